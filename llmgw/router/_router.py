"""The router: one OpenAI-compatible endpoint in front of many replicas.

Per request: authenticate (the key cache, no store round trip) -> read and
check the body -> model known (404) and allowed for the key (403) -> priority
band (header `X-LLMGW-Priority`, else the key's default, capped at the key's
highest band) -> admission (concurrency limit and queue per model) -> choose
an endpoint (scoring over scraped load and our own in-flight counts, breaker,
optional session affinity) -> proxy, retrying on another endpoint only while
nothing has reached the client -> pass status, headers and body chunks through
as they arrive -> release everything and count.

A client that goes away cancels the whole request: the admission slot or
queue place is given back, and the upstream connection is closed so the
engine cancels its generation.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import random
import re
import time
from array import array
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import attrs
import trio
from prometheus_client import CollectorRegistry

from llmgw.config import BoundError, between, positive
from llmgw.core._admission import Admission, AdmissionConfig, Band, Queued, Reject
from llmgw.core._breaker import Breaker, BreakerConfig
from llmgw.core._prefix import NO_MATCH, Match, PrefixIndex, chain
from llmgw.core._scoring import (
    POLICIES,
    Decision,
    EndpointLoad,
    RequestEstimate,
    ScoringConfig,
    decide,
    explain,
)
from llmgw.errors import LlmgwError
from llmgw.router import _request_id, _server, _surface
from llmgw.router._keys import ApiKey, CachedKeys, KeyStore
from llmgw.router._metrics import RouterMetrics
from llmgw.router._scraper import EndpointState, Scraper
from llmgw.router._surface import HttpError, Route
from llmgw.router._tenants import Refused, TenantLimiter, ceiling, share
from llmgw.router._types import Endpoint, EndpointSource
from llmgw.router._upstream import (
    ConnectFailed,
    Response,
    Timeouts,
    UpstreamError,
    UpstreamTimeout,
)
from llmgw.router._usage import UsageMeter, UsageSink

# JSON strings, skipped when measuring nesting (brackets inside them do not nest).
# Possessive, so an unterminated string costs one pass, not a backtracking search.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NESTING = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
# Above this the C decoder may meet the interpreter's recursion limit, whose
# headroom depends on how deep the serving task's stack already is.
MAX_JSON_DEPTH = 512
MAX_WORKERS = 64

log = logging.getLogger("llmgw.router")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PRIORITY_HEADER = b"x-llmgw-priority"
EXPLAIN_HEADER = b"x-llmgw-explain"

# Response headers that describe one hop's connection, not the message.
_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"date",
        b"server",
    }
)

_MODEL_PREFIX = "/v1/models/"


DEFAULT_BANDS = (Band("interactive", 0, 30.0), Band("batch", 1, 120.0))


def _default_bands() -> list[Band]:
    return list(DEFAULT_BANDS)


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise BoundError(attribute.name, f"must be > 0 (got {value})")


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise BoundError(attribute.name, f"must be ≥ 0 (got {value})")


def _policy(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in POLICIES:
        raise BoundError(attribute.name, f"must be one of {', '.join(POLICIES)} (got {value!r})")


@attrs.define(kw_only=True, frozen=True)
class RouterConfig:
    max_body_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=_positive)
    # Nesting of arrays and objects a request body may have (400 beyond it), checked
    # before the body is parsed; a tool's JSON schema nests a dozen levels or so.
    max_json_depth: int = attrs.field(default=128, validator=between(1, MAX_JSON_DEPTH))
    retries: int = attrs.field(default=2, validator=_non_negative)
    connect_timeout_s: float = attrs.field(default=5.0, validator=positive(300))
    # Request sent -> response head. A non-streamed completion's head comes only
    # once it is generated, so this bounds the longest non-streamed generation.
    first_byte_timeout_s: float = attrs.field(default=600.0, validator=positive(86400))
    idle_timeout_s: float = attrs.field(default=60.0, validator=positive(3600))
    scrape_interval_s: float = attrs.field(default=1.0, validator=between(0.1, 300))
    stale_after_intervals: float = attrs.field(default=3.0, validator=_positive)
    unhealthy_after_misses: int = attrs.field(default=3, validator=_positive)
    bands: list[Band] = attrs.field(factory=_default_bands)
    queue_limit: int = attrs.field(default=1024, validator=_non_negative)
    # Per model; None: the sum of its endpoints' slots (slots_per_endpoint when unknown).
    concurrency: int | None = attrs.field(default=None, validator=_positive)
    slots_per_endpoint: int = attrs.field(default=64, validator=_positive)
    affinity_header: str | None = None
    # How an endpoint is chosen (llmgw/core/_scoring.py): expected cost with the
    # prefix cache counted, the same without it, or plain rotation (a baseline).
    policy: str = attrs.field(default="prefix", validator=_policy)
    # No endpoint takes a request that puts it over (1 + epsilon) x the model's mean.
    load_bound_epsilon: float = attrs.field(default=0.25, validator=between(0, 10))
    # The prefix index (llmgw/core/_prefix.py): block size, blocks kept per endpoint
    # (about 100 bytes each), and the half-life of a match's credit.
    prefix_block_bytes: int = attrs.field(default=256, validator=between(16, 1 << 20))
    prefix_blocks_per_endpoint: int = attrs.field(default=8192, validator=between(1, 1 << 24))
    prefix_half_life_s: float = attrs.field(default=300.0, validator=positive(86400))
    breaker_failures: int = attrs.field(default=5, validator=_positive)
    breaker_open_s: float = attrs.field(default=10.0, validator=positive(3600))
    key_cache_ttl_s: float = attrs.field(default=30.0, validator=positive(86400))
    upstream_keepalive_s: float = attrs.field(default=4.0, validator=positive(3600))
    # The client side of the router's listener (llmgw/router/_server.py); each write to
    # a client is bounded by idle_timeout_s (a client that stops reading is cut).
    client_head_timeout_s: float = attrs.field(default=60.0, validator=positive(3600))
    client_body_timeout_s: float = attrs.field(default=60.0, validator=positive(86400))
    client_keepalive_s: float = attrs.field(default=75.0, validator=positive(3600))
    max_head_bytes: int = attrs.field(default=32768, validator=between(1024, 1 << 20))
    # Processes serving the router listener (SO_REUSEPORT, the kernel spreads the
    # connections); each admits its share of every limit (`share`). Inside llmgw-cp
    # the control plane itself is worker 0 (llmgw/cp/_workers.py).
    workers: int = attrs.field(default=1, validator=between(1, MAX_WORKERS))
    # How often counted usage goes to the store (the UsageSink), and once more at shutdown.
    usage_flush_s: float = attrs.field(default=10.0, validator=positive(3600))

    def __attrs_post_init__(self) -> None:
        AdmissionConfig(
            concurrency=1,
            queue_limit=self.queue_limit,
            bands=tuple(self.bands),
        )


class _ClientGone(Exception):
    """The client closed its connection before its request was read."""


def _ewma(old: float | None, new: float, weight: float = 0.1) -> float:
    return new if old is None else old + weight * (new - old)


class _Model:
    """One served name: its endpoints, its admission, and what its answers taught.

    The request estimate learns from the engines' reports: prompt bytes per
    token (the rendering's bytes over the engine's prompt_tokens), output
    tokens per answer, and what one output token costs in prompt tokens
    (llama.cpp's timings, their lower envelope: the cost when the engine is not
    also busy with another's prefill). Until a report comes, the defaults stand.
    """

    __slots__ = (
        "admission",
        "bytes_per_token",
        "decode_cost",
        "endpoints",
        "name",
        "output_tokens",
        "rotation",
    )

    def __init__(self, name: str, admission: Admission) -> None:
        self.name = name
        self.admission = admission
        self.endpoints: tuple[EndpointState, ...] = ()
        self.bytes_per_token: float | None = None
        self.output_tokens: float | None = None
        self.decode_cost: float | None = None
        self.rotation = 0

    def estimate(self, prompt: _Prompt | None) -> RequestEstimate:
        if prompt is None:
            return RequestEstimate(prompt_tokens=0.0, output_tokens=self._output(None))
        return RequestEstimate(
            prompt_tokens=len(prompt.text) / (self.bytes_per_token or 4.0),
            output_tokens=self._output(prompt.max_tokens),
            decode_cost=self.decode_cost or 4.0,
        )

    def _output(self, limit: int | None) -> float:
        typical = self.output_tokens if self.output_tokens is not None else 64.0
        return typical if limit is None else min(float(limit), typical)

    def learn(self, prompt: _Prompt | None, report: _surface.CacheReport) -> None:
        if prompt is not None and report.prompt_tokens and report.prompt_tokens >= 16:
            ratio = len(prompt.text) / report.prompt_tokens
            if 0.05 <= ratio <= 64:
                self.bytes_per_token = _ewma(self.bytes_per_token, ratio)
        if report.completion_tokens is not None:
            self.output_tokens = _ewma(self.output_tokens, float(report.completion_tokens))
        per_prompt, per_output = report.prompt_ms_per_token, report.output_ms_per_token
        # A handful of uncached tokens is computed at a poor rate: not a fair reading.
        if per_prompt and per_output and (report.prompt_n or 0) >= 256:
            ratio = per_output / per_prompt
            if 0.1 <= ratio <= 10_000:
                # The lower envelope: an answer that shared the engine with another's
                # prefill reads its tokens as 10x dearer than they are (measured: 85
                # against 8 alone), and that would make any busy endpoint look dear.
                old = self.decode_cost
                self.decode_cost = ratio if old is None or ratio < old else _ewma(old, ratio, 0.02)


@attrs.frozen
class _Prompt:
    """A request's prompt as the prefix index sees it."""

    text: bytes  # the canonical rendering (_surface.prompt_bytes)
    blocks: tuple[int, ...]  # its chain hashes; empty when the policy does not use them
    max_tokens: int | None


class _Sent:
    """One attempt's share of an endpoint's own load and of its index's in-flight
    prefills, each taken back exactly once."""

    __slots__ = ("blocks", "decode", "guessed_tokens", "match", "prefill", "state")

    def __init__(
        self,
        state: EndpointState,
        prefill: float,
        decode: float,
        match: Match,
        guessed: float,
        blocks: tuple[int, ...],
        now: float,
    ) -> None:
        self.state = state
        self.prefill = prefill
        self.decode = decode
        self.match = match
        self.guessed_tokens = guessed
        self.blocks: tuple[int, ...] | None = blocks  # None once ended
        state.in_flight += 1
        state.pending_prefill += prefill
        state.pending_decode += decode
        if blocks:
            state.index.record(blocks, now)  # predict-on-route: siblings follow
            state.index.begin(blocks)

    def answering(self) -> None:
        """The answer has begun: the prompt is processed, and the engine holds it."""
        if self.prefill < 0:
            return
        self.state.pending_prefill = max(0.0, self.state.pending_prefill - self.prefill)
        self.prefill = -1.0  # taken back
        if self.blocks:
            self.state.index.computed(self.blocks, trio.current_time())

    def done(self) -> None:
        if self.prefill >= 0:  # ended before its answer began
            self.state.pending_prefill = max(0.0, self.state.pending_prefill - self.prefill)
            self.prefill = -1.0
        if self.blocks:
            self.state.index.end(self.blocks)
        self.blocks = None
        self.state.pending_decode = max(0.0, self.state.pending_decode - self.decode)
        self.decode = 0.0
        self.state.in_flight -= 1


class _Waiter:
    __slots__ = ("admitted", "event", "retry_after_s")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.admitted = False
        self.retry_after_s: float | None = None


class _Exchange:
    """Per-request bookkeeping the cleanup path reads."""

    __slots__ = (
        "band",
        "client_gone",
        "complete",
        "completion_tokens",
        "content_type",
        "errors",
        "key_id",
        "model",
        "prompt",
        "prompt_tokens",
        "report",
        "responded",
        "status",
        "strip_usage",
        "tenant",
        "ttft",
    )

    def __init__(self) -> None:
        self.content_type = _surface.JSON_CONTENT_TYPE  # what the engine is sent
        self.errors: _surface.ErrorShape = "openai"  # the route's error shape
        self.complete = False  # the last byte is being sent: a disconnect now is no news
        self.model = ""
        self.band = ""
        self.status = 0
        self.responded = False
        self.client_gone = False
        self.ttft: float | None = None
        self.prompt: _Prompt | None = None
        self.report: _surface.CacheReport | None = None  # the engine's, from the answer
        # Set once the request passed its tenant's limits: from then on it is metered.
        self.tenant: str | None = None
        self.key_id = ""
        self.prompt_tokens: int | None = None  # the relayed answer's usage (None: not said)
        self.completion_tokens: int | None = None
        self.strip_usage = False  # the router asked for the usage chunk; the client did not


class Router:
    """The router. Serve `app` on an HTTP listener, run `run()` in a nursery beside it,
    and serve `metrics_registry` on the admin listener's `/metrics`."""

    def __init__(
        self,
        config: RouterConfig,
        endpoints: EndpointSource,
        keys: KeyStore,
        *,
        registry: CollectorRegistry | None = None,
        rng: random.Random | None = None,
        worker: int = 0,
        admin_key: str | None = None,
        usage: UsageSink | None = None,
    ) -> None:
        """`worker`: this process's index among `config.workers` (its share of the limits,
        tenants' included: each of N workers admits a tenant's limit / N).
        `admin_key`: the key whose requests may ask `x-llmgw-explain: 1`.
        `usage`: where counted usage is flushed (the control plane's store); None: it is
        counted (`meter`) and never sent anywhere."""
        if not 0 <= worker < config.workers:
            raise ValueError(f"worker must be 0 to {config.workers - 1} (workers), got {worker}")
        self.config = config
        self.worker = worker
        # With several workers, every response names the one that served it.
        self._worker_headers: tuple[tuple[bytes, bytes], ...] = (
            ((b"x-llmgw-worker", f"{worker}; pid={os.getpid()}".encode()),)
            if config.workers > 1
            else ()
        )
        self._source = endpoints
        self.keys = (
            keys if isinstance(keys, CachedKeys) else CachedKeys(keys, config.key_cache_ttl_s)
        )
        self._rng = rng or random.Random()
        self._bands = {b.name: b for b in config.bands}
        self._ranks = {b.name: b.rank for b in config.bands}
        self._timeouts = Timeouts(
            connect_s=config.connect_timeout_s,
            first_byte_s=config.first_byte_timeout_s,
            idle_s=config.idle_timeout_s,
        )
        self._scoring = ScoringConfig(
            policy=config.policy,  # type: ignore[arg-type]  # checked by RouterConfig
            scrape_interval_s=config.scrape_interval_s,
            stale_after_intervals=config.stale_after_intervals,
            epsilon=config.load_bound_epsilon,
        )
        self._use_prefix = config.policy == "prefix"
        self._admin_digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else None
        self._breaker_config = BreakerConfig(
            failure_threshold=config.breaker_failures, open_s=config.breaker_open_s
        )
        self._affinity = config.affinity_header.lower().encode() if config.affinity_header else None
        self._models: dict[str, _Model] = {}
        self.tenants = TenantLimiter(worker=worker, workers=config.workers)
        self.meter = UsageMeter()
        self._usage_sink = usage
        self._unknown_ceilings: set[tuple[str, str]] = set()  # logged once each
        self._known: dict[str, _Model] = {}  # what the source lists now
        self._states: dict[str, EndpointState] = {}
        # Endpoints that left the source's list with requests still on them: their
        # counts stay readable (`in_flight`) until the last one ends (a drain waits on it).
        self._leaving: dict[str, list[EndpointState]] = {}
        self._seen_version: int | None = None
        self._waiters: dict[str, _Waiter] = {}
        self._ids = itertools.count(1)
        self.metrics_registry = registry if registry is not None else CollectorRegistry()
        self.metrics = RouterMetrics(self.metrics_registry, self)
        self.scraper = Scraper(
            lambda: list(self._states.values()),
            interval_s=config.scrape_interval_s,
            unhealthy_after=config.unhealthy_after_misses,
            on_slots=self._slots_changed,
        )
        self.refresh()

    def __repr__(self) -> str:
        return f"<Router {len(self._known)} models, {len(self._states)} endpoints>"

    # --- views ---------------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        return {
            "models": {
                name: {
                    "admission": m.admission.statistics(),
                    "endpoints": [s.endpoint.endpoint_id for s in m.endpoints],
                }
                for name, m in self._known.items()
            },
            "endpoints": {
                eid: {
                    "healthy": s.healthy,
                    "in_flight": s.in_flight,
                    "running": s.running,
                    "waiting": s.waiting,
                    "kv_usage": s.kv_usage,
                    "scraped_at": s.scraped_at,
                    "pending_prefill": s.pending_prefill,
                    "pending_decode": s.pending_decode,
                    "prefix_blocks": len(s.index),
                    "prefix_half_life_s": s.index.half_life_s,
                    "breaker": s.breaker.state.value,
                    "pool": s.pool.statistics(),
                }
                for eid, s in self._states.items()
            },
            "waiting": len(self._waiters),
            "keys": self.keys.statistics(),
            "tenants": self.tenants.statistics(),
            "usage": self.meter.statistics(),
        }

    def models(self) -> dict[str, _Model]:
        self._maybe_refresh()
        return self._known

    def endpoint_states(self) -> dict[str, EndpointState]:
        return self._states

    def score_config(self) -> ScoringConfig:
        return self._scoring

    def in_flight(self, endpoint_id: str) -> int:
        """Requests being proxied to this endpoint now, whether or not it is still listed.

        Reads the source first, so a caller that has just taken the endpoint out of
        the list and then sees 0 knows nothing is, or will be, sent there.
        """
        self._maybe_refresh()
        listed = self._states.get(endpoint_id)
        gone = self._leaving.get(endpoint_id, ())
        return (listed.in_flight if listed is not None else 0) + sum(s.in_flight for s in gone)

    # --- the fleet's view ------------------------------------------------------------------

    def _maybe_refresh(self) -> None:
        if self._source.version != self._seen_version:
            self.refresh()

    def refresh(self) -> None:
        """Re-read the endpoint source: new endpoints, gone ones, concurrency limits."""
        self._seen_version = self._source.version
        snapshot = self._source.snapshot()
        now = trio.current_time() if _in_trio() else 0.0
        states: dict[str, EndpointState] = {}
        known: dict[str, _Model] = {}
        for name, eps in snapshot.items():
            model = self._models.get(name)
            if model is None:
                model = self._models[name] = _Model(name, self._new_admission(name))
            model_states = []
            for ep in eps:
                state = self._states.get(ep.endpoint_id) or states.get(ep.endpoint_id)
                if state is None or _moved(state.endpoint, ep):
                    if state is not None:
                        state.close()
                        if state.in_flight > 0:
                            self._leaving.setdefault(ep.endpoint_id, []).append(state)
                    state = EndpointState(
                        ep,
                        Breaker(self._breaker_config, name=ep.endpoint_id),
                        keepalive_s=self.config.upstream_keepalive_s,
                        index=PrefixIndex(
                            self.config.prefix_blocks_per_endpoint,
                            self.config.prefix_half_life_s,
                        ),
                    )
                elif state.endpoint != ep:
                    state.endpoint = ep
                    if ep.slots is not None:
                        state.slots = ep.slots
                states[ep.endpoint_id] = state
                model_states.append(state)
            model.endpoints = tuple(model_states)
            known[name] = model
        for eid, state in self._states.items():
            if eid not in states:
                state.close()
                if state.in_flight > 0:
                    self._leaving.setdefault(eid, []).append(state)
        self._leaving = {
            eid: busy
            for eid, gone in self._leaving.items()
            if (busy := [s for s in gone if s.in_flight > 0])
        }
        for name, model in self._models.items():
            if name not in known:
                model.endpoints = ()
            self._wake(model.admission.set_concurrency(self._concurrency(model), now))
        self._states = states
        self._known = known
        log.debug("endpoints now: %s", {n: len(m.endpoints) for n, m in known.items()})

    def _slots_changed(self, state: EndpointState) -> None:
        """The engine reported how many requests it runs at once: admission follows."""
        now = trio.current_time()
        for model in self._known.values():
            if state in model.endpoints:
                self._wake(model.admission.set_concurrency(self._concurrency(model), now))

    def _concurrency(self, model: _Model) -> int:
        if not model.endpoints:
            return 0
        if self.config.concurrency is not None:
            total = self.config.concurrency
        else:
            total = sum(s.slots or self.config.slots_per_endpoint for s in model.endpoints)
        return share(total, self.worker, self.config.workers)

    def _new_admission(self, name: str) -> Admission:
        cfg = AdmissionConfig(
            concurrency=0,
            queue_limit=share(self.config.queue_limit, self.worker, self.config.workers),
            bands=tuple(self.config.bands),
        )
        return Admission(cfg, name=name)

    # --- background ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scraper, the fleet watch and the usage flush; cancel to stop (usage is
        flushed once more, shielded and bounded). Requests time out in the queue on their
        own deadlines, so no admission timer is needed here."""
        try:
            await self._run(task_status)
        finally:
            if self._usage_sink is not None:
                with trio.CancelScope(shield=True):
                    await self.flush_usage(self._usage_sink)

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as nursery:
            self.refresh()
            await nursery.start(self.scraper.run)
            nursery.start_soon(self._watch_source)
            if self._usage_sink is not None:
                nursery.start_soon(self._flush_usage, self._usage_sink)
            task_status.started()

    async def _flush_usage(self, sink: UsageSink) -> None:
        while True:
            await trio.sleep(self.config.usage_flush_s)
            await self.flush_usage(sink)

    async def flush_usage(self, sink: UsageSink) -> None:
        """Send the counted usage; on failure it stays counted for the next flush."""
        if not self.meter.statistics()["pending"]:
            return
        try:
            with trio.fail_after(max(10.0, self.config.usage_flush_s)):
                await self.meter.flush(sink)
        except Exception as exc:  # the store is down or slow: keep counting, try again
            stats = self.meter.statistics()
            log.warning(
                "usage: could not write %d rows to the store (kept for the next flush "
                "in %g s; %d requests dropped so far, over %d rows pending): %s",
                stats["pending"],
                self.config.usage_flush_s,
                stats["dropped"],
                self.meter.max_rows,
                exc or type(exc).__name__,
            )

    async def _watch_source(self) -> None:
        # Requests re-read the source too; this catches changes while no request comes.
        while True:
            await trio.sleep(min(1.0, self.config.scrape_interval_s))
            self._maybe_refresh()

    def close(self) -> None:
        for state in self._states.values():
            state.close()

    # --- ASGI ------------------------------------------------------------------------------

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        method = scope["method"]
        if method == "HEAD":  # answered as GET; the server sends the head only
            method = "GET"
        rid = _request_id.new()
        send = _request_id.tagged(send, rid, self._worker_headers)
        rid_token = _request_id.CURRENT.set(rid)
        route = _surface.ROUTES.get(path)
        ex = _Exchange()
        if route is not None:
            ex.errors = route.errors
        start = time.perf_counter()
        try:
            if route is not None and method == "POST":
                await self._inference(scope, receive, send, route, ex)
            elif path == "/v1/models" and method == "GET":
                await self._list_models(scope, send, ex)
            elif path.startswith(_MODEL_PREFIX) and method == "GET":
                await self._get_model(scope, send, ex, path[len(_MODEL_PREFIX) :])
            elif path in ("/health", "/healthz") and method == "GET":
                ex.status = 200
                await _json(send, 200, {"status": "ok"})
            elif route is not None or path == "/v1/models" or path.startswith(_MODEL_PREFIX):
                raise HttpError(
                    405,
                    f"{scope['method']} is not allowed on {path}",
                    type="invalid_request_error",
                    code="method_not_allowed",
                    headers=((b"allow", b"POST" if route is not None else b"GET, HEAD"),),
                )
            else:
                raise HttpError(
                    404,
                    f"no such API route: {method} {path}",
                    type="invalid_request_error",
                    code="unknown_url",
                )
        except HttpError as exc:
            ex.status = exc.status
            if not ex.responded:
                await _error(send, exc, ex.errors)
        except _ClientGone:
            ex.status = 499
        finally:
            if ex.client_gone:
                ex.status = 499  # nginx's "client closed request": the client left first
            if route is not None or ex.status:
                self.metrics.finished(ex, time.perf_counter() - start)
            if ex.tenant is not None:
                self._metered(ex)
            _request_id.CURRENT.reset(rid_token)

    def _metered(self, ex: _Exchange) -> None:
        """A request its tenant's limits let through has finished, however it ended: its
        tokens (those its answer reported; unknown adds 0) go to the meter, the tenant's
        token bucket and the tenant's metrics."""
        tenant = ex.tenant
        assert tenant is not None
        prompt, completion = ex.prompt_tokens, ex.completion_tokens
        self.meter.add(time.time(), tenant, ex.key_id, ex.model, prompt, completion)
        self.metrics.tenant_finished(tenant, prompt, completion)
        spent = (prompt or 0) + (completion or 0)
        if spent:
            self.tenants.charge(tenant, spent, trio.current_time())

    def _tenant_admit(self, key: ApiKey, band: Band) -> None:
        """The tenant's band ceiling (403) and its requests and tokens per minute (429)."""
        limits = key.limits
        if limits is None:
            return
        tenant = key.tenant
        refused: Refused | None = None
        if limits.max_band is not None:
            if limits.max_band in self._ranks:
                refused = ceiling(tenant, band.name, limits.max_band, self._ranks)
            elif (tenant, limits.max_band) not in self._unknown_ceilings:
                self._unknown_ceilings.add((tenant, limits.max_band))
                log.warning(
                    "tenant %s: its highest band %r is not a configured band (the bands "
                    "are %s); no band ceiling for it",
                    tenant,
                    limits.max_band,
                    ", ".join(self._bands),
                )
        if refused is None:
            refused = self.tenants.admit(tenant, limits, trio.current_time())
        if refused is None:
            return
        self.metrics.tenant_refused(tenant, refused.reason)
        if refused.reason == "band":
            raise HttpError(403, refused.message, type="permission_error", code="band_not_allowed")
        seconds = refused.retry_after_s
        raise HttpError(
            429,
            refused.message,
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=((b"retry-after", b"%d" % seconds),) if seconds is not None else (),
        )

    async def _list_models(self, scope: Scope, send: Send, ex: _Exchange) -> None:
        key = await self._authenticate(scope)
        created = 0
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "llmgw"}
            for name, model in sorted(self.models().items())
            if key.may_use(name) and any(s.healthy for s in model.endpoints)
        ]
        ex.status = 200
        await _json(send, 200, {"object": "list", "data": data})

    async def _get_model(self, scope: Scope, send: Send, ex: _Exchange, name: str) -> None:
        """OpenAI's `GET /v1/models/{model}`: a model GET /v1/models lists, else 404.

        A served name may hold slashes (`org/model`): the rest of the path is the name.
        """
        key = await self._authenticate(scope)
        model = self.models().get(name)
        if model is None or not key.may_use(name) or not any(s.healthy for s in model.endpoints):
            # 404, not 403, for a name the key may not use: no telling it the name exists.
            raise HttpError(
                404,
                f"the model {name!r} does not exist or is not available to this key "
                "(see GET /v1/models)",
                type="invalid_request_error",
                code="model_not_found",
            )
        ex.status = 200
        await _json(send, 200, {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"})

    def _need_admin(self, scope: Scope) -> None:
        token = _surface.api_key(scope["headers"])
        if self._admin_digest is None:
            raise HttpError(
                403,
                f"{EXPLAIN_HEADER.decode()}: this router has no admin key configured, "
                "so it explains no decisions",
                type="permission_error",
                code="explain_not_allowed",
            )
        if not token or not hmac.compare_digest(
            hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest(), self._admin_digest
        ):
            raise HttpError(
                403,
                f"{EXPLAIN_HEADER.decode()}: only the admin key may ask why an endpoint "
                "is chosen (its answer shows the whole fleet's load)",
                type="permission_error",
                code="explain_not_allowed",
            )

    def _prompt(self, path: str, request: dict[str, Any]) -> _Prompt | None:
        text = _surface.prompt_bytes(path, request)
        if text is None:
            return None
        blocks = tuple(chain(text, self.config.prefix_block_bytes)) if self._use_prefix else ()
        return _Prompt(text, blocks, _surface.output_limit(request))

    def explain(
        self, model: str, path: str, request: dict[str, Any], affinity: str | None = None
    ) -> dict[str, Any]:
        """Which endpoint a request would go to now, and why (nothing is sent or recorded).

        For the control plane's `POST /api/v1/route` (`llmgw ctl route`); raises HttpError
        for an unknown model. A route without a prompt (embeddings, audio) is explained
        with no prompt: its choice is by load alone.
        """
        return self._explain(model, self._prompt(path, request), affinity)

    def _explain(
        self, name: str, prompt: _Prompt | None, affinity: str | None = None
    ) -> dict[str, Any]:
        model = self.models().get(name)
        if model is None:
            raise _unknown_model(name)
        now = trio.current_time()
        loads, _ = self._loads(list(model.endpoints), model, prompt, now)
        decision = explain(
            loads,
            model.estimate(prompt),
            now,
            random.Random(0),
            self._scoring,
            affinity,
            rotation=model.rotation,
        )
        return _decision_json(name, decision, prompt, self.config.prefix_block_bytes)

    async def _authenticate(self, scope: Scope) -> ApiKey:
        token = _surface.api_key(scope["headers"])
        if not token:
            raise HttpError(
                401,
                "an API key is needed: Authorization: Bearer <key> (or x-api-key: <key>)",
                type="authentication_error",
                code="missing_api_key",
            )
        try:
            key = await self.keys.lookup(token)
        except LlmgwError as exc:
            log.warning("cannot check an API key: %s", exc)
            raise HttpError(
                503,
                f"the API key cannot be checked now (the key store is unreachable: {exc})",
                type="server_error",
                code="key_store_unavailable",
                headers=((b"retry-after", b"5"),),
            ) from None
        if key is None:
            raise HttpError(
                401,
                "the API key is not valid (unknown or revoked)",
                type="authentication_error",
                code="invalid_api_key",
            )
        return key

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    raise _too_large(limit)
                break
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _parse(self, body: bytes, required: str | None) -> tuple[dict[str, Any], str]:
        limit = self.config.max_json_depth
        if _nests_deeper(body, limit):
            raise HttpError(
                400,
                f"the request body nests arrays and objects more than {limit} levels deep "
                "(the router's max_json_depth)",
                type="invalid_request_error",
                code="invalid_json",
            )
        try:
            request = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise HttpError(
                400,
                f"the request body is not JSON: {exc}",
                type="invalid_request_error",
                code="invalid_json",
            ) from None
        if not isinstance(request, dict):
            raise HttpError(
                400,
                "the request body must be a JSON object",
                type="invalid_request_error",
                code="invalid_json",
            )
        model = request.get("model")
        if not isinstance(model, str) or not model:
            raise HttpError(
                400,
                "model: required, a string naming a served model (see GET /v1/models)",
                type="invalid_request_error",
                code="missing_field",
            )
        if required is not None and required not in request:
            raise HttpError(
                400,
                f"{required}: required",
                type="invalid_request_error",
                code="missing_field",
            )
        return request, model

    def _band(self, scope: Scope, key: ApiKey) -> Band:
        asked: str | None = None
        for name, value in scope["headers"]:
            if name == PRIORITY_HEADER:
                asked = value.decode("latin-1").strip()
                break
        name = asked or key.default_band
        band = self._bands.get(name)
        if band is None:
            known = ", ".join(self._bands)
            if asked:
                raise HttpError(
                    400,
                    f"X-LLMGW-Priority: no band {asked!r}; the bands are {known}",
                    type="invalid_request_error",
                    code="unknown_band",
                )
            raise HttpError(
                403,
                f"API key {key.key_id}: its default band {name!r} is not configured "
                f"(the bands are {known})",
                type="permission_error",
                code="unknown_band",
            )
        cap = self._bands.get(key.max_band)
        if cap is not None and band.rank < cap.rank:
            band = cap
        return band

    async def _inference(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: Route,
        ex: _Exchange,
    ) -> None:
        explaining = _header(scope, EXPLAIN_HEADER) not in (None, b"", b"0")
        if explaining:
            self._need_admin(scope)
        else:
            key = await self._authenticate(scope)
        body = await self._read_body(scope, receive)
        if route.body == "form":
            content_type = _header(scope, b"content-type")
            name, stream = _surface.form_model(body, content_type)
            # With its boundary: the body goes on unchanged (form_model refuses no content type).
            ex.content_type = content_type or ex.content_type
        else:
            request, name = self._parse(body, route.required)
            stream = request.get("stream") is True
            ex.prompt = self._prompt(scope["path"], request)
            if stream and not explaining:
                asked = _surface.ask_usage(scope["path"], request)
                if asked is not None:
                    body, ex.strip_usage = asked, True
        affinity = None
        if self._affinity is not None:
            for hname, value in scope["headers"]:
                if hname == self._affinity:
                    affinity = value.decode("latin-1")
                    break
        if explaining:
            ex.model = name if name in self.models() else ""
            ex.status = 200
            await _json(send, 200, self._explain(name, ex.prompt, affinity))
            return
        model = self.models().get(name)
        if model is None:
            raise _unknown_model(name)
        ex.model = name
        if not key.may_use(name):
            raise HttpError(
                403,
                f"API key {key.key_id} may not use the model {name!r}",
                type="permission_error",
                code="model_not_allowed",
            )
        band = self._band(scope, key)
        ex.band = band.name
        self._tenant_admit(key, band)
        ex.tenant, ex.key_id = key.tenant, key.key_id
        if not model.endpoints:
            raise _no_replica(name)

        args = (model, key.tenant, band, scope["path"], body, stream, affinity, send, ex)
        if _server.EXTENSION in scope.get("extensions", ()):
            # The server cancels this task when the client leaves: no watcher needed.
            try:
                await self._admitted(*args)
            except trio.Cancelled:
                ex.client_gone = not ex.complete
                raise
            return
        failed: HttpError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, ex)
            try:
                await self._admitted(*args)
            except HttpError as exc:  # raised out of the nursery, it would come in a group
                failed = exc
            finally:
                nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def _admitted(
        self,
        model: _Model,
        tenant: str,
        band: Band,
        path: str,
        body: bytes,
        stream: bool,
        affinity: str | None,
        send: Send,
        ex: _Exchange,
    ) -> None:
        adm = model.admission
        req_id = str(next(self._ids))
        now = trio.current_time()
        decision = adm.request(req_id, tenant, band.name, now)
        if type(decision) is Reject:
            self.metrics.refused(model.name, band.name, "queue_full")
            raise _over_capacity(decision.reason, decision.retry_after_s)
        try:
            if type(decision) is Queued:
                await self._queue(model, req_id, band, decision, now)
            self.metrics.queue_wait(model.name, band.name, trio.current_time() - now)
            await self._proxy(model, path, body, stream, affinity, send, ex)
        finally:
            self._wake(adm.withdraw(req_id, trio.current_time()))

    async def _queue(
        self, model: _Model, req_id: str, band: Band, queued: Queued, now: float
    ) -> None:
        waiter = self._waiters[req_id] = _Waiter()
        try:
            with trio.move_on_at(queued.deadline):
                await waiter.event.wait()
            if not waiter.admitted and waiter.retry_after_s is None:
                for rid, retry_after in model.admission.expire(trio.current_time()):
                    other = self._waiters.pop(rid, None)
                    if other is not None:
                        other.retry_after_s = retry_after
                        other.event.set()
                if waiter.retry_after_s is None and not waiter.admitted:
                    # Not expired by the admission's clock (rounding): the timeout is ours.
                    waiter.retry_after_s = model.admission.retry_after(band.name)
        finally:
            self._waiters.pop(req_id, None)
        if not waiter.admitted:
            self.metrics.refused(model.name, band.name, "queue_timeout")
            self.metrics.queue_wait(model.name, band.name, trio.current_time() - now)
            raise _over_capacity(
                f"waited {band.queue_timeout_s:g} s (the {band.name} band's queue timeout) "
                f"for capacity on {model.name}",
                waiter.retry_after_s or 1.0,
            )

    def _wake(self, admitted: tuple[str, ...]) -> None:
        for rid in admitted:
            waiter = self._waiters.pop(rid, None)
            if waiter is not None:
                waiter.admitted = True
                waiter.event.set()

    def _loads(
        self,
        candidates: list[EndpointState],
        model: _Model,
        prompt: _Prompt | None,
        now: float,
    ) -> tuple[list[EndpointLoad], list[Match]]:
        blocks = prompt.blocks if prompt is not None else ()
        per_block = self.config.prefix_block_bytes / (model.bytes_per_token or 4.0)
        matches = [s.index.match(blocks, now) if blocks else NO_MATCH for s in candidates]
        loads = [
            EndpointLoad(
                endpoint_id=s.endpoint.endpoint_id,
                healthy=s.healthy,
                allowed=s.breaker.would_allow(now),
                in_flight=s.in_flight,
                waiting=s.waiting,
                running=s.running,
                kv_usage=s.kv_usage,
                scraped_at=s.scraped_at,
                own_at_scrape=s.own_at_scrape,
                pending_prefill=s.pending_prefill,
                pending_decode=s.pending_decode,
                cached_tokens=m.credit * per_block,
            )
            for s, m in zip(candidates, matches, strict=True)
        ]
        return loads, matches

    def _choose(
        self,
        model: _Model,
        now: float,
        affinity: str | None,
        tried: set[str],
        prompt: _Prompt | None = None,
        estimate: RequestEstimate | None = None,
    ) -> tuple[EndpointState, Match, bool] | None:
        """The endpoint, its index's match, and whether the bound spilled it there."""
        candidates = [s for s in model.endpoints if s.endpoint.endpoint_id not in tried]
        if not candidates:
            return None
        if len(candidates) == 1:
            only = candidates[0]
            if not (only.healthy and only.breaker.would_allow(now)):
                return None
            blocks = prompt.blocks if prompt is not None else ()
            return only, (only.index.match(blocks, now) if blocks else NO_MATCH), False
        loads, matches = self._loads(candidates, model, prompt, now)
        chosen, spilled = decide(
            loads,
            estimate or model.estimate(prompt),
            now,
            self._rng,
            self._scoring,
            affinity,
            rotation=model.rotation,
        )
        if chosen is None:
            return None
        model.rotation += 1
        for state, match in zip(candidates, matches, strict=True):
            if state.endpoint.endpoint_id == chosen:
                return state, match, spilled
        return None

    async def _proxy(
        self,
        model: _Model,
        path: str,
        body: bytes,
        stream: bool,
        affinity: str | None,
        send: Send,
        ex: _Exchange,
    ) -> None:
        tried: set[str] = set()
        last: HttpError | None = None
        start = trio.current_time()
        prompt = ex.prompt
        for attempt in range(self.config.retries + 1):
            now = trio.current_time()
            estimate = model.estimate(prompt)
            picked = self._choose(model, now, affinity, tried, prompt, estimate)
            if picked is None:
                break
            state, match, spilled = picked
            if attempt:
                self.metrics.retried(model.name)
            eid = state.endpoint.endpoint_id
            tried.add(eid)
            breaker = state.breaker
            if not breaker.allow(now):
                continue  # lost the half-open probe to another request since choosing
            final = attempt == self.config.retries
            per_block = self.config.prefix_block_bytes / (model.bytes_per_token or 4.0)
            cached = min(estimate.prompt_tokens, match.credit * per_block)
            sent = _Sent(
                state,
                estimate.prompt_tokens - cached,
                estimate.output_tokens,
                match,
                match.blocks * per_block,
                # A spill is not the prompt's new home: recorded there, one overflow
                # would move it (and every engine would end up holding every prompt).
                prompt.blocks if prompt is not None and not spilled else (),
                now,
            )
            verdict = False
            ex.report = None
            try:
                try:
                    resp = await state.pool.request(
                        b"POST",
                        path.encode(),
                        body,
                        headers=((b"content-type", ex.content_type),),
                        timeouts=self._timeouts,
                    )
                except UpstreamError as exc:
                    breaker.failure(trio.current_time())
                    verdict = True
                    # Nothing has reached the client, whatever reached us (a reply that
                    # is not HTTP, a head cut short): another endpoint may answer.
                    last = self._failed(model.name, eid, exc)
                    continue
                try:
                    # 501: the engine does not serve this route (llama.cpp's rerank without
                    # --reranking): its own answer, like a 404, not a failure of the engine.
                    if resp.status >= 500 and resp.status != 501:
                        breaker.failure(trio.current_time())
                        verdict = True
                        self.metrics.upstream_failure(model.name, eid, "status")
                        again = self._choose(model, trio.current_time(), affinity, tried, prompt)
                        if not final and again is not None:
                            log.info("%s answered %d; trying another endpoint", eid, resp.status)
                            resp.close()
                            continue
                    else:
                        breaker.success(trio.current_time())
                        verdict = True
                    failed = await self._relay(resp, stream, send, ex, start, sent)
                finally:
                    resp.close()
                if failed is None:
                    if ex.report is not None:
                        self._learned(model, prompt, sent, ex.report)
                    return
                last = failed  # a whole answer broke before any of it was sent: try another
            finally:
                sent.done()
                if not verdict:
                    breaker.cancel(trio.current_time())
        if last is not None:
            raise last
        raise _no_replica(model.name, reachable=bool(model.endpoints))

    def _learned(
        self, model: _Model, prompt: _Prompt | None, sent: _Sent, report: _surface.CacheReport
    ) -> None:
        """The engine's word on the answer: it corrects the index and the estimates."""
        if report.cached_tokens is not None:
            index = sent.state.index
            outcome = index.observe(sent.match, sent.guessed_tokens, report.cached_tokens)
            self.metrics.prompt_cache(
                model.name, sent.state.endpoint.endpoint_id, report.cached_tokens, outcome
            )
        model.learn(prompt, report)

    def _failed(self, model: str, eid: str, exc: UpstreamError) -> HttpError:
        self.metrics.upstream_failure(model, eid, exc.phase)
        log.info("request to %s failed (%s): %s", eid, exc.phase, exc)
        return _upstream_error(model, exc)

    async def _relay(
        self,
        resp: Response,
        stream: bool,
        send: Send,
        ex: _Exchange,
        start: float,
        sent: _Sent,
    ) -> HttpError | None:
        """Pass the answer on; the error to retry with when it broke before any byte was sent.

        How the body went is the breaker's too (`broken` or `complete`), counted
        apart from the head's verdict: an engine that answers and then hangs.
        """
        state = sent.state
        headers = [(k, v) for k, v in resp.headers if k not in _HOP_HEADERS]
        ex.status = resp.status
        if not stream or resp.header(b"content-length") is not None:
            # A whole answer (the engine has finished before sending its head): one write.
            try:
                data = await resp.read()
            except UpstreamError as exc:
                state.breaker.broken(trio.current_time())
                return self._failed(ex.model, state.endpoint.endpoint_id, exc)
            state.breaker.complete(trio.current_time())
            sent.answering()
            if resp.status == 200:
                ex.report = report = _surface.cache_report(data)
                if report is not None:
                    self.metrics.tokens(ex.model, report.prompt_tokens, report.completion_tokens)
                    ex.prompt_tokens = report.prompt_tokens
                    ex.completion_tokens = report.completion_tokens
            ex.responded = True
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            ex.complete = True
            await send({"type": "http.response.body", "body": data})
            return None
        ex.responded = True
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        first = True
        tally = _surface.StreamUsage()
        strip = _surface.UsageStrip() if ex.strip_usage else None
        while True:
            try:
                chunk = await resp.next_chunk()
            except UpstreamError as exc:
                # Too late to retry or to change the status: tell an SSE client in its
                # own terms, then cut the connection so no client takes it for complete.
                ex.status = 502 if not isinstance(exc, UpstreamTimeout) else 504
                state.breaker.broken(trio.current_time())
                self.metrics.upstream_failure(ex.model, state.endpoint.endpoint_id, exc.phase)
                log.warning("%s: stream broken mid-response: %s", ex.model, exc)
                event = _surface.stream_error(
                    ex.errors,
                    f"the model's replica failed mid-response: {exc}",
                    status=ex.status,
                    code=exc.phase,
                )
                await send({"type": "http.response.body", "body": event, "more_body": True})
                return None  # returning mid-body makes hypercorn close the connection
            if chunk is None:
                break
            if first:
                first = False
                ex.ttft = trio.current_time() - start
                sent.answering()
            seen = chunk
            if strip is not None:  # whole events only; the usage-only one taken out
                chunk, removed = strip.feed(chunk)
                seen = chunk + removed if removed else chunk
            if b'"usage"' in seen:
                prompt, completion = tally.add(seen)
                self.metrics.tokens(ex.model, prompt, completion)
                ex.prompt_tokens = tally.prompt
                ex.completion_tokens = tally.completion
                ex.report = _surface.cache_report(seen) or ex.report
            elif b'"timings"' in seen:
                ex.report = _surface.cache_report(seen) or ex.report
            if resp.done:
                state.breaker.complete(trio.current_time())
                ex.complete = True
                if strip is not None:
                    chunk += strip.end()
                await send({"type": "http.response.body", "body": chunk})
                return None
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        state.breaker.complete(trio.current_time())
        ex.complete = True
        rest = strip.end() if strip is not None else b""
        await send({"type": "http.response.body", "body": rest})
        return None


def _nests_deeper(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays and objects more than `limit` deep.

    Cheap for the usual body: fewer opening brackets than the limit cannot nest
    deeper. Otherwise the strings are taken out and the brackets summed as +1/-1
    in C (translate, array, accumulate): no Python loop over the bytes.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    structure = _JSON_STRING.sub(b"", body).translate(_NESTING, _NOT_BRACKETS)
    return max(itertools.accumulate(array("b", structure)), default=0) > limit


def _in_trio() -> bool:
    try:
        trio.current_time()
    except RuntimeError:
        return False
    return True


def _moved(old: Endpoint, new: Endpoint) -> bool:
    return (old.host, old.port, old.engine) != (new.host, new.port, new.engine)


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, ex: _Exchange) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ex.complete:
                ex.client_gone = True
                scope.cancel()
            return


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _json(
    send: Send, status: int, body: Any, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(data)),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _error(send: Send, exc: HttpError, shape: _surface.ErrorShape = "openai") -> None:
    await _json(send, exc.status, _surface.error_body(shape, exc), exc.headers)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _too_large(limit: int) -> HttpError:
    return HttpError(
        413,
        f"the request body is over the limit of {limit} bytes",
        type="invalid_request_error",
        code="request_too_large",
    )


def _unknown_model(name: str) -> HttpError:
    return HttpError(
        404,
        f"the model {name!r} does not exist (see GET /v1/models)",
        type="invalid_request_error",
        code="model_not_found",
    )


def _no_replica(model: str, *, reachable: bool = False) -> HttpError:
    detail = (
        "no replica of it is ready"
        if not reachable
        else "none of its replicas can take a request now (unhealthy or circuit open)"
    )
    return HttpError(
        503,
        f"the model {model!r} is not available: {detail}",
        type="service_unavailable",
        code="no_ready_replica",
        headers=((b"retry-after", b"5"),),
    )


def _over_capacity(reason: str, retry_after_s: float) -> HttpError:
    seconds = max(1, math.ceil(retry_after_s))
    return HttpError(
        429,
        f"over capacity: {reason}; retry after {seconds} s",
        type="rate_limit_error",
        code="over_capacity",
        headers=((b"retry-after", b"%d" % seconds),),
    )


def _upstream_error(model: str, exc: UpstreamError) -> HttpError:
    if isinstance(exc, ConnectFailed):
        return HttpError(
            503,
            f"the model {model!r} is not available: no replica could be reached ({exc})",
            type="service_unavailable",
            code="no_ready_replica",
            headers=((b"retry-after", b"5"),),
        )
    if isinstance(exc, UpstreamTimeout):
        return HttpError(
            504,
            f"the model {model!r}'s replica did not answer in time: {exc}",
            type="upstream_error",
            code="upstream_timeout",
        )
    return HttpError(
        502,
        f"the model {model!r}'s replica failed: {exc}",
        type="upstream_error",
        code="upstream_failed",
    )


def _decision_json(
    model: str, decision: Decision, prompt: _Prompt | None, block_bytes: int
) -> dict[str, Any]:
    """An explanation as JSON: every figure named, unknown ones null."""
    per_token = decision.request
    return {
        "object": "llmgw.route_explanation",
        "model": model,
        "policy": decision.policy,
        "chosen": decision.chosen,
        "reason": decision.reason,
        "bound": {
            "epsilon": decision.epsilon,
            "max_requests_per_endpoint": decision.capacity,
            "average_load": decision.average_load,
        },
        "request": {
            "prompt_bytes": None if prompt is None else len(prompt.text),
            "prompt_blocks": None if prompt is None else len(prompt.blocks),
            "block_bytes": block_bytes,
            "estimated_prompt_tokens": per_token.prompt_tokens,
            "expected_output_tokens": per_token.output_tokens,
            "decode_cost": per_token.decode_cost,
        },
        "candidates": [
            {
                "endpoint": c.endpoint_id,
                "healthy": c.healthy,
                "breaker_allows": c.allowed,
                "within_bound": c.within_bound,
                "load": c.load,
                "in_flight": c.in_flight,
                "cached_tokens": c.cached_tokens,
                "uncached_tokens": c.uncached_tokens,
                "pending_prefill_tokens": c.pending_prefill,
                "pending_decode_tokens": c.pending_decode,
                "external_requests": c.external,
                "scraped": {
                    "running": c.running,
                    "waiting": c.waiting,
                    "kv_usage": c.kv_usage,
                    "age_s": c.scrape_age_s,
                },
                "cost": c.cost,
            }
            for c in decision.candidates
        ],
    }
