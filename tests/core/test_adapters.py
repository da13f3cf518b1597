"""LoRA adapters on a base's replicas: the load/evict plan (llmgw/core/_adapters.py).

Properties over random views of a base's replicas: applying any plan keeps each
replica at or under its maximum (loads in flight counted), never evicts an adapter
with a request in flight, never starts a second load of an adapter while one is in
flight (a second request joins it), evicts the least recently used evictable adapter,
uses a holder within the bound rather than loading, waits only when nothing can take
the adapter, and answers the same whatever the order of the input. A simulation
applies the plans to a stream of requests with skewed popularity and checks every
invariant at every step, and that every waiting request is served once the fleet
drains.
"""

from __future__ import annotations

import random
from collections import Counter

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import (
    ADAPTER_ACTIONS,
    AdapterPlan,
    HeldAdapter,
    ReplicaAdapters,
    plan_adapter,
)
from llmgw.core._scoring import capacity

ADAPTERS = [f"a{i}" for i in range(6)]
BASE = "qwen-7b"


def R(
    rid: str, most: int, held=(), loading=(), load: float = 0.0, demand: float = 0.0
) -> ReplicaAdapters:
    return ReplicaAdapters(rid, most, [HeldAdapter(*h) for h in held], loading, load, demand)


@st.composite
def replica(draw, rid: str, *, least: int = 0) -> ReplicaAdapters:
    most = draw(st.integers(least, 4))
    names = draw(st.permutations(ADAPTERS))
    n_held = draw(st.integers(0, most))
    n_loading = draw(st.integers(0, most - n_held))
    held = [
        HeldAdapter(
            name,
            draw(st.sampled_from([0.0, 1.0, 2.0, 5.0])),  # few values: LRU ties happen
            draw(st.integers(0, 2)),
        )
        for name in names[:n_held]
    ]
    loading = names[n_held : n_held + n_loading]
    load = float(draw(st.integers(0, 8)))
    demand = draw(st.sampled_from([0.0, 0.5, 2.0, 6.0]))  # few values: ties happen
    return ReplicaAdapters(rid, most, held, loading, load, demand)


@st.composite
def fleets(draw) -> list[ReplicaAdapters]:
    """A consistent view: each replica within its maximum, an adapter loading on at
    most one replica (single flight holds in what the shell feeds in)."""
    rs = [draw(replica(f"r{i}")) for i in range(draw(st.integers(0, 4)))]
    seen: set[str] = set()
    out = []
    for r in rs:
        loading = [n for n in r.loading if n not in seen]
        seen.update(loading)
        out.append(attrs.evolve(r, loading=loading))
    return out


adapters = st.sampled_from([*ADAPTERS, "fresh"])
epsilons = st.sampled_from([0.0, 0.25, 1.0])


def apply(rs: list[ReplicaAdapters], plan: AdapterPlan, now: float) -> list[ReplicaAdapters]:
    """What the shell does with a plan, through the values' own transitions."""
    out = []
    for r in rs:
        if r.replica_id == plan.replica_id and plan.action == "use":
            r = r.started(plan.adapter, now)
        elif r.replica_id == plan.replica_id and plan.action == "load":
            r = r.load_started(plan.adapter, plan.evict)
        out.append(r)
    return out


def room(r: ReplicaAdapters) -> bool:
    if r.used < r.max_adapters:
        return True
    return r.used == r.max_adapters and any(h.in_flight == 0 for h in r.held)


def check_invariants(rs: list[ReplicaAdapters]) -> None:
    for r in rs:
        assert r.used <= r.max_adapters, r
    loads = Counter(n for r in rs for n in r.loading)
    assert all(c == 1 for c in loads.values()), loads


@given(fleets(), adapters, epsilons)
def test_a_plan_keeps_every_invariant(rs, adapter, epsilon) -> None:
    plan = plan_adapter(adapter, rs, 10.0, base=BASE, epsilon=epsilon)
    assert plan.action in ADAPTER_ACTIONS and plan.adapter == adapter
    by_id = {r.replica_id: r for r in rs}
    cap = capacity([r.load for r in rs], epsilon)
    holders = [r for r in rs if r.holds(adapter)]
    within = [r for r in holders if r.load + 1 <= cap]
    loading = [r for r in rs if adapter in r.loading]
    assert plan.holders == tuple(r.replica_id for r in holders)
    assert plan.capacity == cap
    after = apply(rs, plan, 10.0)
    check_invariants(after)
    if within:  # a holder within the bound wins over any load
        assert plan.action == "use"
        assert plan.choices == tuple(r.replica_id for r in within)
        assert plan.replica_id == min(within, key=lambda r: (r.load, r.replica_id)).replica_id
    if plan.action == "use":
        assert plan.replica_id in plan.choices
        assert all(by_id[c].holds(adapter) for c in plan.choices)
    elif plan.action == "join":
        assert not holders
        assert by_id[plan.replica_id].loading.count(adapter) == 1
    elif plan.action == "load":
        assert not loading, "single flight: no second load while one is in flight"
        chosen = by_id[plan.replica_id]
        assert not chosen.holds(adapter)
        idle = [h for h in chosen.held if h.in_flight == 0]
        if chosen.used < chosen.max_adapters:
            assert plan.evict is None
        else:
            victim = min(idle, key=lambda h: (h.last_used, h.name))
            assert plan.evict == victim.name  # least recently used of the evictable
            assert all(h.in_flight == 0 for h in chosen.held if h.name == plan.evict)
        assert (plan.evict is None) == (chosen.used < chosen.max_adapters)
        # Among the replicas as able (as much within the bound, as free), the one whose
        # adapters draw the least, then the least loaded.
        alike = [
            r
            for r in rs
            if not r.holds(adapter)
            and room(r)
            and (r.load + 1 <= cap) == (chosen.load + 1 <= cap)
            and (r.used < r.max_adapters) == (chosen.used < chosen.max_adapters)
        ]
        assert (chosen.demand, chosen.load) == min((r.demand, r.load) for r in alike)
    else:
        assert plan.replica_id is None and plan.choices == ()
        assert not holders and not loading
        assert not any(room(r) for r in rs), "waits only when no replica can take it"


@given(fleets(), adapters, epsilons, st.randoms(use_true_random=False))
def test_the_answer_does_not_depend_on_the_order_of_the_input(rs, adapter, epsilon, rng):
    plan = plan_adapter(adapter, rs, 10.0, base=BASE, epsilon=epsilon)
    shuffled = []
    for r in rs:
        held, loading = list(r.held), list(r.loading)
        rng.shuffle(held)
        rng.shuffle(loading)
        shuffled.append(attrs.evolve(r, held=held, loading=loading))
    rng.shuffle(shuffled)
    assert plan_adapter(adapter, shuffled, 10.0, base=BASE, epsilon=epsilon) == plan
    assert plan_adapter(adapter, rs, 10.0, base=BASE, epsilon=epsilon) == plan


@given(fleets(), epsilons)
def test_a_second_request_for_an_adapter_being_loaded_joins_that_load(rs, epsilon) -> None:
    plan = plan_adapter("fresh", rs, 10.0, base=BASE, epsilon=epsilon)
    if plan.action != "load":
        return
    after = apply(rs, plan, 10.0)
    again = plan_adapter("fresh", after, 11.0, base=BASE, epsilon=epsilon)
    assert (again.action, again.replica_id) == ("join", plan.replica_id)
    assert (
        again.reason == f"fresh is being loaded on {plan.replica_id}; this request joins that load"
    )


# Popularity for the simulation: a0 half the time, then a1, a2, ... (8 adapters).
SKEWED = [f"s{i}" for i in range(8) for _ in range(2 ** (7 - i))]


Step = tuple[str, str | int]  # ("arrive", adapter) or (finish|loaded|failed, which one)


def simulate(maxima: list[int], epsilon: float, events: list[Step]) -> Counter[str]:
    """Apply the plans to a stream of events, checking every invariant after each, then
    drain (every load ends, every request finishes) and check each waiting request is
    served. Returns how often each kind of plan was made ("load+evict" apart)."""
    fleet = {f"r{i}": ReplicaAdapters(f"r{i}", m) for i, m in enumerate(maxima)}
    running: list[tuple[str, str]] = []  # (replica, adapter) of requests sent
    waiting: list[str] = []  # adapters of requests waiting on a load or for room
    made: Counter[str] = Counter()
    now = 0.0

    def ask(adapter: str) -> None:
        load = Counter(rid for rid, _ in running)
        rs = [attrs.evolve(r, load=float(load[r.replica_id])) for r in fleet.values()]
        plan = plan_adapter(adapter, rs, now, base=BASE, epsilon=epsilon)
        made[plan.action + ("+evict" if plan.evict else "")] += 1
        if plan.evict is not None:
            assert (plan.replica_id, plan.evict) not in running
        for r in apply(rs, plan, now):
            fleet[r.replica_id] = attrs.evolve(r, load=0.0)
        if plan.action == "use":
            running.append((plan.replica_id, adapter))
        else:
            waiting.append(adapter)

    def wake() -> None:
        again = list(waiting)
        waiting.clear()
        for adapter in again:
            ask(adapter)

    def check() -> None:
        rs = list(fleet.values())
        check_invariants(rs)
        # every request sent still finds its adapter where it went, counted in flight
        counted = Counter(running)
        assert all(fleet[rid].holds(a) for rid, a in running)
        for r in rs:
            for h in r.held:
                assert h.in_flight == counted[(r.replica_id, h.name)]

    for kind, k in events:
        now += 1.0
        loads = sorted((rid, a) for rid, r in fleet.items() for a in r.loading)
        if kind == "arrive":
            ask(str(k))
        elif kind == "finish" and running:
            rid, adapter = running.pop(int(k) % len(running))
            fleet[rid] = fleet[rid].finished(adapter, now)
            wake()
        elif kind in ("loaded", "failed") and loads:
            rid, adapter = loads[int(k) % len(loads)]
            r = fleet[rid]
            fleet[rid] = r.loaded(adapter, now) if kind == "loaded" else r.load_failed(adapter)
            wake()
        check()
    for _ in range(4 * len(SKEWED)):
        if not (waiting or running):
            break
        now += 1.0
        for rid, r in list(fleet.items()):
            for adapter in r.loading:
                fleet[rid] = fleet[rid].loaded(adapter, now)
        for rid, adapter in running:
            fleet[rid] = fleet[rid].finished(adapter, now)
        running.clear()
        wake()
        check()
    assert not waiting and not running
    return made


steps = st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(SKEWED)),
    st.tuples(st.sampled_from(["finish", "finish", "loaded", "failed"]), st.integers(0, 99)),
)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), epsilons, st.lists(steps, max_size=80))
def test_a_stream_of_skewed_requests_keeps_every_invariant(maxima, epsilon, events) -> None:
    simulate(maxima, epsilon, events)


@pytest.mark.parametrize("seed", range(3))
def test_a_long_skewed_stream_loads_evicts_joins_and_waits_within_the_invariants(seed) -> None:
    """The same simulation, long enough that every kind of plan is made (so the
    invariants above were held through evictions, joins and waits, not around them)."""
    rng = random.Random(seed)
    events: list[Step] = []
    for _ in range(1500):
        x = rng.random()
        if x < 0.4:
            events.append(("arrive", rng.choice(SKEWED)))
        else:
            kind = "finish" if x < 0.8 else "loaded" if x < 0.95 else "failed"
            events.append((kind, rng.randrange(99)))
    made = simulate([2, 2, 1], 0.25, events)
    assert {"use", "join", "load", "load+evict", "wait"} <= set(made), made
    assert made["use"] > made["load"] + made["load+evict"]  # the popular ones stay loaded


def test_a_holder_within_the_bound_is_used_with_its_words() -> None:
    rs = [R("r1", 2, [("sql", 1.0, 1)], load=1), R("r2", 2, [("sql", 2.0)], load=0), R("r3", 2)]
    plan = plan_adapter("sql", rs, 10.0, base=BASE)
    assert plan == AdapterPlan(
        "sql", "use", "r2", ("r1", "r2"), None, ("r1", "r2"), 2,
        "sql is held by r1 (1 request), r2 (0 requests), within the bound of 2 requests",
    )  # fmt: skip


def test_a_full_replica_evicts_its_least_recently_used_idle_adapter() -> None:
    rs = [
        R("r1", 2, [("old", 1.0, 2), ("mid", 3.0), ("new", 9.0)]),  # over its maximum
        R("r2", 3, [("old", 1.0, 1), ("mid", 3.0), ("new", 9.0)], load=1),
    ]
    plan = plan_adapter("sql", rs, 100.0, base=BASE)
    assert (plan.action, plan.replica_id, plan.evict) == ("load", "r2", "mid")
    assert plan.reason == (
        "no replica of qwen-7b holds sql; loading it on r2 (1 request, within the bound "
        "of 2 requests; its adapters draw 0): all 3 slots taken: evicting mid (last used "
        "97 s ago, no request in flight)"
    )
    after = rs[1].load_started("sql", "mid")
    assert [h.name for h in after.held] == ["new", "old"] and after.loading == ("sql",)
    assert after.loaded("sql", 101.0).held[-1] == HeldAdapter("sql", 101.0)


def test_a_free_slot_is_taken_before_an_eviction_even_on_a_busier_replica() -> None:
    rs = [R("r1", 1, [("a", 1.0)], load=0), R("r2", 2, [("b", 1.0)], load=1)]
    plan = plan_adapter("sql", rs, 10.0, base=BASE)
    assert (plan.action, plan.replica_id, plan.evict) == ("load", "r2", None)
    assert plan.reason.endswith("a free slot (1 of 2 taken)")


def test_a_load_goes_where_the_adapters_draw_least_before_the_least_loaded() -> None:
    # r1 holds the popular adapter (6 requests on average) and has none in flight this
    # instant; r2's adapters draw 0.5. A load goes to r2: the momentary count would put
    # every load on the replica that happens to be idle as the plan runs.
    rs = [R("r1", 4, [("hot", 1.0)], load=0, demand=6.0), R("r2", 4, [("cold", 1.0)], load=1,
          demand=0.5)]  # fmt: skip
    plan = plan_adapter("sql", rs, 10.0, base=BASE)
    assert (plan.action, plan.replica_id, plan.evict) == ("load", "r2", None)
    assert "r2 (1 request, within the bound of 2 requests; its adapters draw 0.5)" in plan.reason
    # and a replica loading an adapter that many wait for draws them: the next load
    # goes to the other one rather than waiting behind it.
    busy = [R("r1", 4, loading=["hot"], demand=6.0), R("r2", 4)]
    assert plan_adapter("sql", busy, 10.0, base=BASE).replica_id == "r2"


def test_a_hot_adapter_is_loaded_on_a_second_replica_past_the_bound() -> None:
    # epsilon 0: the bound is ceil((4 + 1) / 2) = 3; r1 holds sql with 4 requests.
    rs = [R("r1", 2, [("sql", 1.0, 4)], load=4), R("r2", 2, load=0)]
    plan = plan_adapter("sql", rs, 10.0, base=BASE, epsilon=0.0)
    assert (plan.action, plan.replica_id, plan.holders) == ("load", "r2", ("r1",))
    assert plan.reason.startswith("sql is held only by r1, over the bound of 3 requests;")
    # while that load is in flight, the holder serves: none starts a second load
    during = plan_adapter("sql", [rs[0], rs[1].load_started("sql")], 10.0, base=BASE, epsilon=0.0)
    assert (during.action, during.replica_id) == ("use", "r1")
    assert during.reason == (
        "sql is held only by r1 (4 requests), over the bound of 3 requests; "
        "a load on r2 is in flight, so none starts"
    )


def test_no_room_waits_and_says_why_per_replica() -> None:
    rs = [
        R("r1", 2, [("a", 1.0, 1), ("b", 2.0, 3)], load=4),
        R("r2", 2, [("c", 1.0, 1)], ["d"], load=1),
        R("r3", 0),
        R("r4", 1, [("e", 1.0), ("f", 1.0)], load=0),  # over its maximum: never loads more
    ]
    plan = plan_adapter("sql", rs, 10.0, base=BASE)
    assert plan == AdapterPlan(
        "sql", "wait", None, (), None, (), 3,
        "no replica of qwen-7b can load sql now: r1 holds 2 of 2 adapters, each with "
        "requests in flight; r2 holds 1 of 2 adapters, each with requests in flight and "
        "loads d; r3 takes no adapters (its maximum is 0); r4 holds or loads 2 adapters, "
        "over its maximum of 1; sql waits for a request to finish or a load to end",
    )  # fmt: skip
    assert plan_adapter("sql", [], 10.0, base=BASE).reason == (
        "no replica of qwen-7b is ready; sql waits for one"
    )


def test_inconsistent_views_and_transitions_are_refused_with_their_names() -> None:
    with pytest.raises(ValueError, match="replica r1 holds a twice"):
        R("r1", 2, [("a", 1.0), ("a", 2.0)])
    with pytest.raises(ValueError, match="replica r1 both holds and loads a"):
        R("r1", 2, [("a", 1.0)], ["a"])
    with pytest.raises(ValueError, match="replicas of qwen-7b listed twice: r1"):
        plan_adapter("a", [R("r1", 1), R("r1", 1)], 0.0, base=BASE)
    busy = R("r1", 1, [("a", 1.0, 1)])
    with pytest.raises(ValueError, match="may not evict a: 1 request"):
        busy.load_started("b", "a")
    with pytest.raises(ValueError, match="no request in flight on b to finish"):
        R("r1", 1, [("b", 1.0)]).finished("b", 2.0)
    with pytest.raises(ValueError, match="does not hold x; it holds a"):
        busy.started("x", 2.0)
    with pytest.raises(ValueError, match="is not loading a; it loads none"):
        busy.loaded("a", 2.0)


def test_use_and_finish_move_the_last_use_forward_only() -> None:
    r = R("r1", 1, [("a", 5.0)])
    r = r.started("a", 7.0)
    assert r.held == (HeldAdapter("a", 7.0, 1),)
    assert r.finished("a", 6.0).held == (HeldAdapter("a", 7.0, 0),)
    assert r.finished("a", 9.0).held == (HeldAdapter("a", 9.0, 0),)


def test_the_simulation_can_see_a_broken_plan() -> None:
    """The invariant check is not vacuous: a view that loads twice fails it."""
    rs = [R("r1", 1, loading=["a"]), R("r2", 1, loading=["a"])]
    with pytest.raises(AssertionError):
        check_invariants(rs)
