"""The shard state table and the health-check classifier, walked by hypothesis."""

from __future__ import annotations

import itertools

import pytest
from helpers import doc_table
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core
from llmgw.core import _shard
from llmgw.core._shard import (
    RUNNING,
    TRANSITIONS,
    HealthRun,
    InvalidTransition,
    ShardEvent,
    next_state,
)
from llmgw.model import ShardState

S = ShardState
STARTING, LOADING, READY, UNHEALTHY, FAILED, STOPPED = (
    S.STARTING,
    S.LOADING,
    S.READY,
    S.UNHEALTHY,
    S.FAILED,
    S.STOPPED,
)

# The table as designed, written out again so that a change to the module's
# table is a deliberate change to this test too.
EXPECTED = {
    (STARTING, "launched"): LOADING,
    (STARTING, "exited"): FAILED,
    (STARTING, "stop"): STOPPED,
    (LOADING, "healthy"): READY,
    (LOADING, "check_failed"): LOADING,
    (LOADING, "health_lost"): UNHEALTHY,
    (LOADING, "exited"): FAILED,
    (LOADING, "stop"): STOPPED,
    (READY, "healthy"): READY,
    (READY, "check_failed"): READY,
    (READY, "health_lost"): UNHEALTHY,
    (READY, "exited"): FAILED,
    (READY, "stop"): STOPPED,
    (UNHEALTHY, "healthy"): READY,
    (UNHEALTHY, "health_lost"): UNHEALTHY,
    (UNHEALTHY, "exited"): FAILED,
    (UNHEALTHY, "stop"): STOPPED,
    (FAILED, "stop"): STOPPED,
    (STARTING, "relaunched"): STARTING,
    (LOADING, "relaunched"): STARTING,
    (READY, "relaunched"): STARTING,
    (UNHEALTHY, "relaunched"): STARTING,
}


def test_module_table_is_the_designed_table() -> None:
    assert {(s, e.value): v for (s, e), v in TRANSITIONS.items()} == EXPECTED


def test_the_docstring_draws_the_module_table() -> None:
    drawn = doc_table(_shard.__doc__)
    assert drawn == {(s.value, e.value): v.value for (s, e), v in TRANSITIONS.items()}
    header = next(line for line in (_shard.__doc__ or "").splitlines() if "| event" in line)
    assert [c.strip() for c in header.strip("| ").split("|")][1:] == [s.value for s in ShardState]


def test_the_public_names_are_the_modules() -> None:
    assert core.ShardState is ShardState
    assert (core.ShardEvent, core.HealthRun) == (ShardEvent, HealthRun)
    assert core.RUNNING_SHARD_STATES is RUNNING
    assert core.next_shard_state is next_state
    assert core.InvalidShardTransition is InvalidTransition


def test_wire_values_are_the_strings_reports_always_carried() -> None:
    assert [s.value for s in ShardState] == [
        "starting",
        "loading",
        "ready",
        "unhealthy",
        "failed",
        "stopped",
    ]
    assert READY == "ready"  # a StrEnum: the control plane's string comparisons still hold


@pytest.mark.parametrize(("state", "event"), list(itertools.product(ShardState, ShardEvent)))
def test_every_pair_is_in_the_table_or_invalid(state: ShardState, event: ShardEvent) -> None:
    if (state, event.value) in EXPECTED:
        assert next_state(state, event) is EXPECTED[(state, event.value)]
    else:
        with pytest.raises(InvalidTransition, match=f"{event.value!r}.*{state.value!r}"):
            next_state(state, event)


def test_failed_and_stopped_have_no_way_back() -> None:
    for state in (FAILED, STOPPED):
        reachable = {v for (s, _), v in TRANSITIONS.items() if s is state}
        assert reachable <= {STOPPED}
    assert set(RUNNING) == {STARTING, LOADING, READY, UNHEALTHY}


def test_threshold_failures_trip_with_their_descriptions_and_a_pass_recovers() -> None:
    run = HealthRun(threshold=3)
    # Loading: an engine loading its weights fails every check, and that is not news.
    for _ in range(10):
        assert run.observe("/health answered 503") is ShardEvent.CHECK_FAILED
    assert run.observe(None) is ShardEvent.HEALTHY
    assert run.observe("timed out after 5 s") is ShardEvent.CHECK_FAILED
    assert run.observe("timed out after 5 s") is ShardEvent.CHECK_FAILED
    assert run.observe("cannot connect to port 9 (connection refused)") is ShardEvent.HEALTH_LOST
    reason = run.reason()
    assert reason == (
        "/health failed 3 times in a row: timed out after 5 s; timed out after 5 s; "
        "cannot connect to port 9 (connection refused)"
    )
    # Later failures keep it lost, and the reason names the ones that tripped it.
    assert run.observe("timed out after 5 s") is ShardEvent.HEALTH_LOST
    assert run.reason() == reason
    assert run.observe(None) is ShardEvent.HEALTHY
    assert run.failures == []


def test_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threshold must be 1 or more, got 0"):
        HealthRun(threshold=0)


class Model:
    """The shard as a plain if/else model, to check the table-driven walk against."""

    def __init__(self, threshold: int) -> None:
        self.state = STARTING
        self.threshold = threshold
        self.been_ready = False
        self.in_row = 0

    def step(self, op: str) -> None:
        if self.state in (FAILED, STOPPED):
            if op == "stop" and self.state is FAILED:
                self.state = STOPPED
            return
        if op == "stop":
            self.state = STOPPED
        elif op == "exit":
            self.state = FAILED
        elif self.state is STARTING:
            if op == "launched":
                self.state = LOADING
        elif op == "pass":
            self.been_ready, self.in_row, self.state = True, 0, READY
        elif op == "fail" and self.been_ready:
            self.in_row += 1
            if self.in_row >= self.threshold:
                self.state = UNHEALTHY


@given(
    st.lists(st.sampled_from(["launched", "pass", "fail", "exit", "stop"]), max_size=60),
    st.integers(min_value=1, max_value=5),
)
def test_random_walks_follow_the_table(ops: list[str], threshold: int) -> None:
    """Drive the table as the supervisor does: classify, look up, move."""
    state = STARTING
    run = HealthRun(threshold)
    model = Model(threshold)
    for op in ops:
        # The supervisor never sends what cannot happen in a state (a health
        # check before launch, an exit after the end): skip those as it does.
        if state in (FAILED, STOPPED) and not (op == "stop" and state is FAILED):
            model.step(op)
            continue
        if state is STARTING and op in ("pass", "fail"):
            model.step(op)
            continue
        if op == "launched":
            if state is not STARTING:
                continue
            event = ShardEvent.LAUNCHED
        elif op == "pass":
            event = run.observe(None)
        elif op == "fail":
            event = run.observe("timed out after 1 s")
        elif op == "exit":
            event = ShardEvent.EXITED
        else:
            event = ShardEvent.STOP
        assert (state, event) in TRANSITIONS, (state, event)
        state = next_state(state, event)
        model.step(op)
        assert state is model.state
        if state is UNHEALTHY:
            assert len(run.failures) >= threshold
            assert run.reason().startswith(f"/health failed {threshold} times in a row: ")


@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(min_value=1, max_value=5))
def test_from_ready_unhealthy_exactly_when_the_last_threshold_checks_failed(
    outcomes: list[bool], threshold: int
) -> None:
    run = HealthRun(threshold)
    state = READY
    assert next_state(LOADING, run.observe(None)) is READY
    for ok in outcomes:
        state = next_state(state, run.observe(None if ok else "answered 500"))
    # The failures since the last pass, counted from the end.
    trailing = len(list(itertools.takewhile(lambda ok: not ok, reversed(outcomes))))
    assert (state is UNHEALTHY) == (trailing >= threshold)
    assert state in (READY, UNHEALTHY)


# What the supervisor can send in each state: a health check runs only once the
# shard is launched and while it runs; a launch ends only the starting state; a
# process can exit only while the shard runs; a stop comes in any state but stopped;
# a relaunch takes only a running shard (llmgw/agent/_relaunch.py refuses the rest).
SENT_IN = {
    "launched": {STARTING},
    "pass": {LOADING, READY, UNHEALTHY},
    "fail": {LOADING, READY, UNHEALTHY},
    "exit": set(RUNNING),
    "stop": set(ShardState) - {STOPPED},
    "relaunch": set(RUNNING),
}


def classify(op: str, run: HealthRun) -> ShardEvent:
    """An observation as the supervisor turns it into an event."""
    if op == "pass":
        return run.observe(None)
    if op == "fail":
        return run.observe("timed out after 5 s")
    return {
        "launched": ShardEvent.LAUNCHED,
        "exit": ShardEvent.EXITED,
        "relaunch": ShardEvent.RELAUNCHED,
    }.get(op, ShardEvent.STOP)


def test_every_pair_the_supervisor_can_send_is_in_the_table_and_every_pair_is_reached() -> None:
    """From each state, every observation the supervisor can make there.

    Exhaustive rather than drawn: the table holds exactly the pairs that can
    happen, so the supervisor never meets its illegal-transition path, and no
    row of the table is dead.
    """
    threshold = 2

    def walk(ops: list[str], run: HealthRun, state: ShardState = STARTING) -> ShardState:
        for op in ops:
            state = next_state(state, classify(op, run))
        return state

    def adopted() -> HealthRun:  # loading, but ready before the agent restarted
        return HealthRun(threshold, counting=True)

    starts: list[tuple[ShardState, list[str], HealthRun, ShardState]] = [
        (STARTING, [], HealthRun(threshold), STARTING),
        (LOADING, ["launched"], HealthRun(threshold), STARTING),
        (LOADING, [], adopted(), LOADING),
        (LOADING, ["fail"], adopted(), LOADING),  # the next failure is the threshold's
        (READY, ["launched", "pass"], HealthRun(threshold), STARTING),
        (READY, ["launched", "pass", "fail"], HealthRun(threshold), STARTING),
        (UNHEALTHY, ["launched", "pass", "fail", "fail"], HealthRun(threshold), STARTING),
        (FAILED, ["exit"], HealthRun(threshold), STARTING),
        (STOPPED, ["stop"], HealthRun(threshold), STARTING),
    ]
    seen: set[tuple[ShardState, ShardEvent]] = set()
    for (state, recipe, template, entry), op in itertools.product(starts, SENT_IN):
        run = HealthRun(template.threshold, template.counting, list(template.failures))
        assert walk(recipe, run, entry) is state
        if state not in SENT_IN[op]:
            continue
        event = classify(op, run)
        assert (state, event) in TRANSITIONS, (state, op, event)
        seen.add((state, event))
    assert seen == set(TRANSITIONS)
