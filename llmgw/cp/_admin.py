"""The admin listener: JSON API for operators and `llmgw ctl`.

A plain ASGI app on hypercorn's trio worker. Every `/api/` route needs an admin
key as a Bearer token; `/healthz` does not.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, unquote

import attrs
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw import config, engines, model
from llmgw.cp import _holdings, _node_logs
from llmgw.cp._catalog_file import CatalogFile
from llmgw.cp._events import Event, Failure
from llmgw.cp._leader import LeaderView
from llmgw.cp._reconciler import Reconciler, Unplaced
from llmgw.cp._registry import FetchProgress, NodeRecord, NodeRegistry
from llmgw.cp._shards import manual_shard, ports_taken
from llmgw.cp._store import Account, AuditEntry, Store
from llmgw.errors import (
    ConfigError,
    DeadlineExceeded,
    LlmgwError,
    NotFound,
    PeerError,
    StaleEpoch,
    UsageError,
)
from llmgw.keys import ApiKey
from llmgw.router import HttpError as RouterHttpError
from llmgw.router import KeyStore
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


class LeaderSource(Protocol):
    """Leadership as the admin API needs it (llmgw/cp/_leader.py `Leadership`)."""

    def may_act(self) -> bool: ...
    def view(self) -> LeaderView: ...


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
        store: Store | None = None,
        bands: Mapping[str, int] | None = None,
    ) -> None:
        self._registry = registry
        # Whether this control plane leads (llmgw/cp/_leader.py), set by llmgw/cp/_main.py;
        # None: it always does (tests). On a standby every non-GET call answers 409.
        self.leadership: LeaderSource | None = None
        # Accounts, usage and the audit log (llmgw/cp/_store.py); None: none kept here.
        self._store = store
        # The router's priority bands, name -> rank (0 is the highest): what a tenant's or
        # a key's max_band may name. None: not checked here (no router configured).
        self._bands = dict(bands) if bands is not None else None
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
            ("GET", re.compile(r"^/api/v1/tenants$"), self._tenants_list),
            ("POST", re.compile(r"^/api/v1/tenants$"), self._tenants_create),
            ("GET", re.compile(r"^/api/v1/tenants/(?P<tenant>[^/]+)$"), self._tenants_get),
            ("PATCH", re.compile(r"^/api/v1/tenants/(?P<tenant>[^/]+)$"), self._tenants_set),
            ("DELETE", re.compile(r"^/api/v1/tenants/(?P<tenant>[^/]+)$"), self._tenants_delete),
            ("GET", re.compile(r"^/api/v1/usage$"), self._usage),
            ("GET", re.compile(r"^/api/v1/audit$"), self._audit_list),
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
        if path == "/api/v1/leader" and method == "GET":
            await _json(send, 200, self._leader_json())
            return
        leadership = self.leadership
        if method not in ("GET", "HEAD") and leadership is not None and not leadership.may_act():
            # A standby serves the API read-only; the operator is told where to write.
            await _json(send, 409, self._standby_refusal())
            return
        for route_method, pattern, handler in self._routes:
            match = pattern.match(path)
            if match and route_method == method:
                try:
                    body = await _read_json(receive) if method in ("POST", "PUT", "PATCH") else None
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
                except StaleEpoch as exc:
                    # The agent knows a newer leader: counted, and this one steps down.
                    self._registry.stale_epoch(match.groupdict().get("node") or "?", exc)
                    await _error(send, 409, f"the agent refused this command as stale: {exc}")
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

    # leadership (llmgw/cp/_leader.py) ---------------------------------------------------

    def _leader_json(self) -> dict[str, Any]:
        """`GET /api/v1/leader`: this control plane's role, epoch, the leader's and its own
        addresses; without a Leadership (tests, a bare app) a single leader at its epoch."""
        if self.leadership is None:
            body: dict[str, Any] = {
                "role": "single", "epoch": self._registry.epoch, "leader": None, "me": None,
                "lease_s": None,
            }  # fmt: skip
        else:
            body = self.leadership.view().json()
        body["commands_refused_stale"] = self._registry.commands_refused_stale
        return body

    def _standby_refusal(self) -> dict[str, Any]:
        """The error body every other refusal has, and the leader's addresses beside it."""
        view = self.leadership.view() if self.leadership is not None else None
        leader = view.leader if view is not None else None
        if leader is None:
            message = "standby; no leader yet: try again in a few seconds"
        else:
            message = f"standby; leader is {leader.describe()}"
        return {
            "error": {"message": message, "code": 409},
            "leader": leader.json() if leader is not None else None,
        }

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
            grace = math.nan
        if not 0 <= grace <= MAX_GRACE_S:  # NaN too
            raise HttpError(
                400, f"grace: expected seconds from 0 to {MAX_GRACE_S:g}, got {query['grace']!r}"
            )
        await agent.stop_shard(self._registry.epoch, shard, grace)
        self._registry.forget_shard(node, shard)
        log.info("shard %s on %s stopped by an operator", shard, node)
        return 200, {"stopped": shard}

    async def _shard_logs(
        self, node: str, shard: str, query: dict[str, str], **_: Any
    ) -> tuple[int, Any]:
        _rec, agent = self._connected(node)
        lines = _node_logs.lines_of(query, default=40)
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
                    # Unknown, not 0, until the node has reported its weights directory.
                    "reclaimable_bytes": (
                        sum(r.size_bytes for r in w.reclaimable) if w.reported else None
                    ),
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
            except StaleEpoch as exc:  # another control plane leads: counted, and step down
                self._registry.stale_epoch(rec.node_id, exc)
                row["error"] = str(exc)
                return
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
        if not _node_logs.whole(raw) or not 1 <= int(raw) <= EVENTS_LIMIT:
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
        await self._saved(node, "cordoned")
        await self._audit("cordon", f"{node}: {self._registry.cordoned[node]}")
        return 200, {"cordoned": node}

    async def _uncordon(self, node: str, **_: Any) -> tuple[int, Any]:
        lifted = self._registry.uncordon(node)
        if not lifted:
            raise HttpError(404, f"node {node!r} is neither cordoned nor draining")
        await self._saved(node, "uncordoned")
        await self._audit("uncordon", f"{node}: lifted {', '.join(lifted)}")
        return 200, {"uncordoned": node, "lifted": lifted}

    async def _drain(self, node: str, body: Any, **_: Any) -> tuple[int, Any]:
        request = _expect(body or {}, {}, {"reason": str})
        if self._registry.record(node) is None:
            raise HttpError(404, f"no node {node!r} has registered")
        self._registry.drain(node, request.get("reason"))  # its listeners wake the reconciler
        await self._saved(node, "draining")
        await self._audit("drain", f"{node}: {self._registry.draining[node]}")
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
        await self._saved(node, "forgotten")
        await self._audit("forget", f"{node}: it was {was}")
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

    # the store: what an operator did ----------------------------------------------------

    async def _saved(self, node: str, what: str) -> None:
        """The operator's override is in the store before the API answers."""
        try:
            await self._registry.flush()
        except LlmgwError as exc:
            raise HttpError(
                503,
                f"node {node} is {what} on this control plane but not yet saved in the store "
                f"({exc}); it is retried, and lost if this control plane restarts first",
            ) from None

    async def _audit(self, action: str, detail: str) -> None:
        if self._store is not None:
            await self._store.audit("admin", action, detail)

    async def _audit_list(self, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        store = self._need_store()
        raw = query.get("limit", "100")
        if not _node_logs.whole(raw) or not 1 <= int(raw) <= AUDIT_LIMIT:
            raise HttpError(400, f"limit: expected a whole number from 1 to {AUDIT_LIMIT}, "
                                 f"got {raw!r}")  # fmt: skip
        return 200, {"entries": [_audit_json(e) for e in await store.recent_audit(int(raw))]}

    def _need_store(self) -> Store:
        if self._store is None:
            raise HttpError(404, "this control plane keeps no store")
        return self._store

    # API keys ---------------------------------------------------------------------------

    def _need_keys(self) -> KeyStore:
        if self._keys is None:
            raise HttpError(404, "this control plane keeps no API keys")
        return self._keys

    def _band_rank(self, what: str, band: str) -> int | None:
        """The rank of a configured band (0 is the highest); a band not configured is
        refused, naming those that are. None when no bands are known here."""
        if self._bands is None:
            return None
        if band not in self._bands:
            known = ", ".join(sorted(self._bands, key=self._bands.__getitem__))
            raise HttpError(400, f"{what}: no band {band!r}; the router's bands are {known}")
        return self._bands[band]

    async def _keys_list(self, **_: Any) -> tuple[int, Any]:
        keys = await self._need_keys().list()
        now = time.time()
        return 200, {"keys": [_key_json(k, now) for k in keys]}

    async def _keys_create(self, body: Any, **_: Any) -> tuple[int, Any]:
        request = _expect(
            body,
            {"tenant": str},
            {"models": list, "default_band": str, "max_band": str, "name": str,
             "expires_at": object},
        )  # fmt: skip
        keys = self._need_keys()
        tenant = request["tenant"]
        if not _NAME.match(tenant):
            raise HttpError(400, f"tenant: {tenant[:80]!r} is not a tenant name ({_NAME_RULE})")
        default_band = request.get("default_band", "interactive")
        default_rank = self._band_rank("default_band", default_band)
        max_band = request.get("max_band")
        if max_band is not None:
            self._band_rank("max_band", max_band)
        expires_at = request.get("expires_at")
        now = time.time()
        if expires_at is not None and (
            not isinstance(expires_at, (int, float))
            or isinstance(expires_at, bool)
            or not math.isfinite(expires_at)
            or expires_at <= now
        ):
            raise HttpError(400, f"expires_at: {expires_at!r} is not a time in the future, in "
                                 f"seconds since the epoch (now is {now:.0f})")  # fmt: skip
        created = False
        if self._store is not None:
            account = await self._store.get_account(tenant)
            if account is None:
                # Keys for a new tenant make its account, with no limits (and say so).
                await self._store.create_account(Account(tenant))
                await self._audit("tenant create", f"{tenant}: no limits (with its first key)")
                created = True
            elif account.max_band is not None:
                cap = self._band_rank("tenant max_band", account.max_band)
                if max_band is not None:
                    asked = self._band_rank("max_band", max_band)
                    if cap is not None and asked is not None and asked < cap:
                        raise HttpError(
                            400,
                            f"max_band {max_band!r} is above tenant {tenant}'s highest band "
                            f"{account.max_band!r}; ask for {account.max_band!r} or lower, or "
                            f"raise the tenant's (llmgw ctl tenants set {tenant} --max-band ...)",
                        )
                elif cap is not None and default_rank is not None and default_rank < cap:
                    max_band = account.max_band  # the key asks for less than its tenant may
        models = request.get("models")
        key, secret = await keys.create(
            tenant=tenant,
            models=[str(m) for m in models] if models is not None else None,
            default_band=default_band,
            max_band=max_band,
            name=request.get("name", ""),
            expires_at=None if expires_at is None else float(expires_at),
        )
        expiry = "never expires" if key.expires_at is None else f"expires at {key.expires_at:.0f}"
        await self._audit("key create", f"{key.key_id} for tenant {tenant}; {expiry}")
        return 201, {"key": _key_json(key, time.time()), "secret": secret,
                     "tenant_created": created}  # fmt: skip

    async def _keys_revoke(self, key_id: str, **_: Any) -> tuple[int, Any]:
        if not await self._need_keys().revoke(key_id):
            raise HttpError(404, f"no API key {key_id!r}")
        log.info("API key %s revoked", key_id)
        await self._audit("key revoke", key_id)
        return 200, {"revoked": key_id}

    # tenants ----------------------------------------------------------------------------

    def _limits(self, body: Any, *, partial: bool) -> dict[str, Any]:
        """rpm, tpm (counts >= 0) and max_band (a configured band), each null for none."""
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        problems = []
        out: dict[str, Any] = {}
        for field in ("rpm", "tpm"):
            if field in body:
                value = body[field]
                if value is not None and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 0
                ):
                    problems.append(f"{field}: expected a count >= 0 or null, got {value!r}")
                out[field] = value
        if "max_band" in body:
            band = body["max_band"]
            if band is not None and not isinstance(band, str):
                problems.append(f"max_band: expected a band name or null, got {band!r}")
            out["max_band"] = band
        allowed = {"rpm", "tpm", "max_band"} | (set() if partial else {"name"})
        problems += [f"{k}: unknown field" for k in body if k not in allowed]
        if problems:
            raise HttpError(400, "; ".join(problems))
        if isinstance(out.get("max_band"), str):
            self._band_rank("max_band", out["max_band"])
        return out

    async def _tenant_json(
        self, account: Account, keys: list[ApiKey] | None = None
    ) -> dict[str, Any]:
        """The tenant with its limits and how many usable keys it has (of `keys`, every
        key, when given: a list of tenants reads them once)."""
        if keys is None:
            keys = await self._need_keys().list()
        now = time.time()
        keys = [k for k in keys if k.tenant == account.name]
        return {
            "name": account.name,
            "rpm": account.rpm,
            "tpm": account.tpm,
            "max_band": account.max_band,
            "created_at": account.created_at,
            "keys": sum(k.usable(now) for k in keys),
        }

    async def _account(self, tenant: str) -> Account:
        account = await self._need_store().get_account(unquote(tenant))
        if account is None:
            raise HttpError(404, f"no tenant {unquote(tenant)!r}")
        return account

    def _limits_changed(self) -> None:
        # This process's router reads limits with its keys: make it read them again now
        # (router workers in other processes: within their key cache's TTL).
        invalidate = getattr(self._keys, "invalidate", None)
        if invalidate is not None:
            invalidate()

    async def _tenants_list(self, **_: Any) -> tuple[int, Any]:
        accounts = await self._need_store().list_accounts()
        keys = await self._need_keys().list()
        return 200, {"tenants": [await self._tenant_json(a, keys) for a in accounts]}

    async def _tenants_get(self, tenant: str, **_: Any) -> tuple[int, Any]:
        return 200, {"tenant": await self._tenant_json(await self._account(tenant))}

    async def _tenants_create(self, body: Any, **_: Any) -> tuple[int, Any]:
        store = self._need_store()
        limits = self._limits(body, partial=False)
        name = body.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise HttpError(400, f"name: {str(name)[:80]!r} is not a tenant name ({_NAME_RULE})")
        if await store.get_account(name) is not None:
            raise HttpError(409, f"tenant {name} exists; change its limits with "
                                 f"`llmgw ctl tenants set {name}`")  # fmt: skip
        account = await store.create_account(Account(name, **limits))
        await self._audit("tenant create", f"{name}: {_limits_text(account)}")
        return 201, {"tenant": await self._tenant_json(account)}

    async def _tenants_set(self, tenant: str, body: Any, **_: Any) -> tuple[int, Any]:
        store = self._need_store()
        account = await self._account(tenant)
        limits = self._limits(body, partial=True)
        if not limits:
            raise HttpError(400, "nothing to change: give rpm, tpm or max_band")
        changed = attrs.evolve(account, **limits)
        if not await store.update_account(changed):
            raise HttpError(404, f"no tenant {account.name!r}")
        self._limits_changed()
        await self._audit("tenant set", f"{account.name}: {_limits_text(changed)}")
        return 200, {"tenant": await self._tenant_json(changed)}

    async def _tenants_delete(self, tenant: str, **_: Any) -> tuple[int, Any]:
        store = self._need_store()
        account = await self._account(tenant)
        live = [k for k in await self._need_keys().list()
                if k.tenant == account.name and not k.revoked]  # fmt: skip
        if live:
            raise HttpError(
                409,
                f"tenant {account.name} has {len(live)} unrevoked key"
                f"{'s' if len(live) != 1 else ''} ({', '.join(k.key_id for k in live[:5])}"
                f"{', ...' if len(live) > 5 else ''}); revoke them first "
                "(llmgw ctl keys revoke KEY)",
            )
        await store.delete_account(account.name)
        self._limits_changed()
        await self._audit("tenant delete", account.name)
        return 200, {"deleted": account.name}

    # usage ------------------------------------------------------------------------------

    async def _usage(self, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        store = self._need_store()
        raw = query.get("since", str(USAGE_DEFAULT_SINCE_S))
        try:
            since = float(raw)
        except ValueError:
            since = -1.0
        if not (since >= 0 and math.isfinite(since)):
            raise HttpError(400, f"since: expected seconds ago (under {EPOCH_FROM:g}) or seconds "
                                 f"since the epoch, got {raw!r}")  # fmt: skip
        if since < EPOCH_FROM:
            since = time.time() - since
        rows = await store.usage(tenant=query.get("tenant") or None, since=since)
        totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
        out = []
        for r in rows:
            out.append({"hour": r.hour, "tenant": r.tenant, "key_id": r.key_id, "model": r.model,
                        "requests": r.requests, "prompt_tokens": r.prompt_tokens,
                        "completion_tokens": r.completion_tokens})  # fmt: skip
            totals["requests"] += r.requests
            totals["prompt_tokens"] += r.prompt_tokens
            totals["completion_tokens"] += r.completion_tokens
        return 200, {"rows": out, "totals": totals}


EVENTS_LIMIT = 1000
MAX_GRACE_S = 3600.0  # as stop_grace_s in agent.yaml and server.yaml
AUDIT_LIMIT = 1000
USAGE_DEFAULT_SINCE_S = 7 * 86400
EPOCH_FROM = 1e9  # a `since` at least this is seconds since the epoch (2001), else seconds ago
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_NAME_RULE = "letters, digits and . _ @ -, starting with a letter or digit, at most 128"
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


def _key_json(key: ApiKey, now: float) -> dict[str, Any]:
    state = "revoked" if key.revoked else "active" if key.usable(now) else "expired"
    return {
        "key_id": key.key_id,
        "tenant": key.tenant,
        "models": sorted(key.models) if key.models is not None else None,
        "default_band": key.default_band,
        "max_band": key.max_band,
        "created_at": key.created_at,
        "revoked": key.revoked,
        "name": key.name,
        "expires_at": key.expires_at,
        "state": state,
    }


def _audit_json(entry: AuditEntry) -> dict[str, Any]:
    return {"seq": entry.seq, "at": entry.at, "actor": entry.actor, "action": entry.action,
            "detail": entry.detail}  # fmt: skip


def _limits_text(account: Account) -> str:
    return ", ".join(
        f"{name} {'none' if value is None else value}"
        for name, value in (("rpm", account.rpm), ("tpm", account.tpm),
                            ("max_band", account.max_band))
    )  # fmt: skip


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
