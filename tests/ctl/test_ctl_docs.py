"""The docs and `llmgw ctl` name the same commands.

Every `llmgw ctl X [Y]` the docs and the README write must be a command the CLI
has (an operator copies it), and every command the CLI has must be written
somewhere in docs/operations.md (or nobody finds it).
"""

from __future__ import annotations

import re

import pytest
from helpers import REPO

from llmgw.ctl import main

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Any run of whitespace between the words: a mention wrapped over a line break
# (`llmgw ctl\n  node-logs`) is a mention too.
MENTION = re.compile(r"llmgw\s+ctl\s+([a-z][a-z-]*)(?:[ \t]*\n?[ \t]*\b([a-z][a-z-]*)\b(?![-.:]))?")


def test_a_mention_wrapped_over_a_line_break_is_read() -> None:
    text = (
        "The agent keeps its own ring (`llmgw ctl\n  node-logs`); see `llmgw\nctl nodes\n  forget`."
    )
    assert MENTION.findall(text) == [("node-logs", ""), ("nodes", "forget")]


def choices(argv: list[str], capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The sub-commands `llmgw ctl ARGV --help` offers (empty when it has none)."""
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out.split("\n\n", 1)[0]
    found = re.search(r"\{([a-z,-]+)\}", usage)
    return set(found.group(1).split(",")) if found else set()


def test_every_command_the_docs_write_exists_and_every_command_is_documented(
    capsys: pytest.CaptureFixture[str],
) -> None:
    commands = choices([], capsys)
    assert {"nodes", "replicas", "keys", "onboard"} <= commands
    subcommands = {c: choices([c], capsys) for c in commands}
    unknown = []
    for doc in DOCS:
        for command, word in MENTION.findall(doc.read_text()):
            where = f"{doc.relative_to(REPO)}: llmgw ctl {command} {word}".rstrip()
            if command not in commands:
                unknown.append(where)
            elif word and subcommands[command] and word not in subcommands[command]:
                unknown.append(where)  # a command with sub-commands takes one first
    assert unknown == []
    operations = (REPO / "docs" / "operations.md").read_text()
    written = {c for c, _ in MENTION.findall(operations)}
    assert commands - written == set(), "commands docs/operations.md never shows"
