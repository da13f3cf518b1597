"""The admin API on weights (llmgw/cp/_admin/_weights.py, llmgw/cp/_weights/_holdings.py): a starting
replica's download, what each node holds and who wants it, reclaim per node, and what
each fabric holds. Through the real AdminApp as ASGI; the agents are stand-ins that
answer `reclaim` (the real agent's side is tested in tests/ctl/test_ctl_weights.py)."""

from __future__ import annotations

import types
from typing import Any

import attrs
import trio
from helpers import FakeAgent, register
from helpers import asgi_call as asgi
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core, model
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._catalog import Catalog, CatalogModel
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._weights import _holdings
from llmgw.ctl._weights import format_weights
from llmgw.errors import DeadlineExceeded

WD = "/var/lib/llmgw-weights"
QWEN = "mirror:/qwen-7b/"
QWEN_CACHE = core.cache_name(QWEN)
OLD_CACHE = core.cache_name("mirror:/old.gguf")


def _catalog(*pairs: tuple[str, str]) -> Any:
    models = tuple(CatalogModel(name=n, source=s, profiles=[]) for n, s in pairs)
    return types.SimpleNamespace(catalog=Catalog(models=models))


class _Reconciler:
    def __init__(self, views: list[core.ReplicaView]) -> None:
        self.views = views

    def replicas(self) -> list[core.ReplicaView]:
        return list(self.views)

    def unplaced(self) -> list[object]:
        return []

    def backoffs(self) -> dict[str, core.Backoff]:
        return {}

    def statistics(self) -> dict[str, int]:
        return {"passes": 1}

    def count(self, m: Any) -> int:
        return int(m.replicas)

    class priorities:  # the reconciler's attribute, read as one
        @staticmethod
        def why(name: str) -> None:
            return None


class ReclaimingAgent(FakeAgent):
    """Answers reclaim as an agent would for the paths it is told are removable."""

    def __init__(self, node_id: str, removable: dict[str, int], fail: Exception | None = None):
        super().__init__(node_id)
        self.removable = removable
        self.fail = fail
        self.asked: list[tuple[int, tuple[str, ...], bool]] = []

    async def reclaim(self, epoch: int, paths: tuple[str, ...], dry_run: bool) -> model.Reclaimed:
        self.asked.append((epoch, paths, dry_run))
        if self.fail is not None:
            raise self.fail
        ok = [p for p in paths if p in self.removable]
        refused = tuple(
            model.Refusal(p, "not a cache name", f"{p}: not a cache name")
            for p in paths
            if p not in self.removable
        )
        return model.Reclaimed(tuple(ok), sum(self.removable[p] for p in ok), refused)


def _inventory(
    files: list[tuple[str, int]],
    *,
    wd: str | None = WD,
    fabrics: tuple[str, ...] = (),
    filesystems: tuple[model.Filesystem, ...] = (),
    host: str = "h",
) -> model.Inventory:
    return model.Inventory(
        model.Host(host),
        usage=model.Usage(filesystems=filesystems),
        fabrics=tuple(model.Fabric(f, ("mlx5_0",), 200.0) for f in fabrics),
        weights=model.Weights("fp", tuple(model.WeightFile(p, s) for p, s in files), dir=wd),
    )


# --- the pure view --------------------------------------------------------------------


def test_node_weights_sorts_cache_entries_from_an_operators_files() -> None:
    files = [
        (f"{WD}/{QWEN_CACHE}/model-1.safetensors", 600),
        (f"{WD}/{QWEN_CACHE}/model-2.safetensors", 400),
        (f"{WD}/{OLD_CACHE}/old.gguf", 70),
        (f"{WD}/mine.gguf", 5),  # an operator's file
        (f"{WD}/link", 9),  # a symlink to a file elsewhere: the scan lists it as a file
        (f"{WD}/hand/a.bin", 1),  # an operator's directory, named by a local source
        (f"{WD}/hand/b.bin", 2),
        ("/models/tiny.gguf", 30),  # outside the weights directory, named by the catalog
        ("/models/stray.bin", 4),
    ]
    models = [("qwen", QWEN), ("hand", f"{WD}/hand/"), ("tiny", "/models/./tiny.gguf"),
              ("hub", "Qwen/Qwen2.5-7B")]  # fmt: skip
    w = _holdings.node_weights("a", _inventory(files).weights, models)
    held = {h.path: (h.kind, h.size_bytes, h.files, h.wanted_by) for h in w.held}
    assert held == {
        f"{WD}/{QWEN_CACHE}": ("cache", 1000, 2, ("qwen",)),
        f"{WD}/{OLD_CACHE}": ("cache", 70, 1, ()),
        f"{WD}/mine.gguf": ("file", 5, 1, ()),
        f"{WD}/link": ("file", 9, 1, ()),
        f"{WD}/hand": ("dir", 3, 2, ("hand",)),
        "/models/tiny.gguf": ("file", 30, 1, ("tiny",)),
        "/models/stray.bin": ("file", 4, 1, ()),
    }
    # Only an unwanted cache entry is reclaimable: never an operator's file.
    assert w.reclaimable == (core.Reclaimable(f"{WD}/{OLD_CACHE}", 70),)
    assert w.weights_dir == WD and w.reported


def test_a_local_source_pointing_into_a_cache_entry_keeps_it() -> None:
    files = [(f"{WD}/{OLD_CACHE}/old.gguf", 70)]
    w = _holdings.node_weights("a", _inventory(files).weights,
                               [("direct", f"{WD}/{OLD_CACHE}/old.gguf")])  # fmt: skip
    assert w.held[0].wanted_by == ("direct",)
    assert w.reclaimable == ()


def test_an_unreported_or_odd_weights_dir_reclaims_nothing() -> None:
    assert _holdings.node_weights("a", None, []) == _holdings.NodeWeights("a", None, False)
    for odd in (None, "relative/dir", "/var/../etc"):
        files = [(f"/var/lib/llmgw-weights/{OLD_CACHE}/old.gguf", 70)]
        w = _holdings.node_weights("a", _inventory(files, wd=odd).weights, [])
        assert w.weights_dir is None and w.reclaimable == (), odd


def test_fabric_holdings_count_a_shared_file_once() -> None:
    nfs = model.Filesystem("/shared", "nfs4", (), 10**12, 10**11, True)
    disk = model.Filesystem("/", "ext4", (), 10**12, 10**11, False)
    shared = [("/shared/models/tiny.gguf", 100)]
    own = [(f"{WD}/{QWEN_CACHE}/model.gguf", 1000)]
    inventories = {
        "a": _inventory(shared + own, fabrics=("ib0",), filesystems=(nfs, disk)),
        "b": _inventory(shared + own, fabrics=("ib0", "ib1"), filesystems=(nfs, disk)),
        "c": _inventory(own, filesystems=(disk,)),
        "d": _inventory([], fabrics=("ib1",)),
    }
    models = [("tiny", "/shared/models/tiny.gguf"), ("qwen", QWEN), ("hub", "org/x")]
    got = {
        f.fabric: (f.nodes, {m.model: (m.size_bytes, m.nodes) for m in f.models})
        for f in _holdings.fabric_holdings(inventories, models)
    }
    assert got == {
        # The file on the shared filer counts once; each node's own disk counts for each.
        "ib0": (("a", "b"), {"tiny": (100, ("a", "b")), "qwen": (2000, ("a", "b"))}),
        "ib1": (("b", "d"), {"tiny": (100, ("b",)), "qwen": (1000, ("b",))}),
        None: (("c",), {"qwen": (1000, ("c",))}),
    }
    assert [f.fabric for f in _holdings.fabric_holdings(inventories, models)][-1] is None


# --- through the admin app ------------------------------------------------------------


async def test_a_starting_replica_shows_its_nodes_download(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    _agent, _peer, session = await register(registry, "a")
    await register(registry, "b")
    now = trio.current_time()
    views = [
        core.ReplicaView("qwen-1", "qwen", "starting", ("b", "a"), now, False, None),
        core.ReplicaView("qwen-2", "qwen", "ready", ("a",), now, False, None),
        core.ReplicaView("tiny-1", "tiny", "starting", ("a",), now, False, None),
    ]
    app = AdminApp(registry, "key", reconciler=_Reconciler(views),  # type: ignore[arg-type]
                   catalog=_catalog(("qwen", QWEN), ("tiny", "/m/tiny.gguf")))  # fmt: skip
    await session.progress(model.Progress(QWEN, 1000, 4000))
    await trio.sleep(2)
    await session.progress(model.Progress(QWEN, 3000, 4000))
    status, data = await asgi(app, "GET", "/api/v1/replicas")
    assert status == 200
    rows = {r["replica"]: r for r in data["replicas"]}
    p = rows["qwen-1"]["progress"]
    assert p["node"] == "a" and p["source"] == QWEN
    assert (p["done_bytes"], p["total_bytes"], p["rate_bytes_per_s"]) == (3000, 4000, 1000.0)
    assert p["eta_s"] == 1.0
    assert "progress" not in rows["qwen-2"]  # only a starting replica waits on a download
    assert rows["tiny-1"]["progress"] is None  # starting, nothing heard: null, not zeros


async def test_get_weights_lists_each_node() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 1.0, wall=lambda: 2.0)
    files = [(f"{WD}/{QWEN_CACHE}/m.gguf", 1000), (f"{WD}/{OLD_CACHE}/o.gguf", 70),
             (f"{WD}/mine.gguf", 5)]  # fmt: skip
    await register(registry, "a", inventory=_inventory(files))
    await register(registry, "b")  # has sent no weights
    app = AdminApp(registry, "key", catalog=_catalog(("qwen", QWEN)))  # type: ignore[arg-type]
    status, data = await asgi(app, "GET", "/api/v1/weights")
    assert status == 200
    a, b = data["nodes"]
    assert (a["node"], a["weights_dir"], a["connected"], a["reported"]) == ("a", WD, True, True)
    assert [(h["path"], h["kind"], h["size_bytes"], h["wanted_by"]) for h in a["held"]] == [
        (f"{WD}/mine.gguf", "file", 5, []),
        (f"{WD}/{OLD_CACHE}", "cache", 70, []),
        (f"{WD}/{QWEN_CACHE}", "cache", 1000, ["qwen"]),
    ]
    assert a["reclaimable"] == [{"path": f"{WD}/{OLD_CACHE}", "size_bytes": 70}]
    assert a["reclaimable_bytes"] == 70
    assert (b["reported"], b["held"], b["reclaimable"]) == (False, [], [])
    assert b["reclaimable_bytes"] is None  # unknown until reported: absent is not zero


async def test_collect_asks_each_node_and_one_failure_is_that_nodes() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 1.0, wall=lambda: 2.0)
    registry.epoch = 7
    old = f"{WD}/{OLD_CACHE}"
    files = [(f"{old}/o.gguf", 70), (f"{WD}/mine.gguf", 5)]
    a = ReclaimingAgent("a", {old: 70})
    b = ReclaimingAgent("b", {}, fail=DeadlineExceeded("did not answer reclaim in 30 s"))
    c = ReclaimingAgent("c", {})
    await register(registry, "a", inventory=_inventory(files), agent=a)
    await register(registry, "b", inventory=_inventory(files), agent=b)
    await register(registry, "c", inventory=_inventory([]), agent=c)  # nothing to reclaim
    app = AdminApp(registry, "key", catalog=_catalog(("qwen", QWEN)))  # type: ignore[arg-type]

    status, data = await asgi(app, "POST", "/api/v1/weights/collect", {"dry_run": True})
    assert status == 200 and data["dry_run"] is True
    assert a.asked == [(7, (old,), True)] and c.asked == []
    rows = {n["node"]: n for n in data["nodes"]}
    assert rows["a"] == {"node": "a", "asked": [old], "asked_bytes": 70, "removed": [old],
                         "freed_bytes": 70, "refused": [], "error": None}  # fmt: skip
    assert rows["b"]["error"] == "did not answer reclaim in 30 s"
    assert rows["c"]["asked"] == [] and rows["c"]["error"] is None

    # Exactly the paths asked for, on the node named; the agent refuses what it must.
    body = {"node": "a", "paths": ["/etc/passwd", old]}
    status, data = await asgi(app, "POST", "/api/v1/weights/collect", body)
    assert status == 200 and a.asked[-1] == (7, ("/etc/passwd", old), False)
    (row,) = data["nodes"]
    assert row["removed"] == [old] and row["asked_bytes"] is None  # /etc/passwd: size unknown
    assert row["refused"] == [{"path": "/etc/passwd", "reason": "not a cache name",
                               "detail": "/etc/passwd: not a cache name"}]  # fmt: skip

    # What the catalog wants is refused by the control plane; the agent is not asked.
    wanted = f"{WD}/{QWEN_CACHE}"
    body = {"node": "a", "paths": [wanted + "/m.gguf", old]}
    status, data = await asgi(app, "POST", "/api/v1/weights/collect", body)
    assert status == 200 and a.asked[-1] == (7, (old,), False)
    (row,) = data["nodes"]
    assert row["removed"] == [old]
    assert row["refused"] == [{"path": wanted + "/m.gguf", "reason": "still wanted by the catalog",
                               "detail": f"{wanted}/m.gguf: still wanted by the catalog (qwen); "
                                         "remove the model from the catalog first"}]  # fmt: skip

    # A node that is not connected is that node's error.
    rec = registry.record("a")
    assert rec is not None
    rec.agent = None
    status, data = await asgi(app, "POST", "/api/v1/weights/collect", {"node": "a"})
    assert status == 200
    assert data["nodes"][0]["error"] == "node a is ready: not connected"


async def test_unfinished_downloads_are_listed_and_those_no_model_wants_collected() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 1.0, wall=lambda: 2.0)
    gone_for = f"{WD}/{OLD_CACHE}"  # the download of a source the catalog no longer names
    fetching = f"{WD}/{QWEN_CACHE}"  # qwen's, under way
    inventory = attrs.evolve(
        _inventory([]),
        weights=model.Weights("fp", (), dir=WD, unfinished=(
            model.WeightFile(gone_for, 40), model.WeightFile(fetching, 900))),
    )  # fmt: skip
    a = ReclaimingAgent("a", {gone_for: 40})
    await register(registry, "a", inventory=inventory, agent=a)
    await register(registry, "b", inventory=_inventory([]))  # an older agent: not reported
    app = AdminApp(registry, "key", catalog=_catalog(("qwen", QWEN)))  # type: ignore[arg-type]
    status, data = await asgi(app, "GET", "/api/v1/weights")
    assert status == 200
    row, old = data["nodes"]
    assert [(u["path"], u["size_bytes"], u["wanted_by"]) for u in row["unfinished"]] == [
        (gone_for, 40, []),
        (fetching, 900, ["qwen"]),
    ]
    assert row["reclaimable"] == [{"path": gone_for, "size_bytes": 40}]
    assert old["unfinished"] is None
    text = format_weights(data["nodes"])
    assert f"  unfinished: {OLD_CACHE}/ (40 B so far), wanted by: not wanted" in text
    assert f"  unfinished: {QWEN_CACHE}/ (900 B so far), wanted by: qwen" in text
    status, data = await asgi(app, "POST", "/api/v1/weights/collect", {})
    assert status == 200 and a.asked == [(registry.epoch, (gone_for,), False)]
    assert data["nodes"][0]["removed"] == [gone_for]


async def test_collect_refuses_bad_bodies_in_one_line() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 1.0, wall=lambda: 2.0)
    await register(registry, "a", inventory=_inventory([]))
    app = AdminApp(registry, "key")
    cases = [
        ({"paths": ["/x"]}, 400, "paths: only with node"),
        ({"dry_run": "yes"}, 400, "dry_run: expected bool, got str"),
        ({"node": "a", "paths": [1]}, 400, "paths: expected at most 10000 non-empty strings"),
        ({"node": "a", "paths": [""]}, 400, "paths: expected at most"),
        ({"nodes": "a"}, 400, "nodes: unknown field"),
        ([], 400, "the request body must be a JSON object"),
        ({"node": "zz"}, 404, "no node 'zz' has registered"),
    ]
    for body, want, text in cases:
        status, data = await asgi(app, "POST", "/api/v1/weights/collect", body)
        message = data["error"]["message"]
        assert (status, text in message, "\n" in message) == (want, True, False), (body, data)


async def test_status_shows_what_each_fabric_holds() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 1.0, wall=lambda: 2.0)
    files = [(f"{WD}/{QWEN_CACHE}/m.gguf", 1000)]
    await register(registry, "a", inventory=_inventory(files, fabrics=("ib0",)))
    await register(registry, "b", inventory=_inventory([]))
    app = AdminApp(registry, "key", reconciler=_Reconciler([]),  # type: ignore[arg-type]
                   catalog=_catalog(("qwen", QWEN)))  # fmt: skip
    status, data = await asgi(app, "GET", "/api/v1/status")
    assert status == 200
    assert data["fabrics"] == [
        {"fabric": "ib0", "nodes": ["a"], "models": [{"model": "qwen", "bytes": 1000,
                                                      "nodes": ["a"]}]},
        {"fabric": None, "nodes": ["b"], "models": []},
    ]  # fmt: skip


_SOURCES = ["mirror:/a/", "mirror:/b.gguf", "https://h/c.gguf", f"{WD}/hand", "/models/m.gguf"]
_TOPS = [core.cache_name(s) for s in _SOURCES[:3]] + ["hand", "mine.gguf", "src-nothex"]


@given(
    files=st.lists(
        st.tuples(
            st.sampled_from([*(f"{WD}/{t}" for t in _TOPS), "/models", "/models/m.gguf"]),
            st.sampled_from(["", "/x.bin", "/sub/y.bin"]),
            st.integers(0, 10**12),
        ),
        max_size=20,
    ),
    catalog=st.lists(st.sampled_from(_SOURCES), unique=True),
)
def test_every_file_is_held_once_and_only_unwanted_cache_entries_are_reclaimable(
    files: list[tuple[str, str, int]], catalog: list[str]
) -> None:
    unique = {top + rest: size for top, rest, size in files}
    weights = model.Weights("fp", tuple(model.WeightFile(p, s) for p, s in unique.items()), WD)
    models = [(f"m{i}", s) for i, s in enumerate(catalog)]
    w = _holdings.node_weights("a", weights, models)
    assert sum(h.files for h in w.held) == len(unique)
    assert sum(h.size_bytes for h in w.held) == sum(unique.values())
    by_path = {h.path: h for h in w.held}
    for r in w.reclaimable:
        h = by_path[r.path]
        assert h.kind == "cache" and core.is_cache_name(h.name) and h.wanted_by == ()
        assert r.size_bytes == h.size_bytes
        assert not _holdings.catalog_wants(r.path, WD, models)
    for h in w.held:
        if h.kind == "cache" and h.wanted_by:
            assert h.path not in {r.path for r in w.reclaimable}
            assert _holdings.catalog_wants(h.path + "/x", WD, models) == list(h.wanted_by)
