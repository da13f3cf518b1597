"""Placement by example: exact placements and exact refusal texts."""

from __future__ import annotations

import attrs
import pytest

from llmgw.core._placement import (
    GIB,
    Allocations,
    GpuFacts,
    NodeFacts,
    Placement,
    PlacementProfile,
    Placer,
    RankPlacement,
    Refusal,
    place,
)


def gpus(count: int, cls: str = "h100-80g", *, sick: tuple[int, ...] = ()) -> tuple[GpuFacts, ...]:
    return tuple(GpuFacts(i, f"GPU-{i}", cls, i not in sick, i * 2 // count) for i in range(count))


def switch(count: int, links: int = 18) -> tuple[tuple[int, int, int], ...]:
    return tuple((a, b, links) for a in range(count) for b in range(a + 1, count))


def gpu_node(nid: str, count: int = 8, **kw: object) -> NodeFacts:
    base: dict[str, object] = {
        "gpus": gpus(count),
        "nvlinks": switch(count),
        "engines": frozenset({"vllm"}),
    }
    base.update(kw)
    return NodeFacts(nid, f"{nid}.lan:7000", True, **base)  # type: ignore[arg-type]


def profile(cards: int = 1, cls: str | None = "h100-80g", **kw: object) -> PlacementProfile:
    return PlacementProfile("llama-70b", "vllm", cls, cards, **kw)  # type: ignore[arg-type]


def only_placement(result: Placement | Refusal) -> Placement:
    assert isinstance(result, Placement), str(result)
    return result


# --- Scores ----------------------------------------------------------------------


def test_gpu_replicas_bin_pack_onto_the_fullest_node_that_fits() -> None:
    fleet = [gpu_node("node01"), gpu_node("node02"), gpu_node("node03")]
    taken = Allocations(gpus={"node02": {0, 1, 2, 3, 4, 5}, "node03": {0, 1, 2, 3, 4, 5, 6}})
    assert place(fleet, profile(2), taken) == Placement(
        (RankPlacement(0, "node02", "node02.lan:7000", (6, 7), ("GPU-6", "GPU-7"), ()),), None
    )
    # One card: node03 is left with none free, the tightest fit.
    one = only_placement(place(fleet, profile(1), taken)).ranks[0]
    assert (one.node_id, one.address, one.gpu_indexes) == ("node03", "node03.lan:7000", (7,))


def test_tensor_parallel_takes_nvlinked_cards_and_prefers_the_node_that_has_them() -> None:
    # Two PCIe nodes with NVLink bridges: node01 bridges 0-1 and 2-3; node02 bridges 1-2.
    bridged = gpu_node("node01", 4, nvlinks=((0, 1, 4), (2, 3, 4)))
    odd = gpu_node("node02", 4, nvlinks=((1, 2, 4),))
    taken = Allocations(gpus={"node01": {1, 3}, "node02": {0, 3}})
    # node01 has 0 and 2 free (not joined), node02 has 1 and 2 free (joined).
    chosen = only_placement(place([bridged, odd], profile(2), taken)).ranks[0]
    assert (chosen.node_id, chosen.gpu_indexes) == ("node02", (1, 2))
    # Inside one node: the joined pair, not the lowest indexes.
    chosen = only_placement(place([odd], profile(2))).ranks[0]
    assert chosen.gpu_indexes == (1, 2)


def test_without_nvlink_the_cards_of_one_numa_node_go_together() -> None:
    # gpus() puts cards 0,1 on NUMA 0 and 2,3 on NUMA 1.
    l40s = gpu_node("node01", 4, gpus=gpus(4, "l40s-45g"), nvlinks=())
    taken = Allocations(gpus={"node01": {0}})
    chosen = only_placement(place([l40s], profile(2, "l40s-45g"), taken)).ranks[0]
    assert chosen.gpu_indexes == (2, 3)


def test_weights_already_there_break_a_tie_but_never_beat_bin_packing() -> None:
    fleet = [gpu_node("node01"), gpu_node("node02", weights=frozenset({"llama-70b"}))]
    assert only_placement(place(fleet, profile(4))).node_ids == ("node02",)
    fuller = Allocations(gpus={"node01": {0}})
    assert only_placement(place(fleet, profile(4), fuller)).node_ids == ("node01",)


def test_cpu_replicas_spread_and_may_share() -> None:
    fleet = [
        NodeFacts("node01", "a", True),
        NodeFacts("node02", "b", True),
        NodeFacts("node03", "c", True, weights=frozenset({"llama-70b"})),
    ]
    cpu = profile(0, None)
    placer = Placer(fleet, Allocations(cpu_replicas={"node01": 1}))
    order = []
    for _ in range(5):
        p = only_placement(placer.place(cpu))
        assert p.ranks[0].gpu_indexes == () and p.fabric is None
        order.append(p.node_ids[0])
        placer.add(p)
    # node03 holds the weights: it wins the ties, never the spread.
    assert order == ["node03", "node02", "node03", "node01", "node02"]
    assert placer.allocations.cpu_replicas == {"node01": 2, "node02": 2, "node03": 2}


def test_unknown_is_never_a_reason_to_exclude() -> None:
    old_agent = gpu_node("node01", engines=None, memory_total_bytes=None, disk_free_bytes=None)
    wants = profile(8, min_memory_gb=512, weights_bytes=800 * GIB)
    assert only_placement(place([old_agent], wants)).node_ids == ("node01",)


def test_exactly_enough_memory_and_disk_is_enough() -> None:
    node = gpu_node("node01", memory_total_bytes=24 * GIB, disk_free_bytes=16 * GIB)
    wants = profile(1, min_memory_gb=24, weights_bytes=16 * GIB)
    assert only_placement(place([node], wants)).node_ids == ("node01",)


def test_disk_is_not_needed_for_weights_already_held() -> None:
    full_disk = gpu_node("node01", disk_free_bytes=GIB, weights=frozenset({"llama-70b"}))
    assert only_placement(place([full_disk], profile(1, weights_bytes=140 * GIB))).node_ids == (
        "node01",
    )


def test_unhealthy_cards_are_never_given() -> None:
    node = gpu_node("node01", 4, gpus=gpus(4, sick=(0, 2)))
    assert only_placement(place([node], profile(2))).ranks[0].gpu_indexes == (1, 3)
    assert (
        str(place([node], profile(3)))
        == "node01: 2 free healthy h100-80g cards, needs 3 (2 unhealthy)"
    )


# --- Groups over several nodes ----------------------------------------------------


def rail_node(
    nid: str, fabrics: tuple[tuple[str, tuple[str, ...], float | None], ...]
) -> NodeFacts:
    """8 cards on NVSwitch, a rail adapter next to each card (mlx5_g PIX to GPU g)."""
    nic = tuple((g, f"mlx5_{a}", "PIX" if a == g else "SYS") for g in range(8) for a in range(8))
    return gpu_node(nid, nic_distance=nic, fabrics=fabrics)


def test_a_group_shares_a_fabric_and_each_rank_gets_the_rails_next_to_its_cards() -> None:
    rails = tuple(f"mlx5_{a}" for a in range(8))
    fleet = [
        rail_node("node01", (("ib-a", rails, 400.0),)),
        rail_node("node02", (("ib-b", rails, 400.0),)),
        rail_node("node03", (("ib-a", rails[:4], 400.0), ("ib-b", rails[4:], 400.0))),
    ]
    taken = Allocations(gpus={"node01": {0, 1, 2, 3}, "node03": {0, 1, 2, 3}})
    result = only_placement(place(fleet, profile(4, nodes=2, fabric="ib-a"), taken))
    assert result.fabric == "ib-a"
    assert [(r.rank, r.node_id, r.gpu_indexes, r.fabric_adapters) for r in result.ranks] == [
        (0, "node01", (4, 5, 6, 7), ("mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7")),
        # On node03 only mlx5_0..3 are on ib-a, and all are as far from any card (SYS).
        (1, "node03", (4, 5, 6, 7), ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")),
    ]
    # Unnamed: ib-a leaves no card free on node01 and node03; ib-b would leave 4 on node02.
    result = only_placement(place(fleet, profile(4, nodes=2), taken))
    assert (result.fabric, result.node_ids) == ("ib-a", ("node01", "node03"))
    # Once node01 is busier, ib-b is the only fabric two nodes with 4 free cards share.
    busier = Allocations(gpus={"node01": {0, 1, 2, 3, 4}, "node03": {0, 1, 2, 3}})
    result = only_placement(place(fleet, profile(4, nodes=2), busier))
    assert (result.fabric, result.node_ids) == ("ib-b", ("node03", "node02"))
    assert result.ranks[0].fabric_adapters == ("mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7")
    # One card per rank: the card next to a rail of the fabric, and only that rail.
    result = only_placement(place(fleet, profile(1, nodes=2, fabric="ib-b"), taken))
    assert [(r.node_id, r.gpu_indexes, r.fabric_adapters) for r in result.ranks] == [
        ("node03", (4,), ("mlx5_4",)),
        ("node02", (0,), ("mlx5_0",)),
    ]


def test_a_group_refused_for_want_of_a_fabric() -> None:
    fleet = [
        rail_node("node01", (("ib-a", ("mlx5_0",), 400.0),)),
        rail_node("node02", (("ib-b", ("mlx5_0",), 400.0),)),
        rail_node("node03", ()),
    ]
    assert str(place(fleet, profile(8, nodes=2, fabric="ib-b"))) == "\n".join(
        [
            "ib-b: only 1 node with an ACTIVE port, needs 2",
            "node01, node03: no ACTIVE port on ib-b",
        ]
    )
    assert str(place(fleet, profile(8, nodes=2))) == "\n".join(
        [
            "ib-a: only 1 node with an ACTIVE port, needs 2",
            "ib-b: only 1 node with an ACTIVE port, needs 2",
            "node03: no fabric with an ACTIVE port",
        ]
    )
    taken = Allocations(gpus={"node02": {0}, "node03": {7}})
    assert str(place(fleet, profile(8, nodes=2), taken)) == "\n".join(
        [
            "only 1 node fits, needs 2",
            "node02, node03: 7 free healthy h100-80g cards, needs 8 (1 in use)",
        ]
    )


# --- Refusals ------------------------------------------------------------------------


def test_a_refusal_names_what_each_node_lacks() -> None:
    fleet = [
        gpu_node("node01", labels=(("zone", "eu"),), memory_total_bytes=8 * GIB),
        gpu_node("node02", labels=(("zone", "eu"),), engines=frozenset({"sglang"})),
        gpu_node("node03", labels=(("zone", "eu"),), cordoned=True),
        NodeFacts("node04", "d", ready=False, state="unreachable"),
        gpu_node("node05", labels=(("zone", "eu"),)),
        gpu_node("node06", labels=(("zone", "us"),)),
        gpu_node(
            "node07", labels=(("zone", "eu"),), disk_free_bytes=10 * GIB + 1, weights=frozenset()
        ),
        gpu_node("node08", labels=(("zone", "eu"),), gpus=None),
        gpu_node("node09", labels=(("zone", "eu"),), gpus=gpus(8, "a100-80g")),
        NodeFacts("node10", "j", ready=False),
    ]
    taken = Allocations(gpus={"node05": {0, 1, 2, 3, 4, 5}})
    wants = profile(4, min_memory_gb=24, node_selector=(("zone", "eu"),), weights_bytes=16 * GIB)
    result = place(fleet, wants, taken)
    assert isinstance(result, Refusal)
    assert str(result) == "\n".join(
        [
            "node05: 2 free healthy h100-80g cards, needs 4 (6 in use)",
            "node07: 10 GB free for weights, needs 16 GB",
            "node01: has 8 GB of memory, needs 24 GB",
            "node02: engine vllm not installed",
            "node08: GPUs unknown",
            "node09: has no h100-80g cards",
            "node06: labels do not match zone=eu",
            "node03: cordoned",
            "node04: not ready (unreachable)",
            "node10: not ready",
        ]
    )


def test_a_large_fleet_is_summarised() -> None:
    fleet = [gpu_node(f"node{i:03d}", cordoned=True) for i in range(100)]
    # 30 nodes each short of memory by a different amount, 100 cordoned.
    fleet += [gpu_node(f"mem{i:02d}", memory_total_bytes=i * GIB) for i in range(30)]
    result = place(fleet, profile(1, min_memory_gb=64))
    assert isinstance(result, Refusal)
    assert len(result.reasons) == 21
    assert result.reasons[:2] == (
        "mem00: has 0 GB of memory, needs 64 GB",
        "mem01: has 1 GB of memory, needs 64 GB",
    )
    assert result.reasons[19] == "mem19: has 19 GB of memory, needs 64 GB"
    # The cordoned line (one line for 100 nodes) is among the 10 lines left off.
    assert result.reasons[20] == "... and 110 more nodes"
    assert str(place(fleet[:100], profile(1))) == "node000, node001, node002 and 97 more: cordoned"
    assert str(place([], profile(1))) == "no nodes are registered"


def test_memory_and_disk_are_never_shown_as_enough_when_short() -> None:
    node = gpu_node("node01", memory_total_bytes=24 * GIB - 1, disk_free_bytes=16 * GIB - 1)
    assert (
        str(place([node], profile(1, min_memory_gb=24)))
        == "node01: has 23.9 GB of memory, needs 24 GB"
    )
    assert str(place([node], profile(1, weights_bytes=16 * GIB))) == (
        "node01: 15.9 GB free for weights, needs 16 GB"
    )
    # 15.95 free, 15.96 needed: rounded the same way both would read 16.
    node = gpu_node("node01", disk_free_bytes=int(15.95 * GIB))
    assert str(place([node], profile(1, weights_bytes=int(15.96 * GIB)))) == (
        "node01: 15.9 GB free for weights, needs 16 GB"
    )


def test_a_disk_refusal_names_the_weights_dir_when_the_node_said_it() -> None:
    short = gpu_node("node01", disk_free_bytes=12 * GIB, weights_dir="/var/lib/llmgw-weights")
    unsaid = gpu_node("node02", disk_free_bytes=12 * GIB)
    refused = place([short, unsaid], profile(1, weights_bytes=15 * GIB))
    assert isinstance(refused, Refusal)
    assert refused.reasons == (
        "node01: has 12 GB free on /var/lib/llmgw-weights, needs 15 GB",
        "node02: 12 GB free for weights, needs 15 GB",
    )
    # The holder is not refused, whatever its disk; and it is preferred to one with room.
    holder = attrs.evolve(short, weights=frozenset({"llama-70b"}))
    roomy = gpu_node("node00", disk_free_bytes=100 * GIB, weights_dir="/w")
    assert only_placement(place([roomy, holder], profile(1, weights_bytes=15 * GIB))).node_ids == (
        "node01",
    )


# --- The Placer and the values ---------------------------------------------------------


def test_placer_records_gives_back_and_refuses_double_allocation() -> None:
    fleet = [gpu_node("node01", 4), gpu_node("node02", 4)]
    placer = Placer(fleet, Allocations(gpus={"gone": {0}}))
    first = only_placement(placer.place(profile(2)))
    placer.add(first)
    with pytest.raises(ValueError, match=r"node01: cards \[0, 1\] are already allocated"):
        placer.add(first)
    second = only_placement(placer.place(profile(2)))
    assert (first.node_ids, second.node_ids) == (("node01",), ("node01",))
    assert second.ranks[0].gpu_indexes == (2, 3)
    placer.add(second)
    assert placer.allocations == Allocations(gpus={"gone": {0}, "node01": {0, 1, 2, 3}})
    assert placer.allocations == Allocations(gpus={"gone": {0}}).add(first).add(second)
    placer.remove(first)
    assert placer.allocations == Allocations(gpus={"gone": {0}, "node01": {2, 3}})
    assert placer.place(profile(2)) == first
    assert repr(placer) == "<Placer nodes=2 usable=2 allocated_gpus=3 cpu_replicas=0>"
    assert Allocations().add(first).remove(first) == Allocations()


def test_values_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="a CPU profile takes 0 GPUs per node, not 2"):
        PlacementProfile("m", "vllm", None, 2)
    with pytest.raises(ValueError, match="a h100-80g profile needs at least 1 GPU per node"):
        PlacementProfile("m", "vllm", "h100-80g", 0)
    with pytest.raises(ValueError, match="at least 1 node, not 0"):
        PlacementProfile("m", "vllm", "h100-80g", 1, nodes=0)
    with pytest.raises(ValueError, match="node node01 appears twice"):
        Placer([gpu_node("node01"), gpu_node("node01")])
    assert Allocations(gpus={"a": set(), "b": {1}}, cpu_replicas={"a": 0}) == Allocations(
        gpus={"b": frozenset({1})}
    )
