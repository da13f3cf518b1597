"""A stand-in for vLLM, SGLang and llama-server: a real HTTP server that generates nothing.

Tests, demos and benchmarks run it where there are no GPUs, so the agent's
supervisor and the router meet a process that starts, loads, serves, reports
load and dies the way an inference engine does.

Run it as `python -m llmgw.testing.fake_engine ARGS...`, or through a wrapper
named after the engine on PATH (`install(bin_dir, "vllm")` writes one). It
takes the real engines' command lines and ignores the flags it does not act on:

    vllm serve MODEL [--host H] [--port P] [--served-model-name NAME...] [--max-num-seqs N]
                     [--max-model-len N] [--api-key KEY] [--enable-lora] [--max-loras N]
                     [--max-lora-rank R] [...]
    llama-server -m MODEL [--host H] [--port P] [-a ALIAS] [-np N] [-c N] [--metrics]
                 [--no-slots] [--embeddings] [--api-key KEY] [--lora FNAME]
                 [--lora-scaled FNAME:SCALE] [--cache-ram N] [...]
    (sglang) --model-path MODEL [--host H] [--port P] [--served-model-name NAME]
             [--max-running-requests N] [--context-length N] [--enable-metrics]
             [--enable-lora --max-lora-rank R --lora-target-modules M...]
             [--max-loras-per-batch N] [...]

`--port 0` binds a free port; the startup line says which. Which engine to
imitate: `--fake-engine vllm|llama-server|sglang`, else `LLMGW_FAKE_ENGINE`,
else the wrapper's name (argv[0]'s basename), else the command line's shape
(`serve` first: vLLM; `--model-path`: SGLang; `-m`: llama-server).
`--help` (vLLM also `--help=all`) prints that engine's help listing the flags
in `_fake_engine_cli`; `--version` prints a version. Both exit 0.

Endpoints, as the imitated engine has them:

- `POST /v1/chat/completions`, `POST /v1/completions`: the completion is
  "tok0 tok1 ... tok{N-1}"; with `stream: true`, SSE events `data: {chunk}`
  (chat: a role chunk, then one chunk per token, `finish_reason` on the last),
  a usage chunk when `stream_options.include_usage` is true, then
  `data: [DONE]`. `max_tokens` shortens it (finish_reason "length"). Prompt
  tokens are counted as words (+3 per chat message); a prompt plus max_tokens
  over the context length is refused with 400, as the engines do. With a
  prefix cache (`LLMGW_FAKE_PREFIX_CACHE_TOKENS`), the usage (non-streamed, and
  the streamed usage chunk) has `prompt_tokens_details.cached_tokens` where the
  real engine would report it (llama-server always, vLLM with
  `--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`), and
  llama-server's last response or chunk has `timings` (`cache_n`, `prompt_n`:
  the uncached part, `prompt_ms`, `prompt_per_token_ms`, `prompt_per_second`,
  `predicted_n`, `predicted_ms`, `predicted_per_token_ms`,
  `predicted_per_second`; the times measured from the slot being held to the
  first token and from there to the last).
- `POST /v1/embeddings`: unit vectors that depend only on the text
  (`encoding_format: base64` gives little-endian float32). llama-server
  answers 501 unless started with `--embeddings`.
- `GET /v1/models`: the served names once loaded, an empty list before; vLLM and
  SGLang also list each loaded LoRA adapter with `parent` (the first served name).
- LoRA adapters (`_fake_engine_adapters`, with each engine's bodies, statuses and
  messages): vLLM `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
  (`{"lora_name", "lora_path"}`; routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
  or true; 400 for a loaded name, 404 for a path that does not exist or an unknown
  unload, 500 without --enable-lora), an adapter chosen by `model`; SGLang `POST
  /load_lora_adapter` and `/unload_lora_adapter` (200 or 400 `{"success": false,
  "error_message"}`), an adapter chosen by `lora_path` or `model: BASE:ADAPTER`
  (a plain adapter name as `model` gets the base, as SGLang does); llama-server's
  launch adapters (`--lora`, `--lora-scaled FNAME:SCALE`; a file that is not there
  is refused at startup), `GET /lora-adapters`, and a request's `lora: [{"id",
  "scale"}]`. An adapter's answer starts with `[NAME] ` (llama-server: `[PATH] `, or
  `[PATH*SCALE] `); an unknown adapter gets the engine's error.
- `GET /health`: 503 while loading, then 200.
- `GET /metrics`: Prometheus text with the engine's names, from the real
  in-flight load. vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (labels `engine`, `model_name`), token and
  success counters. SGLang (only with `--enable-metrics`, else 404):
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`.
  llama-server (only with `--metrics`, else 501): `llamacpp:requests_processing`,
  `llamacpp:requests_deferred` and token counters; no KV gauge. With a prefix
  cache, vLLM also has `vllm:prefix_cache_queries_total` and
  `vllm:prefix_cache_hits_total` (in prompt tokens).
- llama-server `GET /slots` (501 with `--no-slots`): one object per slot with
  `id`, `id_task`, `n_ctx` (per slot), `is_processing`, `next_token`.
- `POST /fake/health` (the fake's own): body `{"hang": true}` makes `/health`
  hang from then on (it reads the request and never answers, until the
  client goes away), `{"hang": false}` makes it answer again; answers
  `{"hang": ...}`. The process keeps listening and serving everything else:
  a hung engine, not a dead one.
- `POST /fake/tokens` (the fake's own): body `{"hang": true}` wedges it:
  every generation, running or new, stops before its next token (a streamed
  one has its head and what it sent so far; a non-streamed one no head) while
  `/health`, `/metrics` and everything else answer as before; `{"hang":
  false}` lets them go on. Answers `{"hang": ...}`.
- `GET /fake/stats` (the fake's own): JSON `ready`, `received`, `completed`,
  `cancelled`, `failed`, `in_flight`, `running`, `waiting`, `prompt_tokens`,
  `generation_tokens`, and with a prefix cache `prompt_tokens_cached` (the
  prompt tokens served from it); `probes`: the agent's one-token readiness
  generations (`POST /v1/completions` with the `x-llmgw-probe` header,
  llmgw/engines/_probe.py), answered as a one-token completion (wedged by
  `/fake/tokens` too) and counted there only, never in the others, never
  failed by LLMGW_FAKE_FAIL_RATE, so the counts above are the clients'. An
  inference request ends as exactly one of completed, cancelled (the client
  closed the connection first) or failed (an error status). `adapter_loads`,
  `adapter_unloads`: the LoRA loads and unloads that succeeded (vLLM, SGLang).

A request generates while it holds one of the engine's slots: vLLM's
`--max-num-seqs` (default 256), SGLang's `--max-running-requests` (256),
llama-server's `-np` (4); `LLMGW_FAKE_SLOTS` replaces the default when the
flag is absent. Requests beyond that wait, and count as waiting/deferred. The
KV gauges are the running requests' prompt + generated tokens over
`LLMGW_FAKE_KV_TOKENS`. A model name the server does not serve is 404 for vLLM
and SGLang; llama-server serves its one model whatever the request names.
With `--api-key`, `/v1/*` needs `Authorization: Bearer KEY` (else 401).
Bad JSON or a missing field is 400. A client that closes its connection
cancels its request, whether it is waiting, generating or hung.

Environment variables (they pass through wrapper scripts and the agent):

LLMGW_FAKE_ENGINE
    vllm, llama-server or sglang; see above.
LLMGW_FAKE_LOAD_DELAY
    Seconds of "loading" after it listens (default 0): /health is 503, /v1/models
    is empty and inference requests get 503 until then.
LLMGW_FAKE_TOKENS
    Tokens per completion (default 16).
LLMGW_FAKE_FIRST_TOKEN_DELAY, LLMGW_FAKE_TOKEN_DELAY
    Seconds before the first token once a slot is held, and between later
    tokens (default 0). A non-streamed answer takes the same time.
LLMGW_FAKE_CRASH_AFTER
    Seconds after it starts listening at which it prints a realistic fatal
    error to stderr (a CUDA illegal memory access, as vLLM/SGLang or llama.cpp
    report it) and exits with status 1, abruptly, connections and all.
LLMGW_FAKE_CRASH_MESSAGE
    Replaces that last stderr line (e.g. a torch.OutOfMemoryError line).
LLMGW_FAKE_HANG_AFTER_TOKENS
    Every generation stops after N tokens and keeps its connection open
    without sending anything, until the client goes away.
LLMGW_FAKE_HEALTH_HANG_AFTER
    Seconds after it starts listening at which `/health` starts to hang, as
    `POST /fake/health {"hang": true}` does (0: from the start).
LLMGW_FAKE_FAIL_RATE
    Fraction of inference requests answered 500 in the OpenAI error shape,
    spread evenly and deterministically (0.5: every second request; 1: all).
LLMGW_FAKE_SLOTS
    Concurrent generations when the engine's flag does not say (see above).
LLMGW_FAKE_LOG_EVERY
    Print an engine-style statistics line to stdout every N seconds.
LLMGW_FAKE_HELP_RENAME
    `--old=--new` (several: comma-separated) renames flags in --help output,
    to imitate another engine version.
LLMGW_FAKE_HELP_TRUNCATE
    Cut the --help output after N bytes.
LLMGW_FAKE_EMBED_DIM
    Embedding dimension (default 16).
LLMGW_FAKE_KV_TOKENS
    KV cache capacity in tokens for the usage gauges (default 65536).
LLMGW_FAKE_KEEPALIVE
    Seconds an idle keep-alive connection is kept (default 5, as uvicorn).
LLMGW_FAKE_VERSION
    The version `--version` prints.
LLMGW_FAKE_PREFIX_CACHE_TOKENS
    Capacity, in prompt tokens, of a prefix cache (unset or 0: none is modelled,
    and nothing above mentions one). A prompt's tokens are concrete: per chat
    message a start marker, the role and a separator, then its words; a
    completion prompt's words or token ids. They are hashed as a chain of
    16-token blocks (as vLLM does); once a request holds a slot, its cached
    part is the longest run of leading blocks the cache holds (never the whole
    prompt: at least one token is computed), and after its prefill its blocks
    are the most recently used. Blocks shared by several prompts are held
    once; beyond the capacity the least recently used go (at least 16).
LLMGW_FAKE_REPLAY, LLMGW_FAKE_REPLAY_USAGE
    Files holding a recorded SSE stream (tests/data/*.sse, ending `data: [DONE]`):
    a streamed chat or completion that holds a slot is answered with the first's
    bytes, an event per write, instead of generated tokens, or with the second's
    when it sets `stream_options.include_usage` (unset: generated as usual). So
    the router meets an engine's exact bytes, asked for usage and not.
LLMGW_FAKE_PREFILL_TOKEN_DELAY
    Seconds per uncached prompt token, spent holding a slot before the first
    token, after LLMGW_FAKE_FIRST_TOKEN_DELAY (default 0): time to first token
    grows with the part of the prompt not cached (all of it without a cache).

A bad value is refused at startup with exit status 2 and a message naming the
variable. Stdout gets the engine's startup line once it listens ("Uvicorn
running on http://H:P" for vLLM and SGLang, "server is listening on
http://H:P" for llama-server); a port already in use exits 1 as uvicorn does.
SIGTERM or SIGINT stops it at once with status 0.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import h11
import trio

from llmgw._process import run_service
from llmgw.engines import PROBE_HEADER
from llmgw.errors import UsageError
from llmgw.testing import _fake_engine_console as console
from llmgw.testing._fake_engine_adapters import Adapters
from llmgw.testing._fake_engine_cli import (
    Behaviour,
    Engine,
    FakeConfig,
    HelpRequest,
    VersionRequest,
    parse_command_line,
    read_behaviour,
)
from llmgw.testing._fake_engine_faults import Faults, crash_lines, injected_failure
from llmgw.testing._fake_engine_http import MAX_BODY, Exchange, Gone, serve_connection
from llmgw.testing._fake_engine_wire import (
    EmbedRequest,
    EngineState,
    GenRequest,
    Outcome,
    Reply,
    StreamWriter,
    dumps,
    embeddings_response,
    error,
    full_response,
    llama_timings,
    loading,
    metrics_text,
    models_response,
    not_found,
    read_embeddings,
    read_generation,
    slots_response,
    unauthorized,
)

__all__ = ["EngineState", "FakeEngine", "crash_lines", "install", "main"]

_SERVER_HEADER = {"vllm": b"uvicorn", "sglang": b"uvicorn", "llama-server": b"llama.cpp"}
_Endpoint = Callable[[Exchange, bytes], Awaitable[None]]


class FakeEngine:
    """One fake engine: its listening socket, its routes, its load and its timers.

    The load is `state` (`_fake_engine_wire`), the injected faults `faults`
    (`_fake_engine_faults`), the connections `_fake_engine_http`, the stdout
    lines `_fake_engine_console`; this class routes requests and generates.
    """

    def __init__(self, config: FakeConfig, behaviour: Behaviour) -> None:
        self.config = config
        self.behaviour = behaviour
        self.state = EngineState(config.slots, behaviour.kv_tokens, behaviour.prefix_cache_tokens)
        self.faults = Faults(config.engine, behaviour)
        self._slots = trio.Semaphore(config.slots)
        self._created = int(time.time())
        self.probes = 0  # the agent's generation probes (PROBE_HEADER), counted apart
        self.adapters = Adapters(config)
        self._routes: dict[str, tuple[bytes, _Endpoint]] = {
            "/health": (b"GET", self._health),
            "/v1/models": (b"GET", self._models),
            "/metrics": (b"GET", self._metrics),
            "/fake/stats": (b"GET", self._stats),
            "/fake/health": (b"POST", self._fake_health),
            "/fake/tokens": (b"POST", self._fake_tokens),
            "/v1/chat/completions": (b"POST", self._chat),
            "/v1/completions": (b"POST", self._completions),
            "/v1/embeddings": (b"POST", self._embeddings),
        }
        if config.engine == "llama-server":
            self._routes["/slots"] = (b"GET", self._slots_endpoint)
            self._routes["/models"] = (b"GET", self._models)
            self._routes["/chat/completions"] = (b"POST", self._chat)
        else:
            self._routes["/version"] = (b"GET", self._version)
        for path, (method, answer) in self.adapters.routes().items():
            self._routes[path] = (method, _replying(answer))

    def __repr__(self) -> str:
        c = self.config
        where = console.url(c.host, c.port)
        return f"<FakeEngine {c.engine} {c.served_names[0]!r} on {where} {self.state!r}>"

    # --- lifetime -------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, announce, load, serve until cancelled; `task_status.started(port)`."""
        c = self.config
        console.announce_start(c)
        try:
            listeners = await trio.open_tcp_listeners(c.port, host=c.host, backlog=1024)
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            raise UsageError(
                f"[Errno {exc.errno}] error while attempting to bind on address "
                f"({c.host!r}, {c.port}): {reason}"
            ) from None
        if c.port == 0:  # a name with several addresses got one free port each: keep one
            for extra in listeners[1:]:
                await extra.aclose()
            listeners = listeners[:1]
        port = int(listeners[0].socket.getsockname()[1])
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._connection, listeners)
                console.announce_listening(c, port)
                task_status.started(port)
                nursery.start_soon(self._load)
                self.faults.start(nursery)
                if self.behaviour.log_every is not None:
                    nursery.start_soon(console.log_stats, c, self.state, self.behaviour.log_every)
        finally:
            console.announce_shutdown(c.engine)

    async def _load(self) -> None:
        if self.behaviour.load_delay:
            await trio.sleep(self.behaviour.load_delay)
        self.state.ready = True
        console.announce_loaded(self.config.engine)

    # --- HTTP -----------------------------------------------------------------------------

    async def _connection(self, stream: trio.SocketStream) -> None:
        engine = self.config.engine
        await serve_connection(
            stream,
            self._dispatch,
            server=_SERVER_HEADER[engine],
            keepalive=self.behaviour.keepalive,
            too_large=error(engine, 400, f"request body over {MAX_BODY} bytes"),
        )

    async def _dispatch(self, ex: Exchange, req: h11.Request, body: bytes) -> None:
        path = bytes(req.target).split(b"?", 1)[0].decode("latin-1")
        route = self._routes.get(path)
        if route is None:
            await ex.send(not_found(self.config.engine))
            return
        method, handler = route
        if req.method != method:
            await ex.send(Reply(405, b'{"detail":"Method Not Allowed"}'))
            return
        key = self.config.api_key
        if key is not None and path.startswith("/v1/"):
            auth = dict(req.headers).get(b"authorization", b"")
            if auth != f"Bearer {key}".encode():
                await ex.send(unauthorized(self.config.engine))
                return
        if path == "/v1/completions" and dict(req.headers).get(PROBE_HEADER):
            await self._probe(ex, body)  # the agent's readiness probe, counted apart
            return
        await handler(ex, body)

    # --- endpoints ------------------------------------------------------------------------

    async def _health(self, ex: Exchange, _: bytes) -> None:
        engine = self.config.engine
        # Hung: the request was read, nothing is ever answered; the task ends
        # when the client gives up and closes.
        if self.faults.health_hangs and await ex.watching(trio.sleep_forever):
            raise Gone()
        if not self.state.ready:
            reply = loading(engine)
        elif engine == "llama-server":
            reply = Reply(200, b'{"status":"ok"}')
        else:
            reply = Reply(200, b"")
        await ex.send(reply)

    async def _fake_health(self, ex: Exchange, body: bytes) -> None:
        await ex.send(self.faults.switch_health(body))

    async def _probe(self, ex: Exchange, body: bytes) -> None:
        """The agent's one-token generation (llmgw/agent/_health.py): answered like any
        completion's first token, wedged by `/fake/tokens` like one, but counted in
        `probes` only, never failed by LLMGW_FAKE_FAIL_RATE and holding no slot, so the
        counts tests read are their own requests'."""
        self.probes += 1
        if not self.state.ready:
            await ex.send(loading(self.config.engine))
            return
        if await ex.watching(self.faults.token_may_go):
            raise Gone()
        name = self.config.served_names[0] if self.config.served_names else "model"
        answer = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": [{"index": 0, "text": "tok0", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        await ex.send(Reply(200, dumps(answer)))

    async def _fake_tokens(self, ex: Exchange, body: bytes) -> None:
        await ex.send(self.faults.switch_tokens(body))

    async def _models(self, ex: Exchange, _: bytes) -> None:
        ready = self.state.ready
        listed = self.adapters.model_entries() if ready else []
        await ex.send(Reply(200, models_response(self.config, ready, self._created, listed)))

    async def _version(self, ex: Exchange, _: bytes) -> None:
        await ex.send(Reply(200, dumps({"version": self.config.version})))

    async def _stats(self, ex: Exchange, _: bytes) -> None:
        a = self.adapters
        stats = {**self.state.statistics(), "probes": self.probes}
        stats |= {"adapter_loads": a.loads, "adapter_unloads": a.unloads}
        await ex.send(Reply(200, dumps(stats)))

    async def _metrics(self, ex: Exchange, _: bytes) -> None:
        engine = self.config.engine
        if self.config.metrics_enabled:
            text = metrics_text(self.config, self.state).encode()
            reply = Reply(200, text, "text/plain; version=0.0.4; charset=utf-8")
        elif engine == "llama-server":
            reply = error(
                engine,
                501,
                "This server does not support metrics endpoint. Start it with `--metrics`",
            )
        else:
            reply = not_found(engine)
        await ex.send(reply)

    async def _slots_endpoint(self, ex: Exchange, _: bytes) -> None:
        engine = self.config.engine
        if not self.config.slots_endpoint:
            reply = error(
                engine, 501, "This server does not support slots endpoint. Start it with `--slots`"
            )
        else:
            reply = Reply(200, slots_response(self.config, self.state, self.behaviour.tokens))
        await ex.send(reply)

    async def _chat(self, ex: Exchange, body: bytes) -> None:
        await self._inference(ex, body, "chat")

    async def _completions(self, ex: Exchange, body: bytes) -> None:
        await self._inference(ex, body, "completion")

    async def _embeddings(self, ex: Exchange, body: bytes) -> None:
        await self._inference(ex, body, "embedding")

    async def _inference(
        self, ex: Exchange, body: bytes, kind: Literal["chat", "completion", "embedding"]
    ) -> None:
        st = self.state
        engine = self.config.engine
        st.admit()
        outcome: Outcome = "cancelled"  # unless it gets further: a shutdown or a reset
        try:
            if not st.ready:
                outcome = "failed"
                await ex.send(loading(engine))
                return
            parsed: GenRequest | EmbedRequest | Reply
            if kind == "embedding":
                parsed = read_embeddings(self.config, body)
            else:
                parsed = read_generation(
                    self.config,
                    kind,
                    body,
                    self.behaviour.tokens,
                    prefix_blocks=self.state.prefix is not None,
                    adapters=self.adapters,
                )
            if isinstance(parsed, Reply):
                outcome = "failed"
                await ex.send(parsed)
                return
            if st.should_fail(self.behaviour.fail_rate):
                outcome = "failed"
                await ex.send(injected_failure(engine))
                return
            if isinstance(parsed, EmbedRequest):
                reply = Reply(200, embeddings_response(parsed, self.behaviour.embed_dim))
                outcome = "completed"
                await ex.send(reply)
                return
            generated: list[bool] = []
            gen = parsed

            async def work() -> None:
                await self._generate(ex, gen, generated)

            gone = await ex.watching(work)
            # Generated to the end is completed, even if the last bytes found the client gone.
            outcome = "completed" if generated else "cancelled"
            if gone:
                raise Gone()
        finally:
            st.finish(outcome)

    # --- generation -----------------------------------------------------------------------

    async def _generate(self, ex: Exchange, req: GenRequest, done: list[bool]) -> None:
        """Hold a slot, produce the tokens in time, send them; `done` gets True at the end."""
        b = self.behaviour
        st = self.state
        kind = "chatcmpl" if req.kind == "chat" else "cmpl"
        rid = f"{kind}-{uuid.uuid4().hex}"
        created = int(time.time())
        writer = StreamWriter(req, rid, created)
        if req.stream:
            await ex.start_stream("text/event-stream; charset=utf-8")
        replay = b.replay_usage if req.include_usage else b.replay
        st.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            st.waiting -= 1
        slot_held = trio.current_time()
        # Matched once a slot is held: a sibling prefilled while this one waited counts.
        cached = st.prefix.lookup(req.prompt_blocks, req.prompt_tokens) if st.prefix else None
        reported = cached if self.config.reports_cached else None  # the engine's usage says
        writer.cached = reported
        uncached = req.prompt_tokens - (cached or 0)
        run = st.start(req.prompt_tokens)
        reason: str | None = None
        timings: dict[str, float] | None = None
        llama = self.config.engine == "llama-server"  # which also reports its timings
        try:
            prefill = b.first_token_delay + uncached * b.prefill_token_delay
            if prefill:
                await trio.sleep(prefill)
            await self.faults.token_may_go()
            if st.prefix:
                st.prefix.insert(req.prompt_blocks)
            first_token = trio.current_time()
            if req.stream and replay is not None:
                for event in replay.split(b"\n\n")[:-1]:  # an event per write, as engines do
                    await ex.send_data(event + b"\n\n")
                await ex.end_stream(b"")
                done.append(True)
                return
            pending = writer.role() if req.stream else b""
            for i in range(req.n_tokens):
                if b.hang_after_tokens is not None and i >= b.hang_after_tokens:
                    if pending:
                        await ex.send_data(pending)
                    await trio.sleep_forever()
                if i and b.token_delay:
                    await trio.sleep(b.token_delay)
                await self.faults.token_may_go()
                st.generated(run)
                if i == req.n_tokens - 1 and cached is not None and llama:
                    now = trio.current_time()
                    timings = llama_timings(
                        cached, uncached, first_token - slot_held, i + 1, now - first_token
                    )
                    writer.timings = timings
                if req.stream:
                    pending += writer.token(i)
                    # Without a delay, tokens would go out back to back anyway: batch them.
                    if b.token_delay or i == req.n_tokens - 1:
                        await ex.send_data(pending)
                        pending = b""
            reason = req.finish_reason
            done.append(True)
        finally:
            st.release(run, reason)
            self._slots.release()
        if req.stream:
            await ex.end_stream(writer.end())
        else:
            answer = full_response(self.config.engine, req, rid, created, reported, timings)
            await ex.send(Reply(200, answer))


def _replying(answer: Callable[[bytes], Reply]) -> _Endpoint:
    async def endpoint(ex: Exchange, body: bytes) -> None:
        await ex.send(answer(body))

    return endpoint


def install(bin_dir: Path, engine: Engine = "vllm", python: str = sys.executable) -> Path:
    """Write an executable named after `engine` (vllm, llama-server, sglang) in `bin_dir`.

    It runs this module with its own path as argv[0], so the engine is guessed
    from the name as it would be for a user's own wrapper.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / engine
    code = (
        "import sys; from llmgw.testing.fake_engine import main; "
        "sys.exit(main(sys.argv[2:], prog=sys.argv[1]))"
    )
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} -c {shlex.quote(code)} "$0" "$@"\n')
    path.chmod(0o755)
    return path


def main(
    argv: list[str] | None = None, prog: str | None = None, default_engine: Engine | None = None
) -> int:
    """Run as the engine the command line names; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    prog = sys.argv[0] if prog is None else prog
    try:
        behaviour = read_behaviour(os.environ)
        command = parse_command_line(args, prog, os.environ, behaviour, default_engine)
    except UsageError as exc:
        print(f"{os.path.basename(prog)}: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(command, HelpRequest):
        sys.stdout.buffer.write(command.text)
        sys.stdout.flush()
        return 0
    if isinstance(command, VersionRequest):
        print(command.text, file=sys.stderr if command.to_stderr else sys.stdout, flush=True)
        return 0
    return run_service(command.engine, FakeEngine(command, behaviour).serve)


if __name__ == "__main__":
    sys.exit(main())
