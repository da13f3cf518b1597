"""The fake engine speaks each engine's LoRA adapter API, driven as llmgw drives it.

Each fake is started from the command line and environment `plan_launch` writes for a
profile with adapters, loaded through the `HttpCall`s of `adapter_api`, asked through
bodies made by `adapter_request`, and read back with `listed_adapters`: so the plans,
the calls and the fake's imitation of vLLM 0.34.0, SGLang 0.5.23 and llama-server
(llmgw/engines/_adapters.py names the sources) are checked together over HTTP.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from llmgw.engines import (
    Assignment,
    EngineProfile,
    HttpCall,
    LaunchAdapter,
    adapter_api,
    adapter_request,
    listed_adapters,
    plan_launch,
)
from llmgw.model import Gpu

LISTENING = re.compile(rb"(?:Uvicorn running on|server is listening on) http://127\.0\.0\.1:(\d+)")
GPU = Gpu(index=0, uuid="GPU-0", name="NVIDIA H100", gpu_class="h100-80g")
CPU = Assignment(rank=0, node_addresses=("127.0.0.1",), gpus=(), port=1, rendezvous_port=2)
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "say something"}]}


class Fake:
    def __init__(self, client: httpx.AsyncClient, proc: trio.Process) -> None:
        self.client = client
        self.proc = proc

    async def call(self, call: HttpCall) -> httpx.Response:
        return await self.client.request(call.method, call.path, json=call.json)

    async def chat(self, body: Mapping[str, Any]) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=dict(body))

    async def text(self, body: Mapping[str, Any]) -> str:
        response = await self.chat(body)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    async def listed(self, engine: str) -> tuple[str, ...] | None:
        return listed_adapters(engine, (await self.client.get("/v1/models")).json())


def fake_command(profile: EngineProfile) -> tuple[list[str], dict[str, str]]:
    """The fake run with the argv and env the plan writes (minus the program itself)."""
    assignment = attrs.evolve(CPU, gpus=(GPU,)) if profile.gpu_class else CPU
    (process,) = plan_launch(profile, assignment).processes
    skip = 3 if profile.engine == "sglang" else 1  # python3 -m sglang.launch_server
    argv = [sys.executable, "-m", "llmgw.testing.fake_engine", "--fake-engine", profile.engine]
    argv += [*process.argv[skip:], "--host", "127.0.0.1", "--port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_FAKE", "VLLM_"))}
    return argv, {**env, **dict(process.env)}


@asynccontextmanager
async def running(
    profile: EngineProfile, env: Mapping[str, str] | None = None
) -> AsyncIterator[Fake]:
    argv, plan_env = fake_command(profile)
    proc = await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**plan_env, **(env or {})}
    )
    assert proc.stdout is not None
    out = b""
    try:
        with trio.fail_after(20):
            while not (m := LISTENING.search(out)):
                chunk = await proc.stdout.receive_some()
                assert chunk, out
                out += chunk
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{int(m.group(1))}", timeout=10
        ) as c:
            yield Fake(c, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def adapter_dirs(tmp_path: Path, *names: str) -> dict[str, str]:
    paths = {}
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
        paths[name] = str(tmp_path / name)
    return paths


VLLM = EngineProfile(
    engine="vllm",
    model="/m/base",
    served_names=("base",),
    gpu_class="h100-80g",
    max_adapters=2,
    max_adapter_rank=16,
)
SGLANG = EngineProfile(
    engine="sglang",
    model="/m/base",
    served_names=("base",),
    gpu_class="h100-80g",
    max_adapters=2,
    max_adapter_rank=16,
)


@pytest.mark.slow(seconds=2)
async def test_vllm_adapter_api(tmp_path: Path) -> None:
    paths = adapter_dirs(tmp_path, "sql", "chat")
    api = adapter_api("vllm")
    assert api is not None
    async with running(VLLM) as fake:
        assert await fake.listed("vllm") == ()
        loaded = await fake.call(api.load("sql", paths["sql"]))
        assert (loaded.status_code, loaded.text) == (
            200,
            "Success: LoRA adapter 'sql' added successfully.",
        )
        assert (await fake.call(api.load("chat", paths["chat"]))).status_code == 200
        models = (await fake.client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["root"], m["parent"]) for m in models] == [
            ("base", "/m/base", None),
            ("sql", paths["sql"], "base"),
            ("chat", paths["chat"], "base"),
        ]
        assert await fake.listed("vllm") == ("sql", "chat")

        # The adapter answers a request named for it; the base one without a tag.
        ask = {**CHAT, "model": "sql"}
        body = adapter_request("vllm", ask, adapter="sql", held=(), scale=1.0)
        response = await fake.chat(body)
        assert response.json()["model"] == "sql"
        assert response.json()["choices"][0]["message"]["content"].startswith("[sql] tok0 tok1")
        base = adapter_request("vllm", {**CHAT, "model": "base"}, adapter=None, held=(), scale=1)
        assert (await fake.text(base)).startswith("tok0 tok1")
        streamed = ""
        stream = {**body, "stream": True}
        async with fake.client.stream("POST", "/v1/chat/completions", json=stream) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        assert streamed.startswith("[sql] tok0 tok1")

        # vLLM's refusals, with its statuses, types and messages.
        again = await fake.call(api.load("sql", paths["sql"]))
        assert again.status_code == 400
        assert again.json()["error"]["type"] == "InvalidUserInput"
        assert "'sql' has already been loaded" in again.json()["error"]["message"]
        missing = await fake.call(api.load("gone", str(tmp_path / "gone")))
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == (
            f"Loading lora gone failed: No adapter found for {tmp_path / 'gone'}"
        )
        unknown = await fake.call(api.unload("nope"))
        assert unknown.status_code == 404
        assert unknown.json() == {
            "error": {
                "message": "The lora adapter 'nope' cannot be found.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
        }
        # Over --max-loras (2) is not refused: vLLM keeps the rest in its CPU cache.
        third = adapter_dirs(tmp_path, "code")["code"]
        assert (await fake.call(api.load("code", third))).status_code == 200

        unloaded = await fake.call(api.unload("sql"))
        assert (unloaded.status_code, unloaded.text) == (
            200,
            "Success: LoRA adapter 'sql' removed successfully.",
        )
        assert await fake.listed("vllm") == ("chat", "code")
        stats = (await fake.client.get("/fake/stats")).json()
        assert (stats["adapter_loads"], stats["adapter_unloads"]) == (3, 1)
        gone = await fake.chat(body)
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == "The model `sql` does not exist."


@pytest.mark.slow(seconds=1)
async def test_vllm_without_the_runtime_env_has_no_load_route(tmp_path: Path) -> None:
    api = adapter_api("vllm")
    assert api is not None
    path = adapter_dirs(tmp_path, "sql")["sql"]
    async with running(VLLM, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}) as fake:
        response = await fake.call(api.load("sql", path))
        assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})
    # Runtime updating without --enable-lora: the route is there, the engine refuses.
    plain = EngineProfile(engine="vllm", model="/m/base", gpu_class="h100-80g")
    async with running(plain, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as fake:
        response = await fake.call(api.load("sql", path))
        assert response.status_code == 500
        assert "Use --enable-lora" in response.json()["error"]["message"]


@pytest.mark.slow(seconds=2)
async def test_sglang_adapter_api(tmp_path: Path) -> None:
    paths = adapter_dirs(tmp_path, "sql", "chat")
    api = adapter_api("sglang")
    assert api is not None
    async with running(SGLANG) as fake:
        loaded = await fake.call(api.load("sql", paths["sql"]))
        assert (loaded.status_code, loaded.json()) == (
            200,
            {"success": True, "error_message": "", "loaded_adapters": {"sql": paths["sql"]}},
        )
        assert (await fake.call(api.load("chat", paths["chat"]))).status_code == 200
        assert await fake.listed("sglang") == ("sql", "chat")

        body = adapter_request("sglang", {**CHAT, "model": "sql"}, adapter="sql", held=(), scale=1)
        assert (await fake.text(body)).startswith("[sql] tok0")
        # SGLang does not read a plain adapter name in `model`: the base answers.
        assert (await fake.text({**CHAT, "model": "sql"})).startswith("tok0")
        assert (await fake.text({**CHAT, "model": "base:chat"})).startswith("[chat] tok0")
        unknown = await fake.chat({**CHAT, "model": "base", "lora_path": "x"})
        assert unknown.status_code == 400
        assert unknown.json()["message"].startswith(
            "The following requested LoRA adapters are not loaded: x"
        )

        again = await fake.call(api.load("sql", paths["sql"]))
        assert again.status_code == 400 and again.json()["success"] is False
        assert again.json()["error_message"].startswith("LoRA with name sql already exists")
        nope = await fake.call(api.unload("nope"))
        assert nope.status_code == 400
        assert nope.json()["error_message"].startswith("LoRA with name nope does not exist")
        done = await fake.call(api.unload("sql"))
        assert done.json() == {
            "success": True,
            "error_message": "",
            "loaded_adapters": {"chat": paths["chat"]},
        }
        assert await fake.listed("sglang") == ("chat",)
        stats = (await fake.client.get("/fake/stats")).json()
        assert (stats["adapter_loads"], stats["adapter_unloads"]) == (2, 1)


async def test_sglang_without_a_rank_does_not_start() -> None:
    """What the plan's validation refuses (no max_adapter_rank), SGLang refuses too."""
    argv, env = fake_command(SGLANG)
    at = argv.index("--max-lora-rank")
    done = await trio.run_process(
        argv[:at] + argv[at + 2 :], capture_stdout=True, capture_stderr=True, env=env, check=False
    )
    assert done.returncode == 2
    assert b"you need to specify both --max-lora-rank and --lora-target-modules" in done.stderr


@pytest.mark.slow(seconds=2)
async def test_llama_server_launch_adapters(tmp_path: Path) -> None:
    files = {}
    for name in ("sql", "chat"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"GGUF")
    profile = EngineProfile(
        engine="llama-server",
        model="/m/base.gguf",
        served_names=("base",),
        gpus_per_node=0,
        max_adapters=2,
        adapters=tuple(LaunchAdapter(n, str(p)) for n, p in files.items()),
    )
    held = ("sql", "chat")
    assert adapter_api("llama-server") is None
    async with running(profile) as fake:
        listing = (await fake.client.get("/lora-adapters")).json()
        assert [(a["id"], a["path"], a["scale"]) for a in listing] == [
            (0, str(files["sql"]), 0.0),
            (1, str(files["chat"]), 0.0),
        ]
        assert await fake.listed("llama-server") is None
        ask = {**CHAT, "model": "chat"}
        chat = adapter_request("llama-server", ask, adapter="chat", held=held, scale=1.0)
        assert (await fake.text(chat)).startswith(f"[{files['chat']}] tok0")
        half = adapter_request("llama-server", ask, adapter="sql", held=held, scale=0.5)
        assert (await fake.text(half)).startswith(f"[{files['sql']}*0.5] tok0")
        base = adapter_request("llama-server", CHAT, adapter=None, held=held, scale=1.0)
        assert base["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
        assert (await fake.text(base)).startswith("tok0")
        assert (await fake.text(CHAT)).startswith("tok0")  # launched at scale 0
        bad = await fake.chat({**CHAT, "lora": "chat"})
        assert bad.status_code == 400
        assert "'lora' must be an array of objects" in bad.json()["error"]["message"]


async def test_llama_server_refuses_a_missing_adapter_file(tmp_path: Path) -> None:
    profile = EngineProfile(
        engine="llama-server",
        model="/m/base.gguf",
        gpus_per_node=0,
        max_adapters=1,
        adapters=(LaunchAdapter("sql", str(tmp_path / "absent.gguf")),),
    )
    argv, env = fake_command(profile)
    done = await trio.run_process(argv, capture_stderr=True, env=env, check=False)
    assert done.returncode == 2
    assert f"failed to apply lora adapter '{tmp_path / 'absent.gguf'}'".encode() in done.stderr
