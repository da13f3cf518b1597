"""A lean HTTP/1.1 client for talking to engines: trio sockets, h11, a keep-alive pool.

Why not httpx: on this machine httpx costs 1-2 ms of CPU per request, which
is the router's whole budget; this client does what the router needs and no
more (no TLS, no redirects, no cookies, no HTTP/2). What it shares with the
agent's fetcher is in `llmgw.web.h1`; why its reading stays here (the body
read is per chunk of every streamed answer) is said there.

Three timeouts, each at the edge it guards: `connect_s` (the TCP handshake),
`first_byte_s` (request sent -> response head), `idle_s` (between body
reads; a replica that hangs mid-stream must not hold a slot forever).

A response that is not read to its end, or is abandoned because its caller
was cancelled (the client went away), closes its connection: the engine sees
the socket close and cancels the request. Only a connection whose exchange
finished cleanly goes back to the pool.
"""

from __future__ import annotations

import logging
import select
import time
from collections import deque
from collections.abc import Sequence

import attrs
import h11
import trio

from llmgw.errors import PeerError
from llmgw.web.h1 import header

log = logging.getLogger("llmgw.router.upstream")

READ_SIZE = 65536


@attrs.frozen
class Timeouts:
    connect_s: float = 5.0
    first_byte_s: float = 300.0
    idle_s: float = 60.0


class UpstreamError(PeerError):
    """A request to an engine failed; `phase` says where, `endpoint` which one.

    `before_response` is True when nothing of a response arrived, so the
    request may be sent to another endpoint.
    """

    phase = "upstream"

    def __init__(self, endpoint: str, message: str, *, before_response: bool) -> None:
        super().__init__(f"{endpoint}: {message}")
        self.endpoint = endpoint
        self.before_response = before_response


class ConnectFailed(UpstreamError):
    phase = "connect"


class UpstreamTimeout(UpstreamError):
    def __init__(self, endpoint: str, message: str, *, phase: str, before_response: bool) -> None:
        super().__init__(endpoint, message, before_response=before_response)
        self.phase = phase


class UpstreamBroken(UpstreamError):
    """The engine closed the connection, or spoke something that is not HTTP/1.1."""

    phase = "protocol"


class BodyBroken(UpstreamBroken):
    """The connection closed, or stopped being HTTP, after the response head."""

    phase = "mid_body"


class _Conn:
    __slots__ = ("h11", "idle_since", "reused", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.reused = False

    def close(self) -> None:
        # Synchronous on purpose: it runs in `finally` blocks of cancelled tasks.
        self.stream.socket.close()

    def looks_closed(self) -> bool:
        """An idle keep-alive socket that is readable has been closed (or spoke out of turn)."""
        try:
            readable, _, _ = select.select([self.stream.socket.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)


class Response:
    """A response head and the means to read its body, chunk by chunk as it arrives."""

    __slots__ = ("_conn", "_done", "_idle_s", "_pool", "headers", "last_byte_at", "status")

    def __init__(
        self,
        pool: Pool,
        conn: _Conn,
        status: int,
        headers: list[tuple[bytes, bytes]],
        idle_s: float,
    ) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self._done = False
        self._idle_s = idle_s
        self.status = status
        self.headers = headers
        # The trio clock at the newest read from the engine (the head's, then each body
        # read's): what the wedge watch (llmgw/router/_wedge.py) reads.
        self.last_byte_at = trio.current_time()

    def __repr__(self) -> str:
        return f"<Response {self.status} from {self._pool.name} done={self._done}>"

    @property
    def done(self) -> bool:
        """The whole body has been read."""
        return self._done

    def header(self, name: bytes) -> bytes | None:
        return header(self.headers, name)

    async def next_chunk(self) -> bytes | None:
        """The body bytes that have arrived (at least one), or None at the end of the body.

        Raises UpstreamTimeout (phase "idle") when nothing arrives for `idle_s`,
        UpstreamBroken when the engine closes the connection mid-body.
        """
        conn = self._conn
        if conn is None or self._done:
            return None
        parts: list[bytes] = []
        while True:
            try:
                event = conn.h11.next_event()
            except h11.RemoteProtocolError as exc:
                self.close()
                raise BodyBroken(
                    self._pool.name, f"bad HTTP in the body: {exc}", before_response=False
                ) from None
            if type(event) is h11.Data:
                parts.append(event.data)
                continue
            if type(event) is h11.EndOfMessage:
                self._done = True
                self._finish()
                break
            if event is h11.NEED_DATA:
                if parts:
                    break
                await self._receive(conn)
                continue
            self.close()  # ConnectionClosed before the end, or something unexpected
            raise BodyBroken(
                self._pool.name, "the connection closed mid-body", before_response=False
            )
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def _receive(self, conn: _Conn) -> None:
        try:
            with trio.fail_after(self._idle_s):
                data = await conn.stream.receive_some(READ_SIZE)
        except trio.TooSlowError:
            self.close()
            raise UpstreamTimeout(
                self._pool.name,
                f"sent nothing for {self._idle_s:g} s mid-response",
                phase="idle",
                before_response=False,
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.close()
            raise BodyBroken(
                self._pool.name, f"connection lost mid-body: {exc}", before_response=False
            ) from None
        self.last_byte_at = trio.current_time()
        conn.h11.receive_data(data)

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            try:
                conn.h11.start_next_cycle()
            except h11.LocalProtocolError:
                conn.close()
                return
            self._pool.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Give the connection back if the exchange finished, else close it (the engine cancels)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done:
            self._conn = conn
            self._finish()
        else:
            conn.close()


class Pool:
    """Keep-alive connections to one endpoint.

    Idle connections are reused newest first; one idle longer than
    `keepalive_s` (engines drop theirs after about 5 s, as uvicorn does) or
    found closed is discarded. A request that fails on a reused connection
    before any response byte is sent again once on a fresh one: the server
    closed the idle connection as we wrote, and nothing reached it.
    """

    def __init__(
        self, host: str, port: int, *, keepalive_s: float = 4.0, max_idle: int = 512
    ) -> None:
        self.host = host
        self.port = port
        self.name = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self._host_header = self.name.encode()
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()
        self._closed = False
        self.connects = 0

    def __repr__(self) -> str:
        return f"<Pool {self.name} idle={len(self._idle)} connects={self.connects}>"

    def statistics(self) -> dict[str, int]:
        return {"idle": len(self._idle), "connects": self.connects}

    def put(self, conn: _Conn) -> None:
        if self._closed or len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conn.reused = True
        self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since > self.keepalive_s or conn.looks_closed():
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, timeout: float) -> _Conn:
        try:
            with trio.fail_after(timeout):
                stream = await trio.open_tcp_stream(self.host, self.port)
        except trio.TooSlowError:
            raise ConnectFailed(
                self.name, f"no connection within {timeout:g} s", before_response=True
            ) from None
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise ConnectFailed(
                self.name, f"cannot connect: {reason}", before_response=True
            ) from None
        self.connects += 1
        return _Conn(stream)

    async def request(
        self,
        method: bytes,
        target: bytes,
        body: bytes = b"",
        *,
        headers: Sequence[tuple[bytes, bytes]] = (),
        timeouts: Timeouts,
    ) -> Response:
        """Send a request; return once the response head has arrived.

        The caller must `close()` the response (normally after reading it to
        the end); cancelled before then, the connection is closed.
        """
        head = [(b"host", self._host_header), *headers]
        if body or method == b"POST":
            head.append((b"content-length", b"%d" % len(body)))
        deadline = trio.current_time() + timeouts.first_byte_s
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, method, target, head, body, timeouts, deadline)
            except UpstreamBroken as exc:
                if not exc.before_response:
                    raise
                log.debug("%s: a kept-alive connection was closed; sending again", self.name)
        conn = await self._connect(timeouts.connect_s)
        return await self._exchange(conn, method, target, head, body, timeouts, deadline)

    async def _exchange(
        self,
        conn: _Conn,
        method: bytes,
        target: bytes,
        head: list[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Timeouts,
        deadline: float,
    ) -> Response:
        ok = False
        try:
            try:
                data = conn.h11.send(h11.Request(method=method, target=target, headers=head))
                if body:
                    data += conn.h11.send(h11.Data(data=body))
                data += conn.h11.send(h11.EndOfMessage())
            except h11.LocalProtocolError as exc:
                raise UpstreamBroken(
                    self.name, f"cannot send the request: {exc}", before_response=True
                ) from None
            try:
                await conn.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise UpstreamBroken(
                    self.name, f"connection lost while sending: {exc}", before_response=True
                ) from None
            received = False
            while True:
                try:
                    event = conn.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    raise UpstreamBroken(
                        self.name, f"not an HTTP/1.1 response: {exc}", before_response=False
                    ) from None
                if type(event) is h11.Response:
                    ok = True
                    return Response(
                        self,
                        conn,
                        event.status_code,
                        list(event.headers),
                        timeouts.idle_s,
                    )
                if event is h11.NEED_DATA:
                    try:
                        with trio.fail_at(deadline):
                            chunk = await conn.stream.receive_some(READ_SIZE)
                    except trio.TooSlowError:
                        raise UpstreamTimeout(
                            self.name,
                            f"no response within {timeouts.first_byte_s:g} s",
                            phase="first_byte",
                            before_response=not received,
                        ) from None
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        raise UpstreamBroken(
                            self.name, f"connection lost: {exc}", before_response=not received
                        ) from None
                    if not chunk and not received:
                        raise UpstreamBroken(
                            self.name,
                            "closed the connection without answering",
                            before_response=True,
                        )
                    received = True
                    conn.h11.receive_data(chunk)
                    continue
                if type(event) is h11.InformationalResponse:
                    continue
                raise UpstreamBroken(
                    self.name, "closed the connection without answering", before_response=False
                )
        finally:
            if not ok:
                conn.close()

    async def get(self, target: bytes, timeout: float) -> tuple[int, bytes]:
        """A whole GET (for /metrics and /slots); every phase within `timeout`."""
        t = Timeouts(connect_s=timeout, first_byte_s=timeout, idle_s=timeout)
        with trio.fail_after(timeout):
            resp = await self.request(b"GET", target, timeouts=t)
            try:
                return resp.status, await resp.read()
            finally:
                resp.close()
