from __future__ import annotations

import itertools

import attrs
import pytest
from helpers import doc_table
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core
from llmgw.core import ConnectionLost, HeartbeatSeen, NodeState, Registered, Tick, _liveness
from llmgw.core._liveness import (
    TRANSITIONS,
    InvalidTransition,
    LivenessEvent,
    classify,
    next_state,
)

POLICY = core.LivenessPolicy(heartbeat_interval_s=5, missed_heartbeats=3, lost_after_s=60)
READY, UNREACHABLE, LOST = NodeState.READY, NodeState.UNREACHABLE, NodeState.LOST

# The table as the design states it, written out again here so that a change to
# the module's table is a deliberate change to this test too.
EXPECTED = {
    (READY, "register"): READY,
    (READY, "heartbeat"): READY,
    (READY, "disconnect"): UNREACHABLE,
    (READY, "tick"): READY,
    (READY, "missed"): UNREACHABLE,
    (UNREACHABLE, "register"): READY,
    (UNREACHABLE, "heartbeat"): READY,
    (UNREACHABLE, "late_heartbeat"): UNREACHABLE,
    (UNREACHABLE, "disconnect"): UNREACHABLE,
    (UNREACHABLE, "tick"): UNREACHABLE,
    (UNREACHABLE, "lost_after"): LOST,
    (LOST, "register"): READY,
    (LOST, "heartbeat"): READY,
    (LOST, "late_heartbeat"): LOST,
    (LOST, "disconnect"): LOST,
    (LOST, "tick"): LOST,
}


def test_module_table_is_the_designed_table() -> None:
    assert {(s, e.value): v for (s, e), v in TRANSITIONS.items()} == EXPECTED


def test_the_docstring_draws_the_module_table() -> None:
    drawn = doc_table(_liveness.__doc__)
    assert drawn == {(s.value, e.value): v.value for (s, e), v in TRANSITIONS.items()}
    # Every state is a column and every event a row, even where a row is all `-`.
    header = next(line for line in (_liveness.__doc__ or "").splitlines() if "| event" in line)
    assert [c.strip() for c in header.strip("| ").split("|")][1:] == [s.value for s in NodeState]


@pytest.mark.parametrize(("state", "event"), list(itertools.product(NodeState, LivenessEvent)))
def test_every_pair_is_in_the_table_or_invalid(state: NodeState, event: LivenessEvent) -> None:
    if (state, event.value) in EXPECTED:
        assert next_state(state, event) is EXPECTED[(state, event.value)]
    else:
        with pytest.raises(InvalidTransition, match=f"{event.value!r}.*{state.value!r}"):
            next_state(state, event)


def run(events: list[core.Event]) -> core.Liveness:
    live = core.registered(0.0)
    for event in events:
        live = core.step(live, event, POLICY)
    return live


def test_missed_heartbeats_then_lost_then_back() -> None:
    live = core.registered(0.0)
    live = core.step(live, Tick(15.0), POLICY)
    assert live.state is NodeState.READY  # 15 s of silence is exactly the limit
    live = core.step(live, Tick(15.5), POLICY)
    assert live.state is NodeState.UNREACHABLE
    assert live.reason == "missed 3 heartbeats (last seen 16 s ago)"
    live = core.step(live, Tick(75.0), POLICY)
    assert live.state is NodeState.UNREACHABLE
    live = core.step(live, Tick(75.5), POLICY)
    assert live.state is NodeState.LOST
    assert live.reason.startswith("unreachable for 60 s")
    live = core.step(live, Registered(80.0), POLICY)
    assert (live.state, live.reason, live.since) == (NodeState.READY, "registered", 80.0)


def test_connection_lost_is_unreachable_at_once_and_late_heartbeats_do_not_revive() -> None:
    live = core.step(core.registered(0.0), ConnectionLost(3.0), POLICY)
    assert (live.state, live.reason, live.connected) == (
        NodeState.UNREACHABLE,
        "connection lost",
        False,
    )
    assert core.step(live, HeartbeatSeen(4.0), POLICY) == live


def test_heartbeats_resume_a_silent_but_connected_node() -> None:
    live = core.step(core.registered(0.0), Tick(20.0), POLICY)
    assert live.state is NodeState.UNREACHABLE
    live = core.step(live, HeartbeatSeen(21.0), POLICY)
    assert (live.state, live.reason) == (NodeState.READY, "heartbeats resumed")


times = st.floats(min_value=0, max_value=1000, allow_nan=False)
events = st.lists(
    st.one_of(
        times.map(Registered), times.map(HeartbeatSeen), times.map(ConnectionLost), times.map(Tick)
    ),
    max_size=30,
).map(lambda evs: sorted(evs, key=lambda e: e.now))


@given(events)
def test_every_state_change_has_a_reason_and_time_never_runs_back(evs: list[core.Event]) -> None:
    live = core.registered(0.0)
    for event in evs:
        after = core.step(live, event, POLICY)
        if after.state is not live.state:
            assert after.reason and after.since == event.now
        assert after.since >= live.since or isinstance(event, Registered)
        live = after


@given(events)
def test_ready_means_seen_recently_or_not_yet_ticked(evs: list[core.Event]) -> None:
    live = run([*evs, Tick(2000.0)])
    if live.state is NodeState.READY:
        assert 2000.0 - live.last_seen <= POLICY.silence_limit_s


@given(events)
def test_lost_only_after_unreachable_long_enough(evs: list[core.Event]) -> None:
    live = core.registered(0.0)
    unreachable_since = None
    for event in evs:
        after = core.step(live, event, POLICY)
        if after.state is NodeState.UNREACHABLE and live.state is not NodeState.UNREACHABLE:
            unreachable_since = after.since
        if after.state is NodeState.LOST and live.state is not NodeState.LOST:
            assert live.state is NodeState.UNREACHABLE
            assert unreachable_since is not None
            assert event.now - unreachable_since >= POLICY.lost_after_s
        live = after


def reference_step(
    live: core.Liveness, event: core.Event, policy: core.LivenessPolicy
) -> core.Liveness:
    """The machine as plain if/else (the module before its table), to hold the table to."""
    if isinstance(event, Registered):
        return core.registered(event.now)
    if isinstance(event, HeartbeatSeen):
        if not live.connected:
            return live
        if live.state is READY:
            return attrs.evolve(live, last_seen=event.now)
        return core.Liveness(READY, event.now, "heartbeats resumed", event.now, True)
    if isinstance(event, ConnectionLost):
        if live.state is READY:
            return core.Liveness(UNREACHABLE, event.now, "connection lost", live.last_seen, False)
        return attrs.evolve(live, connected=False)
    now = event.now
    silent = now - live.last_seen
    if live.state is READY and silent > policy.silence_limit_s:
        return core.Liveness(
            UNREACHABLE,
            now,
            f"missed {policy.missed_heartbeats} heartbeats (last seen {silent:.0f} s ago)",
            live.last_seen,
            live.connected,
        )
    if live.state is UNREACHABLE and now - live.since >= policy.lost_after_s:
        return core.Liveness(
            LOST,
            now,
            f"unreachable for {now - live.since:.0f} s ({live.reason})",
            live.last_seen,
            live.connected,
        )
    return live


def follows_the_table(live: core.Liveness, event: core.Event) -> core.Liveness:
    kind = classify(live, event, POLICY)
    after = core.step(live, event, POLICY)
    assert (live.state, kind) in TRANSITIONS
    assert after.state is TRANSITIONS[(live.state, kind)]
    assert after == reference_step(live, event, POLICY)
    return after


@given(events)
def test_random_walks_follow_the_table_and_the_reference(evs: list[core.Event]) -> None:
    live = core.registered(0.0)
    for event in evs:
        live = follows_the_table(live, event)


def test_every_pair_of_the_table_is_reached_and_followed() -> None:
    """From each state, every kind of input at every interesting clock value.

    Exhaustive rather than drawn, so that covering the whole table is certain.
    """
    starts: list[tuple[NodeState, list[core.Event]]] = [
        (READY, []),
        (UNREACHABLE, [Tick(16.0)]),  # silent, still connected
        (UNREACHABLE, [ConnectionLost(1.0)]),
        (LOST, [Tick(16.0), Tick(76.0)]),
        (LOST, [ConnectionLost(1.0), Tick(61.0)]),
    ]
    seen: set[tuple[NodeState, LivenessEvent]] = set()
    inputs: list[type[core.Event]] = [Registered, HeartbeatSeen, ConnectionLost, Tick]
    for (state, recipe), make, dt in itertools.product(starts, inputs, [0.0, 15.5, 60.0, 100.0]):
        live = core.registered(0.0)
        for event in recipe:
            live = follows_the_table(live, event)
        assert live.state is state
        probe = make(live.since + dt)
        seen.add((state, classify(live, probe, POLICY)))
        follows_the_table(live, probe)
    assert seen == set(TRANSITIONS)


def test_the_pairs_left_out_are_those_no_input_can_reach() -> None:
    """A late heartbeat cannot come to a ready node (ready implies connected, below); the
    silence and lost guards are asked only in ready and unreachable respectively."""
    missing = set(itertools.product(NodeState, LivenessEvent)) - set(TRANSITIONS)
    assert missing == {
        (READY, LivenessEvent.LATE_HEARTBEAT),
        (READY, LivenessEvent.LOST_AFTER),
        (UNREACHABLE, LivenessEvent.MISSED),
        (LOST, LivenessEvent.MISSED),
        (LOST, LivenessEvent.LOST_AFTER),
    }


@given(events)
def test_ready_implies_connected(evs: list[core.Event]) -> None:
    live = core.registered(0.0)
    for event in evs:
        live = core.step(live, event, POLICY)
        assert live.connected or live.state is not READY
