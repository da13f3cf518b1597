"""How `ctl replicas` prints a last failure under its replica."""

from __future__ import annotations

from pathlib import Path

from llmgw.ctl._tables import format_failure, table, with_notes

FAILURE = {
    "at": 1000.0,
    "kind": "shard-failed",
    "reason": "engine (pid 7) was killed by SIGKILL",
    "lines": [f"[stdout] line {i}" for i in range(8)],
    "node_id": "cpu-1",
    "shard_id": "tiny-aaaaaa.0",
    "replica_id": "tiny-aaaaaa",
    "model_name": "tiny",
}


def test_a_replacement_names_its_predecessor_and_the_last_lines() -> None:
    lines = format_failure(FAILURE, "tiny-bbbbbb", now=1042.0, lines=3)
    assert lines == [
        "  replaces tiny-aaaaaa, failed 42s ago on cpu-1 (shard tiny-aaaaaa.0): "
        "engine (pid 7) was killed by SIGKILL",
        "      [stdout] line 5",
        "      [stdout] line 6",
        "      [stdout] line 7",
    ]


def test_its_own_failure_and_no_lines() -> None:
    lines = format_failure({**FAILURE, "node_id": None}, "tiny-aaaaaa", now=1000.0 + 600, lines=0)
    assert lines == [
        "  last failure 10m ago (shard tiny-aaaaaa.0): engine (pid 7) was killed by SIGKILL"
    ]


def test_notes_go_under_their_row() -> None:
    text = table(("A", "B"), [("x", "1"), ("y", "2")])
    out = with_notes(text, {0: ["  note for x"]}).splitlines()
    assert out == ["A  B", "x  1", "  note for x", "y  2"]


def test_a_reader_that_stops_reading_gets_no_traceback(tmp_path: Path) -> None:
    """`llmgw ctl tenants list | grep -q team-a` under `set -o pipefail`: grep exits at
    its first match and the pipe closes; ctl printed a BrokenPipeError traceback and
    exited 1 (the runbook's postgres block failed on it)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before ctl writes its first line
    try:
        done = subprocess.run(
            [sys.executable, "-m", "llmgw", "ctl", "cert", "init", "--dir", str(tmp_path / "pki")],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert (tmp_path / "pki" / "ca.crt").exists()  # the command itself ran
    assert (done.returncode, done.stderr) == (0, "")
