"""The reconciler's shell with a real NodeRegistry, fake agents, and trio's MockClock.

Decide, then act: one agent that never answers holds up only its own start;
starts in flight count; a restarted control plane waits for the nodes it knows;
GPU usage from heartbeats reaches placement; unhealthy shards are replaced
after their bound.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from llmgw import core, model
from llmgw.core import node_facts
from llmgw.cp._fleet._catalog import Catalog, parse
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._wake import Wakeup
from llmgw.errors import DeadlineExceeded, LlmgwError
from llmgw.rpc import PeerInfo
from llmgw.store import open_store

_conn = itertools.count(1)


class FakeAgent:
    """An agent's capability: records what it was told; a stuck one never answers."""

    def __init__(self, node_id: str, *, stuck: bool = False) -> None:
        self.node_id = node_id
        self.stuck = stuck
        self.started: list[model.ShardSpec] = []
        self.stopped: list[str] = []
        self.answered = 0

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.started.append(spec)
        if self.stuck:  # what the real handle does (llmgw/rpc Deadlines)
            await trio.sleep(10)
            raise DeadlineExceeded("did not answer startShard in 10 s")
        self.answered += 1
        return report(spec)

    async def stop_shard(self, epoch: int, shard_id: str, grace_s: float) -> None:
        self.stopped.append(shard_id)

    def release(self) -> None:
        pass


def report(spec: model.ShardSpec, state: str = "starting", **kw: Any) -> model.ShardReport:
    return model.ShardReport(
        shard_id=spec.shard_id,
        model=spec.model,
        engine=spec.engine,
        state=state,
        port=spec.port,
        replica_id=spec.replica_id,
        model_name=spec.model_name,
        rank=spec.rank,
        ranks=spec.ranks,
        gpus=spec.gpus,
        profile_fingerprint=spec.profile_fingerprint,
        **kw,
    )


def catalog(replicas: int) -> Catalog:
    return parse(
        {
            "models": [
                {
                    "name": "tiny",
                    "source": "/models/tiny.gguf",
                    "replicas": replicas,
                    "profiles": [{"engine": "llama-server", "gpus_per_node": 0}],
                }
            ]
        },
        "server.yaml",
    )


async def register(
    registry: NodeRegistry,
    node_id: str,
    agent: FakeAgent | None = None,
    shards: tuple[model.ShardReport, ...] = (),
    inventory: model.Inventory | None = None,
) -> tuple[FakeAgent, PeerInfo, Any]:
    agent = agent or FakeAgent(node_id)
    n = next(_conn)
    peer = PeerInfo(n, f"10.0.0.{n}:5000", node_id, trio.Event())
    hello = model.Hello(node_id, "test", inventory or model.Inventory(model.Host(node_id)), shards)
    session, _settings = await registry.register(peer, hello, agent)  # type: ignore[arg-type]
    return agent, peer, session


def make(settle_s: float = 1.0, replicas: int = 3, **kw: Any) -> tuple[NodeRegistry, Reconciler]:
    wake = Wakeup()  # made first: the registry pokes it, the reconciler waits on it
    policy = core.LivenessPolicy(heartbeat_interval_s=1.0, lost_after_s=5.0)
    registry = NodeRegistry(policy, listeners=(wake.poke,))
    reconciler = Reconciler(
        registry, lambda: catalog(replicas), interval_s=0.5, settle_s=settle_s, wake=wake, **kw
    )
    return registry, reconciler


async def wait_until(what: str, check: Any, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.05)


async def beat(session: Any, seq: int) -> None:
    await session.heartbeat(model.Heartbeat(seq=seq))


# Decide, then act ------------------------------------------------------------------------


async def test_a_stuck_agent_holds_up_only_its_own_start(autojump_clock: Any) -> None:
    registry, reconciler = make(replicas=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        stuck, _, _ = await register(registry, "a", FakeAgent("a", stuck=True))
        b, _, sb = await register(registry, "b")
        c, _, sc = await register(registry, "c")
        await nursery.start(reconciler.run)
        t0 = trio.current_time()

        # One pass places a replica on each node (CPU replicas spread); b and c answer
        # at once although a never does.
        await wait_until(
            "starts sent", lambda: len(stuck.started) == 1 and b.answered and c.answered
        )
        assert trio.current_time() - t0 < 1.5 + 0.5  # the settle, and one pass
        passes = reconciler.statistics()["passes"]

        # While a's call hangs, passes go on, and a's start counts as pending: no pass
        # starts the same replica again.
        for seq in range(1, 9):
            await trio.sleep(1.0)
            await beat(sb, seq)
            await beat(sc, seq)
        assert trio.current_time() - t0 < 11
        assert reconciler.statistics()["passes"] >= passes + 8
        assert (len(stuck.started), len(b.started), len(c.started)) == (1, 1, 1)
        assert reconciler.statistics()["pending"] == 1
        row = next(v for v in reconciler.replicas() if v.nodes == ("a",))
        assert row.state == "starting"

        # At its deadline the call ends, with why; a is left out of placement (it has not
        # been heard from since), and the replica is started on b or c instead.
        await wait_until("a's start failed", lambda: reconciler.statistics()["pending"] == 0)
        failed = [v for v in reconciler.replicas() if v.state == "failed"]
        assert [(v.nodes, v.reason) for v in failed] == [
            (("a",), "node a did not answer startShard in 10 s")
        ]
        await wait_until("the replacement", lambda: len(b.started) + len(c.started) == 3)
        assert len(stuck.started) == 1
        nursery.cancel_scope.cancel()


async def test_a_start_that_fails_is_not_counted_again(autojump_clock: Any) -> None:
    class Refusing(FakeAgent):
        async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
            from llmgw.errors import RemoteError

            self.started.append(spec)
            raise RemoteError("engine llama-server is not installed")

    registry, reconciler = make(replicas=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        agent, _, _ = await register(registry, "a", Refusing("a"))
        await nursery.start(reconciler.run)
        await wait_until("two attempts", lambda: len(agent.started) >= 2, timeout=10)
        assert reconciler.statistics()["pending"] == 0
        reasons = {v.reason for v in reconciler.replicas() if v.state == "failed"}
        assert "starting rank 0 on a failed: engine llama-server is not installed" in reasons
        nursery.cancel_scope.cancel()


async def test_engines_get_ports_from_engine_ports(autojump_clock: Any) -> None:
    # server.yaml `engine_ports` reaches placement: 3 replicas on one host (three agents
    # of one machine share its ports) take 3 different ports of a 4-port range.
    registry, reconciler = make(replicas=3, engine_ports=(20_000, 20_003))
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        agents = [(await register(registry, n))[0] for n in "abc"]
        await nursery.start(reconciler.run)
        await wait_until("three starts", lambda: sum(len(a.started) for a in agents) == 3)
        ports = [spec.port for a in agents for spec in a.started]
        assert all(p is not None and 20_000 <= p <= 20_003 for p in ports), ports
        nursery.cancel_scope.cancel()


# Settle by who is expected ---------------------------------------------------------------


async def test_settle_waits_for_every_known_node_and_a_slow_storm_extends_it(
    autojump_clock: Any, tmp_path: Path
) -> None:
    registry, reconciler = make(settle_s=2.0, replicas=4)
    registry.known.update({"a", "b", "c", "d"})  # as load_state reads them (test_drain.py)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await nursery.start(reconciler.run)
        t0 = trio.current_time()
        agents = []
        # Each registers 1.5 s after the one before: 6 s in all, three times settle_s,
        # yet the window stays open until the last known node is back.
        for i, node in enumerate("abcd"):
            await trio.sleep(1.5)
            spec = model.ShardSpec(f"r{i}.0", "/models/tiny.gguf", "llama-server", (),
                                   replica_id=f"r{i}", model_name="tiny")  # fmt: skip
            if node != "d":
                assert reconciler.statistics()["settling"] == 1, node
            agent, _, _ = await register(registry, node, shards=(report(spec, "ready"),))
            agents.append(agent)
        await trio.sleep(0.6)
        assert reconciler.statistics()["settling"] == 0
        assert trio.current_time() - t0 < 6.7  # not a clock: the last one settled it
        passes = reconciler.statistics()["passes"]
        await wait_until("two passes", lambda: reconciler.statistics()["passes"] >= passes + 2)
        assert [a.started for a in agents] == [[], [], [], []]
        assert [a.stopped for a in agents] == [[], [], [], []]
        nursery.cancel_scope.cancel()


async def test_a_takeover_does_not_say_it_is_cut_off(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Right after an election every known node is away only because it has not
    re-registered yet: no "probably the one cut off" then (issue 24). The same nodes
    still away once the settle is over are said to be."""
    registry, reconciler = make(settle_s=2.0, replicas=1)
    registry.known.update({"a", "b", "c"})
    caplog.set_level(logging.WARNING, logger="llmgw.cp.reconciler")
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await nursery.start(reconciler.run)
        reconciler.elected()
        await trio.sleep(1.0)
        await register(registry, "a")
        await trio.sleep(1.0)  # settling: 2 of 3 known nodes still away
        assert reconciler.statistics()["settling"] == 1
        assert "cut off" not in caplog.text
        await wait_until("settled", lambda: not reconciler.statistics()["settling"])
        await wait_until("said", lambda: "probably the one cut off" in caplog.text, 5)
        nursery.cancel_scope.cancel()


async def test_settle_without_the_rest_ends_settle_s_after_the_last_registration(
    autojump_clock: Any, tmp_path: Path
) -> None:
    registry, reconciler = make(settle_s=2.0, replicas=2)
    registry.known.update({"a", "b", "gone"})
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await nursery.start(reconciler.run)
        t0 = trio.current_time()
        await trio.sleep(1.0)
        a, _, _ = await register(registry, "a")
        await trio.sleep(1.5)
        b, _, _ = await register(registry, "b")
        await wait_until("settled", lambda: not reconciler.statistics()["settling"])
        assert 2.5 + 2.0 <= trio.current_time() - t0 <= 2.5 + 2.0 + 0.6
        # 1 of 3 away is the normal case: the two missing replicas are started.
        await wait_until("started", lambda: len(a.started) + len(b.started) == 2)
        nursery.cancel_scope.cancel()


async def test_with_no_known_nodes_settle_is_a_clock_from_the_start(autojump_clock: Any) -> None:
    registry, reconciler = make(settle_s=3.0, replicas=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await nursery.start(reconciler.run)
        t0 = trio.current_time()
        a, _, _ = await register(registry, "a")  # every node we know (none) is back: not enough
        await wait_until("started", lambda: a.started)
        assert trio.current_time() - t0 >= 3.0
        nursery.cancel_scope.cancel()


async def test_known_nodes_survive_a_restart_and_forgotten_ones_drop_out(
    autojump_clock: Any, tmp_path: Path
) -> None:
    store = await open_store(tmp_path)
    registry = NodeRegistry(core.LivenessPolicy())
    await registry.load_state(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await register(registry, "a")
        _, peer_b, _ = await register(registry, "b")
        # Written by the registry's writer task, never by the registration itself.
        while registry.store_writes < 2:
            await trio.sleep(0.05)
        known = {k.node_id: k.address for k in await store.known_nodes()}
        assert sorted(known) == ["a", "b"] and known["a"].startswith("10.0.0.")
        peer_b.closed.set()
        await trio.sleep(0.1)
        registry.forget("b")
        while registry.store_writes < 3:
            await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    again = NodeRegistry(core.LivenessPolicy())
    await again.load_state(store)
    assert again.known == {"a"}
    await store.aclose()


# GPU usage from heartbeats reaches placement ---------------------------------------------


async def test_heartbeat_gpu_usage_reaches_placement(autojump_clock: Any) -> None:
    gpus = tuple(
        model.Gpu(index=i, uuid=f"GPU-{i}", name="H100", gpu_class="h100-80g",
                  foreign_memory_mib=0, ecc_uncorrected=0)
        for i in range(3)
    )  # fmt: skip
    registry = NodeRegistry(core.LivenessPolicy())
    inventory = model.Inventory(model.Host("g"), gpus=gpus)
    _, _, session = await register(registry, "g", inventory=inventory)
    rec = registry.record("g")
    assert rec is not None
    assert [g.healthy for g in node_facts(rec).gpus or ()] == [True, True, True]
    usage = model.Usage(
        gpus=(
            model.GpuUsage(index=0, memory_used_mib=100),  # foreign not measured: registration's
            model.GpuUsage(index=1, memory_used_mib=9000, foreign_memory_mib=8000),
            model.GpuUsage(index=2, foreign_memory_mib=0, ecc_uncorrected=2),
        )
    )
    await session.heartbeat(model.Heartbeat(seq=1, usage=usage))
    assert [g.healthy for g in node_facts(rec).gpus or ()] == [True, False, False]
    # And placement refuses the sick cards: a 2-card profile no longer fits.
    placed = core.place(
        [node_facts(rec)],
        core.PlacementProfile("m", "vllm", "h100-80g", 2),
        core.Allocations(gpus={}, cpu_replicas={}),
    )
    assert isinstance(placed, core.Refusal), placed


# Unhealthy shards --------------------------------------------------------------------------


async def test_an_unhealthy_replica_is_replaced_after_its_bound(autojump_clock: Any) -> None:
    registry, reconciler = make(settle_s=0.0, replicas=1, unhealthy_replace_s=5.0)
    spec = model.ShardSpec("r1.0", "/models/tiny.gguf", "llama-server", (), replica_id="r1",
                           model_name="tiny")  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        agent, _, session = await register(registry, "a", shards=(report(spec, "ready"),))
        await nursery.start(reconciler.run)
        await trio.sleep(2.0)
        sick = report(spec, "unhealthy", reason="GET /health failed 3 times in a row: timed out")
        await session.shard_status(sick)
        became = trio.current_time()
        for seq in range(1, 5):
            await trio.sleep(1.0)
            await beat(session, seq)
        assert agent.stopped == [] and agent.started == []
        view = next(v for v in reconciler.replicas() if v.replica_id == "r1")
        assert view.state == "unhealthy" and "timed out" in (view.reason or "")
        await wait_until("stopped", lambda: agent.stopped == ["r1.0"], timeout=10)
        assert 5.0 <= trio.current_time() - became <= 6.0
        await wait_until("replaced", lambda: len(agent.started) == 1, timeout=10)
        nursery.cancel_scope.cancel()


def test_statistics_names_passes_for_tests_to_wait_on() -> None:
    _, reconciler = make()
    stats = reconciler.statistics()
    assert {"passes", "settling", "holding", "pending"} <= stats.keys()
    assert stats["passes"] == 0 and stats["settling"] == 1


# Restart backoff (llmgw/core/_backoff.py) ----------------------------------------------------


def two_models() -> Catalog:
    profile = {"engine": "llama-server", "gpus_per_node": 0}
    return parse(
        {
            "models": [
                {"name": "broken", "source": "/models/x.gguf", "replicas": 2,
                 "profiles": [profile]},
                {"name": "good", "source": "/models/good.gguf", "replicas": 1,
                 "profiles": [profile]},
            ]
        },
        "server.yaml",
    )  # fmt: skip


class Refusing(FakeAgent):
    """Refuses every start of `broken` as the agent refuses a bad source; the rest start
    and are ready at once."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.tries: list[float] = []

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.started.append(spec)
        if spec.model_name == "broken":
            self.tries.append(trio.current_time())
            raise LlmgwError("source '../x': a manifest path may not leave the model directory")
        return report(spec, "ready")


async def test_a_model_refused_at_start_waits_twice_as_long_each_time(
    autojump_clock: Any,
) -> None:
    wake = Wakeup()
    policy = core.LivenessPolicy(heartbeat_interval_s=1.0, lost_after_s=5.0)
    registry = NodeRegistry(policy, listeners=(wake.poke,))
    reconciler = Reconciler(registry, two_models, interval_s=0.5, settle_s=0.0, wake=wake)
    agent = Refusing("a")
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _, _, session = await register(registry, "a", agent)
        await nursery.start(reconciler.run)
        t0 = trio.current_time()
        for i in range(200):  # 200 s; the agent stays alive throughout
            await trio.sleep(1)
            await beat(session, i + 1)
        nursery.cancel_scope.cancel()

    tries = [t - t0 for t in agent.tries]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    # The first pass tries both missing replicas (one round: one failure), the next
    # pass one, and from then on one at a time, 5, 10, 20, 40 and 80 s apart (plus up
    # to a pass).
    assert len(tries) == 8, tries  # without the backoff: two every pass, 800 or so
    assert gaps[0] == 0 and gaps[1] <= 1, tries
    for wait, floor in zip(gaps[2:], [5, 10, 20, 40, 80], strict=True):
        assert floor - 0.01 <= wait <= floor + 1, (tries, gaps)
    # `good` started once, at once, and is not held back by its neighbour.
    assert [s.model_name for s in agent.started].count("good") == 1
    b = reconciler.backoffs()["broken"]
    assert b.failures == len(tries) - 1  # the first two were one round
    assert "a manifest path may not leave the model directory" in b.reason
    assert "good" not in reconciler.backoffs()


class FailingThenGood(FakeAgent):
    """Its shards of `tiny` fail on the node `failures` times (the engine exits), then
    one is ready."""

    def __init__(self, node_id: str, failures: int) -> None:
        super().__init__(node_id)
        self.failures = failures
        self.tries: list[float] = []

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.started.append(spec)
        self.tries.append(trio.current_time())
        if len(self.tries) <= self.failures:
            return report(spec, "failed", reason="engine exited with code 1")
        return report(spec, "ready")


async def test_replicas_failing_on_the_node_back_off_and_a_ready_one_resets_the_count(
    autojump_clock: Any,
) -> None:
    registry, reconciler = make(replicas=1, settle_s=0.0)
    agent = FailingThenGood("a", failures=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _, _, session = await register(registry, "a", agent)
        await nursery.start(reconciler.run)
        seq = 0

        async def run_for(seconds: int) -> None:
            nonlocal seq
            for _ in range(seconds):
                await trio.sleep(1)
                seq += 1
                await beat(session, seq)

        def tries() -> list[int]:
            return [round(t - t0) for t in agent.tries]

        async def fail_the_ready_one() -> None:
            (spec,) = [s for s in agent.started if s.shard_id not in agent.stopped][-1:]
            await session.shard_status(report(spec, "failed", reason="engine was killed"))

        t0 = trio.current_time()
        await run_for(30)
        # The first failure is replaced at once; then 5 s, then 10 s.
        assert len(tries()) == 4 and tries()[1] <= 1, tries()
        assert 5 <= tries()[2] <= 7 and 15 <= tries()[3] <= 18, tries()
        b = reconciler.backoffs()["tiny"]
        assert b.failures == 4 and "engine exited with code 1" in b.reason
        assert [v for v in reconciler.replicas() if v.state == "ready"] == []
        await run_for(30)  # the 5th try, 20 s after the 4th, is ready
        assert len(tries()) == 5 and 20 <= tries()[4] - tries()[3] <= 22, tries()
        assert [v.state for v in reconciler.replicas()] == ["ready"]
        assert reconciler.backoffs() == {}  # nothing is held back: not shown

        # Ready for less than a minute, then it fails: the count goes on (a 40 s wait).
        failed_at = trio.current_time() - t0
        await fail_the_ready_one()
        await run_for(60)
        assert len(tries()) == 6 and 40 <= tries()[5] - failed_at <= 43, (failed_at, tries())
        # Ready for more than a minute, then it fails: counted from zero, replaced at once.
        await run_for(70)
        await fail_the_ready_one()
        before = trio.current_time() - t0
        await run_for(5)
        assert len(tries()) == 7 and tries()[6] - before <= 2, tries()
        nursery.cancel_scope.cancel()


# Shard state never goes backwards --------------------------------------------------------


class Overtaken(FakeAgent):
    """Its startShard reply (report 1, starting) is made at once but delivered late: the
    shard fails first, and the agent's own report of that (report 2) arrives before it."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.session: Any = None

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.started.append(spec)
        reply = report(spec, seq=1)
        if len(self.started) == 1:
            failed = report(spec, "failed", reason="source refused: '../x'", seq=2)
            await self.session.shard_status(failed)
            await trio.sleep(0.5)  # the reply, delayed past the agent's later report
        return reply


async def test_a_start_reply_overtaken_by_the_agents_report_does_not_overwrite_it(
    autojump_clock: Any,
) -> None:
    registry, reconciler = make(replicas=1, settle_s=0.0)
    agent = Overtaken("a")
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _, _, agent.session = await register(registry, "a", agent)
        await nursery.start(reconciler.run)
        await wait_until("the reply came", lambda: agent.started and not
                         reconciler.statistics()["pending"], timeout=5)  # fmt: skip
        first = agent.started[0].shard_id
        rec = registry.record("a")
        assert rec is not None
        # The failure stands (or the shard is already stopped and gone): never `starting`.
        held = [s for s in rec.shards if s.shard_id == first]
        assert [(s.state, s.seq) for s in held] in ([("failed", 2)], []), held
        # So it is replaced at once, not left `starting` until its startup timeout.
        await wait_until("replaced", lambda: len(agent.started) == 2, timeout=5)
        nursery.cancel_scope.cancel()


async def test_reports_keep_the_newest_and_a_removed_shard_stays_removed() -> None:
    registry, _ = make(replicas=0)
    _, _, session = await register(registry, "a")
    spec = model.ShardSpec(shard_id="s1", model="m", engine="llama-server", processes=(), port=9000)
    registry.note_shard("a", report(spec, "ready", seq=3))
    registry.note_shard("a", report(spec, "starting", seq=2))  # older: dropped
    rec = registry.record("a")
    assert rec is not None
    assert [(s.state, s.seq) for s in rec.shards] == [("ready", 3)]
    await session.shard_status(report(spec, "unhealthy", seq=4))
    assert [(s.state, s.seq) for s in rec.shards] == [("unhealthy", 4)]
    # An older agent sends no seq (0): every report is applied, as before.
    registry.note_shard("a", report(spec, "ready"))
    assert [(s.state, s.seq) for s in rec.shards] == [("ready", 0)]
    await session.shard_status(report(spec, "ready", seq=5))
    registry.forget_shard("a", "s1")
    registry.note_shard("a", report(spec, "starting", seq=1))  # a late reply: still gone
    assert rec.shards == ()
    await session.shard_status(report(spec, "loading", seq=6))  # newer: it is back
    assert [(s.state, s.seq) for s in rec.shards] == [("loading", 6)]
    await session.shard_status(report(spec, "stopped", seq=7))
    await session.shard_status(report(spec, "ready", seq=6))
    assert rec.shards == ()
