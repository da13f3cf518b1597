"""Placement knows each source's size and who holds it (issue 12).

First the pure parts: what `node_facts` says a node holds and has free, the
weights key of each kind of source, and the reconciler refusing and preferring
with a size from `sizes`. Then the same through the real service path: a real
llmgw-cp with its mirror, two real agents and the fake llama-server.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import register

from llmgw import core, model
from llmgw.core import node_facts, placement_profile, weights_key
from llmgw.cp._fleet._catalog import Catalog, parse
from llmgw.cp._fleet._placing import Unplaced
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._wake import Wakeup
from llmgw.cp._weights._sizes import MEASURING, SourceSizes
from llmgw.testing import fake_engine
from llmgw.testing.cluster import LocalCluster, wait_for

GIB = 2**30
MIRROR = "mirror:/huge.gguf"
CACHE = core.cache_name(MIRROR)


def inventory(
    node: str,
    *,
    weights_dir: str | None,
    files: tuple[str, ...] = (),
    filesystems: tuple[model.Filesystem, ...] = (),
) -> model.Inventory:
    weights = model.Weights(
        fingerprint="f", files=tuple(model.WeightFile(p, 1) for p in files), dir=weights_dir
    )
    return model.Inventory(
        model.Host(node), usage=model.Usage(filesystems=filesystems), weights=weights
    )


def fs(mount: str, paths: tuple[str, ...], free_gib: float, *, shared: bool = False) -> Any:
    return model.Filesystem(mount, "nfs4" if shared else "ext4", paths, 1 << 50,
                            int(free_gib * GIB), shared)  # fmt: skip


# --- node_facts: what a node holds and has free -------------------------------------------


async def test_node_facts_holds_cache_names_and_local_paths() -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    other = core.cache_name("mirror:/other/")
    files = (
        f"/w/{CACHE}/huge.gguf",
        f"/w/{other}/part-1.gguf",
        f"/w/{other}/part-2.gguf",
        "/w/operator/own.gguf",  # an operator's file: held as a local path, no cache name
        "/w/src-nothex/x.gguf",  # not a cache name
        "/models/tiny.gguf",
    )
    await register(registry, "a", inventory=inventory("a", weights_dir="/w/", files=files))
    rec = registry.record("a")
    assert rec is not None
    held = node_facts(rec).weights
    assert {CACHE, other} <= held
    assert "src-nothex" not in held
    assert {"/models/tiny.gguf", "/models", "/w/operator/own.gguf", "/w/operator"} <= held
    # Without Weights.dir nothing is a cache entry: only local paths.
    await register(registry, "b", inventory=inventory("b", weights_dir=None, files=files))
    rec_b = registry.record("b")
    assert rec_b is not None
    assert CACHE not in node_facts(rec_b).weights
    assert "/models/tiny.gguf" in node_facts(rec_b).weights


async def test_node_facts_disk_is_the_weights_filesystems() -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    roomy_root = fs("/", ("/var/lib/llmgw",), 500)
    weights_fs = fs("/data", ("/data/w",), 12)
    await register(registry, "a", inventory=inventory(
        "a", weights_dir="/data/w", filesystems=(roomy_root, weights_fs)))  # fmt: skip
    # A shared filesystem holding the weights dir counts too: it is where a fetch writes.
    filer = fs("/filer", ("/filer/w",), 3, shared=True)
    await register(registry, "b", inventory=inventory(
        "b", weights_dir="/filer/w", filesystems=(roomy_root, filer)))  # fmt: skip
    # No Weights.dir (an older agent), or one no filesystem names: as before, the
    # largest free of the node's own filesystems.
    await register(registry, "c", inventory=inventory(
        "c", weights_dir=None, filesystems=(roomy_root, weights_fs)))  # fmt: skip
    await register(registry, "d", inventory=inventory(
        "d", weights_dir="/elsewhere", filesystems=(roomy_root, weights_fs, filer)))  # fmt: skip
    facts = {}
    for node in "abcd":
        rec = registry.record(node)
        assert rec is not None
        facts[node] = node_facts(rec)
    assert (facts["a"].disk_free_bytes, facts["a"].weights_dir) == (12 * GIB, "/data/w")
    assert (facts["b"].disk_free_bytes, facts["b"].weights_dir) == (3 * GIB, "/filer/w")
    assert (facts["c"].disk_free_bytes, facts["c"].weights_dir) == (500 * GIB, None)
    assert (facts["d"].disk_free_bytes, facts["d"].weights_dir) == (500 * GIB, "/elsewhere")


# --- the weights key and the profile -------------------------------------------------------


def catalog(source: str) -> Catalog:
    return parse(
        {
            "models": [
                {
                    "name": "big",
                    "source": source,
                    "replicas": 1,
                    "profiles": [{"engine": "llama-server", "gpus_per_node": 0}],
                }
            ]
        },
        "server.yaml",
    )


@pytest.mark.parametrize(
    ("source", "key", "sized"),
    [
        ("mirror:/huge.gguf", core.cache_name("mirror:/huge.gguf"), True),
        ("mirror:/tiny/", core.cache_name("mirror:/tiny/"), True),
        ("https://files.example/m.gguf", core.cache_name("https://files.example/m.gguf"), True),
        ("http://files.example/v1/", core.cache_name("http://files.example/v1/"), True),
        ("/models/tiny.gguf", "/models/tiny.gguf", False),
        ("./models/tiny.gguf", "./models/tiny.gguf", False),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", False),
    ],
)
def test_the_placement_key_and_size_per_source_kind(source: str, key: str, sized: bool) -> None:
    assert weights_key(source) == key
    m = catalog(source).models[0]
    p = placement_profile(m, m.profiles[0], 15 * GIB)
    assert p.model == key
    # A local path or a hub id has nothing to fetch: never refused for disk.
    assert p.weights_bytes == (15 * GIB if sized else None)


# --- the reconciler: sizes in, refusal and holder out --------------------------------------


async def test_the_reconciler_refuses_short_disks_and_places_on_the_holder() -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    sizes: dict[str, int] = {}
    reconciler = Reconciler(registry, lambda: catalog(MIRROR), sizes=sizes.get)
    for node in ("a", "b"):
        filesystems = (fs("/", (f"/{node}/w",), 12),)
        await register(registry, node, inventory=inventory(
            node, weights_dir=f"/{node}/w", filesystems=filesystems))  # fmt: skip
    m = catalog(MIRROR).models[0]
    # Size unknown: placed (unknown never refuses).
    assert not isinstance(reconciler.try_place(m), Unplaced)
    sizes[MIRROR] = 15 * GIB
    assert reconciler.try_place(m) == Unplaced(
        "big",
        ("a: has 12 GB free on /a/w, needs 15 GB", "b: has 12 GB free on /b/w, needs 15 GB"),
    )
    # b holds it (a complete cache entry): placed there, despite its disk.
    filesystems = (fs("/", ("/b/w",), 12),)
    await register(registry, "b", inventory=inventory(
        "b", weights_dir="/b/w", files=(f"/b/w/{CACHE}/huge.gguf",),
        filesystems=filesystems))  # fmt: skip
    placed = reconciler.try_place(m)
    assert not isinstance(placed, Unplaced), placed
    assert placed[1].node_ids == ("b",)
    # With room on a as well, the holder is still preferred.
    await register(registry, "a", inventory=inventory(
        "a", weights_dir="/a/w", filesystems=(fs("/", ("/a/w",), 100),)))  # fmt: skip
    placed = reconciler.try_place(m)
    assert not isinstance(placed, Unplaced), placed
    assert placed[1].node_ids == ("b",)


class StartingAgent:
    """An agent's capability that records every start it is sent (and answers none)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.started: list[model.ShardSpec] = []

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.started.append(spec)
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    def release(self) -> None:
        pass


async def test_nothing_is_started_before_its_size_is_measured(tmp_path: Path) -> None:
    """The catalog names a source the size task has not measured yet: no pass places it
    (a start would fetch 8 TiB onto a 12 GB disk); the round that measures it pokes the
    reconciler, which then refuses it for disk, having started nothing."""
    sparse(tmp_path / "mirror" / "huge.gguf", HUGE)
    wake = Wakeup()  # made first: the sizes poke it, the reconciler waits on it
    registry = NodeRegistry(core.LivenessPolicy())
    sizes = SourceSizes(lambda: [MIRROR], tmp_path / "mirror", on_change=wake.poke)
    reconciler = Reconciler(
        registry, lambda: catalog(MIRROR), interval_s=0.05, settle_s=0, sizes=sizes, wake=wake
    )
    agent = StartingAgent("a")
    filesystems = (fs("/", ("/a/w",), 12),)
    await register(registry, "a", agent=agent,  # type: ignore[arg-type]
                   inventory=inventory("a", weights_dir="/a/w", filesystems=filesystems))  # fmt: skip
    assert sizes(MIRROR) is MEASURING
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await nursery.start(reconciler.run)
        passes = reconciler.statistics()["passes"]
        with trio.fail_after(30):
            while reconciler.statistics()["passes"] < passes + 5:
                await trio.sleep(0.05)
        assert agent.started == [] and reconciler.unplaced() == []
        async with sizes.client() as client:
            await sizes.refresh(client)
        assert sizes(MIRROR) == HUGE
        with trio.fail_after(30):
            while not reconciler.unplaced():
                await trio.sleep(0.05)
        assert reconciler.unplaced() == [
            Unplaced("big", ("a: has 12 GB free on /a/w, needs 8192 GB",))
        ]
        assert agent.started == []
        nursery.cancel_scope.cancel()


# --- through the real service path ---------------------------------------------------------

TIMEOUT = 60
HUGE = 8 << 40  # 8 TiB, sparse (ext4 allows 16 TiB at most): only ever stat'ed
BIG = {
    "name": "big",
    "source": MIRROR,
    "replicas": 1,
    "profiles": [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 30}],
}


def sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def write_marker(directory: Path, sizes: list[tuple[str, int]]) -> None:
    """The completion marker exactly as llmgw/agent/_fetch.py `_write_marker` writes it."""
    body = json.dumps({"files": [{"name": n, "size": s} for n, s in sizes]}).encode()
    (directory / core.MARKER).write_bytes(body)


def rows(cluster: LocalCluster) -> list[dict[str, Any]]:
    """big's rows of `GET /api/v1/replicas` (what `ctl replicas --json` prints as is), read
    over HTTP because they are polled (a ctl process per poll is ~0.4 s of CPU on the
    suite's two cores); `ctl status --json` is read through the ctl below."""
    return [r for r in cluster.first.api_get("/api/v1/replicas")["replicas"] if r["model"] == "big"]


def reported_weights_dir(cluster: LocalCluster, node: str) -> str | None:
    n = cluster.nodes().get(node)
    if n is None or n.get("state") != "ready":
        return None
    weights = (n.get("inventory") or {}).get("weights") or {}
    return weights.get("dir")


@pytest.mark.slow
def test_placement_refuses_a_short_disk_and_places_on_the_holder(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.mirror_dir = cluster.root / "mirror"
    sparse(cluster.mirror_dir / "huge.gguf", HUGE)
    cluster.models = []  # the model comes once both nodes report where their weights go
    cluster.setup(["node-a", "node-b"])
    for node in ("node-a", "node-b"):
        cluster.write_agent_config(node, engine_paths={"llama-server": str(llama)})
    cluster.start_cp()
    for node in ("node-a", "node-b"):
        cluster.start_agent(node)
    dirs = {n: os.path.realpath(cluster.root / f"{n}-weights") for n in ("node-a", "node-b")}
    wait_for(
        "both nodes report their weights dir",
        lambda: all(reported_weights_dir(cluster, n) == d for n, d in dirs.items()),
        TIMEOUT,
    )
    cluster.write_server_config([BIG])  # the control plane reloads its catalog

    # No holder, no room (8 TiB): unplaced, each node refused naming its weights dir.
    def refused() -> list[str] | None:
        unplaced = [r for r in rows(cluster) if r["state"] == "unplaced"]
        lines = unplaced[0]["reason"].splitlines() if unplaced else []
        shapes = [
            re.compile(rf"{n}: has \d+(\.\d)? GB free on {re.escape(d)}, needs 8192 GB")
            for n, d in dirs.items()
        ]
        ok = len(lines) == 2 and all(s.fullmatch(x) for s, x in zip(shapes, lines, strict=True))
        return lines if ok else None

    lines = wait_for("big unplaced for lack of disk on both nodes", refused, TIMEOUT)
    assert not [r for r in rows(cluster) if r["state"] != "unplaced"], rows(cluster)
    status = json.loads(cluster.ctl("status", "--json").stdout)
    assert [m["unplaced"] for m in status["models"] if m["model"] == "big"] == [True], status
    assert lines[0].startswith("node-a: has ")

    # node-b holds it: a complete cache entry, written before its agent starts again.
    cluster.agents["node-b"].terminate()
    entry = Path(dirs["node-b"]) / CACHE
    sparse(entry / "huge.gguf", HUGE)
    write_marker(entry, [("huge.gguf", HUGE)])
    before = os.stat(entry / "huge.gguf")
    cluster.start_agent("node-b")

    def ready() -> dict[str, Any] | None:
        mine = rows(cluster)
        return mine[0] if len(mine) == 1 and mine[0]["state"] == "ready" else None

    row = wait_for("big ready on node-b, the holder", ready, TIMEOUT)
    assert row["nodes"] == ["node-b"], row
    # Nothing was fetched: the entry is as it was written (sparse, untouched), nothing
    # sits beside it, and the mirror served no byte of it.
    after = os.stat(entry / "huge.gguf")
    assert (after.st_size, after.st_mtime_ns, after.st_blocks) == (
        HUGE, before.st_mtime_ns, before.st_blocks)  # fmt: skip
    assert sorted(p.name for p in entry.iterdir()) == [core.MARKER, "huge.gguf"]
    assert cluster.cp is not None
    log = cluster.cp.output()
    assert f"{MIRROR}: {HUGE} bytes" in log  # the size, learned from the mirror's disk
    assert "GET '/huge.gguf'" not in log and "HEAD '/huge.gguf'" not in log
