"""A lean HTTP/1.1 server for ASGI apps on trio, for the router's listener.

Why not hypercorn here: profiling the router at concurrency 64 (bench/router.py,
py-spy) put about 45% of its CPU time in hypercorn: a task and a memory
channel per request, an idle-timer task restarted per event, event objects
between its protocol layers, header validation and access-log calls. This
server does what the router's listener needs and nothing else (no TLS, HTTP/2,
WebSocket, lifespan or push): h11 parses (it is outside input), and the app is
called in the connection's own task.

ASGI as the router uses it:
- One reader task per connection feeds h11 and notices the client leaving at
  any moment; the app is then cancelled (the scope carries the extension
  `llmgw.cancel_on_disconnect`, so the app needs no watcher task of its own).
  Bytes a client pipelines meanwhile are kept for the next request.
- `receive()` gives the request body (all the bytes that have arrived, in one
  message), then blocks until the client leaves and returns `http.disconnect`;
  after the response is complete it returns `http.disconnect` at once.
- `send()` holds `http.response.start` back until the first body message, so
  a small answer goes out in one write. A client that is gone makes `send`
  a no-op, as hypercorn does.
- An app that returns with its response incomplete gets its connection
  closed: the client sees a truncated message, never a complete-looking one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote

import h11
import trio

log = logging.getLogger("llmgw.router.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

READ_SIZE = 65536
MAX_PIPELINED = 1 << 20
_REASONS = {
    200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden",
    404: b"Not Found", 405: b"Method Not Allowed", 413: b"Content Too Large",
    429: b"Too Many Requests", 431: b"Request Header Fields Too Large",
    499: b"Client Closed Request", 500: b"Internal Server Error", 502: b"Bad Gateway",
    503: b"Service Unavailable", 504: b"Gateway Timeout",
}  # fmt: skip


EXTENSION = "llmgw.cancel_on_disconnect"


class _Closed(Exception):
    pass


class _Reader:
    """The connection's one reader: feeds h11, and notices the client leaving at any time.

    A task per connection rather than per request: a per-request watcher task
    costs two extra scheduler passes at the end of every request (it must run
    once more to be cancelled, and the request's task waits for it), which
    under load showed as a second latency mode at twice the median.
    """

    def __init__(self, conn: h11.Connection, stream: trio.SocketStream) -> None:
        self.conn = conn
        self.stream = stream
        self.gone = False
        self.gone_event = trio.Event()
        self.app_scope: trio.CancelScope | None = None
        self._arrived: trio.Event | None = None
        self._drained: trio.Event | None = None

    async def run(self) -> None:
        try:
            while True:
                trailing = self.conn.trailing_data[0]
                if len(trailing) > MAX_PIPELINED:  # the client races ahead: stop reading
                    self._drained = trio.Event()
                    await self._drained.wait()
                    continue
                try:
                    data = await self.stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    data = b""
                if not data:
                    break
                self.conn.receive_data(data)
                self._wake()
        finally:
            self.gone = True
            with contextlib.suppress(RuntimeError):
                self.conn.receive_data(b"")  # EOF: h11 ends what it has, then ConnectionClosed
            self.gone_event.set()
            if self.app_scope is not None:
                self.app_scope.cancel()
            self._wake()

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def drained(self) -> None:
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    async def more(self) -> None:
        """Wait until more bytes have arrived; _Closed when the client has gone."""
        if self.gone:
            raise _Closed()
        self._arrived = event = trio.Event()
        await event.wait()


class _Exchange:
    """One request/response on a connection: the app's receive and send."""

    __slots__ = (
        "body_done",
        "conn",
        "head",
        "reader",
        "response_done",
        "started",
        "stream",
        "timeout",
        "write_failed",
    )

    def __init__(
        self, conn: h11.Connection, stream: trio.SocketStream, reader: _Reader, timeout: float
    ) -> None:
        self.conn = conn
        self.stream = stream
        self.reader = reader
        self.timeout = timeout
        self.head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.started = False
        self.body_done = False
        self.response_done = False
        self.write_failed = False

    @property
    def gone(self) -> bool:
        return self.reader.gone or self.write_failed

    async def receive(self) -> Message:
        if self.response_done:
            return {"type": "http.disconnect"}
        if not self.body_done:
            if self.conn.they_are_waiting_for_100_continue and not self.started:
                await self._write(
                    self.conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                )
            parts: list[bytes] = []
            try:
                with trio.fail_after(self.timeout):
                    while True:
                        event = self.conn.next_event()
                        if type(event) is h11.Data:
                            parts.append(event.data)
                        elif type(event) is h11.EndOfMessage:
                            self.body_done = True
                            break
                        elif event is h11.NEED_DATA:
                            if parts:
                                break
                            await self.reader.more()
                        else:
                            return {"type": "http.disconnect"}
            except (_Closed, trio.TooSlowError, h11.RemoteProtocolError):
                self.write_failed = True  # the request cannot be read: treat as gone
                return {"type": "http.disconnect"}
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            return {"type": "http.request", "body": body, "more_body": not self.body_done}
        await self.reader.gone_event.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.gone or self.response_done:
            return
        kind = message["type"]
        if kind == "http.response.start":
            if self.head is not None:
                raise RuntimeError("http.response.start sent twice")
            self.head = (int(message["status"]), list(message.get("headers", ())))
            return
        if kind != "http.response.body":
            return
        if self.head is None:
            raise RuntimeError("http.response.body before http.response.start")
        conn = self.conn
        data = b""
        if not self.started:
            self.started = True
            status, headers = self.head
            data = conn.send(
                h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))
            )
        body = message.get("body", b"")
        if body:
            data += conn.send(h11.Data(data=body))
        if not message.get("more_body", False):
            data += conn.send(h11.EndOfMessage())
            self.response_done = True
        if data:
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.write_failed = True


async def serve(
    app: App,
    host: str,
    port: int,
    *,
    keepalive_s: float = 75.0,
    request_timeout_s: float = 60.0,
    backlog: int = 4096,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; `task_status.started(port)`."""
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    bound = int(listeners[0].socket.getsockname()[1])
    server = (host, bound)

    async def handler(stream: trio.SocketStream) -> None:
        await _connection(app, stream, server, keepalive_s, request_timeout_s)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(bound)


async def _connection(
    app: App,
    stream: trio.SocketStream,
    server: tuple[str, int],
    keepalive_s: float,
    request_timeout_s: float,
) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        peer = stream.socket.getpeername()
        client = (str(peer[0]), int(peer[1]))
    except OSError:
        client = None
    reader = _Reader(conn, stream)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await _requests(app, conn, stream, reader, client, server, keepalive_s,
                            request_timeout_s)  # fmt: skip
            nursery.cancel_scope.cancel()
    finally:
        stream.socket.close()


async def _requests(
    app: App,
    conn: h11.Connection,
    stream: trio.SocketStream,
    reader: _Reader,
    client: tuple[str, int] | None,
    server: tuple[str, int],
    keepalive_s: float,
    request_timeout_s: float,
) -> None:
    try:
        while True:
            event = await _next_head(conn, reader, keepalive_s, request_timeout_s)
            if event is None:
                return
            target = bytes(event.target)
            path, _, query = target.partition(b"?")
            scope: Scope = {
                "type": "http",
                "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": event.http_version.decode(),
                "method": event.method.decode("ascii"),
                "scheme": "http",
                "path": unquote(path.decode("latin-1")),
                "raw_path": path,
                "query_string": query,
                "root_path": "",
                "headers": list(event.headers),
                "client": client,
                "server": server,
                # The app need not watch for the client leaving: this server cancels it.
                "extensions": {EXTENSION: {}},
            }
            ex = _Exchange(conn, stream, reader, request_timeout_s)
            with trio.CancelScope() as reader.app_scope:
                if reader.gone:
                    reader.app_scope.cancel()
                try:
                    await app(scope, ex.receive, ex.send)
                except Exception:
                    log.exception("the app failed on %s %s", scope["method"], scope["path"])
                    if not ex.started and not ex.gone:
                        ex.head = (500, [(b"content-type", b"text/plain")])
                        await ex.send({"type": "http.response.body", "body": b"internal error\n"})
            reader.app_scope = None
            if ex.gone or not ex.response_done:
                return  # an incomplete response must not look complete: close
            while conn.their_state is h11.SEND_BODY:
                # The app did not read the body (a GET has an empty one): take what has
                # arrived; a body still on its way (a refused upload) closes instead.
                if type(conn.next_event()) not in (h11.Data, h11.EndOfMessage):
                    break
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
            reader.drained()
    except h11.RemoteProtocolError as exc:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with trio.move_on_after(1):
                body = f"bad request: {exc}\n".encode()
                resp = h11.Response(
                    status_code=exc.error_status_hint,
                    headers=[(b"content-type", b"text/plain"), (b"connection", b"close"),
                             (b"content-length", b"%d" % len(body))],
                )  # fmt: skip
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, OSError
                ):
                    await stream.send_all(conn.send(resp) + conn.send(h11.Data(data=body)))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


async def _next_head(
    conn: h11.Connection, reader: _Reader, keepalive_s: float, timeout_s: float
) -> h11.Request | None:
    """The next request head; None when the client closes, idles out, or is too slow."""
    deadline = trio.current_time() + keepalive_s
    started = False
    while True:
        event = conn.next_event()
        if type(event) is h11.Request:
            return event
        if event is not h11.NEED_DATA:
            return None  # ConnectionClosed, or PAUSED (cannot happen here)
        with trio.move_on_at(deadline) as idle:
            try:
                await reader.more()
            except _Closed:
                return None
        if idle.cancelled_caught:
            return None
        if not started and conn.trailing_data[0]:
            started = True
            deadline = trio.current_time() + timeout_s
