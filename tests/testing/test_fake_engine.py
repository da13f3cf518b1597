"""The fake inference engine: real processes on loopback, spoken to with httpx.

The pure parts (command lines, help, bodies, load counters) are checked in
process; everything a client can observe is checked against a running
`python -m llmgw.testing.fake_engine` bound to a free port.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from llmgw.errors import UsageError
from llmgw.testing import fake_engine
from llmgw.testing._fake_engine_cli import (
    FakeConfig,
    HelpRequest,
    choose_engine,
    help_text,
    parse_command_line,
    read_behaviour,
)
from llmgw.testing._fake_engine_wire import (
    EngineState,
    GenRequest,
    PrefixCache,
    Reply,
    block_chain,
    chat_prompt_token_ids,
    chat_prompt_tokens,
    read_generation,
)

LISTENING = re.compile(rb"(?:Uvicorn running on|server is listening on) http://127\.0\.0\.1:(\d+)")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "say something"}]}


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_FAKE")}
    env.update(extra or {})
    return env


class EngineProcess:
    """A fake engine process: its URL, an httpx client, and what it printed."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.stdout = b""
        self.url = ""
        self.client = httpx.AsyncClient(timeout=10)

    async def read_stdout_until(
        self, pattern: re.Pattern[bytes], timeout: float = 10
    ) -> re.Match[bytes]:
        assert self.proc.stdout is not None
        with trio.fail_after(timeout):
            while not (m := pattern.search(self.stdout)):
                chunk = await self.proc.stdout.receive_some()
                assert chunk, f"stdout closed before {pattern.pattern!r}: {self.stdout!r}"
                self.stdout += chunk
        return m

    async def stderr(self) -> str:
        assert self.proc.stderr is not None
        data = b""
        while chunk := await self.proc.stderr.receive_some():
            data += chunk
        return data.decode()

    async def get(self, path: str) -> httpx.Response:
        return await self.client.get(self.url + path)

    async def post(self, path: str, body: object) -> httpx.Response:
        return await self.client.post(self.url + path, json=body)

    async def stats(self) -> dict[str, int]:
        return (await self.get("/fake/stats")).json()  # type: ignore[no-any-return]

    async def wait_stats(self, **want: int) -> dict[str, int]:
        """Poll /fake/stats until every named counter has the wanted value."""
        with trio.fail_after(10):
            while True:
                stats = await self.stats()
                if all(stats[k] == v for k, v in want.items()):
                    return stats
                await trio.sleep(0.02)


@asynccontextmanager
async def engine(
    *args: str, env: Mapping[str, str] | None = None, command: Sequence[str] | None = None
) -> AsyncIterator[EngineProcess]:
    argv = [*(command or [sys.executable, "-m", "llmgw.testing.fake_engine"]), *args]
    argv += ["--host", "127.0.0.1", "--port", "0"]
    proc = await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(env)
    )
    run = EngineProcess(proc)
    try:
        port = int((await run.read_stdout_until(LISTENING)).group(1))
        run.url = f"http://127.0.0.1:{port}"
        yield run
    finally:
        await run.client.aclose()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(5):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) for each SSE event."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield trio.current_time(), line[len("data: ") :]


def content(event: str) -> str:
    if event == "[DONE]":
        return ""
    choices = json.loads(event)["choices"]
    return choices[0]["delta"].get("content", "") if choices else ""


def metrics(text: str) -> dict[str, float]:
    """Sample name -> value; the text must parse as Prometheus exposition."""
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


# --- command lines and help, in process ---------------------------------------------------


def test_vllm_help_lists_every_flag_llmgw_may_pass() -> None:
    text = help_text("vllm", {}).decode()
    assert text.startswith("usage: vllm serve [model_tag] [options]")
    for flag in ("--host", "--port", "--served-model-name", "--tensor-parallel-size",
                 "--pipeline-parallel-size", "--distributed-executor-backend", "--nnodes",
                 "--node-rank", "--master-addr", "--master-port", "--headless", "--quantization",
                 "--max-model-len", "--gpu-memory-utilization"):  # fmt: skip
        assert re.search(rf"^  {flag}\b", text, re.M), flag


def test_llama_and_sglang_help_list_their_flags() -> None:
    llama = help_text("llama-server", {}).decode()
    for line in ("-m,    --model FNAME", "--host HOST", "--port PORT", "-a,    --alias STRING",
                 "--jinja, --no-jinja", "--metrics", "-c,    --ctx-size N",
                 "-ngl,  --gpu-layers, --n-gpu-layers N", "-t,    --threads N", "--slots, --no-slots",
                 "(env: LLAMA_ARG_N_PARALLEL)"):  # fmt: skip
        assert line in llama, line
    sglang = help_text("sglang", {}).decode()
    for flag in ("--model-path", "--host", "--port", "--tp", "--nnodes", "--node-rank",
                 "--dist-init-addr", "--served-model-name", "--enable-metrics"):  # fmt: skip
        assert re.search(rf"(?<![\w-]){flag}(?![\w-])", sglang), flag


def test_help_rename_and_truncate() -> None:
    renamed = help_text("vllm", {"LLMGW_FAKE_HELP_RENAME": "--headless=--no-api-server"}).decode()
    assert "--no-api-server" in renamed
    assert "--headless" not in renamed
    # Only the whole flag: --master-addr is not touched by renaming --master-port.
    renamed = help_text("vllm", {"LLMGW_FAKE_HELP_RENAME": "--master-port=--dist-port"}).decode()
    assert "--dist-port DIST_PORT" not in renamed and "--dist-port MASTER_PORT" in renamed
    assert "--master-addr MASTER_ADDR" in renamed
    full = help_text("llama-server", {})
    cut = help_text("llama-server", {"LLMGW_FAKE_HELP_TRUNCATE": "100"})
    assert cut == full[:100] and len(full) > 1000
    with pytest.raises(UsageError, match="LLMGW_FAKE_HELP_RENAME"):
        help_text("vllm", {"LLMGW_FAKE_HELP_RENAME": "headless"})


def test_main_prints_help_and_exits_0(
    capsysbinary: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_FAKE_HELP_TRUNCATE", "40")
    assert fake_engine.main(["serve", "--help"], prog="/opt/bin/vllm") == 0
    assert capsysbinary.readouterr().out == help_text("vllm", {})[:40]


@pytest.mark.parametrize(
    ("argv", "prog", "env", "engine"),
    [
        (["serve", "m"], "/usr/local/bin/vllm", {}, "vllm"),
        (["-m", "x.gguf"], "/usr/bin/llama-server", {}, "llama-server"),
        (["serve", "m"], "python", {}, "vllm"),
        (["--model-path", "m"], "python", {}, "sglang"),
        (["-m", "x.gguf"], "python", {}, "llama-server"),
        (["serve", "m"], "vllm", {"LLMGW_FAKE_ENGINE": "sglang"}, "sglang"),
        (
            ["--fake-engine", "llama-server", "serve"],
            "vllm",
            {"LLMGW_FAKE_ENGINE": "sglang"},
            "llama-server",
        ),
    ],
)
def test_engine_choice_order(argv: list[str], prog: str, env: dict[str, str], engine: str) -> None:
    assert choose_engine(argv, prog, env)[0] == engine


def test_engine_choice_refuses_what_it_cannot_tell() -> None:
    with pytest.raises(UsageError, match="cannot tell which engine"):
        choose_engine(["--port", "1"], "python", {})
    with pytest.raises(UsageError, match="'tgi'; it must be one of vllm, llama-server, sglang"):
        choose_engine(["--fake-engine", "tgi"], "python", {})


def test_command_lines_are_read_and_unknown_flags_ignored() -> None:
    b = read_behaviour({"LLMGW_FAKE_SLOTS": "3"})
    vllm = parse_command_line(
        ["serve", "org/m", "--served-model-name", "a", "b", "--tensor-parallel-size", "2",
         "--some-future-flag", "x", "--headless", "--max-num-seqs", "8"],
        "vllm", {}, b,
    )  # fmt: skip
    assert isinstance(vllm, FakeConfig)
    assert (vllm.model, vllm.served_names, vllm.slots, vllm.host, vllm.port) == (
        "org/m", ("a", "b"), 8, "0.0.0.0", 8000)  # fmt: skip
    llama = parse_command_line(
        ["-m", "/m/x.gguf", "-a", "x", "--jinja", "--metrics", "-ngl", "99", "-c", "8192",
         "--port", "9"], "llama-server", {}, b,
    )  # fmt: skip
    assert isinstance(llama, FakeConfig)
    # No -np: LLMGW_FAKE_SLOTS decides; -c is shared among the slots, as llama-server does.
    assert (llama.served_names, llama.slots, llama.ctx_per_slot, llama.metrics_enabled) == (
        ("x",), 3, 2730, True)  # fmt: skip
    assert (llama.host, llama.port, llama.slots_endpoint, llama.embeddings_enabled) == (
        "127.0.0.1", 9, True, False)  # fmt: skip
    sglang = parse_command_line(
        ["--model-path", "m", "--tp", "2"], "python", {"LLMGW_FAKE_ENGINE": "sglang"}, b
    )
    assert isinstance(sglang, FakeConfig)
    assert (sglang.served_names, sglang.metrics_enabled, sglang.port) == (("m",), False, 30000)
    with pytest.raises(UsageError, match="vllm serve needs a model"):
        parse_command_line(["serve"], "vllm", {}, b)
    assert isinstance(parse_command_line(["--help=all"], "vllm", {}, b), HelpRequest)


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("LLMGW_FAKE_TOKENS", "many", "it must be a whole number"),
        ("LLMGW_FAKE_TOKEN_DELAY", "-1", "it must be at least 0.0"),
        ("LLMGW_FAKE_FAIL_RATE", "1.5", "it must be between 0 and 1"),
        ("LLMGW_FAKE_HEALTH_HANG_AFTER", "-2", "it must be at least 0.0"),
        ("LLMGW_FAKE_PREFIX_CACHE_TOKENS", "lots", "it must be a whole number"),
        ("LLMGW_FAKE_PREFIX_CACHE_TOKENS", "8", "it must be 0 (no prefix cache) or at least 16"),
        ("LLMGW_FAKE_PREFILL_TOKEN_DELAY", "-0.1", "it must be at least 0.0"),
    ],
)
def test_bad_switches_exit_2_naming_the_variable(
    name: str, value: str, problem: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv(name, value)
    assert fake_engine.main(["serve", "m"], prog="vllm") == 2
    err = capsys.readouterr().err
    assert name in err and problem in err


def test_fail_rate_is_spread_evenly() -> None:
    state = EngineState(slots=1, kv_tokens=100)
    assert [state.should_fail(0.5) for _ in range(6)] == [False, True] * 3
    state = EngineState(slots=1, kv_tokens=100)
    assert sum(state.should_fail(0.1) for _ in range(100)) == 10
    assert not any(EngineState(1, 1).should_fail(0.0) for _ in range(10))


def test_context_length_is_enforced() -> None:
    config = parse_command_line(
        ["serve", "m", "--max-model-len", "10"], "vllm", {}, read_behaviour({})
    )
    assert isinstance(config, FakeConfig)
    body = json.dumps({"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 5})
    refused = read_generation(config, "chat", body.encode(), tokens=16)
    assert isinstance(refused, Reply) and refused.status == 400
    assert "maximum context length is 10 tokens" in json.loads(refused.body)["error"]["message"]
    # Without max_tokens the completion stops at the context: 10 - (3 words + 3) = 4 tokens.
    body = json.dumps({"messages": [{"role": "user", "content": "a b c"}]})
    fits = read_generation(config, "chat", body.encode(), tokens=16)
    assert isinstance(fits, GenRequest)
    assert (fits.prompt_tokens, fits.n_tokens, fits.finish_reason) == (6, 4, "length")


def test_crash_lines_end_with_the_message_asked_for() -> None:
    assert fake_engine.crash_lines("vllm", None)[-1] == (
        "RuntimeError: CUDA error: an illegal memory access was encountered")  # fmt: skip
    assert fake_engine.crash_lines("llama-server", "boom")[-1] == "boom"


# --- real processes -------------------------------------------------------------------------


async def test_loading_then_ready() -> None:
    env = {"LLMGW_FAKE_LOAD_DELAY": "1.0"}
    async with engine("serve", "org/m", "--served-model-name", "m", "m2", env=env) as e:
        started = trio.current_time()
        assert (await e.get("/health")).status_code == 503
        assert (await e.get("/v1/models")).json() == {"object": "list", "data": []}
        early = await e.post("/v1/chat/completions", CHAT)
        assert early.status_code == 503 and early.json()["error"]["code"] == 503
        with trio.fail_after(10):
            while (await e.get("/health")).status_code != 200:
                await trio.sleep(0.05)
        assert trio.current_time() - started >= 0.5
        models = (await e.get("/v1/models")).json()["data"]
        assert [(m["id"], m["root"], m["owned_by"]) for m in models] == [
            ("m", "org/m", "vllm"), ("m2", "org/m", "vllm")]  # fmt: skip
        ok = await e.post("/v1/chat/completions", {**CHAT, "model": "m2"})
        assert ok.status_code == 200 and ok.json()["model"] == "m2"
        stats = await e.stats()
        assert (stats["received"], stats["completed"], stats["failed"]) == (2, 1, 1)
        await e.read_stdout_until(re.compile(rb"Application startup complete"))


async def test_health_hangs_on_request_while_everything_else_answers() -> None:
    async with engine("serve", "m") as e:
        assert (await e.get("/health")).status_code == 200
        assert (await e.post("/fake/health", {"hang": True})).json() == {"hang": True}
        with pytest.raises(httpx.ReadTimeout):
            await e.client.get(e.url + "/health", timeout=0.5)
        # Hung, not dead: the rest of it still serves.
        assert (await e.get("/v1/models")).json()["data"][0]["id"] == "m"
        assert (await e.post("/v1/completions", {"model": "m", "prompt": "hi"})).status_code == 200
        bad = await e.post("/fake/health", {"hang": "yes"})
        assert bad.status_code == 400 and "hang" in bad.json()["error"]["message"]
        assert (await e.post("/fake/health", {"hang": False})).json() == {"hang": False}
        assert (await e.get("/health")).status_code == 200


async def test_tokens_hang_on_request_while_health_and_metrics_answer() -> None:
    """A wedged engine: `/fake/tokens {"hang": true}` stops every generation before its
    next token, a streamed one after its head; /health and /metrics answer as before."""
    async with engine("serve", "m", env={"LLMGW_FAKE_TOKENS": "3"}) as e:
        assert (await e.post("/fake/tokens", {"hang": True})).json() == {"hang": True}
        with pytest.raises(httpx.ReadTimeout):
            await e.client.post(e.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                                timeout=0.5)  # fmt: skip
        body = {"model": "m", "prompt": "x", "stream": True}
        async with e.client.stream(
            "POST", e.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5)
        ) as streamed:
            assert streamed.status_code == 200  # the head came, no token follows
            with pytest.raises(httpx.ReadTimeout):
                await streamed.aiter_lines().__anext__()
        assert (await e.get("/health")).status_code == 200
        assert (await e.get("/metrics")).status_code == 200
        bad = await e.post("/fake/tokens", {"hang": "yes"})
        assert bad.status_code == 400 and "hang" in bad.json()["error"]["message"]
        assert (await e.post("/fake/tokens", {"hang": False})).json() == {"hang": False}
        r = await e.post("/v1/completions", {"model": "m", "prompt": "x"})
        assert r.json()["choices"][0]["text"] == "tok0 tok1 tok2"
        stats = await e.stats()
        assert stats["generation_tokens"] == 3 and stats["probes"] == 0


async def test_the_agents_probe_is_answered_and_counted_apart() -> None:
    probe = {"x-llmgw-probe": "1"}
    async with engine("serve", "m", env={"LLMGW_FAKE_FAIL_RATE": "1"}) as e:
        body = {"model": "m", "prompt": "a", "max_tokens": 1}
        r = await e.client.post(e.url + "/v1/completions", json=body, headers=probe)
        assert r.status_code == 200  # never failed by LLMGW_FAKE_FAIL_RATE
        assert r.json()["choices"][0]["text"] == "tok0"
        assert r.json()["usage"]["completion_tokens"] == 1
        stats = await e.stats()
        assert stats["probes"] == 1
        assert (stats["received"], stats["completed"], stats["generation_tokens"]) == (0, 0, 0)
        assert (await e.post("/fake/tokens", {"hang": True})).status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # wedged like any generation
            await e.client.post(e.url + "/v1/completions", json=body, headers=probe, timeout=0.5)


async def test_health_hang_after_starts_hanging_on_its_own() -> None:
    async with engine("serve", "m", env={"LLMGW_FAKE_HEALTH_HANG_AFTER": "0.5"}) as e:
        started = trio.current_time()
        assert (await e.get("/health")).status_code == 200
        with trio.fail_after(10):
            while True:
                try:
                    await e.client.get(e.url + "/health", timeout=0.3)
                except httpx.ReadTimeout:
                    break
                await trio.sleep(0.05)
        assert trio.current_time() - started >= 0.5


async def test_chat_and_completions_non_streaming_and_errors() -> None:
    async with engine("serve", "m", env={"LLMGW_FAKE_TOKENS": "5"}) as e:
        r = await e.post("/v1/chat/completions", CHAT)
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": "tok0 tok1 tok2 tok3 tok4",
        }
        assert body["choices"][0]["finish_reason"] == "stop"
        # "say something": 2 words + 3 for the message.
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}

        r = await e.post(
            "/v1/completions", {"model": "m", "prompt": "one two three", "max_tokens": 2}
        )
        choice = r.json()["choices"][0]
        assert (r.json()["object"], choice["text"], choice["finish_reason"]) == (
            "text_completion", "tok0 tok1", "length")  # fmt: skip
        assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

        r = await e.post("/v1/chat/completions", {**CHAT, "model": "other"})
        assert r.status_code == 404
        assert r.json()["error"] == {"message": "The model `other` does not exist.",
                                     "type": "NotFoundError", "param": "model", "code": 404}  # fmt: skip
        bad = await e.client.post(e.url + "/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
        missing = await e.post("/v1/chat/completions", {"model": "m"})
        assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
        assert (await e.get("/nowhere")).status_code == 404
        stats = await e.stats()
        assert (stats["received"], stats["completed"], stats["failed"]) == (5, 2, 3)
        # No prefix cache unless asked for: no cached figures anywhere, not even zeros.
        assert "prompt_tokens_cached" not in stats
        assert "prefix_cache" not in (await e.get("/metrics")).text


async def test_streaming_chunks_arrive_as_they_are_generated() -> None:
    env = {
        "LLMGW_FAKE_TOKENS": "5",
        "LLMGW_FAKE_TOKEN_DELAY": "0.15",
        "LLMGW_FAKE_FIRST_TOKEN_DELAY": "0.3",
    }
    async with engine("serve", "m", env=env) as e:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        events: list[tuple[float, str]] = []
        asked = trio.current_time()
        async with e.client.stream("POST", e.url + "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            async for ev in sse_events(r):
                events.append(ev)
        data = [d for _, d in events]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(content(d) for d in data) == "tok0 tok1 tok2 tok3 tok4"
        token_chunks = [
            c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
        ]
        assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 4 + ["stop"]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 5,
            "total_tokens": 10,
        }
        # Streamed, not buffered: the first token arrived while the last was 4 delays away.
        times = [t for t, d in events if content(d)]
        assert times[0] - asked >= 0.3
        assert times[-1] - times[0] >= 4 * 0.15 * 0.5


async def test_completions_stream_without_usage() -> None:
    async with engine("serve", "m", env={"LLMGW_FAKE_TOKENS": "3"}) as e:
        body = {"model": "m", "prompt": "x", "stream": True}
        async with e.client.stream("POST", e.url + "/v1/completions", json=body) as r:
            data = [d async for _, d in sse_events(r)]
        chunks = [json.loads(d) for d in data[:-1]]
        assert data[-1] == "[DONE]" and all("usage" not in c for c in chunks)
        assert [c["choices"][0]["text"] for c in chunks] == ["tok0", " tok1", " tok2"]
        assert chunks[-1]["object"] == "text_completion"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_replay_sends_the_recorded_stream_asked_and_not(tmp_path: Path) -> None:
    from helpers import FIXTURES

    plain = FIXTURES / "vllm-chat-stream-no-usage.sse"
    asked = FIXTURES / "vllm-chat-stream-include-usage.sse"
    env = {"LLMGW_FAKE_REPLAY": str(plain), "LLMGW_FAKE_REPLAY_USAGE": str(asked)}
    async with engine("serve", "m", env=env) as e:
        body: dict[str, object] = {"model": "m", "stream": True}
        body["messages"] = [{"role": "user", "content": "hi"}]
        got = await e.client.post(e.url + "/v1/chat/completions", json=body)
        assert got.status_code == 200 and got.content == plain.read_bytes()
        body["stream_options"] = {"include_usage": True}
        got = await e.client.post(e.url + "/v1/completions", json={**body, "prompt": "x"})
        assert got.status_code == 200 and got.content == asked.read_bytes()
        # A whole answer is generated as usual.
        whole = await e.client.post(e.url + "/v1/chat/completions", json={**body, "stream": False})
        assert whole.json()["choices"][0]["message"]["content"].startswith("tok0")
        await e.wait_stats(completed=3, in_flight=0)
    (tmp_path / "cut.sse").write_bytes(plain.read_bytes()[:-20])
    for value, problem in ((tmp_path / "none.sse", "cannot be read"),
                           (tmp_path / "cut.sse", "does not end with `data: \\[DONE\\]`")):  # fmt: skip
        with pytest.raises(UsageError, match=problem):
            read_behaviour({"LLMGW_FAKE_REPLAY_USAGE": str(value)})


async def test_embeddings_are_deterministic_unit_vectors() -> None:
    async with engine("serve", "m", env={"LLMGW_FAKE_EMBED_DIM": "8"}) as e:
        one = (await e.post("/v1/embeddings", {"model": "m", "input": "hello world"})).json()
        many = (await e.post("/v1/embeddings", {"input": ["hello world", "other"]})).json()
        b64 = (
            await e.post("/v1/embeddings", {"input": "hello world", "encoding_format": "base64"})
        ).json()
        assert one["object"] == "list" and one["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
        vec = one["data"][0]["embedding"]
        assert len(vec) == 8 and math.isclose(sum(x * x for x in vec), 1.0)
        assert [d["index"] for d in many["data"]] == [0, 1]
        assert many["data"][0]["embedding"] == vec != many["data"][1]["embedding"]
        unpacked = struct.unpack("<8f", base64.b64decode(b64["data"][0]["embedding"]))
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(unpacked, vec, strict=True))


async def test_vllm_metrics_follow_in_flight_requests_and_disconnects_cancel() -> None:
    env = {"LLMGW_FAKE_SLOTS": "2", "LLMGW_FAKE_TOKENS": "1000", "LLMGW_FAKE_TOKEN_DELAY": "0.05"}
    async with engine("serve", "m", env=env) as e:
        before = metrics((await e.get("/metrics")).text)
        assert before["vllm:num_requests_running"] == 0 and before["vllm:kv_cache_usage_perc"] == 0
        release = trio.Event()

        async def stream() -> None:
            body = {**CHAT, "stream": True}
            async with e.client.stream("POST", e.url + "/v1/chat/completions", json=body):
                await release.wait()  # leaving closes the connection mid-stream

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(stream)
            await e.wait_stats(running=2, waiting=1, in_flight=3)
            text = (await e.get("/metrics")).text
            m = metrics(text)
            assert m["vllm:num_requests_running"] == 2 and m["vllm:num_requests_waiting"] == 1
            assert 0 < m["vllm:kv_cache_usage_perc"] < 1
            assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in text
            release.set()
        stats = await e.wait_stats(cancelled=3, in_flight=0)
        assert (stats["completed"], stats["running"], stats["waiting"]) == (0, 0, 0)
        after = metrics((await e.get("/metrics")).text)
        assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


async def test_non_streaming_client_timeout_cancels_the_generation() -> None:
    env = {"LLMGW_FAKE_TOKENS": "1000", "LLMGW_FAKE_TOKEN_DELAY": "0.05"}
    async with engine("serve", "m", env=env) as e:
        with pytest.raises(httpx.ReadTimeout):
            await e.client.post(e.url + "/v1/chat/completions", json=CHAT, timeout=0.5)
        stats = await e.wait_stats(cancelled=1)
        assert (stats["received"], stats["completed"], stats["in_flight"]) == (1, 0, 0)


async def test_hang_after_tokens_keeps_the_stream_open_silently(tmp_path: Path) -> None:
    env = {"LLMGW_FAKE_HANG_AFTER_TOKENS": "2"}
    async with engine("serve", "m", env=env) as e:
        got: list[str] = []
        async with e.client.stream(
            "POST", e.url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as r:
            with trio.move_on_after(0.7):
                async for _, d in sse_events(r):
                    got.append(content(d))
        assert "".join(got) == "tok0 tok1"
        stats = await e.wait_stats(cancelled=1)
        assert stats["completed"] == 0


async def test_llama_server_slots_and_metrics_without_kv_gauge(tmp_path: Path) -> None:
    wrapper = fake_engine.install(tmp_path / "bin", "llama-server")
    env = {"LLMGW_FAKE_TOKENS": "1000", "LLMGW_FAKE_TOKEN_DELAY": "0.05"}
    args = ("-m", "/models/x.gguf", "-a", "small", "--metrics", "-np", "2", "--jinja", "-ngl", "99")
    async with engine(*args, env=env, command=[str(wrapper)]) as e:
        assert (await e.get("/health")).json() == {"status": "ok"}
        assert [m["id"] for m in (await e.get("/v1/models")).json()["data"]] == ["small"]
        # llama-server serves its one model whatever the request calls it.
        ok = await e.post("/v1/completions", {"model": "anything", "prompt": "x", "max_tokens": 2})
        assert ok.json()["choices"][0]["text"] == "tok0 tok1"
        release = trio.Event()

        async def stream() -> None:
            body = {**CHAT, "stream": True}
            async with e.client.stream("POST", e.url + "/v1/chat/completions", json=body):
                await release.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            await e.wait_stats(running=1)
            slots = (await e.get("/slots")).json()
            assert [(s["id"], s["is_processing"], s["n_ctx"]) for s in slots] == [
                (0, True, 4096), (1, False, 4096)]  # fmt: skip
            text = (await e.get("/metrics")).text
            m = metrics(text)
            assert m["llamacpp:requests_processing"] == 1 and m["llamacpp:requests_deferred"] == 0
            assert "kv" not in text
            release.set()
        await e.wait_stats(cancelled=1, running=0)


async def test_llama_server_endpoints_off_unless_asked_for() -> None:
    async with engine("-m", "x.gguf", "--no-slots", env={"LLMGW_FAKE_ENGINE": "llama-server"}) as e:
        for path, flag in (("/metrics", "--metrics"), ("/slots", "--slots")):
            r = await e.get(path)
            assert r.status_code == 501 and flag in r.json()["error"]["message"]
        r = await e.post("/v1/embeddings", {"input": "x"})
        assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]


async def test_sglang_metrics_names() -> None:
    env = {"LLMGW_FAKE_TOKENS": "1000", "LLMGW_FAKE_TOKEN_DELAY": "0.05", "LLMGW_FAKE_SLOTS": "1"}
    args = ("--fake-engine", "sglang", "--model-path", "org/m", "--served-model-name", "m",
            "--tp", "2", "--enable-metrics")  # fmt: skip
    async with engine(*args, env=env) as e:
        release = trio.Event()

        async def stream() -> None:
            body = {**CHAT, "stream": True}
            async with e.client.stream("POST", e.url + "/v1/chat/completions", json=body):
                await release.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            nursery.start_soon(stream)
            await e.wait_stats(running=1, waiting=1)
            m = metrics((await e.get("/metrics")).text)
            assert (m["sglang:num_running_reqs"], m["sglang:num_queue_reqs"]) == (1, 1)
            assert 0 < m["sglang:token_usage"] < 1
            release.set()


async def test_fail_rate_one_answers_500_in_openai_shape() -> None:
    async with engine("serve", "m", env={"LLMGW_FAKE_FAIL_RATE": "1"}) as e:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/embeddings", {"input": "x"})):
            r = await e.post(path, body)
            assert r.status_code == 500
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("InternalServerError", 500) and err["message"]
        assert (await e.get("/health")).status_code == 200
        stats = await e.stats()
        assert (stats["received"], stats["failed"], stats["completed"]) == (2, 2, 0)


async def test_crash_after_exits_1_with_an_engine_error_on_stderr() -> None:
    async with engine("serve", "m", env={"LLMGW_FAKE_CRASH_AFTER": "0.3"}) as e:
        with trio.fail_after(10):
            await e.proc.wait()
        assert e.proc.returncode == 1
        lines = (await e.stderr()).splitlines()
        assert lines[-1] == "RuntimeError: CUDA error: an illegal memory access was encountered"
        assert "EngineCore encountered a fatal error." in lines[0]


async def test_sigterm_exits_0_promptly_with_requests_in_flight() -> None:
    env = {"LLMGW_FAKE_TOKENS": "1000", "LLMGW_FAKE_TOKEN_DELAY": "0.05"}
    async with engine("serve", "m", env=env) as e:
        async with e.client.stream(
            "POST", e.url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ):
            await e.wait_stats(running=1)
            sent = trio.current_time()
            e.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                await e.proc.wait()
            assert trio.current_time() - sent < 2
        assert e.proc.returncode == 0
        assert await e.stderr() == ""


async def test_log_every_prints_engine_statistics() -> None:
    async with engine("serve", "m", env={"LLMGW_FAKE_LOG_EVERY": "0.1"}) as e:
        await e.post("/v1/chat/completions", CHAT)
        line = await e.read_stdout_until(
            re.compile(rb"Engine 000: Avg prompt throughput: [^\n]*\n")
        )
        assert b"Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%" in line.group(0)


async def test_api_key_is_required_when_given() -> None:
    async with engine("serve", "m", "--api-key", "sekret") as e:
        assert (await e.post("/v1/chat/completions", CHAT)).status_code == 401
        r = await e.client.post(e.url + "/v1/chat/completions", json=CHAT,
                                headers={"Authorization": "Bearer sekret"})  # fmt: skip
        assert r.status_code == 200
        assert (await e.get("/health")).status_code == 200  # only /v1 is guarded, as in vLLM


def test_port_in_use_exits_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "llmgw.testing.fake_engine", "serve", "m", "--host", "127.0.0.1",
             "--port", str(port)],
            capture_output=True, text=True, env=clean_env(), timeout=20,
        )  # fmt: skip
    assert done.returncode == 1
    assert "address already in use" in done.stderr.lower() and str(port) in done.stderr


def test_installed_wrappers_answer_help_as_their_engine(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_engine.install(bin_dir, "vllm")
    fake_engine.install(bin_dir, "llama-server")
    env = clean_env({"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    vllm = subprocess.run(
        ["vllm", "serve", "--help"], capture_output=True, text=True, env=env, timeout=20
    )
    assert vllm.returncode == 0 and vllm.stdout.startswith("usage: vllm serve")
    llama = subprocess.run(
        ["llama-server", "--help"], capture_output=True, text=True, env=env, timeout=20
    )
    assert llama.returncode == 0 and llama.stdout.startswith("----- common params -----")
    version = subprocess.run(["llama-server", "--version"], capture_output=True, text=True,
                             env={**env, "LLMGW_FAKE_VERSION": "4242"}, timeout=20)  # fmt: skip
    assert version.returncode == 0 and version.stderr.startswith("version: 4242 ")


# --- the prefix cache ---------------------------------------------------------------------


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def chat(system: str, user: str, **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }


# 61 words + 3 markers: the system message is 4 whole blocks of 16 tokens.
SYSTEM_A, SYSTEM_B, SYSTEM_C = (words(61, tag) for tag in "abc")


def test_prefix_cache_matches_whole_leading_blocks_and_evicts_the_least_recent() -> None:
    a, b, c = (
        block_chain([t] * 3 + w.split())
        for t, w in zip("xyz", (SYSTEM_A, SYSTEM_B, SYSTEM_C), strict=True)
    )
    assert len(a) == 4
    cache = PrefixCache(capacity_tokens=128)  # room for two of these prompts
    assert cache.lookup(a, 64 + 5) == 0
    cache.insert(a)
    assert cache.lookup(a, 64 + 5) == 64
    # The whole prompt is never served from cache: at least one token is computed.
    assert cache.lookup(a, 64) == 48
    cache.insert(b)
    cache.insert(a)  # a is now the more recent of the two
    cache.insert(c)  # over capacity: b, the least recently used, goes
    assert (cache.lookup(a, 80), cache.lookup(b, 80), cache.lookup(c, 80)) == (64, 0, 64)
    assert (cache.tokens, cache.evicted) == (128, 4)
    assert (cache.queries, cache.hits) == (69 + 69 + 64 + 80 * 3, 64 + 48 + 64 + 64)
    # A prompt longer than the whole cache keeps its head.
    long = block_chain(words(16 * 20, "l").split())
    cache.insert(long)
    assert cache.lookup(long, 16 * 20) == 128 and cache.lookup(a, 80) == 0
    with pytest.raises(ValueError, match="at least 16"):
        PrefixCache(capacity_tokens=15)


def test_a_shared_prefix_is_held_once() -> None:
    # Two prompts sharing 3 of their 4 blocks take 5 blocks, not 8.
    head = words(48, "h").split()
    one, two = (
        block_chain(head + words(16, "p").split()),
        block_chain(head + words(16, "q").split()),
    )
    cache = PrefixCache(capacity_tokens=80)
    cache.insert(one)
    cache.insert(two)
    assert (cache.tokens, cache.evicted) == (80, 0)
    assert (cache.lookup(one, 65), cache.lookup(two, 65)) == (64, 64)


messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]),
         "content": st.text(alphabet="ab \n", max_size=60)}
    ),
    min_size=1,
    max_size=4,
)  # fmt: skip


@given(messages)
def test_chat_token_ids_are_the_tokens_counted(msgs: list[dict[str, str]]) -> None:
    assert len(chat_prompt_token_ids(msgs)) == chat_prompt_tokens(msgs)


@given(
    st.lists(st.sampled_from("abc"), max_size=80),
    st.lists(st.sampled_from("xyz"), min_size=1, max_size=40),
    st.lists(st.sampled_from("abc"), min_size=1, max_size=40),
)
def test_block_chains_agree_exactly_as_far_as_the_prompts_do(
    shared: list[str], tail_one: list[str], tail_two: list[str]
) -> None:
    one, two = block_chain(shared + tail_one), block_chain(shared + tail_two)
    whole = len(shared) // 16  # blocks entirely inside the shared prefix
    assert one[:whole] == two[:whole]
    # The block where they part (tail_one opens with a token tail_two never has) differs.
    if len(one) > whole and len(two) > whole:
        assert one[whole] != two[whole]


async def test_vllm_reports_cached_tokens_counts_them_and_evicts_lru() -> None:
    # Room for two 4-block system prompts.
    env = {"LLMGW_FAKE_TOKENS": "2", "LLMGW_FAKE_PREFIX_CACHE_TOKENS": "128"}
    async with engine("serve", "m", "--enable-prompt-tokens-details", env=env) as e:

        async def cached(system: str, user: str) -> int:
            r = await e.post("/v1/chat/completions", chat(system, user))
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            assert (u["prompt_tokens"], u["completion_tokens"]) == (64 + 5, 2)
            return int(u["prompt_tokens_details"]["cached_tokens"])

        # The first sight of a system prompt is all prefill; a sibling reuses its 64 tokens.
        assert await cached(SYSTEM_A, "first question") == 0
        assert await cached(SYSTEM_A, "second question") == 64
        assert await cached(SYSTEM_B, "first question") == 0
        assert await cached(SYSTEM_A, "third question") == 64  # A is now the more recent
        assert await cached(SYSTEM_C, "first question") == 0  # evicts B, the LRU
        assert await cached(SYSTEM_B, "again please") == 0
        assert await cached(SYSTEM_C, "again please") == 64
        stats = await e.stats()
        assert (stats["prompt_tokens"], stats["prompt_tokens_cached"]) == (7 * 69, 3 * 64)

        # Streamed: the usage chunk carries it too.
        body = chat(SYSTEM_C, "streamed now", stream=True, stream_options={"include_usage": True})
        async with e.client.stream("POST", e.url + "/v1/chat/completions", json=body) as r:
            data = [d async for _, d in sse_events(r)]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["usage"] == {
            "prompt_tokens": 69, "total_tokens": 71, "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 64}}  # fmt: skip
        m = metrics((await e.get("/metrics")).text)
        assert m["vllm:prefix_cache_queries_total"] == 8 * 69
        assert m["vllm:prefix_cache_hits_total"] == 4 * 64
        assert (await e.stats())["prompt_tokens_cached"] == 4 * 64


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("serve", "m"), "--enable-prompt-tokens-details"),
        (("--fake-engine", "sglang", "--model-path", "m"), "--enable-cache-report"),
    ],
)
async def test_vllm_and_sglang_report_cached_tokens_only_when_asked(
    argv: tuple[str, ...], flag: str
) -> None:
    """As the real engines: their usage has no prompt_tokens_details without the flag
    (llmgw's plans pass it), though the prefix cache works the same either way."""
    env = {"LLMGW_FAKE_TOKENS": "2", "LLMGW_FAKE_PREFIX_CACHE_TOKENS": "128"}
    for extra, reported in (((), None), ((flag,), 64)):
        async with engine(*argv, *extra, env=env) as e:
            usages = []
            for user in ("first question", "second question"):
                r = await e.post("/v1/chat/completions", chat(SYSTEM_A, user))
                assert r.status_code == 200, r.text
                usages.append(r.json()["usage"])
            details = [u.get("prompt_tokens_details") for u in usages]
            if reported is None:
                assert details == [None, None]
            else:
                assert details == [{"cached_tokens": 0}, {"cached_tokens": reported}]
            assert (await e.stats())["prompt_tokens_cached"] == 64


async def test_llama_server_timings_show_prefill_of_the_uncached_part_only() -> None:
    delay = 0.004  # s per uncached prompt token
    env = {
        "LLMGW_FAKE_ENGINE": "llama-server",
        "LLMGW_FAKE_TOKENS": "3",
        "LLMGW_FAKE_PREFIX_CACHE_TOKENS": "4096",
        "LLMGW_FAKE_PREFILL_TOKEN_DELAY": str(delay),
    }
    system = words(253, "s")  # 256 tokens: 16 blocks
    async with engine("-m", "x.gguf", env=env) as e:
        cold = (await e.post("/v1/chat/completions", chat(system, "first question"))).json()
        warm = (await e.post("/v1/chat/completions", chat(system, "next question"))).json()
        assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
        tc, tw = cold["timings"], warm["timings"]
        assert (tc["cache_n"], tc["prompt_n"], tc["predicted_n"]) == (0, 261, 3)
        assert (tw["cache_n"], tw["prompt_n"], tw["predicted_n"]) == (256, 5, 3)
        # The prefill is spent per uncached token: the engine's own figures say so.
        assert tc["prompt_ms"] >= 261 * delay * 1000
        assert tw["prompt_ms"] >= 5 * delay * 1000
        assert tw["prompt_ms"] < tc["prompt_ms"] / 4
        assert tc["prompt_per_token_ms"] == pytest.approx(tc["prompt_ms"] / 261)
        assert tc["predicted_per_token_ms"] == pytest.approx(tc["predicted_ms"] / 3)
        assert set(tc) == {
            "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
            "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}  # fmt: skip

        # Streamed: on the usage chunk when there is one, else on the last token's chunk.
        for include_usage in (True, False):
            body = chat(system, f"streamed {include_usage}", stream=True,
                        stream_options={"include_usage": include_usage})  # fmt: skip
            async with e.client.stream("POST", e.url + "/v1/chat/completions", json=body) as r:
                chunks = [json.loads(d) for _, d in [ev async for ev in sse_events(r)][:-1]]
            with_timings = [c for c in chunks if "timings" in c]
            assert with_timings == [chunks[-1]]
            assert chunks[-1]["timings"]["cache_n"] == 256
            assert chunks[-1]["timings"]["prompt_n"] == 5
            if include_usage:
                assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
            else:
                assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert (await e.stats())["prompt_tokens_cached"] == 3 * 256
