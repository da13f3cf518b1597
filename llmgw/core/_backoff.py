"""A model's restart backoff, as a pure value: one bad catalog entry never starves the fleet.

A model whose replicas keep failing (refused at start, failed on their node,
not ready within their startup timeout) waits longer before each new start. A
first failure is replaced at once (an engine that crashed once is the common
case, and its clients want it back); from the second failure in a row the wait
is `base_s`, doubling with each further one, at most `max_s`. From the first
failure on, one replica of the model is tried at a time
(llmgw/core/_reconcile.py), so a model that wants ten replicas probes with one,
not ten. Failures of one round count once: a replica started before the last
counted failure (the siblings started with the one that failed) notes its
reason but does not double the wait again. The count goes back to zero once a
replica of the model has stayed ready for `reset_s` after the last failure; a
replica that was ready before that failure proves nothing about the new one.

Other models are not touched: each model has its own value, and nothing here
delays anything but its own model's starts.
"""

from __future__ import annotations

import attrs

BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 60.0


@attrs.frozen
class BackoffPolicy:
    base_s: float = BACKOFF_BASE_S
    max_s: float = BACKOFF_MAX_S
    reset_s: float = BACKOFF_RESET_S

    def __attrs_post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"backoff: need 0 < base_s <= max_s, got {self.base_s}, {self.max_s}")
        if self.reset_s < 0:
            raise ValueError(f"backoff: reset_s must be >= 0, got {self.reset_s}")


@attrs.frozen
class Backoff:
    """`failures` consecutive failures of one model, the last at `last_at`, for `reason`."""

    failures: int
    last_at: float
    reason: str

    def delay_s(self, policy: BackoffPolicy) -> float:
        if self.failures <= 1:
            return 0.0
        # Capped before the power is taken: a model failing for days must not overflow.
        return min(policy.max_s, policy.base_s * 2.0 ** min(self.failures - 2, 64))

    def next_try_at(self, policy: BackoffPolicy) -> float:
        return self.last_at + self.delay_s(policy)

    def describe(self, now: float, policy: BackoffPolicy) -> str:
        """The operator's line: `next try in 40 s after 6 failures: <reason>`."""
        times = "failure" if self.failures == 1 else "failures"
        left = self.next_try_at(policy) - now
        when = f"next try in {left:.0f} s" if left > 0 else "trying again"
        return f"{when} after {self.failures} {times}: {self.reason}"


def backoff_failure(
    prev: Backoff | None, now: float, reason: str, started_after: int | None = None
) -> Backoff:
    """One more failure of the model. `started_after`: the model's count of failures
    when the failing replica was started (None: not known, say it was adopted); one
    started before the last counted failure belongs to that round, and only its reason
    is kept."""
    count = prev.failures if prev is not None else 0
    if prev is not None and started_after is not None and started_after < count:
        return attrs.evolve(prev, reason=reason)
    return Backoff(count + 1, now, reason)


def backoff_settled(
    prev: Backoff | None, ready_since: list[float], now: float, policy: BackoffPolicy
) -> Backoff | None:
    """None (no backoff) once one of the model's replicas became ready after the last
    failure and has stayed ready for `reset_s`; `ready_since`: when each of its
    replicas now ready became so."""
    if prev is None:
        return None
    if any(t > prev.last_at and now - t >= policy.reset_s for t in ready_since):
        return None
    return prev
