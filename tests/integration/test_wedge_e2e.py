"""Wedged engines, through real processes: llmgw-cp with its router, two agents, two
replicas of one model. One engine stops producing tokens while its process stays up
(the fake llama-server's `/fake/tokens` switch: `/health` still 200; a real
llama-server SIGSTOPped: nothing answers at all). Under a steady stream of
non-streamed requests:

- the router quarantines that endpoint within `wedge_after_s` + 2 s of the wedge
  (its own log line's timestamp, against the wall clock at the wedge);
- the requests that were waiting on it are sent to the other replica: the router
  says how many it sent elsewhere (at least one), and no client request fails;
- the control plane, told over the router's report, stops the replica and starts
  another (new replica id, ready, its engine a new process; the wedged one gone);
- `ctl replicas` and `ctl events` show why: `wedged: N requests, no bytes for X s`,
  with what `/health` said then.

Only non-streamed requests are retried elsewhere: a streamed one whose head has
reached its client is past the point of retrying (the fake and vLLM send the
head before the first token), which is the stream-continuation work's, not this.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ChatLoad, alive, llama_server_binary, start_tiny_fleet, tiny_catalog

from llmgw.testing.cluster import LocalCluster, wait_for

WEDGE_AFTER_S = 3.0
NODES = ["cpu-1", "cpu-2"]


def replicas(cluster: LocalCluster) -> list[dict[str, Any]]:
    return list(json.loads(cluster.ctl("replicas", "--json").stdout)["replicas"])


def tiny_shards(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    """replica id -> its shard, for every `tiny` shard the nodes report."""
    return {
        s["replica_id"]: s
        for n in cluster.nodes().values()
        for s in n["shards"]
        if s.get("model_name") == "tiny"
    }


def two_ready(cluster: LocalCluster) -> dict[str, dict[str, Any]] | None:
    shards = tiny_shards(cluster)
    ok = len(shards) == 2 and all(s["state"] == "ready" for s in shards.values())
    return shards if ok else None


def log_time(line: str) -> float:
    """The wall-clock time a log line was written ("2026-12-01 18:22:21,854 INFO ...")."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def quarantine_line(log: str, replica_id: str) -> str | None:
    for line in log.splitlines():
        if f"{replica_id}@" in line and "quarantined," in line and line[:4].isdigit():
            return line
    return None


def check_wedge_handled(
    cluster: LocalCluster, load: ChatLoad, wedged: str, wedged_at: float, health: str
) -> None:
    """What both tests assert once one replica is wedged under `load`."""
    assert cluster.cp is not None
    line = wait_for(
        "the router's quarantine",
        lambda: quarantine_line(cluster.cp.output(), wedged),  # type: ignore[union-attr]
        WEDGE_AFTER_S + 30,
    )
    took = log_time(line) - wedged_at
    assert took <= WEDGE_AFTER_S + 2.0, (took, line)
    assert "wedged: " in line and "no bytes for" in line, line
    sent = re.search(r"quarantined, (\d+) waiting request\(s\) sent elsewhere", line)
    assert sent is not None and int(sent.group(1)) >= 1, line

    # Replaced: a new replica ready beside the other, the wedged one gone for good.
    def replaced() -> dict[str, dict[str, Any]] | None:
        shards = two_ready(cluster)
        return shards if shards is not None and wedged not in shards else None

    now = wait_for("the wedged replica replaced", replaced, 90)
    assert wedged not in now

    # Why, in ctl replicas (the wedged replica's row, kept after it is gone) and events.
    rows = {r["replica"]: r for r in replicas(cluster)}
    row = rows[wedged]
    assert row["state"] == "failed", row
    assert re.fullmatch(rf"wedged: \d+ requests?, no bytes for \d+ s, {health}", row["reason"]), row
    table = cluster.ctl("replicas").stdout
    assert any(wedged in ln and "wedged: " in ln for ln in table.splitlines()), table
    events = cluster.ctl("events").stdout
    assert any(wedged in ln or "wedged: " in ln for ln in events.splitlines()), events
    assert "wedged: " in events, events

    # Requests went on being served meanwhile, none failed.
    served = load.ok
    wait_for("requests after the replacement", lambda: load.ok >= served + 10, 60)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_fake_engine_with_health_200_and_no_tokens_is_quarantined_and_replaced(
    tmp_path: Path, workers: int
) -> None:
    """With two router workers, each sees its own share of the requests and the control
    plane hears of the quarantine from whichever saw it first (llmgw/cp/_workers.py)."""
    cluster = LocalCluster(tmp_path / "fleet")
    try:
        start_tiny_fleet(
            cluster,
            tmp_path,
            NODES,
            # Each answer takes about 0.4 s, so requests are in flight at any moment.
            engine_env={"LLMGW_FAKE_TOKEN_DELAY": "0.05"},
            router={"wedge_after_s": WEDGE_AFTER_S, "workers": workers},
            models=tiny_catalog(2),
        )
        before = wait_for("two ready replicas", lambda: two_ready(cluster), 60)
        key = cluster.api_key()
        wedged, shard = sorted(before.items())[0]
        with ChatLoad(cluster.router_url, key, clients=3) as load:
            wait_for("requests flowing", lambda: load.ok >= 10, 60)
            wedged_at = time.time()
            answer = httpx.post(
                f"http://127.0.0.1:{shard['port']}/fake/tokens", json={"hang": True}, timeout=5
            )
            assert answer.json() == {"hang": True}
            # /health still 200: what the router's reason must say it saw.
            assert (
                httpx.get(f"http://127.0.0.1:{shard['port']}/health", timeout=5).status_code == 200
            )
            check_wedge_handled(cluster, load, wedged, wedged_at, r"/health 200")
        assert load.failed == [], load.failed[:5]
        assert not any(alive(p) for p in shard["pids"])
    finally:
        cluster.stop_all()


@pytest.mark.slow
def test_a_sigstopped_llama_server_is_quarantined_and_replaced(
    tmp_path: Path, tiny_model: Path
) -> None:
    binary = llama_server_binary()
    cluster = LocalCluster(tmp_path / "fleet")
    cluster.models = [
        {
            "name": "tiny",
            "source": str(tiny_model),
            "replicas": 2,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "engine_args": ["--ctx-size", "256", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.router_extra["wedge_after_s"] = WEDGE_AFTER_S
    stopped: list[int] = []
    try:
        cluster.start_fleet(NODES, {"llama-server": binary})
        before = wait_for("two ready replicas", lambda: two_ready(cluster), 120)
        key = cluster.api_key()
        wedged, shard = sorted(before.items())[0]
        with ChatLoad(cluster.router_url, key, clients=3) as load:
            wait_for("requests flowing", lambda: load.ok >= 10, 60)
            wedged_at = time.time()
            for pid in shard["pids"]:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            check_wedge_handled(cluster, load, wedged, wedged_at, r"/health timed out after 1 s")
        assert load.failed == [], load.failed[:5]
        # The agent stopped it (SIGKILL reaches a stopped process).
        wait_for("the stopped engine gone", lambda: not any(alive(p) for p in stopped), 30)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cluster.stop_all()
