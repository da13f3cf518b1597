"""The event log: why a replica went, kept for a while, bounded, and fed by the registry."""

from __future__ import annotations

import ast
from pathlib import Path

import trio
import trio.testing

from llmgw import core, model
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._observe._events import (
    COMMAND_STUCK,
    NODE_STATE,
    REPLICA_STOPPED,
    SHARD_FAILED,
    SHARD_UNHEALTHY,
    EventLog,
    split_reason,
)
from llmgw.rpc import PeerInfo

KILLED = (
    "engine (pid 4242) was killed by SIGKILL; last output:\n"
    "[stderr] ERROR 05-02 10:00:00 [core.py:700] EngineCore encountered a fatal error.\n"
    "[stdout] INFO 05-02 09:59:58 Uvicorn running on http://127.0.0.1:8123"
)


def failed(
    shard_id: str = "chat-abc123.0", reason: str | None = KILLED, **kw: object
) -> model.ShardReport:
    fields: dict[str, object] = {
        "shard_id": shard_id,
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "engine": "vllm",
        "state": "failed",
        "reason": reason,
        "replica_id": shard_id.rsplit(".", 1)[0],
        "model_name": "chat",
    }
    fields.update(kw)
    return model.ShardReport(**fields)  # type: ignore[arg-type]


class Clocks:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_700_000_000.0

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s


def log_with(clocks: Clocks, **kw: float) -> EventLog:
    return EventLog(clock=lambda: clocks.mono, wall=lambda: clocks.wall, **kw)  # type: ignore[arg-type]


def test_split_reason_takes_the_first_line_as_the_summary() -> None:
    head, lines = split_reason(KILLED)
    assert head == "engine (pid 4242) was killed by SIGKILL"
    assert lines[0].startswith("[stderr] ERROR") and "Uvicorn running" in lines[1]
    assert split_reason(None) == ("no reason given", ())
    assert split_reason("health check failed 3 times") == ("health check failed 3 times", ())


def test_a_failed_shard_is_its_replicas_last_failure_with_its_output() -> None:
    clocks = Clocks()
    log = log_with(clocks)
    assert log.shard_report("gpu-1", failed()) is not None
    f = log.last_failure("chat-abc123")
    assert f is not None
    assert f.reason == "engine (pid 4242) was killed by SIGKILL"
    assert f.lines[-1] == "[stdout] INFO 05-02 09:59:58 Uvicorn running on http://127.0.0.1:8123"
    assert (f.node_id, f.shard_id, f.model_name, f.kind) == (
        "gpu-1", "chat-abc123.0", "chat", SHARD_FAILED
    )  # fmt: skip
    assert f.at == clocks.wall
    # The same report again (a registration repeats it) is not a second event.
    assert log.shard_report("gpu-1", failed()) is None
    assert [e.kind for e in log.events()] == [SHARD_FAILED]
    # Reports in other states are not events.
    assert log.shard_report("gpu-1", failed("x.0", state="ready")) is None


def test_the_stop_that_follows_does_not_hide_the_shards_own_reason() -> None:
    clocks = Clocks()
    log = log_with(clocks)
    log.shard_report("gpu-1", failed())
    log.replica_stopped(
        node_id="gpu-1",
        shard_id="chat-abc123.0",
        reason="replica chat-abc123 failed: rank 0 on gpu-1 failed: " + KILLED,
        replica_id="chat-abc123",
        model_name="chat",
        state="failed",
    )
    f = log.last_failure("chat-abc123")
    assert f is not None and f.kind == SHARD_FAILED and "SIGKILL" in f.reason
    stop = log.events(replica_id="chat-abc123")[-1]
    assert stop.kind == REPLICA_STOPPED
    assert stop.lines == ()  # the output is on the shard's own event, once
    assert stop.message == (
        "stopping shard chat-abc123.0: replica chat-abc123 failed: rank 0 on gpu-1 failed: "
        "engine (pid 4242) was killed by SIGKILL"
    )


def test_a_stop_is_a_failure_only_when_the_replica_is_being_replaced() -> None:
    clocks = Clocks()
    log = log_with(clocks)
    common = {"node_id": "gpu-1", "model_name": "chat"}
    log.replica_stopped(shard_id="a.0", replica_id="a", state="timed-out",
                        reason="replica a timed-out: not ready within its startup timeout of 30 s",
                        **common)  # type: ignore[arg-type]  # fmt: skip
    log.replica_stopped(shard_id="b.0", replica_id="b", state="extra",
                        reason="chat wants 1 replicas", **common)  # type: ignore[arg-type]  # fmt: skip
    a = log.last_failure("a")
    assert a is not None and a.reason.endswith("not ready within its startup timeout of 30 s")
    assert log.last_failure("b") is None


def test_retention_a_minute_later_still_there_gone_after_the_window() -> None:
    clocks = Clocks()
    log = log_with(clocks, failure_retention_s=900)
    log.shard_report("gpu-1", failed())
    clocks.advance(60)
    assert log.last_failure("chat-abc123") is not None
    clocks.advance(839)
    assert log.last_failure("chat-abc123") is not None
    clocks.advance(2)
    assert log.last_failure("chat-abc123") is None
    assert log.predecessor_failure("chat", started=None, present=()) is None
    # The event itself stays in its ring: only the "last failure" expires.
    assert [e.kind for e in log.events(replica_id="chat-abc123")] == [SHARD_FAILED]


def test_the_replacement_shows_why_its_predecessor_went() -> None:
    clocks = Clocks()
    log = log_with(clocks)
    survivor_since = clocks.mono - 300  # the other replica of the model, older than the failure
    log.shard_report("gpu-1", failed())
    clocks.advance(1)
    replacement_since = clocks.mono
    f = log.predecessor_failure("chat", started=replacement_since, present=["chat-new", "chat-old"])
    assert f is not None and f.replica_id == "chat-abc123"
    assert log.predecessor_failure("chat", started=survivor_since, present=["chat-new"]) is None
    # While the failed replica is still listed, the failure is its own, not a predecessor's.
    assert (
        log.predecessor_failure("chat", started=replacement_since, present=["chat-abc123"]) is None
    )
    assert log.predecessor_failure("other", started=None, present=()) is None


def test_a_lost_node_is_the_failure_of_what_ran_there() -> None:
    clocks = Clocks()
    log = log_with(clocks)
    log.node_state("gpu-2", "unreachable", "lost", "no heartbeat for 60 s",
                   replicas=[("chat-x", "chat", "chat-x.0")])  # fmt: skip
    f = log.last_failure("chat-x")
    assert f is not None and f.reason == "node gpu-2 is lost (no heartbeat for 60 s)"
    assert [e.message for e in log.events(node_id="gpu-2")] == [
        "node gpu-2: unreachable -> lost (no heartbeat for 60 s)",
        "replica chat-x lost with node gpu-2 (no heartbeat for 60 s)",
    ]
    assert all(e.kind == NODE_STATE for e in log.events(node_id="gpu-2"))


def test_unhealthy_and_stuck_commands_are_events() -> None:
    clocks = Clocks()
    log = log_with(clocks)
    reason = "/health failed 3 times in a row\nGET /health: timed out after 5 s"
    log.shard_report("gpu-1", failed(state="unhealthy", reason=reason))
    f = log.last_failure("chat-abc123")
    assert f is not None and f.kind == SHARD_UNHEALTHY
    assert f.reason == "/health failed 3 times in a row"
    assert f.lines == ("GET /health: timed out after 5 s",)
    log.command_stuck("gpu-3", "node gpu-3 did not answer stopShard in 40 s", shard_id="s.0")
    assert log.events(node_id="gpu-3")[-1].kind == COMMAND_STUCK
    # A stuck start is why its replica never ran.
    log.command_stuck("gpu-3", "node gpu-3 did not answer startShard in 10 s", shard_id="r.0",
                      replica_id="r", model_name="chat")  # fmt: skip
    stuck = log.last_failure("r")
    assert stuck is not None and stuck.reason == "node gpu-3 did not answer startShard in 10 s"
    assert stuck.kind == COMMAND_STUCK


def test_rings_are_bounded_per_key_and_overall_and_filters_combine() -> None:
    clocks = Clocks()
    log = log_with(clocks, per_key=3, keys=2, total=5)
    for i in range(10):
        log.record("x", f"m{i}", node_id="n1", replica_id="r1")
    log.record("x", "quiet", node_id="n2", replica_id="r2")
    assert [e.message for e in log.events(replica_id="r1")] == ["m7", "m8", "m9"]
    # The chatty replica did not push the quiet one's story out.
    assert [e.message for e in log.events(replica_id="r2")] == ["quiet"]
    assert len(log.events(limit=1000)) == 5
    assert [e.message for e in log.events(limit=2)] == ["m9", "quiet"]
    assert log.events(replica_id="r1", node_id="n2") == ()
    seqs = [e.seq for e in log.events()]
    assert seqs == sorted(seqs)
    log.record("x", "third", replica_id="r3")  # a third replica key: the oldest key goes
    assert log.events(replica_id="r1") == ()
    assert log.statistics()["replicas"] == 2


def test_reading_never_changes_it() -> None:
    clocks = Clocks()
    log = log_with(clocks, failure_retention_s=10)
    log.shard_report("gpu-1", failed())
    before = log.statistics()
    clocks.advance(60)
    assert log.last_failure("chat-abc123") is None
    log.events()
    log.predecessor_failure("chat", started=None, present=())
    assert log.statistics() == before  # expired, but dropped only when something new comes


def test_the_event_log_does_no_io() -> None:
    source = Path(__file__).resolve().parents[2] / "llmgw" / "cp" / "_observe" / "_events.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names & {"trio", "capnp", "httpx", "os", "pathlib", "socket"} == set()


class _Agent:
    released = False

    def release(self) -> None:
        self.released = True


async def test_registry_feeds_it_and_retention_runs_on_the_trio_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = NodeRegistry(core.LivenessPolicy(heartbeat_interval_s=1, lost_after_s=5))
    peer = PeerInfo(conn_id=1, address="127.0.0.1:5555", common_name="gpu-1", closed=trio.Event())
    hello = model.Hello("gpu-1", "0.1", model.Inventory(host=model.Host("gpu-1")))
    _session, _settings = await registry.register(peer, hello, _Agent())  # type: ignore[arg-type]
    rec = registry.record("gpu-1")
    assert rec is not None
    registry.on_shard_status("gpu-1", rec.generation, failed())
    assert [e.kind for e in registry.events.events(node_id="gpu-1")] == [NODE_STATE, SHARD_FAILED]
    assert registry.events.events(node_id="gpu-1")[0].message == (
        "node gpu-1: new -> ready (registered from 127.0.0.1:5555)"
    )
    await trio.sleep(60)
    f = registry.events.last_failure("chat-abc123")
    assert f is not None and f.reason == "engine (pid 4242) was killed by SIGKILL"
    await trio.sleep(registry.events.failure_retention_s - 60 + 1)
    assert registry.events.last_failure("chat-abc123") is None
    # A node state change is recorded with its reason.
    registry.tick()  # silent for long past lost_after_s: lost
    kinds = [e.message for e in registry.events.events(node_id="gpu-1")]
    assert kinds[-1].startswith("node gpu-1: ready -> ") and "(" in kinds[-1], kinds
    rec.agent = None  # its connection is gone: it may be forgotten
    registry.forget("gpu-1", "retired")
    last = registry.events.events(node_id="gpu-1")[-1]
    assert last.message.endswith("-> forgotten (retired)"), last


class _Reconciler:
    """What the admin API reads from the reconciler: its replica views."""

    def __init__(self) -> None:
        self.views: list[core.ReplicaView] = []

    def replicas(self) -> list[core.ReplicaView]:
        return list(self.views)

    def unplaced(self) -> list[object]:
        return []

    def backoffs(self) -> dict[str, core.Backoff]:
        return {}


async def test_replicas_rows_show_the_predecessors_failure_for_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from llmgw.cp._admin import AdminApp

    registry = NodeRegistry(core.LivenessPolicy())
    reconciler = _Reconciler()
    admin = AdminApp(registry, "k", reconciler=reconciler, catalog=object())  # type: ignore[arg-type]
    registry.events.shard_report("cpu-1", failed())
    await trio.sleep(1)
    # The replacement, started after the failure; the failed replica is gone.
    new = core.ReplicaView("chat-def456", "chat", "ready", ("cpu-1",), trio.current_time(),
                           False, None)  # fmt: skip
    reconciler.views = [new]
    await trio.sleep(60)
    (row,) = admin._models.replica_rows()
    assert row["replica"] == "chat-def456"
    assert row["last_failure"]["replica_id"] == "chat-abc123"
    assert row["last_failure"]["reason"] == "engine (pid 4242) was killed by SIGKILL"
    assert row["last_failure"]["lines"][-1].endswith("Uvicorn running on http://127.0.0.1:8123")
    await trio.sleep(registry.events.failure_retention_s)
    (row,) = admin._models.replica_rows()
    assert row["last_failure"] is None
