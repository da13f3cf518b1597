"""Sharing cards: how many cards a mixed catalog takes, shared against whole cards.

The fleet is built from the recorded inventories bench/fleet.py uses: an 8x H100
80GB node and an 8x H200 node, each taken by the agent's own discovery over
recorded outputs in tests/data/ (bench/fleet_node.py: "NVIDIA H100 80GB HBM3",
81559 MiB; "NVIDIA H200", 143771 MiB), turned into placement facts the way the
control plane does (`core.node_facts`, with each card's memory total and the
memory others hold on it from the same inventory and sample), then copied to
`--nodes` nodes with their own names and card uuids: half H100, half H200, and
one node in ten an H100 with MIG enabled on every card in the layout recorded in
tests/data/smi-h100-mig-enabled-4migdevs-processes-drv590.txt (3g.40gb,
2g.20gb, 2x 1g.10gb per card, the sizes read from that table).

The catalog is 40 models of 1B to 70B parameters: a replica's memory is its
parameters times bytes per parameter (bf16 2, fp8 1) plus KV cache headroom
(a quarter of the weights, at least 2 GiB). A replica that fits one card less
`SHARED_HEADROOM_MIB` takes that share of one card; a larger one a share on 2 or
4 cards (tensor parallel); the smallest seven run on a MIG instance of the
smallest profile that holds them. The whole-card placement of the same
replicas takes, per replica, the power-of-two number of whole cards that holds
it (a MIG-sized one: one whole card).

Each node carries a label `rack` (ten nodes a rack); the last figure places up
to 100 one-card shares held to one rack by a node_selector, the case where the
sorted lists hold mostly cards that are not eligible.

`--replicas` replicas (default 1,000) are drawn from the catalog (popular
small models more often; seeded), placed one after another with `Placer` and
recorded, once shared and once whole. It prints the cards each used and their
ratio (goal <= 60 %), and the time to place the shared replicas (goal
< 0.2 s for 1,000 on 5,000 nodes; indexing the fleet, linear in its size, is
printed apart), each goal marked met or not. Run:
`.venv/bin/python bench/packing.py [--nodes 5000] [--replicas 1000] [--seed 1]`.
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import attrs
import fleet_node  # bench/fleet_node.py (the script's folder is on the path)

from llmgw import core, model

GIB_MIB = 1024
MIG_RECORDING = fleet_node.DATA / "smi-h100-mig-enabled-4migdevs-processes-drv590.txt"
# An H100 80GB's MIG profiles by the memory its instances report (the recording's sizes).
MIG_PROFILE_BY_MIB = {9984: "1g.10gb", 20096: "2g.20gb", 40448: "3g.40gb"}
GOAL_RATIO = 0.60
GOAL_SECONDS = 0.2
RACK = 10  # nodes per rack label: a node_selector on one rack picks 10 nodes

# (name, billions of parameters, bytes per parameter, popularity weight)
CATALOG = [
    ("llama-3.2-1b", 1.2, 2, 30),
    ("qwen2.5-1.5b", 1.5, 2, 25),
    ("gemma-2-2b", 2.6, 2, 20),
    ("llama-3.2-3b", 3.2, 2, 30),
    ("qwen2.5-3b", 3.1, 2, 15),
    ("phi-3.5-mini", 3.8, 2, 15),
    ("phi-4-mini", 3.8, 2, 10),
    ("qwen2.5-7b", 7.6, 2, 30),
    ("mistral-7b", 7.2, 2, 25),
    ("llama-3.1-8b", 8.0, 2, 40),
    ("llama-3.1-8b-fp8", 8.0, 1, 20),
    ("granite-3.1-8b", 8.2, 2, 10),
    ("gemma-2-9b", 9.2, 2, 15),
    ("glm-4-9b", 9.4, 2, 8),
    ("yi-1.5-9b", 8.8, 2, 5),
    ("mistral-nemo-12b", 12.2, 2, 15),
    ("gemma-3-12b", 12.2, 2, 12),
    ("phi-4-14b", 14.7, 2, 15),
    ("qwen2.5-14b", 14.8, 2, 15),
    ("qwen2.5-14b-fp8", 14.8, 1, 8),
    ("starcoder2-15b", 16.0, 2, 6),
    ("deepseek-v2-lite-16b", 15.7, 2, 6),
    ("mistral-small-22b", 22.2, 2, 10),
    ("codestral-22b", 22.2, 2, 8),
    ("mistral-small-24b", 23.6, 2, 12),
    ("gemma-2-27b", 27.2, 2, 8),
    ("gemma-3-27b", 27.4, 2, 10),
    ("qwen2.5-32b", 32.8, 2, 15),
    ("qwen2.5-32b-fp8", 32.8, 1, 10),
    ("qwq-32b", 32.8, 2, 8),
    ("deepseek-r1-distill-32b", 32.8, 2, 8),
    ("yi-1.5-34b", 34.4, 2, 4),
    ("command-r-35b", 35.0, 2, 4),
    ("mixtral-8x7b", 46.7, 2, 6),
    ("llama-3.3-70b", 70.6, 2, 20),
    ("llama-3.3-70b-fp8", 70.6, 1, 15),
    ("qwen2.5-72b", 72.7, 2, 10),
    ("qwen2.5-72b-fp8", 72.7, 1, 6),
    ("deepseek-r1-distill-70b", 70.6, 2, 6),
    ("llama-3.1-70b", 70.6, 2, 8),
]
MIG_MODELS = 7  # the smallest: each on one MIG instance


@attrs.frozen
class Report:
    """What `core.node_facts` reads of a node's registry record."""

    node_id: str
    host: str
    inventory: model.Inventory
    liveness: core.Liveness = attrs.field(factory=lambda: core.registered(0.0))
    shards: tuple[model.ShardReport, ...] = ()


def recorded_mig() -> tuple[str, ...]:
    """The MIG instances' profiles of the recorded MIG-enabled H100, by their sizes."""
    sizes = re.findall(
        r"^\|\s+0\s+\d+\s+\d+\s+\d+\s+\|\s+\d+MiB /\s+(\d+)MiB", MIG_RECORDING.read_text(), re.M
    )
    if not sizes:
        raise SystemExit(f"packing bench: no MIG devices read from {MIG_RECORDING}")
    return tuple(MIG_PROFILE_BY_MIB[int(s)] for s in sizes)


def templates() -> dict[str, core.NodeFacts]:
    """Placement facts of one recorded node of each kind, with each card's memory."""
    out = {}
    with tempfile.TemporaryDirectory() as work:
        for kind in ("h100", "h200"):
            inventory, usage = fleet_node.take(Path(work), kind)
            inventory = attrs.evolve(inventory, usage=usage)
            facts = core.node_facts(Report(f"bench-{kind}", "10.0.0.1", inventory))
            by_index = {g.index: g for g in inventory.gpus or ()}
            foreign = {u.index: u.foreign_memory_mib for u in usage.gpus}
            gpus = tuple(
                attrs.evolve(
                    g,
                    memory_total_mib=by_index[g.index].memory_total_mib,
                    foreign_mib=foreign.get(g.index),
                )
                for g in facts.gpus or ()
            )
            out[kind] = attrs.evolve(facts, gpus=gpus)
    return out


def fleet(n: int, kinds: dict[str, core.NodeFacts], rng: random.Random) -> list[core.NodeFacts]:
    layout = recorded_mig()
    nodes = []
    for i in range(n):
        kind = "h100" if i % 2 == 0 else "h200"
        mig = kind == "h100" and rng.random() < 0.2  # one node in ten of the fleet
        nid = f"node{i:05d}"
        gpus = tuple(
            attrs.evolve(
                g,
                uuid=f"GPU-{i:05d}-{g.index}",
                mig_enabled=mig,
                mig=tuple(
                    core.MigFacts(f"MIG-{i:05d}-{g.index}-{j}", p, None)
                    for j, p in enumerate(layout)
                )
                if mig
                else (),
            )
            for g in kinds[kind].gpus or ()
        )
        address = f"10.{i // 256}.{i % 256}.1"
        labels = (("rack", f"r{i // RACK}"),)
        nodes.append(
            attrs.evolve(kinds[kind], node_id=nid, address=address, gpus=gpus, labels=labels)
        )
    return nodes


def replica_mib(billions: float, per_param: int) -> int:
    weights = billions * 1e9 * per_param / 2**20
    return math.ceil(weights + max(weights / 4, 2 * GIB_MIB))


def profiles(
    card_mib: int, cls: str
) -> list[tuple[core.PlacementProfile, core.PlacementProfile, int]]:
    """(shared, whole, weight) per catalog model on cards of `cls`."""
    fit = card_mib - core.SHARED_HEADROOM_MIB
    mig_sizes = sorted((mib, p) for mib, p in MIG_PROFILE_BY_MIB.items())
    out = []
    for rank, (name, billions, per_param, weight) in enumerate(
        sorted(CATALOG, key=lambda m: m[1] * m[2])
    ):
        need = replica_mib(billions, per_param)
        whole_k = 1
        while whole_k * card_mib < need:
            whole_k *= 2
        whole = core.PlacementProfile(name, "vllm", cls, whole_k)
        if rank < MIG_MODELS and cls.startswith("h100"):
            mig = next(p for mib, p in mig_sizes if mib >= need)
            shared = core.PlacementProfile(name, "vllm", cls, 1, mig=mig)
        else:
            k = 1
            while math.ceil(need / k) > fit:
                k *= 2
            shared = core.PlacementProfile(name, "vllm", cls, k, gpu_memory_mib=math.ceil(need / k))
        out.append((shared, whole, weight))
    return out


def cards_used(placer: core.Placer) -> int:
    a = placer.allocations
    whole = sum(len(c) for c in a.gpus.values())
    shared = sum(len(c) for c in a.claims.values())
    mig_cards = {(n, u.rsplit("-", 1)[0]) for n, us in a.mig.items() for u in us}
    return whole + shared + len(mig_cards)


def over_committed(placer: core.Placer, nodes: list[core.NodeFacts]) -> int:
    """Cards whose claims exceed what they offer shares (the bench checks it is 0)."""
    total = {(n.node_id, g.index): g for n in nodes for g in n.gpus or ()}
    bad = 0
    for nid, per in placer.allocations.claims.items():
        for i, mib in per.items():
            g = total[nid, i]
            room = (g.memory_total_mib or 0) - (g.foreign_mib or 0) - core.SHARED_HEADROOM_MIB
            bad += mib > room
    return bad


@attrs.frozen
class Run:
    placer: core.Placer
    refused: int
    index_s: float  # Placer(fleet)
    first_s: float  # the first placement: a shared one also builds the index of shares
    rest_s: float  # every other placement


def run(fleet_: list[core.NodeFacts], wanted: list[core.PlacementProfile]) -> Run:
    t0 = time.perf_counter()
    placer = core.Placer(fleet_)
    t1 = time.perf_counter()
    refused = 0
    first = t1
    for p in wanted:
        got = placer.place(p)
        if isinstance(got, core.Placement):
            placer.add(got)
        else:
            refused += 1
        if first == t1:
            first = time.perf_counter()
    return Run(placer, refused, t1 - t0, first - t1, time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = templates()
    nodes = fleet(args.nodes, kinds, rng)
    per_class = []
    for kind in ("h100", "h200"):
        g = (kinds[kind].gpus or ())[0]
        assert g.memory_total_mib is not None
        per_class += profiles(g.memory_total_mib, g.gpu_class)
    picks = rng.choices(per_class, weights=[w for _, _, w in per_class], k=args.replicas)
    shared = run(nodes, [s for s, _, _ in picks])
    whole = run(nodes, [w for _, w, _ in picks])
    one_rack = [
        attrs.evolve(s, node_selector=(("rack", "r7"),))
        for s, _, _ in picks[:100]
        if s.mig is None and s.gpus_per_node == 1
    ]
    rack = run(nodes, one_rack)
    shared_cards, whole_cards = cards_used(shared.placer), cards_used(whole.placer)
    ratio = shared_cards / whole_cards if whole_cards else math.nan
    mig_nodes = sum(1 for n in nodes if any(g.mig_enabled for g in n.gpus or ()))
    on_mig = sum(1 for s, _, _ in picks if s.mig is not None)

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print(f"python {platform.python_version()} on {platform.machine()}, {sys.platform}")
    print(
        f"fleet: {args.nodes} nodes from the recorded H100 80GB and H200 inventories"
        f" ({mig_nodes} H100 nodes MIG-enabled);"
        f" replicas: {args.replicas} of {len(CATALOG)} models ({on_mig} on MIG instances)"
    )
    print(
        f"whole cards: {whole_cards} cards used, {whole.refused} refused,"
        f" placed in {(whole.first_s + whole.rest_s) * 1e3:.1f} ms"
    )
    print(
        f"shared:      {shared_cards} cards used, {shared.refused} refused,"
        f" {over_committed(shared.placer, nodes)} cards over-committed"
    )
    print(
        f"cards used, shared against whole: {ratio:.1%}"
        f" (goal <= {GOAL_RATIO:.0%}: {mark(ratio <= GOAL_RATIO)})"
    )
    placing = shared.first_s + shared.rest_s
    print(f"index the fleet (Placer): {shared.index_s * 1e3:.1f} ms")
    print(
        f"place {args.replicas} shared replicas: {placing * 1e3:.1f} ms, of which the first"
        f" {shared.first_s * 1e3:.1f} ms (it indexes every card for shares); the other"
        f" {args.replicas - 1}: {shared.rest_s * 1e3:.1f} ms"
        f" ({shared.rest_s / max(args.replicas - 1, 1) * 1e6:.0f} us each)"
    )
    print(
        f"goal < {GOAL_SECONDS * 1e3:.0f} ms for 1,000 on 5,000 nodes, the index of shares"
        f" included: {mark(placing < GOAL_SECONDS)}"
    )
    print(
        f"place {len(one_rack)} one-card shares held to one rack ({RACK} nodes) by a"
        f" node_selector: {(rack.first_s + rack.rest_s) * 1e3:.1f} ms"
        f" ({rack.refused} refused)"
    )


if __name__ == "__main__":
    main()
