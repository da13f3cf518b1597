"""Tenants' per-minute budgets, leased to the routers (llmgw/core/_budget.py).

`rate_budget` holds, per tenant, kind ("rpm", "tpm") and window (minutes since
the epoch), how much of the window's budget the routers have taken; a lease
reads and updates its row in one transaction, under the row's write lock
(taken by a first, empty UPDATE: PostgreSQL's row lock, SQLite's BEGIN
IMMEDIATE), so two routers leasing at once never both get the last of it.
`rate_routers` holds when each router process last leased: their count is what
a router falls back on when the store is out of reach. Rows of windows and
routers older than `KEEP_S` are deleted as leases go by.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.core import BUDGET_WINDOW_S, grant_budget, restore_budget
from llmgw.errors import UsageError
from llmgw.keys import BudgetAsk, BudgetGrant, BudgetLeases
from llmgw.store._backends import Exec
from llmgw.store._runner import Runner

KINDS = ("rpm", "tpm")
ROUTER_SEEN_S = 120.0  # a router that leased within this long counts among the routers
KEEP_S = 600.0  # older windows and routers are deleted

_WHERE = " WHERE tenant = ? AND kind = ? AND win = ?"


def _check(ask: BudgetAsk) -> None:
    if ask.kind not in KINDS:
        raise UsageError(f"budget lease for {ask.tenant}: kind {ask.kind!r} is not one of {KINDS}")
    if min(ask.limit, ask.ask, ask.give_back) < 0:
        raise UsageError(f"budget lease {ask!r}: limit, ask and give_back must be 0 or more")


def _lease(run: Exec, a: BudgetAsk) -> BudgetGrant:
    key = (a.tenant, a.kind, a.window)
    run(
        "INSERT INTO rate_budget (tenant, kind, win, taken) VALUES (?,?,?,0)"
        " ON CONFLICT DO NOTHING",
        key,
    )
    run("UPDATE rate_budget SET taken = taken" + _WHERE, key)  # the row's lock, held to commit
    taken = restore_budget(
        int(run("SELECT taken FROM rate_budget" + _WHERE, key)[0][0]), a.give_back
    )
    granted = grant_budget(a.limit, taken, a.ask)
    taken += granted
    run("UPDATE rate_budget SET taken = ?" + _WHERE, (taken, *key))
    return BudgetGrant(granted, taken)


class BudgetStore:
    """The `rate_budget` and `rate_routers` tables."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner
        self._pruned_window: int | None = None

    async def lease_budget(
        self, router: str, now: float, asks: Sequence[BudgetAsk]
    ) -> BudgetLeases:
        """Each ask's give-back, then its lease, all in one transaction (rows locked in a
        fixed order, so two routers' batches never wait on each other in a circle); `now`:
        the router's wall clock, for the count of routers."""
        for a in asks:
            _check(a)
        order = sorted(
            range(len(asks)), key=lambda i: (asks[i].tenant, asks[i].kind, asks[i].window)
        )
        window = int(now // BUDGET_WINDOW_S)
        prune = self._pruned_window != window
        keep_from = window - int(KEEP_S // BUDGET_WINDOW_S)

        def write(run: Exec) -> BudgetLeases:
            run(
                "INSERT INTO rate_routers (router, seen_at) VALUES (?, ?) ON CONFLICT (router)"
                " DO UPDATE SET seen_at = excluded.seen_at",
                (router, now),
            )
            grants: list[BudgetGrant | None] = [None] * len(asks)
            for i in order:
                grants[i] = _lease(run, asks[i])
            if prune:
                run("DELETE FROM rate_budget WHERE win < ?", (keep_from,))
                run("DELETE FROM rate_routers WHERE seen_at < ?", (now - KEEP_S,))
            routers = run(
                "SELECT COUNT(*) FROM rate_routers WHERE seen_at >= ?", (now - ROUTER_SEEN_S,)
            )
            return BudgetLeases(
                tuple(g for g in grants if g is not None), max(1, int(routers[0][0]))
            )

        leases = await self._run.tx(write)
        self._pruned_window = window
        return leases

    async def budget_taken(self, tenant: str, kind: str, window: int) -> int | None:
        """What the routers have taken of a window's budget; None: no lease for it yet."""
        rows = await self._run.q("SELECT taken FROM rate_budget" + _WHERE, (tenant, kind, window))
        return int(rows[0][0]) if rows else None
