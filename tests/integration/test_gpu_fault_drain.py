"""GPU faults through real processes: llmgw-cp, two agents on nodes faked with nvidia-smi
(two h100-80g cards each), fake vLLM engines, and recorded kernel-log lines appended to
the file each agent reads (agent.yaml `gpu_fault_log`).

gpu-1 runs one replica on each card. Xid 13 (recorded, the application's fault) on its
card 0 is reported and moves nothing; Xid 79 (recorded: fallen off the bus) on its card 1
moves that card's replica only, to gpu-2, within 30 s; then Xid 48 (recorded: double-bit
ECC) on the card of gpu-2 the replacement took moves that one only, to gpu-2's other card.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for
from tests.helpers import FIXTURES

FAULT_BUDGET_S = 30.0  # the bound: a card's replicas moved within this

XID79 = FIXTURES / "kernlog-xid79-fallen-off-bus-dmesg-T-drv535.txt"  # PCI 0000:a1:00
XID48 = FIXTURES / "kernlog-xid48-dbe-framebuffer.txt"  # PCI 0000:07:00
XID13 = FIXTURES / "kernlog-xid13-graphics-exception-dmesg-ctime.txt"  # PCI 0000:cb:00

# The fake cards' PCI addresses are those the recorded lines name: gpu-1's card 0 is the
# Xid 13 card, its card 1 the Xid 79 card; gpu-2's card 0 the Xid 48 card.
BUS = {"gpu-1": "00000000:CB:00.0,00000000:A1:00.0", "gpu-2": "00000000:07:00.0,00000000:3B:00.0"}

Placed = dict[tuple[str, int], tuple[str, str, tuple[int, ...]]]

CATALOG = [
    {
        "name": "chat",
        "source": "Qwen/Qwen2.5-7B-Instruct",
        "replicas": 2,
        "profiles": [
            {"engine": "vllm", "gpu_class": "h100-80g", "gpus_per_node": 1, "startup_timeout_s": 30}
        ],
    }
]


class Nodes:
    def __init__(self, cluster: LocalCluster, tmp_path: Path) -> None:
        self.c = cluster
        bin_dir = tmp_path / "gpu-bin"
        fake_nvidia_smi.install(bin_dir)
        self.vllm = fake_engine.install(bin_dir, "vllm")
        self.env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "LLMGW_FAKE_GPUS": "2xh100-80g",
            "LLMGW_FAKE_LOAD_DELAY": "0.3",
        }
        self.logs = {n: tmp_path / f"{n}-kern.log" for n in ("gpu-1", "gpu-2")}

    def start(self, node: str) -> None:
        self.logs[node].write_text("")
        self.c.write_agent_config(
            node,
            engine_paths={"vllm": str(self.vllm)},
            gpu_fault_log=str(self.logs[node]),
            gpu_fault_nvml_events=False,
            sample_interval_s=0.5,
        )
        self.c.start_agent(node, env={**self.env, "LLMGW_FAKE_SMI_BUS_IDS": BUS[node]})

    def append(self, node: str, recorded: Path) -> None:
        with self.logs[node].open("a") as f:
            f.write(recorded.read_text())

    # replicas, events and the reconciler's passes are polled, so they are read over HTTP:
    # the admin API's answers, which `ctl replicas/events/status --json` print as is (a
    # ctl process per poll is ~0.4 s of CPU on the suite's two cores). `ctl nodes` is read
    # below where its row is what is checked.
    def replicas(self) -> list[dict[str, Any]]:
        return list(self.c.first.api_get("/api/v1/replicas")["replicas"])

    def placed(self) -> Placed:
        """(node, card index) -> (replica, shard state, engine pids), from `ctl nodes`."""
        out = {}
        for node_id, n in self.c.nodes().items():
            index = {g["uuid"]: g["index"] for g in (n["inventory"] or {}).get("gpus") or ()}
            for s in n["shards"]:
                for uuid in s["gpus"]:
                    out[(node_id, index[uuid])] = (s["replica_id"], s["state"], tuple(s["pids"]))
        return out

    def events(self, kind: str) -> list[dict[str, Any]]:
        data = self.c.first.api_get("/api/v1/events?limit=200")["events"]
        return [e for e in data if e["kind"] == kind]

    def passes(self) -> int:
        return int(self.c.first.api_get("/api/v1/status")["reconciler"]["passes"])

    def ready_on(self, *cards: tuple[str, int]) -> Placed | None:
        """What runs where, once exactly these cards hold a replica each, all ready."""
        placed = self.placed()
        ok = set(placed) == set(cards) and all(s == "ready" for _, s, _ in placed.values())
        return placed if ok else None


@pytest.mark.slow(seconds=20)
def test_xid_79_and_48_move_only_their_cards_replica_and_xid_13_is_reported(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    nodes = Nodes(cluster, tmp_path)
    cluster.models = CATALOG
    cluster.setup(["gpu-1", "gpu-2"])
    cluster.start_cp()
    nodes.start("gpu-1")
    # One replica on each card of gpu-1 (the only node yet).
    first = wait_for(
        "a ready replica on each card of gpu-1",
        lambda: nodes.ready_on(("gpu-1", 0), ("gpu-1", 1)),
        60,
    )
    keep, keep_pids = first[("gpu-1", 0)][0], first[("gpu-1", 0)][2]
    moved = first[("gpu-1", 1)][0]
    nodes.start("gpu-2")
    wait_for("gpu-2 ready", lambda: cluster.states().get("gpu-2") == "ready", 30)

    # Xid 13 on card 0: the application's fault. Reported, nothing moves.
    nodes.append("gpu-1", XID13)
    reported = wait_for(
        "the Xid 13 event",
        lambda: [e for e in nodes.events("gpu-fault") if "Xid 13" in e["message"]] or None,
        30,
    )
    assert reported[0]["node_id"] == "gpu-1"
    assert reported[0]["message"] == (
        "gpu 0: Xid 13 (Graphics Engine Exception); reported only (application fault): "
        "nothing moves"
    )
    assert "Graphics SM Warp Exception" in reported[0]["lines"][0]
    # The Xid 109 line after it is not in the table: reported as unknown, nothing moves.
    assert any("Xid 109 (unknown Xid 109)" in e["message"] for e in nodes.events("gpu-fault"))
    start = nodes.passes()
    wait_for("3 reconciler passes after the Xid 13", lambda: nodes.passes() >= start + 3, 30)
    assert nodes.placed() == first
    gpu1 = cluster.nodes()["gpu-1"]
    usage = {u["index"]: u for u in gpu1["inventory"]["usage"]["gpus"]}
    assert usage[0]["health"] == "ok" and usage[1]["health"] == "ok"
    assert [f["xid"] for f in usage[0]["faults"]] == [13, 13, 13, 109]

    # Xid 79 on card 1: the card is out. Its replica is replaced on gpu-2, then stopped.
    t0 = time.monotonic()
    nodes.append("gpu-1", XID79)
    after = wait_for(
        "card 1's replica replaced on gpu-2 and stopped on gpu-1",
        lambda: nodes.ready_on(("gpu-1", 0), ("gpu-2", 0)),
        FAULT_BUDGET_S + 15,
    )
    took = time.monotonic() - t0
    assert took < FAULT_BUDGET_S, f"the Xid 79 card's replica took {took:.1f} s to move"
    assert after[("gpu-1", 0)] == (keep, "ready", keep_pids)  # untouched: same replica, pids
    assert after[("gpu-2", 0)][0] not in (keep, moved)
    stopped = [e for e in nodes.events("replica-stopped") if e["replica_id"] == moved]
    assert (
        stopped
        and "gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus) on gpu-1"
        in (stopped[-1]["message"])
    )
    assert not [e for e in nodes.events("replica-stopped") if e["replica_id"] == keep]
    out = cluster.ctl("nodes").stdout
    line = next(x for x in out.splitlines() if x.startswith("gpu-1"))
    assert "2xh100-80g; gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus)" in line
    fault = [e for e in nodes.events("gpu-fault") if "Xid 79" in e["message"]]
    assert fault[0]["message"] == (
        "gpu 1: Xid 79 (GPU has fallen off the bus); the card is taken out: its replicas "
        "are replaced elsewhere, then stopped"
    )

    # Xid 48 on gpu-2's card 0, where the replacement runs: that one moves to card 1.
    replacement = after[("gpu-2", 0)][0]
    t0 = time.monotonic()
    nodes.append("gpu-2", XID48)
    last = wait_for(
        "the Xid 48 card's replica moved to gpu-2's card 1",
        lambda: nodes.ready_on(("gpu-1", 0), ("gpu-2", 1)),
        FAULT_BUDGET_S + 15,
    )
    took = time.monotonic() - t0
    assert took < FAULT_BUDGET_S, f"the Xid 48 card's replica took {took:.1f} s to move"
    assert last[("gpu-1", 0)] == (keep, "ready", keep_pids)
    assert last[("gpu-2", 1)][0] not in (keep, moved, replacement)
    stopped = [e for e in nodes.events("replica-stopped") if e["replica_id"] == replacement]
    assert "gpu 0 unhealthy: Xid 48 (Double Bit ECC Error) on gpu-2" in stopped[-1]["message"]

    # Nothing healthy left for a third replica: the refusal names the cards and why.
    cluster.write_server_config([{**CATALOG[0], "replicas": 3}])
    unplaced = wait_for(
        "the third replica refused",
        lambda: [r for r in nodes.replicas() if r["state"] == "unplaced"] or None,
        30,
    )
    reasons = unplaced[0]["reason"]
    assert "gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus)" in reasons
    assert "gpu 0 unhealthy: Xid 48 (Double Bit ECC Error)" in reasons
