"""The event log kept in the store (llmgw/cp/_observe/_event_keeper.py): written off the
request path, nothing lost while the store is out, retried with backoff, bounded, and
read back by another control plane as the one that recorded it held it."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from llmgw import model
from llmgw.cp._observe import _event_codec
from llmgw.cp._observe._event_keeper import EventKeeper
from llmgw.cp._observe._events import (
    NODE_STATE,
    REPLICA_STOPPED,
    SHARD_FAILED,
    Event,
    EventLog,
    Recorded,
)
from llmgw.errors import PeerError, UsageError
from llmgw.store import SqlStore, open_store

KILLED = "engine (pid 4242) was killed by SIGKILL; last output:\n[stderr] CUDA error: out of memory"


def failed() -> model.ShardReport:
    return model.ShardReport(
        shard_id="chat-abc123.0", model="Qwen/Qwen2.5-7B-Instruct", engine="vllm",
        state=model.ShardState.FAILED, reason=KILLED, replica_id="chat-abc123",
        model_name="chat",
    )  # fmt: skip


class Clocks:
    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, 1_700_000_000.0

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s


def log_with(clocks: Clocks, **kw: int) -> EventLog:
    return EventLog(clock=lambda: clocks.mono, wall=lambda: clocks.wall, **kw)


class Rows:
    """The store's events table in memory; `down` makes every call fail as a lost
    connection does. `tries` records the trio time of each write attempt."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, str]] = []
        self.down = False
        self.tries: list[float] = []

    async def add_events(self, rows: Sequence[tuple[float, str]], keep: int) -> None:
        self.tries.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if self.down:
            raise PeerError("store postgresql://db:5432/llmgw: connection refused")
        for at, body in rows:
            self.rows.append((len(self.rows) + 1, at, body))
        self.rows = self.rows[-keep:]

    async def recent_events(self, limit: int) -> list[tuple[int, float, str]]:
        await trio.lowlevel.checkpoint()
        if self.down:
            raise PeerError("store postgresql://db:5432/llmgw: connection refused")
        return self.rows[-limit:]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStore]:
    s = await open_store(tmp_path / "state", timeout_s=10)
    try:
        yield s
    finally:
        await s.aclose()


def _messages(rows: Rows) -> list[str]:
    return [_event_codec.decode(s, a, b).event.message for s, a, b in rows.rows]


async def test_a_store_outage_loses_nothing_and_is_retried_with_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clocks = Clocks()
    log = log_with(clocks)
    rows = Rows()
    keeper = EventKeeper(log, rows, flush_s=0.5, retry_min_s=1.0, retry_max_s=4.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        log.record(NODE_STATE, "one")
        await trio.sleep(1)
        assert _messages(rows) == ["one"] and log.statistics()["unsaved"] == 0
        rows.down = True
        log.record(NODE_STATE, "two")
        log.record(NODE_STATE, "three")
        await trio.sleep(20)
        # Shown all along; still to be written; tried again 1, 2, 4, 4, ... s apart.
        assert [e.message for e in log.events()] == ["one", "two", "three"]
        assert log.statistics()["unsaved"] == 2 and keeper.failures >= 4
        fails = rows.tries[1:]
        gaps = [round(b - a, 1) for a, b in itertools.pairwise(fails)]
        assert gaps[:4] == [1.0, 2.0, 4.0, 4.0], gaps
        log.record(NODE_STATE, "four")  # recorded during the outage: kept too
        rows.down = False
        await trio.sleep(5)
        assert _messages(rows) == ["one", "two", "three", "four"]  # in order, none twice
        assert log.statistics()["unsaved"] == 0 and keeper.written == 4
        nursery.cancel_scope.cancel()


def test_what_waits_for_the_store_is_bounded_and_the_oldest_goes_first() -> None:
    log = log_with(Clocks(), unsaved=3)
    for i in range(5):
        log.record(NODE_STATE, f"e{i}")
    assert [r.event.message for r in log.unsaved(10)] == ["e2", "e3", "e4"]
    assert log.statistics()["unsaved_dropped"] == 2
    assert len(log.events()) == 5  # the log in memory keeps its own bound
    log.saved(log.unsaved(1)[0].event.seq)
    assert [r.event.message for r in log.unsaved(10)] == ["e3", "e4"]


async def test_another_control_plane_reads_the_log_as_it_was_recorded(store: SqlStore) -> None:
    """Failover in miniature: control plane A records and writes; B (a standby with a log
    of its own) reads the store at its election and holds what A held: the events in
    order, each replica's failure for "why was this replaced", and the repeat suppression
    (an agent re-registering with B reports its failed shard again: no second event)."""
    clocks = Clocks()
    a = log_with(clocks)
    a.node_state("gpu-1", "new", "ready", "registered from 10.0.0.1:4000")
    a.shard_report("gpu-1", failed())
    a.replica_stopped(node_id="gpu-1", shard_id="chat-abc123.0", reason="failed",
                      replica_id="chat-abc123", model_name="chat", state="failed")  # fmt: skip
    fault = model.GpuFault("xid", "GPU has fallen off the bus", True, 1.0, xid=79,
                           line="NVRM: Xid (PCI:0000:01:00): 79")  # fmt: skip
    a.gpu_faults("gpu-1", [model.GpuUsage(0, faults=(fault,))])
    writer = EventKeeper(a, store, keep=100)
    assert await writer.flush() == 4 and a.statistics()["unsaved"] == 0

    clocks.advance(30)
    b = log_with(clocks)
    b.record(NODE_STATE, "b's own, not yet written")
    reader = EventKeeper(b, store, keep=100)
    await reader.load()
    want = [(e.kind, e.message, e.at, e.lines) for e in a.events()]
    got = [(e.kind, e.message, e.at, e.lines) for e in b.events()]
    assert got[:-1] == want and got[-1][1] == "b's own, not yet written"
    assert [e.seq for e in b.events()] == [1, 2, 3, 4, 5]
    assert [r.event.message for r in b.unsaved(10)] == ["b's own, not yet written"]
    assert b.last_failure("chat-abc123") == a.last_failure("chat-abc123")
    f = b.last_failure("chat-abc123")
    assert f is not None and f.reason == "engine (pid 4242) was killed by SIGKILL"
    assert f.kind == SHARD_FAILED  # the shard's own reason, not the stop's weaker one
    assert b.predecessor_failure("chat", started=None, present=()) == f
    assert b.shard_report("gpu-1", failed()) is None  # the same report again: no event
    assert b.gpu_faults("gpu-1", [model.GpuUsage(0, faults=(fault,))]) == []
    assert [e.kind for e in b.events(replica_id="chat-abc123")] == [SHARD_FAILED, REPLICA_STOPPED]
    # Past the failure window (counted from when it happened, not from the read):
    clocks.advance(b.failure_retention_s)
    c = log_with(clocks)
    await EventKeeper(c, store, keep=100).load()
    assert c.last_failure("chat-abc123") is None and len(c.events()) == 4


async def test_the_store_keeps_the_newest_events_kept(store: SqlStore) -> None:
    log = log_with(Clocks())
    for i in range(7):
        log.record(NODE_STATE, f"e{i}")
    await EventKeeper(log, store, keep=3, batch=2).flush()
    fresh = log_with(Clocks())
    keeper = EventKeeper(fresh, store, keep=3)
    await keeper.load()
    assert [e.message for e in fresh.events()] == ["e4", "e5", "e6"] and keeper.loaded == 3
    assert len(await store.recent_events(100)) == 3


async def test_a_row_that_cannot_be_read_is_skipped_and_named(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    good = Recorded(log_with(Clocks()).record(NODE_STATE, "fine"))
    bad_seen = '{"kind":"gpu-fault","message":"m","seen":["gpu","n1","zero","xid",79,"l"]}'
    rows = [(1.0, "{not json"), (2.0, bad_seen), (3.0, '{"kind":5,"message":"m"}')]
    await store.add_events([*rows, _event_codec.encode(good)], keep=10)
    fresh = log_with(Clocks())
    keeper = EventKeeper(fresh, store, keep=10)
    await keeper.load()
    assert [e.message for e in fresh.events()] == ["fine"] and keeper.unreadable == 3
    assert "stored event 1: not JSON" in caplog.text
    assert "stored event 2: seen: expected" in caplog.text and "'zero'" in caplog.text
    assert "stored event 3: kind: expected text, got 5" in caplog.text


async def test_reload_is_retried_until_the_store_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rows = Rows()
    first = log_with(Clocks())
    first.record(NODE_STATE, "before the failover")
    await EventKeeper(first, rows).flush()
    log = log_with(Clocks())
    keeper = EventKeeper(log, rows, retry_min_s=1.0)
    rows.down = True
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        keeper.reload()
        await trio.sleep(3)
        assert log.events() == () and keeper.failures >= 1
        rows.down = False
        await trio.sleep(5)
        assert [e.message for e in log.events()] == ["before the failover"]
        nursery.cancel_scope.cancel()


_text = st.text(max_size=20)
_opt = st.none() | _text
_seen = (
    st.none()
    | st.tuples(st.just("shard"), _text, _text, _text, _opt)
    | st.tuples(
        st.just("gpu"), _text, st.integers(0, 64), _text, st.none() | st.integers(0, 200), _text
    )
)


@given(
    st.builds(
        Recorded,
        st.builds(
            Event,
            seq=st.integers(1, 10**9),
            at=st.floats(0, 4e9),
            kind=_text,
            message=_text,
            node_id=_opt,
            replica_id=_opt,
            model_name=_opt,
            shard_id=_opt,
            lines=st.lists(_text, max_size=3).map(tuple),
        ),
        failure=_opt,
        strong=st.booleans(),
        seen=_seen,
    )
)
def test_a_stored_event_reads_back_as_it_was_written(rec: Recorded) -> None:
    at, body = _event_codec.encode(rec)
    back = _event_codec.decode(rec.event.seq, at, body)
    want = rec if rec.failure is not None else attrs.evolve(rec, strong=False)
    assert back == want


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(["kind", "message", "node", "lines", "seen", "failure",
                                        "strong", "replica"]), _json) | _json)  # fmt: skip
def test_any_stored_body_is_read_or_refused_with_our_error(body: object) -> None:
    """Parse or raise UsageError: a row another llmgw wrote never stops a load."""
    try:
        rec = _event_codec.decode(7, 1.0, json.dumps(body))
    except UsageError as exc:
        assert str(exc).startswith("stored event 7: ")
        return
    log = log_with(Clocks())
    log.replace([rec])  # and replaying it never raises either
    assert len(log.events()) == 1
