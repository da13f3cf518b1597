"""The lease loop: keeps a router's `FleetLimiter` (llmgw/router/_budgets.py) supplied
with its tenants' budgets from the store, off the request path.

Every `TICK_S` it asks the limiter what to lease and give back, and makes one store
call for all of it (one transaction); a call that fails leaves the limiter admitting
on its own (its fallback) and is tried again after `RETRY_S`. A call that hangs (a
frozen store) is not cancelled (the store's own deadline ends it) but counts as out
of reach after `STORE_SLOW_S`: the limiter reads that from when the call began.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from llmgw.keys import BudgetAsk, BudgetLeases
from llmgw.router._bands import Limiter
from llmgw.router._budgets import FleetLimiter
from llmgw.router._tenants import TenantLimiter

log = logging.getLogger("llmgw.router.leases")

TICK_S = 0.05
RETRY_S = 1.0


class BudgetSource(Protocol):
    """Where tenants' budgets are leased from (the control plane's store)."""

    async def lease_budget(
        self, router: str, now: float, asks: Sequence[BudgetAsk]
    ) -> BudgetLeases: ...


def tenant_limiter(worker: int, workers: int, budget: BudgetSource | None) -> Limiter:
    """With a `budget` source (the control plane's store), tenants' limits hold across every
    router of the fleet (`FleetLimiter`, counted in wall-clock minutes: `keep_leases` keeps
    it supplied); without one, each of this router's `workers` processes admits its share
    of them (`TenantLimiter`, on trio's clock)."""
    if budget is not None:
        return FleetLimiter(routers=workers, clock=time.time)
    return TenantLimiter(worker=worker, workers=workers, clock=trio.current_time)


async def supply_leases(limiter: Limiter, budget: BudgetSource | None, worker: int) -> None:
    """`keep_leases` for `tenant_limiter`'s FleetLimiter; returns at once for the other."""
    if isinstance(limiter, FleetLimiter) and budget is not None:
        await keep_leases(limiter, budget, router_id(worker))


def router_id(worker: int) -> str:
    """This router process, as the store counts routers: host, pid and worker."""
    return f"{socket.gethostname()}:{os.getpid()}:{worker}"


async def keep_leases(
    limiter: FleetLimiter,
    source: BudgetSource,
    router: str,
    *,
    clock: Callable[[], float] = time.time,
    tick_s: float = TICK_S,
    retry_s: float = RETRY_S,
) -> None:
    """Run until cancelled."""
    down_since: float | None = None
    while True:
        asks = limiter.plan(clock())
        if asks:
            try:
                answer = await source.lease_budget(router, clock(), asks)
            except Exception as exc:  # the store is down or slow: admit on our own
                limiter.lease_failed(asks, clock())
                if down_since is None:
                    down_since = clock()
                    log.warning(
                        "tenant limits: cannot lease budgets from the store (%s); each "
                        "router admits its own part of every limit (1/%d) until it answers",
                        exc or type(exc).__name__,
                        limiter.routers,
                    )
                await trio.sleep(retry_s)
                continue
            limiter.leased(asks, answer, clock())
            if down_since is not None:
                log.warning(
                    "tenant limits: the store answers again after %.1f s; budgets are "
                    "leased from it again",
                    clock() - down_since,
                )
                down_since = None
        await trio.sleep(tick_s)
