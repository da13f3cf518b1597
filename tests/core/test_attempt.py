"""The attempt loop's table: every (phase, outcome) has a verdict, the one the router's
tests pin, and no verdict tells a breaker something its own table has no row for."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import (
    ATTEMPT_VERDICTS,
    AttemptOutcome,
    AttemptPhase,
    AttemptVerdict,
    Breaker,
    BreakerConfig,
    BreakerEvent,
    BreakerState,
    attempt_verdict,
    head_outcome,
)

HEAD, WHOLE, STREAM = AttemptPhase.HEAD, AttemptPhase.WHOLE_BODY, AttemptPhase.STREAM
FAILED, SUCCEEDED, CANCELLED = (
    AttemptOutcome.FAILED,
    AttemptOutcome.SUCCEEDED,
    AttemptOutcome.CANCELLED,
)
ROUTER_TESTS = Path(__file__).resolve().parents[1] / "router"

# The table as the design states it, written out again here so that a change to the
# module's table is a deliberate change to this test too. Each row names the router
# tests (tests/router/, through real listeners and engines) that pin its behaviour.
EXPECTED: dict[tuple[AttemptPhase, AttemptOutcome], tuple[str | None, bool, tuple[str, ...]]] = {
    (HEAD, FAILED): (
        "failure",
        True,
        (
            # connect refused: retried elsewhere, the dead endpoint's breaker opens
            "test_proxy.py::test_a_refusing_replica_sends_requests_elsewhere_and_opens_its_breaker",
            # a 5xx head: retried; with no retry left, passed on as the engine sent it
            "test_proxy.py::test_a_5xx_before_the_first_byte_is_retried_on_another_replica",
            # not HTTP, a bad Content-Length, a head cut short: retried, counted by phase
            "test_robustness.py::test_an_engine_reply_that_is_not_http_is_retried_on_another_endpoint",
        ),
    ),
    (HEAD, SUCCEEDED): (
        "success",
        False,
        (
            # 404 and 501 are the engine's own answers: sent once, no breaker opens
            "test_surface.py::test_an_engine_that_does_not_serve_a_route_answers_for_itself",
        ),
    ),
    (HEAD, CANCELLED): (
        "cancel",
        False,
        ("test_proxy.py::test_a_client_that_leaves_a_non_streamed_request_cancels_it",),
    ),
    (WHOLE, FAILED): (
        "broken",
        True,
        (
            # "a whole answer cut short" (phase mid_body): retried, the client gets 200
            "test_robustness.py::test_an_engine_reply_that_is_not_http_is_retried_on_another_endpoint",
        ),
    ),
    (WHOLE, SUCCEEDED): (
        "complete",
        False,
        ("test_proxy.py::test_a_5xx_before_the_first_byte_is_retried_on_another_replica",),
    ),
    (WHOLE, CANCELLED): (
        None,
        False,
        ("test_proxy.py::test_a_client_that_leaves_a_non_streamed_request_cancels_it",),
    ),
    (STREAM, FAILED): (
        "broken",
        False,
        (
            # hung mid-stream: an error event, the connection cut, the breaker opens
            "test_robustness.py::test_an_engine_that_hangs_mid_stream_is_counted_and_its_breaker_opens",
            "test_robustness.py::test_a_stream_cut_mid_body_is_counted_as_mid_body",
            "test_proxy.py::test_a_replica_that_hangs_mid_stream_times_out_and_frees_the_slot",
            # resumed: a greedy stream continued elsewhere, or refused with the error event
            "test_stream_continuation.py::test_a_cut_greedy_chat_stream_is_continued_on_another_endpoint",
            "test_stream_continuation.py::test_a_stream_that_may_not_be_continued_ends_with_the_error_event",
        ),
    ),
    (STREAM, SUCCEEDED): (
        "complete",
        False,
        (
            "test_robustness.py::test_an_engine_that_hangs_mid_stream_is_counted_and_its_breaker_opens",
        ),
    ),
    (STREAM, CANCELLED): (
        None,
        False,
        ("test_proxy.py::test_a_client_that_disconnects_cancels_the_engine_request",),
    ),
}


def test_every_phase_and_outcome_has_a_verdict() -> None:
    pairs = set(itertools.product(AttemptPhase, AttemptOutcome))
    assert set(ATTEMPT_VERDICTS) == pairs
    assert set(EXPECTED) == pairs


def test_the_table_is_the_designed_one() -> None:
    got = {
        pair: (None if v.breaker is None else v.breaker.value, v.retry)
        for pair, v in ATTEMPT_VERDICTS.items()
    }
    assert got == {pair: (event, retry) for pair, (event, retry, _) in EXPECTED.items()}
    for (phase, outcome), verdict in ATTEMPT_VERDICTS.items():
        assert attempt_verdict(phase, outcome) is verdict
        assert isinstance(verdict, AttemptVerdict)


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def test_every_row_names_router_tests_that_exist() -> None:
    """The rows point at the tests that pin them; a renamed or removed test shows here."""
    for pair, (_, _, pinned) in EXPECTED.items():
        assert pinned, pair
        for ref in pinned:
            file, _, name = ref.partition("::")
            assert name in _test_names(ROUTER_TESTS / file), (pair, ref)


def test_only_a_head_or_an_unsent_body_is_retried() -> None:
    """The loop's one rule about the client: nothing of the answer has reached it."""
    retried = {pair for pair, v in ATTEMPT_VERDICTS.items() if v.retry}
    assert retried == {(HEAD, FAILED), (WHOLE, FAILED)}


def test_only_a_broken_stream_is_resumed() -> None:
    """Continuing on another endpoint is for an answer that has begun reaching the
    client; before that, the request is retried as it was."""
    resumed = {pair for pair, v in ATTEMPT_VERDICTS.items() if v.resume}
    assert resumed == {(STREAM, FAILED)}
    assert not ATTEMPT_VERDICTS[STREAM, FAILED].retry


def test_a_verdict_on_the_head_is_always_given_and_a_body_has_its_own() -> None:
    # The breaker: every allowed request ends in exactly one of success, failure, cancel
    # (its head's verdict); a body's end is broken or complete, a kind of its own.
    head = {ATTEMPT_VERDICTS[HEAD, o].breaker for o in AttemptOutcome}
    assert head == {BreakerEvent.SUCCESS, BreakerEvent.FAILURE, BreakerEvent.CANCEL}
    for phase in (WHOLE, STREAM):
        body = {ATTEMPT_VERDICTS[phase, o].breaker for o in AttemptOutcome}
        assert body == {BreakerEvent.BROKEN, BreakerEvent.COMPLETE, None}


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, SUCCEEDED),
        (400, SUCCEEDED),
        (404, SUCCEEDED),
        (429, SUCCEEDED),
        (499, SUCCEEDED),
        (500, FAILED),
        (501, SUCCEEDED),  # the engine does not serve the route: its own answer
        (502, FAILED),
        (503, FAILED),
        (504, FAILED),
        (599, FAILED),
    ],
)
def test_head_outcome(status: int, outcome: AttemptOutcome) -> None:
    assert head_outcome(status) is outcome


_TELL = {
    BreakerEvent.SUCCESS: Breaker.success,
    BreakerEvent.FAILURE: Breaker.failure,
    BreakerEvent.CANCEL: Breaker.cancel,
    BreakerEvent.BROKEN: Breaker.broken,
    BreakerEvent.COMPLETE: Breaker.complete,
}

# One attempt: its head's outcome, then (if the head was answered) its body's phase and
# outcome; the clock moves on by a few seconds between attempts.
_attempts = st.lists(
    st.tuples(
        st.sampled_from(list(AttemptOutcome)),
        st.sampled_from([WHOLE, STREAM]),
        st.sampled_from(list(AttemptOutcome)),
        st.floats(min_value=0, max_value=30),
    ),
    max_size=60,
)


@given(_attempts)
def test_any_run_of_attempts_tells_the_breaker_only_what_it_accepts(
    attempts: list[tuple[AttemptOutcome, AttemptPhase, AttemptOutcome, float]],
) -> None:
    """Walk a breaker through attempts as the loop makes them: allowed first, each
    verdict applied; none raises InvalidTransition, and a breaker told a failure or a
    broken body as often as its threshold in a row from closed is open."""
    breaker = Breaker(BreakerConfig(failure_threshold=3, open_s=10.0, probe_timeout_s=30.0))
    now = 0.0
    for head, phase, body, wait in attempts:
        now += wait
        if not breaker.allow(now):
            continue
        before = breaker.state
        failures = breaker.consecutive_failures
        event = ATTEMPT_VERDICTS[HEAD, head].breaker
        assert event is not None
        _TELL[event](breaker, now)
        if event is BreakerEvent.FAILURE and before is BreakerState.CLOSED and failures == 2:
            assert breaker.state is BreakerState.OPEN
        if head is not SUCCEEDED:
            continue  # no answer: no body
        event = ATTEMPT_VERDICTS[phase, body].breaker
        if event is not None:
            _TELL[event](breaker, now)
        assert breaker.state in BreakerState
