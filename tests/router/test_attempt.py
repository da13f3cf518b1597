"""The attempt loop follows core's table: each verdict reaches the breaker as written."""

from __future__ import annotations

import pytest

from llmgw.core import ATTEMPT_VERDICTS, AttemptOutcome, AttemptPhase, Breaker, BreakerEvent
from llmgw.router._attempt import _TELL, _tell


def test_every_event_the_table_names_has_a_breaker_call() -> None:
    named = {v.breaker for v in ATTEMPT_VERDICTS.values()} - {None}
    assert named <= set(_TELL)


@pytest.mark.parametrize("pair", sorted(ATTEMPT_VERDICTS))
async def test_tell_gives_the_breaker_the_tables_event_and_says_whether_to_retry(
    pair: tuple[AttemptPhase, AttemptOutcome],
) -> None:
    verdict = ATTEMPT_VERDICTS[pair]
    breaker = Breaker()
    breaker.failure(0.0)  # one of each already counted, so that every event shows
    breaker.broken(0.0)
    assert breaker.allow(0.0)
    retry = _tell(breaker, *pair)
    assert retry is verdict.retry
    counts = (breaker.consecutive_failures, breaker.consecutive_broken)
    expected = {
        BreakerEvent.FAILURE: (2, 1),
        BreakerEvent.BROKEN: (1, 2),
        BreakerEvent.SUCCESS: (0, 1),
        BreakerEvent.COMPLETE: (1, 0),
        BreakerEvent.CANCEL: (1, 1),
        None: (1, 1),
    }
    assert counts == expected[verdict.breaker]
