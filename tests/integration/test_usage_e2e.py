"""Usage end to end: two tenants' streamed (with and without include_usage) and plain
requests through llmgw-cp's router to a real llama-server; `ctl usage` totals equal the
engine's own usage figures, and a client that did not ask for the usage chunk gets none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import llama_server_binary, ready_shards

from llmgw.testing.cluster import LocalCluster, wait_for

PROMPTS = ["hello", "tell me a story", "what is two plus two", "hi"]


def totals(cluster: LocalCluster, tenant: str) -> dict[str, int]:
    data = json.loads(cluster.ctl("usage", "--tenant", tenant, "--since", "24h", "--json").stdout)
    assert all(r["tenant"] == tenant for r in data["rows"])
    return dict(data["totals"])


@pytest.mark.slow
def test_ctl_usage_totals_equal_the_engines_figures(
    cluster: LocalCluster, tiny_model: Path
) -> None:
    binary = llama_server_binary()
    cluster.models = [
        {
            "name": "tiny",
            "source": str(tiny_model),
            "replicas": 1,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "engine_args": ["--ctx-size", "512", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.router_extra = {"usage_flush_s": 0.2}
    cluster.setup(["cpu-1"])
    cluster.write_agent_config("cpu-1", engine_paths={"llama-server": binary})
    cluster.start_cp()
    cluster.start_agent("cpu-1")
    keys = {t: cluster.api_key(t) for t in ("team-a", "team-b")}
    clients = {
        t: openai.OpenAI(base_url=cluster.router_url, api_key=k, max_retries=0, timeout=60)
        for t, k in keys.items()
    }
    wait_for(
        "the model listed by the router",
        lambda: [m.id for m in clients["team-a"].models.list().data] == ["tiny"],
        120,
    )
    (_, shard), *_ = ready_shards(cluster)
    engine = httpx.Client(base_url=f"http://127.0.0.1:{shard['port']}", timeout=60)

    def direct(messages: list[dict[str, str]], max_tokens: int) -> tuple[str, dict[str, Any]]:
        """The same request straight to the engine (not counted by the router), with
        its usage chunk: the engine's own figures for it, and the text it wrote."""
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, usage = "", None
        with engine.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                usage = chunk.get("usage") or usage
        assert usage is not None
        return text, usage

    expected = {t: {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0} for t in keys}

    def count(tenant: str, prompt: int, completion: int) -> None:
        expected[tenant]["requests"] += 1
        expected[tenant]["prompt_tokens"] += prompt
        expected[tenant]["completion_tokens"] += completion

    for i, prompt in enumerate(PROMPTS):
        for tenant, client in clients.items():
            messages = [{"role": "user", "content": f"{tenant}: {prompt}"}]
            max_tokens = 3 + i + (tenant == "team-b")
            # Plain: the usage is in the answer.
            plain = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
            )
            assert plain.usage is not None
            count(tenant, plain.usage.prompt_tokens, plain.usage.completion_tokens)
            # Streamed, asking for usage: the last chunk carries it.
            asked = list(
                client.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = asked[-1].usage
            assert usage is not None and asked[-1].choices == []
            count(tenant, usage.prompt_tokens, usage.completion_tokens)
            # Streamed, not asking: no usage chunk reaches the client; the engine's figures
            # come from the same greedy request sent to it directly, checked to be the same
            # answer (same text, so the same tokens).
            with httpx.stream(
                "POST",
                cluster.router_url + "/chat/completions",
                headers={"Authorization": f"Bearer {keys[tenant]}"},
                json={
                    "model": "tiny",
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                },
                timeout=60,
            ) as resp:
                assert resp.status_code == 200
                raw = b"".join(resp.iter_bytes())
            assert b'"usage"' not in raw
            events = [e for e in raw.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
            assert all(c["choices"] for c in chunks)  # no usage-only chunk
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            same_text, figures = direct(messages, max_tokens)
            assert text == same_text
            count(tenant, figures["prompt_tokens"], figures["completion_tokens"])

    print("expected usage:", expected)
    assert expected["team-a"] != expected["team-b"]
    for tenant, want in expected.items():
        assert want["requests"] == 3 * len(PROMPTS)

        def arrived(t: str = tenant, w: dict[str, int] = want) -> bool:
            return totals(cluster, t) == w

        wait_for(f"ctl usage totals for {tenant}: {want}", arrived, 30)
    everything = json.loads(cluster.ctl("usage", "--json").stdout)
    assert everything["totals"] == {
        k: expected["team-a"][k] + expected["team-b"][k] for k in expected["team-a"]
    }
    models = {r["model"] for r in everything["rows"]}
    assert models == {"tiny"}
