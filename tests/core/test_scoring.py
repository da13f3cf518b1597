from __future__ import annotations

import collections
import random

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmgw.core._scoring import (
    EndpointLoad,
    RequestEstimate,
    ScoringConfig,
    affinity_target,
    capacity,
    choose,
    cost,
    decide,
    explain,
    external,
    load,
    queued,
    rendezvous_weight,
    uncached,
)

CONFIG = ScoringConfig()  # prefix policy, scrape every 1 s, stale after 3 s, epsilon 1.0
LEAST = ScoringConfig(policy="least-load")
TIGHT = ScoringConfig(epsilon=0.25)  # the count bound that decided spills before issue 24
NOW = 100.0
REQ = RequestEstimate(prompt_tokens=2000, output_tokens=16, decode_cost=4)  # unit 2064


def ep(
    endpoint_id: str,
    *,
    waiting: float | None = 0,
    running: float | None = 0,
    kv: float | None = 0.0,
    in_flight: int = 0,
    own_at_scrape: int | None = 0,
    age: float | None = 0.5,
    healthy: bool = True,
    allowed: bool = True,
    cached: float = 0.0,
    pending_prefill: float = 0.0,
    pending_decode: float = 0.0,
) -> EndpointLoad:
    return EndpointLoad(
        endpoint_id=endpoint_id,
        healthy=healthy,
        allowed=allowed,
        in_flight=in_flight,
        waiting=waiting,
        running=running,
        kv_usage=kv,
        scraped_at=None if age is None else NOW - age,
        own_at_scrape=own_at_scrape,
        pending_prefill=pending_prefill,
        pending_decode=pending_decode,
        cached_tokens=cached,
    )


def pick(
    *endpoints: EndpointLoad,
    affinity: str | None = None,
    seed: int = 0,
    config: ScoringConfig = CONFIG,
    request: RequestEstimate = REQ,
) -> str | None:
    return choose(endpoints, request, NOW, random.Random(seed), config, affinity=affinity)


# -- the load the router counts, and what a scrape adds ------------------------------------


def test_cost_of_known_figures() -> None:
    e = ep("a", cached=1500, pending_prefill=300, pending_decode=20, running=3, own_at_scrape=1)
    # 500 uncached + 300 pending prefill + 4 x 20 decode + 2 external requests x 2064.
    assert cost(e, REQ, NOW, CONFIG) == 500 + 300 + 80 + 2 * 2064
    # least-load leaves the prefix out: the whole prompt is prefill everywhere.
    assert cost(e, REQ, NOW, LEAST) == 2000 + 300 + 80 + 2 * 2064


def test_an_engine_that_just_finished_is_idle_not_busy() -> None:
    """The bug measured on two llama-servers: the last reading still shows the finished
    request running, the router's own count says it ended. The own count wins."""
    just_finished = ep("a", running=1, own_at_scrape=1, in_flight=0)
    busy = ep("b", running=1, own_at_scrape=1, in_flight=1, pending_decode=16)
    assert external(just_finished, NOW, CONFIG) == 0
    assert load(just_finished, NOW, CONFIG) == 0
    for seed in range(20):
        assert pick(just_finished, busy, seed=seed, config=LEAST) == "a"


def test_requests_the_router_did_not_send_count_as_load() -> None:
    # Another router's two requests show in the reading, not in our count.
    shared = ep("a", running=2, waiting=1, own_at_scrape=0)
    assert external(shared, NOW, CONFIG) == 3
    assert load(shared, NOW, CONFIG) == 3
    assert pick(shared, ep("b", in_flight=1, pending_decode=16), config=LEAST) == "b"


def test_unknown_figures_are_penalised_not_read_as_zero() -> None:
    never_scraped = ep("a", age=None)
    silent = ep("b", running=None, waiting=None)
    garbage = ep("c", running=float("nan"), waiting=-1.0)
    for e in (never_scraped, silent, garbage):
        assert external(e, NOW, CONFIG) is None
        assert cost(e, REQ, NOW, CONFIG) == 2000 + CONFIG.unknown_penalty * REQ.unit


def test_staleness_boundary() -> None:
    assert external(ep("a", running=1, age=3.0), NOW, CONFIG) == 1  # 3 intervals: believed
    assert external(ep("a", running=1, age=3.01), NOW, CONFIG) is None


def test_a_stale_idle_looking_endpoint_loses_to_a_fresh_idle_one() -> None:
    stale = ep("stale", age=10.0)
    fresh = ep("fresh")
    assert all(pick(stale, fresh, seed=s) == "fresh" for s in range(20))
    # ... but not to one known to be drowning in others' requests.
    drowning = ep("drowning", waiting=20, running=8)
    assert pick(stale, drowning) == "stale"


def test_a_full_kv_cache_is_avoided() -> None:
    full = ep("full", kv=0.97)
    roomy = ep("roomy", kv=0.6)
    assert cost(full, REQ, NOW, CONFIG) == 2000 + CONFIG.kv_full_penalty * REQ.unit
    assert pick(full, roomy) == "roomy"


def test_unhealthy_or_breaker_open_endpoints_are_never_chosen() -> None:
    idle_but_sick = ep("sick", healthy=False)
    idle_but_open = ep("open", allowed=False)
    busy = ep("busy", waiting=10, running=10, kv=0.99, in_flight=10)
    assert pick(idle_but_sick, idle_but_open, busy) == "busy"
    assert pick(idle_but_sick, idle_but_open) is None
    assert pick() is None


def test_ties_are_spread_at_random_and_reproducibly_with_a_seeded_rng() -> None:
    endpoints = [ep(f"e{i}") for i in range(4)] + [ep("busy", in_flight=1)]
    rng = random.Random(7)
    counts = collections.Counter(choose(endpoints, REQ, NOW, rng, CONFIG) for _ in range(4000))
    assert set(counts) == {"e0", "e1", "e2", "e3"}
    assert all(900 < n < 1100 for n in counts.values()), counts
    first = [choose(endpoints, REQ, NOW, random.Random(3), CONFIG) for _ in range(5)]
    again = [choose(endpoints[::-1], REQ, NOW, random.Random(3), CONFIG) for _ in range(5)]
    assert first == again


def test_round_robin_takes_the_eligible_endpoints_in_turn() -> None:
    rr = ScoringConfig(policy="round-robin")
    endpoints = [ep("c"), ep("a", in_flight=9), ep("b", healthy=False)]
    got = [choose(endpoints, REQ, NOW, random.Random(0), rr, rotation=i) for i in range(4)]
    assert got == ["a", "c", "a", "c"]


# -- the prefix, and its bound ------------------------------------------------------------


def test_the_endpoint_holding_the_prefix_wins_while_within_the_bound() -> None:
    warm = ep("warm", cached=1900, in_flight=1, pending_decode=16)
    cold = ep("cold")
    assert pick(warm, cold) == "warm"  # 100 + 64 beats 2000
    assert pick(warm, cold, config=LEAST) == "cold"  # without the prefix it is busier


def test_a_cache_hit_on_a_busier_endpoint_wins_while_it_is_cheaper() -> None:
    """Issue 24: loads (2, 0), the prompt cached on the busy one. The old count bound
    (epsilon 0.25: ceil(1.25 x 3 / 2) = 2) sent it to the idle one and its 2,000-token
    prefill; priced in work, the 2 requests queued there (100 tokens of prefill and
    2 x 16 output tokens at 4 each) cost far less, and the hit wins."""
    warm = ep("warm", cached=1900, in_flight=2, pending_prefill=100, pending_decode=32)
    cold = ep("cold")
    assert queued(warm, REQ, NOW, CONFIG) == 100 + 4 * 32
    assert uncached(warm, REQ, CONFIG) == 100 and uncached(cold, REQ, CONFIG) == 2000
    assert decide([warm, cold], REQ, NOW, random.Random(0), CONFIG) == ("warm", False)
    assert decide([warm, cold], REQ, NOW, random.Random(0), TIGHT) == ("cold", True)
    # Its queue dearer than the whole prefill elsewhere: the request spills, and says so.
    swamped = attrs.evolve(warm, pending_prefill=2000.0)
    assert cost(swamped, REQ, NOW, CONFIG) == 100 + 2000 + 128 > cost(cold, REQ, NOW, CONFIG)
    assert decide([swamped, cold], REQ, NOW, random.Random(0), CONFIG) == ("cold", True)
    d = explain([swamped, cold], REQ, NOW, random.Random(0), CONFIG)
    assert d.chosen == "cold"
    assert "sent away from warm, which holds the prompt: its queued work (2128 tokens)" in (
        d.reason
    )
    assert {c.endpoint_id: c.queued for c in d.candidates} == {"warm": 2128, "cold": 0}
    # Others' requests, seen in a fresh reading, are queued work too (a unit each).
    shared = attrs.evolve(warm, in_flight=0, pending_prefill=0.0, pending_decode=0.0, running=1)
    assert queued(shared, REQ, NOW, CONFIG) == REQ.unit
    assert pick(shared, cold) == "cold"


def test_unknown_figures_price_the_queue_never_at_zero() -> None:
    """A cached endpoint whose reading is stale costs unknown_penalty requests of queue:
    it keeps a short prompt's sibling only if that still beats the prefill elsewhere."""
    stale_warm = ep("warm", cached=2000, age=None)
    assert queued(stale_warm, REQ, NOW, CONFIG) == CONFIG.unknown_penalty * REQ.unit
    assert pick(stale_warm, ep("cold")) == "cold"  # 2064 of unknown queue > 2000 prefill
    cheap = attrs.evolve(CONFIG, unknown_penalty=0.5)
    assert pick(stale_warm, ep("cold"), config=cheap) == "warm"


def test_a_spill_is_a_request_sent_away_from_the_prompts_home() -> None:
    # Nowhere held (or credited with under half the prompt): no home, no spill.
    assert decide([ep("a"), ep("b", pending_decode=16)], REQ, NOW, random.Random(0), CONFIG) == (
        "a",
        False,
    )
    faint = ep("faint", cached=900, pending_prefill=5000)
    assert decide([faint, ep("b")], REQ, NOW, random.Random(0), CONFIG) == ("b", False)
    # Held on two: going to either is no spill.
    both = [ep("a", cached=2000, in_flight=1, pending_decode=200), ep("b", cached=1500)]
    assert decide(both, REQ, NOW, random.Random(0), CONFIG) == ("b", False)


def test_the_count_bound_still_guards_against_a_hot_spot() -> None:
    """Wide by default, but where it binds it binds: 4 endpoints, epsilon 1, loads
    (3, 0, 0, 0): the cap is ceil(2 x 4 / 4) = 2, and the warm one is over it however
    cheap its queue looks (the estimates may be wrong; a count is not)."""
    assert capacity([3, 0, 0, 0], 1.0) == 2
    warm = ep("warm", cached=2000, in_flight=3)
    others = [ep(f"c{i}") for i in range(3)]
    got, spilled = decide([warm, *others], REQ, NOW, random.Random(0), CONFIG)
    assert got in {"c0", "c1", "c2"} and spilled
    d = explain([warm, *others], REQ, NOW, random.Random(0), CONFIG)
    assert "over the bound of 2 requests: warm" in d.reason
    assert "sent away from warm, which holds the prompt, by the bound" in d.reason
    # With 2 endpoints an epsilon of 1 never binds: the cap is at least total + 1.
    assert all(capacity([k, 0], 1.0) >= k + 1 for k in range(50))
    # A tight epsilon is still honoured: loads (2, 0) at 0.25 cap at 2.
    assert capacity([2, 0], 0.25) == 2
    assert pick(ep("warm", cached=2000, in_flight=2), ep("cold"), config=TIGHT) == "cold"
    busy_cold = ep("busy", in_flight=2)
    assert decide([busy_cold, ep("cold")], REQ, NOW, random.Random(0), TIGHT) == (
        "cold",
        False,
    )


def test_capacity_always_admits_the_least_loaded() -> None:
    assert capacity([], 0.25) == 0
    assert capacity([0, 0], 0.0) == 1
    assert capacity([3, 3, 3], 0.0) == 4
    assert capacity([1, 0], 0.25) == 2


def test_header_affinity_stays_under_the_same_bound() -> None:
    key = "conversation-42"
    home = affinity_target([ep("a"), ep("b")], key)
    other = "b" if home == "a" else "a"
    # Busier by one but within the bound: the session stays.
    assert pick(ep(home, in_flight=1, pending_decode=16), ep(other), affinity=key) == home
    # Over the bound: it goes elsewhere.
    assert pick(ep(home, in_flight=2), ep(other), affinity=key, config=TIGHT) == other


def test_affinity_sticks_to_one_endpoint_and_moves_only_when_it_leaves() -> None:
    endpoints = [ep(f"e{i}") for i in range(6)]
    homes = {k: pick(*endpoints, affinity=k) for k in (f"session-{n}" for n in range(200))}
    assert len(set(homes.values())) == 6
    for key, home in homes.items():
        assert home == affinity_target(endpoints, key)
        without_e5 = [e for e in endpoints if e.endpoint_id != "e5"]
        moved = pick(*without_e5, affinity=key)
        assert moved == (home if home != "e5" else affinity_target(without_e5, key))
    key = next(k for k, h in homes.items() if h == "e3")
    breaker_open = [attrs.evolve(e, allowed=e.endpoint_id != "e3") for e in endpoints]
    assert pick(*breaker_open, affinity=key) == runner_up(key, endpoints, "e3")


def runner_up(key: str, endpoints: list[EndpointLoad], home: str) -> str:
    others = [e.endpoint_id for e in endpoints if e.endpoint_id != home]
    return max(others, key=lambda i: rendezvous_weight(key, i))


def test_an_affinity_key_with_a_lone_surrogate_still_maps() -> None:
    assert pick(ep("a"), ep("b"), affinity="\ud800") in ("a", "b")


def test_explain_names_the_choice_and_every_candidate_figure() -> None:
    endpoints = [
        ep("warm", cached=1900, in_flight=1, pending_decode=16, running=1, own_at_scrape=1),
        ep("cold", in_flight=1),
        ep("stale", age=30.0),
        ep("sick", healthy=False),
    ]
    d = explain(endpoints, REQ, NOW, random.Random(0), CONFIG)
    assert d.chosen == "warm" == pick(*endpoints)
    assert d.capacity == 2 and d.average_load == pytest.approx(2 / 3)
    assert "lowest expected cost" in d.reason
    rows = {c.endpoint_id: c for c in d.candidates}
    assert rows["warm"].cached_tokens == 1900 and rows["warm"].uncached_tokens == 100
    assert rows["warm"].cost == 100 + 4 * 16 and rows["warm"].scrape_age_s == 0.5
    assert rows["warm"].external == 0 and rows["warm"].running == 1
    assert rows["stale"].external is None and rows["stale"].running is None
    assert rows["stale"].scrape_age_s == 30.0
    assert rows["sick"].cost is None and not rows["sick"].within_bound


def test_config_is_validated() -> None:
    assert ScoringConfig().epsilon == 1.0  # the wide guard (issue 24)
    with pytest.raises(ValueError, match="epsilon must be a finite number, 0 or more"):
        ScoringConfig(epsilon=-1)
    with pytest.raises(ValueError, match="scrape_interval_s must be a positive number"):
        ScoringConfig(scrape_interval_s=0)
    with pytest.raises(ValueError, match=r"kv_full must be in \(0, 1\]"):
        ScoringConfig(kv_full=1.5)
    with pytest.raises(ValueError, match="policy must be one of prefix, least-load, round-robin"):
        ScoringConfig(policy="random")  # type: ignore[arg-type]


# -- properties ----------------------------------------------------------------------------

figure = st.one_of(st.none(), st.floats(0, 50), st.just(float("nan")))
loads_strategy = st.lists(
    st.builds(
        EndpointLoad,
        endpoint_id=st.sampled_from([f"e{i}" for i in range(8)]),
        healthy=st.booleans(),
        allowed=st.booleans(),
        in_flight=st.integers(0, 20),
        waiting=figure,
        running=figure,
        kv_usage=st.one_of(st.none(), st.floats(0, 1)),
        scraped_at=st.one_of(st.none(), st.floats(90, 100)),
        own_at_scrape=st.one_of(st.none(), st.integers(0, 20)),
        pending_prefill=st.floats(0, 10_000),
        pending_decode=st.floats(0, 1000),
        cached_tokens=st.floats(0, 4000),
    ),
    max_size=8,
    unique_by=lambda e: e.endpoint_id,
)
policies = st.sampled_from([CONFIG, LEAST])


@settings(max_examples=300)
@given(loads_strategy, st.one_of(st.none(), st.text(max_size=8)), st.integers(0, 2**32), policies)
def test_only_eligible_endpoints_within_the_bound_are_chosen(
    endpoints: list[EndpointLoad], affinity: str | None, seed: int, config: ScoringConfig
) -> None:
    chosen = choose(endpoints, REQ, NOW, random.Random(seed), config, affinity=affinity)
    eligible = [e for e in endpoints if e.eligible]
    if not eligible:
        assert chosen is None
        return
    by_id = {e.endpoint_id: e for e in eligible}
    assert chosen in by_id
    counts = [load(e, NOW, config) for e in eligible]
    cap = capacity(counts, config.epsilon)
    assert load(by_id[chosen], NOW, config) + 1 <= cap  # the bound holds, always
    if affinity is None or chosen != affinity_target(eligible, affinity):
        within = [e for e in eligible if load(e, NOW, config) + 1 <= cap]
        best = min(cost(e, REQ, NOW, config) for e in within)
        assert cost(by_id[chosen], REQ, NOW, config) == pytest.approx(best)


@settings(max_examples=300)
@given(loads_strategy, st.integers(0, 2**32), policies)
def test_an_endpoint_whose_scrape_failed_is_never_preferred_for_reading_zero(
    endpoints: list[EndpointLoad], seed: int, config: ScoringConfig
) -> None:
    """Two endpoints alike in everything the router counts itself, both reading zero;
    one reading is stale. The stale one costs more and is never chosen over its twin."""
    for e in endpoints:
        if not e.eligible:
            continue
        twin_fresh = attrs.evolve(
            e, endpoint_id="fresh", running=0.0, waiting=0.0, kv_usage=0.0, scraped_at=NOW
        )
        twin_stale = attrs.evolve(twin_fresh, endpoint_id="stale", scraped_at=NOW - 60)
        assert cost(twin_stale, REQ, NOW, config) > cost(twin_fresh, REQ, NOW, config)
        got = choose([twin_stale, twin_fresh], REQ, NOW, random.Random(seed), config)
        assert got == "fresh"


def _run(
    signals: str, n: int, requests: int, rng: random.Random, config: ScoringConfig
) -> tuple[collections.Counter[str], int]:
    """A closed loop of `n + 1` requests in flight over `n` endpoints: each finishes at
    random; the scraped figures are equal, stale, or zero. Returns the counts and the
    most any endpoint held at once."""
    ids = [f"e{i}" for i in range(n)]
    in_flight = dict.fromkeys(ids, 0)
    live: list[str] = []
    got: collections.Counter[str] = collections.Counter()
    peak = 0
    for _ in range(requests):
        if len(live) > n:
            in_flight[live.pop(rng.randrange(len(live)))] -= 1
        endpoints = [
            EndpointLoad(
                endpoint_id=i,
                healthy=True,
                allowed=True,
                in_flight=in_flight[i],
                running={"equal": 2.0, "stale": 0.0, "zero": 0.0}[signals],
                waiting=0.0,
                kv_usage=None,
                scraped_at=NOW - (60 if signals == "stale" else 0.5),
                own_at_scrape=0,
                pending_decode=16.0 * in_flight[i],
            )
            for i in ids
        ]
        chosen = choose(endpoints, REQ, NOW, rng, config)
        assert chosen is not None
        in_flight[chosen] += 1
        peak = max(peak, in_flight[chosen])
        live.append(chosen)
        got[chosen] += 1
    return got, peak


@settings(max_examples=60)
@given(
    st.sampled_from(["equal", "stale", "zero"]),
    st.integers(2, 8),
    st.integers(0, 2**32),
    policies,
)
def test_no_endpoint_gets_more_than_twice_its_fair_share_without_shared_prefixes(
    signals: str, n: int, seed: int, config: ScoringConfig
) -> None:
    requests = 400
    got, _ = _run(signals, n, requests, random.Random(seed), config)
    event(f"{signals} signals")
    assert max(got.values()) <= 2 * requests / n, got


@settings(max_examples=60)
@given(st.integers(2, 8), st.floats(0, 2), st.integers(1, 40), st.integers(0, 2**32))
def test_one_hot_prefix_cannot_make_a_hotspot(n: int, epsilon: float, busy: int, seed: int) -> None:
    """Every request carries the prefix only e0 holds; e0 takes them while within the
    bound and not one past it."""
    config = ScoringConfig(epsilon=epsilon)
    rng = random.Random(seed)
    in_flight = {f"e{i}": 0 for i in range(n)}
    for _ in range(busy):
        endpoints = [
            ep(i, in_flight=k, cached=2000.0 if i == "e0" else 0.0) for i, k in in_flight.items()
        ]
        cap = capacity([float(k) for k in in_flight.values()], epsilon)
        chosen = choose(endpoints, REQ, NOW, rng, config)
        assert chosen is not None
        assert in_flight[chosen] + 1 <= cap
        if in_flight["e0"] + 1 <= cap:
            assert chosen == "e0"  # the cache wins while the bound allows
        in_flight[chosen] += 1


@settings(max_examples=200)
@given(loads_strategy, st.text(max_size=8), st.data())
def test_affinity_is_stable_under_removal_of_other_endpoints(
    endpoints: list[EndpointLoad], key: str, data: st.DataObject
) -> None:
    idle = [attrs.evolve(e, in_flight=0, scraped_at=None) for e in endpoints]
    chosen = choose(idle, REQ, NOW, random.Random(0), CONFIG, affinity=key)
    home = affinity_target(idle, key)
    event("affinity kept" if chosen is not None and chosen == home else "none eligible")
    if chosen is None:
        return
    assert chosen == home  # all idle: everyone is within the bound
    others = [e for e in idle if e.endpoint_id != home]
    kept = (
        data.draw(st.lists(st.sampled_from(others), unique_by=lambda e: e.endpoint_id))
        if others
        else []
    )
    fewer = [e for e in idle if e.endpoint_id == home or e in kept]
    assert choose(fewer, REQ, NOW, random.Random(1), CONFIG, affinity=key) == home


@settings(max_examples=500)
@given(loads_strategy, st.integers(0, 2**32), st.floats(0, 1), st.sampled_from([CONFIG, TIGHT]))
def test_a_cached_prompt_is_never_sent_away_while_its_queue_is_cheaper(
    endpoints: list[EndpointLoad], seed: int, share: float, config: ScoringConfig
) -> None:
    """Issue 24's property: one eligible endpoint holds the whole prompt. While its
    queued work is below every other eligible endpoint's queued work plus the prompt's
    uncached prefill there, and the hot-spot bound admits it, the request goes to it;
    and sent elsewhere it is a spill exactly when the other holds under half of it."""
    eligible = [e for e in endpoints if e.eligible]
    if not eligible:
        return
    home_id = eligible[0].endpoint_id
    # The others hold some share of the prompt (under all of it).
    fleet = [
        attrs.evolve(e, cached_tokens=REQ.prompt_tokens)
        if e.endpoint_id == home_id
        else attrs.evolve(e, cached_tokens=min(e.cached_tokens, share * REQ.prompt_tokens))
        for e in endpoints
    ]
    home = next(e for e in fleet if e.endpoint_id == home_id)
    others = [e for e in fleet if e.eligible and e.endpoint_id != home_id]
    cheaper = all(
        queued(home, REQ, NOW, config)
        < queued(e, REQ, NOW, config) + uncached(e, REQ, config) - 1e-6 * REQ.unit
        for e in others
    )
    counts = [load(e, NOW, config) for e in fleet if e.eligible]
    admitted = load(home, NOW, config) + 1 <= capacity(counts, config.epsilon)
    chosen, spilled = decide(fleet, REQ, NOW, random.Random(seed), config)
    event(f"cheaper={cheaper} admitted={admitted}")
    if cheaper and admitted:
        assert (chosen, spilled) == (home_id, False)
    elif chosen != home_id:
        went = next(e for e in fleet if e.endpoint_id == chosen)
        assert spilled == (went.cached_tokens < 0.5 * REQ.prompt_tokens)
