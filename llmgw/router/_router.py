"""The router: one OpenAI-compatible endpoint in front of many replicas.

Per request, in this module: parse the route and the body (llmgw/router/_surface.py)
-> authenticate (the key cache, no store round trip) -> a traffic split's name to
one version (llmgw/router/_traffic.py, llmgw/core/_traffic.py) -> model known (404) and
allowed for the key (403) -> priority band (header `X-LLMGW-Priority`, else the
key's default, capped at the key's highest band) and the tenant's limits -> a model
with no replica: held while its first starts when its source holds it
(llmgw/router/_holds.py), else 503 -> admission (concurrency limit and queue per
model, llmgw/core/_admission.py) ->
the attempt loop (llmgw/router/_attempt.py: choose an endpoint from the fleet
view, proxy, retry on another endpoint only while nothing has reached the
client, pass status, headers and body chunks through as they arrive) ->
release everything, and count what the request's record says. The load signals the
autoscaler reads (`loads()`) are counted on the way (llmgw/router/_load.py).

Around it: the configuration (_config.py), one request's record (_record.py),
the fleet view (_fleet.py: models, endpoints, queues, its frozen snapshot),
explain (_explain.py) and the metrics (_metrics.py, which read the snapshot).

A client that goes away cancels the whole request: the admission slot or
queue place is given back, and the upstream connection is closed so the
engine cancels its generation.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import time
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from llmgw.core import (
    Band,
    Queued,
    Reject,
    ResumePlan,
    RouterLoad,
    ScoringConfig,
    chain,
    resume_plan,
)
from llmgw.errors import LlmgwError
from llmgw.keys import ApiKey
from llmgw.router import _listing, _request_id, _server, _surface
from llmgw.router._attempt import Attempts
from llmgw.router._bands import PRIORITY_HEADER, Bands
from llmgw.router._config import DEFAULT_BANDS as DEFAULT_BANDS
from llmgw.router._config import MAX_JSON_DEPTH as MAX_JSON_DEPTH
from llmgw.router._config import MAX_WORKERS as MAX_WORKERS
from llmgw.router._config import RouterConfig
from llmgw.router._explain import EXPLAIN_HEADER, AdminKey, explanation
from llmgw.router._fleet import Fleet, Model
from llmgw.router._holds import Holds
from llmgw.router._keys import CachedKeys, KeyStore
from llmgw.router._leases import BudgetSource, TenantAdmission
from llmgw.router._load import LoadCounters
from llmgw.router._metering import ask_usage
from llmgw.router._metrics import RouterMetrics
from llmgw.router._record import Ask, Prompt, Record
from llmgw.router._scraper import EndpointState, Scraper
from llmgw.router._surface import HttpError, Route
from llmgw.router._tenants import share as share
from llmgw.router._traffic import Versions, renamed, with_version
from llmgw.router._types import EndpointSource
from llmgw.router._upstream import Timeouts
from llmgw.router._usage import UsageMeter, UsageSink
from llmgw.router._wedge import watch_fleet
from llmgw.web.asgi import Receive, Scope, Send, lifespan, send_json

__all__ = [
    "DEFAULT_BANDS",
    "EXPLAIN_HEADER",
    "MAX_JSON_DEPTH",
    "MAX_WORKERS",
    "PRIORITY_HEADER",
    "Router",
    "RouterConfig",
    "share",
]

log = logging.getLogger("llmgw.router")


_MODEL_PREFIX = "/v1/models/"


class _ClientGone(Exception):
    """The client closed its connection before its request was read."""


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
        budget: BudgetSource | None = None,
    ) -> None:
        """`worker`: this process's index among `config.workers` (its share of the limits;
        tenants' too without a `budget`: llmgw/router/_leases.py TenantAdmission).
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
        self.keys = (
            keys if isinstance(keys, CachedKeys) else CachedKeys(keys, config.key_cache_ttl_s)
        )
        self._admin = AdminKey(admin_key)
        self._affinity = config.affinity_header.lower().encode() if config.affinity_header else None
        self.tenants = TenantAdmission(worker, config.workers, budget)
        self.meter = UsageMeter()
        self._usage_sink = usage
        self._ids = itertools.count(1)
        self.fleet = Fleet(config, endpoints, worker=worker, rng=rng)
        self.metrics_registry = registry if registry is not None else CollectorRegistry()
        self.load = LoadCounters()  # the autoscaler's signals (`loads()`)
        self.holds = Holds(
            self.fleet,
            self.load,
            lambda model, reason: self.metrics.hold_refused(model, reason),
            worker=worker,
            workers=config.workers,
        )
        self.metrics = RouterMetrics(
            self.metrics_registry, self.fleet, self.tenants, held=self.holds.statistics
        )
        self._versions = Versions(self.fleet, self.metrics)
        self._bands = Bands(config.bands, self.tenants.admit, self.metrics.tenant_refused)
        self._attempts = Attempts(
            self.fleet,
            self.metrics,
            retries=config.retries,
            timeouts=Timeouts(
                connect_s=config.connect_timeout_s,
                first_byte_s=config.first_byte_timeout_s,
                idle_s=config.idle_timeout_s,
            ),
            load=self.load,
        )
        states = self.fleet.endpoint_states
        self.scraper = Scraper(
            lambda: list(states().values()),
            interval_s=config.scrape_interval_s,
            unhealthy_after=config.unhealthy_after_misses,
            on_slots=self.fleet.slots_changed,
        )
        self.wedges = watch_fleet(self.fleet, self.metrics.quarantined)  # fleet.quarantined()

    def __repr__(self) -> str:
        return f"<Router worker {self.worker} {self.fleet!r}>"

    # --- views (the fleet's, and the router's own counts) ---------------------------------

    def statistics(self) -> dict[str, Any]:
        """The fleet's snapshot and the router's own counts, as JSON."""
        return {
            **self.fleet.statistics().as_json(),
            "keys": self.keys.statistics(),
            "tenants": self.tenants.statistics(),
            "usage": self.meter.statistics(),
        }

    def models(self) -> dict[str, Model]:
        return self.fleet.models()

    def loads(self) -> dict[str, RouterLoad]:
        """This router's load per served model the view lists (zeros included), for the
        autoscaler (llmgw/router/_load.py); reads only, cheap enough for every 200 ms."""
        return self.load.loads(self.fleet.listed(), self.holds.held())

    def endpoint_states(self) -> dict[str, EndpointState]:
        return self.fleet.endpoint_states()

    def score_config(self) -> ScoringConfig:
        return self.fleet.scoring

    def in_flight(self, endpoint_id: str) -> int:
        """Requests being proxied to this endpoint now, whether or not it is still listed
        (`Fleet.in_flight`: the source is read first)."""
        return self.fleet.in_flight(endpoint_id)

    def refresh(self) -> None:
        """Re-read the endpoint source: new endpoints, gone ones, concurrency limits."""
        self.fleet.refresh()

    def explain(
        self, model: str, path: str, request: dict[str, Any], affinity: str | None = None
    ) -> dict[str, Any]:
        """Which endpoint a request would go to now, and why (nothing is sent or recorded).

        For the control plane's `POST /api/v1/route` (`llmgw ctl route`); raises HttpError
        for an unknown model. A route without a prompt (embeddings, audio) is explained
        with no prompt: its choice is by load alone.
        """
        return explanation(self.fleet, model, _prompt(self.fleet, path, request, model), affinity)

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
            self.fleet.refresh()
            await nursery.start(self.keys.run)  # key lookups refresh behind requests
            await nursery.start(self.scraper.run)
            nursery.start_soon(self._watch_source)
            nursery.start_soon(self.wedges.run)
            if self._usage_sink is not None:
                nursery.start_soon(self._flush_usage, self._usage_sink)
            nursery.start_soon(self.tenants.run)  # the fleet's budgets leased from the store
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
            (log.warning if self.meter.worth_saying() else log.debug)(
                "usage: could not write %d rows to the store (kept for the next flush "
                "in %g s; %d requests dropped so far, over %d rows pending): %s",
                stats["pending"],
                self.config.usage_flush_s,
                stats["dropped"],
                self.meter.max_rows,
                exc or type(exc).__name__,
            )

    async def _watch_source(self) -> None:
        # Requests re-read the source too; this catches changes while no request comes,
        # and, every 50 ms while requests are held at zero replicas, the first replica.
        while True:
            every = 0.05 if self.holds.held() else min(1.0, self.config.scrape_interval_s)
            await trio.sleep(every)
            self.fleet.maybe_refresh()

    def close(self) -> None:
        self.fleet.close()

    # --- ASGI ------------------------------------------------------------------------------

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        method = scope["method"]
        if method == "HEAD":  # answered as GET; the server sends the head only
            method = "GET"
        rid = _request_id.new()
        send = _request_id.tagged(send, rid, self._worker_headers)
        rid_token = _request_id.CURRENT.set(rid)
        route = _surface.ROUTES.get(path)
        record = Record(arrived=trio.current_time())
        if route is not None:
            record.errors = route.errors
        start = time.perf_counter()
        try:
            if route is not None and method == "POST":
                await self._inference(scope, receive, send, route, record)
            elif path == "/v1/models" and method == "GET":
                await self._list_models(scope, send, record)
            elif path.startswith(_MODEL_PREFIX) and method == "GET":
                await self._get_model(scope, send, record, path[len(_MODEL_PREFIX) :])
            elif path in ("/health", "/healthz") and method == "GET":
                record.status = 200
                await send_json(send, 200, {"status": "ok"})
            elif route is not None or path == "/v1/models" or path.startswith(_MODEL_PREFIX):
                allow = b"POST" if route is not None else b"GET, HEAD"
                raise _surface.method_not_allowed(scope["method"], path, allow)
            else:
                raise _surface.unknown_route(method, path)
        except HttpError as exc:
            record.status = exc.status
            if not record.responded:
                await _error(send, exc, record.errors)
        except _ClientGone:
            record.status = 499
        finally:
            if record.client_gone:
                record.status = 499  # nginx's "client closed request": the client left first
            if route is not None or record.status:
                self.metrics.finished(record, time.perf_counter() - start)
            if record.tenant is not None:
                self._metered(record)
            _request_id.CURRENT.reset(rid_token)

    def _metered(self, record: Record) -> None:
        """A request its tenant's limits let through has finished, however it ended: its
        tokens (those its answer reported; unknown adds 0) go to the meter, the tenant's
        tokens limit (settling what it reserved) and the tenant's metrics."""
        tenant = record.tenant
        assert tenant is not None
        prompt, completion = record.prompt_tokens, record.completion_tokens
        self.meter.add(time.time(), tenant, record.key_id, record.model, prompt, completion)
        self.metrics.tenant_finished(tenant, prompt, completion)
        self.tenants.charge(tenant, (prompt or 0) + (completion or 0))

    async def _list_models(self, scope: Scope, send: Send, record: Record) -> None:
        key = await self._authenticate(scope)
        record.status = 200
        await send_json(send, 200, {"object": "list", "data": _listing.listed(self.fleet, key)})

    async def _get_model(self, scope: Scope, send: Send, record: Record, name: str) -> None:
        """OpenAI's `GET /v1/models/{model}`: a model GET /v1/models lists, else 404.

        A served name may hold slashes (`org/model`): the rest of the path is the name.
        """
        key = await self._authenticate(scope)
        if not _listing.is_listed(self.fleet, key, name):
            raise _surface.model_not_listed(name)
        record.status = 200
        await send_json(send, 200, _listing.model_entry(name, _listing.parent(self.fleet, name)))

    # --- the request path: parse -> authenticate -> admit -> attempt ----------------------

    async def _authenticate(self, scope: Scope) -> ApiKey:
        token = _surface.api_key(scope["headers"])
        if not token:
            raise _surface.missing_key()
        try:
            key = await self.keys.lookup(token)
        except LlmgwError as exc:
            log.warning("cannot check an API key: %s", exc)
            raise _surface.key_store_unavailable(exc) from None
        if key is None:
            raise _surface.invalid_key()
        return key

    async def _inference(
        self, scope: Scope, receive: Receive, send: Send, route: Route, record: Record
    ) -> None:
        explaining = _header(scope, EXPLAIN_HEADER) not in (None, b"", b"0")
        if explaining:
            self._admin.check(scope["headers"])
        else:
            key = await self._authenticate(scope)
        body = await _read_body(scope, receive, self.config.max_body_bytes)
        path = scope["path"]
        content_type = _surface.JSON_CONTENT_TYPE
        prompt: Prompt | None = None
        usage_body: bytes | None = None
        resume: ResumePlan | None = None
        if route.body == "form":
            form_type = _header(scope, b"content-type")
            name, stream = _surface.form_model(body, form_type)
            # With its boundary: the body goes on unchanged (form_model refuses no content type).
            content_type = form_type or content_type
        else:
            request, name = _surface.parse_json(body, route.required, self.config.max_json_depth)
            stream = request.get("stream") is True
        wanted, split = name, self.fleet.traffic().get(name)
        if split is not None:  # a split's name: one version answers (llmgw/core/_traffic.py)
            asking = None if explaining else key
            version = self._versions.choose(split, scope["headers"], asking, route.body == "form")
            name, send = version.served, with_version(send, version)
        if route.body != "form":
            if split is not None:
                request = {**request, "model": name}
                body = renamed(request)
            prompt = _prompt(self.fleet, path, request, name)
            if stream and not explaining:
                usage_body = ask_usage(path, request)
                # What a continuation would extend: the request asking for the usage
                # event (a continued stream is rewritten anyway; its tokens are counted
                # from that event whichever engine continues it).
                resume = resume_plan(path, json.loads(usage_body) if usage_body else request)
        affinity = None
        if self._affinity is not None:
            for hname, value in scope["headers"]:
                if hname == self._affinity:
                    affinity = value.decode("latin-1")
                    break
        if explaining:
            record.model = name if name in self.fleet.models() else ""
            record.status = 200
            await send_json(send, 200, explanation(self.fleet, name, prompt, affinity))
            return
        model = self.fleet.models().get(name)
        if model is None:
            raise _surface.unknown_model(name)
        record.model = name
        if not key.may_use(wanted):
            raise _surface.model_not_allowed(key.key_id, wanted)
        if model.adapter is not None and not model.adapter.allows(key.tenant):
            raise _surface.adapter_not_allowed(key.tenant, name)
        band = self._bands.band(scope["headers"], key)
        record.band = band.name
        await self._bands.admit_tenant(key, band)
        record.tenant, record.key_id = key.tenant, key.key_id
        ask = Ask(path, body, content_type, stream, prompt, affinity, usage_body, resume)
        if _server.EXTENSION in scope.get("extensions", ()):
            # The server cancels this task when the client leaves: no watcher needed.
            try:
                await self._admitted(model, key.tenant, band, ask, send, record)
            except trio.Cancelled:
                record.client_gone = not record.complete
                raise
            return
        failed: HttpError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, record)
            try:
                await self._admitted(model, key.tenant, band, ask, send, record)
            except HttpError as exc:  # raised out of the nursery, it would come in a group
                failed = exc
            finally:
                nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def _admitted(
        self, model: Model, tenant: str, band: Band, ask: Ask, send: Send, record: Record
    ) -> None:
        """A model with no replica held (or 503), admission (429 on a full queue or a
        queue timeout), then the attempt loop."""
        if model.adapter is not None:  # found its adapter loaded, or waits for a load
            self.metrics.adapter_request(model.name, bool(model.endpoints))
        if not model.endpoints:
            model = await self.holds.ready(model)
        adm = model.admission
        req_id = str(next(self._ids))
        now = trio.current_time()
        decision = adm.request(req_id, tenant, band.name, now)
        if type(decision) is Reject:
            self.metrics.refused(model.name, band.name, "queue_full")
            self.load.rejected(model.name)
            raise _surface.over_capacity(decision.reason, decision.retry_after_s)
        try:
            if type(decision) is Queued:
                retry_after = await self.fleet.wait(model, req_id, band, decision)
                if retry_after is not None:
                    self.metrics.refused(model.name, band.name, "queue_timeout")
                    self.load.rejected(model.name)
                    self.metrics.queue_wait(model.name, band.name, trio.current_time() - now)
                    raise _surface.queue_timed_out(
                        band.name, band.queue_timeout_s, model.name, retry_after
                    )
            self.metrics.queue_wait(model.name, band.name, trio.current_time() - now)
            await self._attempts.run(model, ask, send, record)
        finally:
            self.fleet.wake(adm.withdraw(req_id, trio.current_time()))


def _prompt(fleet: Fleet, path: str, request: dict[str, Any], name: str) -> Prompt | None:
    """The request's prompt as the router weighs it (None: a route without one); under
    the prefix policy its blocks' chain, from a salt of the adapter's name for a LoRA
    adapter (its prompts are cached under it, of no use to the base)."""
    text = _surface.prompt_bytes(path, request)
    if text is None:
        return None
    config = fleet.config
    under = name if name in fleet.adapters() else ""
    blocks = (
        tuple(chain(text, config.prefix_block_bytes, under)) if config.policy == "prefix" else ()
    )
    return Prompt(text, blocks, _surface.output_limit(request))


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = 0
            if declared > limit:
                raise _surface.too_large(limit)
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
            raise _surface.too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, record: Record) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not record.complete:
                record.client_gone = True
                scope.cancel()
            return


async def _error(send: Send, exc: HttpError, shape: _surface.ErrorShape = "openai") -> None:
    await send_json(send, exc.status, _surface.error_body(shape, exc), exc.headers)
