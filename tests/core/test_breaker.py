from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core._breaker import (
    TRANSITIONS,
    Breaker,
    BreakerConfig,
    BreakerEvent,
    BreakerState,
    InvalidTransition,
    next_state,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
CONFIG = BreakerConfig(failure_threshold=3, open_s=10.0, probe_timeout_s=30.0)

# The table as the design states it, written out again here so that a change to
# the module's table is a deliberate change to this test too.
EXPECTED = {
    (CLOSED, "allow"): (CLOSED, True),
    (CLOSED, "success"): (CLOSED, None),
    (CLOSED, "failure"): (CLOSED, None),
    (CLOSED, "trip"): (OPEN, None),
    (CLOSED, "cancel"): (CLOSED, None),
    (OPEN, "allow"): (OPEN, False),
    (OPEN, "cooldown_over"): (HALF_OPEN, True),
    (OPEN, "success"): (OPEN, None),
    (OPEN, "failure"): (OPEN, None),
    (OPEN, "cancel"): (OPEN, None),
    (HALF_OPEN, "allow"): (HALF_OPEN, False),
    (HALF_OPEN, "probe_timeout"): (HALF_OPEN, True),
    (HALF_OPEN, "success"): (CLOSED, None),
    (HALF_OPEN, "failure"): (OPEN, None),
    (HALF_OPEN, "cancel"): (OPEN, None),
    (CLOSED, "broken"): (CLOSED, None),
    (OPEN, "broken"): (OPEN, None),
    (HALF_OPEN, "broken"): (OPEN, None),
    (CLOSED, "complete"): (CLOSED, None),
    (OPEN, "complete"): (OPEN, None),
    (HALF_OPEN, "complete"): (HALF_OPEN, None),
}


def test_module_table_is_the_designed_table() -> None:
    assert {(s, e.value): v for (s, e), v in TRANSITIONS.items()} == EXPECTED


@pytest.mark.parametrize(("state", "event"), list(itertools.product(BreakerState, BreakerEvent)))
def test_every_pair_is_in_the_table_or_invalid(state: BreakerState, event: BreakerEvent) -> None:
    if (state, event.value) in EXPECTED:
        assert next_state(state, event) == EXPECTED[(state, event.value)]
    else:
        with pytest.raises(InvalidTransition, match=f"{event.value!r}.*{state.value!r}"):
            next_state(state, event)


def tripped(now: float = 0.0) -> Breaker:
    b = Breaker(CONFIG, name="ep-1")
    for _ in range(CONFIG.failure_threshold):
        assert b.allow(now)
        b.failure(now)
    assert b.state is OPEN
    return b


def test_threshold_consecutive_failures_open_it_and_a_success_resets_the_count() -> None:
    b = Breaker(CONFIG)
    b.failure(0.0)
    b.failure(0.0)
    b.success(0.0)
    b.failure(0.0)
    b.failure(0.0)
    assert (b.state, b.consecutive_failures) == (CLOSED, 2)
    b.failure(1.0)
    assert b.state is OPEN
    assert b.statistics()["since"] == 1.0
    assert b.statistics()["opened_total"] == 1


def test_open_refuses_until_open_s_then_allows_exactly_one_probe() -> None:
    b = tripped(0.0)
    assert not b.allow(9.99)
    assert not b.would_allow(9.99)
    assert b.would_allow(10.0)
    assert b.state is OPEN  # would_allow took nothing
    assert b.allow(10.0)
    assert b.state is HALF_OPEN
    assert not b.allow(10.0)
    assert not b.allow(20.0)
    assert not b.would_allow(20.0)
    stats = b.statistics()
    assert (stats["probes_total"], stats["refused_total"]) == (1, 3)


def test_probe_success_closes() -> None:
    b = tripped(0.0)
    assert b.allow(10.0)
    b.success(11.0)
    assert (b.state, b.consecutive_failures) == (CLOSED, 0)
    assert b.allow(11.0)


def test_probe_failure_reopens_and_restarts_the_timer() -> None:
    b = tripped(0.0)
    assert b.allow(10.0)
    b.failure(15.0)
    assert b.state is OPEN
    assert not b.allow(24.9)  # 10 s from the probe's failure, not from the first opening
    assert b.allow(25.0)
    assert b.statistics()["opened_total"] == 2


def test_late_outcomes_in_open_change_nothing() -> None:
    b = tripped(0.0)
    b.success(1.0)
    b.failure(2.0)
    b.cancel(3.0)
    assert b.state is OPEN
    assert b.statistics()["since"] == 0.0
    assert b.allow(10.0)  # the late failure did not restart the timer


def test_cancelled_probe_lets_the_next_request_probe_at_once() -> None:
    b = tripped(0.0)
    assert b.allow(10.0)
    b.cancel(12.0)
    assert b.state is OPEN
    assert b.allow(12.0)
    assert b.state is HALF_OPEN


def test_a_probe_never_reported_is_presumed_lost_after_probe_timeout() -> None:
    b = tripped(0.0)
    assert b.allow(10.0)
    assert not b.allow(39.9)
    assert b.allow(40.0)
    assert not b.allow(40.0)
    assert b.statistics()["probes_total"] == 2


def test_repr_and_statistics_say_where_it_stands() -> None:
    b = tripped(5.0)
    assert repr(b) == "<Breaker ep-1 open since 5, 3/3 consecutive failures, opened 1 times>"
    assert b.statistics() == {
        "name": "ep-1",
        "state": "open",
        "since": 5.0,
        "consecutive_failures": 3,
        "failure_threshold": 3,
        "opened_total": 1,
        "probes_total": 0,
        "refused_total": 0,
        "consecutive_broken": 0,
        "broken_total": 0,
    }


def test_bodies_that_break_open_it_although_every_head_succeeded() -> None:
    """An engine that answers at once and hangs mid-stream: successes do not hide it."""
    b = Breaker(CONFIG)
    for i in range(CONFIG.failure_threshold):
        assert b.state is CLOSED, i
        assert b.allow(float(i))
        b.success(float(i))  # the head came
        b.broken(float(i) + 0.5)  # then the body hung
    assert b.state is OPEN
    assert b.statistics()["since"] == 2.5
    assert (b.consecutive_failures, b.consecutive_broken) == (0, 3)
    # The probe's head closes it; its body breaking re-opens it at once, not after 3 more.
    assert b.allow(12.5)
    b.success(12.5)
    assert b.state is CLOSED
    b.broken(13.0)
    assert b.state is OPEN
    assert b.statistics()["opened_total"] == 2
    # A body read to its end clears the count: it takes 3 broken ones again.
    assert b.allow(23.0)
    b.success(23.0)
    b.complete(23.5)
    b.broken(24.0)
    b.broken(24.0)
    assert (b.state, b.consecutive_broken) == (CLOSED, 2)
    b.complete(25.0)
    b.broken(26.0)
    b.broken(26.0)
    assert b.state is CLOSED


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="failure_threshold must be 1 or more, got 0"):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ValueError, match="open_s must be a positive number of seconds"):
        BreakerConfig(open_s=-1)


class Reference:
    """The breaker as a plain if/else model, to check the table-driven one against."""

    def __init__(self) -> None:
        self.state = CLOSED
        self.failures = 0
        self.broken = 0
        self.opened_at = 0.0
        self.probe_at = 0.0

    def event(self, op: str, now: float) -> str:
        if op == "allow":
            if self.state is OPEN and now - self.opened_at >= CONFIG.open_s:
                return "cooldown_over"
            if self.state is HALF_OPEN and now - self.probe_at >= CONFIG.probe_timeout_s:
                return "probe_timeout"
            return "allow"
        if op == "failure" and self.state is CLOSED and self.failures + 1 >= 3:
            return "trip"
        if op == "broken" and self.state is CLOSED and self.broken + 1 >= 3:
            return "trip"
        return op

    def apply(self, op: str, now: float) -> bool | None:
        event = self.event(op, now)
        before = self.state
        after, allowed = EXPECTED[(before, event)]
        if event in ("cooldown_over", "probe_timeout"):
            self.probe_at = now
        if op == "failure" and before is CLOSED:
            self.failures += 1
        if op == "success" and after is CLOSED:
            self.failures = 0
        if op == "broken":
            self.broken += 1
        if op == "complete":
            self.broken = 0
        if after is OPEN and before is not OPEN and op in ("failure", "broken"):
            self.opened_at = now
        self.state = after
        return allowed


ops = st.lists(
    st.tuples(
        st.sampled_from(["allow", "success", "failure", "cancel", "broken", "complete"]),
        st.sampled_from([0.0, 0.5, 5.0, 10.0, 30.0]),
    ),
    max_size=60,
)


@given(ops)
def test_random_walks_follow_the_table(walk: list[tuple[str, float]]) -> None:
    b = Breaker(CONFIG)
    ref = Reference()
    now = 0.0
    for op, dt in walk:
        now += dt
        before = b.state
        event = BreakerEvent(ref.event(op, now))
        result = getattr(b, op)(now)
        expected_allowed = ref.apply(op, now)
        assert (before, event) in TRANSITIONS
        assert (b.state, result if op == "allow" else None) == TRANSITIONS[(before, event)]
        assert b.state is ref.state
        if op == "allow":
            assert result is expected_allowed
        assert b.consecutive_failures == ref.failures
        assert b.consecutive_broken == ref.broken


@given(ops, st.integers(min_value=1, max_value=6))
def test_threshold_consecutive_failures_in_closed_always_open_it(
    walk: list[tuple[str, float]], threshold: int
) -> None:
    b = Breaker(BreakerConfig(failure_threshold=threshold, open_s=10.0))
    now = 0.0
    for op, dt in walk:
        now += dt
        getattr(b, op)(now)
    if b.state is not CLOSED:
        return
    already = b.consecutive_failures
    for i in range(1, threshold + 1):
        b.failure(now)
        assert b.state is (OPEN if already + i >= threshold else CLOSED)
    assert b.state is OPEN


def test_every_pair_of_the_table_is_reached_and_followed() -> None:
    """From each state, every public call at every interesting clock value.

    Exhaustive rather than drawn, so that covering the whole table is certain.
    """
    trip = [("failure", 0.0)] * 3
    starts: list[tuple[BreakerState, list[tuple[str, float]]]] = [
        (CLOSED, []),
        (CLOSED, [("failure", 0.0)] * 2),  # the next failure reaches the threshold
        (CLOSED, [("broken", 0.0)] * 2),  # the next broken body reaches it
        (OPEN, trip),
        (HALF_OPEN, [*trip, ("allow", 10.0)]),
    ]
    seen: set[tuple[BreakerState, BreakerEvent]] = set()
    for (state, recipe), op, dt in itertools.product(
        starts,
        ["allow", "success", "failure", "cancel", "broken", "complete"],
        [0.0, 10.0, 30.0],
    ):
        b, ref, now = Breaker(CONFIG), Reference(), 0.0
        for step_op, step_dt in recipe:
            now += step_dt
            getattr(b, step_op)(now)
            ref.apply(step_op, now)
        assert b.state is state
        now += dt
        event = BreakerEvent(ref.event(op, now))
        result = getattr(b, op)(now)
        ref.apply(op, now)
        seen.add((state, event))
        assert (b.state, result if op == "allow" else None) == TRANSITIONS[(state, event)]
        assert b.state is ref.state
    assert seen == set(TRANSITIONS)
