"""An hour of each node's figures in the control plane (llmgw/cp/_observe/_history.py).

Unit tests on an injected clock (exact values in their buckets, gaps as null,
an hour wrapping, the memory bound), a hypothesis walk against a dict model,
the registry and the admin route, and one control plane with a real agent.
"""

from __future__ import annotations

import ast
import math
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import ready_shards, register, start_tiny_fleet
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import core, model
from llmgw.cp._admin import AdminApp, HttpError
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._observe import _history
from llmgw.cp._observe._history import NODE_BYTES_BOUND, History
from llmgw.testing.cluster import LocalCluster, wait_for

GIB = 1 << 30
WALL = 1_700_000_000.0  # the wall clock runs this far ahead of the monotonic one


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        return WALL + self.t


def history(clock: Clock, **kw: Any) -> History:
    return History(clock=clock, wall=clock.wall, **kw)


def full_usage(
    cpu: float | None, *, gpus: int = 1, shards: tuple[str, ...] = ("s1",)
) -> model.Usage:
    return model.Usage(
        memory_total_bytes=8 * GIB,
        memory_available_bytes=2 * GIB,
        load1=1.5,
        load5=1.25,
        load15=0.75,
        cpu_util_pct=cpu,
        gpus=tuple(
            model.GpuUsage(index=i, memory_used_mib=1000 + i, utilization_pct=50.0)
            for i in range(gpus)
        ),
        filesystems=(
            model.Filesystem("/", "ext4", ("/",), 100 * GIB, 40 * GIB, False),
            model.Filesystem("/weights", "nfs", ("/weights",), 1000 * GIB, 500 * GIB, True),
        ),
        shards=tuple(model.ShardUsage(s, cpu_cores=2.5, rss_bytes=4 * GIB) for s in shards),
    )


def report(shard: str, replica: str | None = "r1", rank: int = 0) -> model.ShardReport:
    return model.ShardReport(
        shard, "/m/tiny.gguf", "llama-server", "ready", replica_id=replica, model_name="tiny",
        rank=rank,
    )  # fmt: skip


def test_each_sample_lands_in_its_bucket_and_what_was_not_said_is_null() -> None:
    clock = Clock(1000.0)  # bucket 100 of 10 s
    depth: dict[tuple[str, str], tuple[float | None, float | None] | None] = {
        ("n1", "r1"): (2.0, 3.0)
    }
    # Six buckets: 95..100 at first.
    h = history(clock, resolution_s=10, span_s=60, queue=lambda n, r: depth.get((n, r)))
    h.record("n1", full_usage(10.0), (report("s1"),))
    clock.t = 1005.0  # the same bucket: the last heartbeat's figures win
    h.record("n1", full_usage(20.0), (report("s1"),))
    # Bucket 101: no heartbeat. Bucket 102: one that knows no memory, no GPU, no
    # filesystem, no shard usage; the router has no fresh queue figure.
    clock.t = 1021.0
    depth[("n1", "r1")] = (None, None)
    h.record("n1", model.Usage(cpu_util_pct=30.0, load1=0.0), (report("s1"),))
    clock.t = 1029.9
    view = h.view("n1")
    assert view is not None
    assert (view["resolution_s"], view["buckets"], view["node"]) == (10, 6, "n1")
    assert view["start"] == WALL + 970.0  # the window is buckets 97..102
    s = view["series"]
    assert s["cpu_util_percent"] == [None, None, None, 20.0, None, 30.0]
    assert s["memory_used_bytes"] == [None, None, None, 6 * GIB, None, None]
    assert s["memory_available_bytes"] == [None, None, None, 2 * GIB, None, None]
    assert s["memory_total_bytes"] == [None, None, None, 8 * GIB, None, None]
    # A reported 0 stays 0; only absence is null.
    assert s["load1"] == [None, None, None, 1.5, None, 0.0]
    assert s["load5"] == [None, None, None, 1.25, None, None]
    assert s["load15"] == [None, None, None, 0.75, None, None]
    assert s["gpus"] == {
        "0": {
            "utilization_percent": [None, None, None, 50.0, None, None],
            "memory_used_bytes": [None, None, None, 1000 * 2**20, None, None],
        }
    }
    assert s["filesystems"] == {
        "/": {"free_bytes": [None, None, None, 40 * GIB, None, None]},
        "/weights": {"free_bytes": [None, None, None, 500 * GIB, None, None]},
    }
    assert s["shards"] == {
        "s1": {
            "model": "tiny",
            "cpu_cores": [None, None, None, 2.5, None, None],
            "memory_bytes": [None, None, None, 4 * GIB, None, None],
            "running_requests": [None, None, None, 2.0, None, None],
            "waiting_requests": [None, None, None, 3.0, None, None],
        }
    }
    # Read later with no heartbeat since: the window moves on, the samples with it.
    clock.t = 1045.0  # bucket 104: window 99..104
    later = h.view("n1")
    assert later is not None and later["start"] == WALL + 990.0
    assert later["series"]["cpu_util_percent"] == [None, 20.0, None, 30.0, None, None]
    assert h.view("nobody") is None


def test_only_a_serving_rank_of_a_catalog_replica_asks_the_router_for_its_queue() -> None:
    clock = Clock(0.0)
    asked: list[tuple[str, str]] = []

    def queue(node: str, replica: str) -> tuple[float | None, float | None]:
        asked.append((node, replica))
        return (1.0, 0.0)

    h = history(clock, resolution_s=10, span_s=20, queue=queue)
    shards = (report("a", "ra"), report("b", "rb", rank=1), report("c", None))
    h.record("n1", full_usage(1.0, shards=("a", "b", "c")), shards)
    assert asked == [("n1", "ra")]
    view = h.view("n1")
    assert view is not None
    got = {k: v["waiting_requests"][-1] for k, v in view["series"]["shards"].items()}
    assert got == {"a": 0.0, "b": None, "c": None}


def test_an_hour_wraps_and_a_node_does_not_grow_with_time() -> None:
    clock = Clock(0.0)
    h = history(clock)  # 10 s buckets, one hour
    assert h.buckets == 360
    reports = (report("s1"), report("s2", "r2"))
    sizes: dict[int, int] = {}
    for step in range(2 * 720 + 1):  # two hours of heartbeats every 5 s
        clock.t = step * 5.0
        # A shard that ran only in the first ten minutes: gone an hour after.
        shards = ("s1", "s2", "old") if step < 120 else ("s1", "s2")
        h.record("n1", full_usage(float(step % 1000), gpus=8, shards=shards), reports)
        if step in (900, 1440):
            sizes[step] = h.nbytes("n1")
    assert sizes[900] == sizes[1440] <= NODE_BYTES_BOUND, sizes
    view = h.view("n1")
    assert view is not None
    cpu = view["series"]["cpu_util_percent"]
    assert len(cpu) == 360
    # Bucket k holds the second heartbeat in it (step 2k + 1), the last bucket the one
    # at 7200 s (step 1440) alone.
    cur = 720
    expected = [float((2 * b + 1) % 1000) for b in range(cur - 359, cur)] + [1440 % 1000.0]
    assert cpu == expected
    assert view["start"] == WALL + (cur - 359) * 10.0
    assert sorted(view["series"]["shards"]) == ["s1", "s2"]  # "old" was dropped
    assert sorted(view["series"]["gpus"], key=int) == [str(i) for i in range(8)]
    assert h.statistics()["series"] == 7 + 8 * 2 + 2 * 1 + 2 * 4


def test_a_node_silent_for_more_than_an_hour_has_only_its_new_sample() -> None:
    clock = Clock(0.0)
    h = history(clock, resolution_s=10, span_s=60)
    for step in range(6):
        clock.t = step * 10.0
        h.record("n1", full_usage(1.0), ())
    clock.t = 10_000.0
    h.record("n1", full_usage(2.0), ())
    view = h.view("n1")
    assert view is not None
    assert view["series"]["cpu_util_percent"] == [None] * 5 + [2.0]


def test_a_hostile_agent_cannot_grow_a_history_without_bound() -> None:
    clock = Clock(0.0)
    h = history(clock, resolution_s=10, span_s=60)
    many = model.Usage(
        gpus=tuple(model.GpuUsage(index=i, utilization_pct=1.0) for i in range(1000)),
        shards=tuple(model.ShardUsage(f"s{i}", cpu_cores=1.0) for i in range(1000)),
        filesystems=(model.Filesystem("/" + "x" * 10_000, "ext4", (), 1, 1, False),),
        cpu_util_pct=float("inf"),
    )
    h.record("n1", many, ())
    view = h.view("n1")
    assert view is not None
    assert len(view["series"]["gpus"]) == _history.MAX_GPUS
    assert len(view["series"]["shards"]) == _history.MAX_SHARDS
    assert view["series"]["filesystems"] == {}
    assert view["series"]["cpu_util_percent"][-1] is None  # not a number: not kept


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=35, allow_nan=False),
            st.one_of(st.none(), st.integers(min_value=-1000, max_value=1000).map(float)),
        ),
        max_size=40,
    ),
    st.floats(min_value=0, max_value=100, allow_nan=False),
)
def test_the_ring_reads_as_the_last_sample_of_each_bucket(
    beats: list[tuple[float, float | None]], read_after: float
) -> None:
    """Against a model: bucket -> the last heartbeat's value, over the last `n` buckets."""
    clock = Clock(50.0)
    h = history(clock, resolution_s=10, span_s=50)
    last: dict[int, float | None] = {}
    for dt, cpu in beats:
        clock.t += dt
        h.record("n1", model.Usage(cpu_util_pct=cpu), ())
        last[math.floor(clock.t / 10)] = cpu
    clock.t += read_after
    view = h.view("n1")
    if not beats:
        assert view is None
        return
    assert view is not None
    cur = math.floor(clock.t / 10)
    assert view["series"]["cpu_util_percent"] == [last.get(b) for b in range(cur - 4, cur + 1)]
    assert view["start"] == WALL + (cur - 4) * 10


def test_the_history_module_does_no_io() -> None:
    tree = ast.parse(Path(_history.__file__).read_text())
    imported = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert imported <= {
        "__future__",
        "math",
        "sys",
        "time",
        "array",
        "collections",
        "typing",
        "llmgw",
    }


POLICY = core.LivenessPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, lost_after_s=10.0)


async def test_the_registry_records_heartbeats_and_a_forgotten_node_drops_its_history(
    autojump_clock: Any,
) -> None:
    clock = Clock(0.0)
    h = history(clock, resolution_s=10, span_s=60)
    registry = NodeRegistry(POLICY, history=h)
    app = AdminApp(registry, "key")
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        inv = model.Inventory(model.Host("n1"), usage=model.Usage(cpu_util_pct=5.0))
        _agent, peer, session = await register(registry, "n1", inventory=inv)
        clock.t = 10.0
        await session.heartbeat(model.Heartbeat(seq=1, usage=model.Usage(cpu_util_pct=7.0)))
        status, body = await app._logs.history(node="n1")
        assert status == 200
        assert body["series"]["cpu_util_percent"][-2:] == [5.0, 7.0]  # registration, heartbeat
        with pytest.raises(HttpError) as refused:
            await app._logs.history(node="n2")
        assert refused.value.status == 404 and "'n2'" in str(refused.value)

        peer.closed.set()
        await trio.sleep(0.5)
        registry.forget("n1")
        assert h.view("n1") is None and h.nodes() == []
        with pytest.raises(HttpError) as gone:
            await app._logs.history(node="n1")
        assert gone.value.status == 404 and "'n1'" in str(gone.value)
        nursery.cancel_scope.cancel()


@pytest.mark.slow
def test_a_real_agents_heartbeats_fill_its_history(cluster: LocalCluster) -> None:
    cluster.heartbeat_interval_s = 0.5
    cluster.setup(["n1"])
    cluster.start_cp()
    cluster.start_agent("n1")
    cluster.wait_states({"n1": "ready"}, 30)
    url = cluster.admin_url + "/api/v1/nodes/n1/history"
    auth = {"Authorization": f"Bearer {cluster.admin_key}"}

    def filled() -> dict[str, Any] | None:
        body: dict[str, Any] = httpx.get(url, headers=auth, timeout=5).json()
        s = body["series"]
        known = [v for v in s["cpu_util_percent"] if v is not None]
        mem = [v for v in s["memory_used_bytes"] if v is not None]
        return body if known and mem else None

    body = wait_for("CPU and memory samples in n1's history", filled, 30)
    assert body["resolution_s"] == 10 and body["buckets"] == 360
    s = body["series"]
    for name in ("cpu_util_percent", "memory_used_bytes", "memory_total_bytes", "load1"):
        assert len(s[name]) == 360, name
    total = next(v for v in s["memory_total_bytes"] if v is not None)
    used = next(v for v in s["memory_used_bytes"] if v is not None)
    assert 0 < used < total
    assert all(0 <= v <= 100 for v in s["cpu_util_percent"] if v is not None)
    # Most of the hour is before this control plane started: null, never 0.
    assert s["cpu_util_percent"][:300] == [None] * 300
    assert abs(body["start"] + 3600 - 10 - time.time()) < 30
    unknown = httpx.get(cluster.admin_url + "/api/v1/nodes/nobody/history", headers=auth)
    assert unknown.status_code == 404 and "'nobody'" in unknown.json()["error"]["message"]


@pytest.mark.slow
def test_a_shards_queue_depth_is_the_routers_scrape_of_its_engine(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The fake llama-server holds one request for about 10 s: while it does, the
    router scrapes 1 running and 0 waiting, and the shard's history says so."""
    cluster.heartbeat_interval_s = 0.5
    env = {"LLMGW_FAKE_TOKENS": "100", "LLMGW_FAKE_TOKEN_DELAY": "0.1"}
    start_tiny_fleet(cluster, tmp_path, ["n1"], engine_env=env)
    wait_for("a ready shard", lambda: ready_shards(cluster), 60)
    shard = ready_shards(cluster)[0][1]["shard_id"]
    key = cluster.api_key()
    url = cluster.admin_url + "/api/v1/nodes/n1/history"
    auth = {"Authorization": f"Bearer {cluster.admin_key}"}
    errors: list[BaseException] = []

    def ask() -> None:
        request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 100}  # fmt: skip
        try:
            r = httpx.post(cluster.router_url + "/chat/completions", json=request,
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    def busy() -> dict[str, Any] | None:
        series = httpx.get(url, headers=auth, timeout=5).json()["series"]["shards"][shard]
        return series if 1.0 in series["running_requests"] else None

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    series = wait_for("the shard's running request in its history", busy, 15)
    asker.join(60)
    assert not errors, errors
    assert series["model"] == "tiny"
    i = series["running_requests"].index(1.0)
    assert series["waiting_requests"][i] == 0.0  # scraped, and 0: not null
    # Before the engine was ready nobody scraped it: null there, not 0.
    assert series["running_requests"][0] is None
