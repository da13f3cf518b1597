"""A frozen store does not stall requests with known keys (issue 24).

Real processes on loopback: a PostgreSQL started for the test, llmgw-cp on it
(`store:`), one agent with the fake llama-server. PostgreSQL is frozen (SIGSTOP of
its postmaster and every backend: not down, so connections hang instead of failing)
for longer than `key_cache_ttl_s`; a key the router has checked before keeps being
answered at its usual latency, because an expired key-cache entry is served at once
and refreshed behind the request (llmgw/router/_keys.py CachedKeys).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import postgres_server, ready_shards, start_tiny_fleet

from llmgw.testing.cluster import LocalCluster, wait_for

KEY_CACHE_TTL_S = 1.0
FROZEN_FOR_S = 4 * KEY_CACHE_TTL_S
SLOWEST_S = 1.0


@pytest.fixture
def pg() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


def postgres_pids(dsn: str) -> list[int]:
    """The postmaster serving `dsn` and all its children (backends, background workers),
    the postmaster first."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        backend = int(row[0])
        postmaster = _ppid(backend)  # while it runs: it exits with the connection
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (postmaster, backend):  # ours is closing
            try:
                if _ppid(int(entry)) == postmaster:
                    children.append(int(entry))
            except OSError:
                continue  # gone meanwhile
    assert children, f"no children of the postmaster {postmaster}"
    return [postmaster, *children]


def signal_if_there(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # a backend that has exited
        os.kill(pid, sig)


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_known_keys_keep_their_latency_while_postgresql_is_frozen(
    pg: str, cluster: LocalCluster, tmp_path: Path
) -> None:
    start_tiny_fleet(
        cluster,
        tmp_path,
        ["n1"],
        engine_env={},
        router={"key_cache_ttl_s": KEY_CACHE_TTL_S},
        store=pg,
    )
    key = cluster.api_key()
    wait_for("the replica ready", lambda: ready_shards(cluster), 30)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=cluster.router_url, headers=headers, timeout=30) as client:
        wait_for(
            "a 200 through the router",
            lambda: client.post("/chat/completions", json=body).status_code == 200,
            15,
        )  # the key is now cached
        pids = postgres_pids(pg)
        answered: list[tuple[int, float]] = []
        for pid in pids:
            signal_if_there(pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            while time.monotonic() - frozen_at < FROZEN_FOR_S:
                t0 = time.monotonic()
                r = client.post("/chat/completions", json=body)
                answered.append((r.status_code, time.monotonic() - t0))
                assert r.status_code == 200, r.text
                time.sleep(0.05)
        finally:
            for pid in pids:
                signal_if_there(pid, signal.SIGCONT)
    slowest = max(s for _, s in answered)
    print(f"{len(answered)} requests in {FROZEN_FOR_S} s frozen; slowest {slowest:.3f} s")
    assert len(answered) >= 10, answered
    # Past the TTL the answers came from the cache while a refresh waited on the store;
    # without that, the first request past it waited for the store call's deadline (10 s).
    assert slowest < SLOWEST_S, answered
