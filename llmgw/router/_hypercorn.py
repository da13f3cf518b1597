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
whether a large head passes depends on how TCP splits it. Nor can it close a
slow head at `head_timeout_s` (hypercorn's `read_timeout` bounds each read,
not the head; a read that waits that long closes the connection, without a
408). The lean listener does all of these.

`serve(app, config)` is `hypercorn.trio.serve` for every llmgw listener on
hypercorn (the router in hypercorn mode, the control plane's admin API and
pages), with hypercorn's connection (`TCPServer`) subclassed for four faults
of hypercorn 0.18 that no config setting reaches:

- A connection's socket is closed only when all its tasks have ended, and its
  keep-alive timer is one of them: the reader sees the client's EOF (or a
  reset, or `read_timeout`) and returns, but the timer runs on for
  `keep_alive_timeout`. Measured: 1,000 idle connections that closed left
  1,010 fds in the serving process 10 s later (75 s keep-alive; its baseline
  is 10), each socket in CLOSE_WAIT with its protocol objects. `_Connection`
  stops the timer once the reader has ended (and keeps it stopped), so the
  socket closes as soon as no request is in flight.
- When a peer's protocol error closes a connection (bytes pipelined behind an
  answer that said `connection: close`, a malformed head after a request),
  hypercorn half-closes the socket without its send lock, while the answer
  may be being written: the two meet and the app's send raises
  `trio.BusyResourceError`, logged with its traceback ("Error in ASGI
  Framework"). `_Connection._close` lets the write in flight finish first
  (bounded; then the socket is closed under it). The answer itself may still
  be cut after its head: h11 has failed the connection, and hypercorn drops
  what is sent after that.
- hypercorn's writes have no time bound, and are shielded from cancellation
  (so a cancelled app cannot leave half a frame): a client that stops reading
  held its request, and the router's admission slot, for as long as it liked.
  `_Connection._send` keeps the shield and gives it a deadline,
  `send_timeout_s` (the router's `idle_timeout_s`; 60 s elsewhere): then the
  connection is closed and the app hears the client has gone.
- hypercorn upper-cases the method before the app sees it (`post` reaches the
  app as `POST`). `_Connection` gives its HTTP/1.1 protocol an h11 connection
  that refuses a method with a lowercase letter as h11 refuses a malformed
  request: 400, closed (as llhttp does on the lean listener; RFC 9110 §9.1:
  methods are case-sensitive, and no method llmgw serves is lowercase).

A transfer coding other than chunked (`gzip, chunked`) needs nothing here:
h11 refuses every one with 501 before the app is called (and a chunked that is
not the final coding with 501 too, where the lean listener says 400 as RFC 9112
§6.3 asks).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import h11
import hypercorn.config
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.events import Event as HypercornEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr, wrap_app

from llmgw.router._http1 import BAD_METHOD
from llmgw.web.asgi import App, Message, Receive, Scope, Send
from llmgw.web.limits import ListenerLimits

log = logging.getLogger("llmgw.router.hypercorn")


def config(bind: str, limits: ListenerLimits) -> hypercorn.config.Config:
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


def guard(app: App, limits: ListenerLimits) -> App:
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


# --- serving: hypercorn's trio worker, with its connection fixed ---------------------------


# How long a close waits for a response write in flight (hypercorn shields its writes,
# so one to a client that stopped reading may never end by itself).
_CLOSE_WAIT_S = 5.0


class _CaseSensitiveMethods(h11.Connection):
    """h11's server side, refusing a method with a lowercase letter (hypercorn would
    upper-case it on the way to the app)."""

    def next_event(self) -> Any:
        event = super().next_event()
        if type(event) is h11.Request and event.method != event.method.upper():
            # Raised as h11 raises on a malformed head: hypercorn answers 400 and closes.
            raise h11.RemoteProtocolError(BAD_METHOD, error_status_hint=400)
        return event


class _Connection(TCPServer):
    """hypercorn's connection, closed once its client has gone (the module says why)."""

    _reader_done = False

    def __init__(self, *args: Any, send_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send_timeout_s = send_timeout_s

    async def _read_data(self) -> None:
        protocol = self.protocol.protocol
        if isinstance(protocol, H11Protocol):  # not h2, chosen by ALPN under TLS
            # Nothing has been read yet: the fresh h11 connection is swapped whole.
            protocol.connection = _CaseSensitiveMethods(
                h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
            )
        await super()._read_data()
        # The client has gone (EOF, reset) or `read_timeout` ended reading: nothing will
        # be read on this connection again, so its keep-alive timer holds only the socket.
        self._reader_done = True
        await self.idle_task.stop()

    async def _send(self, data: bytes) -> None:
        """hypercorn's write (shielded: a cancelled app must not leave half a frame), bounded
        by `send_timeout_s`: a client that stops reading is then closed, and the app hears
        it has gone (the router cancels the request and frees its admission slot)."""
        async with self.send_lock:
            deadline = trio.current_time() + self.send_timeout_s
            with trio.CancelScope(shield=True, deadline=deadline) as write:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.protocol.handle(Closed())
                    return
            if write.cancelled_caught:
                log.info(
                    "client stopped reading for %g s (send_timeout_s); closing",
                    self.send_timeout_s,
                )
                await self.stream.aclose()
                await self.protocol.handle(Closed())

    async def _close(self) -> None:
        if self.send_lock.statistics().owner is trio.lowlevel.current_task():
            await super()._close()
            return
        # hypercorn half-closes (send_eof) without its send lock: when the peer's protocol
        # error closes the connection while a response is being written, that write and
        # the send_eof meet, and the app's send raises BusyResourceError (a traceback,
        # "Error in ASGI Framework", per connection). The write is let finish first, for
        # a bounded time: then closing the socket ends it (ClosedResourceError, which
        # hypercorn takes as the client gone).
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_CLOSE_WAIT_S):
                async with self.send_lock:
                    await super()._close()
                    return
            await self.stream.aclose()

    async def protocol_send(self, event: HypercornEvent) -> None:
        if isinstance(event, RawData):
            await self._send(event.data)
            return
        if isinstance(event, Updated) and event.idle and self._reader_done:
            # A response completed after the reader ended: no next request can come.
            await self.idle_task.stop()
            return
        await super().protocol_send(event)


async def serve(
    app: Any,
    config: hypercorn.config.Config,
    *,
    send_timeout_s: float = 60.0,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI `app` as `hypercorn.trio.serve(app, config)` does, until cancelled;
    `task_status.started(binds)` with the bound addresses ("http://127.0.0.1:8081").
    Every write to a client must complete within `send_timeout_s` (hypercorn has no
    such bound) or the connection is closed.

    hypercorn 0.18's `worker_serve` with `_Connection` for its `TCPServer`, and without
    what llmgw does not use (QUIC, statsd, `max_requests`, a shutdown trigger).
    """
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            ssl_context = config.create_ssl_context()
            listeners: list[trio.SSLListener[trio.SocketStream] | trio.SocketListener] = []
            binds = []
            for sock in sockets.secure_sockets:
                assert ssl_context is not None  # (secure sockets only come with a context)
                sock.listen(config.backlog)
                listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                listeners.append(trio.SSLListener(listener, ssl_context, https_compatible=True))
                binds.append(f"https://{repr_socket_addr(sock.family, sock.getsockname())}")
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            for sock in sockets.quic_sockets:
                sock.close()  # (only with quic_bind set, which llmgw never sets)
            handler = partial(
                _Connection,
                wrapped,
                config,
                context,
                ConnectionState(state.copy()),
                send_timeout_s=send_timeout_s,
            )
            task_status.started(binds)
            try:
                await trio.serve_listeners(handler, listeners, handler_nursery=server_nursery)
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
