"""The real engine: llama-server started by the agent's supervisor on a generated model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from conftest import alive, llama_server_binary

from llmgw import engines
from llmgw.testing.cluster import LocalCluster, wait_for


@pytest.mark.slow
def test_real_llama_server_through_the_supervisor(cluster: LocalCluster, tiny_model: Path) -> None:
    binary = llama_server_binary()
    cluster.setup(["cpu-1"])
    cluster.write_agent_config("cpu-1", engine_paths={"llama-server": binary}, stop_grace_s=10)
    cluster.start_cp()
    cluster.start_agent("cpu-1")
    cluster.wait_states({"cpu-1": "ready"}, timeout=20)
    started = json.loads(
        cluster.ctl(
            "shard",
            "start",
            "cpu-1",
            "--engine",
            "llama-server",
            "--model",
            str(tiny_model),
            "--json",
            "--",
            "--ctx-size",
            "512",
            "--threads",
            "1",
        ).stdout
    )
    shard_id, port = started["shard"]["shard_id"], started["shard"]["port"]
    argv = started["spec"]["processes"][-1]["argv"]
    assert argv[0] == "llama-server" and "--jinja" in argv and "--metrics" in argv

    def ready() -> dict | None:
        shards = {s["shard_id"]: s for s in cluster.nodes()["cpu-1"]["shards"]}
        shard = shards.get(shard_id)
        if shard and shard["state"] == "failed":
            raise AssertionError(shard["reason"])
        return shard if shard and shard["state"] == "ready" else None

    shard = wait_for("llama-server ready", ready, 90)
    pids = shard["pids"]
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=60) as client:
        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
            },
        ).json()
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["completion_tokens"] == 8
        chunks = []
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6,
                "stream": True,
            },
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[len("data: ") :])
        assert chunks[-1] == "[DONE]"
        deltas = [
            json.loads(c)["choices"][0]["delta"] for c in chunks[:-1] if json.loads(c)["choices"]
        ]
        assert len([d for d in deltas if d.get("content")]) >= 1
    # Its metrics, read through the adapter's mapping. On connections of their own: under
    # load llama-server may close a keep-alive connection just after a stream ends, and a
    # plain client that reuses it fails (the router's pool retries such a request).
    load = engines.parse_load(
        httpx.get(base + "/metrics", timeout=60).text, engines.metric_names("llama-server")
    )
    assert load.running == 0.0 and load.waiting == 0.0 and load.kv_usage is None
    assert engines.slots_usage(httpx.get(base + "/slots", timeout=60).json()) == 0.0

    cluster.ctl("shard", "stop", "cpu-1", shard_id)
    wait_for("llama-server gone", lambda: not any(alive(p) for p in pids), 15)
    assert shard_id not in {s["shard_id"] for s in cluster.nodes()["cpu-1"]["shards"]}
