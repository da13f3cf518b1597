"""Values that repeat across nodes' inventories are kept once (llmgw/cp/_fleet/_shared.py)."""

from __future__ import annotations

import gc
import pickle
import tracemalloc
from pathlib import Path

import trio
from helpers import register
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import core, model
from llmgw.agent.discovery import parse_topo
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._shared import SharedValues

DATA = Path(__file__).resolve().parents[1] / "data"
TOPO = (DATA / "topo-h100sxm-8gpu-nv18-8nics-niclegend-gpunumaid-drv570.txt").read_text()
FLAGS = ("avx", "avx2", "avx512f", "avx512_bf16", "sse4_2", "fma")


def h100_node(node: str) -> model.Inventory:
    """An 8xH100 node as the agent reports it: the recorded topology, its own card ids."""
    topology = parse_topo(TOPO).topology
    gpus = tuple(
        model.Gpu(
            index=i,
            uuid=f"GPU-{node}-{i}",
            name="NVIDIA H100 80GB HBM3",
            gpu_class="h100-80g",
            pci_bus_id=f"00000000:{i:02x}:00.0",
            memory_total_mib=81559,
            compute_capability="9.0",
            cpu_affinity="0-47,96-143",
        )
        for i in range(8)
    )
    host = model.Host(hostname=node, os_id="ubuntu", cpu_flags=FLAGS)
    inventory = model.Inventory(host=host, gpus=gpus, topology=topology)
    return pickle.loads(pickle.dumps(inventory))  # new objects, as a decoded registration's


def test_equal_parts_of_two_nodes_are_one_object() -> None:
    shared = SharedValues()
    a, b = shared(h100_node("a")), shared(h100_node("b"))
    assert a == h100_node("a") and b == h100_node("b")
    assert a.topology is b.topology
    assert a.host.cpu_flags is b.host.cpu_flags
    assert a.gpus is not None and b.gpus is not None
    assert a.gpus[3].name is b.gpus[5].name
    # A node's own values stay its own.
    assert a.host.hostname == "a" and b.gpus[0].uuid == "GPU-b-0"


def test_a_node_of_a_known_kind_costs_a_fifth_of_its_inventory() -> None:
    shared = SharedValues()
    shared(h100_node("first"))

    def snapshot() -> tracemalloc.Snapshot:
        # What is live, not what the collector has yet to free (building a node leaves
        # cyclic garbage).
        gc.collect()
        return tracemalloc.take_snapshot()

    def grown(since: tracemalloc.Snapshot, to: tracemalloc.Snapshot) -> int:
        return sum(d.size_diff for d in to.compare_to(since, "filename"))

    # Three rounds, the least of each kind kept: the interpreter's own tables grow by
    # doubling, one block at a time, wherever the process happens to be (the interned
    # strings' dict once grew by 1.8 MB inside a round: 79 KB a node kept against 15
    # plain), and such a growth lands in one round at most.
    plain_bytes, kept_bytes = [], []
    for r in range(3):
        tracemalloc.start()
        try:
            before = snapshot()
            plain = [h100_node(f"p{r}-{i}") for i in range(50)]
            middle = snapshot()
            kept = [shared(h100_node(f"s{r}-{i}")) for i in range(50)]
            after = snapshot()
        finally:
            tracemalloc.stop()
        assert len(plain) == len(kept) == 50
        plain_bytes.append(grown(before, middle))
        kept_bytes.append(grown(middle, after))
        del plain, kept
    assert min(kept_bytes) < min(plain_bytes) / 5, (plain_bytes, kept_bytes)


async def test_registrations_through_the_registry_share_the_topology() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=trio.current_time)
    await register(registry, "a", inventory=h100_node("a"))
    await register(registry, "b", inventory=h100_node("b"))
    a, b = (rec.inventory for rec in sorted(registry.records(), key=lambda r: r.node_id))
    assert a.topology is b.topology
    assert a.host.hostname == "a" and b.host.hostname == "b"
    assert registry.shared.hits > 0


names = st.sampled_from(["mlx5_0", "mlx5_1", "PIX", "SYS", "NODE", "h100-80g", "x" * 300])
links = st.builds(model.NvLink, st.integers(0, 3), st.integers(0, 3), st.integers(1, 18))
distances = st.builds(model.NicDistance, st.integers(0, 3), names, names)
topologies = st.builds(
    model.Topology,
    st.lists(links, max_size=4).map(tuple),
    st.lists(distances, max_size=4).map(tuple),
)
hosts = st.builds(model.Host, names, cpu_flags=st.lists(names, max_size=3).map(tuple))
inventories = st.builds(
    model.Inventory, hosts, topology=st.none() | topologies, warnings=st.lists(names).map(tuple)
)


@settings(max_examples=200, deadline=None)
@given(st.lists(inventories, min_size=1, max_size=6), st.integers(1, 8))
def test_sharing_never_changes_a_value_and_stays_bounded(
    values: list[model.Inventory], bound: int
) -> None:
    shared = SharedValues(max_entries=bound)
    out = [shared(v) for v in values]
    assert out == values
    assert len(shared) <= bound
    # Once a value is kept, an equal one is that object (while there was room for it).
    again = [shared(pickle.loads(pickle.dumps(v))) for v in values]
    assert again == values
    for first, second in zip(out, again, strict=True):
        if first.topology is not None and first.topology in shared._table:
            assert second.topology is first.topology
