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
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from llmgw import config, engines
from llmgw.cp._registry import NodeRecord, NodeRegistry
from llmgw.cp._shards import manual_shard
from llmgw.errors import ConfigError, PeerError, UsageError
from llmgw.rpc import AgentHandle

log = logging.getLogger("llmgw.cp.admin")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

ADMIN_KEY_FILE = "admin.key"


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


class AdminApp:
    def __init__(self, registry: NodeRegistry, admin_key: str) -> None:
        self._registry = registry
        self._digest = _digest(admin_key)
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
            ("POST", re.compile(r"^/api/v1/engine-check$"), self._engine_check),
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
                except (UsageError, ConfigError) as exc:
                    await _error(send, 400, str(exc))
                    return
                except PeerError as exc:
                    await _error(send, 502, f"the agent answered: {exc}")
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
        return 200, {"nodes": [config.unstructure(v) for v in views]}

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
            node,
            rec.inventory,
            rec.shards,
            engine=request["engine"],
            model_ref=request["model"],
            port=request.get("port"),
            args=[str(a) for a in request.get("args", [])],
            gpus=request.get("gpus"),
            served_name=request.get("served_name"),
            node_address=rec.address.rsplit(":", 1)[0],
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
        tail = await agent.logs(shard, lines)
        return 200, {"lines": [config.unstructure(line) for line in tail]}

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
    data = json.dumps(body).encode()
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
