"""What the fake engine says, and the load it reports: request bodies in, bytes out, no I/O.

`EngineState` holds the counters behind /metrics, /slots and /fake/stats, and
`PrefixCache` the prompts an engine would still hold in its KV cache; the
functions here read requests and build the engines' JSON and Prometheus
text. The server in `fake_engine` only moves these bytes and keeps time.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import json
import math
import random
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs

from llmgw.testing._fake_engine_cli import PREFIX_BLOCK_TOKENS, Engine, FakeConfig

Outcome = Literal["completed", "cancelled", "failed"]


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@attrs.frozen
class Reply:
    """A whole response: status, body, content type."""

    status: int
    body: bytes
    content_type: str = "application/json"


@attrs.frozen
class GenRequest:
    """A completion to generate, read and checked from a request body."""

    kind: Literal["chat", "completion"]
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    n_tokens: int
    finish_reason: str
    # The prompt's chain of block hashes (`block_chain`), when a prefix cache is modelled.
    prompt_blocks: tuple[int, ...] = ()
    # What starts the text: "[ADAPTER] " when a LoRA adapter answers, else "".
    tag: str = ""


class AdapterChoice(Protocol):
    """The engine's adapters, as a request meets them (`_fake_engine_adapters.Adapters`)."""

    def accepts(self, model: str) -> bool: ...

    def select(self, body: Mapping[str, Any]) -> str | Reply: ...


@attrs.frozen
class EmbedRequest:
    model: str
    texts: tuple[str, ...]
    prompt_tokens: int
    base64: bool


# --- errors, in each engine's shape ---------------------------------------------------------

_VLLM_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
_LLAMA_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def error(engine: Engine, status: int, message: str, param: str | None = None) -> Reply:
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`."""
    if engine == "llama-server":
        body: dict[str, Any] = {"code": status, "message": message, "type": _LLAMA_TYPES[status]}
    else:
        body = {"message": message, "type": _VLLM_TYPES[status], "param": param, "code": status}
    return Reply(status, dumps({"error": body}))


def not_found(engine: Engine) -> Reply:
    if engine == "llama-server":
        return Reply(404, b"File Not Found", "text/plain")
    return Reply(404, b'{"detail":"Not Found"}')


def unauthorized(engine: Engine) -> Reply:
    if engine == "llama-server":
        return error(engine, 401, "Invalid API Key")
    return Reply(401, b'{"error":"Unauthorized"}')


def loading(engine: Engine) -> Reply:
    return error(engine, 503, "Loading model")


# --- reading requests -----------------------------------------------------------------------


def _words(text: str) -> int:
    return len(text.split())


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url"...}]
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def chat_prompt_tokens(messages: list[Any]) -> int:
    """One token per word, plus 3 per message for the chat template's markers."""
    return sum(
        _words(_content_text(m.get("content"))) + 3 for m in messages if isinstance(m, Mapping)
    )


def chat_prompt_token_ids(messages: list[Any]) -> list[str]:
    """The chat prompt as the fake's tokens: per message a start marker, the role and a
    separator (the 3 that `chat_prompt_tokens` counts), then one token per word. Two
    requests that open with the same system prompt share a token prefix."""
    tokens: list[str] = []
    for m in messages:
        if isinstance(m, Mapping):
            role = m.get("role")
            tokens += ["<|im_start|>", role if isinstance(role, str) else "", "<|sep|>"]
            tokens += _content_text(m.get("content")).split()
    return tokens


def completion_prompt_token_ids(prompt: object) -> list[str]:
    """The completion prompt as tokens: words, or the ids given (as "#ID"), in order."""
    if isinstance(prompt, str):
        return prompt.split()
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return [f"#{p}" for p in prompt]
        return [t for p in prompt for t in completion_prompt_token_ids(p)]
    return []


def block_chain(tokens: Sequence[str], block: int = PREFIX_BLOCK_TOKENS) -> tuple[int, ...]:
    """One hash per whole block of `tokens`, each over the one before it and the block's
    tokens (vLLM's block hashing): equal hashes at position i mean equal prefixes up to
    the end of block i. A trailing partial block is not cacheable and gets none."""
    chain: list[int] = []
    h = 0
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, *tokens[start : start + block]))
        chain.append(h)
    return tuple(chain)


def completion_prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return max(1, _words(prompt))
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return max(1, len(prompt))
        return max(1, sum(completion_prompt_tokens(p) for p in prompt))
    return 1


def _json_object(engine: Engine, body: bytes) -> dict[str, Any] | Reply:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return error(engine, 400, f"JSON decode error: {exc}")
    if not isinstance(obj, dict):
        return error(
            engine, 400, f"the request body must be a JSON object, got {type(obj).__name__}"
        )
    return obj


def _model(
    config: FakeConfig, body: Mapping[str, Any], adapters: AdapterChoice | None = None
) -> str | Reply:
    asked = body.get("model")
    if asked is None or asked == "":
        return config.served_names[0]
    if not isinstance(asked, str):
        return error(config.engine, 400, "model must be a string", "model")
    if adapters is not None and adapters.accepts(asked):
        return asked
    # llama-server serves its one model whatever the request names; the others refuse.
    if config.engine != "llama-server" and asked not in config.served_names:
        return error(config.engine, 404, f"The model `{asked}` does not exist.", "model")
    return asked


def read_generation(
    config: FakeConfig,
    kind: Literal["chat", "completion"],
    raw: bytes,
    tokens: int,
    prefix_blocks: bool = False,
    adapters: AdapterChoice | None = None,
) -> GenRequest | Reply:
    """Check a chat or completions request as the engine would; say what to generate.

    With `prefix_blocks`, the request carries its prompt's block chain for the prefix cache.
    With `adapters`, a request may name a loaded LoRA adapter, whose tag starts the text.
    """
    engine = config.engine
    body = _json_object(engine, raw)
    if isinstance(body, Reply):
        return body
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return error(engine, 400, "messages: Field required (a non-empty list)", "messages")
        prompt_tokens = chat_prompt_tokens(messages)
        chain = block_chain(chat_prompt_token_ids(messages)) if prefix_blocks else ()
    else:
        if "prompt" not in body or body["prompt"] in ("", []):
            return error(engine, 400, "prompt: Field required", "prompt")
        prompt_tokens = completion_prompt_tokens(body["prompt"])
        chain = block_chain(completion_prompt_token_ids(body["prompt"])) if prefix_blocks else ()
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return error(engine, 400, "stream must be true or false", "stream")
    limit = body.get("max_completion_tokens", body.get("max_tokens", body.get("n_predict")))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        return error(engine, 400, f"max_tokens must be at least 1, got {limit!r}", "max_tokens")
    model = _model(config, body, adapters)
    if isinstance(model, Reply):
        return model
    tag = adapters.select(body) if adapters is not None else ""
    if isinstance(tag, Reply):
        return tag
    ctx = config.ctx_per_slot
    if prompt_tokens + (limit or 0) > ctx or prompt_tokens >= ctx:
        if engine == "llama-server":
            return error(
                engine,
                400,
                "the request exceeds the available context size, "
                f"try increasing it (n_prompt_tokens={prompt_tokens}, n_ctx={ctx})",
            )
        return error(
            engine,
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_tokens + (limit or 0)} tokens ({prompt_tokens} in the messages, "
            f"{limit or 0} in the completion). Please reduce the length of the messages or "
            "completion.",
        )
    n = min(tokens, limit or tokens, ctx - prompt_tokens)
    options = body.get("stream_options")
    include_usage = bool(stream and isinstance(options, Mapping) and options.get("include_usage"))
    return GenRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        prompt_tokens=prompt_tokens,
        n_tokens=n,
        finish_reason="stop" if n == tokens else "length",
        prompt_blocks=chain,
        tag=tag,
    )


def read_embeddings(config: FakeConfig, raw: bytes) -> EmbedRequest | Reply:
    engine = config.engine
    if not config.embeddings_enabled:
        return error(
            engine, 501, "This server does not support embeddings. Start it with `--embeddings`"
        )
    body = _json_object(engine, raw)
    if isinstance(body, Reply):
        return body
    value = body.get("input", body.get("content"))
    texts: list[str]
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        texts = [" ".join(map(str, value))]
    elif isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        texts = [v if isinstance(v, str) else " ".join(map(str, v)) for v in value]
    else:
        return error(
            engine, 400, "input must be a string, a list of strings or a list of token ids", "input"
        )
    model = _model(config, body)
    if isinstance(model, Reply):
        return model
    return EmbedRequest(
        model=model,
        texts=tuple(texts),
        prompt_tokens=sum(max(1, _words(t)) for t in texts),
        base64=body.get("encoding_format") == "base64",
    )


# --- building answers -----------------------------------------------------------------------


def token_text(i: int, tag: str = "") -> str:
    """The i-th generated token: the whole completion reads "tok0 tok1 tok2 ...",
    after `tag` (an adapter's "[NAME] ") on the first."""
    return f"{tag}tok{i}" if i == 0 else f" tok{i}"


def completion_text(n: int, tag: str = "") -> str:
    return "".join(token_text(i, tag) for i in range(n))


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """The usage object; `cached` (prompt tokens served from the prefix cache) adds
    `prompt_tokens_details.cached_tokens` as vLLM, SGLang and llama-server report it."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def llama_timings(
    cached: int, prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float
) -> dict[str, float]:
    """llama-server's `timings`: `prompt_n` is the uncached part of the prompt, `cache_n`
    the part served from its cache; times in milliseconds."""
    prompt_ms, predicted_ms = prompt_s * 1000, predicted_s * 1000
    return {
        "cache_n": cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / prompt_s if prompt_s else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": predicted_n / predicted_s if predicted_s else 0.0,
    }


def full_response(
    engine: Engine,
    req: GenRequest,
    rid: str,
    created: int,
    cached: int | None = None,
    timings: Mapping[str, float] | None = None,
) -> bytes:
    text = completion_text(req.n_tokens, req.tag)
    choice: dict[str, Any]
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": req.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason}
        obj = "text_completion"
    if engine == "vllm":
        choice["stop_reason"] = None
    answer: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": usage(req.prompt_tokens, req.n_tokens, cached),
    }
    if timings is not None:
        answer["timings"] = timings
    return dumps(answer)


class StreamWriter:
    """The SSE events of one streamed completion, in order.

    The engine sets `cached` (prompt tokens from the prefix cache) once the prompt
    is matched, and `timings` (llama-server's) before the last token; both go on the
    last event, as the engines send them.
    """

    def __init__(self, req: GenRequest, rid: str, created: int) -> None:
        self.req = req
        self.cached: int | None = None
        self.timings: Mapping[str, float] | None = None
        self._head = (
            f'{{"id":"{rid}","object":"'
            + ("chat.completion.chunk" if req.kind == "chat" else "text_completion")
            + f'","created":{created},"model":{json.dumps(req.model)},'
        ).encode()

    def _event(
        self, choices: list[Any], with_usage: object = None, timings: object = None
    ) -> bytes:
        tail: dict[str, object] = {"choices": choices}
        if self.req.include_usage:
            tail["usage"] = with_usage
        if timings is not None:
            tail["timings"] = timings
        return b"data: " + self._head + dumps(tail)[1:] + b"\n\n"

    def role(self) -> bytes:
        """vLLM's first chat chunk: the role, no text; empty for completions."""
        if self.req.kind != "chat":
            return b""
        return self._event(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def token(self, i: int) -> bytes:
        last = i == self.req.n_tokens - 1
        finish = self.req.finish_reason if last else None
        if self.req.kind == "chat":
            choice = {
                "index": 0,
                "delta": {"content": token_text(i, self.req.tag)},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            text = token_text(i, self.req.tag)
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        # llama-server puts its timings on the last event: this one, unless a usage chunk follows.
        last_event = last and not self.req.include_usage
        return self._event([choice], timings=self.timings if last_event else None)

    def end(self) -> bytes:
        """The usage chunk when asked for, then [DONE]."""
        done = b"data: [DONE]\n\n"
        if not self.req.include_usage:
            return done
        used = usage(self.req.prompt_tokens, self.req.n_tokens, self.cached)
        return self._event([], used, self.timings) + done


def embedding(text: str, dim: int) -> list[float]:
    """A unit vector that depends only on `text` and `dim`."""
    rng = random.Random(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big"))
    v = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def embeddings_response(req: EmbedRequest, dim: int) -> bytes:
    data = []
    for i, text in enumerate(req.texts):
        vec = embedding(text, dim)
        value: object = (
            base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode() if req.base64 else vec
        )
        data.append({"index": i, "object": "embedding", "embedding": value})
    return dumps(
        {
            "id": f"embd-{hashlib.sha256(repr(req.texts).encode()).hexdigest()[:24]}",
            "object": "list",
            "model": req.model,
            "data": data,
            "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens},
        }
    )


def models_response(
    config: FakeConfig, ready: bool, created: int, adapters: Sequence[Mapping[str, Any]] = ()
) -> bytes:
    """The served names (vLLM and SGLang: with `parent` null), then `adapters`' entries."""
    owner = {"vllm": "vllm", "llama-server": "llamacpp", "sglang": "sglang"}[config.engine]
    data: list[dict[str, Any]] = []
    if ready:
        for name in config.served_names:
            entry: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": owner,
            }
            if config.engine != "llama-server":
                entry["root"] = config.model
                entry["parent"] = None
                entry["max_model_len"] = config.ctx_per_slot
            data.append(entry)
        data += (dict(entry) for entry in adapters)
    return dumps({"object": "list", "data": data})


# --- load ---------------------------------------------------------------------------------


@attrs.define
class Running:
    """A request that holds a slot (llama-server) or a place in the batch (vLLM, SGLang)."""

    slot: int
    task: int
    prompt_tokens: int
    generated: int = 0


class PrefixCache:
    """The prompts an engine still holds in KV cache: an LRU of prompt blocks.

    Capacity is in tokens, kept as whole blocks of `block` tokens; a block shared by
    several prompts (a common system prompt) is held once. A lookup walks the
    request's block chain (`block_chain`) and stops at the first block not held:
    O(prompt blocks), one dict lookup each. Inserting a prompt refreshes its blocks
    with its first block the most recent, as vLLM frees a request's blocks tail
    first, so eviction takes the tails of the least recently used prompts before
    their shared heads. A prompt longer than the capacity keeps only its head.
    """

    def __init__(self, capacity_tokens: int, block: int = PREFIX_BLOCK_TOKENS) -> None:
        if capacity_tokens < block:
            raise ValueError(f"capacity_tokens is {capacity_tokens}; it must be at least {block}")
        self.block = block
        self.capacity_blocks = capacity_tokens // block
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which were served from the cache
        self.evicted = 0  # blocks

    def lookup(self, chain: Sequence[int], prompt_tokens: int) -> int:
        """How many of the prompt's tokens are cached (whole blocks, and never the last
        token: an engine always computes at least one); counted in queries/hits."""
        held = 0
        for h in chain:
            if h not in self._blocks:
                break
            held += 1
        cached = min(held * self.block, (prompt_tokens - 1) // self.block * self.block)
        cached = max(0, cached)
        self.queries += prompt_tokens
        self.hits += cached
        return cached

    def insert(self, chain: Sequence[int]) -> None:
        """The prompt was prefilled: hold its blocks, evicting the least recently used."""
        blocks = self._blocks
        for h in reversed(chain[: self.capacity_blocks]):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.evicted += 1

    @property
    def tokens(self) -> int:
        return len(self._blocks) * self.block

    def __repr__(self) -> str:
        return (
            f"<PrefixCache {self.tokens}/{self.capacity_blocks * self.block} tokens "
            f"queries={self.queries} hits={self.hits} evicted_blocks={self.evicted}>"
        )


class EngineState:
    """Counters and the running set: what the fake's endpoints report about its load.

    `received` counts inference requests (chat, completions, embeddings); each
    ends as exactly one of `completed`, `cancelled` (the client went away
    first) or `failed` (answered with an error status). `prefix` is the prefix
    cache, None when none is modelled.
    """

    def __init__(self, slots: int, kv_tokens: int, prefix_cache_tokens: int = 0) -> None:
        self.slots = slots
        self.kv_tokens = kv_tokens
        self.prefix = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.ready = False
        self.received = 0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.waiting = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_by_reason: dict[str, int] = {"stop": 0, "length": 0}
        self.running: dict[int, Running] = {}
        self._free = list(range(slots))
        self._tasks = 0
        self._fail_seen = 0

    @property
    def in_flight(self) -> int:
        return self.received - self.completed - self.cancelled - self.failed

    def admit(self) -> None:
        self.received += 1

    def should_fail(self, rate: float) -> bool:
        """Spread failures evenly: with rate r, request k fails when floor(k*r) steps up."""
        if rate <= 0.0:
            return False
        self._fail_seen += 1
        k = self._fail_seen
        return math.floor(round(k * rate, 9)) > math.floor(round((k - 1) * rate, 9))

    def finish(self, outcome: Outcome) -> None:
        if outcome == "completed":
            self.completed += 1
        elif outcome == "cancelled":
            self.cancelled += 1
        else:
            self.failed += 1

    def start(self, prompt_tokens: int) -> Running:
        """Take the lowest free slot; the caller has made sure one is free."""
        slot = heapq.heappop(self._free)
        self._tasks += 1
        run = Running(slot=slot, task=self._tasks, prompt_tokens=prompt_tokens)
        self.running[slot] = run
        self.prompt_tokens_total += prompt_tokens
        return run

    def generated(self, run: Running) -> None:
        run.generated += 1
        self.generation_tokens_total += 1

    def release(self, run: Running, finish_reason: str | None) -> None:
        del self.running[run.slot]
        heapq.heappush(self._free, run.slot)
        if finish_reason is not None:
            self.finished_by_reason[finish_reason] = (
                self.finished_by_reason.get(finish_reason, 0) + 1
            )

    def kv_used_tokens(self) -> int:
        return sum(r.prompt_tokens + r.generated for r in self.running.values())

    def kv_usage(self) -> float:
        return min(1.0, self.kv_used_tokens() / self.kv_tokens)

    def statistics(self) -> dict[str, int | bool]:
        return {
            "ready": self.ready,
            "received": self.received,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "in_flight": self.in_flight,
            "running": len(self.running),
            "waiting": self.waiting,
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.generation_tokens_total,
        } | ({"prompt_tokens_cached": self.prefix.hits} if self.prefix else {})

    def __repr__(self) -> str:
        s = self.statistics()
        return "<EngineState " + " ".join(f"{k}={v}" for k, v in s.items()) + ">"


def _exposition(families: list[tuple[str, str, str, list[tuple[str, float]]]]) -> str:
    lines: list[str] = []
    for name, kind, help, samples in families:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value!r}" for labels, value in samples)
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def metrics_text(config: FakeConfig, state: EngineState) -> str:
    """/metrics in the Prometheus text format, with the imitated engine's names."""
    running, waiting = float(len(state.running)), float(state.waiting)
    prompt, generated = float(state.prompt_tokens_total), float(state.generation_tokens_total)
    name = _label(config.served_names[0])
    if config.engine == "vllm":
        lab = f'{{engine="0",model_name={name}}}'
        by_reason = [
            (f'{{engine="0",finished_reason="{reason}",model_name={name}}}', float(n))
            for reason, n in sorted(state.finished_by_reason.items())
        ]
        prefix = state.prefix
        cache_families = [
            ("vllm:prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.",
             [(lab, float(prefix.queries))]),
            ("vllm:prefix_cache_hits_total", "counter",
             "Prefix cache hits, in terms of number of cached tokens.",
             [(lab, float(prefix.hits))]),
        ] if prefix else []  # fmt: skip
        return _exposition([
            ("vllm:num_requests_running", "gauge",
             "Number of requests in model execution batches.", [(lab, running)]),
            ("vllm:num_requests_waiting", "gauge",
             "Number of requests waiting to be processed.", [(lab, waiting)]),
            ("vllm:kv_cache_usage_perc", "gauge",
             "KV-cache usage. 1 means 100 percent usage.", [(lab, state.kv_usage())]),
            ("vllm:prompt_tokens_total", "counter",
             "Number of prefill tokens processed.", [(lab, prompt)]),
            ("vllm:generation_tokens_total", "counter",
             "Number of generation tokens processed.", [(lab, generated)]),
            ("vllm:request_success_total", "counter",
             "Count of successfully processed requests.", by_reason),
            *cache_families,
        ])  # fmt: skip
    if config.engine == "sglang":
        lab = f"{{model_name={name}}}"
        return _exposition([
            ("sglang:num_running_reqs", "gauge", "The number of running requests.",
             [(lab, running)]),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
             [(lab, waiting)]),
            ("sglang:num_used_tokens", "gauge", "The number of used tokens.",
             [(lab, float(state.kv_used_tokens()))]),
            ("sglang:token_usage", "gauge", "The token usage.", [(lab, state.kv_usage())]),
            ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             [(lab, prompt)]),
            ("sglang:generation_tokens_total", "counter",
             "Number of generation tokens processed.", [(lab, generated)]),
            ("sglang:num_requests_total", "counter", "Number of requests processed.",
             [(lab, float(state.completed))]),
        ])  # fmt: skip
    # llama.cpp's names carry no labels, and recent versions have no KV cache gauge.
    return _exposition([
        ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.",
         [("", prompt)]),
        ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
         [("", generated)]),
        ("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls",
         [("", generated)]),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.",
         [("", running)]),
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.",
         [("", waiting)]),
    ])  # fmt: skip


def slots_response(config: FakeConfig, state: EngineState, n_predict: int) -> bytes:
    """llama-server's GET /slots: one object per slot."""
    slots = []
    for i in range(config.slots):
        run = state.running.get(i)
        slots.append(
            {
                "id": i,
                "id_task": run.task if run else -1,
                "n_ctx": config.ctx_per_slot,
                "speculative": False,
                "is_processing": run is not None,
                "params": {"n_predict": n_predict, "stream": True},
                "next_token": {
                    "has_next_token": run is not None,
                    "has_new_line": False,
                    "n_remain": n_predict - run.generated if run else -1,
                    "n_decoded": run.generated if run else 0,
                },
            }
        )
    return dumps(slots)
