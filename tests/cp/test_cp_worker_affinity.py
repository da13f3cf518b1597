"""Prefix affinity across router workers inside llmgw-cp, through real processes: the
control plane (worker 0) and its worker process (worker 1), two agents, each running
the fake llama-server with a prompt cache that reports cached tokens.

Each system prompt's first request goes through a connection the kernel gave one
worker, its sibling (once the channel is quiet) through a connection it gave the
other. The control plane relays
what each worker's prefix index learned (llmgw/cp/_workers.py), so the other worker's
index holds the same chains before it has sent anything, and every sibling lands on
the replica that has its prompt cached. (Without the relay the second worker's choice
is its own: tests/router/test_prefix_sharing.py shows the same workload then misses.)
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import httpx
from helpers import (
    ask_with_system,
    index_blocks,
    one_client_per_worker,
    ready_shards,
    start_tiny_fleet,
    tiny_catalog,
)

from llmgw.core import chain
from llmgw.router._surface import prompt_bytes
from llmgw.testing.cluster import LocalCluster, wait_for

PROMPTS = 12
_SHARED = re.compile(r'^llmgw_router_prefix_shared_facts_total\{outcome="(\w+)"\}\s+(\S+)', re.M)


def system_prompt(i: int) -> str:
    rng = random.Random(i)
    return f"system {i}: " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(200))


def shared_facts(url: str) -> dict[str, str]:
    """A worker's llmgw_router_prefix_shared_facts_total, by outcome."""
    return dict(_SHARED.findall(httpx.get(url, timeout=5).text))


def chain_of(system: str, question: str) -> list[int]:
    """The block chain the router makes of a chat request (default 256-byte blocks)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    text = prompt_bytes("/v1/chat/completions", {"messages": messages})
    assert text is not None
    return chain(text, 256)


def test_siblings_through_either_worker_land_where_their_prompt_is_cached(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    start_tiny_fleet(
        cluster,
        tmp_path,
        ["n1", "n2"],
        engine_env={"LLMGW_FAKE_PREFIX_CACHE_TOKENS": "1000000", "LLMGW_FAKE_TOKENS": "2"},
        router={"workers": 2},
        models=tiny_catalog(2),
    )
    wait_for("two replicas ready", lambda: len(ready_shards(cluster)) == 2, 60)
    key = cluster.api_key()
    base = cluster.router_url.removesuffix("/v1")
    metrics = {i: f"http://127.0.0.1:{cluster.admin_port + i}/metrics" for i in (0, 1)}
    clients = one_client_per_worker(base, key)
    try:

        def lists_tiny(client: httpx.Client) -> bool:
            r = client.get("/v1/models")
            return r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]

        wait_for("both workers list the model", lambda: all(map(lists_tiny, clients.values())), 30)
        systems = [system_prompt(i) for i in range(PROMPTS)]
        order = list(range(PROMPTS))
        random.Random(7).shuffle(order)
        # Half the prompts start on worker 0 and go on through 1; the other half the
        # other way round: the control plane's own router tells and hears as well.
        for i, system in enumerate(systems):
            first = i % 2
            worker, cached = ask_with_system(clients[first], "tiny", system, f"first {i}")
            assert (worker, cached) == (first, 0)
        # Each worker sent half the prompts; each index holds every prompt's chain.
        expected = sum(len(chain_of(system, f"first {i}")) for i, system in enumerate(systems))
        wait_for(
            "each worker's index holds the other's chains",
            lambda: [index_blocks(metrics[w]) for w in (0, 1)] == [expected, expected],
            10,
        )

        def quiet() -> bool:
            """No fact told or heard on either worker for 0.3 s: every request's end has
            reached the other worker (a request of the other's still counted in flight
            there would rightly weigh against its endpoint)."""
            before = [shared_facts(url) for url in metrics.values()]
            time.sleep(0.3)
            return before == [shared_facts(url) for url in metrics.values()]

        # The siblings in two rounds, each through one worker with the other idle.
        for second in (1, 0):
            wait_for("the relay quiet", quiet, 10)
            for i in (i for i in order if 1 - i % 2 == second):
                worker, cached = ask_with_system(clients[second], "tiny", systems[i], f"again {i}")
                assert worker == second
                assert cached > 0, f"prompt {i}'s sibling through worker {second} missed"
    finally:
        for c in clients.values():
            c.close()
