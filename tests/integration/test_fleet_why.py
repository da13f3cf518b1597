"""Issue 9, "why it was replaced", with real processes: the reason outlives the replica."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.testing import fake_engine
from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 30

TINY = {
    "name": "tiny",
    "source": "llmgw-test/tiny",  # a hub id: the fake engine reads no weights
    "replicas": 1,
    "profiles": [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 30}],
}


def replicas(cluster: LocalCluster) -> list[dict[str, Any]]:
    """`GET /api/v1/replicas`, which `ctl replicas --json` prints as is: read over HTTP
    because it is polled (a ctl process per poll is ~0.4 s of CPU); the tests read the
    ctl's own output where it is what they check."""
    return list(cluster.first.api_get("/api/v1/replicas")["replicas"])


def ready_replica(cluster: LocalCluster, *, not_: str | None = None) -> dict[str, Any] | None:
    """The model's one ready replica (other than `not_`), once it is the only one listed."""
    rows = [r for r in replicas(cluster) if r["model"] == "tiny"]
    if len(rows) == 1 and rows[0]["state"] == "ready" and rows[0]["replica"] != not_:
        return rows[0]
    return None


def shard_of(cluster: LocalCluster, replica: str) -> dict[str, Any]:
    shards = [s for s in cluster.nodes()["cpu-1"]["shards"] if s["replica_id"] == replica]
    assert len(shards) == 1, shards
    return dict(shards[0])


def start(cluster: LocalCluster, tmp_path: Path, **agent: Any) -> dict[str, Any]:
    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.models = [TINY]
    cluster.setup(["cpu-1"])
    cluster.write_agent_config("cpu-1", engine_paths={"llama-server": str(llama)}, **agent)
    cluster.start_cp()
    cluster.start_agent("cpu-1", env={"LLMGW_FAKE_LOAD_DELAY": "0.2"})
    return dict(wait_for("a ready replica of tiny", lambda: ready_replica(cluster), TIMEOUT))


@pytest.mark.slow
def test_a_killed_engine_leaves_its_reason_and_last_lines(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    first = start(cluster, tmp_path)
    old = first["replica"]
    shard = shard_of(cluster, old)
    engine_pid = shard["pids"][-1]  # the engine is the last process of a shard
    os.kill(engine_pid, signal.SIGKILL)

    new = wait_for(
        "the killed engine's replacement ready", lambda: ready_replica(cluster, not_=old), TIMEOUT
    )
    # The replacement carries why its predecessor went: reason, where, and the output.
    failure = new["last_failure"]
    assert failure is not None, new
    assert failure["replica_id"] == old
    assert failure["shard_id"] == shard["shard_id"]
    assert failure["node_id"] == "cpu-1"
    assert failure["kind"] == "shard-failed"
    assert failure["reason"] == f"engine (pid {engine_pid}) was killed by SIGKILL"
    assert any("server is listening on" in line for line in failure["lines"]), failure["lines"]

    table = cluster.ctl("replicas").stdout.splitlines()
    row = next(
        i for i, line in enumerate(table) if line.startswith("tiny") and new["replica"] in line
    )
    under = table[row + 1]
    assert under.startswith(f"  replaces {old}, failed ")
    assert (
        f"ago on cpu-1 (shard {shard['shard_id']}): engine (pid {engine_pid}) was killed by SIGKILL"
        in under
    )
    output = table[row + 2 : row + 2 + 5]
    assert output and all(line.startswith("      [") for line in output), table
    assert any("server is listening on" in line for line in output), table

    # The events, per replica: its shard failed, then the reconciler stopped it, saying why.
    events = json.loads(cluster.ctl("events", "--replica", old, "--json").stdout)["events"]
    kinds = [e["kind"] for e in events]
    assert kinds[:2] == ["shard-failed", "replica-stopped"], events
    assert "was killed by SIGKILL" in events[1]["message"]
    by_node = cluster.ctl("events", "--node", "cpu-1").stdout
    assert "node cpu-1: new -> ready (registered from" in by_node
    assert f"shard {shard['shard_id']} failed: engine (pid {engine_pid}) was killed" in by_node
    status = cluster.ctl("status").stdout
    assert f"{old} failed " in status and "was killed by SIGKILL" in status

    # A shard that is not on the node: one line, non-zero, no traceback.
    gone = cluster.ctl("shard", "logs", "cpu-1", "nothing-here.0", check=False)
    assert gone.returncode == 1
    assert gone.stdout == ""
    assert len(gone.stderr.strip().splitlines()) == 1, gone.stderr
    assert "nothing-here.0" in gone.stderr and "Traceback" not in gone.stderr
    assert "404" in gone.stderr, gone.stderr


@pytest.mark.slow
def test_a_hung_engine_is_replaced_and_says_why(cluster: LocalCluster, tmp_path: Path) -> None:
    """Waits on the agent's health watch (unhealthy after health_failures) and on the
    control plane replacing a replica unhealthy for longer than `unhealthy_replace_s`."""
    cluster.server_extra = {"unhealthy_replace_s": 1.0}
    first = start(cluster, tmp_path, health_interval_s=0.3, health_timeout_s=0.5, health_failures=2)
    old = first["replica"]
    shard = shard_of(cluster, old)
    # Still listening, never answering /health again: a hung engine.
    httpx.post(f"http://127.0.0.1:{shard['port']}/fake/health", json={"hang": True}, timeout=5)

    new = wait_for(
        "the hung engine's replacement ready", lambda: ready_replica(cluster, not_=old), TIMEOUT
    )
    failure = new["last_failure"]
    assert failure is not None and failure["replica_id"] == old, new
    assert failure["kind"] == "shard-unhealthy"
    assert failure["shard_id"] == shard["shard_id"]
    assert failure["reason"].startswith("/health failed 2 times in a row: "), failure
    assert "timed out after 0.5 s" in failure["reason"]
    table = cluster.ctl("replicas").stdout
    assert f"replaces {old}, failed " in table
    assert "/health failed 2 times in a row" in table
    events = json.loads(cluster.ctl("events", "--replica", old, "--json").stdout)["events"]
    assert [e["kind"] for e in events][:2] == ["shard-unhealthy", "replica-stopped"], events
    assert "unhealthy" in events[1]["message"]
