"""Time to place replica after replica on a large fleet, allocations updated each time.

Builds a seeded random fleet (8x h100-80g on NVSwitch with a rail NIC per card,
8x a100-80g, 4x l40s-45g without NVLink, CPU nodes; some cordoned, unreachable
or without GPU facts; a few unhealthy cards; fabrics), then places a mix of
profiles (1, 2, 4 and 8 GPUs, 2-node groups on a fabric, CPU replicas, and a
few that cannot fit) one after another with `Placer`, recording each placement.
Prints the time for indexing the fleet and for the placements, and how many
were placed and refused. Run: `.venv/bin/python bench/placement.py [--nodes N]
[--replicas N] [--seed N]`.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time

from llmgw.core._placement import (
    GIB,
    GpuFacts,
    NodeFacts,
    Placement,
    PlacementProfile,
    Placer,
    Refusal,
    place,
)

KINDS = [  # (weight, class, cards, NVLinks per pair, rail NICs)
    (30, "h100-80g", 8, 18, True),
    (25, "a100-80g", 8, 12, False),
    (25, "l40s-45g", 4, 0, False),
    (20, None, 0, 0, False),
]
FABRICS = {"h100-80g": ["ib-a", "ib-b"], "a100-80g": ["ib-c"], "l40s-45g": ["roce"]}
ENGINES = ["vllm", "sglang", "llama-server"]
MODELS = ["llama-8b", "llama-70b", "llama-405b", "qwen-32b", "mistral-7b"]


def node(i: int, rng: random.Random) -> NodeFacts:
    (_, cls, count, links, rails) = rng.choices(KINDS, weights=[k[0] for k in KINDS])[0]
    nid = f"node{i:05d}"
    gpus: tuple[GpuFacts, ...] | None = tuple(
        GpuFacts(g, f"GPU-{i:05d}-{g}", cls, rng.random() > 0.01, g * 2 // max(count, 1))
        for g in range(count)
    )
    if cls is not None and rng.random() < 0.01:
        gpus = None  # an agent that could not tell
    nvlinks = tuple((a, b, links) for a in range(count) for b in range(a + 1, count) if links)
    adapters = tuple(f"mlx5_{g}" for g in range(8 if rails else 2))
    nic = tuple(
        (g, a, "PIX" if rails and a == f"mlx5_{g}" else rng.choice(["NODE", "SYS"]))
        for g in range(count)
        for a in adapters
    )
    fabrics: tuple[tuple[str, tuple[str, ...], float | None], ...] = ()
    if cls is not None and rng.random() < 0.9:
        fabrics = ((rng.choice(FABRICS[cls]), adapters, 400.0),)
    roll = rng.random()
    return NodeFacts(
        node_id=nid,
        address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
        ready=roll > 0.03,
        cordoned=0.03 < roll < 0.06,
        state="unreachable" if roll <= 0.03 else None,
        labels=(("zone", rng.choice(["eu", "us"])),),
        engines=None if rng.random() < 0.1 else frozenset(rng.sample(ENGINES, rng.randint(1, 3))),
        gpus=gpus,
        nvlinks=nvlinks,
        nic_distance=nic,
        memory_total_bytes=rng.choice([256, 512, 1024, 2048]) * GIB,
        disk_free_bytes=rng.choice([None, 100 * GIB, 500 * GIB, 2000 * GIB]),
        weights=frozenset(m for m in MODELS if rng.random() < 0.05),
        fabrics=fabrics,
    )


PROFILES = [  # (weight, profile)
    (20, PlacementProfile("llama-8b", "vllm", "l40s-45g", 1, weights_bytes=16 * GIB)),
    (10, PlacementProfile("mistral-7b", "vllm", "a100-80g", 1, weights_bytes=15 * GIB)),
    (10, PlacementProfile("qwen-32b", "vllm", "h100-80g", 2, weights_bytes=65 * GIB)),
    (10, PlacementProfile("qwen-32b", "sglang", "l40s-45g", 4, min_memory_gb=400)),
    (12, PlacementProfile("llama-70b", "vllm", "h100-80g", 4, weights_bytes=140 * GIB)),
    (
        8,
        PlacementProfile("llama-70b", "sglang", "a100-80g", 4, node_selector=(("zone", "eu"),)),
    ),
    (8, PlacementProfile("llama-405b", "vllm", "h100-80g", 8, weights_bytes=800 * GIB)),
    (3, PlacementProfile("llama-405b", "vllm", "h100-80g", 8, nodes=2, fabric="ib-a")),
    (2, PlacementProfile("llama-405b", "sglang", "a100-80g", 8, nodes=2)),
    (15, PlacementProfile("mistral-7b", "llama-server", None, 0, min_memory_gb=64)),
    (1, PlacementProfile("llama-8b", "vllm", "h100-80g", 1, node_selector=(("zone", "mars"),))),
    (1, PlacementProfile("llama-405b", "vllm", "l40s-45g", 8)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    fleet = [node(i, rng) for i in range(args.nodes)]
    weights = [w for w, _ in PROFILES]
    wanted = [rng.choices(PROFILES, weights=weights)[0][1] for _ in range(args.replicas)]

    start = time.perf_counter()
    placer = Placer(fleet)
    indexed = time.perf_counter()
    placed = refused = 0
    slowest = 0.0
    last_refusal: Refusal | None = None
    for profile in wanted:
        t0 = time.perf_counter()
        result = placer.place(profile)
        if isinstance(result, Placement):
            placer.add(result)
            placed += 1
        else:
            refused += 1
            last_refusal = result
        slowest = max(slowest, time.perf_counter() - t0)
    done = time.perf_counter()

    t0 = time.perf_counter()
    place(fleet, wanted[0], placer.allocations)
    single = time.perf_counter() - t0

    print(f"python {platform.python_version()} on {platform.machine()}, {sys.platform}")
    print(
        f"fleet: {args.nodes} nodes; replicas asked: {args.replicas}"
        f" ({len({p for p in wanted})} profiles)"
    )
    print(f"index the fleet:     {(indexed - start) * 1e3:8.1f} ms")
    print(
        f"place {args.replicas} replicas: {(done - indexed) * 1e3:8.1f} ms"
        f" ({(done - indexed) / args.replicas * 1e6:.0f} us each, slowest"
        f" {slowest * 1e3:.1f} ms)"
    )
    print(f"total:               {(done - start) * 1e3:8.1f} ms")
    print(f"placed {placed}, refused {refused}")
    print(f"one pure place() call (indexing included): {single * 1e3:.1f} ms")
    if last_refusal is not None:
        print("last refusal:")
        print("  " + str(last_refusal).replace("\n", "\n  "))


if __name__ == "__main__":
    main()
