"""A process and its descendants, as psutil sees them: what the agent counts as one
engine's (its process group) and as llmgw's own (on the cards' process lists)."""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def process_tree(pids: Iterable[int]) -> frozenset[int]:
    """`pids` and every live descendant of theirs (children, grandchildren, ...).

    A pid that is gone stays in the set: it names nothing else until reused,
    and the caller's record of it is what it is.
    """
    pids = list(pids)
    return frozenset(pids) | {p.pid for p in process_group(pids)}


def process_group(pids: Iterable[int]) -> list[psutil.Process]:
    """The given processes and all their descendants, once each."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            kids = proc.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for p in (proc, *kids):
            found.setdefault(p.pid, p)
    return list(found.values())
