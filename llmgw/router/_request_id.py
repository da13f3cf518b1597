"""A request id on every response and in the router's log lines for that request.

Every response carries `x-llmgw-request-id` (the router's own id) and
`x-request-id`: the engine's when it sent one, else the router's own. The id is
`<process prefix>-<counter>`: unique per process without a random draw per
request. Log records emitted while a request is handled (the same trio task)
end with `[request <id>]`: a contextvar set by the router's app, read by a
logging filter on the router's loggers.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os

from llmgw.web.asgi import Message, Send

HEADER = b"x-request-id"
OWN_HEADER = b"x-llmgw-request-id"

CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llmgw_request_id", default=None
)
_PREFIX = os.urandom(4).hex()
_COUNTER = itertools.count(1)


def new() -> str:
    return f"{_PREFIX}-{next(_COUNTER)}"


def tagged(send: Send, request_id: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> Send:
    """`send`, with the request id headers (and `extra`) added to the response head."""
    own = request_id.encode()

    async def send_tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            for name, _ in headers:
                if name == HEADER:
                    break
            else:
                headers.append((HEADER, own))
            headers.append((OWN_HEADER, own))
            headers.extend(extra)
            message["headers"] = headers
        await send(message)

    return send_tagged


class LogFilter(logging.Filter):
    """Appends `[request <id>]` to records emitted while a request is being handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = CURRENT.get()
        if rid is not None and not getattr(record, "request_id", None):
            record.request_id = rid
            record.msg = f"{record.getMessage()} [request {rid}]"
            record.args = None
        return True


def install(*loggers: str) -> None:
    """Add the filter to these loggers (once each)."""
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(f, LogFilter) for f in logger.filters):
            logger.addFilter(LogFilter())


install("llmgw.router", "llmgw.router.server", "llmgw.router.upstream")
