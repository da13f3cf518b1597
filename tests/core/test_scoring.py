from __future__ import annotations

import collections
import random

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmgw.core._scoring import (
    EndpointLoad,
    ScoringConfig,
    affinity_target,
    choose,
    rendezvous_weight,
    score,
)

CONFIG = ScoringConfig()  # scrape every 1 s, stale after 3 s
NOW = 100.0


def ep(
    endpoint_id: str,
    *,
    waiting: float | None = 0,
    running: float | None = 0,
    kv: float | None = 0.0,
    in_flight: int = 0,
    age: float | None = 0.5,
    healthy: bool = True,
    allowed: bool = True,
    slots: int | None = None,
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
        slots=slots,
    )


def pick(*endpoints: EndpointLoad, affinity: str | None = None, seed: int = 0) -> str | None:
    return choose(endpoints, NOW, random.Random(seed), CONFIG, affinity=affinity)


def test_score_of_known_figures() -> None:
    e = ep("a", waiting=2, running=3, kv=0.5, in_flight=1)
    assert score(e, NOW, CONFIG) == 1 * 1 + 2 * 2 + 1 * 3 + 4 * 0.5


def test_unknown_figures_are_penalised_not_read_as_zero() -> None:
    never_scraped = ep("a", age=None)
    assert score(never_scraped, NOW, CONFIG) == 3 * CONFIG.unknown_penalty
    silent_engine = ep("b", waiting=None, kv=None)  # fresh, but reports only `running`
    assert score(silent_engine, NOW, CONFIG) == 2 * CONFIG.unknown_penalty
    garbage = ep("c", waiting=float("nan"), running=-1.0)
    assert score(garbage, NOW, CONFIG) == 2 * CONFIG.unknown_penalty


def test_staleness_boundary() -> None:
    assert score(ep("a", age=3.0), NOW, CONFIG) == 0.0  # 3 intervals old: still believed
    assert score(ep("a", age=3.01), NOW, CONFIG) == 3 * CONFIG.unknown_penalty


def test_a_stale_idle_looking_endpoint_loses_to_a_fresh_busy_one() -> None:
    stale = ep("stale", waiting=0, running=0, kv=0.0, age=10.0)
    busy = ep("busy", waiting=1, running=4, kv=0.4, in_flight=2)
    assert pick(stale, busy) == "busy"
    # ... but not to one known to be drowning.
    drowning = ep("drowning", waiting=20, running=8, kv=0.9)
    assert pick(stale, drowning) == "stale"


def test_the_router_own_in_flight_count_counts_even_when_scrapes_are_stale() -> None:
    assert pick(ep("a", age=10.0, in_flight=3), ep("b", age=10.0, in_flight=1)) == "b"


def test_a_full_kv_cache_is_avoided() -> None:
    full = ep("full", running=2, kv=0.97)
    roomy = ep("roomy", running=4, kv=0.6)
    assert score(full, NOW, CONFIG) == 2 + 4 * 0.97 + CONFIG.kv_full_penalty
    assert pick(full, roomy) == "roomy"


def test_llama_cpp_slots_stand_in_for_the_kv_gauge() -> None:
    e = ep("a", running=3, kv=None, slots=4)
    assert score(e, NOW, CONFIG) == 3 + 4 * 0.75
    # All slots busy is a full cache.
    assert score(ep("b", running=4, kv=None, slots=4), NOW, CONFIG) == 4 + 4 + 8


def test_unhealthy_or_breaker_open_endpoints_are_never_chosen() -> None:
    idle_but_sick = ep("sick", healthy=False)
    idle_but_open = ep("open", allowed=False)
    busy = ep("busy", waiting=10, running=10, kv=0.99, in_flight=10)
    assert pick(idle_but_sick, idle_but_open, busy) == "busy"
    assert pick(idle_but_sick, idle_but_open) is None
    assert pick() is None


def test_ties_are_spread_at_random_and_reproducibly_with_a_seeded_rng() -> None:
    endpoints = [ep(f"e{i}") for i in range(4)] + [ep("busy", running=1)]
    rng = random.Random(7)
    counts = collections.Counter(choose(endpoints, NOW, rng, CONFIG) for _ in range(4000))
    assert set(counts) == {"e0", "e1", "e2", "e3"}
    assert all(900 < n < 1100 for n in counts.values()), counts
    # The same seed gives the same sequence, whatever order the endpoints come in.
    first = [choose(endpoints, NOW, random.Random(3), CONFIG) for _ in range(5)]
    again = [choose(endpoints[::-1], NOW, random.Random(3), CONFIG) for _ in range(5)]
    assert first == again


def test_affinity_sticks_to_one_endpoint_and_moves_only_when_it_leaves() -> None:
    endpoints = [ep(f"e{i}", running=i) for i in range(6)]  # e0 is the least loaded
    homes = {k: pick(*endpoints, affinity=k) for k in (f"session-{n}" for n in range(200))}
    assert len(set(homes.values())) == 6  # keys spread over all endpoints, load aside
    for key, home in homes.items():
        assert home == affinity_target(endpoints, key)
        without_e5 = [e for e in endpoints if e.endpoint_id != "e5"]
        moved = pick(*without_e5, affinity=key)
        if home != "e5":
            assert moved == home
        else:
            assert moved == affinity_target(without_e5, key)
    # An endpoint that cannot take requests is not a home: its keys go to their
    # runner-up by hash (stable), not to whichever endpoint is least loaded.
    key = next(
        k for k, h in homes.items()
        if h == "e3" and runner_up(k, endpoints, "e3") not in ("e0", "e3")
    )  # fmt: skip
    breaker_open = [attrs.evolve(e, allowed=e.endpoint_id != "e3") for e in endpoints]
    assert pick(*breaker_open, affinity=key) == runner_up(key, endpoints, "e3")


def runner_up(key: str, endpoints: list[EndpointLoad], home: str) -> str:
    others = [e.endpoint_id for e in endpoints if e.endpoint_id != home]
    return max(others, key=lambda i: rendezvous_weight(key, i))


def test_affinity_yields_when_its_endpoint_is_overloaded() -> None:
    key = "conversation-42"
    home = affinity_target([ep("a"), ep("b")], key)
    other = "b" if home == "a" else "a"

    def with_home(**load: float | None) -> str | None:
        return pick(ep(home, **load), ep(other), affinity=key)  # type: ignore[arg-type]

    # Busy but not queueing: the warm cache is worth it.
    assert with_home(running=12, kv=0.8) == home
    # Queueing, but only a little worse than the best (8 = the margin): stay.
    assert with_home(waiting=1, running=6) == home
    # Queueing and much worse than the best: go elsewhere.
    assert with_home(waiting=3, running=6) == other
    # Figures unknown (scrapes stale) and much worse: go elsewhere.
    assert with_home(age=10.0) == other


def test_an_affinity_key_with_a_lone_surrogate_still_maps() -> None:
    assert pick(ep("a"), ep("b"), affinity="\ud800") in ("a", "b")


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_weight must be a finite number, 0 or more"):
        ScoringConfig(kv_weight=-1)
    with pytest.raises(ValueError, match="scrape_interval_s must be a positive number"):
        ScoringConfig(scrape_interval_s=0)
    with pytest.raises(ValueError, match=r"kv_full must be in \(0, 1\]"):
        ScoringConfig(kv_full=1.5)


# -- properties ----------------------------------------------------------------

figure = st.one_of(st.none(), st.floats(0, 50), st.just(float("nan")))
loads = st.lists(
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
        slots=st.one_of(st.none(), st.integers(1, 8)),
    ),
    max_size=8,
    unique_by=lambda e: e.endpoint_id,
)


@settings(max_examples=300)
@given(loads, st.one_of(st.none(), st.text(max_size=8)), st.integers(0, 2**32))
def test_only_eligible_endpoints_are_chosen_and_none_only_when_there_is_none(
    endpoints: list[EndpointLoad], affinity: str | None, seed: int
) -> None:
    chosen = choose(endpoints, NOW, random.Random(seed), CONFIG, affinity=affinity)
    eligible = {e.endpoint_id for e in endpoints if e.healthy and e.allowed}
    if eligible:
        assert chosen in eligible
    else:
        assert chosen is None
    if chosen is not None and affinity is None:
        best = min(score(e, NOW, CONFIG) for e in endpoints if e.endpoint_id in eligible)
        by_id = {e.endpoint_id: e for e in endpoints}
        assert score(by_id[chosen], NOW, CONFIG) == pytest.approx(best)


@settings(max_examples=300)
@given(loads, st.text(max_size=8), st.data())
def test_affinity_is_stable_under_removal_of_other_endpoints(
    endpoints: list[EndpointLoad], key: str, data: st.DataObject
) -> None:
    chosen = choose(endpoints, NOW, random.Random(0), CONFIG, affinity=key)
    home = affinity_target(endpoints, key)
    event("affinity kept" if chosen is not None and chosen == home else "affinity yielded or none")
    if chosen is None or chosen != home:
        return
    others = [e for e in endpoints if e.endpoint_id != home]
    kept = (
        data.draw(st.lists(st.sampled_from(others), unique_by=lambda e: e.endpoint_id))
        if others
        else []
    )
    fewer = [e for e in endpoints if e.endpoint_id == home or e in kept]
    assert choose(fewer, NOW, random.Random(1), CONFIG, affinity=key) == home
