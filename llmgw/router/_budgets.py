"""Tenant limits held fleet-wide: each router spends leases of a tenant's per-minute budget.

Used in place of the per-process buckets (llmgw/router/_tenants.py) when the router
has the control plane's store. A tenant's rpm and tpm are budgets per wall-clock
minute window (llmgw/core/_budget.py); every router process, of every control plane
and every router worker, takes its part of a window's budget from the store in small
leases (the lease loop, llmgw/router/_leases.py, calls `plan` and `leased`) and spends
it here with no store round trip: `admit` is a dictionary lookup.

Pure: no trio, no store, no clock of its own (every call is given the wall-clock time).

Per tenant and kind, in the current window, a `_Ledger` holds what this router was
granted and has not spent (`held`), and decides:

- admit (rpm): one request from `held`; tokens (tpm): while `held` is above 0, with
  the tenant's recent tokens per request reserved (`held` less that estimate), settled
  by `charge` when the answer's tokens are known (the difference, or below zero a
  debt the next lease pays first);
- the first request of a window, before any lease has come back, on credit (at most
  one per router, kind and window: the only way past a limit while the store answers);
- refused once the store said the window's budget is spent: Retry-After is the seconds
  to the next window; while a lease is on its way, refused with `leasing` set (the
  caller, llmgw/router/_leases.py, waits a moment for it and asks `again`), Retry-After 1;
- while the store is out of reach (the last lease failed, or has not come back within
  `STORE_SLOW_S`): up to `fallback_share` of the limit per window, the limit split
  between the router processes the store last counted (its own control plane's
  `workers` before it ever answered), leases already held included.

Leases: `plan` asks for more where `held` is low and requests came within
`IDLE_RETURN_S` (sized by `lease_ask`), for the next window in the last
`LEASE_HORIZON_S` of this one, again every `PROBE_S` where the budget was spent (a
router that went idle may have given some back), and gives back what an idle router
holds (`unused_lease`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from llmgw.core import (
    IDLE_RETURN_S,
    LEASE_HORIZON_S,
    decayed_rate,
    fallback_share,
    lease_ask,
    unused_lease,
    window_left_s,
    window_of,
)
from llmgw.keys import BudgetAsk, BudgetLeases
from llmgw.router._tenants import Reason, Refused, retry_seconds

if TYPE_CHECKING:
    from llmgw.keys import TenantLimits

STORE_SLOW_S = 3.0  # a lease not back in this long: the store counts as out of reach (a busy
# PostgreSQL on a loaded host answers in a second or two; a share admitted on its own is not
# written to the store, so counting a slow store as down too soon lets a limit through twice)
PROBE_S = 1.0  # a spent window is asked again this often while requests come
IDLE_S = 600.0  # a tenant not seen for this long is forgotten
_TOKENS_ALPHA = 0.2
Verdict = Literal[
    "ok", "credit", "spent", "leasing"
]  # the weight of the newest answer in a tenant's tokens per request


class _Ledger:
    """One tenant's budget of one kind in this router, for the current window."""

    __slots__ = (
        "ahead",
        "ahead_asked",
        "asked_at",
        "exhausted",
        "held",
        "leases",
        "limit",
        "rate",
        "rate_at",
        "remaining",
        "spent",
        "wanted_at",
        "window",
    )

    def __init__(self, window: int, limit: int, now: float) -> None:
        self.window = window
        self.limit = limit
        self.held = 0.0  # granted and not spent (below 0: tokens charged beyond it)
        self.spent = 0.0
        self.leases = 0  # grants received for this window
        self.exhausted = False  # the store had less than was asked
        self.remaining: int | None = None  # what the store last said was left
        self.ahead = 0  # granted for the next window
        self.ahead_asked = False
        self.rate = 0.0  # demand per second (admitted and refused; tokens for tpm)
        self.rate_at = now
        self.wanted_at = now  # the last request (or charge) for it
        self.asked_at: float | None = None

    def __repr__(self) -> str:
        return (
            f"<_Ledger window {self.window} held {self.held:g} spent {self.spent:g} "
            f"of {self.limit}{' exhausted' if self.exhausted else ''}>"
        )

    def roll(self, window: int) -> None:
        if window <= self.window:
            return
        ahead = self.ahead if window == self.window + 1 else 0
        self.window = window
        self.held = float(ahead)
        self.spent = 0.0
        self.leases = 1 if ahead else 0
        self.exhausted = False
        self.remaining = None
        self.ahead = 0
        self.ahead_asked = False
        self.asked_at = None

    def want(self, now: float, amount: float) -> None:
        self.rate = decayed_rate(self.rate, self.rate_at, now, amount)
        self.rate_at = max(self.rate_at, now)
        self.wanted_at = max(self.wanted_at, now)

    def rate_now(self, now: float) -> float:
        return decayed_rate(self.rate, self.rate_at, now, 0.0)

    def take(self, amount: float) -> None:
        self.held -= amount
        self.spent += amount


class FleetLimiter:
    """Every tenant's leased budgets in this router process."""

    def __init__(
        self, *, routers: int = 1, idle_s: float = IDLE_S, clock: Callable[[], float] | None = None
    ) -> None:
        """`routers`: how many router processes share a limit until the store says (this
        control plane's workers). `clock`: the wall clock its callers pass (windows are
        wall-clock minutes, fleet-wide)."""
        self.clock = clock or _no_clock
        self.routers = max(1, routers)
        self.idle_s = idle_s
        self.store_ok: bool | None = None  # None: no lease has come back yet
        self.leasing_since: float | None = None  # a lease on its way since
        self._ledgers: dict[tuple[str, str], _Ledger] = {}
        self._reserved: dict[str, collections.deque[tuple[int, float]]] = {}
        self._per_request: dict[str, float] = {}  # tenant -> tokens per request (recent)
        self._pruned_at: float | None = None
        self.credited = 0  # requests admitted on credit
        self.fallback_admitted = 0  # requests admitted while the store was out of reach

    def __repr__(self) -> str:
        state = {None: "not leased yet", True: "store ok", False: "store out of reach"}
        return (
            f"<FleetLimiter {len(self._ledgers)} budgets, {self.routers} routers, "
            f"{state[self.store_ok]}>"
        )

    def statistics(self) -> dict[str, object]:
        tenants: dict[str, dict[str, object]] = {}
        for (tenant, kind), led in self._ledgers.items():
            tenants.setdefault(tenant, {})[kind] = {
                "window": led.window,
                "held": led.held,
                "spent": led.spent,
                "exhausted": led.exhausted,
                "remaining": led.remaining,
            }
        return {
            "store_ok": self.store_ok,
            "routers": self.routers,
            "credited": self.credited,
            "fallback_admitted": self.fallback_admitted,
            "tenants": tenants,
        }

    def fallback(self, now: float) -> bool:
        """Whether this router admits on its own now (the store is out of reach)."""
        if self.store_ok is False:
            return True
        return self.leasing_since is not None and now - self.leasing_since > STORE_SLOW_S

    # --- the request path ---------------------------------------------------------------

    def admit(
        self, tenant: str, limits: TenantLimits | None, now: float, *, again: bool = False
    ) -> Refused | None:
        """Take one request (and the tenant's recent tokens per request) from its leases;
        a Refused, and nothing taken, when either kind refuses (`leasing` when neither
        kind's budget is spent: a lease on its way may admit it). `again`: the same
        request asks again after waiting for a lease (its demand is counted once)."""
        self._prune(now)
        if limits is None or (limits.rpm is None and limits.tpm is None):
            return None
        if limits.rpm == 0:
            return Refused(tenant, "rpm", 0, None)
        if limits.tpm == 0:
            return Refused(tenant, "tpm", 0, None)
        window = window_of(now)
        fallback = self.fallback(now)
        estimate = self._per_request.get(tenant, 0.0)
        admitted: list[tuple[_Ledger, float, bool]] = []
        waits: list[tuple[float, Refused]] = []
        for kind, limit in (("rpm", limits.rpm), ("tpm", limits.tpm)):
            if limit is None:
                continue
            led = self._ledger(tenant, kind, limit, window, now)
            if kind == "rpm" and not again:
                led.want(now, 1.0)
            else:
                led.wanted_at = max(led.wanted_at, now)  # its rate is the tokens charged
            need = 1.0 if kind == "rpm" else estimate
            verdict = self._verdict(led, kind, fallback)
            if verdict in ("ok", "credit"):
                admitted.append((led, need, verdict == "credit"))
                continue
            wait = window_left_s(now) if verdict == "spent" else 1.0
            reason: Reason = "rpm" if kind == "rpm" else "tpm"
            leasing = verdict == "leasing"
            waits.append((wait, Refused(tenant, reason, limit, retry_seconds(wait), None, leasing)))
        if waits:
            return max(waits, key=lambda w: w[0])[1]
        for led, need, on_credit in admitted:
            self.credited += on_credit
            led.take(need)
        if fallback:
            self.fallback_admitted += 1
        if limits.tpm is not None:
            self._reserved.setdefault(tenant, collections.deque()).append((window, estimate))
        return None

    def _verdict(self, led: _Ledger, kind: str, fallback: bool) -> Verdict:
        """ "ok" (from what it holds), "credit" (the window's first, before any lease came
        back), "spent" (the window's budget is), "leasing" (a lease is on its way)."""
        enough = led.held >= 1 if kind == "rpm" else led.held > 0
        if enough:
            return "ok"
        if fallback:
            share = fallback_share(led.limit, self.routers)
            return "ok" if led.spent < share else "spent"
        if led.exhausted:
            return "spent"
        if led.leases == 0 and led.spent <= 0:
            return "credit"
        return "leasing"

    def charge(self, tenant: str, tokens: int, now: float) -> None:
        """An admitted request has finished with `tokens` (prompt + completion; 0 when
        unknown): its reservation is settled against the tokens budget."""
        line = self._reserved.get(tenant)
        window, reserved = line.popleft() if line else (None, 0.0)
        if line is not None and not line:
            del self._reserved[tenant]
        if tokens > 0:
            old = self._per_request.get(tenant)
            self._per_request[tenant] = (
                float(tokens) if old is None else old + _TOKENS_ALPHA * (tokens - old)
            )
        led = self._ledgers.get((tenant, "tpm"))
        if led is None:
            return
        led.roll(window_of(now))
        # A reservation made in an earlier window was spent there: all of it is charged now.
        delta = tokens - reserved if window == led.window else float(tokens)
        led.take(delta)
        led.want(now, max(0.0, float(tokens)))

    # --- the lease loop's side ----------------------------------------------------------

    def plan(self, now: float) -> list[BudgetAsk]:
        """What to ask the store for now (and give back); [] when nothing. What is given
        back is no longer held from here on."""
        window = window_of(now)
        left = window_left_s(now)
        asks: list[BudgetAsk] = []
        for (tenant, kind), led in self._ledgers.items():
            led.roll(window)
            idle_s = now - led.wanted_at
            back = unused_lease(led.held, idle_s)
            if back:
                led.held -= back
                asks.append(BudgetAsk(tenant, kind, window, led.limit, give_back=back))
                continue
            if idle_s >= IDLE_RETURN_S and led.held >= 0:
                continue  # nobody asks: nothing to lease
            rate = led.rate_now(now)
            if led.exhausted:
                if led.asked_at is None or now - led.asked_at >= PROBE_S:
                    led.asked_at = now
                    asks.append(BudgetAsk(tenant, kind, window, led.limit, ask=1))
            else:
                n = lease_ask(
                    limit=led.limit,
                    rate_per_s=rate,
                    held=led.held,
                    remaining=led.remaining,
                    routers=self.routers,
                )
                if n:
                    led.asked_at = now
                    asks.append(BudgetAsk(tenant, kind, window, led.limit, ask=n))
            if left <= LEASE_HORIZON_S and not led.ahead_asked and idle_s < IDLE_RETURN_S:
                led.ahead_asked = True
                n = lease_ask(
                    limit=led.limit, rate_per_s=rate, held=0, remaining=None, routers=self.routers
                )
                asks.append(BudgetAsk(tenant, kind, window + 1, led.limit, ask=n))
        if asks:
            self.leasing_since = now
        return asks

    def leased(self, asks: Sequence[BudgetAsk], answer: BudgetLeases, now: float) -> None:
        """The store's answer to `plan`'s asks."""
        self.leasing_since = None
        self.store_ok = True
        self.routers = max(1, answer.routers)
        for ask, got in zip(asks, answer.grants, strict=True):
            led = self._ledgers.get((ask.tenant, ask.kind))
            if led is None:
                continue
            led.roll(window_of(now))
            if ask.window == led.window:
                led.held += got.granted
                led.leases += 1 if got.granted else 0
                led.remaining = max(0, ask.limit - got.taken)
                if ask.ask and got.granted < ask.ask:
                    led.exhausted = True
                elif got.granted:
                    led.exhausted = False
            elif ask.window == led.window + 1:
                led.ahead += got.granted
            # else: the window has gone by; what it was granted is of no use now

    def lease_failed(self, asks: Sequence[BudgetAsk], now: float) -> None:
        """The store did not answer `plan`'s asks: what they gave back is held again, and
        this router admits on its own until a lease comes back."""
        self.leasing_since = None
        self.store_ok = False
        for ask in asks:
            led = self._ledgers.get((ask.tenant, ask.kind))
            if led is not None and ask.give_back and ask.window == led.window:
                led.held += ask.give_back
            if led is not None and ask.window == led.window + 1:
                led.ahead_asked = False

    # --- state --------------------------------------------------------------------------

    def _ledger(self, tenant: str, kind: str, limit: int, window: int, now: float) -> _Ledger:
        led = self._ledgers.get((tenant, kind))
        if led is None:
            led = self._ledgers[(tenant, kind)] = _Ledger(window, limit, now)
        led.roll(window)
        led.limit = limit
        return led

    def _prune(self, now: float) -> None:
        if self._pruned_at is not None and now - self._pruned_at < min(60.0, self.idle_s):
            return
        self._pruned_at = now
        gone = [k for k, led in self._ledgers.items() if now - led.wanted_at >= self.idle_s]
        for key in gone:
            del self._ledgers[key]
        for tenant in {t for t, _ in gone} - {t for t, _ in self._ledgers}:
            if tenant not in self._reserved:
                self._per_request.pop(tenant, None)

    def tenants(self) -> list[str]:
        return sorted({t for t, _ in self._ledgers})


def _no_clock() -> float:
    raise RuntimeError("FleetLimiter: no clock was given; pass clock= (callers pass the time)")
