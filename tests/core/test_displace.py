"""Priorities on a full fleet (llmgw/core/_displace.py).

`fits` here is what the shell's placement simulation answers for a one-node replica:
one more replica of the asking model needs `need` cards on one node, and each node has
some cards free plus those of the replicas freed on it. Properties: a victim always has
a strictly lower priority, an idle model and a spare replica (its model never goes
below its min); the result fits; with few candidates no smaller or better set fits, and
None means none fits at all; a lower priority never displaces a higher one.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import Displacement, Holder, displace, no_room
from llmgw.core._displace import EXACT_UP_TO


@attrs.frozen
class Fleet:
    holders: tuple[Holder, ...]
    node_of: dict[str, str]  # replica id -> node
    free: dict[str, int]  # node -> free cards
    need: int  # cards one more replica of the asker needs on one node

    def fits(self, freed: frozenset[str]) -> bool:
        by_node = Counter(self.free)
        for h in self.holders:
            if h.replica_id in freed:
                by_node[self.node_of[h.replica_id]] += h.cards
        return any(n >= self.need for n in by_node.values())


@st.composite
def fleets(draw, least: int = 0, most: int = 10, *, lenient: bool = False) -> Fleet:
    """Holders on 1-3 nodes. `lenient`: nearly every holder may be taken by an asker of
    priority 5 (idle, lower, spare), on small replicas that take several to make room."""
    nodes = [f"n{i}" for i in range(draw(st.integers(1, 2 if lenient else 3)))]
    models = {}
    for m in range(draw(st.integers(1, 4))):
        models[f"m{m}"] = (
            draw(st.integers(0, 4)),
            draw(st.booleans() | st.just(True)) if lenient else draw(st.booleans()),
            draw(st.integers(1, 3) if lenient else st.integers(0, 3)),
        )
    holders, node_of = [], {}
    cards = st.integers(1, 3) if lenient else st.integers(1, 8)
    for i in range(draw(st.integers(least, most))):
        name = draw(st.sampled_from(sorted(models)))
        priority, idle, spare = models[name]
        rid = f"{name}-r{i}"
        holders.append(Holder(rid, name, priority, idle, spare, draw(cards)))
        node_of[rid] = draw(st.sampled_from(nodes))
    free = {n: draw(st.integers(0, 4)) for n in nodes}
    return Fleet(tuple(holders), node_of, free, draw(st.integers(1, 12)))


def allowed(h: Holder, model: str, priority: int) -> bool:
    return h.model_name != model and h.priority < priority and h.idle and h.spare > 0


def within_spare(victims: Sequence[Holder]) -> bool:
    taken = Counter(h.model_name for h in victims)
    return all(taken[h.model_name] <= h.spare for h in victims)


def check(fleet: Fleet, model: str, priority: int, result: Displacement | None) -> None:
    """The rules every answer keeps, whatever the search."""
    if result is None:
        return
    by_id = {h.replica_id: h for h in fleet.holders}
    victims = [by_id[v] for v in result.victims]
    assert len(set(result.victims)) == len(victims)
    assert all(allowed(h, model, priority) for h in victims)
    assert within_spare(victims)
    assert fleet.fits(frozenset(result.victims))


@settings(max_examples=400)
@given(fleets() | fleets(most=EXACT_UP_TO, lenient=True), st.integers(0, 5))
def test_the_victims_are_lower_idle_spare_and_the_fewest_that_fit(
    fleet: Fleet, priority: int
) -> None:
    result = displace("asker", priority, 3, 2, fleet.holders, fleet.fits)
    check(fleet, "asker", priority, result)
    candidates = [h for h in fleet.holders if allowed(h, "asker", priority)]
    assert len(candidates) <= EXACT_UP_TO
    fitting = [
        c
        for k in range(len(candidates) + 1)
        for c in itertools.combinations(candidates, k)
        if within_spare(c) and fleet.fits(frozenset(h.replica_id for h in c))
    ]
    if result is None:
        assert fitting == []
        return
    assert fitting, "a set was chosen, so one fits"
    fewest = min(len(c) for c in fitting)
    assert len(result.victims) == fewest
    # Among the fewest: no set of lower priorities (highest first) fits.
    by_id = {h.replica_id: h for h in fleet.holders}
    chosen = sorted((by_id[v].priority for v in result.victims), reverse=True)
    assert chosen == min(
        sorted((h.priority for h in c), reverse=True) for c in fitting if len(c) == fewest
    )


@settings(max_examples=200)
@given(fleets(least=EXACT_UP_TO + 1, most=30, lenient=True))
def test_with_many_candidates_the_greedy_choice_keeps_every_rule(fleet: Fleet) -> None:
    result = displace("asker", 5, 3, 2, fleet.holders, fleet.fits)
    check(fleet, "asker", 5, result)
    # Greedy is complete when no model's spare binds: None only when nothing fits.
    candidates = [h for h in fleet.holders if allowed(h, "asker", 5)]
    if result is None and within_spare(candidates):
        assert not fleet.fits(frozenset(h.replica_id for h in candidates))
    if result is not None and result.victims:
        # No victim could be given back and the replica still fit.
        for v in result.victims:
            assert not fleet.fits(frozenset(result.victims) - {v})


@given(fleets(), st.data())
def test_a_lower_priority_never_displaces_a_higher_one(fleet: Fleet, data: st.DataObject) -> None:
    names = sorted({h.model_name for h in fleet.holders})
    if len(names) < 2:
        return
    a, b = data.draw(st.permutations(names))[:2]
    pa = next(h.priority for h in fleet.holders if h.model_name == a)
    pb = next(h.priority for h in fleet.holders if h.model_name == b)
    by_id = {h.replica_id: h for h in fleet.holders}
    for asker, priority, other in ((a, pa, b), (b, pb, a)):
        result = displace(asker, priority, 2, 1, fleet.holders, fleet.fits)
        check(fleet, asker, priority, result)
        taken = {by_id[v].model_name for v in (result.victims if result else ())}
        if other in taken:
            # Then the other model, asking in turn, could never take the asker's.
            other_priority = pb if other == b else pa
            assert other_priority < priority
            back = displace(other, other_priority, 2, 1, fleet.holders, fleet.fits)
            assert asker not in {by_id[v].model_name for v in (back.victims if back else ())}


# --- the words ----------------------------------------------------------------------------


def one_node(*holders: Holder, free: int = 0, need: int = 8) -> Fleet:
    return Fleet(holders, {h.replica_id: "n1" for h in holders}, {"n1": free}, need)


def test_the_reason_names_who_held_the_cards() -> None:
    fleet = one_node(
        Holder("llama-70b-1", "llama-70b", 1, True, 1, 8),
        Holder("phi-1", "phi", 0, True, 2, 2),
    )
    result = displace("qwen-7b", 5, 3, 2, fleet.holders, fleet.fits)
    assert result == Displacement(
        ("llama-70b-1",),
        "qwen-7b wants 3, has 2: no room; llama-70b (priority 1) holds the 8 cards it could "
        "use: draining llama-70b-1 (idle, 1 above its min)",
    )


def test_a_replica_that_fits_already_needs_no_victim() -> None:
    fleet = one_node(Holder("a-1", "a", 0, True, 1, 8), free=8)
    result = displace("b", 5, 1, 0, fleet.holders, fleet.fits)
    assert result == Displacement((), "b wants 1, has 0: fits without displacing anything")


def test_lowest_priority_first_then_most_cards() -> None:
    fleet = one_node(
        Holder("p1-big", "p1", 1, True, 5, 8),
        Holder("p0-small", "p0", 0, True, 5, 4),
        Holder("p0-big", "p0", 0, True, 5, 8),
    )
    result = displace("x", 5, 1, 0, fleet.holders, fleet.fits)
    assert result is not None and result.victims == ("p0-big",)


def test_no_room_names_the_holder_and_why_it_may_not_give_up_its_cards() -> None:
    busy = Holder("llama-1", "llama", 1, False, 1, 8)
    assert displace("qwen", 5, 3, 2, [busy], one_node(busy).fits) is None
    assert no_room("qwen", 3, 2, [busy], one_node(busy).fits, priority=5) == (
        "qwen wants 3, has 2: no room; llama (priority 1) holds the 8 cards it could use "
        "but may not give them up: busy"
    )
    higher = Holder("llama-1", "llama", 7, True, 0, 8)
    assert no_room("qwen", 3, 2, [higher], one_node(higher).fits, priority=5) == (
        "qwen wants 3, has 2: no room; llama (priority 7) holds the 8 cards it could use "
        "but may not give them up: priority 7 is not lower than 5, at its min"
    )
    equal = Holder("llama-1", "llama", 5, True, 1, 8)
    assert displace("qwen", 5, 3, 2, [equal], one_node(equal).fits) is None
    assert "priority 5 is not lower than 5" in no_room(
        "qwen", 3, 2, [equal], one_node(equal).fits, priority=5
    )


def test_no_room_when_nothing_would_do() -> None:
    small = Holder("a-1", "a", 0, True, 1, 2)
    assert no_room("qwen", 1, 0, [small], one_node(small, need=8).fits) == (
        "qwen wants 1, has 0: no room, even if every other model's replicas gave up their cards"
    )
    together = [Holder("a-1", "a", 0, False, 1, 4), Holder("b-1", "b", 0, True, 0, 4)]
    words = no_room("qwen", 1, 0, together, one_node(*together, need=8).fits)
    assert words.startswith("qwen wants 1, has 0: no room; only the replicas of several models")
    assert "a (priority 0) holds the 4 cards it could use but may not give them up: busy" in words
    assert (
        "b (priority 0) holds the 4 cards it could use but may not give them up: at its min"
        in words
    )
