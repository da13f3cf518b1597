"""The admin listener: JSON API for operators and `llmgw ctl`.

A plain ASGI app on hypercorn's trio worker. Every `/api/` route needs an admin
key as a Bearer token; `/healthz` does not.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw import config, engines, model
from llmgw.cp import _holdings, _node_logs
from llmgw.cp._catalog_file import CatalogFile
from llmgw.cp._events import Event, Failure
from llmgw.cp._reconciler import Reconciler, Unplaced
from llmgw.cp._registry import FetchProgress, NodeRecord, NodeRegistry
from llmgw.cp._shards import manual_shard, ports_taken
from llmgw.errors import (
    ConfigError,
    DeadlineExceeded,
    LlmgwError,
    NotFound,
    PeerError,
    UsageError,
)
from llmgw.router import HttpError as RouterHttpError
from llmgw.router._keys import ApiKey, KeyStore
from llmgw.rpc import AgentHandle

log = logging.getLogger("llmgw.cp.admin")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

ADMIN_KEY_FILE = "admin.key"
_NODES_PER_SLICE = 100  # ~15 ms of rendering between checkpoints


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def ensure_admin_key(state_dir: Path) -> tuple[Path, bool]:
    """Create the first admin key on first start: a 0600 file in the state directory.

    Returns the file and whether it was created now.
    """
    path = state_dir / ADMIN_KEY_FILE
    if path.exists():
        return path, False
    state_dir.mkdir(parents=True, exist_ok=True)
    key = "llmgw-admin-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path, True


def read_admin_key(path: Path) -> str:
    return path.read_text().strip()


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Handler = Callable[..., Awaitable[tuple[int, Any]]]


class Explainer(Protocol):
    """The router, as `POST /api/v1/route` needs it (llmgw/router `Router.explain`)."""

    def explain(self, model: str, path: str, request: dict[str, Any]) -> dict[str, Any]: ...


class AdminApp:
    def __init__(
        self,
        registry: NodeRegistry,
        admin_key: str,
        *,
        reconciler: Reconciler | None = None,
        catalog: CatalogFile | None = None,
        keys: KeyStore | None = None,
        metrics: CollectorRegistry | None = None,
        router: Explainer | None = None,
    ) -> None:
        self._registry = registry
        self._router = router
        self._keys = keys
        self._metrics = metrics
        self._reconciler = reconciler
        self._catalog = catalog
        self._digest = _digest(admin_key)
        # The admin pages (llmgw/cp/_pages) under /admin, set by the caller (llmgw/cp/_main.py).
        self.pages: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = [
            ("GET", re.compile(r"^/api/v1/nodes$"), self._nodes),
            ("POST", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/shards$"), self._shard_start),
            (
                "DELETE",
                re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/shards/(?P<shard>[^/]+)$"),
                self._shard_stop,
            ),
            (
                "GET",
                re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/shards/(?P<shard>[^/]+)/logs$"),
                self._shard_logs,
            ),
            ("GET", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/logs$"), self._node_logs),
            ("GET", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/log-sources$"), self._log_sources),
            ("POST", re.compile(r"^/api/v1/engine-check$"), self._engine_check),
            ("GET", re.compile(r"^/api/v1/models$"), self._models),
            ("GET", re.compile(r"^/api/v1/replicas$"), self._replicas),
            ("GET", re.compile(r"^/api/v1/status$"), self._status),
            ("GET", re.compile(r"^/api/v1/events$"), self._events),
            ("GET", re.compile(r"^/api/v1/weights$"), self._weights),
            ("POST", re.compile(r"^/api/v1/weights/collect$"), self._weights_collect),
            ("POST", re.compile(r"^/api/v1/place$"), self._place),
            ("POST", re.compile(r"^/api/v1/route$"), self._route),
            ("POST", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/cordon$"), self._cordon),
            ("DELETE", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/cordon$"), self._uncordon),
            ("POST", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/drain$"), self._drain),
            ("DELETE", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)$"), self._forget),
            ("GET", re.compile(r"^/api/v1/nodes/(?P<node>[^/]+)/history$"), self._history),
            ("GET", re.compile(r"^/api/v1/keys$"), self._keys_list),
            ("POST", re.compile(r"^/api/v1/keys$"), self._keys_create),
            ("DELETE", re.compile(r"^/api/v1/keys/(?P<key_id>[^/]+)$"), self._keys_revoke),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/healthz":
            await _json(send, 200, {"status": "ok"})
            return
        if path == "/metrics" and self._metrics is not None:
            # Unauthenticated, as Prometheus scrapes it: keep the admin listener private.
            page = generate_latest(self._metrics)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())],
                }
            )
            await send({"type": "http.response.body", "body": page})
            return
        if self.pages is not None and (path == "/admin" or path.startswith("/admin/")):
            await self.pages(scope, receive, send)  # its own login: a cookie, not a Bearer key
            return
        if not path.startswith("/api/"):
            await _error(send, 404, f"no such page: {path}")
            return
        if not self._authorised(scope):
            await _error(send, 401, "an admin key is needed: Authorization: Bearer <key>")
            return
        for route_method, pattern, handler in self._routes:
            match = pattern.match(path)
            if match and route_method == method:
                try:
                    body = await _read_json(receive) if method in ("POST", "PUT") else None
                    query = dict(parse_qsl(scope.get("query_string", b"").decode()))
                    status, result = await handler(body=body, query=query, **match.groupdict())
                except HttpError as exc:
                    await _error(send, exc.status, str(exc))
                    return
                except NotFound as exc:
                    await _error(send, 404, str(exc))
                    return
                except (UsageError, ConfigError) as exc:
                    await _error(send, 400, str(exc))
                    return
                except PeerError as exc:
                    await _error(send, 502, f"the agent answered: {exc}")
                    return
                if isinstance(result, _node_logs.Follow):  # a stream, after its first reply
                    await result.run(receive, send)
                    return
                await _json(send, status, result)
                return
        await _error(send, 404, f"no such API route: {method} {path}")

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(_digest(token.strip()), self._digest)
        return False

    # routes ----------------------------------------------------------------------------

    async def _nodes(self, **_: Any) -> tuple[int, Any]:
        views = self._registry.views()
        # Rendering costs ~0.15 ms a node (cattrs, then json): in one piece, at
        # 5,000 nodes it held the trio thread, and every heartbeat queued behind
        # it, for over a second (bench/fleet.py). A worker thread does not help:
        # json.dumps holds the GIL throughout. So render in slices, letting the
        # heartbeats in between; the bytes are what json.dumps would write.
        parts = []
        for start in range(0, len(views), _NODES_PER_SLICE):
            parts += [
                json.dumps(config.unstructure(v)) for v in views[start : start + _NODES_PER_SLICE]
            ]
            await trio.lowlevel.checkpoint()
        return 200, ('{"nodes": [' + ", ".join(parts) + "]}").encode()

    def _connected(self, node: str) -> tuple[NodeRecord, AgentHandle]:
        rec = self._registry.record(node)
        if rec is None:
            raise HttpError(404, f"no node {node!r} has registered")
        if rec.agent is None:
            raise HttpError(409, f"node {node} is {rec.liveness.state.value}: not connected")
        return rec, rec.agent

    async def _shard_start(self, node: str, body: Any, **_: Any) -> tuple[int, Any]:
        rec, agent = self._connected(node)
        request = _expect(
            body,
            {"engine": str, "model": str},
            {"port": int, "args": list, "gpus": int, "served_name": str},
        )
        spec = manual_shard(
            rec,
            ports_taken(self._registry.records()).get(rec.host, set()),
            engine=request["engine"],
            model_ref=request["model"],
            port=request.get("port"),
            args=[str(a) for a in request.get("args", [])],
            gpus=request.get("gpus"),
            served_name=request.get("served_name"),
        )
        report = await agent.start_shard(self._registry.epoch, spec)
        self._registry.note_shard(node, report)
        log.info("shard %s started on %s by an operator: %s", spec.shard_id, node, spec.model)
        return 201, {"shard": config.unstructure(report), "spec": config.unstructure(spec)}

    async def _shard_stop(
        self, node: str, shard: str, query: dict[str, str], **_: Any
    ) -> tuple[int, Any]:
        _rec, agent = self._connected(node)
        try:
            grace = float(query.get("grace", "0"))
        except ValueError:
            raise HttpError(400, f"grace: not a number of seconds: {query['grace']!r}") from None
        await agent.stop_shard(self._registry.epoch, shard, grace)
        self._registry.forget_shard(node, shard)
        log.info("shard %s on %s stopped by an operator", shard, node)
        return 200, {"stopped": shard}

    async def _shard_logs(
        self, node: str, shard: str, query: dict[str, str], **_: Any
    ) -> tuple[int, Any]:
        _rec, agent = self._connected(node)
        lines = int(query.get("lines", "40")) if query.get("lines", "40").isdigit() else 40
        try:
            tail = await agent.logs(shard, lines)
        except NotFound:
            raise HttpError(404, self._gone(node, shard)) from None
        except DeadlineExceeded:
            raise HttpError(504, _node_logs.silent(node, agent.deadline_of("logs"))) from None
        return 200, {"lines": [config.unstructure(line) for line in tail]}

    async def _node_logs(self, node: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        """The tail of a log source on the node (default: the agent's own); `follow=1`
        streams what comes after it (llmgw/cp/_node_logs.py)."""
        _rec, agent = self._connected(node)
        source, lines = query.get("source") or "agent", _node_logs.lines_of(query)
        try:
            if query.get("follow") in ("1", "true"):
                return 200, await _node_logs.Follow.open(node, agent, source, lines)
            tail = await agent.logs(source, lines)
        except DeadlineExceeded:
            raise HttpError(504, _node_logs.silent(node, agent.deadline_of("logs"))) from None
        return 200, {"source": source, "lines": [config.unstructure(line) for line in tail]}

    async def _log_sources(self, node: str, **_: Any) -> tuple[int, Any]:
        _rec, agent = self._connected(node)
        try:
            return 200, {"sources": await agent.log_sources()}
        except DeadlineExceeded:
            raise HttpError(504, _node_logs.silent(node, agent.deadline_of("logSources"))) from None

    def _gone(self, node: str, shard: str) -> str:
        """One line: the shard is not there, and what became of it if that is known."""
        seen = [e for e in self._registry.events.events(node_id=node, limit=EVENTS_LIMIT)
                if e.shard_id == shard]  # fmt: skip
        if not seen:
            return (f"node {node} has no shard {shard!r} (it never ran there, or it is gone "
                    "and its logs with it); `llmgw ctl nodes --json` lists its shards")  # fmt: skip
        last = seen[-1]
        ago = max(0.0, time.time() - last.at)
        return (f"shard {shard} is gone from node {node}; {ago:.0f} s ago: {last.message} "
                f"(`llmgw ctl events --node {node}` has more)")  # fmt: skip

    async def _engine_check(self, body: Any, **_: Any) -> tuple[int, Any]:
        request = _expect(body or {}, {}, {"node": str, "engine": str})
        names = [request["engine"]] if request.get("engine") else list(ENGINES)
        for name in names:
            if name not in ENGINES:
                raise HttpError(400, f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
        if request.get("node"):
            targets = [self._connected(request["node"])]
        else:
            targets = [(r, r.agent) for r in self._registry.records() if r.agent is not None]
        results = []
        for rec, agent in targets:
            for name in names:
                try:
                    check = await agent.engine_check(name, engines.widest_command(name))
                    results.append({"node": rec.node_id, **config.unstructure(check)})
                except PeerError as exc:
                    results.append({"node": rec.node_id, "engine": name, "error": str(exc)})
        return 200, {"checks": results}

    # catalog and replicas ---------------------------------------------------------------

    def _need_catalog(self) -> tuple[Reconciler, CatalogFile]:
        if self._reconciler is None or self._catalog is None:
            raise HttpError(404, "this control plane runs no catalog")
        return self._reconciler, self._catalog

    async def _models(self, **_: Any) -> tuple[int, Any]:
        _rec, catalog = self._need_catalog()
        return 200, {"models": [config.unstructure(m) for m in catalog.catalog.models]}

    def _replica_rows(self) -> list[dict[str, Any]]:
        reconciler, _cat = self._need_catalog()
        now = trio.current_time()
        wall = time.time()
        rows: list[dict[str, Any]] = []
        events = self._registry.events
        views = reconciler.replicas()
        present = [v.replica_id for v in views]
        sources: dict[str, str] | None = None
        for v in views:
            since = wall - (now - v.first_seen)
            # Its own last failure, else why its predecessor went: the reason
            # outlives the replica it was about.
            failure = events.last_failure(v.replica_id) or events.predecessor_failure(
                v.model_name, started=v.first_seen, present=present
            )
            rows.append(
                {
                    "model": v.model_name,
                    "replica": v.replica_id,
                    "state": v.state,
                    "nodes": list(v.nodes),
                    "since": since,
                    "stale": v.stale,
                    "reason": v.reason,
                    "last_failure": _failure_json(failure),
                }
            )
            if v.state == "starting":
                if sources is None:
                    sources = {m.name: m.source for m in _cat.catalog.models}
                rows[-1]["progress"] = self._fetching(v.nodes, sources.get(v.model_name))
        for u in reconciler.unplaced():
            failure = events.predecessor_failure(u.model_name, started=None, present=present)
            rows.append(
                {
                    "model": u.model_name,
                    "replica": None,
                    "state": "unplaced",
                    "nodes": [],
                    "since": None,
                    "stale": False,
                    "reason": "\n".join(u.reasons),
                    "last_failure": _failure_json(failure),
                }
            )
        return rows

    def _fetching(self, nodes: tuple[str, ...], source: str | None) -> dict[str, Any] | None:
        """The download a starting replica waits on: its first node's that has one."""
        if source is None:
            return None
        for node in nodes:
            found = self._registry.progress(node).get(source)
            if found is not None:
                return {"node": node, **progress_json(found)}
        return None

    async def _replicas(self, **_: Any) -> tuple[int, Any]:
        return 200, {"replicas": self._replica_rows()}

    async def _status(self, **_: Any) -> tuple[int, Any]:
        reconciler, catalog = self._need_catalog()
        rows = self._replica_rows()
        out = []
        for m in catalog.catalog.models:
            mine = [r for r in rows if r["model"] == m.name]
            failure = self._registry.events.predecessor_failure(m.name, started=None, present=())
            out.append(
                {
                    "model": m.name,
                    "desired": m.replicas,
                    "ready": sum(r["state"] == "ready" for r in mine),
                    "starting": sum(r["state"] == "starting" for r in mine),
                    "unplaced": any(r["state"] == "unplaced" for r in mine),
                    "last_failure": _failure_json(failure),
                }
            )
        inventories = {r.node_id: r.inventory for r in self._registry.records()}
        pairs = [(m.name, m.source) for m in catalog.catalog.models]
        holds = {}
        for i, (node_id, inv) in enumerate(inventories.items()):
            holds[node_id] = _holdings.node_holds(node_id, inv, pairs)
            if i % _NODES_PER_SLICE == _NODES_PER_SLICE - 1:
                await trio.lowlevel.checkpoint()  # a large fleet: let the heartbeats in
        fabrics = [
            {
                "fabric": f.fabric,
                "nodes": list(f.nodes),
                "models": [
                    {"model": h.model, "bytes": h.size_bytes, "nodes": list(h.nodes)}
                    for h in f.models
                ],
            }
            for f in _holdings.fabric_holdings(inventories, pairs, holds)
        ]
        # passes, settling, holding...: a test waits for a pass instead of sleeping.
        return 200, {"models": out, "fabrics": fabrics, "reconciler": reconciler.statistics()}

    # weights ----------------------------------------------------------------------------

    def _catalog_sources(self) -> list[tuple[str, str]]:
        """(model, source) for every catalog model; none when this control plane runs no
        catalog (then every cache entry is unwanted, and the agents still keep what their
        shards use)."""
        if self._catalog is None:
            return []
        return [(m.name, m.source) for m in self._catalog.catalog.models]

    def _node_weights(
        self, only: str | None = None
    ) -> list[tuple[NodeRecord, _holdings.NodeWeights]]:
        pairs = self._catalog_sources()
        return [
            (rec, _holdings.node_weights(rec.node_id, rec.inventory.weights, pairs))
            for rec in self._registry.records()
            if only is None or rec.node_id == only
        ]

    async def _weights(self, **_: Any) -> tuple[int, Any]:
        nodes = []
        pairs = self._catalog_sources()
        for rec in self._registry.records():
            w = _holdings.node_weights(rec.node_id, rec.inventory.weights, pairs)
            nodes.append(
                {
                    "node": rec.node_id,
                    "state": rec.liveness.state.value,
                    "connected": rec.agent is not None,
                    "reported": w.reported,
                    "weights_dir": w.weights_dir,
                    "held": [_held_json(h) for h in w.held],
                    "reclaimable": [
                        {"path": r.path, "size_bytes": r.size_bytes} for r in w.reclaimable
                    ],
                    "reclaimable_bytes": sum(r.size_bytes for r in w.reclaimable),
                }
            )
            await trio.lowlevel.checkpoint()  # a large fleet: let the heartbeats in
        return 200, {"nodes": nodes}

    async def _weights_collect(self, body: Any, **_: Any) -> tuple[int, Any]:
        request = _expect(
            {} if body is None else body, {}, {"dry_run": bool, "node": str, "paths": list}
        )
        dry_run = bool(request.get("dry_run", False))
        node = request.get("node")
        paths = request.get("paths")
        if paths is not None:
            if node is None:
                raise HttpError(400, "paths: only with node (each node's paths are its own); "
                                     "add \"node\": \"<node id>\"")  # fmt: skip
            bad = [p for p in paths if not isinstance(p, str) or not p or len(p) > 4096]
            if bad or len(paths) > COLLECT_MAX_PATHS:
                shown = f"{str(bad[0])[:80]!r}" if bad else f"{len(paths)} paths"
                raise HttpError(400, f"paths: expected at most {COLLECT_MAX_PATHS} non-empty "
                                     f"strings of at most 4096 characters, "
                                     f"got {shown}")  # fmt: skip
        known = self._node_weights(node)
        if node is not None and not known:
            raise HttpError(404, f"no node {node!r} has registered")
        pairs = self._catalog_sources()
        asks: list[tuple[NodeRecord, tuple[str, ...], int | None, list[dict[str, str]]]] = []
        for rec, w in known:
            if paths is None:
                asks.append((rec, tuple(r.path for r in w.reclaimable),
                             sum(r.size_bytes for r in w.reclaimable), []))  # fmt: skip
                continue
            sizes = {h.path: h.size_bytes for h in w.held}
            got = [sizes.get(p) for p in paths]
            total = None if None in got else sum(s or 0 for s in got)
            # What the catalog wants is refused here: the agent knows only its own shards.
            ours = []
            for p in paths:
                wants = _holdings.catalog_wants(p, w.weights_dir, pairs)
                if wants:
                    detail = (f"{p}: {_holdings.WANTED} ({', '.join(wants)}); remove the "
                              "model from the catalog first")  # fmt: skip
                    ours.append({"path": p, "reason": _holdings.WANTED, "detail": detail})
            asks.append((rec, tuple(paths), total, ours))
        results: dict[str, dict[str, Any]] = {}

        async def ask(
            rec: NodeRecord,
            asked: tuple[str, ...],
            asked_bytes: int | None,
            ours: list[dict[str, str]],
        ) -> None:
            row: dict[str, Any] = {
                "node": rec.node_id, "asked": list(asked), "asked_bytes": asked_bytes,
                "removed": [], "freed_bytes": 0, "refused": ours, "error": None,
            }  # fmt: skip
            results[rec.node_id] = row
            refused_here = {r["path"] for r in ours}
            asked = tuple(p for p in asked if p not in refused_here)
            if not asked:
                return
            agent = rec.agent
            if agent is None:
                row["error"] = f"node {rec.node_id} is {rec.liveness.state.value}: not connected"
                return
            try:
                # The bridge bounds the call with its per-call deadline.
                done: model.Reclaimed = await agent.reclaim(self._registry.epoch, asked, dry_run)
            except LlmgwError as exc:
                row["error"] = str(exc)
                return
            row["removed"] = list(done.removed)
            row["freed_bytes"] = done.freed_bytes
            row["refused"] = ours + [
                {"path": r.path, "reason": r.reason, "detail": r.detail} for r in done.refused
            ]
            log.info("reclaim on %s%s: asked %d, removed %d (%d bytes), refused %d",
                     rec.node_id, " (dry run)" if dry_run else "", len(asked),
                     len(done.removed), done.freed_bytes, len(done.refused))  # fmt: skip

        async with trio.open_nursery() as nursery:
            for rec, asked, asked_bytes, ours in asks:
                nursery.start_soon(ask, rec, asked, asked_bytes, ours)
        return 200, {"dry_run": dry_run, "nodes": [results[a[0].node_id] for a in asks]}

    async def _events(self, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        raw = query.get("limit", "50")
        if not raw.isdigit() or not 1 <= int(raw) <= EVENTS_LIMIT:
            raise HttpError(400, f"limit: expected a whole number from 1 to {EVENTS_LIMIT}, "
                                 f"got {raw!r}")  # fmt: skip
        found = self._registry.events.events(
            replica_id=query.get("replica") or None,
            node_id=query.get("node") or None,
            limit=int(raw),
        )
        return 200, {"events": [_event_json(e) for e in found]}

    async def _place(self, body: Any, **_: Any) -> tuple[int, Any]:
        reconciler, catalog = self._need_catalog()
        request = _expect(body, {"model": str}, {})
        m = catalog.catalog.model(request["model"])
        if m is None:
            known = ", ".join(x.name for x in catalog.catalog.models) or "none"
            raise HttpError(404, f"no model {request['model']!r} in the catalog (known: {known})")
        found = reconciler.try_place(m)
        if isinstance(found, Unplaced):
            return 200, {"model": m.name, "placed": False, "reasons": list(found.reasons)}
        profile, where = found
        ranks = [
            {"rank": r.rank, "node": r.node_id, "gpus": list(r.gpu_indexes),
             "fabric_adapters": list(r.fabric_adapters)}
            for r in where.ranks
        ]  # fmt: skip
        return 200, {"model": m.name, "placed": True, "engine": profile.engine, "ranks": ranks,
                     "fabric": where.fabric}  # fmt: skip

    async def _route(self, body: Any, **_: Any) -> tuple[int, Any]:
        """Which endpoint the router would send a request to now, and why."""
        if self._router is None:
            raise HttpError(404, "this control plane runs no router (router_listen is null)")
        asked = _expect(body, {"model": str, "request": dict}, {"path": str})
        path = asked.get("path", "/v1/chat/completions")
        try:
            return 200, self._router.explain(asked["model"], path, asked["request"])
        except RouterHttpError as exc:
            raise HttpError(exc.status, str(exc)) from None

    async def _cordon(self, node: str, body: Any, **_: Any) -> tuple[int, Any]:
        request = _expect(body or {}, {}, {"reason": str})
        if self._registry.record(node) is None:
            raise HttpError(404, f"no node {node!r} has registered")
        self._registry.cordon(node, request.get("reason"))
        return 200, {"cordoned": node}

    async def _uncordon(self, node: str, **_: Any) -> tuple[int, Any]:
        lifted = self._registry.uncordon(node)
        if not lifted:
            raise HttpError(404, f"node {node!r} is neither cordoned nor draining")
        return 200, {"uncordoned": node, "lifted": lifted}

    async def _drain(self, node: str, body: Any, **_: Any) -> tuple[int, Any]:
        request = _expect(body or {}, {}, {"reason": str})
        if self._registry.record(node) is None:
            raise HttpError(404, f"no node {node!r} has registered")
        self._registry.drain(node, request.get("reason"))  # its listeners wake the reconciler
        return 200, {"draining": node}

    async def _forget(self, node: str, **_: Any) -> tuple[int, Any]:
        rec = self._registry.record(node)
        if rec is not None and rec.agent is not None:
            raise HttpError(
                409,
                f"node {node} is connected ({rec.liveness.state.value}): a connected node "
                "cannot be forgotten; stop its agent first (drain it to move its replicas)",
            )
        was = self._registry.forget(node)  # NotFound (404) when it is not known at all
        return 200, {"forgotten": node, "was": was}

    async def _history(self, node: str, **_: Any) -> tuple[int, Any]:
        """The node's last hour (llmgw/cp/_history.py); null where nothing was reported."""
        history = self._registry.history
        if history is None:
            raise HttpError(404, "this control plane keeps no node history")
        view = history.view(node)
        if view is None:
            raise HttpError(404, f"no node {node!r} has a history here: it has not registered")
        return 200, view

    # API keys ---------------------------------------------------------------------------

    def _need_keys(self) -> KeyStore:
        if self._keys is None:
            raise HttpError(404, "this control plane keeps no API keys")
        return self._keys

    async def _keys_list(self, **_: Any) -> tuple[int, Any]:
        keys = await self._need_keys().list()
        return 200, {"keys": [_key_json(k) for k in keys]}

    async def _keys_create(self, body: Any, **_: Any) -> tuple[int, Any]:
        request = _expect(
            body,
            {"tenant": str},
            {"models": list, "default_band": str, "max_band": str, "name": str},
        )
        models = request.get("models")
        key, secret = await self._need_keys().create(
            tenant=request["tenant"],
            models=[str(m) for m in models] if models is not None else None,
            default_band=request.get("default_band", "interactive"),
            max_band=request.get("max_band"),
            name=request.get("name", ""),
        )
        log.info("API key %s created for tenant %s", key.key_id, key.tenant)
        return 201, {"key": _key_json(key), "secret": secret}

    async def _keys_revoke(self, key_id: str, **_: Any) -> tuple[int, Any]:
        if not await self._need_keys().revoke(key_id):
            raise HttpError(404, f"no API key {key_id!r}")
        log.info("API key %s revoked", key_id)
        return 200, {"revoked": key_id}


EVENTS_LIMIT = 1000
COLLECT_MAX_PATHS = 10_000


def _held_json(h: _holdings.Held) -> dict[str, Any]:
    return {"path": h.path, "kind": h.kind, "size_bytes": h.size_bytes, "files": h.files,
            "wanted_by": list(h.wanted_by)}  # fmt: skip


def progress_json(p: FetchProgress) -> dict[str, Any]:
    """A fetch's progress for the API: unknown stays null, an eta only with a length and
    a rate."""
    return {
        "source": p.source,
        "done_bytes": p.done_bytes,
        "total_bytes": p.total_bytes,
        "rate_bytes_per_s": p.rate_bytes_per_s,
        "eta_s": p.eta_s,
        "at": p.at_wall,
    }


def _event_json(event: Event) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "at": event.at,
        "kind": event.kind,
        "message": event.message,
        "node_id": event.node_id,
        "replica_id": event.replica_id,
        "model_name": event.model_name,
        "shard_id": event.shard_id,
        "lines": list(event.lines),
    }


def _failure_json(failure: Failure | None) -> dict[str, Any] | None:
    if failure is None:
        return None
    return {
        "at": failure.at,
        "kind": failure.kind,
        "reason": failure.reason,
        "lines": list(failure.lines),
        "node_id": failure.node_id,
        "shard_id": failure.shard_id,
        "replica_id": failure.replica_id,
        "model_name": failure.model_name,
    }


def _key_json(key: ApiKey) -> dict[str, Any]:
    return {
        "key_id": key.key_id,
        "tenant": key.tenant,
        "models": sorted(key.models) if key.models is not None else None,
        "default_band": key.default_band,
        "max_band": key.max_band,
        "created_at": key.created_at,
        "revoked": key.revoked,
        "name": key.name,
    }


ENGINES = ("vllm", "sglang", "llama-server")


def _expect(body: Any, required: dict[str, type], optional: dict[str, type]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    problems = []
    for key in required:
        if key not in body:
            problems.append(f"{key}: required")
    for key, value in body.items():
        kind = required.get(key) or optional.get(key)
        if kind is None:
            problems.append(f"{key}: unknown field")
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"{key}: expected {kind.__name__}, got {type(value).__name__}")
    if problems:
        raise HttpError(400, "; ".join(problems))
    return body


async def _read_json(receive: Receive, limit: int = 1 << 20) -> Any:
    chunks = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    raw = b"".join(chunks)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise HttpError(400, f"the request body is not JSON: {exc}") from None


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _json(send: Send, status: int, body: Any) -> None:
    """`body` as JSON; bytes are taken as JSON already rendered."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _error(send: Send, status: int, message: str) -> None:
    await _json(send, status, {"error": {"message": message, "code": status}})
