from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import llama_server_binary

from llmgw.core import MARKER, cache_name


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
    # The model came from the control plane's mirror (`mirror:/tiny/`, a split GGUF):
    # each part downloaded once, by demo-a, into one cache entry of its weights directory.
    demo = tmp_path / "demo"
    parts = ["tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"]
    assert sorted(p.name for p in (demo / "mirror" / "tiny").iterdir()) == parts
    assert json.loads((demo / "server.yaml").read_text())["models"][0]["source"] == "mirror:/tiny/"
    entries = list((demo / "demo-a-weights").iterdir())
    assert [e.name for e in entries] == [cache_name("mirror:/tiny/")]
    assert sorted(p.name for p in entries[0].iterdir()) == sorted([*parts, MARKER])
    assert not any((demo / "demo-b-weights").iterdir())
    log = (demo / "cp.log").read_text()
    for part in parts:
        assert log.count(f"llmgw.cp.mirror: GET '/tiny/{part}' 200 ") == 1, log
    assert f"{demo.resolve() / 'mirror' / 'tiny'}, served by the" in done.stdout
    # Nothing left running.
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "demo")], capture_output=True)
    assert left.stdout == b""
