"""A real llama-server killed (SIGKILL) mid-stream at temperature 0: the client reads one
answer, the uninterrupted run's, continued on the other replica; where continuation is
refused, the final error event in the API's shape.

Two real llama-servers serve the tiny test model (a wider variant, so an answer takes
long enough to be cut), the router (the one tests/router/ runs, on its lean listener)
in front of them. The answer is kept to single letters (`logit_bias` bans every other
token): the test model's tokenizer never merges letters, so the text re-tokenizes as
it was generated, which is what an exact join needs (llmgw/core/_continuation.py; its
word tokens such as `▁the` are never produced from text by that tokenizer). Prompt
caching is off (`cache_prompt: false`), so each run computes its prompt the same way.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import llama_server_binary
from router.conftest import SECRET_A, sample, serve_router

from llmgw.router._types import Endpoint
from llmgw.testing import tiny_gguf
from llmgw.testing.cluster import free_port, wait_for

AUTH = {"Authorization": f"Bearer {SECRET_A}"}
N_VOCAB = 3 + 256 + len(tiny_gguf.WORDS) + 26
LETTERS = range(N_VOCAB - 26, N_VOCAB)  # "a".."z", the vocabulary's last 26 tokens
ONLY_LETTERS = {str(t): -100 for t in range(N_VOCAB) if t not in LETTERS}
MAX_TOKENS = 300
CUT_AFTER = 5  # text chunks the client reads before the engine is killed


class Engine:
    """One llama-server on the model, on its own port (kept across a restart)."""

    def __init__(self, name: str, model: Path, log: Path) -> None:
        self.name, self.model, self.log = name, model, log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.name, "tiny", "llama-server", "127.0.0.1", self.port, 1)

    def start(self) -> None:
        argv = [llama_server_binary(), "-m", str(self.model), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--ctx-size", "1024", "--threads", "1", "-np", "1"]
        argv += ["--jinja", "--metrics", "--seed", "0"]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self.port}/health"

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(f"llama-server {self.name} ready", up, 90)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[Engine, Engine]]:
    llama_server_binary()  # skips (fails under CI) before anything starts without it
    model = tiny_gguf.write(tmp_path / "wide.gguf", n_embd=256, n_layer=4, n_ff=512)
    pair = (Engine("a", model, tmp_path / "a.log"), Engine("b", model, tmp_path / "b.log"))
    try:
        for engine in pair:
            engine.start()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me about the fleet"}],
        **common(**extra),
    }


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "the fleet and the engine", **common(**extra)}


def common(**extra: Any) -> dict[str, Any]:
    return {
        "stream": True,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "logit_bias": ONLY_LETTERS,
        "cache_prompt": False,
        **extra,
    }


class Read:
    """A streamed answer as the client read it."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.done = 0
        self.cut = False

    @property
    def text(self) -> str:
        out = []
        for c in self.chunks:
            for choice in c.get("choices", []):
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(out)

    @property
    def finishes(self) -> list[str]:
        return [
            ch["finish_reason"]
            for c in self.chunks
            for ch in c.get("choices", [])
            if ch.get("finish_reason")
        ]


async def stream(
    h: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    after: Callable[[], Awaitable[None]] | None = None,
) -> Read:
    """Read a stream to its end; `after` is awaited once CUT_AFTER text chunks arrived."""
    read = Read()
    texts = 0
    try:
        async with h.stream("POST", url, headers=AUTH, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    read.done += 1
                    continue
                chunk = json.loads(line[6:])
                read.chunks.append(chunk)
                if read.text and texts < CUT_AFTER:
                    texts += 1
                    if texts == CUT_AFTER and after is not None:
                        await after()
    except httpx.RemoteProtocolError:
        read.cut = True
    return read


def serving(r: Any, engines: tuple[Engine, Engine]) -> Engine:
    """The engine the router has the one request in flight at."""
    states = r.router.endpoint_states()
    busy = [e for e in engines if states[e.name].in_flight]
    assert len(busy) == 1, {e.name: states[e.name].in_flight for e in engines}
    return busy[0]


@pytest.mark.slow
async def test_a_greedy_stream_whose_engine_is_killed_reads_as_the_uninterrupted_answer(
    engines: tuple[Engine, Engine],
) -> None:
    a, b = engines
    async with (
        serve_router([a.endpoint, b.endpoint], scrape_interval_s=0.2) as r,
        httpx.AsyncClient(timeout=120) as h,
    ):
        killed: list[Engine] = []

        async def kill() -> None:
            engine = serving(r, engines)
            await trio.to_thread.run_sync(engine.kill9)
            killed.append(engine)

        async def restart() -> None:
            engine = killed[-1]
            await trio.to_thread.run_sync(engine.start)
            # Routable again before the next cut needs it for the continuation.
            with trio.fail_after(30):
                while not r.router.endpoint_states()[engine.name].healthy:
                    await trio.sleep(0.05)

        cuts = "llmgw_router_stream_cuts_total"
        for n, (path, body) in enumerate(
            (("/chat/completions", chat()), ("/completions", completion())), start=1
        ):
            url = r.base_url + path
            whole = await stream(h, url, body)
            again = await stream(h, url, body)
            assert whole.text == again.text  # greedy on this model is deterministic
            assert len(whole.text) == MAX_TOKENS and set(whole.text) <= set(
                "abcdefghijklmnopqrstuvwxyz"
            )
            assert (whole.done, whole.finishes, whole.cut) == (1, ["length"], False)

            joined = await stream(h, url, body, kill)
            assert len(killed) == n  # the engine was killed while it answered
            assert not joined.cut and joined.done == 1, joined.chunks[-3:]
            assert joined.finishes == ["length"]
            assert all("error" not in c for c in joined.chunks)
            assert len({c["id"] for c in joined.chunks}) == 1
            assert joined.text == whole.text
            metrics = r.metrics_text()
            labels = {"model": "tiny", "api": "openai", "outcome": "continued", "reason": ""}
            assert sample(metrics, cuts, **labels) == n
            await restart()

        # Refused: with logprobs the continuation could not be exact; the client gets the
        # final error event in OpenAI's shape, and the stream is cut, not ended.
        refused = await stream(h, r.base_url + "/chat/completions", chat(logprobs=True), kill)
        assert refused.cut and refused.done == 0 and refused.finishes == []
        error = refused.chunks[-1]["error"]
        assert error["type"] == "upstream_error" and error["code"] == "mid_body"
        assert "mid-response" in error["message"]
        labels = {"model": "tiny", "api": "openai", "outcome": "error", "reason": "logprobs"}
        assert sample(r.metrics_text(), cuts, **labels) == 1
