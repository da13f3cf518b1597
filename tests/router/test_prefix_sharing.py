"""Prefix sharing between router workers, router-only mode: real processes on loopback.

Two fake engines with a prompt cache (LLMGW_FAKE_PREFIX_CACHE_TOKENS) behind
`llmgw-router` with `workers: 2`. Each system prompt's first request goes through a
connection the kernel gave worker A, its sibling through one it gave worker B. With
sharing, B's index learns where A sent each prompt (the relay in the supervisor), so
every sibling lands where its prompt is cached; with `prefix_sharing: false`, B's
index holds nothing and the siblings go where B's own choice puts them.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from helpers import ask_with_system, index_blocks, one_client_per_worker, start_router

from llmgw.testing.cluster import free_port, wait_for
from router.conftest import FakeEngine
from router.test_workers import _two_free_ports

KEY = "llmgw-prefix-sharing-key"
PROMPTS = 12  # without sharing, all 12 siblings home by chance: about 1 in 4,000
_SHARED = re.compile(r'^llmgw_router_prefix_shared_facts_total\{outcome="(\w+)"\}\s+(\S+)', re.M)
_HEALTHY = re.compile(r"^llmgw_router_endpoint_healthy\{[^}]*\}\s+(\S+)", re.M)


def system_prompt(i: int) -> str:
    rng = random.Random(i)
    return f"system {i}: " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(200))


def shared_facts(mport: int) -> dict[str, str]:
    """A worker's llmgw_router_prefix_shared_facts_total, by outcome (its /metrics)."""
    return dict(_SHARED.findall(httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text))


def healthy(mport: int) -> int:
    """Endpoints a worker reads as healthy (its /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
    return sum(float(v) == 1.0 for v in _HEALTHY.findall(text))


@pytest.mark.parametrize("sharing", [True, False])
def test_siblings_through_the_other_worker_land_where_the_prompt_is_cached(
    tmp_path: Path, start_engine: Callable[..., FakeEngine], sharing: bool
) -> None:
    env = {"LLMGW_FAKE_PREFIX_CACHE_TOKENS": "1000000", "LLMGW_FAKE_TOKENS": "2"}
    engines = [start_engine("chat", env=env), start_engine("chat", env=env)]
    port, mport = free_port(), _two_free_ports()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        json.dumps(
            {
                "listen": f"127.0.0.1:{port}",
                "metrics_listen": f"127.0.0.1:{mport}",
                "endpoints": [
                    {"model": "chat", "engine": "vllm", "url": f"http://127.0.0.1:{e.port}"}
                    for e in engines
                ],
                "keys": [{"key": KEY, "tenant": "t"}],
                "workers": 2,
                "scrape_interval_s": 0.2,
                "prefix_sharing": sharing,
            }
        )
    )
    log = tmp_path / "router.log"
    proc = start_router(cfg, log)
    clients: list[tuple[int, httpx.Client]] = []
    try:
        wait_for(
            "both workers listening",
            lambda: (
                len(re.findall(r"router listening on .* \(worker \d of 2", log.read_text())) == 2
            ),
            20,
            0.05,
        )
        wait_for(
            "both engines healthy in both workers",
            lambda: all(healthy(mport + i) == 2 for i in (0, 1)),
            20,
            0.1,
        )
        clients = list(one_client_per_worker(f"http://127.0.0.1:{port}", KEY).items())
        (a, first), (b, second) = clients
        systems = [system_prompt(i) for i in range(PROMPTS)]
        for i, system in enumerate(systems):
            worker, cached = ask_with_system(first, "chat", system, f"first question {i}")
            assert (worker, cached) == (a, 0)  # a new prompt: nothing cached anywhere
        held_by_a = index_blocks(f"http://127.0.0.1:{mport + a}/metrics")
        assert held_by_a > 0
        if sharing:
            # The relay brought what A's index learned to B, which sent nothing yet.
            wait_for(
                "B's index holds A's chains",
                lambda: index_blocks(f"http://127.0.0.1:{mport + b}/metrics") == held_by_a,
                10,
            )
        else:
            time.sleep(0.5)  # the relay's tick is 50 ms: nothing may come in ten of them
            assert index_blocks(f"http://127.0.0.1:{mport + b}/metrics") == 0
        if sharing:
            # Every end A told has reached B (a request of A's still counted in flight
            # at an endpoint would rightly weigh against it): no fact for 0.3 s.
            def quiet() -> bool:
                before = [shared_facts(mport + w) for w in (a, b)]
                time.sleep(0.3)
                return before == [shared_facts(mport + w) for w in (a, b)]

            wait_for("the relay quiet", quiet, 10)
        # The siblings through B, in an order of their own (a rotation or a draw on B
        # that happened to match A's choices would not be affinity).
        order = list(range(PROMPTS))
        random.Random(7).shuffle(order)
        hits = 0
        for i in order:
            worker, cached = ask_with_system(second, "chat", systems[i], f"second question {i}")
            assert worker == b
            hits += cached > 0
        shared = {w: shared_facts(mport + w) for w in (a, b)}
        if sharing:
            assert hits == PROMPTS  # every sibling found its prompt cached
            # A told each first request's dispatch and end (coalesced when both fell in
            # one 50 ms batch); B heard them all, and nothing was dropped.
            assert PROMPTS <= float(shared[a]["told"]) <= 2 * PROMPTS
            # What A told last may still be on its way to B when the two are scraped.
            wait_for(
                "B heard all A told",
                lambda: (
                    float(shared_facts(mport + b)["heard"])
                    >= float(shared_facts(mport + a)["told"])
                ),
                10,
            )
            assert shared[a]["dropped"] == shared[b]["dropped"] == "0.0"
        else:
            assert hits < PROMPTS, "without sharing B still found every prompt's home"
            assert shared == {a: {}, b: {}}  # nothing shared: no samples, not zeros
    finally:
        for _, c in clients:
            c.close()
        proc.terminate()
        proc.wait(10)
