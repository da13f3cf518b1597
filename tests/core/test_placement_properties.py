"""Placement properties over random fleets, against a brute-force reference."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core._placement import (
    GIB,
    Allocations,
    GpuFacts,
    NodeFacts,
    Placement,
    PlacementProfile,
    Placer,
    Refusal,
    place,
)

CLASSES = ["a", "b"]
LABELS = [("zone", "eu"), ("zone", "us"), ("tier", "gold")]
FABRICS = ["f1", "f2"]
MODELS = ["m1", "m2"]
DISTANCES = ["PIX", "PXB", "PHB", "NODE", "SYS"]
# Filters fail often enough at random to leave little placed: keep most draws friendly.
OFTEN = st.sampled_from([True] * 5 + [False])


@st.composite
def nodes(draw: st.DrawFn, nid: str, max_cards: int = 4, friendly: bool = False) -> NodeFacts:
    """A random node; a `friendly` one passes every filter but cards, labels and fabrics."""
    gpus: tuple[GpuFacts, ...] | None = None
    if friendly or draw(st.sampled_from([True] * 9 + [False])):
        count = draw(st.sampled_from([max_cards, max_cards, max_cards - 1, 2, 1, 0]))
        count = max_cards if friendly else count
        gpus = tuple(
            GpuFacts(
                i,
                f"{nid}-{i}",
                draw(st.sampled_from(["a", "a", "a", "b"])),
                draw(OFTEN),
                draw(st.sampled_from([None, 0, 1])),
            )
            for i in range(count)
        )
    indexes = [g.index for g in gpus or ()]
    pairs = list(itertools.combinations(indexes, 2))
    nvlinks = tuple((a, b, draw(st.integers(1, 3))) for a, b in pairs if draw(st.booleans()))
    adapters = ["x0", "x1", "x2"]
    nic = tuple(
        (g, a, draw(st.sampled_from(DISTANCES)))
        for g in indexes
        for a in adapters
        if draw(st.booleans())
    )
    fabrics = tuple(
        (name, draw(st.sampled_from([(), ("x0",), ("x1",), ("x0", "x1"), ("x2", "x0")])), 100.0)
        for name in FABRICS
        if draw(OFTEN)
    )
    state = draw(st.sampled_from(["ready"] * 8 + ["cordoned", "down"]))
    labels: dict[str, str] = dict(draw(st.lists(st.sampled_from(LABELS), max_size=2)))
    if friendly:
        return NodeFacts(
            nid,
            f"{nid}.lan",
            True,
            labels=tuple(sorted(labels.items())),
            gpus=gpus,
            nvlinks=nvlinks,
            nic_distance=nic,
            fabrics=fabrics,
            weights=draw(st.frozensets(st.sampled_from(MODELS))),
        )
    return NodeFacts(
        node_id=nid,
        address=f"{nid}.lan",
        ready=state != "down",
        cordoned=state == "cordoned",
        state=draw(st.sampled_from([None, "unreachable"])),
        labels=tuple(sorted(labels.items())),
        engines=draw(
            st.sampled_from(
                [None, frozenset({"vllm", "sglang"}), frozenset({"vllm", "sglang"}), frozenset()]
            )
        ),
        gpus=gpus,
        nvlinks=nvlinks,
        nic_distance=nic,
        memory_total_bytes=draw(st.sampled_from([None, 8 * GIB, 16 * GIB, 32 * GIB, 32 * GIB])),
        disk_free_bytes=draw(st.sampled_from([None, 10 * GIB, 20 * GIB, 30 * GIB])),
        weights=draw(st.frozensets(st.sampled_from(MODELS))),
        fabrics=fabrics,
    )


@st.composite
def fleets(draw: st.DrawFn, max_nodes: int = 5, friendly: bool | None = None) -> list[NodeFacts]:
    least = draw(st.sampled_from([0, 2, 3]))
    names = draw(
        st.lists(st.sampled_from("abcdefgh"), unique=True, min_size=least, max_size=max_nodes)
    )
    if friendly is None:
        friendly = draw(st.sampled_from([False, False, True]))
    return [draw(nodes(f"node-{n}", friendly=friendly)) for n in names]


@st.composite
def profiles(draw: st.DrawFn) -> PlacementProfile:
    cls = draw(st.sampled_from([None, "a", "a", "b"]))
    nodes = draw(st.sampled_from([1, 1, 2, 2, 3]))
    cards = draw(st.integers(1, 4 if nodes == 1 else 2))
    return PlacementProfile(
        model=draw(st.sampled_from(MODELS)),
        engine=draw(st.sampled_from(["vllm", "vllm", "sglang"])),
        gpu_class=cls,
        gpus_per_node=0 if cls is None else cards,
        nodes=nodes,
        min_memory_gb=draw(st.sampled_from([None, None, None, 8, 16, 24])),
        node_selector=draw(st.sampled_from([(), (), (), (), (), *((x,) for x in LABELS)])),
        fabric=draw(st.sampled_from([None, *FABRICS])),
        weights_bytes=draw(st.sampled_from([None, None, 15 * GIB, 25 * GIB])),
    )


@st.composite
def allocations(draw: st.DrawFn, fleet: Sequence[NodeFacts]) -> Allocations:
    gpus = {
        n.node_id: draw(st.frozensets(st.integers(0, 4), max_size=3))
        for n in fleet
        if not draw(OFTEN)
    }
    cpu = {n.node_id: draw(st.integers(0, 2)) for n in fleet}
    return Allocations(gpus, cpu)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[NodeFacts], PlacementProfile, Allocations]:
    fleet = draw(fleets())
    return fleet, draw(profiles()), draw(allocations(fleet))


# --- The reference: every filter written out, every assignment tried -----------------


def fits(node: NodeFacts, p: PlacementProfile, taken: Allocations) -> bool:
    if not node.ready or node.cordoned:
        return False
    if any(dict(node.labels).get(k) != v for k, v in p.node_selector):
        return False
    if node.engines is not None and p.engine not in node.engines:
        return False
    memory, disk = node.memory_total_bytes, node.disk_free_bytes
    if p.min_memory_gb is not None and memory is not None and memory < p.min_memory_gb * GIB:
        return False
    if p.weights_bytes is not None and p.model not in node.weights:  # noqa: SIM102
        if disk is not None and disk < p.weights_bytes:
            return False
    if p.gpu_class is None:
        return True
    return node.gpus is not None and len(free_cards(node, p, taken)) >= p.gpus_per_node


def free_cards(node: NodeFacts, p: PlacementProfile, taken: Allocations) -> list[int]:
    used = taken.gpus.get(node.node_id, frozenset())
    return sorted(
        g.index
        for g in node.gpus or ()
        if g.gpu_class == p.gpu_class and g.healthy and g.index not in used
    )


def active(node: NodeFacts) -> set[str]:
    return {name for name, adapters, _ in node.fabrics if adapters}


def feasible(fleet: Sequence[NodeFacts], p: PlacementProfile, taken: Allocations) -> bool:
    ok = [n for n in fleet if fits(n, p, taken)]
    for group in itertools.combinations(ok, p.nodes):
        if p.nodes == 1:
            return True
        shared = set.intersection(*(active(n) for n in group))
        if (p.fabric in shared) if p.fabric is not None else shared:
            return True
    return False


def score(node: NodeFacts, cards: Sequence[int]) -> tuple[int, int, int]:
    links = {(min(a, b), max(a, b)): n for a, b, n in node.nvlinks}
    numa = {g.index: g.numa_node for g in node.gpus or ()}
    pairs = total = same = 0
    for a, b in itertools.combinations(cards, 2):
        if links.get((a, b)):
            pairs += 1
            total += links[(a, b)]
        if numa[a] is not None and numa[a] == numa[b]:
            same += 1
    return pairs, total, same


def best_cards(node: NodeFacts, p: PlacementProfile, taken: Allocations) -> tuple[int, ...]:
    combos = list(itertools.combinations(free_cards(node, p, taken), p.gpus_per_node))
    top = max(score(node, c) for c in combos)
    return next(c for c in combos if score(node, c) == top)


def node_key(node: NodeFacts, p: PlacementProfile, taken: Allocations) -> tuple[object, ...]:
    held = p.model not in node.weights
    if p.gpu_class is None:
        return (taken.cpu_replicas.get(node.node_id, 0), held, node.node_id)
    left = len(free_cards(node, p, taken)) - p.gpus_per_node
    s = score(node, best_cards(node, p, taken))
    return (left, -s[0], -s[1], -s[2], held, node.node_id)


def fleet_is_filtered_right(
    fleet: Sequence[NodeFacts], result: Placement, p: PlacementProfile, taken: Allocations
) -> None:
    by_id = {n.node_id: n for n in fleet}
    assert len(result.ranks) == p.nodes
    assert [r.rank for r in result.ranks] == list(range(p.nodes))
    assert len(set(result.node_ids)) == p.nodes
    for r in result.ranks:
        node = by_id[r.node_id]
        assert fits(node, p, taken)
        assert r.address == node.address
        assert len(r.gpu_indexes) == p.gpus_per_node
        assert set(r.gpu_indexes) <= set(free_cards(node, p, taken))
        uuids = {g.index: g.uuid for g in node.gpus or ()}
        assert r.gpu_uuids == tuple(uuids[i] for i in r.gpu_indexes)
        if p.nodes == 1:
            assert r.fabric_adapters == ()
        else:
            assert result.fabric is not None
            adapters = {a for name, ads, _ in node.fabrics if name == result.fabric for a in ads}
            assert r.fabric_adapters and set(r.fabric_adapters) <= adapters
            assert len(set(r.fabric_adapters)) == len(r.fabric_adapters)
    if p.nodes == 1:
        assert result.fabric is None
    else:
        assert p.fabric in (None, result.fabric)


def reason_counts(refusal: Refusal) -> list[tuple[list[str], int, str]]:
    out = []
    for line in refusal.reasons:
        m = re.fullmatch(r"(node-[a-h](?:, node-[a-h])*)(?: and (\d+) more)?: (.+)", line)
        if m:
            names = m.group(1).split(", ")
            out.append((names, len(names) + int(m.group(2) or 0), m.group(3)))
    return out


# --- Properties ------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(cases())
def test_refuses_exactly_when_brute_force_finds_nothing_and_picks_its_best(
    case: tuple[list[NodeFacts], PlacementProfile, Allocations],
) -> None:
    fleet, p, taken = case
    result = place(fleet, p, taken)
    assert isinstance(result, Placement) == feasible(fleet, p, taken), str(result)
    if isinstance(result, Refusal):
        assert result.reasons
        if p.nodes == 1:
            # Every node is named once, with one reason.
            counted = reason_counts(result)
            assert sum(c for _, c, _ in counted) == len(fleet)
            named = [n for names, _, _ in counted for n in names]
            assert len(named) == len(set(named))
        return
    fleet_is_filtered_right(fleet, result, p, taken)
    by_id = {n.node_id: n for n in fleet}
    if p.nodes == 1:
        ok = [n for n in fleet if fits(n, p, taken)]
        best = min(ok, key=lambda n: node_key(n, p, taken))
        assert result.node_ids == (best.node_id,)
        if p.gpu_class is not None:
            assert result.ranks[0].gpu_indexes == best_cards(best, p, taken)
    else:
        # The ranks are the best nodes on the chosen fabric, best first.
        on = [n for n in fleet if fits(n, p, taken) and result.fabric in active(n)]
        on.sort(key=lambda n: node_key(n, p, taken))
        assert list(result.node_ids) == [n.node_id for n in on[: p.nodes]]
        for r in result.ranks:
            node = by_id[r.node_id]
            if p.gpu_class is not None:
                assert score(node, r.gpu_indexes) == score(node, best_cards(node, p, taken))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_placing_one_after_another_never_gives_a_card_twice(data: st.DataObject) -> None:
    fleet = data.draw(fleets(max_nodes=6))
    start = data.draw(allocations(fleet))
    wanted = data.draw(st.lists(profiles(), min_size=1, max_size=12))
    placer = Placer(fleet, start)
    taken = start
    given_out: set[tuple[str, int]] = {(n, i) for n, s in start.gpus.items() for i in s}
    placed: list[Placement] = []
    for p in wanted:
        result = placer.place(p)
        # The index kept current gives what a fresh look at the same allocations gives.
        assert result == place(fleet, p, taken)
        if isinstance(result, Refusal):
            continue
        fleet_is_filtered_right(fleet, result, p, taken)
        for r in result.ranks:
            for i in r.gpu_indexes:
                assert (r.node_id, i) not in given_out
                given_out.add((r.node_id, i))
        placer.add(result)
        taken = taken.add(result)
        assert placer.allocations == taken
        placed.append(result)
    # Giving everything back returns to the start, and decisions with it.
    for done in reversed(placed):
        placer.remove(done)
    assert placer.allocations == start
    for p in wanted[:3]:
        assert placer.place(p) == place(fleet, p, start)


@settings(max_examples=150, deadline=None)
@given(cases(), st.randoms(use_true_random=False))
def test_the_answer_does_not_depend_on_the_order_of_the_fleet(
    case: tuple[list[NodeFacts], PlacementProfile, Allocations], rng: object
) -> None:
    fleet, p, taken = case
    shuffled = list(fleet)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    first = place(fleet, p, taken)
    assert place(shuffled, p, taken) == first
    assert place(fleet, p, taken) == first


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_groups_share_one_fabric_on_larger_fleets(data: st.DataObject) -> None:
    fleet = data.draw(fleets(max_nodes=8, friendly=True))
    p = data.draw(profiles().filter(lambda p: p.nodes > 1))
    placer = Placer(fleet)
    for _ in range(4):
        result = placer.place(p)
        if isinstance(result, Refusal):
            assert not feasible(fleet, p, placer.allocations)
            break
        fleet_is_filtered_right(fleet, result, p, placer.allocations)
        by_id = {n.node_id: n for n in fleet}
        assert all(result.fabric in active(by_id[n]) for n in result.node_ids)
        placer.add(result)
