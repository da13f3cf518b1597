"""A circuit breaker per endpoint, as a pure state machine.

The router asks `allow(now)` before it sends a request to an endpoint, and
reports how the attempt went with `success(now)`, `failure(now)` or, when the
client left before the endpoint answered, `cancel(now)`. Every allowed request
must end in exactly one of these three; "success" and "failure" are about the
endpoint (did it answer, up to the first byte), not about the client.

A request that was answered may still fail later, in its body (the engine
hangs mid-stream, or cuts the connection): the router reports that as
`broken(now)`, and a body read to its end as `complete(now)`. These are a kind
of their own, with their own count: consecutive broken bodies, reset only by a
complete one (not by a success, which every such request also had at its
head). An engine that answers at once and then always hangs mid-stream
would otherwise look healthy for ever. The count is not reset when the
breaker opens either, so once a probe has closed it again, the next broken
body re-opens it at once: until it completes a body, such an engine gets the
probe and what is sent before that probe's body breaks, not a full share.

To *choose* an endpoint, read `would_allow(now)` (no side effects) for every
candidate, then call `allow(now)` only on the one chosen: in half_open,
`allow` hands out the single probe, and asking every candidate would spend
probes on endpoints that are not used.

Each public call is first classified into a `BreakerEvent` (using the clock
and the failure count), then looked up in `TRANSITIONS`; a pair missing from
the table is invalid and raises.

| event         | closed          | open             | half_open          |
|---------------|-----------------|------------------|--------------------|
| ALLOW         | closed, allowed | open, refused    | half_open, refused |
| COOLDOWN_OVER | -               | half_open, probe | -                  |
| PROBE_TIMEOUT | -               | -                | half_open, probe   |
| SUCCESS       | closed          | open             | closed             |
| FAILURE       | closed          | open             | open               |
| TRIP          | open            | -                | -                  |
| CANCEL        | closed          | open             | open               |
| BROKEN        | closed          | open             | open               |
| COMPLETE      | closed          | open             | half_open          |

- ALLOW: `allow()` when no other row applies.
- COOLDOWN_OVER: `allow()` in open once `open_s` has passed since it opened:
  the request goes through as the one probe.
- PROBE_TIMEOUT: `allow()` in half_open when the probe has been out for
  `probe_timeout_s` with no verdict: it is presumed lost (a caller that forgot
  to report it must not keep the endpoint out of service for ever), and this
  request becomes the new probe.
- FAILURE in closed counts one more consecutive failure; the failure that
  makes `failure_threshold` consecutive ones is TRIP. SUCCESS in closed resets
  the count.
- SUCCESS or FAILURE in open is the late outcome of a request allowed before
  the breaker opened: it is ignored, and the timer is not restarted.
- In half_open the endpoint cannot tell the probe's outcome from a late one,
  so any success closes and any failure re-opens (the timer restarts).
- CANCEL in half_open: the probe ended with no verdict. The breaker goes back
  to open with its cooldown already served, so the next `allow()` sends a
  new probe at once.
- BROKEN: `broken()` when it is not a TRIP; the `failure_threshold`-th
  consecutive broken body in closed is TRIP. In half_open it re-opens (the
  timer restarts), as a FAILURE does; in open it is a late outcome, ignored.
- COMPLETE: `complete()`; it resets the broken count and changes no state
  (in half_open the probe's own verdict, at its head, decides).
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(enum.StrEnum):
    ALLOW = "allow"
    COOLDOWN_OVER = "cooldown_over"
    PROBE_TIMEOUT = "probe_timeout"
    SUCCESS = "success"
    FAILURE = "failure"
    TRIP = "trip"
    CANCEL = "cancel"
    BROKEN = "broken"
    COMPLETE = "complete"


_S = BreakerState
_E = BreakerEvent

# (state, event) -> (next state, whether the request is allowed; None for an outcome)
TRANSITIONS: dict[tuple[BreakerState, BreakerEvent], tuple[BreakerState, bool | None]] = {
    (_S.CLOSED, _E.ALLOW): (_S.CLOSED, True),
    (_S.CLOSED, _E.SUCCESS): (_S.CLOSED, None),
    (_S.CLOSED, _E.FAILURE): (_S.CLOSED, None),
    (_S.CLOSED, _E.TRIP): (_S.OPEN, None),
    (_S.CLOSED, _E.CANCEL): (_S.CLOSED, None),
    (_S.OPEN, _E.ALLOW): (_S.OPEN, False),
    (_S.OPEN, _E.COOLDOWN_OVER): (_S.HALF_OPEN, True),
    (_S.OPEN, _E.SUCCESS): (_S.OPEN, None),
    (_S.OPEN, _E.FAILURE): (_S.OPEN, None),
    (_S.OPEN, _E.CANCEL): (_S.OPEN, None),
    (_S.HALF_OPEN, _E.ALLOW): (_S.HALF_OPEN, False),
    (_S.HALF_OPEN, _E.PROBE_TIMEOUT): (_S.HALF_OPEN, True),
    (_S.HALF_OPEN, _E.SUCCESS): (_S.CLOSED, None),
    (_S.HALF_OPEN, _E.FAILURE): (_S.OPEN, None),
    (_S.HALF_OPEN, _E.CANCEL): (_S.OPEN, None),
    (_S.CLOSED, _E.BROKEN): (_S.CLOSED, None),
    (_S.OPEN, _E.BROKEN): (_S.OPEN, None),
    (_S.HALF_OPEN, _E.BROKEN): (_S.OPEN, None),
    (_S.CLOSED, _E.COMPLETE): (_S.CLOSED, None),
    (_S.OPEN, _E.COMPLETE): (_S.OPEN, None),
    (_S.HALF_OPEN, _E.COMPLETE): (_S.HALF_OPEN, None),
}


class InvalidTransition(ValueError):
    """A (state, event) pair that is not in `TRANSITIONS`: a bug in the caller of `next_state`."""


def next_state(state: BreakerState, event: BreakerEvent) -> tuple[BreakerState, bool | None]:
    """The table lookup; raises `InvalidTransition` for a pair not in the table."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(
            f"event {event.value!r} is not valid in breaker state {state.value!r}"
        ) from None


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be 1 or more, got {value}")


def _positive_seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value}")


@attrs.frozen
class BreakerConfig:
    failure_threshold: int = attrs.field(default=5, validator=_positive_int)
    open_s: float = attrs.field(default=10.0, validator=_positive_seconds)
    # A probe with no verdict after this long is presumed lost (see the table).
    probe_timeout_s: float = attrs.field(default=60.0, validator=_positive_seconds)


class Breaker:
    """One endpoint's breaker. `name` is only for `repr` and logs."""

    def __init__(self, config: BreakerConfig | None = None, *, name: str = "") -> None:
        self.config = config if config is not None else BreakerConfig()
        self.name = name
        self._state = BreakerState.CLOSED
        self._since: float | None = None  # clock value of the last state change
        self._consecutive_failures = 0
        self._consecutive_broken = 0
        self._opened_at = -math.inf  # start of the current cooldown
        self._probe_sent_at = -math.inf
        self._opened_total = 0
        self._probes_total = 0
        self._refused_total = 0
        self._broken_total = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    @property
    def consecutive_broken(self) -> int:
        return self._consecutive_broken

    def would_allow(self, now: float) -> bool:
        """What `allow(now)` would answer, without taking the probe."""
        return bool(next_state(self._state, self._classify_request(now))[1])

    def allow(self, now: float) -> bool:
        """May a request go to this endpoint now? In half_open, True hands out the probe."""
        event = self._classify_request(now)
        allowed = self._apply(event, now)
        if event in (BreakerEvent.COOLDOWN_OVER, BreakerEvent.PROBE_TIMEOUT):
            self._probe_sent_at = now
            self._probes_total += 1
        if not allowed:
            self._refused_total += 1
        return bool(allowed)

    def success(self, now: float) -> None:
        """An allowed request got an answer from the endpoint."""
        self._apply(BreakerEvent.SUCCESS, now)
        if self._state is BreakerState.CLOSED:
            self._consecutive_failures = 0

    def failure(self, now: float) -> None:
        """An allowed request failed because of the endpoint (refused, reset, 5xx, timeout)."""
        if (
            self._state is BreakerState.CLOSED
            and self._consecutive_failures + 1 >= self.config.failure_threshold
        ):
            event = BreakerEvent.TRIP
        else:
            event = BreakerEvent.FAILURE
        before = self._state
        self._apply(event, now)
        if before is BreakerState.CLOSED:
            self._consecutive_failures += 1
        self._note_opening(before, now)

    def cancel(self, now: float) -> None:
        """An allowed request ended with no verdict on the endpoint (the client left first)."""
        self._apply(BreakerEvent.CANCEL, now)

    def broken(self, now: float) -> None:
        """A request the endpoint had answered failed in its body (hung, cut, not HTTP)."""
        if (
            self._state is BreakerState.CLOSED
            and self._consecutive_broken + 1 >= self.config.failure_threshold
        ):
            event = BreakerEvent.TRIP
        else:
            event = BreakerEvent.BROKEN
        before = self._state
        self._apply(event, now)
        self._consecutive_broken += 1
        self._broken_total += 1
        self._note_opening(before, now)

    def complete(self, now: float) -> None:
        """A request's body was read to its end."""
        self._apply(BreakerEvent.COMPLETE, now)
        self._consecutive_broken = 0

    def _note_opening(self, before: BreakerState, now: float) -> None:
        if before is not BreakerState.OPEN and self._state is BreakerState.OPEN:
            self._opened_at = now
            self._opened_total += 1

    def statistics(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self._state.value,
            "since": self._since,
            "consecutive_failures": self._consecutive_failures,
            "failure_threshold": self.config.failure_threshold,
            "consecutive_broken": self._consecutive_broken,
            "broken_total": self._broken_total,
            "opened_total": self._opened_total,
            "probes_total": self._probes_total,
            "refused_total": self._refused_total,
        }

    def __repr__(self) -> str:
        name = f" {self.name}" if self.name else ""
        since = "" if self._since is None else f" since {self._since:g}"
        return (
            f"<Breaker{name} {self._state.value}{since}, "
            f"{self._consecutive_failures}/{self.config.failure_threshold} consecutive failures, "
            f"opened {self._opened_total} times>"
        )

    def _classify_request(self, now: float) -> BreakerEvent:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.config.open_s:
            return BreakerEvent.COOLDOWN_OVER
        if (
            self._state is BreakerState.HALF_OPEN
            and now - self._probe_sent_at >= self.config.probe_timeout_s
        ):
            return BreakerEvent.PROBE_TIMEOUT
        return BreakerEvent.ALLOW

    def _apply(self, event: BreakerEvent, now: float) -> bool | None:
        after, allowed = next_state(self._state, event)
        if after is not self._state:
            self._state = after
            self._since = now
        return allowed
