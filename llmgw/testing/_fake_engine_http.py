"""The fake engine's HTTP/1 connections: h11 over a trio stream, one request at a time.

`serve_connection` reads requests off one connection (keep-alive, bounded
bodies, pipelining) and hands each to a handler with an `Exchange`, through
which the handler answers: a whole `Reply`, or a streamed body piece by piece.
`Exchange.watching` runs slow work while reading the socket, so a client that
closes its connection cancels what it asked for, as uvicorn and llama.cpp do.
Which routes exist and what they answer is `fake_engine`'s business.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import h11
import trio

from llmgw.testing._fake_engine_wire import Reply

_READ_SIZE = 65536
MAX_BODY = 32 * 1024 * 1024
# Bytes a client may pipeline behind a request still being answered before we stop reading.
_MAX_PIPELINED = 1024 * 1024
_BODY_TIMEOUT = 60.0
_REASONS = {int(s): s.phrase.encode() for s in HTTPStatus}


class Gone(Exception):
    """The client closed its connection, or sent nothing for too long."""


class Exchange:
    """One connection as a handler sees it: where the answer to its request goes."""

    def __init__(self, conn: h11.Connection, stream: trio.SocketStream, server: bytes) -> None:
        self._conn = conn
        self._stream = stream
        self._server = server

    def __repr__(self) -> str:
        return f"<Exchange ours={self._conn.our_state} theirs={self._conn.their_state}>"

    def _headers(self, content_type: str, length: int | None) -> list[tuple[bytes, bytes]]:
        headers = [(b"server", self._server), (b"content-type", content_type.encode())]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        return headers

    async def send(self, reply: Reply) -> None:
        """The whole response: head, body, end."""
        conn = self._conn
        head = h11.Response(
            status_code=reply.status,
            headers=self._headers(reply.content_type, len(reply.body)),
            reason=_REASONS.get(reply.status, b""),
        )
        out = conn.send(head)
        if reply.body:
            out += conn.send(h11.Data(data=reply.body))
        await self._stream.send_all(out + conn.send(h11.EndOfMessage()))

    async def start_stream(self, content_type: str) -> None:
        """A 200 head without a length: the body follows in `send_data`, then `end_stream`."""
        head = h11.Response(
            status_code=200, headers=self._headers(content_type, None), reason=b"OK"
        )
        await self._stream.send_all(self._conn.send(head))

    async def send_data(self, data: bytes) -> None:
        await self._stream.send_all(self._conn.send(h11.Data(data=data)))

    async def end_stream(self, data: bytes) -> None:
        conn = self._conn
        await self._stream.send_all(conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))

    async def watching(self, work: Callable[[], Awaitable[None]]) -> bool:
        """Run `work` while reading the socket; cancel it if the client goes away.

        Returns whether the client went away. Bytes it pipelines meanwhile go to
        h11, which hands them out after this response.
        """
        conn, stream = self._conn, self._stream
        gone = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                buffered = 0
                while buffered < _MAX_PIPELINED:
                    try:
                        data = await stream.receive_some(_READ_SIZE)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data:
                        gone = True
                        nursery.cancel_scope.cancel()
                        return
                    conn.receive_data(data)
                    buffered += len(data)

            nursery.start_soon(watch)
            try:
                await work()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                gone = True
            nursery.cancel_scope.cancel()
        return gone


Handler = Callable[[Exchange, h11.Request, bytes], Awaitable[None]]


async def serve_connection(
    stream: trio.SocketStream,
    handle: Handler,
    *,
    server: bytes,
    keepalive: float,
    too_large: Reply,
) -> None:
    """Answer the requests on `stream` until either side is done; always closes it.

    `server` is the Server header; `keepalive` the seconds an idle connection
    is kept; `too_large` the answer to a body over `MAX_BODY` bytes. A handler
    raises `Gone` when its client went away mid-answer.
    """
    conn = h11.Connection(h11.SERVER)
    ex = Exchange(conn, stream, server)
    try:
        while True:
            head = await _next(conn, stream, keepalive)
            if not isinstance(head, h11.Request):
                return
            body = await _body(conn, stream)
            if body is None:
                await ex.send(too_large)
                return
            await handle(ex, head, body)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (Gone, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    except h11.RemoteProtocolError as exc:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            reply = Reply(
                exc.error_status_hint, f"Invalid HTTP request: {exc}".encode(), "text/plain"
            )
            with trio.move_on_after(1):
                await ex.send(reply)
    except Exception:
        print("ERROR:    Exception in ASGI application", file=sys.stderr)
        traceback.print_exc()
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with trio.move_on_after(1):
                await ex.send(Reply(500, b"Internal Server Error", "text/plain"))
    finally:
        await trio.aclose_forcefully(stream)


async def _next(conn: h11.Connection, stream: trio.SocketStream, timeout: float) -> object:
    """The next h11 event (or PAUSED); Gone when the peer closes between requests."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = b""
        with trio.move_on_after(timeout):
            data = await stream.receive_some(_READ_SIZE)
        if not data and conn.their_state is h11.IDLE:
            raise Gone()  # closed or idle between requests: nothing to answer
        conn.receive_data(data)


async def _body(conn: h11.Connection, stream: trio.SocketStream) -> bytes | None:
    """The request's body; None when it is over `MAX_BODY` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await _next(conn, stream, _BODY_TIMEOUT)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY:
                return None
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:
            raise Gone()
