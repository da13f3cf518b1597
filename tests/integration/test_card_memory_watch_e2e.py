"""Replicas sharing a card, watched against their claims, through real llmgw-cp and
llmgw-agent processes, fake GPUs (two recorded H100 80 GB cards) and the fake vLLM.

Four `gpu_memory_gib: 24` replicas: three on one card, one on the other. The test says,
through the fake nvidia-smi's compute-apps (a file read at each call), which engine holds
how much: the agent reports each shard's GPU memory; one engine that grows past its
24 GiB claim is reported (an `over-claim` event, once, and its line in `ctl replicas`);
when it pushes its card past its total it is the one replaced, and the others keep running.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import start_shared_cards

from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 60
CLAIM = 24 * 1024
TOTAL = 81559  # the recorded H100 80 GB's memory.total


@pytest.mark.slow(seconds=20)
def test_a_replica_over_its_claim_is_reported_and_replaced_when_its_card_is_full(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    apps, shards = start_shared_cards(cluster, tmp_path, timeout=TIMEOUT)

    def ready_shards() -> list[dict[str, Any]]:
        shards = [s for n in cluster.nodes().values() for s in n["shards"]]
        return [s for s in shards if s["state"] == "ready"]

    uuids = [g["uuid"] for g in cluster.nodes()["g1"]["inventory"]["gpus"]]
    index = {u: i for i, u in enumerate(uuids)}
    per_card = Counter(s["gpus"][0] for s in shards)
    full = max(per_card, key=per_card.__getitem__)
    crowded = sorted((s for s in shards if s["gpus"][0] == full), key=lambda s: s["shard_id"])
    assert len(crowded) == 3
    culprit, others = crowded[0], [s for s in shards if s is not crowded[0]]
    held = {s["shard_id"]: 20480 for s in shards}

    def write() -> None:
        apps.write_text(
            ",".join(f"{index[s['gpus'][0]]}:{s['pids'][-1]}:{held[s['shard_id']]}" for s in shards)
        )

    def measured() -> dict[str, int | None]:
        usage = cluster.nodes()["g1"]["inventory"]["usage"]["shards"]
        return {u["shard_id"]: u.get("gpu_memory_mib") for u in usage}

    # 1. The agent reads each shard's own memory from the cards' processes.
    write()
    wait_for("each shard's GPU memory read", lambda: measured() == held, TIMEOUT)

    def events(kind: str, replica: str) -> list[dict[str, Any]]:
        got = cluster.first.api_get(f"/api/v1/events?replica={replica}&limit=1000")["events"]
        return [e for e in got if e["kind"] == kind]

    # 2. One engine grows past its claim: reported, not replaced (the card has room).
    rid = culprit["replica_id"]
    held[culprit["shard_id"]] = 30720
    write()
    over = wait_for("the over-claim event", lambda: events("over-claim", rid), TIMEOUT)
    where = f"gpu {index[full]} of g1"
    assert over[0]["message"] == (
        f"replica {rid} over its claim on {where}: holds 30720 MiB, claims {CLAIM} (6144 over)"
    )
    assert over[0]["shard_id"] == culprit["shard_id"] and over[0]["model_name"] == "small"
    line = next(x for x in cluster.ctl("replicas").stdout.splitlines() if rid in x)
    assert "ready" in line and "over its claim" in line and "6144 over" in line, line
    replicas = {r["replica"]: r["state"] for r in cluster.first.api_get("/api/v1/replicas")[
        "replicas"]}  # fmt: skip
    assert sorted(replicas.values()) == ["ready"] * 4 and rid in replicas

    # 3. It grows until the card is full (85960 MiB held of 81559): it is the one replaced.
    held[culprit["shard_id"]] = 45000
    write()
    stopped = wait_for("the culprit stopped", lambda: events("replica-stopped", rid), TIMEOUT)
    used = 45000 + 2 * 20480
    assert stopped[0]["message"] == (
        f"stopping shard {culprit['shard_id']}: replica {rid} failed: out of memory: {where} "
        f"holds {used} of {TOTAL} MiB; this replica holds 45000 MiB, claims {CLAIM} "
        f"({45000 - CLAIM} over)"
    ), stopped
    # One over-claim episode, one event, however many passes saw it.
    assert len(events("over-claim", rid)) == 1

    def replaced() -> dict[str, str] | None:
        now = {r["replica"]: r["state"] for r in cluster.first.api_get("/api/v1/replicas")[
            "replicas"] if r["model"] == "small"}  # fmt: skip
        ready = {r for r, st in now.items() if st == "ready"}
        return now if len(ready) == 4 and rid not in ready else None

    after = wait_for("a replacement ready, the others untouched", replaced, TIMEOUT)
    assert {s["replica_id"] for s in others} <= {r for r, st in after.items() if st == "ready"}
    # The others' engines are the same processes: never stopped.
    still = {s["shard_id"]: s["pids"] for s in ready_shards()}
    assert all(still.get(s["shard_id"]) == s["pids"] for s in others)
