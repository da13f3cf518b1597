"""The memory-error sections of `nvidia-smi -q` (`-d ECC,PAGE_RETIREMENT,ROW_REMAPPER`).

A card that must be reset before its memory is trusted says so here, in words
no `--query-gpu` field of older drivers has:

    GPU 00000000:83:00.0
        Retired Pages
            Single Bit ECC                 : N/A
            Double Bit ECC                 : N/A
            Pending Page Blacklist         : N/A      (older drivers: "Pending : Yes")
        Remapped Rows
            Correctable Error              : 0
            Uncorrectable Error            : 4
            Pending                        : Yes
            Remapping Failure Occurred     : No

Sections nest by indentation; pastes turn nvidia-smi's spaces into tabs or
fewer spaces, so only the order of indents counts. "N/A" (a card without page
retirement, Hopper's "Pending Page Blacklist") stays unknown. A fragment
without its `GPU <bus id>` line is filed under None.
"""

from __future__ import annotations

import re

import attrs

from llmgw.errors import ParseError

_GPU = re.compile(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_FIELD = re.compile(r"^(?P<key>[^:]+?)\s*:\s*(?P<value>.*?)\s*$")


@attrs.frozen
class MemoryErrors:
    """One card's memory-error state; None: not said (N/A, an older driver, a section absent)."""

    remap_pending: bool | None = None  # rows wait for a reset to be remapped
    remap_failed: bool | None = None  # a row could not be remapped: the card cannot hide it
    retired_pending: bool | None = None  # pages wait for a reset to be retired


def _yes_no(value: str) -> bool | None:
    v = value.strip().lower()
    return True if v == "yes" else False if v == "no" else None


def parse_smi_q_memory(
    text: str, *, source: str = "nvidia-smi -q"
) -> dict[str | None, MemoryErrors]:
    """Bus id as printed (`00000000:83:00.0`, or None for a fragment) -> its state.

    Raises ParseError when the text holds neither a `Retired Pages` nor a `Remapped
    Rows` section: that is not this command's output."""
    found: dict[str | None, dict[str, bool | None]] = {}
    gpu: str | None = None
    stack: list[tuple[int, str]] = []  # (indent, section header)
    for raw in text.splitlines():
        line = raw.expandtabs(4).rstrip()
        if not line.strip():
            continue
        m = _GPU.match(line)
        if m is not None:
            gpu, stack = m.group(1), []
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        body = line.strip()
        field = _FIELD.match(body)
        if field is None:
            stack.append((indent, body))
            continue
        section = stack[-1][1] if stack else ""
        key, value = field.group("key").strip(), field.group("value")
        if section == "Remapped Rows":
            entry = found.setdefault(gpu, {})
            if key == "Pending":
                entry["remap_pending"] = _yes_no(value)
            elif key == "Remapping Failure Occurred":
                entry["remap_failed"] = _yes_no(value)
        elif section == "Retired Pages":
            entry = found.setdefault(gpu, {})
            if key in ("Pending", "Pending Page Blacklist"):
                entry["retired_pending"] = _yes_no(value)
    if not found:
        raise ParseError(source, "no 'Retired Pages' or 'Remapped Rows' section")
    return {bus: MemoryErrors(**fields) for bus, fields in found.items()}
