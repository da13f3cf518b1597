from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import llama_server_binary


@pytest.mark.slow
def test_demo_shows_two_ready_nodes_and_stops(tmp_path: Path) -> None:
    llama_server_binary()
    done = subprocess.run(
        [sys.executable, "-m", "llmgw.demo", "--check", "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = [line.split() for line in done.stdout.splitlines() if line.startswith("demo-")]
    assert [(row[0], row[1]) for row in table] == [("demo-a", "ready"), ("demo-b", "ready")]
    assert "LLMGW_ADMIN_KEY" in done.stdout and "stopped" in done.stdout
    # A real llama-server, placed from the catalog, answered the printed curl to the router.
    assert "curl -s http://127.0.0.1:" in done.stdout and "/v1/chat/completions" in done.stdout
    # The reply the demo printed (`  -> 'text'`) is a non-empty completion, not only an arrow.
    replies = [
        ast.literal_eval(line.split("-> ", 1)[1])
        for line in done.stdout.splitlines()
        if line.lstrip().startswith("-> ")
    ]
    assert len(replies) == 1, done.stdout
    assert isinstance(replies[0], str) and replies[0].strip(), replies
    assert [row[8] for row in table] == ["1/1", "-"]  # SHARDS: ready/total
    # Nothing left running.
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "demo")], capture_output=True)
    assert left.stdout == b""
