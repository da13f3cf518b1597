"""A real llama-server killed (SIGKILL) mid-stream at temperature 0: the client reads one
answer, the uninterrupted run's, continued on the other replica; where continuation is
refused, the final error event in the API's shape.

Two real llama-servers serve the tiny test model (a wider variant, so an answer takes
long enough to be cut: `wide_model`), the router (the one tests/router/ runs, on its lean listener)
in front of them. The answer is kept to single letters (`logit_bias` bans every other
token): the test model's tokenizer never merges letters, so the text re-tokenizes as
it was generated, which is what an exact join needs (llmgw/core/_continuation.py; its
word tokens such as `▁the` are never produced from text by that tokenizer). Prompt
caching is off (`cache_prompt: false`), so each run computes its prompt the same way.
"""

from __future__ import annotations

import json
import os
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
from llmgw.testing.cluster import LocalCluster, free_port, wait_for

AUTH = {"Authorization": f"Bearer {SECRET_A}"}
N_VOCAB = 3 + 256 + len(tiny_gguf.WORDS) + 26
LETTERS = range(N_VOCAB - 26, N_VOCAB)  # "a".."z", the vocabulary's last 26 tokens
ONLY_LETTERS = {str(t): -100 for t in range(N_VOCAB) if t not in LETTERS}
MAX_TOKENS = 300
CUT_AFTER = 5  # text chunks the client reads before the engine is killed


def wide_model(tmp: Path, n_embd: int = 512) -> Path:
    """The tiny model made wide enough to write about 200 tokens a second here (one
    thread; 370 on an idle machine): an answer of MAX_TOKENS takes about a second, so
    the kill lands while the engine is still generating it (the default tiny model
    writes 3,000 a second, and an engine that has written its whole answer to the
    socket before it dies cuts nothing). `n_embd` 1024 writes about 130 a second idle."""
    return tiny_gguf.write(tmp / "wide.gguf", n_embd=n_embd, n_layer=4, n_ff=2 * n_embd)


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
    model = wide_model(tmp_path)
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


IN_FLIGHT = "llmgw_router_endpoint_in_flight_requests"


def engine_pid(pids: list[int]) -> int:
    """The shard's llama-server among its processes."""
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"llama-server" in f.read():
                return pid
    raise AssertionError(f"no llama-server among the shard's processes {pids}")


@pytest.mark.slow
def test_through_the_fleet_a_killed_replicas_stream_is_continued_on_the_other(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The same through llmgw-cp (its router, its endpoints from the fleet) and two agents,
    two llama-server replicas, the serving engine killed with SIGKILL."""
    binary = llama_server_binary()
    # Wider still: before the kill the test scrapes the control plane's metrics for the
    # serving endpoint, which takes a while on a busy machine; at 370 tokens a second
    # the answer was once over before the scrape came back (no endpoint in flight).
    model = wide_model(tmp_path, n_embd=1024)
    profile = {
        "engine": "llama-server",
        "gpus_per_node": 0,
        "engine_args": ["--ctx-size", "1024", "--threads", "1", "-np", "1"],
        "startup_timeout_s": 120,
    }
    cluster.models = [{"name": "tiny", "source": str(model), "replicas": 2, "profiles": [profile]}]
    nodes = ("c1", "c2")
    cluster.start_fleet(nodes, {"llama-server": binary})
    key = cluster.api_key("team-a")

    def replicas() -> dict[str, tuple[int, int]] | None:
        """The router's endpoint id -> (port, llama-server pid) of the two ready replicas
        (placement may put both on one node: each is its own engine either way)."""
        ready = [
            (node, s)
            for node, n in cluster.nodes().items()
            for s in n["shards"]
            if s.get("model_name") == "tiny" and s["state"] == "ready"
        ]
        if len(ready) != 2:
            return None
        return {
            f"{s['replica_id']}@{node}": (s["port"], engine_pid(s["pids"])) for node, s in ready
        }

    engines = wait_for("two ready replicas", replicas, 180)
    url = cluster.router_url + "/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}

    def read(body: dict[str, Any], kill: bool) -> Read:
        out, texts, killed = Read(), 0, False
        with (
            httpx.Client(timeout=120) as h,
            h.stream("POST", url, headers=headers, json=body) as resp,
        ):
            assert resp.status_code == 200, resp.read()
            try:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        out.done += 1
                    elif line.startswith("data: "):
                        out.chunks.append(json.loads(line[6:]))
                        texts += bool(out.text)
                        if kill and not killed and texts >= CUT_AFTER:
                            # The router's own count: the endpoint it sent the request to.
                            scrape = httpx.get(cluster.admin_url + "/metrics", timeout=10).text
                            busy = [
                                eid
                                for eid in engines
                                if sample(scrape, IN_FLIGHT, model="tiny", endpoint=eid)
                            ]
                            assert len(busy) == 1, busy
                            os.kill(engines[busy[0]][1], signal.SIGKILL)
                            killed = True
            except httpx.RemoteProtocolError:
                out.cut = True
        assert killed or not kill
        return out

    # Both endpoints known to the router and healthy: the continuation has somewhere to go.
    def routable() -> bool:
        scrape = httpx.get(cluster.admin_url + "/metrics", timeout=10).text
        healthy = "llmgw_router_endpoint_healthy"
        return all(sample(scrape, healthy, model="tiny", endpoint=e) == 1 for e in engines)

    wait_for("the router routes to both replicas", routable, 60)
    whole = read(chat(), kill=False)
    assert (whole.done, whole.finishes, len(whole.text)) == (1, ["length"], MAX_TOKENS)
    joined = read(chat(), kill=True)
    assert not joined.cut and joined.done == 1 and joined.finishes == ["length"]
    assert len({c["id"] for c in joined.chunks}) == 1
    assert joined.text == whole.text
    metrics = httpx.get(cluster.admin_url + "/metrics", timeout=10).text
    labels = {"model": "tiny", "api": "openai", "outcome": "continued", "reason": ""}
    assert sample(metrics, "llmgw_router_stream_cuts_total", **labels) == 1
