"""The router on hypercorn: its settings, and a guard for what h11 under it does not refuse.

hypercorn parses with h11, which frames a request carrying both Content-Length
and Transfer-Encoding by the chunked coding and keeps the connection open
(request smuggling behind a proxy that frames by Content-Length), and which
has no bound on a slow body. `guard(app, limits)` closes those gaps from
inside the ASGI app, as far as the ASGI interface lets it:

- Content-Length with Transfer-Encoding: 400 with `connection: close` (h11 then
  closes after the response, so nothing that follows is served).
- The body must arrive within `body_timeout_s` of the head: 408, closed.
- HEAD: the body the app sends is dropped (h11 would refuse it and close).
- An answer given before the body has been read (413): the rest of the body is
  read and discarded (bounded) before the answer's last bytes are sent, since
  hypercorn closes as soon as the response is complete, and closing on unread
  bytes resets the connection, which can destroy the answer.

What h11 accepts and the ASGI app cannot see stays accepted on this listener
(docs/architecture.md lists it): obs-fold (h11 unfolds it), bare LF line ends,
a duplicated identical Content-Length (h11 merges it); and h11's head-size
limit (`h11_max_incomplete_size`) applies to the buffered part of a head, so
whether a large head passes depends on how TCP splits it. Nor can it bound a
client that stops reading (hypercorn shields its socket writes from
cancellation), or close a slow head at `head_timeout_s` (its `read_timeout`
stops reading, but the connection closes only when its keep-alive timer
ends). The lean listener does all of these.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import hypercorn.config
import trio

from llmgw.router._server import Limits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def config(bind: str, limits: Limits) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    hc.bind = [bind]
    hc.accesslog = None
    hc.graceful_timeout = 1.0
    hc.keep_alive_timeout = limits.keepalive_s
    # hypercorn closes a connection after 1,000 requests by default: a needless reconnect
    # (and a lost request for clients that pipeline) at thousands of requests per second.
    hc.keep_alive_max_requests = 1_000_000
    hc.h11_max_incomplete_size = limits.max_head_bytes
    # Per read, not per head: a slow head is bounded by this per read only.
    hc.read_timeout = max(1, int(limits.head_timeout_s))
    return hc


async def _plain(send: Send, status: int, text: str) -> None:
    body = (text + "\n").encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", b"%d" % len(body)),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def guard(app: App, limits: Limits) -> App:
    """`app` behind the checks above (for the hypercorn listener only)."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        cl = te = False
        length = b""
        for name, value in scope["headers"]:
            if name == b"content-length":
                cl = True
                length = value.strip()
            elif name == b"transfer-encoding":
                te = True
        if cl and te:
            await _plain(
                send, 400,
                "bad request: Content-Length and Transfer-Encoding together (RFC 9112 §6.1)",
            )  # fmt: skip
            return
        is_head = scope["method"] == "HEAD"  # h11 refuses a body on a HEAD response
        deadline = trio.current_time() + limits.body_timeout_s
        body_done = not te and (not cl or length == b"0")  # no body is coming
        too_slow = False
        started = False
        early = False

        async def bounded_receive() -> Message:
            nonlocal body_done, too_slow
            if body_done or too_slow:
                return await receive()
            with trio.move_on_at(deadline) as timer:
                message = await receive()
            if timer.cancelled_caught:
                too_slow = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def drain() -> None:
            nonlocal body_done
            seen = 0
            with trio.move_on_at(max(deadline, trio.current_time() + 1.0)):
                while not body_done and seen <= limits.discard_bytes:
                    message = await receive()
                    seen += len(message.get("body", b""))
                    if message["type"] != "http.request" or not message.get("more_body"):
                        body_done = True

        async def bounded_send(message: Message) -> None:
            nonlocal started, early
            if too_slow:
                return
            if message["type"] == "http.response.start":
                started = True
                if not body_done:
                    early = True
                    message["headers"] = [*message.get("headers", ()), (b"connection", b"close")]
            elif message["type"] == "http.response.body":
                if is_head and message.get("body"):
                    message = {**message, "body": b""}
                if early and not message.get("more_body", False):
                    await drain()
            await send(message)

        await app(scope, bounded_receive, bounded_send)
        if too_slow and not started:
            await _plain(
                send, 408,
                f"request timeout: the request body did not arrive within "
                f"{limits.body_timeout_s:g} s (body_timeout_s)",
            )  # fmt: skip

    return guarded
