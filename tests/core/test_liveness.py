from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw import core
from llmgw.core import ConnectionLost, HeartbeatSeen, NodeState, Registered, Tick

POLICY = core.LivenessPolicy(heartbeat_interval_s=5, missed_heartbeats=3, lost_after_s=60)


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
