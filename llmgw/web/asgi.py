"""ASGI as every llmgw HTTP app speaks it: the types, the lifespan loop, a JSON answer and
one HTTP error value.

The admin API, the pages, the router's app and router-only mode's metrics app all take
these; each app keeps its own error body (the admin's `{"error": {"message", "code"}}`,
the router's OpenAI and Anthropic shapes in llmgw/router/_surface.py), since those are
wire formats that clients parse.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = [
    "App",
    "Headers",
    "HttpError",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "lifespan",
    "send_json",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

Headers = tuple[tuple[bytes, bytes], ...]


class HttpError(Exception):
    """Answer the request with `status`, saying `message`; `headers` go with the answer
    (an `allow` on a 405, a `retry-after` on a 429). The app renders the body in its shape."""

    def __init__(self, status: int, message: str, *, headers: Headers = ()) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


async def lifespan(
    receive: Receive,
    send: Send,
    *,
    startup: Callable[[], Awaitable[None]] | None = None,
    shutdown: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Answer the server's lifespan messages until shutdown, running the hooks given.

    A hook that raises answers `lifespan.startup.failed` (or `.shutdown.failed`) with the
    exception's text, which the server logs and stops on; the loop then returns, as no
    further lifespan message is due. Other message types are ignored, as the spec asks.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if startup is not None:
                try:
                    await startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if shutdown is not None:
                try:
                    await shutdown()
                except Exception as exc:
                    await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
                    return
            await send({"type": "lifespan.shutdown.complete"})
            return


async def send_json(send: Send, status: int, body: Any, headers: Headers = ()) -> None:
    """Answer `status` with `body` as JSON, `headers` after the content type and length;
    bytes are taken as JSON already rendered."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
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
