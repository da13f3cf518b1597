"""The agent's own log in memory, and following a shard's output file (llmgw/agent/_logs.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent._logs import MEMORY_LINES, FileFollower, MemoryLog


def memory_logger(name: str, capacity: int = MEMORY_LINES) -> tuple[logging.Logger, MemoryLog]:
    handler = MemoryLog(capacity)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, handler


def test_the_agent_keeps_its_last_2000_lines_as_formatted() -> None:
    logger, memory = memory_logger("llmgw.test.memory.bound")
    for i in range(2500):
        logger.info("line %d", i)
    position, lines = memory.tail(5000)
    assert position == 2500
    assert len(lines) == MEMORY_LINES == 2000
    assert lines[0] == "INFO llmgw.test.memory.bound: line 500"
    assert lines[-1] == "INFO llmgw.test.memory.bound: line 2499"
    assert memory.tail(3)[1] == [
        f"INFO llmgw.test.memory.bound: line {i}" for i in (2497, 2498, 2499)
    ]
    # A follower gets what came after its position, and no more than is held.
    logger.warning("after")
    assert memory.since(position) == (2501, ["WARNING llmgw.test.memory.bound: after"])
    assert memory.since(2501) == (2501, [])
    behind, held = memory.since(0)
    assert behind == 2501 and len(held) == 2000 and held[0].endswith("line 501")


@given(
    capacity=st.integers(1, 20),
    messages=st.lists(st.text(st.sampled_from("ab\n"), max_size=6), max_size=40),
    start=st.integers(0, 40),
)
def test_memory_holds_the_last_lines_and_since_returns_exactly_the_new_ones(
    capacity: int, messages: list[str], start: int
) -> None:
    logger, memory = memory_logger("llmgw.test.memory.prop", capacity)
    logger.handlers[0].setFormatter(logging.Formatter("%(message)s"))
    start = min(start, len(messages))
    for message in messages[:start]:
        logger.info("%s", message)
    position, _ = memory.tail(1)
    for message in messages[start:]:
        logger.info("%s", message)
    every = [line for m in messages for line in (m.splitlines() or [""])]
    after = [line for m in messages[start:] for line in (m.splitlines() or [""])]
    assert memory.tail(capacity + 5) == (len(every), every[-capacity:])
    assert memory.since(position) == (len(every), after[-capacity:] if after else [])


def test_a_follower_reads_complete_new_lines_and_starts_again_after_a_truncate(
    tmp_path: Path,
) -> None:
    path = tmp_path / "engine.stdout.log"
    path.write_text("old 1\nold 2\n")
    follower = FileFollower(path)
    assert follower.read() == []  # it starts at the end: the tail is read apart
    with open(path, "a") as f:
        f.write("new 1\nhalf")
    assert follower.read() == ["new 1"]  # a line without its newline waits
    with open(path, "a") as f:
        f.write(" done\r\n")
    assert follower.read() == ["half done"]
    assert follower.read() == []
    # Cut back in place (the supervisor's _cut_logs): shorter than where it was read to.
    with open(path, "r+") as f:
        f.truncate(0)
        f.write("[cut]\nkept\n")
    assert follower.read() == ["[cut]", "kept"]
    # Replaced by another file (another inode) longer than the old one: from its top.
    other = tmp_path / "other"
    other.write_text("r1\nr2\nr3\nr4\nr5\nr6\n")
    os.replace(other, path)
    assert follower.read() == ["r1", "r2", "r3", "r4", "r5", "r6"]


def test_a_follower_of_a_file_not_there_yet_reads_it_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.stderr.log"
    follower = FileFollower(path)
    assert follower.read() == []
    path.write_text("first\nsecond\n")
    assert follower.read() == ["first", "second"]
    path.unlink()
    assert follower.read() == []
