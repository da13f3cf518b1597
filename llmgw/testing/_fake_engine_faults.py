"""The fake engine's injected faults: a crash, a hung /health, requests that fail.

`Faults` holds the switches that make an engine misbehave on purpose and the
timers that flip them: LLMGW_FAKE_CRASH_AFTER (die with the engine's last
words on stderr, status 1, no unwinding), LLMGW_FAKE_HEALTH_HANG_AFTER and
`POST /fake/health` (/health reads the request and never answers), `POST
/fake/tokens` (every generation stops before its next token, /health still
200: a wedged engine), and the 500 that LLMGW_FAKE_FAIL_RATE picks requests
for. Faults that live inside one
generation (slow tokens, LLMGW_FAKE_HANG_AFTER_TOKENS) stay in its loop.
"""

from __future__ import annotations

import json
import os
import sys
import time

import trio

from llmgw.testing._fake_engine_cli import Behaviour, Engine
from llmgw.testing._fake_engine_wire import Reply, dumps, error


def crash_lines(engine: Engine, last: str | None) -> list[str]:
    """What the engine prints to stderr as it dies; the last line is the one operators see."""
    if engine == "llama-server":
        lines = [
            "CUDA error: an illegal memory access was encountered",
            "  current device: 0, in function ggml_backend_cuda_synchronize at "
            "/app/ggml/src/ggml-cuda/ggml-cuda.cu:2484",
            "  cudaStreamSynchronize(cuda_ctx->stream())",
            "/app/ggml/src/ggml-cuda/ggml-cuda.cu:75: CUDA error",
        ]
    else:
        where = "[core.py:700]" if engine == "vllm" else "Scheduler hit an exception:"
        prefix = time.strftime("ERROR %m-%d %H:%M:%S ", time.localtime())
        lines = [
            f"{prefix}{where} EngineCore encountered a fatal error.",
            "Traceback (most recent call last):",
            '  File "/usr/local/lib/python3.12/dist-packages/torch/cuda/__init__.py", line 1014, '
            "in synchronize",
            "    return torch._C._cuda_synchronize()",
            "RuntimeError: CUDA error: an illegal memory access was encountered",
        ]
    if last:
        lines[-1] = last
    return lines


def injected_failure(engine: Engine) -> Reply:
    """The 500 for a request LLMGW_FAKE_FAIL_RATE chose to fail."""
    message = (
        "EngineCore encountered an issue. See stack trace (above) for the root cause."
        if engine != "llama-server"
        else "fake engine: LLMGW_FAKE_FAIL_RATE chose this request to fail"
    )
    return error(engine, 500, message)


class Faults:
    """The switches of one engine; `start` arms the timers that flip them."""

    def __init__(self, engine: Engine, behaviour: Behaviour) -> None:
        self._engine = engine
        self._behaviour = behaviour
        self.health_hangs = behaviour.health_hang_after == 0
        self.tokens_hang = False
        self._flowing = trio.Event()
        self._flowing.set()

    def __repr__(self) -> str:
        return f"<Faults health_hangs={self.health_hangs} tokens_hang={self.tokens_hang}>"

    def switch_tokens(self, body: bytes) -> Reply:
        """`POST /fake/tokens`: `{"hang": bool}`; while true, no generation sends another
        token (new ones included) and nothing else changes; the answer echoes it."""
        hang = self._hang_switch(body)
        if isinstance(hang, Reply):
            return hang
        self.tokens_hang = hang
        if hang and self._flowing.is_set():
            self._flowing = trio.Event()
        elif not hang:
            self._flowing.set()
        return Reply(200, dumps({"hang": hang}))

    async def token_may_go(self) -> None:
        """Returns at once, or once `POST /fake/tokens {"hang": false}` lets tokens go."""
        while self.tokens_hang:
            await self._flowing.wait()

    def start(self, nursery: trio.Nursery) -> None:
        b = self._behaviour
        if b.crash_after is not None:
            nursery.start_soon(self._crash, b.crash_after)
        if b.health_hang_after:
            nursery.start_soon(self._hang_health_later, b.health_hang_after)

    def switch_health(self, body: bytes) -> Reply:
        """`POST /fake/health`: `{"hang": bool}` sets the switch; the answer echoes it."""
        hang = self._hang_switch(body)
        if isinstance(hang, Reply):
            return hang
        self.health_hangs = hang
        return Reply(200, dumps({"hang": hang}))

    def _hang_switch(self, body: bytes) -> bool | Reply:
        """A switch's `{"hang": bool}` body: the value, or the 400 that says what is wrong."""
        try:
            hang = json.loads(body or b"{}").get("hang")
        except (ValueError, AttributeError):
            hang = None
        if not isinstance(hang, bool):
            message = 'the body must be {"hang": true} or {"hang": false}'
            return error(self._engine, 400, message)
        return hang

    async def _hang_health_later(self, after: float) -> None:
        await trio.sleep(after)
        self.health_hangs = True

    async def _crash(self, after: float) -> None:
        await trio.sleep(after)
        sys.stdout.flush()
        for line in crash_lines(self._engine, self._behaviour.crash_message):
            print(line, file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # an engine that dies does not unwind politely
