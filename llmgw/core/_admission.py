"""Admission per model: a concurrency limit, priority bands, fairness between tenants.

Pure: the router calls in with a request id and a clock value, and gets back
what to do (admit, keep waiting, answer 429). It keeps no timer of its own:
`next_deadline()` tells the caller when to call `expire(now)`.

Order of service
    A higher band (lower `rank`) is always served first. Inside a band,
    tenants with waiting requests take turns (round robin, one request per
    turn, FIFO inside a tenant), so one tenant's flood does not starve
    another: a request at the head of its tenant's line waits for at most one
    admission per other tenant of its band. A new request is admitted at once
    only when a slot is free and nobody of its band or a higher one waits (no
    overtaking); since every freed slot is handed to the queue first, a free
    slot and a waiting request never coexist.

Life of a request (anything not in the table is invalid and raises)

| state    | PROMOTE  | RELEASE | WITHDRAW | EXPIRE |
|----------|----------|---------|----------|--------|
| queued   | admitted | -       | gone     | gone   |
| admitted | -        | gone    | gone     | -      |

    `request()` starts a request as admitted (`Admit`), queued (`Queued`) or
    ends it at once (`Reject`). `withdraw()` of an id that is already gone is
    not an error: a client's disconnect can race its expiry.

Retry-After estimate
    When the queue is full, or a queued request times out, the answer is 429
    with Retry-After = (requests that would be served before a newcomer of
    that band: the waiting ones of that band and of higher bands, plus one) x
    (mean time an admitted request holds its slot) / concurrency. The mean is
    an exponentially weighted average of admitted-to-released times (weight
    `_SERVICE_EWMA_ALPHA` for the newest); before any request has finished it
    is the band's queue timeout, and with no concurrency at all (no replica)
    the estimate is that timeout too. The result is clamped to
    [`MIN_RETRY_AFTER_S`, `MAX_RETRY_AFTER_S`]: a client told 0 comes straight
    back, and one told an hour gives up on a fleet that recovers in seconds.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Iterable
from typing import Any

import attrs

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0
_SERVICE_EWMA_ALPHA = 0.2


def _non_negative_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be 0 or more, got {value}")


def _timeout(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value}")


@attrs.frozen
class Band:
    """A priority band: a lower `rank` is served first (interactive=0, batch=1)."""

    name: str
    rank: int
    queue_timeout_s: float = attrs.field(validator=_timeout)


def _bands(
    _: object, attribute: attrs.Attribute[tuple[Band, ...]], bands: tuple[Band, ...]
) -> None:
    if not bands:
        raise ValueError("bands must name at least one band, e.g. Band('interactive', 0, 30.0)")
    names = [b.name for b in bands]
    if len(set(names)) != len(names):
        raise ValueError(f"band names must be distinct, got {names}")
    ranks = [b.rank for b in bands]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"band ranks must be distinct (one priority per band), got {ranks}")


def _as_tuple(bands: Iterable[Band]) -> tuple[Band, ...]:
    return tuple(bands)


@attrs.frozen
class AdmissionConfig:
    concurrency: int = attrs.field(validator=_non_negative_int)
    queue_limit: int = attrs.field(validator=_non_negative_int)
    bands: tuple[Band, ...] = attrs.field(converter=_as_tuple, validator=_bands)

    def band(self, name: str) -> Band:
        for b in self.bands:
            if b.name == name:
                return b
        known = ", ".join(repr(b.name) for b in self.bands)
        raise ValueError(f"unknown priority band {name!r}; the bands are {known}")


@attrs.frozen
class Admit:
    """Go ahead: the request holds a slot until `release` or `withdraw`."""

    req_id: str


@attrs.frozen
class Queued:
    """Wait: admitted later (an id returned by release, withdraw, ...) or expired at `deadline`."""

    req_id: str
    deadline: float


@attrs.frozen
class Reject:
    """Answer 429 now, with Retry-After `retry_after_s` (round up for the header)."""

    reason: str
    retry_after_s: float


class RequestState(enum.StrEnum):
    QUEUED = "queued"
    ADMITTED = "admitted"


class RequestEvent(enum.StrEnum):
    PROMOTE = "promote"
    RELEASE = "release"
    WITHDRAW = "withdraw"
    EXPIRE = "expire"


# (state, event) -> next state; None: the request is gone.
TRANSITIONS: dict[tuple[RequestState, RequestEvent], RequestState | None] = {
    (RequestState.QUEUED, RequestEvent.PROMOTE): RequestState.ADMITTED,
    (RequestState.QUEUED, RequestEvent.WITHDRAW): None,
    (RequestState.QUEUED, RequestEvent.EXPIRE): None,
    (RequestState.ADMITTED, RequestEvent.RELEASE): None,
    (RequestState.ADMITTED, RequestEvent.WITHDRAW): None,
}


def next_state(state: RequestState, event: RequestEvent, req_id: str = "?") -> RequestState | None:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        hint = {
            (RequestState.QUEUED, RequestEvent.RELEASE): "; withdraw a queued request instead",
        }.get((state, event), "")
        raise ValueError(
            f"request {req_id!r} is {state.value}: {event.value} is not valid{hint}"
        ) from None


@attrs.define
class _Entry:
    req_id: str
    tenant: str
    band: Band
    state: RequestState
    since: float  # queued at, then admitted at
    deadline: float


class Admission:
    """One model's admission state. `name` (the model) is for `repr` and reasons."""

    def __init__(self, config: AdmissionConfig, *, name: str = "") -> None:
        self.config = config
        self.name = name
        self._concurrency = config.concurrency
        self._bands = sorted(config.bands, key=lambda b: b.rank)
        self._entries: dict[str, _Entry] = {}
        self._in_flight = 0
        # Per band (by name): tenant -> that tenant's waiting requests in arrival order.
        # The tenants dict's own order is the round-robin turn order.
        self._waiting: dict[str, dict[str, dict[str, _Entry]]] = {b.name: {} for b in self._bands}
        self._queued_per_band: dict[str, int] = {b.name: 0 for b in self._bands}
        self._queued = 0
        self._deadlines: list[tuple[float, int, str]] = []  # heap; stale entries skipped
        self._seq = 0
        self._mean_service_s: float | None = None
        self._admitted_total = 0
        self._rejected_total = 0
        self._expired_total = 0
        self._withdrawn_total = 0
        self._released_total = 0

    # -- queries -----------------------------------------------------------

    @property
    def concurrency(self) -> int:
        return self._concurrency

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._queued

    def state_of(self, req_id: str) -> RequestState | None:
        """The request's state, or None when it is not (or no longer) known."""
        entry = self._entries.get(req_id)
        return None if entry is None else entry.state

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued requests: when to call `expire` next."""
        while self._deadlines:
            deadline, _, req_id = self._deadlines[0]
            entry = self._entries.get(req_id)
            if entry is not None and entry.state is RequestState.QUEUED:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def retry_after(self, band: str) -> float:
        """The Retry-After estimate for a request of `band` refused now (see the module doc)."""
        b = self.config.band(band)
        ahead = sum(self._queued_per_band[x.name] for x in self._bands if x.rank <= b.rank)
        if self._concurrency == 0:
            estimate = b.queue_timeout_s
        else:
            service = self._mean_service_s
            if service is None:
                service = b.queue_timeout_s
            estimate = (ahead + 1) * service / self._concurrency
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    # -- events ------------------------------------------------------------

    def request(self, req_id: str, tenant: str, band: str, now: float) -> Admit | Queued | Reject:
        b = self.config.band(band)
        if req_id in self._entries:
            raise ValueError(
                f"request id {req_id!r} is already {self._entries[req_id].state.value}; "
                "ids must be unique among live requests"
            )
        if self._in_flight < self._concurrency and not self._waiting_at_or_above(b):
            self._entries[req_id] = _Entry(req_id, tenant, b, RequestState.ADMITTED, now, math.inf)
            self._in_flight += 1
            self._admitted_total += 1
            return Admit(req_id)
        if self._queued >= self.config.queue_limit:
            self._rejected_total += 1
            model = f" for {self.name}" if self.name else ""
            return Reject(
                f"the queue{model} is full ({self._queued} requests waiting, the limit is "
                f"{self.config.queue_limit}; {self._in_flight} of {self._concurrency} slots busy)",
                self.retry_after(band),
            )
        entry = _Entry(req_id, tenant, b, RequestState.QUEUED, now, now + b.queue_timeout_s)
        self._entries[req_id] = entry
        self._waiting[b.name].setdefault(tenant, {})[req_id] = entry
        self._queued_per_band[b.name] += 1
        self._queued += 1
        self._seq += 1
        heapq.heappush(self._deadlines, (entry.deadline, self._seq, req_id))
        self._compact_deadlines()
        return Queued(req_id, entry.deadline)

    def release(self, req_id: str, now: float) -> tuple[str, ...]:
        """An admitted request finished or failed; returns the ids admitted in its place."""
        entry = self._entries.get(req_id)
        if entry is None:
            raise ValueError(f"request {req_id!r} is not known: release is for admitted requests")
        next_state(entry.state, RequestEvent.RELEASE, req_id)
        self._end_admitted(entry, now)
        self._released_total += 1
        return self._pump(now)

    def withdraw(self, req_id: str, now: float) -> tuple[str, ...]:
        """A queued request left, or an admitted one was cancelled; returns the ids admitted."""
        entry = self._entries.get(req_id)
        if entry is None:
            return ()  # already gone: expired, or rejected, before the client left
        next_state(entry.state, RequestEvent.WITHDRAW, req_id)
        if entry.state is RequestState.QUEUED:
            self._unqueue(entry)
        else:
            self._end_admitted(entry, now)
        self._withdrawn_total += 1
        return self._pump(now)

    def expire(self, now: float) -> tuple[tuple[str, float], ...]:
        """Remove the queued requests whose deadline is at or before `now`.

        Returns (req_id, retry_after_s) for each, earliest deadline first; the
        caller answers them 429.
        """
        gone: list[_Entry] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req_id = heapq.heappop(self._deadlines)
            entry = self._entries.get(req_id)
            if entry is None or entry.state is not RequestState.QUEUED:
                continue
            next_state(entry.state, RequestEvent.EXPIRE, req_id)
            self._unqueue(entry)
            self._expired_total += 1
            gone.append(entry)
        # Estimated after all are gone: the queue they leave behind is what a retry meets.
        return tuple((e.req_id, self.retry_after(e.band.name)) for e in gone)

    def set_concurrency(self, n: int, now: float) -> tuple[str, ...]:
        """Change the limit (replicas came or went). Lowering it cancels nothing:
        requests in flight finish, and none is admitted until in-flight drops below `n`."""
        if n < 0:
            raise ValueError(f"concurrency must be 0 or more, got {n}")
        self._concurrency = n
        return self._pump(now)

    # -- reporting ---------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "concurrency": self._concurrency,
            "in_flight": self._in_flight,
            "queue_limit": self.config.queue_limit,
            "queued": dict(self._queued_per_band),
            "queued_tenants": {band: len(tenants) for band, tenants in self._waiting.items()},
            "admitted_total": self._admitted_total,
            "rejected_total": self._rejected_total,
            "expired_total": self._expired_total,
            "withdrawn_total": self._withdrawn_total,
            "released_total": self._released_total,
            "mean_service_s": self._mean_service_s,
        }

    def __repr__(self) -> str:
        name = f" {self.name}" if self.name else ""
        queued = ", ".join(f"{b}={n}" for b, n in self._queued_per_band.items())
        return (
            f"<Admission{name} {self._in_flight}/{self._concurrency} in flight, "
            f"queued {queued} (limit {self.config.queue_limit})>"
        )

    # -- internals ---------------------------------------------------------

    def _waiting_at_or_above(self, band: Band) -> bool:
        return any(self._queued_per_band[b.name] for b in self._bands if b.rank <= band.rank)

    def _end_admitted(self, entry: _Entry, now: float) -> None:
        del self._entries[entry.req_id]
        self._in_flight -= 1
        held = max(0.0, now - entry.since)
        if self._mean_service_s is None:
            self._mean_service_s = held
        else:
            self._mean_service_s += _SERVICE_EWMA_ALPHA * (held - self._mean_service_s)

    def _unqueue(self, entry: _Entry) -> None:
        del self._entries[entry.req_id]
        tenants = self._waiting[entry.band.name]
        line = tenants[entry.tenant]
        del line[entry.req_id]
        if not line:
            # Leaving the rotation: a later arrival of this tenant joins at the back.
            del tenants[entry.tenant]
        self._queued_per_band[entry.band.name] -= 1
        self._queued -= 1

    def _pump(self, now: float) -> tuple[str, ...]:
        admitted: list[str] = []
        for entry in self._take(self._concurrency - self._in_flight):
            next_state(entry.state, RequestEvent.PROMOTE, entry.req_id)
            entry.state = RequestState.ADMITTED
            entry.since = now
            self._in_flight += 1
            self._admitted_total += 1
            admitted.append(entry.req_id)
        return tuple(admitted)

    def _take(self, slots: int) -> Iterable[_Entry]:
        """Up to `slots` waiting requests, in service order, taken off the queue."""
        for band in self._bands:
            tenants = self._waiting[band.name]
            while slots > 0 and tenants:
                tenant = next(iter(tenants))
                line = tenants.pop(tenant)
                req_id = next(iter(line))
                entry = line.pop(req_id)
                if line:
                    tenants[tenant] = line  # re-inserted: to the back of the rotation
                self._queued_per_band[band.name] -= 1
                self._queued -= 1
                slots -= 1
                yield entry

    def _compact_deadlines(self) -> None:
        # Withdrawn and admitted requests leave their heap entries behind;
        # rebuild once they outnumber the live ones so the heap stays O(queue).
        if len(self._deadlines) > 2 * self._queued + 16:
            self._deadlines = [
                (e.deadline, i, e.req_id)
                for i, e in enumerate(self._entries.values())
                if e.state is RequestState.QUEUED
            ]
            heapq.heapify(self._deadlines)
