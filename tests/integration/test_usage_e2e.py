"""Usage end to end: two tenants' streamed (with and without include_usage) and plain
requests through llmgw-cp's router to a real llama-server; `ctl usage` totals equal the
engine's own usage figures, and a client that did not ask for the usage chunk gets the
engine's stream as it sends it (its `timings` included). The same for a vLLM-shaped
stream (tests/data/vllm-chat-stream-*.sse, replayed by the fake engine)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import FIXTURES, llama_server_binary, ready_shards

from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for

PROMPTS = ["hello", "tell me a story", "what is two plus two", "hi"]


# What differs between two sends of one greedy request to llama-server, and nothing else:
# the completion's id, its creation time, and the measured `timings` (durations, rates,
# and how the prompt splits between cache_n and prompt_n, which depends on what the
# slot's cache held). The tokens are compared apart (`timings_tokens`).
_ID = re.compile(rb'"id":"chatcmpl-[A-Za-z0-9]+"')
_CREATED = re.compile(rb'"created":\d+')
_TIMINGS = re.compile(rb'"timings":\{[^{}]*\}')
_NUMBER = re.compile(rb"(?<=:)-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def unmeasured(stream: bytes) -> bytes:
    """`stream` with its id, creation time and timing values replaced by placeholders:
    the keys, their order and every other byte kept."""
    stream = _ID.sub(b'"id":"ID"', stream)
    stream = _CREATED.sub(b'"created":T', stream)
    return _TIMINGS.sub(lambda m: _NUMBER.sub(b"N", m.group(0)), stream)


def timings_tokens(stream: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens in the stream's `timings`: cache_n + prompt_n, predicted_n."""
    found = _TIMINGS.findall(stream)
    assert len(found) == 1, found
    timings = json.loads(found[0].removeprefix(b'"timings":'))
    return timings["cache_n"] + timings["prompt_n"], timings["predicted_n"]


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
    # A connection per request: llama-server closes an idle kept-alive connection after a
    # few seconds, and a request sent on one as it closes fails with "Server disconnected
    # without sending a response" (it did once, on a busy machine).
    engine = httpx.Client(
        base_url=f"http://127.0.0.1:{shard['port']}",
        timeout=60,
        limits=httpx.Limits(max_keepalive_connections=0),
    )

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

    def direct_raw(messages: list[dict[str, str]], max_tokens: int) -> bytes:
        """The bytes of the same request straight to the engine, not asking for usage."""
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        with engine.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            return b"".join(resp.iter_bytes())

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
            # Streamed, not asking: the client gets the bytes the engine sends the same
            # request sent straight to it (ids, times and timing values aside), `timings`
            # included, and no usage chunk; the engine's figures come from the same greedy
            # request sent to it directly asking for usage, checked to be the same answer
            # (same text, so the same tokens).
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
            straight = direct_raw(messages, max_tokens)
            assert b'"timings":{"cache_n":' in raw
            assert unmeasured(raw) == unmeasured(straight)
            assert raw != straight  # (the placeholders hid something: the ids at least)
            events = [e for e in raw.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
            assert all(c["choices"] for c in chunks)  # no usage-only chunk
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            same_text, figures = direct(messages, max_tokens)
            assert text == same_text
            assert timings_tokens(raw) == (figures["prompt_tokens"], figures["completion_tokens"])
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


@pytest.mark.slow
def test_a_vllm_shaped_stream_reaches_the_client_as_vllm_sends_it_and_is_counted(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A fake vLLM that answers with the recorded shapes (asked: `"usage":null` in every
    chunk and a usage event; unasked: neither): through llmgw-cp's router a client that
    asked for nothing gets the unasked bytes exactly, and `ctl usage` counts the tokens
    of the usage event the router asked for."""
    plain = FIXTURES / "vllm-chat-stream-no-usage.sse"
    asked = FIXTURES / "vllm-chat-stream-include-usage.sse"
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi.install(bin_dir)
    vllm = fake_engine.install(bin_dir, "vllm")
    cluster.models = [
        {
            "name": "qwen",
            "source": "llmgw-test/qwen",  # a hub id: the fake engine reads no weights
            "replicas": 1,
            "profiles": [
                {
                    "engine": "vllm",
                    "gpu_class": "h100-80g",
                    "gpus_per_node": 1,
                    "startup_timeout_s": 30,
                }
            ],
        }
    ]
    cluster.router_extra = {"usage_flush_s": 0.2}
    cluster.setup(["gpu-1"])
    cluster.write_agent_config("gpu-1", engine_paths={"vllm": str(vllm)})
    cluster.start_cp()
    cluster.start_agent(
        "gpu-1",
        env={
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "LLMGW_FAKE_GPUS": "1xh100-80g",
            "LLMGW_FAKE_REPLAY": str(plain),
            "LLMGW_FAKE_REPLAY_USAGE": str(asked),
        },
    )
    key = cluster.api_key("team-v")
    client = openai.OpenAI(base_url=cluster.router_url, api_key=key, max_retries=0, timeout=60)
    wait_for(
        "the model listed by the router",
        lambda: [m.id for m in client.models.list().data] == ["qwen"],
        60,
    )
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", cluster.router_url + "/chat/completions", headers=headers, json=body, timeout=60
    ) as resp:
        assert resp.status_code == 200
        raw = b"".join(resp.iter_bytes())
    assert raw == plain.read_bytes()
    # A client that asks gets vLLM's asked stream as it was; both are counted.
    body["stream_options"] = {"include_usage": True}
    with httpx.stream(
        "POST", cluster.router_url + "/chat/completions", headers=headers, json=body, timeout=60
    ) as resp:
        assert resp.status_code == 200
        assert b"".join(resp.iter_bytes()) == asked.read_bytes()
    want = {"requests": 2, "prompt_tokens": 2 * 20, "completion_tokens": 2 * 6}
    wait_for(f"ctl usage totals for team-v: {want}", lambda: totals(cluster, "team-v") == want, 30)
