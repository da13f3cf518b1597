"""Benchmark: what an hour of history costs the control plane (not a test).

Builds llmgw.cp._observe._history.History for `--nodes` nodes (5,000 by default), each
with `--gpus` GPUs (8), 2 filesystems and 2 shards, and writes an hour and a
bit of heartbeats into it (a sample every `--interval-s` seconds, 5 by
default, on an injected clock: no sleeping), so that every ring has wrapped.
Prints:

1. bytes per node by `History.nbytes` (sys.getsizeof, deep) and the total;
2. tracemalloc's figure: what the allocator holds for the history after the
   first two heartbeats (every allocation happens at a node's first sample;
   the hour then runs without tracemalloc, which slows it tenfold, and the
   nbytes total after it shows that nothing grew);
3. the time one heartbeat's record() takes, and one node's view() (the API's
   rendering).

    .venv/bin/python bench/history.py [--nodes 5000] [--gpus 8] [--interval-s 5]
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

from llmgw import model
from llmgw.cp._observe._history import NODE_BYTES_BOUND, SPAN_S, History


def usage(i: int, step: int, gpus: int) -> model.Usage:
    return model.Usage(
        memory_total_bytes=512 << 30,
        memory_available_bytes=(256 << 30) + step,
        load1=1.0 + i % 7,
        load5=2.0,
        load15=3.0,
        cpu_util_pct=float(step % 100),
        gpus=tuple(
            model.GpuUsage(index=g, memory_used_mib=40000 + step % 100, utilization_pct=50.0)
            for g in range(gpus)
        ),
        filesystems=(
            model.Filesystem("/", "ext4", ("/",), 1 << 40, (1 << 39) + step, False),
            model.Filesystem("/weights", "nfs", ("/weights",), 1 << 44, 1 << 43, True),
        ),
        shards=(
            model.ShardUsage("s1", cpu_cores=2.5, rss_bytes=8 << 30),
            model.ShardUsage("s2", cpu_cores=1.0, rss_bytes=4 << 30),
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--interval-s", type=float, default=5.0)
    args = parser.parse_args()

    now = [0.0]
    reports = tuple(
        model.ShardReport(sid, "m", "vllm", "ready", replica_id=f"r-{sid}", model_name="m")
        for sid in ("s1", "s2")
    )
    nodes = [f"node-{i:05d}" for i in range(args.nodes)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    history = History(clock=lambda: now[0], wall=lambda: 1.7e9 + now[0])
    steps = int((SPAN_S + 600) / args.interval_s)

    def beat(step: int) -> None:
        now[0] = step * args.interval_s
        u = usage(0, step, args.gpus)  # one per step, shared by the nodes: we measure the history
        for node in nodes:
            history.record(node, u, reports)

    # Every allocation happens at a node's first sample (the rings are fixed-size);
    # tracemalloc (slow: ~10x) watches the first two heartbeats, then the hour runs
    # without it and nbytes shows that nothing grew.
    beat(0)
    beat(1)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    first = sum(history.nbytes(n) for n in nodes)
    t0 = time.perf_counter()
    for step in range(2, steps):
        beat(step)
    elapsed = time.perf_counter() - t0
    gc.collect()

    per_node = history.nbytes(nodes[0])
    total = sum(history.nbytes(n) for n in nodes)
    samples = (steps - 2) * len(nodes)
    views = []
    for node in nodes[:20]:
        t1 = time.perf_counter()
        view = history.view(node)
        views.append(time.perf_counter() - t1)
        assert view is not None
    view_s = sorted(views)[len(views) // 2]
    print(
        f"{len(nodes)} nodes x {args.gpus} GPUs, 2 filesystems, 2 shards; "
        f"{history.buckets} buckets of {history.resolution_s:g} s"
    )
    print(f"series per node: {history.statistics()['series'] // len(nodes)}")
    print(f"bytes per node (nbytes): {per_node:,} (documented bound {NODE_BYTES_BOUND:,})")
    print(f"total (nbytes): {total:,} bytes = {total / 2**20:.1f} MiB after {steps} heartbeats "
          f"({steps * args.interval_s / 3600:.2f} h), {first:,} after the first two")  # fmt: skip
    print(
        f"tracemalloc: {traced:,} bytes = {traced / 2**20:.1f} MiB "
        f"({traced / len(nodes):,.0f} a node)"
    )
    print(f"record(): {elapsed / samples * 1e6:.1f} us a heartbeat ({samples:,} samples)")
    print(f"view(): {view_s * 1e3:.1f} ms for one node (median of 20; max {max(views) * 1e3:.1f})")


if __name__ == "__main__":
    main()
