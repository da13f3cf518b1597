"""A tenant's per-minute budget, shared by every router in the fleet through leases.

Pure: no trio, no store, no clock of its own (every call is given the time).

The budget of a tenant's limit (requests, or tokens, per minute) is counted per
wall-clock minute window (`window_of`: the minute since the epoch), so every
router in the fleet counts the same window without talking to the others (their
clocks must agree to well under a second: NTP). The store keeps, per tenant,
kind and window, how much of the budget the routers have `taken`; a router
takes a lease (`grant_budget`) when what it holds runs low, spends it locally with no
store round trip, and gives back (`restore_budget`) what it holds once it has gone idle.

The rules the store and the routers follow, each a function here:

- `grant_budget(limit, taken, ask)`: what a lease gets: all it asked for while the
  budget holds it, what is left when less is, 0 once it is spent. The sum of
  grants in a window never exceeds the limit; a router that asks while budget
  remains gets at least 1.
- `restore_budget(taken, amount)`: a router gives back what it did not use; what it
  gives back is at most what it holds, so `taken` never goes below 0.
- `lease_ask(...)`: how much a router asks for: enough for `LEASE_HORIZON_S` of
  its own recent rate, at least `min_lease(limit)`, and no more than its fair
  part (1 / (2 x routers)) of what the store last said was left, so the last
  requests of a window are not stranded in one router's lease while another
  router has demand; a debt (tokens charged beyond what it held) is added, so it
  is paid first.
- `fallback_share(limit, routers)`: while the store cannot be reached, each
  router admits this much of the window by itself (the limit split between the
  routers it last knew of).
"""

from __future__ import annotations

import math

BUDGET_WINDOW_S = 60  # a limit is per minute
LEASE_HORIZON_S = 2.0  # a lease covers about this much of the router's own recent rate
RATE_TAU_S = 5.0  # the recent rate's memory (an exponentially decaying average)
IDLE_RETURN_S = 2.0  # a router that spent nothing of a kind for this long gives back its lease
MIN_LEASE_FRACTION = 100  # the smallest lease: 1 / this of the limit (and at least 1)


def window_of(wall: float) -> int:
    """The window (minutes since the epoch) that wall-clock time `wall` falls in."""
    return int(wall // BUDGET_WINDOW_S)


def window_left_s(wall: float) -> float:
    """Seconds from `wall` to the start of the next window (> 0)."""
    return (window_of(wall) + 1) * BUDGET_WINDOW_S - wall


def grant_budget(limit: int, taken: int, ask: int) -> int:
    """How much of a window's budget of `limit` a lease asking `ask` gets, when the
    routers have `taken` of it so far: min(ask, what is left), never below 0."""
    if ask <= 0:
        return 0
    return max(0, min(ask, limit - taken))


def restore_budget(taken: int, amount: int) -> int:
    """`taken` after a router gives back `amount` it held and did not use."""
    return max(0, taken - max(0, amount))


def min_lease(limit: int) -> int:
    """The smallest lease worth a store round trip for a limit of `limit`."""
    return max(1, limit // MIN_LEASE_FRACTION)


def lease_ask(
    *,
    limit: int,
    rate_per_s: float,
    held: float,
    remaining: int | None,
    routers: int,
    horizon_s: float = LEASE_HORIZON_S,
) -> int:
    """What a router asks for now; 0: what it holds covers its next `horizon_s`.

    `rate_per_s`: its recent demand (admitted and refused) for this kind; `held`: what it
    holds of this window (below 0: a debt, tokens charged beyond it); `remaining`: what the
    store last said was left of the window (None: not asked yet this window); `routers`:
    the routers the store last counted (at least 1).
    """
    if limit <= 0:
        return 0
    debt = max(0, math.ceil(-held))
    cover = rate_per_s * horizon_s
    if held >= 1 and held >= cover / 2:
        return 0  # it holds at least half of what it expects to spend: no round trip yet
    want = max(min_lease(limit), math.ceil(cover - max(held, 0.0)))
    fair_of = remaining if remaining is not None else limit
    fair = max(1, math.ceil(fair_of / (2 * max(1, routers))))
    return min(want, fair) + debt


def unused_lease(held: float, idle_s: float) -> int:
    """What a router gives back: all it holds (whole units) once it has spent nothing of
    this kind for `IDLE_RETURN_S`; else 0."""
    if idle_s < IDLE_RETURN_S or held < 1:
        return 0
    return math.floor(held)


def fallback_share(limit: int, routers: int) -> int:
    """What one of `routers` routers admits of a window of `limit` on its own, while the
    store is out of reach: its equal part, at least 1 when the limit is 1 or more."""
    if limit <= 0:
        return 0
    return max(1, limit // max(1, routers))


def decayed_rate(rate: float, at: float, now: float, amount: float) -> float:
    """A rate per second after `amount` more at `now` (the last update was at `at`):
    an exponentially decaying average with a memory of `RATE_TAU_S`."""
    dt = max(0.0, now - at)
    return rate * math.exp(-dt / RATE_TAU_S) + amount / RATE_TAU_S
