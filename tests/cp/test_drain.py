"""Drain and forget through real processes: llmgw-cp (with its router), agents, fake engines.

Drain: a streamed request in flight on the drained node's replica completes whole; the
replacement answers /health before the old engine exits; `ctl nodes` shows the node
draining, then drained; after a control-plane restart it is still drained and a new
replica goes elsewhere. Forget: lost nodes forgotten (by `ctl nodes forget` and by
`forget_after_s`) leave `ctl nodes` and no longer hold the mass-unreachable guard.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import alive, api_nodes, ready_shards, start_tiny_fleet, tiny_catalog

from llmgw import core, model
from llmgw.cp._fleet._catalog import parse
from llmgw.cp._fleet._endpoints import FleetEndpoints, endpoint_id
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.errors import NotFound, UsageError
from llmgw.router import Router, RouterConfig, StaticKeys
from llmgw.rpc import PeerInfo
from llmgw.store import open_store
from llmgw.testing.cluster import LocalCluster, wait_for

TOKENS = 100  # streamed at 0.1 s each: the request is in flight for about 10 s


def start_fleet(cluster: LocalCluster, tmp_path: Path, nodes: list[str], **server: Any) -> None:
    env = {
        "LLMGW_FAKE_LOAD_DELAY": "1.0",
        "LLMGW_FAKE_TOKENS": str(TOKENS),
        "LLMGW_FAKE_TOKEN_DELAY": "0.1",
    }
    start_tiny_fleet(cluster, tmp_path, nodes, engine_env=env, **server)


def replicas(cluster: LocalCluster) -> list[dict[str, Any]]:
    """`GET /api/v1/replicas`, which `ctl replicas --json` prints as is: read over HTTP
    because it is polled (a ctl process per poll is ~0.4 s of CPU on the suite's two
    cores); `ctl nodes` and `ctl drain` are read where their output is what is checked."""
    return list(cluster.first.api_get("/api/v1/replicas")["replicas"])


def node_row(cluster: LocalCluster, node: str) -> str:
    table = cluster.ctl("nodes").stdout.splitlines()
    return next(line for line in table if line.split()[0] == node)


def fake_stats(port: int) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{port}/fake/stats", timeout=5).json())


class Stream(threading.Thread):
    """One streamed chat completion through the router; keeps the whole body."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.first_chunk = threading.Event()
        self.status: int | None = None
        self.body = b""
        self.done_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        request = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": TOKENS,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST",
                self.url + "/chat/completions",
                json=request,
                headers={"Authorization": f"Bearer {self.key}"},
                timeout=60,
            ) as r:
                self.status = r.status_code
                for chunk in r.iter_bytes():
                    self.body += chunk
                    self.first_chunk.set()
            self.done_at = time.monotonic()
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc
            self.first_chunk.set()


class Watch(threading.Thread):
    """From outside: when the first engine on `new_node` answers /health 200, and when
    every one of `old_pids` has exited."""

    def __init__(self, cluster: LocalCluster, new_node: str, old_pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.cluster, self.new_node, self.old_pids = cluster, new_node, old_pids
        self.ready_at: float | None = None
        self.exited_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        port: int | None = None
        while not self.stop.is_set() and (self.ready_at is None or self.exited_at is None):
            now = time.monotonic()
            if self.exited_at is None and not any(alive(p) for p in self.old_pids):
                self.exited_at = now
            if self.ready_at is None:
                try:
                    if port is None:
                        shards = api_nodes(self.cluster)[self.new_node]["shards"]
                        port = next((s["port"] for s in shards if s.get("port")), None)
                    if port is not None:
                        url = f"http://127.0.0.1:{port}/health"
                        if httpx.get(url, timeout=1).status_code == 200:
                            self.ready_at = now
                except (httpx.HTTPError, KeyError):
                    pass
            time.sleep(0.05)


# --- the pieces, in process -----------------------------------------------------------


class _Agent:
    def release(self) -> None:
        pass


def _hello(node: str, *shards: model.ShardReport) -> model.Hello:
    return model.Hello(node, "0.1", model.Inventory(host=model.Host(node)), shards)


def _peer(node: str) -> PeerInfo:
    return PeerInfo(conn_id=1, address="127.0.0.1:5555", common_name=node, closed=trio.Event())


def _ready(replica: str, port: int) -> model.ShardReport:
    return model.ShardReport(
        f"{replica}.0", "/models/tiny.gguf", "llama-server", "ready", port=port,
        replica_id=replica, model_name="tiny",
    )  # fmt: skip


async def test_cordon_and_drain_survive_a_restart_and_uncordon_lifts_both(
    tmp_path: Path,
) -> None:
    store = await open_store(tmp_path)
    first = NodeRegistry(core.LivenessPolicy())
    await first.load_state(store)
    first.cordon("n1", "bad fan")
    first.drain("n2", None)
    await first.flush()
    again = NodeRegistry(core.LivenessPolicy())
    await again.load_state(store)
    assert (again.cordoned, again.draining) == ({"n1": "bad fan"}, {"n2": "drained by an operator"})
    assert again.uncordon("n2") == ["drain"]
    assert again.uncordon("n2") == []
    await again.flush()
    third = NodeRegistry(core.LivenessPolicy())
    await third.load_state(store)
    assert (third.cordoned, third.draining) == ({"n1": "bad fan"}, {})
    assert [(o.node_id, o.kind) for o in await store.overrides()] == [("n1", "cordon")]
    await store.aclose()


async def test_forget_refuses_a_connected_node_and_forget_after_s_forgets_a_lost_one(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    policy = core.LivenessPolicy(heartbeat_interval_s=1, missed_heartbeats=3, lost_after_s=5)
    registry = NodeRegistry(policy, forget_after_s=100)
    store = await open_store(tmp_path)
    await registry.load_state(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        peers = {n: _peer(n) for n in ("n1", "n2")}
        for n, peer in peers.items():
            await registry.register(peer, _hello(n), _Agent())  # type: ignore[arg-type]
        registry.drain("n1", None)
        with pytest.raises(UsageError, match="node n1 is connected \\(ready\\)"):
            registry.forget("n1")
        with pytest.raises(NotFound, match="no node 'n9' is known"):
            registry.forget("n9")
        peers["n1"].closed.set()  # its agent went away; n2 stays and heartbeats
        for _ in range(60):
            await trio.sleep(1)
            rec = registry.record("n2")
            assert rec is not None
            registry.on_heartbeat("n2", rec.generation, model.Heartbeat(seq=1))
        assert registry.statistics()["lost"] == 1
        await trio.sleep(50)  # lost for 5 + 100 s in all: forgotten, with its drain
        assert [v.node_id for v in registry.views()] == ["n2"]
        assert registry.draining == {}
        nursery.cancel_scope.cancel()
    await registry.flush()  # what the writer task had not written yet
    again = NodeRegistry(policy)
    await again.load_state(store)
    assert (again.known, again.draining) == ({"n2"}, {})  # a restart waits for n2 only
    await store.aclose()


async def test_a_known_node_not_back_since_the_restart_can_be_forgotten(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    for node in ("old", "n2"):
        await store.remember_node(node, "10.0.0.1:5000")
    registry = NodeRegistry(core.LivenessPolicy())
    await registry.load_state(store)
    assert registry.forget("old") == "not registered since this start"
    await registry.flush()
    assert [k.node_id for k in await store.known_nodes()] == ["n2"]
    await store.aclose()


async def test_endpoints_leave_out_retiring_replicas_and_the_router_still_counts_them() -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    shards = (_ready("tiny-a", 9001), _ready("tiny-b", 9002))
    await registry.register(_peer("n1"), _hello("n1", *shards), _Agent())  # type: ignore[arg-type]
    cat = parse({"models": tiny_catalog(2)}, "server.yaml")
    retiring: set[str] = set()
    endpoints = FleetEndpoints(registry, lambda: cat, lambda: retiring)
    both = {e.endpoint_id for e in endpoints.snapshot()["tiny"]}
    assert both == {endpoint_id("tiny-a", "n1"), endpoint_id("tiny-b", "n1")}
    router = Router(RouterConfig(), endpoints, StaticKeys([]))
    leaving = router.endpoint_states()[endpoint_id("tiny-a", "n1")]
    leaving.in_flight += 2  # two requests being answered there
    retiring.add("tiny-a")
    endpoints.refresh()
    assert [e.endpoint_id for e in endpoints.snapshot()["tiny"]] == [endpoint_id("tiny-b", "n1")]
    # No longer listed, so nothing new goes there; its count stays readable until it ends.
    assert router.in_flight(endpoint_id("tiny-a", "n1")) == 2
    assert endpoint_id("tiny-a", "n1") not in router.endpoint_states()
    leaving.in_flight -= 2
    assert router.in_flight(endpoint_id("tiny-a", "n1")) == 0
    assert router.in_flight(endpoint_id("tiny-b", "n1")) == 0


@pytest.mark.slow(seconds=25)
def test_drain_replaces_first_lets_the_request_finish_and_survives_a_restart(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    start_fleet(cluster, tmp_path, ["n1", "n2"], drain_timeout_s=30)
    ((old_node, old),) = wait_for("the replica ready", lambda: ready_shards(cluster), 30)
    new_node = "n2" if old_node == "n1" else "n1"
    key = cluster.api_key()

    stream = Stream(cluster.router_url, key)
    stream.start()
    assert stream.first_chunk.wait(30), "no first chunk through the router"
    assert stream.error is None, stream.error
    watch = Watch(cluster, new_node, list(old["pids"]))
    watch.start()

    out = cluster.ctl("drain", old_node).stdout
    assert f"{old_node} draining" in out
    # The request holds the old engine for seconds: it is still there, and the node says so.
    row = node_row(cluster, old_node)
    assert "ready,draining" in row, row

    # Replaced, then retiring: from then on the router sends the old engine nothing new.
    def retiring() -> bool:
        states = {r["replica"]: r["state"] for r in replicas(cluster)}
        return states.get(old["replica_id"]) == "retiring" and "ready" in states.values()

    wait_for("the old replica retiring behind a ready replacement", retiring, 30)
    assert stream.done_at is None, (
        f"the streamed request ended before the replacement was ready: {stream.status} "
        f"{stream.body[-300:]!r}"
    )
    ((_, new),) = [(n, s) for n, s in ready_shards(cluster) if n == new_node]
    before = fake_stats(new["port"])["received"]
    answer = httpx.post(
        cluster.router_url + "/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert fake_stats(new["port"])["received"] == before + 1
    assert fake_stats(old["port"])["received"] == 1  # only the streamed request, ever

    # The request in flight completes whole; only then does the old engine stop.
    stream.join(30)
    assert stream.error is None, stream.error
    assert stream.status == 200
    events = [e for e in stream.body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    text = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in (json.loads(e[6:]) for e in events[:-1])
        if c.get("choices")
    )
    assert text.split() == [f"tok{i}" for i in range(TOKENS)]
    watch.join(30)
    assert watch.ready_at is not None and watch.exited_at is not None
    assert stream.done_at is not None
    assert watch.ready_at < watch.exited_at, (
        "the old engine exited before its replacement was ready"
    )
    assert stream.done_at <= watch.exited_at + 0.1, "the old engine exited mid-request"

    def drained() -> str | None:
        row = node_row(cluster, old_node)
        return row if "ready,drained" in row else None

    wait_for("the node drained", drained, 30)
    assert api_nodes(cluster)[old_node]["shards"] == []

    # A restart of the control plane: still drained, and a new replica goes elsewhere
    # (the empty node would be placement's first choice were it not draining).
    assert cluster.cp is not None
    cluster.cp.terminate()
    cluster.start_cp()
    wait_for("the node back, drained", lambda: "ready,drained" in node_row(cluster, old_node), 30)
    cluster.write_server_config(tiny_catalog(2))

    def two_ready() -> list[tuple[str, dict[str, Any]]] | None:
        found = ready_shards(cluster)
        return found if len(found) == 2 else None

    placed = wait_for("two replicas ready", two_ready, 30)
    assert [node for node, _ in placed] == [new_node, new_node]
    assert api_nodes(cluster)[old_node]["shards"] == []
    assert api_nodes(cluster)[old_node]["draining"] == "drained by an operator"

    # uncordon returns it to service: the drain is lifted, and placement may use it.
    out = cluster.ctl("uncordon", old_node).stdout
    assert "drain lifted" in out
    assert api_nodes(cluster)[old_node]["draining"] is None


@pytest.mark.slow(seconds=20)
def test_lost_nodes_forgotten_leave_the_fleet_and_the_guard(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    nodes = ["n1", "n2", "n3"]
    start_fleet(cluster, tmp_path, nodes, lost_after_s=2, forget_after_s=8)
    ((x, shard),) = wait_for("the replica ready", lambda: ready_shards(cluster), 30)
    y, z = (n for n in nodes if n != x)

    refused = cluster.ctl("nodes", "forget", z, check=False)
    assert refused.returncode == 1
    assert f"node {z} is connected (ready)" in refused.stderr
    assert "stop its agent first" in refused.stderr

    # Two of three machines retired at once: the guard holds (this could be a partition).
    for node in (x, y):
        cluster.agents[node].kill9()
    cluster.kill_engines()  # a retired machine's engines are gone with it
    cluster.wait_states({x: "lost", y: "lost"}, timeout=20)
    assert cluster.cp is not None
    wait_for("the guard holding", lambda: "nothing is rescheduled" in cluster.cp.output(), 10)

    # The replica's state is the reconciler's last pass: one that ran while its node was
    # still unreachable says so until the next (on a busy machine, a moment later).
    def replica_lost() -> bool:
        states = [r["state"] for r in replicas(cluster) if r["replica"] == shard["replica_id"]]
        return states in (["lost"], [])

    wait_for("the replica lost with its node", replica_lost, 10)
    assert api_nodes(cluster)[z]["shards"] == []

    # Forget one by hand: 1 of 2 away is the normal lost case, so the replica moves to z.
    out = cluster.ctl("nodes", "forget", x).stdout
    assert f"{x} forgotten (it was lost)" in out
    assert x not in cluster.nodes()
    again = cluster.ctl("nodes", "forget", x, check=False)
    assert again.returncode == 1 and f"no node {x!r} is known" in again.stderr

    def moved() -> list[tuple[str, dict[str, Any]]] | None:
        found = ready_shards(cluster)
        return found if [n for n, _ in found] == [z] else None

    wait_for("the replica rescheduled on the remaining node", moved, 30)

    # The other one is forgotten by forget_after_s, with no command.
    wait_for(f"{y} forgotten by forget_after_s", lambda: y not in cluster.nodes(), 20)
    assert sorted(cluster.nodes()) == [z]
    assert f"node {y} forgotten (lost for 8 s (forget_after_s)" in cluster.cp.output()
