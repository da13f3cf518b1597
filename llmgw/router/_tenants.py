"""Tenant limits: requests and tokens per minute as token buckets, and the band ceiling.

Pure: no trio, no sockets, no clock of its own (every call is given `now`, in
seconds on any monotonic clock). The router asks `TenantLimiter.admit` after
authentication and before the model's admission queue, and `charge`s a
tenant's tokens when an answer's usage is known (prompt + completion), so the
token bucket may go below zero: it then refuses until it has refilled to zero.

A bucket's capacity is the per-minute figure and it refills continuously at
capacity / 60 per second; a limit of 0 admits nothing (429 with no Retry-After: waiting
will not help). With router workers (N processes on one port) each
process enforces its `share` of every limit (below; the router's own limits too),
spread over its workers by the kernel's choice of connection. This is router-only
mode's limiter (no store); a router with the control plane's store holds tenants'
limits across the whole fleet instead (llmgw/router/_budgets.py).

State is per tenant and bounded: a tenant not seen for `idle_s` whose buckets
have refilled is dropped (a fresh bucket is full, so nothing is forgiven).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Literal

import attrs

if TYPE_CHECKING:
    from llmgw.keys import TenantLimits

Reason = Literal["rpm", "tpm", "band"]

# Float refill is not exact: a bucket due to admit at t may read a hair below at t. A
# level within this many tokens of what is needed admits; a wait is computed to half of it.
_SLACK = 1e-6
IDLE_S = 600.0


def share(total: int, index: int, workers: int) -> int:
    """Worker `index`'s part of a limit of `total` split between `workers` processes.

    The parts add up to `total` (the first `total % workers` workers get one more),
    except that a limit of 1 or more is never split into a 0: with fewer than
    `workers`, every worker gets 1 and together they admit up to `workers`.
    """
    if workers <= 1 or total <= 0:
        return total
    part = total // workers + (1 if index < total % workers else 0)
    return max(part, 1)


class Bucket:
    """A token bucket: `capacity`, refilled at `capacity / 60` per second, starting full."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.at = now

    def __repr__(self) -> str:
        return f"<Bucket {self.level:.3f}/{self.capacity:g} at {self.at:.3f}>"

    def refill(self, now: float) -> float:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now
        return self.level

    def resize(self, capacity: int, now: float) -> None:
        self.refill(now)
        self.capacity = float(capacity)
        self.rate = capacity / 60.0
        self.level = min(self.level, self.capacity)

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until the level is at least `need` (0: it is now)."""
        short = need - self.refill(now)
        if short <= _SLACK:
            return 0.0
        return (short - _SLACK / 2) / self.rate

    def full(self, now: float) -> bool:
        return self.refill(now) >= self.capacity - _SLACK


@attrs.frozen
class Refused:
    """A request over its tenant's limit: the answer is 429 (rpm, tpm) or 403 (band)."""

    tenant: str
    reason: Reason
    limit: int | str  # the tenant's figure (its whole per-minute limit), or its highest band
    retry_after_s: int | None  # whole seconds, >= 1; None for the band and a 0 limit
    asked: str | None = None  # the band asked, for "band"
    leasing: bool = False  # the fleet's budget is not spent: a lease is on its way

    @property
    def message(self) -> str:
        if self.reason == "band":
            return (
                f"tenant {self.tenant}: the priority band {self.asked!r} is above its "
                f"highest allowed band {self.limit!r}"
            )
        what = "requests" if self.reason == "rpm" else "tokens"
        if self.retry_after_s is None:
            flag = "--rpm" if self.reason == "rpm" else "--tpm"
            return (
                f"tenant {self.tenant}: its limit is 0 {what} per minute, so nothing is "
                f"admitted (llmgw ctl tenants set {self.tenant} {flag} N)"
            )
        return (
            f"tenant {self.tenant}: over its {self.limit} {what} per minute; "
            f"retry in {self.retry_after_s} s"
        )


def retry_seconds(wait_s: float) -> int:
    """The whole seconds a client is told to wait (>= 1), at or after the wait."""
    return max(1, math.ceil(wait_s))


def ceiling(
    tenant: str, asked: str, max_band: str | None, ranks: Mapping[str, int]
) -> Refused | None:
    """The band ceiling: refused when `asked` ranks above (a lower rank: more urgent
    than) the tenant's `max_band`. An unknown `max_band` is no ceiling (the caller
    logs it); so is None."""
    if max_band is None or max_band not in ranks or asked not in ranks:
        return None
    if ranks[asked] < ranks[max_band]:
        return Refused(tenant, "band", max_band, None, asked=asked)
    return None


class _Tenant:
    __slots__ = ("requests", "seen", "tokens")

    def __init__(self, now: float) -> None:
        self.requests: Bucket | None = None
        self.tokens: Bucket | None = None
        self.seen = now


class TenantLimiter:
    """Every tenant's buckets in this router process (its `worker` of `workers`)."""

    def __init__(
        self,
        *,
        worker: int = 0,
        workers: int = 1,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`clock`: the monotonic clock its callers pass (the router's: trio's)."""
        self.clock = clock or _no_clock
        self.worker = worker
        self.workers = workers
        self.idle_s = idle_s
        self._tenants: dict[str, _Tenant] = {}
        self._pruned_at: float | None = None

    def __repr__(self) -> str:
        return f"<TenantLimiter {len(self._tenants)} tenants, worker {self.worker}/{self.workers}>"

    def statistics(self) -> dict[str, dict[str, float | None]]:
        return {
            name: {
                "requests": None if t.requests is None else t.requests.level,
                "tokens": None if t.tokens is None else t.tokens.level,
                "seen": t.seen,
            }
            for name, t in self._tenants.items()
        }

    def _bucket(self, old: Bucket | None, limit: int | None, now: float) -> Bucket | None:
        if limit is None:
            return None
        part = share(limit, self.worker, self.workers)
        if old is None:
            return Bucket(part, now)
        if old.capacity != part:
            old.resize(part, now)
        return old

    def admit(self, tenant: str, limits: TenantLimits | None, now: float) -> Refused | None:
        """Take one request from the tenant's buckets; a Refused (and nothing taken) when
        either refuses. `limits` None: no tenant limits."""
        self._prune(now)
        if limits is None or (limits.rpm is None and limits.tpm is None):
            return None
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(now)
        if limits.rpm == 0:
            return Refused(tenant, "rpm", 0, None)
        if limits.tpm == 0:
            return Refused(tenant, "tpm", 0, None)
        state.seen = max(state.seen, now)
        state.requests = self._bucket(state.requests, limits.rpm, now)
        state.tokens = self._bucket(state.tokens, limits.tpm, now)
        # Both are asked, and the longer wait is the answer: Retry-After is when it admits.
        rpm_wait = 0.0 if state.requests is None else state.requests.wait_s(1.0, now)
        tpm_wait = 0.0 if state.tokens is None else state.tokens.wait_s(0.0, now)
        if rpm_wait > 0 or tpm_wait > 0:
            if rpm_wait >= tpm_wait:
                return Refused(tenant, "rpm", _limit(limits.rpm), retry_seconds(rpm_wait))
            return Refused(tenant, "tpm", _limit(limits.tpm), retry_seconds(tpm_wait))
        if state.requests is not None:
            state.requests.level -= 1.0
        return None

    def charge(self, tenant: str, tokens: int, now: float) -> None:
        """An answer's tokens (prompt + completion), once known; below zero is a debt."""
        state = self._tenants.get(tenant)
        if state is None or state.tokens is None or tokens <= 0:
            return
        state.tokens.refill(now)
        state.tokens.level -= tokens
        state.seen = max(state.seen, now)

    def _prune(self, now: float) -> None:
        if self._pruned_at is not None and now - self._pruned_at < min(60.0, self.idle_s):
            return
        self._pruned_at = now
        for name in [n for n, t in self._tenants.items() if _idle(t, now, self.idle_s)]:
            del self._tenants[name]

    def tenants(self) -> Iterable[str]:
        return self._tenants.keys()


def _idle(t: _Tenant, now: float, idle_s: float) -> bool:
    if now - t.seen < idle_s:
        return False
    return all(b is None or b.full(now) for b in (t.requests, t.tokens))


def _limit(value: int | None) -> int:
    assert value is not None
    return value


def _no_clock() -> float:
    raise RuntimeError("TenantLimiter: no clock was given; pass clock= (callers pass the time)")
