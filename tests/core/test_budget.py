"""The budget lease rules (llmgw/core/_budget.py): hypothesis walks leases and give-backs
by many routers against one window's budget, as the store applies them."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import (
    BUDGET_WINDOW_S,
    IDLE_RETURN_S,
    decayed_rate,
    fallback_share,
    grant_budget,
    lease_ask,
    min_lease,
    restore_budget,
    unused_lease,
    window_left_s,
    window_of,
)

limits = st.integers(min_value=0, max_value=10_000)
# (router, ask, give back as a fraction of what it holds)
steps = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 500), st.floats(0, 1)), max_size=80)


@given(limits, steps)
def test_grants_never_exceed_the_budget_and_give_backs_restore_it(
    limit: int, script: list[tuple[int, int, float]]
) -> None:
    taken = 0
    held = [0] * 6
    for router, ask, fraction in script:
        back = math.floor(held[router] * fraction)  # a router gives back only what it holds
        before = taken
        taken = restore_budget(taken, back)
        assert taken == before - back  # what it gives back is free again, exactly
        held[router] -= back
        got = grant_budget(limit, taken, ask)
        assert 0 <= got <= ask
        if ask >= 1 and taken < limit:
            assert got >= 1  # a router that asks while budget remains gets something
        taken += got
        held[router] += got
        assert taken == sum(held) <= max(limit, 0)


@given(limits, st.integers(0, 20_000), st.integers(-5, 500))
def test_a_grant_is_all_that_was_asked_while_the_budget_holds_it(
    limit: int, taken: int, ask: int
) -> None:
    got = grant_budget(limit, taken, ask)
    if ask <= 0 or taken >= limit:
        assert got == 0
    elif taken + ask <= limit:
        assert got == ask
    else:
        assert got == limit - taken


@given(
    limit=st.integers(1, 100_000),
    rate=st.floats(0, 10_000),
    held=st.floats(-5_000, 5_000),
    remaining=st.none() | st.integers(0, 100_000),
    routers=st.integers(1, 64),
)
def test_a_lease_ask_is_bounded_by_the_fair_part_of_what_is_left_plus_the_debt(
    limit: int, rate: float, held: float, remaining: int | None, routers: int
) -> None:
    ask = lease_ask(limit=limit, rate_per_s=rate, held=held, remaining=remaining, routers=routers)
    debt = max(0, math.ceil(-held))
    left = limit if remaining is None else remaining
    if held < 1:
        assert ask >= 1  # a router with nothing in hand always asks
    if ask:
        assert ask - debt <= max(1, math.ceil(left / (2 * routers)))
        assert ask >= debt
    if held >= 1 and held >= rate * 2.0 / 2:
        assert ask == 0  # enough in hand: no store round trip


def test_a_lease_covers_the_recent_rate_at_least_the_smallest_lease() -> None:
    # 10 requests/s for 2 s, nothing held, plenty left: 20.
    assert lease_ask(limit=1000, rate_per_s=10, held=0, remaining=1000, routers=4) == 20
    # Idle: the smallest lease, 1 % of the limit.
    assert lease_ask(limit=1000, rate_per_s=0, held=0, remaining=1000, routers=4) == 10
    assert min_lease(50) == 1
    # The end of a window: 12 left among 3 routers: at most 2 each (12 / 6).
    assert lease_ask(limit=600, rate_per_s=50, held=0, remaining=12, routers=3) == 2
    # A debt of 30 tokens is asked for on top.
    assert lease_ask(limit=1000, rate_per_s=10, held=-30, remaining=1000, routers=4) == 50
    # 15 held of 20 expected: no round trip; 9 held: ask for the rest.
    assert lease_ask(limit=1000, rate_per_s=10, held=15, remaining=1000, routers=4) == 0
    assert lease_ask(limit=1000, rate_per_s=10, held=9, remaining=1000, routers=4) == 11
    assert lease_ask(limit=0, rate_per_s=10, held=0, remaining=None, routers=1) == 0


@given(st.floats(0, 1000), st.floats(0, 100))
def test_an_idle_router_gives_back_all_it_holds(held: float, idle_s: float) -> None:
    back = unused_lease(held, idle_s)
    if idle_s >= IDLE_RETURN_S and held >= 1:
        assert back == math.floor(held)
    else:
        assert back == 0


@given(st.integers(0, 100_000), st.integers(1, 100))
def test_the_fallback_shares_add_up_to_the_limit_at_most_plus_one_each(
    limit: int, routers: int
) -> None:
    part = fallback_share(limit, routers)
    assert part * routers <= max(limit, routers if limit else 0)
    if limit:
        assert part >= 1
    assert fallback_share(600, 4) == 150


@given(st.floats(0, 4e9))
def test_windows_are_wall_clock_minutes(wall: float) -> None:
    w = window_of(wall)
    assert w * BUDGET_WINDOW_S <= wall < (w + 1) * BUDGET_WINDOW_S
    assert 0 < window_left_s(wall) <= BUDGET_WINDOW_S


def test_the_recent_rate_follows_a_steady_stream_and_decays() -> None:
    rate, at = 0.0, 0.0
    for i in range(1, 301):  # 10 a second for 30 s
        now = i / 10
        rate, at = decayed_rate(rate, at, now, 1), now
    assert 9.5 < rate < 10.5
    assert decayed_rate(rate, at, at + 50, 0) < 0.01
