"""The admin API's HTTP plumbing: the route row, reading a JSON request body, and the
admin's error body. The ASGI types, the lifespan loop, the JSON answer and the error value
are llmgw.web.asgi's; `HttpError` is re-exported here beside `expect`, which raises it.

Nothing here knows a resource; each resource module builds its rows with `route`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from llmgw.web.asgi import HttpError, Receive, Send, send_json

__all__ = ["Handler", "HttpError", "Route", "expect", "read_json", "route", "send_error"]

# A handler is called with `body` (the parsed JSON, or None), `query` (the query string
# as a dict) and the path's named groups; it answers (status, JSON value). Bytes are JSON
# already rendered; a `_node_logs.Follow` is a stream, run after its first reply.
Handler = Callable[..., Awaitable[tuple[int, Any]]]
Route = tuple[str, re.Pattern[str], Handler]

_TEMPLATE = re.compile(r"^/api/v1(/([a-z0-9-]+|\{[a-z_]+\}))+$")


def route(method: str, template: str, handler: Handler) -> Route:
    """A row of the route table: `/api/v1/nodes/{node}` matches one path segment as `node`.

    The template is written as docs/api.md heads its section (tests/cp/test_api_docs.py
    turns the pattern back into it), so it holds no regular-expression syntax.
    """
    if not _TEMPLATE.match(template):
        raise ValueError(f"route {method} {template!r}: expected /api/v1/ and segments of "
                         "a-z 0-9 - or a {name}")  # fmt: skip
    pattern = re.sub(r"\{([a-z_]+)\}", r"(?P<\1>[^/]+)", template)
    return method, re.compile(f"^{pattern}$"), handler


def expect(body: Any, required: dict[str, type], optional: dict[str, type]) -> dict[str, Any]:
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


async def read_json(receive: Receive, limit: int = 1 << 20) -> Any:
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


async def send_error(send: Send, status: int, message: str) -> None:
    await send_json(send, status, {"error": {"message": message, "code": status}})
