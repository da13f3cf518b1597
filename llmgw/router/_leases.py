"""A router's tenant limits as the request path uses them, and the lease loop that keeps
the fleet's budgets supplied from the store.

`TenantAdmission` holds the limiter: with a budget source (the control plane's store)
a `FleetLimiter` (llmgw/router/_budgets.py: limits held across every router of the
fleet, counted in wall-clock minutes), else a `TenantLimiter` (llmgw/router/_tenants.py:
each of this router's workers admits its share, on trio's clock).

The lease loop (`run`): every `TICK_S`, or at once when a request finds nothing in
hand, it asks the limiter what to lease and give back and makes one store call for all
of it (one transaction); a call that fails leaves the limiter admitting on its own (its
fallback) and is tried again after `RETRY_S`. A call that hangs (a frozen store) is not
cancelled (the store's own deadline ends it) but counts as out of reach after
`STORE_SLOW_S`: the limiter reads that from when the call began.

A request that finds its router's lease spent while the window's budget is not (a
burst at a router that was idle, or faster than its lease was sized for) waits for
the lease on its way, at most `LEASE_WAIT_S`, rather than being refused while its
tenant is under its limit; in steady traffic leases are taken ahead of need (at half
of the next `LEASE_HORIZON_S`'s demand), so no request waits on the store.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from llmgw.keys import BudgetAsk, BudgetLeases
from llmgw.router._budget_metrics import BudgetStatistics
from llmgw.router._budgets import FleetLimiter
from llmgw.router._tenants import Refused, TenantLimiter

if TYPE_CHECKING:
    from llmgw.keys import TenantLimits

log = logging.getLogger("llmgw.router.leases")

TICK_S = 0.05
RETRY_S = 1.0
LEASE_WAIT_S = 0.25


class BudgetSource(Protocol):
    """Where tenants' budgets are leased from (the control plane's store)."""

    async def lease_budget(
        self, router: str, now: float, asks: Sequence[BudgetAsk]
    ) -> BudgetLeases: ...


def router_id(worker: int) -> str:
    """This router process, as the store counts routers: host, pid and worker."""
    return f"{socket.gethostname()}:{os.getpid()}:{worker}"


class TenantAdmission:
    """The tenant limits of one router process (its `worker` of `workers`)."""

    def __init__(
        self,
        worker: int,
        workers: int,
        budget: BudgetSource | None,
        *,
        clock: Callable[[], float] | None = None,
        tick_s: float = TICK_S,
        retry_s: float = RETRY_S,
    ) -> None:
        """`clock`: the wall clock (tests set it); `budget` None: per-process buckets."""
        self._budget = budget
        self.limiter: FleetLimiter | TenantLimiter
        if budget is not None:
            self.limiter = FleetLimiter(routers=workers, clock=clock or time.time)
        else:
            self.limiter = TenantLimiter(worker=worker, workers=workers, clock=trio.current_time)
        self.router = router_id(worker)
        self._tick_s, self._retry_s = tick_s, retry_s
        self._poke = trio.Event()  # a request waits for a lease: lease now
        self._answered = trio.Event()  # the store answered (or failed): look again
        self.waited = 0  # requests that waited for a lease
        self.leases = 0  # store calls answered
        self.lease_failures = 0

    def __repr__(self) -> str:
        return f"<TenantAdmission {self.limiter!r}>"

    def statistics(self) -> Any:
        return self.limiter.statistics()

    def budget_statistics(self) -> BudgetStatistics | None:
        lim = self.limiter
        if not isinstance(lim, FleetLimiter):
            return None
        return BudgetStatistics(
            store_ok=lim.store_ok,
            leases=self.leases,
            lease_failures=self.lease_failures,
            waited=self.waited,
            fallback_admitted=lim.fallback_admitted,
            credited=lim.credited,
        )

    async def admit(self, tenant: str, limits: TenantLimits | None) -> Refused | None:
        """None: admitted; else why not (the band ceiling is the caller's)."""
        lim = self.limiter
        refused = lim.admit(tenant, limits, lim.clock())
        if refused is None or not refused.leasing or not isinstance(lim, FleetLimiter):
            return refused
        self.waited += 1
        with trio.move_on_after(LEASE_WAIT_S):
            while refused is not None and refused.leasing:
                answered = self._answered
                self._poke.set()
                await answered.wait()
                refused = lim.admit(tenant, limits, lim.clock(), again=True)
        return refused

    def charge(self, tenant: str, tokens: int) -> None:
        """A request this admitted has finished with `tokens` (0: none or unknown)."""
        self.limiter.charge(tenant, tokens, self.limiter.clock())

    async def run(self) -> None:
        """The lease loop (for a FleetLimiter; returns at once otherwise): until cancelled."""
        lim, source = self.limiter, self._budget
        if not isinstance(lim, FleetLimiter) or source is None:
            return
        down_since: float | None = None
        while True:
            asks = lim.plan(lim.clock())
            if asks:
                try:
                    answer = await source.lease_budget(self.router, lim.clock(), asks)
                except Exception as exc:  # the store is down or slow: admit on our own
                    lim.lease_failed(asks, lim.clock())
                    self.lease_failures += 1
                    self._answer()
                    if down_since is None:
                        down_since = lim.clock()
                        log.warning(
                            "tenant limits: cannot lease budgets from the store (%s); each "
                            "router admits its own part of every limit (1/%d) until it answers",
                            exc or type(exc).__name__,
                            lim.routers,
                        )
                    await trio.sleep(self._retry_s)
                    continue
                lim.leased(asks, answer, lim.clock())
                self.leases += 1
                self._answer()
                if down_since is not None:
                    log.warning(
                        "tenant limits: the store answers again after %.1f s; budgets are "
                        "leased from it again",
                        lim.clock() - down_since,
                    )
                    down_since = None
            else:
                self._answer()  # nothing to lease: a waiting request looks again
            with trio.move_on_after(self._tick_s):
                await self._poke.wait()
            self._poke = trio.Event()

    def _answer(self) -> None:
        self._answered.set()
        self._answered = trio.Event()
