"""Autoscaling through real processes: llmgw-cp with its router, agents, real
llama-servers serving the tiny GGUF.

1. Scale from zero, and back. `tiny` autoscales between 0 and 2. At zero it is still
   listed; a burst of 32 requests is held by the router (the leader asks for
   replicas at once; the nodes are started only then, so the hold is certain), past
   `hold_max` the extra requests get 503 with Retry-After at once, and every one of
   the 32 is answered 200 once a replica is ready, the first within a few seconds. With the burst's demand the count goes to 2; under a light stream load it
   comes back to 1 through a drain (no stream cut), and with no load to 0 (min). An
   operator's pause holds a count of 1 with no load; resumed, it goes back to 0.
2. A full fleet (one fake h100 card, a real llama-server on it): `high` (priority 1)
   with demand displaces the idle `low` (priority 0), drained; then `low` with demand
   does not displace the idle `high`: its request gets 503 once held `hold_s`, and
   `ctl status` says who holds the room.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ChatLoad, llama_server_binary

from llmgw.testing import fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 120


def profile(**extra: Any) -> dict[str, Any]:
    return {
        "engine": "llama-server",
        "gpus_per_node": 0,
        "engine_args": ["--ctx-size", "1024", "--parallel", "4", "--threads", "1"],
        "startup_timeout_s": 120,
        **extra,
    }


def tiny_shards(cluster: LocalCluster, model: str = "tiny") -> dict[str, str]:
    """replica id -> shard state, for every shard of `model` the nodes report."""
    return {
        s["replica_id"]: s["state"]
        for n in cluster.nodes().values()
        for s in n["shards"]
        if s.get("model_name") == model
    }


def status_row(cluster: LocalCluster, model: str) -> dict[str, Any]:
    rows = cluster.first.api_get("/api/v1/status")["models"]
    return dict(next(r for r in rows if r["model"] == model))


def post(url: str, key: str, model: str, text: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    with httpx.Client(timeout=TIMEOUT) as h:
        return h.post(url + "/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json=body | extra)  # fmt: skip


def held(cluster: LocalCluster, model: str) -> float:
    """The router's llmgw_router_held gauge for `model` (0 when absent)."""
    text = httpx.get(cluster.admin_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("llmgw_router_held{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow(seconds=90)
def test_a_burst_at_zero_is_held_answered_and_drains_back_to_min(
    cluster: LocalCluster, tiny_model: Path
) -> None:
    binary = llama_server_binary()
    cluster.models = [
        {
            "name": "tiny",
            "source": str(tiny_model),
            "autoscale": {
                "min": 0, "max": 2, "target": {"requests_per_replica": 4},
                "window_s": 4, "scale_down_after_s": 6, "down_cooldown_s": 2,
                "up_cooldown_s": 1, "hold_max": 32, "hold_s": 90,
            },
            "profiles": [profile()],
        }
    ]  # fmt: skip
    nodes = ["a1", "a2"]
    cluster.setup(nodes)
    for node in nodes:
        cluster.write_agent_config(node, engine_paths={"llama-server": binary})
    cluster.start_cp()  # the nodes come later: nothing can start until they do
    key = cluster.api_key("team-a")
    listed = httpx.get(cluster.router_url + "/models", headers={"Authorization": f"Bearer {key}"})
    assert [m["id"] for m in listed.json()["data"]] == ["tiny"]
    assert status_row(cluster, "tiny")["desired"] == 0

    # 1. A burst of 32 at zero: held (past hold_max refused at once), then all answered.
    answers: list[tuple[int, float]] = []
    ready_at: list[float] = []

    def one(i: int) -> None:
        r = post(cluster.router_url, key, "tiny", f"burst {i}")
        answers.append((r.status_code, time.monotonic()))

    def watch_ready() -> None:
        wait_for("a ready replica", lambda: "ready" in tiny_shards(cluster).values(), TIMEOUT,
                 interval=0.1)  # fmt: skip
        ready_at.append(time.monotonic())

    watcher = threading.Thread(target=watch_ready)
    watcher.start()
    burst = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in burst:
        t.start()
    wait_for("32 requests held", lambda: held(cluster, "tiny") == 32, 60)
    wait_for("the leader asked for them", lambda: status_row(cluster, "tiny")["desired"] > 0, 30)
    for i in range(3):  # over hold_max: refused at once
        began = time.monotonic()
        r = post(cluster.router_url, key, "tiny", f"over {i}")
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "service_unavailable", r.text
        assert time.monotonic() - began < 5.0
    for node in nodes:
        cluster.start_agent(node)
    for t in burst:
        t.join(TIMEOUT)
    watcher.join(TIMEOUT)
    assert sorted(code for code, _ in answers) == [200] * 32, answers
    first = min(at for _, at in answers)
    assert first - ready_at[0] < 5.0, (first, ready_at)
    # The burst's demand (32 for a target of 4) asked for the most: 2.
    wait_for("2 replicas", lambda: status_row(cluster, "tiny")["desired"] == 2, 30)
    row = status_row(cluster, "tiny")
    assert row["autoscale"]["min"] == 0 and row["autoscale"]["max"] == 2, row

    # 2. A light load of streams: back to 1 through a drain, no stream cut.
    wait_for("two ready", lambda: list(tiny_shards(cluster).values()) == ["ready"] * 2, TIMEOUT)
    with ChatLoad(cluster.router_url, key, clients=1, streams=True) as load:
        wait_for("down to 1", lambda: len(tiny_shards(cluster)) == 1, 60)
        served = load.ok
        wait_for("requests after the scale-down", lambda: load.ok >= served + 4, 60)
    assert load.failed == [] and load.truncated == [], (load.failed[:3], load.truncated[:3])
    events = cluster.ctl("events", "--json").stdout
    assert "autoscaled" in events and "lowered 2 -> 1" in events, events[-2000:]

    # 3. No load: to min (0), and the status says why.
    wait_for("down to 0", lambda: tiny_shards(cluster) == {}, 60)
    table = cluster.ctl("status").stdout
    line = next(x for x in table.splitlines() if x.startswith("tiny"))
    assert "0-2" in line and "lowered 1 -> 0" in line, table

    # 4. An operator holds a count: a replica with no load, until resumed.
    refused = cluster.ctl("autoscale", "pause", "tiny", "--replicas", "3", check=False)
    assert refused.returncode != 0 and "outside tiny's autoscale range [0, 2]" in refused.stderr
    out = cluster.ctl("autoscale", "pause", "tiny", "--replicas", "1").stdout
    assert "paused at 1 by admin" in out, out
    wait_for("held at 1", lambda: list(tiny_shards(cluster).values()) == ["ready"], TIMEOUT)
    assert "paused at 1" in cluster.ctl("status").stdout
    cluster.ctl("autoscale", "resume", "tiny")
    wait_for("back to 0 once resumed", lambda: tiny_shards(cluster) == {}, 60)


@pytest.mark.slow(seconds=60)
def test_a_higher_priority_displaces_an_idle_lower_one_and_never_the_reverse(
    cluster: LocalCluster, tiny_model: Path, tmp_path: Path
) -> None:
    binary = llama_server_binary()
    bin_dir = tmp_path / "gpu-bin"
    fake_nvidia_smi.install(bin_dir)
    on_card = profile(gpu_class="h100-80g", gpus_per_node=1)

    def autoscaled(name: str, priority: int, hold_s: float) -> dict[str, Any]:
        return {
            "name": name, "source": str(tiny_model), "priority": priority,
            "autoscale": {"min": 0, "max": 1, "scale_down_after_s": 600, "hold_s": hold_s},
            "profiles": [on_card],
        }  # fmt: skip

    cluster.models = [autoscaled("low", 0, 8), autoscaled("high", 1, 90)]
    cluster.setup(["gpu-1"])
    cluster.write_agent_config("gpu-1", engine_paths={"llama-server": binary})
    cluster.start_cp()
    cluster.start_agent(
        "gpu-1", env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "LLMGW_FAKE_GPUS": "1xh100-80g"}
    )
    cluster.wait_states({"gpu-1": "ready"}, 60)
    key = cluster.api_key("team-a")

    # low takes the only card.
    assert post(cluster.router_url, key, "low", "hello").status_code == 200
    assert list(tiny_shards(cluster, "low").values()) == ["ready"]
    # high wants it while low is idle: low is drained, high placed and answered.
    r = post(cluster.router_url, key, "high", "hello")
    assert r.status_code == 200, r.text
    assert tiny_shards(cluster, "low") == {}
    (high_replica,) = tiny_shards(cluster, "high")
    events = cluster.ctl("events", "--json").stdout
    assert "low: lowered 1 -> 0" in events and "priority" in events, events[-2000:]

    # The reverse: low wants the card while high is idle: refused after hold_s, high stays.
    began = time.monotonic()
    r = post(cluster.router_url, key, "low", "again")
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert 6.0 <= time.monotonic() - began < 30.0
    assert tiny_shards(cluster, "high") == {high_replica: "ready"}
    row = status_row(cluster, "low")
    assert row["no_room"] is not None and "high (priority 1)" in row["no_room"], row
    table = cluster.ctl("status").stdout
    assert "high (priority 1)" in table, table
    assert json.loads(cluster.ctl("status", "--json").stdout)["models"]
