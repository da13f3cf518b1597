"""Sharing a card: memory shares and MIG instances (llmgw/core/_sharing.py)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import SHARED_HEADROOM_MIB, MigFacts
from llmgw.core._placement import (
    MAX_REASON_LINES,
    Allocations,
    GpuFacts,
    NodeFacts,
    Placement,
    PlacementProfile,
    Placer,
    Refusal,
    place,
)

GIB_MIB = 1024
H100 = "h100-80g"
H100_MIB = 81559  # what nvidia-smi reports as an H100 80GB's memory.total (tests/data)


def card(
    i: int,
    total: int | None = 80 * GIB_MIB,
    *,
    nid: str = "n",
    healthy: bool = True,
    foreign: int | None = None,
    mig: tuple[MigFacts, ...] | None = None,
) -> GpuFacts:
    return GpuFacts(
        i,
        f"GPU-{nid}-{i}",
        H100,
        healthy,
        memory_total_mib=total,
        foreign_mib=foreign,
        mig_enabled=mig is not None,
        mig=mig or (),
    )


def node(nid: str, *gpus: GpuFacts) -> NodeFacts:
    return NodeFacts(nid, f"10.0.0.{len(nid)}", True, gpus=gpus)


def share(gib: float, k: int = 1) -> PlacementProfile:
    return PlacementProfile("m", "vllm", H100, k, gpu_memory_mib=int(gib * GIB_MIB))


WHOLE = PlacementProfile("m", "vllm", H100, 1)


def instances(*profiles: str, nid: str = "n", gpu: int = 0) -> tuple[MigFacts, ...]:
    return tuple(
        MigFacts(f"MIG-{nid}-{gpu}-{j}", p, 9856 if p == "1g.10gb" else 40192)
        for j, p in enumerate(profiles)
    )


def place_all(placer: Placer, profiles: list[PlacementProfile]) -> list[Placement | Refusal]:
    out: list[Placement | Refusal] = []
    for p in profiles:
        got = placer.place(p)
        if isinstance(got, Placement):
            placer.add(got)
        out.append(got)
    return out


# --- Exact examples -------------------------------------------------------------


def test_four_24_gib_replicas_on_two_80_gib_cards_put_three_on_the_first() -> None:
    placer = Placer([node("n", card(0, H100_MIB), card(1, H100_MIB))])
    got = place_all(placer, [share(24)] * 4)
    assert [r.ranks[0].gpu_indexes for r in got if isinstance(r, Placement)] == [
        (0,),
        (0,),
        (0,),
        (1,),
    ]
    assert all(isinstance(r, Placement) and r.ranks[0].memory_mib == 24 * GIB_MIB for r in got)
    assert placer.allocations.claims == {"n": {0: 72 * GIB_MIB, 1: 24 * GIB_MIB}}
    # A fifth, sixth and seventh fit on card 1 only up to its 80 GiB less the headroom.
    more = place_all(placer, [share(24)] * 3)
    assert [type(r) for r in more] == [Placement, Placement, Refusal]
    assert (
        str(more[2])
        == "n: gpu 0 has 6.6 GiB unclaimed, needs 24; gpu 1 has 6.6 GiB unclaimed, needs 24"
    )


def test_the_headroom_is_one_gib_per_shared_card() -> None:
    assert SHARED_HEADROOM_MIB == 1024
    exactly = 80 * GIB_MIB - SHARED_HEADROOM_MIB
    assert isinstance(place([node("n", card(0))], share(exactly / GIB_MIB)), Placement)
    refused = place([node("n", card(0))], share((exactly + 1) / GIB_MIB))
    assert str(refused) == "n: gpu 0 has 79 GiB unclaimed, needs 79.1"


def test_foreign_memory_and_claims_count_against_a_card() -> None:
    fleet = [node("n", card(0, foreign=30 * GIB_MIB))]
    taken = Allocations(claims={"n": {0: 20 * GIB_MIB}})
    assert str(place(fleet, share(30), taken)) == "n: gpu 0 has 29 GiB unclaimed, needs 30"
    got = place(fleet, share(29), taken)
    assert isinstance(got, Placement) and got.ranks[0].gpu_uuids == ("GPU-n-0",)


def test_a_shared_card_is_preferred_to_an_empty_one_and_the_fullest_that_fits_wins() -> None:
    fleet = [node("a", card(0, nid="a"), card(1, nid="a")), node("b", card(0, nid="b"))]
    taken = Allocations(claims={"b": {0: 60 * GIB_MIB}, "a": {1: 40 * GIB_MIB}})
    got = place(fleet, share(10), taken)
    assert isinstance(got, Placement)
    assert (got.ranks[0].node_id, got.ranks[0].gpu_indexes) == ("b", (0,))
    got = place(
        fleet, share(30), taken
    )  # b's card has 19 GiB: a's shared card before a's empty one
    assert isinstance(got, Placement)
    assert (got.ranks[0].node_id, got.ranks[0].gpu_indexes) == ("a", (1,))


def test_an_empty_card_is_taken_on_the_node_with_fewest_whole_cards_free() -> None:
    fleet = [
        node("a", *(card(i, nid="a") for i in range(4))),
        node("b", *(card(i, nid="b") for i in range(4))),
    ]
    got = place(fleet, share(10), Allocations(gpus={"b": {0, 1}}))
    assert isinstance(got, Placement)
    assert (got.ranks[0].node_id, got.ranks[0].gpu_indexes) == ("b", (2,))


def test_a_whole_card_profile_never_takes_a_claimed_or_mig_card() -> None:
    mig = instances("3g.40gb", "3g.40gb")
    fleet = [node("n", card(0, mig=mig), card(1), card(2))]
    refused = place(fleet, WHOLE, Allocations(claims={"n": {1: 1024}}, gpus={"n": {2}}))
    assert str(refused) == (
        "n: 0 free healthy h100-80g cards, needs 1 (1 in use, 1 shared);"
        " gpu 0 is MIG-enabled: whole-card profiles do not use it"
    )
    got = place(fleet, WHOLE, Allocations(claims={"n": {1: 1024}}))
    assert isinstance(got, Placement) and got.ranks[0].gpu_indexes == (2,)


def test_a_placer_refuses_a_whole_card_once_a_share_is_on_it() -> None:
    placer = Placer([node("n", card(0))])
    (first,) = place_all(placer, [share(8)])
    assert isinstance(first, Placement)
    assert str(placer.place(WHOLE)) == "n: 0 free healthy h100-80g cards, needs 1 (1 shared)"
    placer.remove(first)
    assert placer.allocations == Allocations()
    assert isinstance(placer.place(WHOLE), Placement)


def test_a_share_never_lands_on_a_whole_card_or_a_mig_card_or_one_of_unknown_size() -> None:
    fleet = [
        node(
            "n",
            card(0, mig=instances("1g.10gb")),
            card(1, None),
            card(2, healthy=False),
            card(3),
        )
    ]
    refused = place(fleet, share(1), Allocations(gpus={"n": {3}}))
    assert str(refused) == (
        "n: gpu 0 is MIG-enabled: shared profiles do not use it;"
        " gpu 1 memory total unknown: not shared; gpu 2 unhealthy; gpu 3 is allocated whole"
    )


def test_a_share_of_several_cards_takes_that_much_on_each_of_them_on_one_node() -> None:
    fleet = [
        node("a", card(0, nid="a"), card(1, nid="a")),
        node("b", card(0, nid="b"), card(1, nid="b"), card(2, nid="b")),
    ]
    taken = Allocations(claims={"a": {0: 50 * GIB_MIB}, "b": {0: 10 * GIB_MIB}})
    got = place(fleet, share(40, k=2), taken)
    assert isinstance(got, Placement)
    assert (got.ranks[0].node_id, got.ranks[0].gpu_indexes, got.ranks[0].memory_mib) == (
        "b",
        (0, 1),
        40 * GIB_MIB,
    )
    assert Allocations().add(got).claims == {"b": {0: 40 * GIB_MIB, 1: 40 * GIB_MIB}}
    refused = place(fleet, share(70, k=3), taken)
    assert str(refused).splitlines() == [
        "a: 1 h100-80g card with 70 GiB unclaimed, needs 3; gpu 0 has 29 GiB unclaimed, needs 70",
        "b: 2 h100-80g cards with 70 GiB unclaimed, needs 3; gpu 0 has 69 GiB unclaimed, needs 70",
    ]


def test_a_share_over_nodes_is_refused() -> None:
    p = PlacementProfile("m", "vllm", H100, 1, nodes=2, gpu_memory_mib=8 * GIB_MIB)
    assert str(place([node("n", card(0))], p)) == (
        "a share of a card (8 GiB) is placed on one node, not 2: a group over nodes takes whole cards"
    )


def test_a_mig_profile_takes_one_free_instance_of_its_profile() -> None:
    mig = instances("3g.40gb", "1g.10gb", "3g.40gb")
    placer = Placer([node("n", card(0, mig=mig), card(1))])
    p = PlacementProfile("m", "vllm", H100, 1, mig="3g.40gb")
    got = place_all(placer, [p, p, p])
    assert [r.ranks[0].mig_uuids for r in got if isinstance(r, Placement)] == [
        ("MIG-n-0-0",),
        ("MIG-n-0-2",),
    ]
    first = got[0]
    assert isinstance(first, Placement)
    assert first.ranks[0].gpu_indexes == (0,) and first.ranks[0].gpu_uuids == ("GPU-n-0",)
    assert str(got[2]) == "n: no free 3g.40gb instance (gpu 0 has 1g.10gb x1, 3g.40gb x2 (2 taken))"
    assert placer.allocations.mig == {"n": frozenset({"MIG-n-0-0", "MIG-n-0-2"})}
    placer.remove(first)
    assert placer.place(p) == first


def test_the_issue_s_mig_refusal_words() -> None:
    fleet = [node("n", card(0, mig=instances("1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb")))]
    refused = place(fleet, PlacementProfile("m", "vllm", H100, 1, mig="3g.40gb"))
    assert str(refused) == "n: no free 3g.40gb instance (gpu 0 has 1g.10gb x4)"
    refused = place([node("n", card(0))], PlacementProfile("m", "vllm", H100, 1, mig="3g.40gb"))
    assert str(refused) == "n: no MIG-enabled h100-80g card"


@pytest.mark.parametrize(("k", "nodes"), [(2, 1), (1, 2)])
def test_mig_with_tensor_parallelism_is_refused(k: int, nodes: int) -> None:
    fleet = [node("n", card(0, mig=instances("3g.40gb", "3g.40gb")))]
    refused = place(fleet, PlacementProfile("m", "vllm", H100, k, nodes=nodes, mig="3g.40gb"))
    assert isinstance(refused, Refusal)
    assert "CUDA does not run tensor parallelism across MIG instances" in str(refused)
    assert f"not {k} GPU" in str(refused) and f"on {nodes} node" in str(refused)


def test_a_profile_is_a_share_or_mig_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        PlacementProfile("m", "vllm", H100, 1, gpu_memory_mib=1024, mig="1g.10gb")
    with pytest.raises(ValueError, match="needs a gpu_class"):
        PlacementProfile("m", "vllm", None, 0, gpu_memory_mib=1024)
    with pytest.raises(ValueError, match="at least 1, not 0"):
        PlacementProfile("m", "vllm", H100, 1, gpu_memory_mib=0)


def test_best_fit_can_use_more_cards_than_first_fit_on_odd_sizes() -> None:
    """The known limit of best fit (the packing properties below use sizes that divide
    each other, as catalogs mostly do): 5, 6, 3, 2, 4 GiB on 10 GiB cards take three
    cards where first fit takes two."""
    total = 10 * GIB_MIB + SHARED_HEADROOM_MIB
    placer = Placer([node("n", *(card(i, total) for i in range(3)))])
    place_all(placer, [share(g) for g in (5, 6, 3, 2, 4)])
    assert len(placer.allocations.claims["n"]) == 3
    assert first_fit_cards([total] * 3, [g * GIB_MIB for g in (5, 6, 3, 2, 4)]) == 2


# --- Properties ------------------------------------------------------------------

MIG_PROFILES = ["1g.10gb", "3g.40gb"]


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeFacts]:
    out = []
    for n in range(draw(st.integers(1, 5))):
        nid = f"n{n}"
        gpus = []
        for i in range(draw(st.integers(0, 4))):
            mig = None
            if draw(st.integers(0, 4)) == 0:
                mig = instances(
                    *draw(st.lists(st.sampled_from(MIG_PROFILES), max_size=4)), nid=nid, gpu=i
                )
            gpus.append(
                card(
                    i,
                    draw(st.sampled_from([None, 40 * GIB_MIB, H100_MIB, 141 * GIB_MIB])),
                    nid=nid,
                    healthy=draw(st.sampled_from([True, True, True, False])),
                    foreign=draw(st.sampled_from([None, 0, 512, 30 * GIB_MIB])),
                    mig=mig,
                )
            )
        out.append(
            NodeFacts(nid, nid, draw(st.sampled_from([True] * 5 + [False])), gpus=tuple(gpus))
        )
    return out


PROFILES = st.one_of(
    st.builds(
        lambda gib, k: share(gib, k),
        st.sampled_from([1, 5, 10, 20, 24, 33.5, 70, 90]),
        st.integers(1, 3),
    ),
    st.builds(lambda k: PlacementProfile("m", "vllm", H100, k), st.integers(1, 2)),
    st.builds(
        lambda prof: PlacementProfile("m", "vllm", H100, 1, mig=prof), st.sampled_from(MIG_PROFILES)
    ),
)


def run(
    fleet: list[NodeFacts], profiles: list[PlacementProfile]
) -> tuple[Placer, list[Placement | Refusal]]:
    placer = Placer(fleet)
    return placer, place_all(placer, profiles)


@settings(max_examples=300, deadline=None)
@given(fleets(), st.lists(PROFILES, max_size=25))
def test_claims_on_a_card_never_exceed_its_memory_less_headroom(
    fleet: list[NodeFacts], profiles: list[PlacementProfile]
) -> None:
    placer, _ = run(fleet, profiles)
    cards = {(f.node_id, g.index): g for f in fleet for g in f.gpus or ()}
    for nid, per in placer.allocations.claims.items():
        for i, mib in per.items():
            g = cards[nid, i]
            assert g.memory_total_mib is not None and g.healthy and not g.mig_enabled
            assert mib + (g.foreign_mib or 0) + SHARED_HEADROOM_MIB <= g.memory_total_mib


@settings(max_examples=300, deadline=None)
@given(fleets(), st.lists(PROFILES, max_size=25))
def test_a_whole_card_profile_never_shares(
    fleet: list[NodeFacts], profiles: list[PlacementProfile]
) -> None:
    placer, got = run(fleet, profiles)
    cards = {(f.node_id, g.index): g for f in fleet for g in f.gpus or ()}
    whole = placer.allocations.gpus
    claims = placer.allocations.claims
    for nid, indexes in whole.items():
        assert not set(indexes) & set(claims.get(nid, {})), (nid, indexes, claims)
        assert not any(cards[nid, i].mig_enabled for i in indexes)
    placed_whole = sum(
        len(r.ranks[0].gpu_indexes)
        for r, p in zip(got, profiles, strict=True)
        if isinstance(r, Placement) and p.gpu_memory_mib is None and p.mig is None
    )
    assert placed_whole == sum(len(v) for v in whole.values())


@settings(max_examples=300, deadline=None)
@given(fleets(), st.lists(PROFILES, max_size=25))
def test_a_mig_enabled_card_offers_only_its_instances(
    fleet: list[NodeFacts], profiles: list[PlacementProfile]
) -> None:
    _, got = run(fleet, profiles)
    cards = {(f.node_id, g.index): g for f in fleet for g in f.gpus or ()}
    seen: set[str] = set()
    for r, p in zip(got, profiles, strict=True):
        if not isinstance(r, Placement):
            continue
        (rank,) = r.ranks
        used = [cards[rank.node_id, i] for i in rank.gpu_indexes]
        if p.mig is None:
            assert not any(g.mig_enabled for g in used) and rank.mig_uuids == ()
            continue
        (g,) = used
        (uuid,) = rank.mig_uuids
        assert g.mig_enabled and uuid not in seen
        assert [m.profile for m in g.mig if m.uuid == uuid] == [p.mig]
        seen.add(uuid)


def named(line: str) -> int:
    """How many nodes a refusal line names: "a, b and 3 more: why" -> 5."""
    m = re.fullmatch(r"(.+?)(?: and (\d+) more)?: .*", line)
    assert m is not None, line
    return len(m.group(1).split(", ")) + int(m.group(2) or 0)


@settings(max_examples=300, deadline=None)
@given(fleets(), st.lists(PROFILES, min_size=1, max_size=25))
def test_every_refusal_has_a_reason_per_node(
    fleet: list[NodeFacts], profiles: list[PlacementProfile]
) -> None:
    _, got = run(fleet, profiles)
    assert len(fleet) <= MAX_REASON_LINES
    for r in got:
        if not isinstance(r, Refusal):
            continue
        assert all(r.reasons)
        assert sum(named(line) for line in r.reasons) == len(fleet), r.reasons


def first_fit_cards(totals: list[int], sizes: list[int]) -> int:
    """Cards a first fit uses: each share on the first card (in order) with room."""
    free = [t - SHARED_HEADROOM_MIB for t in totals]
    used: set[int] = set()
    for s in sizes:
        for i, f in enumerate(free):
            if f >= s:
                free[i] -= s
                used.add(i)
                break
    return len(used)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.lists(st.sampled_from([5, 10, 20, 40, 80]), max_size=40),
)
def test_packing_leaves_at_least_as_many_whole_cards_free_as_first_fit(
    nodes: int, per_node: int, sizes: list[int]
) -> None:
    total = 80 * GIB_MIB + SHARED_HEADROOM_MIB
    fleet = [
        node(f"n{n}", *(card(i, total, nid=f"n{n}") for i in range(per_node))) for n in range(nodes)
    ]
    cards = nodes * per_node
    while sum(sizes) > cards * 80:  # what fits: sizes that divide 80 then pack without loss
        sizes = sizes[:-1]
    placer, got = run(fleet, [share(g) for g in sizes])
    assert all(isinstance(r, Placement) for r in got)
    used = sum(len(c) for c in placer.allocations.claims.values())
    first_fit_used = first_fit_cards([total] * cards, [g * GIB_MIB for g in sizes])
    assert cards - used >= cards - first_fit_used


@settings(max_examples=150, deadline=None)
@given(fleets(), st.lists(PROFILES, max_size=15))
def test_the_placer_and_pure_place_agree_and_remove_gives_everything_back(
    fleet: list[NodeFacts], profiles: list[PlacementProfile]
) -> None:
    placer = Placer(fleet)
    placed: list[Placement] = []
    for p in profiles:
        got = placer.place(p)
        assert got == place(fleet, p, placer.allocations)
        assert Placer(fleet, placer.allocations).place(p) == got
        if isinstance(got, Placement):
            before = placer.allocations
            placer.add(got)
            assert placer.allocations == before.add(got)
            placed.append(got)
    for got in reversed(placed):
        placer.remove(got)
    assert placer.allocations == Allocations()
    if profiles:
        assert placer.place(profiles[0]) == place(fleet, profiles[0])


@settings(max_examples=200, deadline=None)
@given(fleets(), st.lists(PROFILES, max_size=15), PROFILES, st.data())
def test_a_narrow_selection_finds_the_card_the_sorted_walk_finds(
    fleet: list[NodeFacts],
    profiles: list[PlacementProfile],
    probe: PlacementProfile,
    data: st.DataObject,
) -> None:
    """find_share compares the eligible nodes' cards when they are few (a narrow
    node_selector) instead of walking the sorted lists: the two give one answer."""
    placer, _ = run(fleet, profiles)
    ids = [f.node_id for f in fleet]
    eligible = frozenset(data.draw(st.lists(st.sampled_from(ids), unique=True)))
    share_ = placer._share
    share_.find_share(H100, 1, 1, eligible)  # indexes what is pending
    k, mib = probe.gpus_per_node, probe.gpu_memory_mib or 1
    assert share_._by_node(H100, k, mib, eligible) == share_._walk(H100, k, mib, eligible)
