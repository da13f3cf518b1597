"""Issue 5 with real processes: catalog, placement, and a reconciler that keeps the fleet true."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import alive

from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 60


def vllm(gpus: int, **extra: Any) -> dict[str, Any]:
    return {
        "engine": "vllm",
        "gpu_class": "h100-80g",
        "gpus_per_node": gpus,
        "startup_timeout_s": 30,
        **extra,
    }


CATALOG = [
    {
        "name": "chat",
        "source": "Qwen/Qwen2.5-7B-Instruct",
        "served_names": ["chat"],
        "replicas": 2,
        "profiles": [vllm(2)],
    },
    {"name": "embed", "source": "BAAI/bge-m3", "replicas": 2, "profiles": [vllm(1)]},
    {"name": "big", "source": "meta-llama/Llama-3.1-70B", "replicas": 1, "profiles": [vllm(4)]},
    {
        "name": "tiny-cpu",
        "source": "llmgw-test/tiny",  # a hub id: the fake engine reads no weights
        "replicas": 1,
        "profiles": [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 30}],
    },
]


class Fleet:
    def __init__(self, cluster: LocalCluster, tmp_path: Path) -> None:
        self.c = cluster
        bin_dir = tmp_path / "gpu-bin"  # GPU nodes: nvidia-smi and vllm, no llama-server
        fake_nvidia_smi.install(bin_dir)
        self.vllm = fake_engine.install(bin_dir, "vllm")
        self.llama = fake_engine.install(tmp_path / "cpu-bin", "llama-server")
        self.gpu_env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "LLMGW_FAKE_GPUS": "8xh100-80g",
            "LLMGW_FAKE_LOAD_DELAY": "0.5",
            "LLMGW_FAKE_PREFIX_CACHE_TOKENS": "4096",
        }
        self.cpu_env = {"LLMGW_FAKE_LOAD_DELAY": "0.5", "LLMGW_FAKE_PREFIX_CACHE_TOKENS": "4096"}

    def start(self) -> None:
        self.c.models = CATALOG
        self.c.setup(["gpu-1", "gpu-2", "cpu-1"])
        for node in ("gpu-1", "gpu-2"):
            self.c.write_agent_config(node, engine_paths={"vllm": str(self.vllm)})
        self.c.write_agent_config("cpu-1", engine_paths={"llama-server": str(self.llama)})
        self.c.start_cp()
        self.agent("gpu-1")
        self.agent("gpu-2")
        self.agent("cpu-1")

    def agent(self, node: str) -> None:
        self.c.start_agent(node, env=self.gpu_env if node.startswith("gpu") else self.cpu_env)

    # status, replicas and the reconciler's counters are read over HTTP (the admin API's
    # answers, which `ctl status --json` and `ctl replicas --json` print as is): they are
    # polled, and a ctl process per poll is ~0.4 s of CPU on the suite's two cores. The
    # ctl's own output is checked below where it is the point (rollout status, place).
    def status(self) -> dict[str, dict]:
        return {m["model"]: m for m in self.c.first.api_get("/api/v1/status")["models"]}

    def replicas(self) -> list[dict]:
        return list(self.c.first.api_get("/api/v1/replicas")["replicas"])

    def shards(self) -> dict[str, dict]:
        return {
            s["shard_id"]: {**s, "node": n} for n, v in self.c.nodes().items() for s in v["shards"]
        }

    def all_ready(self) -> dict[str, dict] | None:
        status = self.status()
        ok = all(m["ready"] == m["desired"] for m in status.values())
        ready_replicas = [r for r in self.replicas() if r["state"] == "ready"]
        return (
            status
            if ok and len(ready_replicas) == sum(m["desired"] for m in status.values())
            else None
        )

    def reconciler(self) -> dict[str, int]:
        stats: dict[str, int] = self.c.first.api_get("/api/v1/status")["reconciler"]
        return stats

    def wait_passes(self, passes: int = 2, timeout: float = 30) -> None:
        def free() -> dict[str, int] | None:
            s = self.reconciler()
            return s if not s["settling"] and not s["holding"] else None

        start = wait_for("the reconciler free to act", free, timeout)["passes"]
        wait_for(
            f"{passes} reconciler passes",
            lambda: self.reconciler()["passes"] >= start + passes,
            timeout,
        )

    def pids(self) -> dict[str, tuple[int, ...]]:
        return {sid: tuple(s["pids"]) for sid, s in self.shards().items()}


@pytest.mark.slow(seconds=40)
def test_catalog_placement_and_reconciler(cluster: LocalCluster, tmp_path: Path) -> None:
    fleet = Fleet(cluster, tmp_path)
    fleet.start()
    wait_for("every replica ready", fleet.all_ready, TIMEOUT)
    replicas = {r["replica"]: r for r in fleet.replicas()}
    cpu = [r for r in replicas.values() if r["model"] == "tiny-cpu"]
    assert [r["nodes"] for r in cpu] == [["cpu-1"]]
    shards = fleet.shards()
    # No card given twice; every GPU replica on a GPU node.
    cards = [(s["node"], g) for s in shards.values() for g in s["gpus"]]
    assert len(cards) == len(set(cards)) == 2 * 2 + 2 * 1 + 4
    assert all(s["node"].startswith("gpu") for s in shards.values() if s["gpus"])

    # The engines report what they had cached, as the router's prefix index needs:
    # vLLM only because its plan passes --enable-prompt-tokens-details (the fake, as
    # the real one, says nothing without it); llama-server always.
    key = cluster.api_key("team-a")
    system = " ".join(f"rule{i} holds" for i in range(60))  # ~120 tokens, 7 blocks
    for model in ("chat", "tiny-cpu"):
        seen = []
        for question in ("one", "two", "three"):
            r = httpx.post(
                cluster.router_url + "/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={
                    "model": model,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                },
                timeout=30,
            )
            assert r.status_code == 200, r.text
            seen.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert seen[0] == 0 and max(seen) >= 112, (model, seen)

    # kill -9 an engine: replaced within the startup timeout.
    victim = next(s for s in shards.values() if s["model_name"] == "embed")
    os.kill(victim["pids"][0], signal.SIGKILL)
    killed_at = time.monotonic()

    def replaced() -> bool:
        now = {
            r["replica"]
            for r in fleet.replicas()
            if r["model"] == "embed" and r["state"] == "ready"
        }
        return victim["replica_id"] not in now and len(now) == 2

    wait_for("the killed engine's replica replaced", replaced, 30)
    assert time.monotonic() - killed_at < 30
    wait_for("every replica ready", fleet.all_ready, TIMEOUT)

    # kill -9 an agent: its engines keep serving; restarted, it adopts them, 0 restarts.
    before = fleet.pids()
    on_gpu1 = [s for s in fleet.shards().values() if s["node"] == "gpu-1"]
    assert on_gpu1
    cluster.agents["gpu-1"].kill9()
    for s in on_gpu1:
        assert httpx.get(f"http://127.0.0.1:{s['port']}/health", timeout=5).status_code == 200
    fleet.agent("gpu-1")
    cluster.wait_states({"gpu-1": "ready"}, timeout=20)
    wait_for("every replica ready", fleet.all_ready, TIMEOUT)
    assert fleet.pids() == before

    # kill -9 the control plane: 0 engine restarts, every replica ready within 15 s of its start.
    assert cluster.cp is not None
    cluster.cp.kill9()
    started = time.monotonic()
    cluster.start_cp()
    wait_for(
        "every replica ready after the control plane restart",
        fleet.all_ready,
        15 - (time.monotonic() - started),
    )
    # Not a sleep (which passes when the reconciler has simply not run yet): until it
    # is free to act, and has then made two passes over what it found.
    fleet.wait_passes()
    assert fleet.pids() == before
    assert all(alive(p) for ps in before.values() for p in ps)

    # Drop a model: its shards stop. Change a profile: its replicas are rolled, surge first.
    chat_before = {r["replica"] for r in fleet.replicas() if r["model"] == "chat"}
    embed_pids = [
        p for sid, s in fleet.shards().items() if s["model_name"] == "embed" for p in s["pids"]
    ]
    changed = [m for m in CATALOG if m["name"] != "embed"]
    changed[0] = {**changed[0], "profiles": [vllm(2, engine_args=["--max-model-len", "4096"])]}
    cluster.write_server_config(changed)
    wait_for("embed's engines stopped", lambda: not any(alive(p) for p in embed_pids), 30)
    wait_for(
        "chat rolling",
        lambda: (
            any(r["stale"] for r in fleet.replicas() if r["model"] == "chat")
            or "done" in cluster.ctl("rollout", "status", "chat").stdout
        ),
        20,
    )

    def rolled() -> bool:
        chat = [r for r in fleet.replicas() if r["model"] == "chat"]
        return (
            len(chat) == len(chat_before)
            and all(r["state"] == "ready" and not r["stale"] for r in chat)
            and not {r["replica"] for r in chat} & chat_before
        )

    wait_for("chat rolled to its new profile", rolled, TIMEOUT)
    assert not [r for r in fleet.replicas() if r["model"] == "embed"]
    status = cluster.ctl("rollout", "status", "chat").stdout
    assert "done" in status, status

    # A model nothing can hold: the per-node reasons, in `replicas` and `place --dry-run`.
    huge = {
        "name": "huge",
        "source": "x/huge",
        "replicas": 1,
        "profiles": [{"engine": "vllm", "gpu_class": "h200-140g", "gpus_per_node": 8}],
    }
    cluster.write_server_config([*changed, huge])

    def unplaced() -> dict | None:
        return next(
            (r for r in fleet.replicas() if r["model"] == "huge" and r["state"] == "unplaced"), None
        )

    row = wait_for("huge unplaced", unplaced, 20)
    for node in ("gpu-1", "gpu-2", "cpu-1"):
        assert node in row["reason"], row["reason"]
    dry = cluster.ctl("place", "huge", "--dry-run", check=False)
    assert dry.returncode == 1
    assert "cannot be placed" in dry.stdout and "gpu-1" in dry.stdout and "cpu-1" in dry.stdout
    ok = cluster.ctl("place", "tiny-cpu", "--dry-run", check=False)
    assert ok.returncode == 0 and "cpu-1" in ok.stdout

    # A bad catalog is refused whole; the running one stays.
    refusals = cluster.cp.output().count("refused")
    (cluster.root / "server.yaml").write_text("models: [{name: broken}]\n" + "tls: {}\n")
    wait_for(
        "the bad catalog refused",
        lambda: cluster.cp is not None and cluster.cp.output().count("refused") > refusals,
        20,
    )
    assert {m["model"] for m in fleet.status().values()} == {"chat", "big", "tiny-cpu", "huge"}


@pytest.mark.slow
def test_cordon_keeps_placement_off_a_node_across_restarts(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.setup(["cpu-1", "cpu-2"])
    for node in ("cpu-1", "cpu-2"):
        cluster.write_agent_config(node, engine_paths={"llama-server": str(llama)})
        cluster.start_agent(node, env={"LLMGW_FAKE_LOAD_DELAY": "0.2"})
    cluster.start_cp()
    cluster.wait_states({"cpu-1": "ready", "cpu-2": "ready"}, timeout=20)
    cluster.ctl("cordon", "cpu-1", "--reason", "disk replacement")
    model = {
        "name": "tiny",
        "source": "llmgw-test/tiny",  # a hub id: the fake engine reads no weights
        "replicas": 2,
        "profiles": [{"engine": "llama-server", "gpus_per_node": 0}],
    }
    cluster.write_server_config([model])

    def ready_nodes() -> list[str] | None:
        rows = cluster.first.api_get("/api/v1/replicas")["replicas"]  # polled: over HTTP
        ready = sorted(n for r in rows if r["state"] == "ready" for n in r["nodes"])
        return ready if len(ready) == 2 else None

    assert wait_for("two replicas", ready_nodes, 30) == ["cpu-2", "cpu-2"]
    row = next(
        line for line in cluster.ctl("nodes").stdout.splitlines() if line.startswith("cpu-1")
    )
    assert "ready,cordoned" in row
    assert cluster.nodes()["cpu-1"]["cordoned"] == "disk replacement"
    dry = cluster.ctl("place", "tiny", "--dry-run", check=False).stdout
    assert "cpu-2" in dry and "cpu-1" not in dry
    # The cordon is the operator's, kept in the state directory: a restart keeps it.
    assert cluster.cp is not None
    cluster.cp.terminate()
    cluster.start_cp()
    cluster.wait_states({"cpu-1": "ready", "cpu-2": "ready"}, timeout=20)
    assert cluster.nodes()["cpu-1"]["cordoned"] == "disk replacement"
    cluster.ctl("uncordon", "cpu-1")
    assert "rank 0: cpu-1" in cluster.ctl("place", "tiny", "--dry-run").stdout
