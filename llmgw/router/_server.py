"""A lean HTTP/1.1 server for ASGI apps on trio, for the router's listener.

Why not hypercorn here: profiling the router at concurrency 64 (bench/router.py,
py-spy) put about 45% of its CPU time in hypercorn: a task and a memory
channel per request, an idle-timer task restarted per event, event objects
between its protocol layers, header validation and access-log calls. This
server does what the router's listener needs and nothing else (no TLS, HTTP/2,
WebSocket, lifespan or push): llhttp parses (llmgw/router/_http1.py: it is
outside input, and llhttp is strict where RFC 9112 says to be), responses are
written here, and the app is called in the connection's own task.

ASGI as the router uses it:
- One reader task per connection feeds the parser and notices the client
  leaving at any moment; the app is then cancelled (the scope carries the
  extension `llmgw.cancel_on_disconnect`, so the app needs no watcher task of
  its own). Bytes a client pipelines meanwhile are kept for the next request.
- `receive()` gives the request body (all the bytes that have arrived, in one
  message), then blocks until the client leaves and returns `http.disconnect`;
  after the response is complete it returns `http.disconnect` at once.
- `send()` holds `http.response.start` back until the first body message, so
  a small answer goes out in one write. A client that is gone makes `send`
  a no-op, as hypercorn does. HEAD gets the head only.
- An app that returns with its response incomplete gets its connection
  closed: the client sees a truncated message, never a complete-looking one.

Bounds on the client side (`llmgw.web.limits.ListenerLimits`): the head must
arrive within `head_timeout_s` of its first byte and fit in `max_head_bytes`;
the body within `body_timeout_s` of the head (a total bound, so a 1 byte/s body is cut
too: 408); every write must complete within `send_timeout_s` (a client that
stops reading is cut and the app cancelled, which frees its admission slot);
an idle keep-alive connection is closed after `keepalive_s`. A response sent
before the request body has been read (413, or any early answer) says
`connection: close`; the server then shuts its write side and reads and
discards the rest of the body (up to `discard_bytes`, within
`body_timeout_s`) before closing, so the client reads the answer instead of
a reset.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from email.utils import formatdate
from urllib.parse import unquote

import attrs
import trio

from llmgw.router._http1 import END, Failure, Head, RequestParser
from llmgw.web.asgi import App, Message, Scope
from llmgw.web.limits import ListenerLimits

log = logging.getLogger("llmgw.router.server")


READ_SIZE = 65536
MAX_PIPELINED = 1 << 20
_REASONS = {
    100: b"Continue", 200: b"OK", 204: b"No Content", 304: b"Not Modified",
    400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden",
    404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
    413: b"Content Too Large", 415: b"Unsupported Media Type",
    429: b"Too Many Requests", 431: b"Request Header Fields Too Large",
    499: b"Client Closed Request", 500: b"Internal Server Error", 501: b"Not Implemented",
    502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}  # fmt: skip
_STATUS_LINES: dict[int, bytes] = {}

EXTENSION = "llmgw.cancel_on_disconnect"


class _Date:
    """The Date header, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        t = int(time.time())
        if t != cls.second:
            cls.value = formatdate(t, usegmt=True).encode()
            cls.second = t
        return cls.value


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))
    return line


def _error_response(status: int, reason: str) -> bytes:
    body = f"{_REASONS.get(status, b'error').decode().lower()}: {reason}\n".encode()
    return (
        _status_line(status)
        + b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        + b"date: " + _Date.now() + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )  # fmt: skip


def _arrived(parser: RequestParser) -> bool:
    """The request's whole body is in the parser's events."""
    for event in parser.events:
        if event is END:
            return True
        if type(event) is not bytes:
            return False
    return False


class _Closed(Exception):
    pass


class _Reader:
    """The connection's one reader: feeds the parser, and notices the client leaving.

    A task per connection rather than per request: a per-request watcher task
    costs two extra scheduler passes at the end of every request (it must run
    once more to be cancelled, and the request's task waits for it), which
    under load showed as a second latency mode at twice the median.
    """

    def __init__(self, parser: RequestParser, stream: trio.SocketStream) -> None:
        self.parser = parser
        self.stream = stream
        self.gone = False
        self.gone_event = trio.Event()
        self.app_scope: trio.CancelScope | None = None
        self.discarding = False  # body bytes are dropped as they arrive
        self.discarded = 0
        self._arrived: trio.Event | None = None
        self._drained: trio.Event | None = None

    async def run(self) -> None:
        parser = self.parser
        try:
            while True:  # (after a refusal the parser drops what comes; EOF still counts)
                if parser.pending_body > MAX_PIPELINED or len(parser.events) > 64:
                    # The client races ahead: stop reading until the server catches up.
                    self._drained = trio.Event()
                    await self._drained.wait()
                    continue
                try:
                    data = await self.stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    data = b""
                if not data:
                    break
                parser.feed(data)
                if self.discarding:
                    self._discard()
                self._wake()
        finally:
            self.gone = True
            self.gone_event.set()
            if self.app_scope is not None:
                self.app_scope.cancel()
            self._wake()

    def _discard(self) -> None:
        events = self.parser.events
        while events and type(events[0]) is bytes:
            n = len(events.popleft())  # type: ignore[arg-type]
            self.parser.pending_body -= n
            self.discarded += n

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def drained(self) -> None:
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    async def more(self) -> None:
        """Wait until more has been parsed; _Closed when the client has gone."""
        if self.gone:
            raise _Closed()
        self._arrived = event = trio.Event()
        await event.wait()


class _Exchange:
    """One request/response on a connection: the app's receive and send."""

    __slots__ = (
        "body_deadline",
        "body_done",
        "chunked",
        "close",
        "head",
        "is_head",
        "limits",
        "reader",
        "refusal",
        "request",
        "response_done",
        "started",
        "stream",
        "to_send",
        "write_failed",
    )

    def __init__(
        self, request: Head, stream: trio.SocketStream, reader: _Reader, limits: ListenerLimits
    ) -> None:
        self.request = request
        self.stream = stream
        self.reader = reader
        self.limits = limits
        self.body_deadline = trio.current_time() + limits.body_timeout_s
        self.is_head = request.method == "HEAD"
        self.close = not request.keep_alive or request.last
        self.head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.started = False
        self.chunked = False
        self.to_send: int | None = None  # body bytes still due under a content-length
        self.body_done = False
        self.response_done = False
        self.write_failed = False
        # Why the request could not be read (408 too slow, 400 a bad chunk): the app
        # saw the client leave; the server answers this if nothing was sent yet.
        self.refusal: Failure | None = None

    @property
    def gone(self) -> bool:
        return self.reader.gone or self.write_failed

    async def receive(self) -> Message:
        if self.response_done:
            return {"type": "http.disconnect"}
        if not self.body_done:
            if self.request.expect_continue and not self.started:
                self.request = attrs.evolve(self.request, expect_continue=False)
                await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
            parser = self.reader.parser
            events = parser.events
            parts: list[bytes] = []
            try:
                with trio.fail_at(self.body_deadline):
                    while True:
                        if events:
                            event = events[0]
                            if type(event) is bytes:
                                events.popleft()
                                parts.append(event)
                                parser.pending_body -= len(event)
                                continue
                            if event is END:
                                events.popleft()
                                self.body_done = True
                                break
                            assert type(event) is Failure  # mid-body: the server answers
                            self.refusal = event
                            return {"type": "http.disconnect"}
                        if parts:
                            break
                        await self.reader.more()
            except _Closed:
                self.write_failed = True  # the request cannot be read: treat as gone
                return {"type": "http.disconnect"}
            except trio.TooSlowError:
                self.refusal = Failure(
                    408,
                    f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                    "(body_timeout_s)",
                )
                return {"type": "http.disconnect"}
            finally:
                self.reader.drained()
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            return {"type": "http.request", "body": body, "more_body": not self.body_done}
        await self.reader.gone_event.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.gone or self.response_done or self.refusal is not None:
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
        data = b""
        if not self.started:
            self.started = True
            data = self._head_bytes()
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if body and not self.is_head:
            if self.chunked:
                data += b"%x\r\n%b\r\n" % (len(body), body)
            else:
                if self.to_send is not None:
                    if len(body) > self.to_send:
                        raise RuntimeError(
                            f"the app sent {len(body) - self.to_send} bytes beyond its "
                            "content-length"
                        )
                    self.to_send -= len(body)
                data += body
        if not more:
            if self.chunked and not self.is_head:
                data += b"0\r\n\r\n"
            if self.to_send or (self.to_send is None and not self.chunked):
                self.close = True  # short of its content-length, or close-delimited
            self.response_done = True
        if data:
            await self._write(data)

    def _head_bytes(self) -> bytes:
        assert self.head is not None
        status, headers = self.head
        if not self.body_done and not self.close and not _arrived(self.reader.parser):
            # Answered before the body has arrived: close after discarding the rest.
            self.close = True
        lines = [_status_line(status)]
        length: int | None = None
        for name, value in headers:
            if name == b"content-length":
                length = int(value)
            lines.append(b"%b: %b\r\n" % (name, value))
        bodyless = status < 200 or status in (204, 304)
        if bodyless:
            self.to_send = 0
        elif length is not None:
            self.to_send = 0 if self.is_head else length
        elif self.request.http_version == "1.1":
            self.chunked = True
            if not self.is_head:
                lines.append(b"transfer-encoding: chunked\r\n")
        else:
            self.close = True  # HTTP/1.0 without a length: the close ends the body
        lines.append(b"date: " + _Date.now() + b"\r\n")
        if self.close:
            lines.append(b"connection: close\r\n")
        elif self.request.http_version == "1.0":
            lines.append(b"connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _write(self, data: bytes) -> None:
        with trio.move_on_after(self.limits.send_timeout_s) as timer:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.write_failed = True
        if timer.cancelled_caught:
            # The client stopped reading: give up on it, and stop the app (its admission
            # slot and upstream connection go back now, not when the engine finishes).
            log.info(
                "client stopped reading for %g s (send_timeout_s); closing",
                self.limits.send_timeout_s,
            )
            self.write_failed = True
            if self.reader.app_scope is not None:
                self.reader.app_scope.cancel()


async def serve(
    app: App,
    host: str,
    port: int,
    *,
    limits: ListenerLimits | None = None,
    backlog: int = 4096,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; `task_status.started(port)`.

    `reuse_port`: bind with SO_REUSEPORT, beside other processes on the same
    address (router workers); the kernel spreads new connections between them.
    """
    lim = limits or ListenerLimits()
    if reuse_port:
        listeners = await reuse_port_listeners(host, port, backlog)
    else:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    bound = int(listeners[0].socket.getsockname()[1])
    server = (host, bound)

    async def handler(stream: trio.SocketStream) -> None:
        await _connection(app, stream, server, lim)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(bound)


async def reuse_port_listeners(host: str, port: int, backlog: int) -> list[trio.SocketListener]:
    """Listening sockets on each address of host:port, bound with SO_REUSEPORT."""
    infos = await trio.socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners = []
    try:
        for family, type_, proto, _, addr in infos:
            sock = trio.socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(addr)
                sock.listen(backlog)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners


async def _connection(
    app: App, stream: trio.SocketStream, server: tuple[str, int], limits: ListenerLimits
) -> None:
    parser = RequestParser(limits.max_head_bytes)
    try:
        peer = stream.socket.getpeername()
        client = (str(peer[0]), int(peer[1]))
    except OSError:
        client = None
    reader = _Reader(parser, stream)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await _requests(app, parser, stream, reader, client, server, limits)
            nursery.cancel_scope.cancel()
    finally:
        stream.socket.close()


async def _requests(
    app: App,
    parser: RequestParser,
    stream: trio.SocketStream,
    reader: _Reader,
    client: tuple[str, int] | None,
    server: tuple[str, int],
    limits: ListenerLimits,
) -> None:
    events = parser.events
    try:
        while True:
            head = await _next_head(parser, reader, limits)
            if type(head) is Failure:
                await _refuse(stream, head.status, head.reason)
                return
            if head is None:
                return
            assert type(head) is Head
            target = head.target
            path, _, query = target.partition(b"?")
            scope: Scope = {
                "type": "http",
                "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": head.http_version,
                "method": head.method,
                "scheme": "http",
                "path": unquote(path.decode("latin-1")),
                "raw_path": path,
                "query_string": query,
                "root_path": "",
                "headers": head.headers,
                "client": client,
                "server": server,
                # The app need not watch for the client leaving: this server cancels it.
                "extensions": {EXTENSION: {}},
            }
            ex = _Exchange(head, stream, reader, limits)
            with trio.CancelScope() as reader.app_scope:
                if reader.gone:
                    reader.app_scope.cancel()
                try:
                    await app(scope, ex.receive, ex.send)
                except Exception:
                    log.exception("the app failed on %s %s", scope["method"], scope["path"])
                    if not ex.started and not ex.gone and ex.refusal is None:
                        ex.head = (500, [(b"content-type", b"text/plain")])
                        await ex.send({"type": "http.response.body", "body": b"internal error\n"})
            reader.app_scope = None
            if ex.refusal is not None:
                if not ex.started and not ex.gone:
                    await _refuse(stream, ex.refusal.status, ex.refusal.reason)
                return
            if ex.gone or not ex.response_done:
                return  # an incomplete response must not look complete: close
            if not ex.body_done:
                # Answered before the body was read (a GET that ignored an empty body
                # has none left; a refused upload has).
                while events and type(events[0]) is bytes:
                    parser.pending_body -= len(events.popleft())  # type: ignore[arg-type]
                if events and events[0] is END:
                    events.popleft()
                    ex.body_done = True
            if ex.close or not ex.body_done:
                if not ex.body_done and not ex.gone:
                    await _discard_rest(stream, parser, reader, ex.body_deadline, limits)
                return
            reader.drained()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


async def _refuse(stream: trio.SocketStream, status: int, reason: str) -> None:
    """Answer a request that cannot be served, then the caller closes."""
    with (
        trio.move_on_after(1),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
    ):
        await stream.send_all(_error_response(status, reason))
        with contextlib.suppress(OSError):
            stream.socket.shutdown(socket.SHUT_WR)


async def _discard_rest(
    stream: trio.SocketStream,
    parser: RequestParser,
    reader: _Reader,
    deadline: float,
    limits: ListenerLimits,
) -> None:
    """After an early answer: end our side, then drop the body until it ends or a bound.

    Closing with unread bytes would make the kernel reset the connection, and a
    reset can destroy the answer before the client has read it.
    """
    with contextlib.suppress(OSError):
        stream.socket.shutdown(socket.SHUT_WR)
    reader.discarding = True
    reader.discarded = 0
    reader._discard()
    reader.drained()
    events = parser.events
    with trio.move_on_at(max(deadline, trio.current_time() + 1.0)):
        while reader.discarded <= limits.discard_bytes:
            if events and (events[0] is END or type(events[0]) is Failure):
                return
            try:
                await reader.more()
            except _Closed:
                return


async def _next_head(
    parser: RequestParser, reader: _Reader, limits: ListenerLimits
) -> Head | Failure | None:
    """The next request head; None when the client closes, idles out, or is too slow."""
    events = parser.events
    deadline = trio.current_time() + limits.keepalive_s
    started = False
    while True:
        if events:
            event = events.popleft()
            if type(event) is Head or type(event) is Failure:
                return event
            continue  # (cannot happen: bodies are consumed with their request)
        if not started and parser.in_message:
            started = True
            deadline = trio.current_time() + limits.head_timeout_s
        with trio.move_on_at(deadline) as idle:
            try:
                await reader.more()
            except _Closed:
                return None
        if idle.cancelled_caught:
            if started:
                return Failure(
                    408,
                    f"the request head did not arrive within {limits.head_timeout_s:g} s "
                    "(head_timeout_s)",
                )
            return None
