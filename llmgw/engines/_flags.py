"""Does an engine's `--help` list every flag llmgw would pass it?

Engines rename flags between versions, so llmgw checks its command lines
against the installed engine's own help, on word boundaries: a flag matches
only where it is not preceded or followed by a letter, digit, `_` or `-`, so
`--port` is not found inside `--port-range` or `--port_x`, and `--tp` is not
found inside `--tp-size`. `--flag=value` in the command is checked as `--flag`.

Negations: argparse's BooleanOptionalAction prints `--jinja, --no-jinja` and
click prints `--jinja / --no-jinja`, so `--no-jinja` is usually listed
literally; some tools print `--[no-]jinja`, which also counts. A bare
`--jinja` does NOT make `--no-jinja` present: old llama-server builds had
`--jinja` and no negation, and passing `--no-jinja` to them fails.

Only long flags are checked: single-dash options are ambiguous with the
program's own (`python3 -m`), and llmgw writes long spellings for this reason.

A help text that looks cut short gets warnings, so that "missing" can be
weighed (heuristics, each cheap and each documented in `help_warnings`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from llmgw.engines._common import flags_in
from llmgw.engines._types import FlagCheck

_EDGE = "A-Za-z0-9_-"
# A whole help is thousands of characters and dozens of options; less than
# this is a fragment (a pipe closed early, a capped log line, a summary view).
MIN_HELP_CHARS = 200
MIN_OPTIONS = 10
_OPTION = re.compile(rf"(?<![{_EDGE}])--[A-Za-z0-9][{_EDGE}]*")
_HELP_FLAG = re.compile(rf"(?<![{_EDGE}])(?:--help|-h)(?![{_EDGE}])")
_MARKER = re.compile(r"(\.\.\.|…|\btruncated\b|<snip>|\bsnip\b)[\s\])>]*$", re.IGNORECASE)


def check_flags(help_text: str, argv: Sequence[str]) -> FlagCheck:
    """Which long flags of `argv` the help does not list, and doubts about the help."""
    missing = tuple(flag for flag in flags_in(argv) if not _listed(help_text, flag))
    warnings = help_warnings(help_text)
    if missing and "--help=all" in help_text:
        warnings += (
            "the help mentions --help=all, so it may be a summary: check against the "
            "full listing (vllm serve --help=all)",
        )
    return FlagCheck(missing=missing, warnings=warnings)


def _listed(help_text: str, flag: str) -> bool:
    if re.search(rf"(?<![{_EDGE}]){re.escape(flag)}(?![{_EDGE}])", help_text):
        return True
    if flag.startswith("--no-") and len(flag) > 5:
        stem = re.escape(flag[len("--no-") :])
        return re.search(rf"(?<![{_EDGE}])--\[no-\]{stem}(?![{_EDGE}])", help_text) is not None
    return False


def help_warnings(help_text: str) -> tuple[str, ...]:
    """Reasons to think `help_text` is not the engine's whole help.

    Pass the output as captured, untrimmed. Heuristics:
    - fewer than MIN_HELP_CHARS characters;
    - no `--help` or `-h` anywhere (every argparse, click and llama.cpp help
      lists its own help flag; its absence means the start is missing or this
      is not a help at all);
    - fewer than MIN_OPTIONS distinct long options;
    - the text does not end with a newline (cut off mid-line);
    - the last non-empty line ends with a truncation marker: "...", "…",
      "truncated", "<snip>" (closing brackets after it allowed).
    """
    warnings: list[str] = []
    stripped = help_text.strip()
    if len(stripped) < MIN_HELP_CHARS:
        warnings.append(f"the help is only {len(stripped)} characters long; it looks cut short")
    if not _HELP_FLAG.search(help_text):
        warnings.append(
            "the help never mentions --help or -h; its start may be missing, "
            "or it is not the engine's help"
        )
    options = len(set(_OPTION.findall(help_text)))
    if options < MIN_OPTIONS:
        warnings.append(
            f"the help lists only {options} long options; an engine lists dozens, "
            "so it may be cut short"
        )
    if stripped and not help_text.endswith("\n"):
        warnings.append("the help does not end with a newline; it may be cut off mid-line")
    lines = [line for line in help_text.splitlines() if line.strip()]
    if lines:
        marker = _MARKER.search(lines[-1])
        if marker:
            warnings.append(
                f"the help ends with {marker.group(1)!r}, which looks like a truncation marker"
            )
    return tuple(warnings)
