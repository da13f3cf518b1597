"""Issue 12 with real processes: weights from the control plane's mirror, fetched once per
node, served by the real llama-server; and a fetch's progress in `ctl replicas`.

The control plane's mirror access log (logger "llmgw.cp.mirror", one INFO line per
answered request, in cp.log) counts the downloads.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ThrottlingProxy, llama_server_binary, slow_file_server

from llmgw.core import MARKER, cache_name, is_cache_name
from llmgw.testing import fake_engine, tiny_gguf
from llmgw.testing.cluster import LocalCluster, wait_for

pytestmark = pytest.mark.slow

PARTS = ("tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf")


def _cache_entries(weights_dir: Path) -> list[str]:
    """The cache entries a node holds (an unmarked or .partial entry is not one)."""
    if not weights_dir.is_dir():
        return []
    return sorted(p.name for p in weights_dir.iterdir() if is_cache_name(p.name))


def _downloads(cluster: LocalCluster, name: str) -> list[str]:
    """The mirror's access-log lines of GETs of `name` answered 200 or 206."""
    pattern = re.compile(rf"llmgw\.cp\.mirror: GET '/tiny/{re.escape(name)}' (200|206) ")
    return [line for line in cluster.root.joinpath("cp.log").read_text().splitlines()
            if pattern.search(line)]  # fmt: skip


def _chat(base: str, headers: dict[str, str] | None = None, model: str = "tiny") -> Any:
    r = httpx.post(
        base + "/chat/completions",
        headers=headers or {},
        json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_split_gguf_from_the_mirror_fetched_once_and_served_by_two_shards(
    cluster: LocalCluster,
) -> None:
    binary = llama_server_binary()
    cluster.mirror_dir = cluster.root / "mirror"
    tiny_gguf.write(cluster.mirror_dir / "tiny" / "tiny.gguf", parts=2)
    assert sorted(p.name for p in (cluster.mirror_dir / "tiny").iterdir()) == list(PARTS)
    cluster.models = [
        {
            "name": "tiny",
            "source": "mirror:/tiny/",
            "replicas": 2,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "node_selector": {"weights": "here"},
                    "engine_args": ["--ctx-size", "512", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.setup(["node-a", "node-b"])
    # Both could run it; the selector pins both replicas to node-a.
    cluster.write_agent_config(
        "node-a", engine_paths={"llama-server": binary}, labels={"weights": "here"}
    )
    cluster.write_agent_config("node-b", engine_paths={"llama-server": binary})
    cluster.start_cp()
    cluster.start_agent("node-a")
    cluster.start_agent("node-b")

    def two_ready() -> list[dict[str, Any]] | None:
        shards = [s for n in cluster.nodes().values() for s in n["shards"]]
        failed = [s for s in shards if s["state"] == "failed"]
        if failed:
            raise AssertionError(f"a shard failed: {failed[0].get('reason')}")
        ready = [s for s in shards if s["state"] == "ready"]
        return ready if len(ready) == 2 else None

    wait_for("two ready shards of tiny", two_ready, 180)
    nodes = cluster.nodes()
    assert [s["state"] for s in nodes["node-a"]["shards"]] == ["ready", "ready"]
    assert nodes["node-b"]["shards"] == []

    # One download: each part GET'ed once, into one cache entry, on node-a only.
    for name in PARTS:
        assert len(_downloads(cluster, name)) == 1, (name, _downloads(cluster, name))
    entries = _cache_entries(cluster.root / "node-a-weights")
    assert entries == [cache_name("mirror:/tiny/")]
    entry = cluster.root / "node-a-weights" / entries[0]
    assert sorted(p.name for p in entry.iterdir()) == sorted([*PARTS, MARKER])
    for name in PARTS:
        assert (entry / name).read_bytes() == (cluster.mirror_dir / "tiny" / name).read_bytes()
    assert _cache_entries(cluster.root / "node-b-weights") == []

    # Both shards serve: each real llama-server on its own port, and the router.
    ports = sorted(s["port"] for s in nodes["node-a"]["shards"])
    assert len(set(ports)) == 2
    for port in ports:
        done = _chat(f"http://127.0.0.1:{port}/v1")
        assert done["usage"]["completion_tokens"] >= 1
    key = cluster.api_key("weights")
    done = _chat(cluster.router_url, {"Authorization": f"Bearer {key}"})
    assert done["choices"][0]["message"]["content"] is not None
    # The engines run the fetched first part (llama.cpp finds the second beside it).
    runs = [json.loads(p.read_text()) for p in (cluster.root / "node-a").glob("shards/*/run.json")]
    argvs = [proc["argv"] for run in runs for proc in run["procs"]]
    assert len(argvs) == 2
    for argv in argvs:
        assert str(entry / PARTS[0]) in argv and "mirror:/tiny/" not in argv, argv


# --- a throttled download and its progress ------------------------------------------------


@pytest.fixture
def throttled_files(tmp_path: Path) -> Iterator[tuple[Path, ThrottlingProxy]]:
    """A plain HTTP file server on loopback behind a throttling proxy (256 KiB/s)."""
    root = tmp_path / "files"
    root.mkdir()
    with slow_file_server(root, 256 * 1024) as proxy:
        yield root, proxy


def _replicas(cluster: LocalCluster) -> list[dict[str, Any]]:
    """`GET /api/v1/replicas`, which `ctl replicas --json` prints as is: read over HTTP
    because it is polled (a ctl process per poll is ~0.4 s of CPU on the suite's two
    cores); the test reads `ctl replicas` itself where its lines are what is checked."""
    return list(cluster.first.api_get("/api/v1/replicas")["replicas"])


@pytest.mark.slow(seconds=25)
def test_progress_in_ctl_replicas_the_startup_timer_and_its_end(
    cluster: LocalCluster, tmp_path: Path, throttled_files: tuple[Path, ThrottlingProxy]
) -> None:
    root, proxy = throttled_files
    # big.bin takes 64 s at 256 KiB/s, longer than its 15 s startup timeout; small.bin 8 s.
    (root / "big.bin").write_bytes(os.urandom(16 << 20))
    (root / "small.bin").write_bytes(os.urandom(2 << 20))
    llama = fake_engine.install(tmp_path / "bin", "llama-server")

    def entry(name: str, timeout_s: float) -> dict[str, Any]:
        return {
            "name": name,
            "source": f"http://127.0.0.1:{proxy.port}/{name}.bin",
            "replicas": 1,
            "profiles": [
                {"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": timeout_s}
            ],
        }

    cluster.models = [entry("big", 15), entry("small", 120)]
    cluster.setup(["n1"])
    cluster.write_agent_config("n1", engine_paths={"llama-server": str(llama)})
    cluster.start_cp()
    cluster.start_agent("n1", env={"LLMGW_FAKE_LOAD_DELAY": "0.2"})
    started = time.monotonic()

    # While they download, a progress line under each replica.
    seen: dict[str, str] = {}

    def both_lines() -> bool:
        for line in cluster.ctl("replicas").stdout.splitlines():
            for name in ("big.bin", "small.bin"):
                if f"downloading {name} " in line:
                    seen.setdefault(name, line.strip())
        return set(seen) == {"big.bin", "small.bin"}

    wait_for("`downloading big.bin` and `downloading small.bin` in ctl replicas", both_lines, 30)
    # The length is known (Content-Length): an amount of a total and a percentage.
    assert re.match(r"downloading big\.bin [\d.]+/16(\.0)? MiB \(\d{1,2} %\)", seen["big.bin"]), (
        seen
    )

    # small.bin finishes: ready, and its line is gone.
    def small_ready() -> str | None:
        rows = {r["model"]: r for r in _replicas(cluster)}
        if rows.get("small", {}).get("state") != "ready":
            return None
        return cluster.ctl("replicas").stdout

    text = wait_for("small ready", small_ready, 60)
    assert "downloading small.bin" not in text, text
    entry = cluster.root / "n1-weights" / cache_name(f"http://127.0.0.1:{proxy.port}/small.bin")
    assert (entry / "small.bin").read_bytes() == (root / "small.bin").read_bytes()

    # big.bin reports progress all along, and is still ended at its startup timeout.
    def timed_out() -> str | None:
        # Polled: the events over HTTP, as `ctl events --json --limit 1000` prints them.
        for e in cluster.first.api_get("/api/v1/events?limit=1000")["events"]:
            if "startup timeout of 15 s" in (e["message"] or ""):
                return str(e["message"])
        return None

    message = wait_for("big ended by its startup timeout", timed_out, 60)
    assert time.monotonic() - started < 64  # before its download could have finished
    assert "not ready within its startup timeout of 15 s" in message
    # Its replacement downloads again (or resumes): its line is back, never ready yet.
    rows = {r["model"]: r for r in _replicas(cluster)}
    assert rows["big"]["state"] != "ready"
