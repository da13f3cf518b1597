"""Rolling a model onto a new version through real llmgw-cp, agents and llama-servers.

Two nodes, the tiny GGUF on real llama-server, two replicas. One test walks the
model through three changes of its profile, each a rollout (llmgw/core/_rollout.py):

1. under a steady stream of requests (streamed and not, two clients at once):
   every replica rolled, 0 failed requests, 0 truncated streams, each engine
   replaced exactly once (two starts, two stops, new pids);
2. a control-plane kill -9 once the first new replica is ready, then a restart:
   the rollout continues (the new replica is kept, its pid unchanged; the store's
   record, begun before the kill, is the one that finishes);
3. a version whose engine exits at once: the rollout stops itself after
   max_failures and says why; the old replicas keep serving; `undo` goes back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import ChatLoad, alive, llama_server_binary

from llmgw.testing.cluster import LocalCluster, wait_for

NODES = ("a1", "a2")
TIMEOUT = 120


def profile(ctx: int, *extra: str) -> dict[str, Any]:
    return {
        "engine": "llama-server",
        "gpus_per_node": 0,
        "engine_args": ["--ctx-size", str(ctx), "--threads", "1", *extra],
        "startup_timeout_s": 120,
    }


def model(*profiles: dict[str, Any], tiny: Path) -> list[dict[str, Any]]:
    return [{"name": "tiny", "source": str(tiny), "replicas": 2, "profiles": list(profiles)}]


def rollout(cluster: LocalCluster) -> dict[str, Any]:
    return dict(cluster.first.api_get("/api/v1/rollouts/tiny"))


def tiny_shards(cluster: LocalCluster) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """replica id -> (shard state, fingerprint, pids) of every `tiny` shard."""
    return {
        s["replica_id"]: (s["state"], s["profile_fingerprint"], tuple(s["pids"]))
        for n in cluster.nodes().values()
        for s in n["shards"]
        if s.get("model_name") == "tiny"
    }


def rolled_to(cluster: LocalCluster) -> dict[str, tuple[int, ...]] | None:
    """replica id -> pids once the rollout is done and both replicas run its version."""
    row = rollout(cluster)
    shards = tiny_shards(cluster)
    if row["phase"] != "done" or len(shards) != 2:
        return None
    if any(state != "ready" or fp not in row["to"] for state, fp, _ in shards.values()):
        return None
    return {r: pids for r, (_, _, pids) in shards.items()}


def starts_in(log: str) -> list[str]:
    return re.findall(r"starting replica (tiny-\w+) of tiny", log)


@pytest.mark.slow
def test_a_profile_change_rolls_every_replica_without_losing_a_request(
    cluster: LocalCluster, tiny_model: Path
) -> None:
    binary = llama_server_binary()
    cluster.models = model(profile(256), tiny=tiny_model)
    cluster.start_fleet(NODES, {"llama-server": binary})
    key = cluster.api_key("team-a")

    def ready_two() -> dict[str, tuple[int, ...]] | None:
        shards = tiny_shards(cluster)
        ok = len(shards) == 2 and all(s == "ready" for s, _, _ in shards.values())
        return {r: p for r, (_, _, p) in shards.items()} if ok else None

    v1 = wait_for("two ready replicas", ready_two, TIMEOUT)
    fp1 = wait_for("v1 settled", lambda: rollout(cluster)["settled"], 30)

    # 1. Under load: every replica rolled, nothing lost, each engine replaced once.
    assert cluster.cp is not None
    log_before = len(cluster.cp.output())
    with ChatLoad(cluster.router_url, key, streams=True) as load:
        wait_for("requests flowing", lambda: load.ok >= 10, 60)
        cluster.write_server_config(model(profile(512), tiny=tiny_model))
        v2 = wait_for("rolled to v2", lambda: rolled_to(cluster), TIMEOUT)
        served = load.ok
        wait_for("requests after the roll", lambda: load.ok >= served + 10, 60)
    assert load.failed == [] and load.truncated == [], (load.failed[:5], load.truncated[:5])
    assert load.ok >= 20
    assert not set(v2) & set(v1)
    old_pids = {p for ps in v1.values() for p in ps}
    assert not {p for ps in v2.values() for p in ps} & old_pids
    assert not any(alive(p) for p in old_pids)
    log = cluster.cp.output()[log_before:]
    assert sorted(starts_in(log)) == sorted(v2), starts_in(log)  # two starts, no more
    row = wait_for("v2 settled", lambda: (r := rollout(cluster))["settled"] == r["to"] and r, 30)
    assert (row["phase"], row["previous"]) == ("done", fp1), row
    assert row["to"] != fp1 and row["failures"] == 0
    status = cluster.ctl("rollout", "status", "tiny").stdout
    assert "rollout done" in status and "2 of 2 ready" in status, status

    # 2. kill -9 of the control plane mid-rollout: the restarted one continues it.
    cluster.write_server_config(model(profile(384), tiny=tiny_model))

    def first_new_ready() -> tuple[str, tuple[int, ...]] | None:
        row = rollout(cluster)
        if row["phase"] != "rolling" or not row["to"]:
            return None
        for r, (state, fp, pids) in tiny_shards(cluster).items():
            if state == "ready" and fp in row["to"]:
                return r, pids
        return None

    kept, kept_pids = wait_for("the first v3 replica ready", first_new_ready, TIMEOUT)
    began = rollout(cluster)["started_at"]
    cluster.cp.kill9()
    cluster.start_cp()  # its log is appended to the same file
    v3 = wait_for("rolled to v3 after the restart", lambda: rolled_to(cluster), TIMEOUT)
    assert kept in v3 and v3[kept] == kept_pids, (kept, v3)  # continued, not restarted
    assert rollout(cluster)["started_at"] == began  # the store's record, not a new one
    assert starts_in(cluster.cp.output()).count(kept) == 1

    # 3. A version that never becomes ready: stopped by itself, the old ones serve.
    cluster.write_server_config(model(profile(384, "--no-such-flag"), tiny=tiny_model))

    def stopped() -> dict[str, Any] | None:
        row = rollout(cluster)
        return row if row["phase"] == "stopped" else None

    row = wait_for("the rollout stopped itself", stopped, 180)
    assert "3 new replicas failed (the limit is 3)" in row["status"], row
    assert "the old ones keep serving" in row["status"], row
    shards = tiny_shards(cluster)
    assert {r for r, (s, _, _) in shards.items() if s == "ready"} == set(v3), shards
    with ChatLoad(cluster.router_url, key, streams=True) as load:
        wait_for("the old version serving", lambda: load.ok >= 10, 60)
    assert load.failed == [] and load.truncated == [], (load.failed[:5], load.truncated[:5])
    replicas = cluster.ctl("rollout", "status", "tiny").stdout
    assert "rollout stopped" in replicas, replicas

    # Undo: back to v3 while server.yaml still says the broken v4; nothing restarts.
    undone = json.loads(cluster.ctl("rollout", "undo", "tiny", "--json").stdout)
    assert undone["undone"] is True
    assert undone["fingerprints"] == rollout(cluster)["settled"]
    back = wait_for("undone: done on v3", lambda: rolled_to(cluster), 60)
    assert back == v3
    text = cluster.ctl("rollout", "status", "tiny").stdout
    assert "undone: running" in text, text
