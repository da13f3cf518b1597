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
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from llmgw import config
from llmgw.cp._registry import NodeRegistry

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


class AdminApp:
    def __init__(self, registry: NodeRegistry, admin_key: str) -> None:
        self._registry = registry
        self._digest = _digest(admin_key)

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
        if path == "/api/v1/nodes" and method == "GET":
            views = self._registry.views()
            await _json(send, 200, {"nodes": [config.unstructure(v) for v in views]})
            return
        await _error(send, 404, f"no such API route: {method} {path}")

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(_digest(token.strip()), self._digest)
        return False


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
