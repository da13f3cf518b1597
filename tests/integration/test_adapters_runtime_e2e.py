"""LoRA adapters on engines that load them at run time (vLLM, SGLang), through real
llmgw-cp and llmgw-agent processes, fake GPUs (the recorded nvidia-smi) and the fake
engines speaking vLLM's and SGLang's adapter APIs (llmgw/testing/_fake_engine_adapters.py:
an adapter's answer starts with `[NAME] `).

The leader loads an adapter where requests wait for it: the agent fetches it (a local
directory here, one from the weights mirror), the control plane calls the engine's
load route; a second adapter on a replica at its maximum (1) unloads the first. After
the control plane is killed and started again, the new leader learns what each replica
holds from the engine's own listing: a request for a loaded adapter is answered without
a new load.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 60
REPO = Path(__file__).resolve().parents[2]


def chat(cluster: LocalCluster, key: str, model: str) -> str:
    r = httpx.post(
        cluster.router_url + "/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=TIMEOUT + 60,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def adapters(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in cluster.first.api_get("/api/v1/adapters")["adapters"]}


def engine_stats(cluster: LocalCluster, model: str) -> dict[str, Any]:
    (port,) = [
        s["port"]
        for n in cluster.nodes().values()
        for s in n["shards"]
        if s.get("model_name") == model and s["state"] == "ready"
    ]
    return dict(httpx.get(f"http://127.0.0.1:{port}/fake/stats", timeout=10).json())


def sglang_python(tmp: Path) -> str:
    """A Python that imports a stand-in sglang whose `-m sglang.launch_server` is the
    fake SGLang (what agent.yaml's `sglang_python` names on a real node)."""
    site = tmp / "site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "launch_server.py").write_text(
        "import sys\nfrom llmgw.testing.fake_engine import main\n"
        "sys.exit(main(sys.argv[1:], prog='sglang'))\n"
    )
    python = tmp / "bin" / "sglang-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site.parent}:{REPO} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


@pytest.mark.slow(seconds=20)
def test_vllm_and_sglang_load_evict_and_are_relearned_after_a_restart(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi.install(bin_dir)
    fake_engine.install(bin_dir, "vllm")
    local = tmp_path / "adapters"
    for name in ("vl-a", "sg-a"):
        (local / name).mkdir(parents=True)
        (local / name / "adapter_config.json").write_text('{"r": 8}')
    cluster.mirror_dir = tmp_path / "mirror"
    (cluster.mirror_dir / "vl-b").mkdir(parents=True)
    (cluster.mirror_dir / "vl-b" / "adapter_config.json").write_text('{"r": 8}')
    gpu = {"gpu_class": "h100-80g", "startup_timeout_s": 60, "max_adapters": 1}
    cluster.models = [
        {
            "name": "vl",
            "source": "org/vl-8b",
            "profiles": [{"engine": "vllm", **gpu, "max_adapter_rank": 8}],
        },
        {
            "name": "sg",
            "source": "org/sg-8b",
            "profiles": [{"engine": "sglang", **gpu, "max_adapter_rank": 16}],
        },
    ]
    cluster.server_extra = {
        "adapters": [
            {"name": "vl-a", "base": "vl", "source": str(local / "vl-a")},
            {"name": "vl-b", "base": "vl", "source": "mirror:/vl-b/"},
            {"name": "sg-a", "base": "sg", "source": str(local / "sg-a")},
        ]
    }
    cluster.setup(["g1"])
    cluster.write_agent_config(
        "g1", engine_paths={"vllm": str(bin_dir / "vllm")}, sglang_python=sglang_python(tmp_path)
    )
    cluster.start_cp()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LLMGW_FAKE_GPUS": "2xh100-80g"}
    cluster.start_agent("g1", env=env)

    def both_ready() -> bool:
        shards = [s for n in cluster.nodes().values() for s in n["shards"]]
        return sorted(s["model_name"] for s in shards if s["state"] == "ready") == ["sg", "vl"]

    wait_for("vl and sg ready", both_ready, TIMEOUT)
    key = cluster.api_key("team-a")
    wait_for("vl routable", lambda: chat(cluster, key, "vl") == chat(cluster, key, "vl"), TIMEOUT)

    # vl-a: fetched (a local directory) and loaded through vLLM's route.
    assert chat(cluster, key, "vl-a").startswith("[vl-a] ")
    stats = engine_stats(cluster, "vl")
    assert (stats["adapter_loads"], stats["adapter_unloads"]) == (1, 0)
    # vl-b (from the mirror): the replica holds 1 at most, so vl-a is unloaded first.
    assert chat(cluster, key, "vl-b").startswith("[vl-b] ")
    stats = engine_stats(cluster, "vl")
    assert (stats["adapter_loads"], stats["adapter_unloads"]) == (2, 1)
    rows = adapters(cluster)
    assert rows["vl-a"]["held_by"] == [] and rows["vl-a"]["evictions"] == 1, rows
    assert rows["vl-b"]["loads"] == 1 and len(rows["vl-b"]["held_by"]) == 1, rows
    # The base of vl is unaffected; SGLang's adapter through SGLang's route.
    assert not chat(cluster, key, "vl").startswith("[")
    assert chat(cluster, key, "sg-a").startswith("[sg-a] ")
    assert engine_stats(cluster, "sg")["adapter_loads"] == 1
    metrics = httpx.get(cluster.admin_url + "/metrics", timeout=10).text
    assert 'llmgw_adapter_loads_total{adapter="vl-b"} 1.0' in metrics
    assert 'llmgw_adapter_evictions_total{adapter="vl-a"} 1.0' in metrics
    assert 'llmgw_adapter_replicas{adapter="sg-a",base="sg"} 1.0' in metrics

    # A new control plane learns what the engines hold: no second load of vl-b.
    assert cluster.cp is not None
    cluster.cp.kill9()
    cluster.start_cp()
    wait_for("vl-b held again", lambda: adapters(cluster)["vl-b"]["held_by"], TIMEOUT)
    assert chat(cluster, key, "vl-b").startswith("[vl-b] ")
    assert adapters(cluster)["vl-b"]["loads"] == 0
    assert engine_stats(cluster, "vl")["adapter_loads"] == 2
    assert json.loads(cluster.ctl("adapters", "vl-b", "--json").stdout)["name"] == "vl-b"
