"""Issues 3 and 4 through real processes: discovery reaches `ctl nodes`, and the
supervisor never loses an engine across agent restarts."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from helpers import alive

from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for


def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi.install(bin_dir)
    fake_engine.install(bin_dir, "vllm")
    fake_engine.install(bin_dir, "llama-server")
    return bin_dir


def gpu_env(bin_dir: Path, gpus: str = "8xh100-80g") -> dict[str, str]:
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LLMGW_FAKE_GPUS": gpus}


@pytest.mark.slow
def test_agent_with_fake_gpus_shows_gpus_memory_disk_engines(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    bin_dir = fake_bin(tmp_path)
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "model.safetensors").write_bytes(b"\0" * 4096)
    cluster.setup([])
    # Named on purpose: an engine on PATH alone is not reported.
    engine_paths = {name: str(bin_dir / name) for name in ("llama-server", "vllm")}
    cluster.write_agent_config("gpu-1", model_dirs=[str(models)], engine_paths=engine_paths)
    from llmgw.ctl import _cert

    _cert.issue_agent(cluster.pki, "gpu-1")
    cluster.start_cp()
    cluster.start_agent("gpu-1", env=gpu_env(bin_dir))
    cluster.wait_states({"gpu-1": "ready"}, timeout=20)
    node = cluster.nodes()["gpu-1"]
    inv = node["inventory"]
    assert len(inv["gpus"]) == 8
    assert {g["gpu_class"] for g in inv["gpus"]} == {"h100-80g"}
    assert inv["gpus"][0]["memory_total_mib"] == 81559
    assert {(n["a"], n["b"], n["links"]) for n in inv["topology"]["nvlinks"]} >= {(0, 1, 18)}
    assert inv["usage"]["memory_total_bytes"] > 1 << 30
    assert inv["usage"]["filesystems"] and inv["usage"]["filesystems"][0]["free_bytes"] > 0
    assert sorted(e["name"] for e in inv["engines"]["found"]) == ["llama-server", "vllm"]
    assert [(f["path"], f["size_bytes"]) for f in inv["weights"]["files"]] == [
        (str(models / "tiny" / "model.safetensors"), 4096)
    ]
    table = cluster.ctl("nodes").stdout
    row = next(line for line in table.splitlines() if line.startswith("gpu-1"))
    assert "8xh100-80g" in row and "llama-server (configured), vllm (configured)" in row


@pytest.mark.slow
def test_engines_survive_ten_agent_kills_and_stop_leaves_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    bin_dir = fake_bin(tmp_path)
    cluster.setup(["node-a"])
    cluster.write_agent_config(
        "node-a", engine_paths={"llama-server": str(bin_dir / "llama-server")}, stop_grace_s=5
    )
    cluster.start_cp()
    cluster.start_agent("node-a", env={"LLMGW_FAKE_LOAD_DELAY": "0.5"})
    cluster.wait_states({"node-a": "ready"}, timeout=20)
    shard_ids = []
    for i in range(3):
        out = cluster.ctl(
            "shard",
            "start",
            "node-a",
            "--engine",
            "llama-server",
            "--model",
            f"/models/tiny-{i}.gguf",
        ).stdout
        shard_ids.append(out.split()[0])

    def shards() -> dict[str, dict]:
        return {s["shard_id"]: s for s in cluster.nodes()["node-a"]["shards"]}

    def all_ready() -> dict[str, dict] | None:
        current = shards()
        ok = len(current) == 3 and all(s["state"] == "ready" for s in current.values())
        return current if ok else None

    first = wait_for("three ready engines", all_ready, 30)
    pids = {sid: tuple(s["pids"]) for sid, s in first.items()}
    generation = cluster.nodes()["node-a"]["generation"]
    assert isinstance(generation, int)
    log_path = cluster.agents["node-a"].log
    for round_ in range(10):
        mark = log_path.stat().st_size  # each agent appends to the same log
        cluster.agents["node-a"].kill9()
        cluster.start_agent("node-a", env={"LLMGW_FAKE_LOAD_DELAY": "0.5"})

        def registered_again(gen: int = generation) -> dict | None:
            # The killed agent's session can still read "ready" until the control
            # plane notices the connection is gone: only a new registration counts.
            node = cluster.nodes()["node-a"]
            if (node["generation"] or 0) <= gen or node["state"] != "ready":
                return None
            return node if all_ready() else None

        node = wait_for(f"a new registration, ready, after kill {round_ + 1}", registered_again, 30)
        generation = node["generation"]
        after = {s["shard_id"]: s for s in node["shards"]}
        assert {sid: tuple(s["pids"]) for sid, s in after.items()} == pids
        assert all(alive(p) for ps in pids.values() for p in ps)

        def adoptions(mark: int = mark) -> str | None:
            with log_path.open("rb") as f:
                f.seek(mark)
                text = f.read().decode(errors="replace")
            return text if all(f"shard {sid}: adopted" in text for sid in shard_ids) else None

        this_agent = wait_for(
            f"adoption of all three logged after kill {round_ + 1}", adoptions, 10
        )
        assert ": started " not in this_agent  # adopted, never started again

    # Killed behind the agent's back: reported failed with its last output lines.
    victim = shard_ids[0]
    os.kill(pids[victim][0], signal.SIGKILL)
    failed = wait_for(
        "failed report", lambda: shards()[victim]["state"] == "failed" and shards()[victim], 20
    )
    assert f"engine (pid {pids[victim][0]})" in failed["reason"]
    assert "last output" in failed["reason"] and "server is listening" in failed["reason"]

    # Stop: nothing left behind.
    for sid in shard_ids[1:]:
        cluster.ctl("shard", "stop", "node-a", sid)
    wait_for(
        "stopped engines gone",
        lambda: not any(alive(p) for sid in shard_ids[1:] for p in pids[sid]),
        15,
    )
    assert set(shards()) == {victim}


@pytest.mark.slow
def test_engine_check_names_a_renamed_flag(cluster: LocalCluster, tmp_path: Path) -> None:
    bin_dir = fake_bin(tmp_path)
    cluster.setup(["node-a"])
    cluster.write_agent_config(
        "node-a", engine_paths={"llama-server": str(bin_dir / "llama-server")}
    )
    cluster.start_cp()
    cluster.start_agent("node-a", env={"LLMGW_FAKE_HELP_RENAME": "--metrics=--prometheus"})
    cluster.wait_states({"node-a": "ready"}, timeout=20)
    done = cluster.ctl("engine-check", "--engine", "llama-server", check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "missing --metrics" in done.stdout
    data = json.loads(
        cluster.ctl("engine-check", "--engine", "llama-server", "--json", check=False).stdout
    )
    (check,) = data["checks"]
    assert check["missing"] == ["--metrics"] and check["path"] == str(bin_dir / "llama-server")
    # vllm is not installed on this node: said so, not an error.
    done = cluster.ctl("engine-check", "--engine", "vllm", check=False)
    assert "not installed" in done.stdout
