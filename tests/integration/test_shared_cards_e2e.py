"""Several replicas on one card, through real llmgw-cp and llmgw-agent processes, fake GPUs
(the recorded nvidia-smi of an 8x H100 80 GB node, two of its cards here) and the fake
vLLM: a profile that asks for `gpu_memory_gib: 24` is packed by free memory. Three
replicas fit on one 80 GiB card (3 x 24 = 72, with the shared-card headroom), the fourth
goes to the next card; each engine's command line carries its share as
`--gpu-memory-utilization` and its card's UUID in CUDA_VISIBLE_DEVICES; the replicas'
own memory on the card is llmgw's, never foreign, so the card stays healthy.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import llama_server_binary, mig_agent_env, start_shared_cards

from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 60


def proc_args(pid: int) -> tuple[list[str], dict[str, str]]:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(e.decode().split("=", 1) for e in raw if b"=" in e)
    return [a.decode() for a in argv if a], env


def place(cluster: LocalCluster, model: str) -> dict[str, Any]:
    r = httpx.post(
        cluster.admin_url + "/api/v1/place",
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        json={"model": model},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.slow(seconds=15)
def test_four_24_gib_replicas_pack_three_on_one_80_gib_card(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    probe = {  # never started: what `POST /api/v1/place` places, to see which cards take a share
        "name": "probe",
        "source": "org/probe-20b",
        "replicas": 0,
        "profiles": [{"engine": "vllm", "gpu_class": "h100-80g", "gpu_memory_gib": 40}],
    }
    apps, shards = start_shared_cards(cluster, tmp_path, probe, timeout=TIMEOUT)
    node = cluster.nodes()["g1"]
    uuids = [g["uuid"] for g in node["inventory"]["gpus"]]
    per_card = Counter(s["gpus"][0] for s in shards)
    assert all(len(s["gpus"]) == 1 for s in shards)
    assert sorted(per_card.values()) == [1, 3], per_card
    assert set(per_card) == set(uuids)
    for s in shards:
        assert s["gpu_memory_mib"] == 24 * 1024
        argv, penv = proc_args(s["pids"][-1])
        at = argv.index("--gpu-memory-utilization")
        assert argv[at + 1] == "0.3", argv  # 24 GiB of the card's 81559 MiB: 0.301, rounded down
        assert penv["CUDA_VISIBLE_DEVICES"] == s["gpus"][0]
    # `ctl nodes` shows each shared card's claims, per replica.
    row = next(x for x in cluster.ctl("nodes").stdout.splitlines() if x.startswith("g1"))
    full = max(per_card, key=per_card.__getitem__)
    mine = sorted(s["replica_id"] for s in shards if s["gpus"][0] == full)
    assert f"gpu {uuids.index(full)} shared 72/80 GiB: " + ", ".join(f"{r} 24" for r in mine) in row
    # So does the node page, under each card.
    with httpx.Client(base_url=cluster.admin_url, timeout=10) as client:
        r = client.post("/admin/login", data={"key": cluster.admin_key})
        assert r.status_code in (200, 303), r.text
        page = client.get("/admin/nodes/g1").text
    claims = ", ".join(f"{r} 24" for r in mine)
    assert f'<small data-field="gpu-claims">shared: 72 GiB claimed ({claims})</small>' in page
    # The engines hold 20 GiB each on their cards: llmgw's own, not foreign; then a
    # process llmgw did not start takes 4 GiB of the second card: foreign, over the limit.
    index = {u: i for i, u in enumerate(uuids)}
    held = [f"{index[s['gpus'][0]]}:{s['pids'][-1]}:20480" for s in shards]
    apps.write_text(",".join(held))

    def foreign() -> list[int | None]:
        usage = cluster.nodes()["g1"]["inventory"]["usage"]["gpus"]
        return [g.get("foreign_memory_mib") for g in sorted(usage, key=lambda g: g["index"])]

    wait_for("the engines' memory read, none foreign", lambda: foreign() == [0, 0], TIMEOUT)
    lone = min(per_card, key=per_card.__getitem__)  # the card with one replica
    # 40 GiB more fits only the card with one replica (79.6 - 24 - 1 GiB headroom).
    placed = place(cluster, "probe")
    assert placed["placed"] is True, placed
    assert placed["ranks"][0]["gpus"] == [index[lone]], placed
    apps.write_text(",".join([*held, f"{index[lone]}:1:4096"]))
    want = [4096 if u == lone else 0 for u in uuids]
    wait_for("the foreign process read", lambda: foreign() == want, TIMEOUT)
    refused = place(cluster, "probe")
    assert refused["placed"] is False, refused
    said = {
        index[u]: f"gpu {index[u]} unhealthy: 4096 MiB held by processes llmgw did not start"
        if u == lone
        else f"gpu {index[u]} has 6.6 GiB unclaimed, needs 40"
        for u in uuids
    }
    assert refused["reasons"] == ["g1: " + "; ".join(said[i] for i in sorted(said))], refused
    replicas = cluster.first.api_get("/api/v1/replicas")["replicas"]
    assert sorted(r["state"] for r in replicas if r["model"] == "small") == ["ready"] * 4


@pytest.mark.slow(seconds=10)
def test_a_mig_profile_takes_an_instance_and_a_whole_card_profile_is_refused_there(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The recorded MIG-enabled H100 (4 instances: 3g.40gb, 2g.20gb, 2x 1g.10gb): a
    `mig: 1g.10gb` profile's two replicas take the two 1g.10gb instances, each engine
    given its instance's MIG UUID in CUDA_VISIBLE_DEVICES; a whole-card profile never
    lands on the MIG-enabled card, and placement says why."""
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi.install(bin_dir)
    fake_engine.install(bin_dir, "vllm")
    cluster.models = [
        {
            "name": "mini",
            "source": "org/mini-1b",
            "replicas": 2,
            "profiles": [
                {"engine": "vllm", "gpu_class": "h100-80g", "mig": "1g.10gb",
                 "startup_timeout_s": 60},
            ],
        },
        {
            "name": "whole",
            "source": "org/whole-8b",
            "replicas": 0,
            "profiles": [{"engine": "vllm", "gpu_class": "h100-80g"}],
        },
    ]  # fmt: skip
    cluster.setup(["mig-1"])
    cluster.write_agent_config("mig-1", engine_paths={"vllm": str(bin_dir / "vllm")})
    cluster.start_cp()
    cluster.start_agent("mig-1", env=mig_agent_env(bin_dir))

    def two_ready() -> list[dict[str, Any]] | None:
        shards = [s for n in cluster.nodes().values() for s in n["shards"]]
        ready = [s for s in shards if s["state"] == "ready"]
        return ready if len(ready) == 2 else None

    shards = wait_for("two mini replicas ready", two_ready, TIMEOUT)
    small = {"MIG-00000002-0000-0000-0000-000000000002", "MIG-00000003-0000-0000-0000-000000000003"}
    assert {s["gpus"][0] for s in shards} == small
    for s in shards:
        _, penv = proc_args(s["pids"][-1])
        assert penv["CUDA_VISIBLE_DEVICES"] == s["gpus"][0]
    refused = place(cluster, "whole")
    assert refused["placed"] is False, refused
    assert "gpu 0 is MIG-enabled: whole-card profiles do not use it" in refused["reasons"][0]
    more = place(cluster, "mini")  # both 1g.10gb instances are taken
    assert more["placed"] is False and "no free 1g.10gb instance" in more["reasons"][0], more


@pytest.mark.slow(seconds=10)
def test_two_real_llama_servers_share_one_card_and_both_serve(
    cluster: LocalCluster, tmp_path: Path, tiny_model: Path
) -> None:
    """Real llama-servers (the CPU build: the fake card is a budget, CUDA_VISIBLE_DEVICES
    names it and nothing reads it) placed by the same rules: two 30 GiB shares on one
    80 GiB card, both answering through the router."""
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi.install(bin_dir)
    cluster.models = [
        {
            "name": "tiny",
            "source": str(tiny_model),
            "replicas": 2,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpu_class": "h100-80g",
                    "gpu_memory_gib": 30,
                    "engine_args": ["--ctx-size", "512", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.setup(["g1"])
    cluster.write_agent_config("g1", engine_paths={"llama-server": llama_server_binary()})
    cluster.start_cp()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LLMGW_FAKE_GPUS": "2xh100-80g"}
    cluster.start_agent("g1", env=env)

    def two_ready() -> list[dict[str, Any]] | None:
        shards = [s for n in cluster.nodes().values() for s in n["shards"]]
        ready = [s for s in shards if s["state"] == "ready"]
        return ready if len(ready) == 2 else None

    shards = wait_for("two llama-servers ready", two_ready, 120)
    assert len({s["gpus"][0] for s in shards}) == 1  # one card, shared
    # Each is held to its share at start: fit's margin is the card's free memory (the
    # fake reports all 81559 MiB free) less 30 GiB.
    for s in shards:
        argv, penv = proc_args(s["pids"][-1])
        assert penv["LLAMA_ARG_FIT_TARGET"] == str(81559 - 30 * 1024), argv
    key = cluster.api_key("team-a")

    def prompt_tokens(port: int) -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        line = next(x for x in text.splitlines() if x.startswith("llamacpp:prompt_tokens_total"))
        return float(line.split()[-1])

    def both_answered() -> bool:
        for i in range(8):
            r = httpx.post(
                cluster.router_url + "/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}],
                      "max_tokens": 2},
                timeout=60,
            )  # fmt: skip
            if r.status_code != 200:
                return False
        return all(prompt_tokens(s["port"]) > 0 for s in shards)

    wait_for("both replicas serving through the router", both_answered, 60)
