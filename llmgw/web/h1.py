"""The HTTP/1.1 client parts llmgw has once: h11 over a trio stream, with a bound on every read.

Used by the agent's fetcher (llmgw/agent/_fetch.py: one GET per connection,
a long body) and the router's upstream pool (llmgw/router/_upstream.py:
keep-alive connections to engines, many short exchanges).

- `receive(stream, timeout_s, max_bytes)`: one read, within `timeout_s`;
  `Quiet` when nothing came in time, `Broken` when the connection broke.
- `read_head(conn, stream, timeout_s)`: h11 events off the stream until the
  response head (an informational one is skipped), each read bounded as above;
  the head's size is bounded by h11 (`max_incomplete_event_size`).
- `body_length(status, headers)`: the body's length when Content-Length
  frames it (a caller may then read it straight from the stream).
- `header(headers, name)`: a header's first value in h11's list.
- `TlsClient`: the TLS client stream that decrypts every record already
  arrived per read (why, measured, in its docstring).

What the router's pool does not take from here, and why: its body read
(`Response.next_chunk`) is the router's hot path, one iteration per chunk
of every streamed token; it drains h11's events inline and reads the socket
in place, and its errors must say whether anything of a response arrived (a
request that got nothing may go to another engine). Reading through
`receive` would add a call, a cancel scope and an exception translation per
chunk, so the pool keeps its reading and shares the value-level parts
(`header`). Its head read is per request, but it has the same error
semantics as its body read (`before_response`), so it stays beside it.

It imports nothing of llmgw (tests/test_layering.py: llmgw.web sits below
every service).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

import h11
import trio

__all__ = [
    "HEAD_READ_BYTES",
    "RECEIVE_BYTES",
    "Broken",
    "Quiet",
    "TlsClient",
    "body_length",
    "header",
    "one_line",
    "read_head",
    "receive",
]

HEAD_READ_BYTES = 65536  # one read while a head is awaited
RECEIVE_BYTES = 1 << 20  # one read of a body's bytes, and of TLS records


class Quiet(Exception):
    """No bytes within the read deadline (a signal: the caller says it as its own error)."""


class Broken(Exception):
    """The connection broke, or the peer broke HTTP (a signal, as `Quiet`)."""


def one_line(exc: BaseException) -> str:
    """The first cause that says something (trio's BrokenResourceError often says nothing)."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            break
        if str(seen):
            return " ".join(str(seen).split())
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


async def receive(
    stream: trio.abc.Stream, timeout_s: float, max_bytes: int = HEAD_READ_BYTES
) -> bytes:
    """One read of at most `max_bytes` within `timeout_s`; b"" at the end of the stream.

    Raises `Quiet` when nothing arrived in time, `Broken` (one line, the first
    cause that says something) when the connection broke."""
    try:
        with trio.move_on_after(timeout_s) as timer:
            data = await stream.receive_some(max_bytes)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise Broken(one_line(exc)) from exc
    if timer.cancelled_caught:
        raise Quiet()
    return bytes(data)


async def read_head(
    conn: h11.Connection, stream: trio.abc.Stream, timeout_s: float
) -> h11.Response:
    """The response head, read off `stream` into `conn`, each read within `timeout_s`.

    Raises `Quiet`, `Broken`, or h11's RemoteProtocolError (not HTTP/1.1, a
    head larger than h11 allows, or the server closing before its head)."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await receive(stream, timeout_s))
        elif isinstance(event, h11.Response):
            return event
        elif isinstance(event, h11.ConnectionClosed):
            raise Broken("the server closed the connection without answering")


def body_length(status: int, headers: dict[str, str]) -> int | None:
    """The body's length when Content-Length frames it, else None (h11 reads it).

    `headers`: names lower-cased (as h11 gives them), decoded."""
    if "transfer-encoding" in headers or status in (204, 304):
        return None
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else None


def header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of the header `name` (lower-case) in h11's header list, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


class TlsClient(trio.abc.Stream):
    """A TLS client over a trio stream that reads every record already here at once.

    trio.SSLStream hands out one TLS record (16 KiB) per `receive_some`, each through
    its locks and a scheduler checkpoint: measured with bench/fetch.py --tls, that
    was most of the Fetcher's CPU (4.6 s for 2 GiB against curl's 2.7 s). This one
    decrypts every record that has arrived (one `SSLObject.read` each, in C) into one
    answer of up to `max_bytes`, and refills from the socket `RECEIVE_BYTES` at a
    time. Only what one request and then its body need: no renegotiation, no
    unwrap; the connection is not reused. Verification is the context's (hostname
    included). An EOF without close_notify reads as the end, as `https_compatible`
    does in trio: the body's Content-Length, or a manifest's size, tells a cut body
    from a whole one.
    """

    def __init__(self, transport: trio.abc.Stream, context: ssl.SSLContext, host: str) -> None:
        self.transport = transport
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)

    def __repr__(self) -> str:
        return f"<TlsClient over {self.transport!r} version={self._tls.version()}>"

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            await self.transport.send_all(data)

    async def _refill(self) -> None:
        data = await self.transport.receive_some(RECEIVE_BYTES)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    async def do_handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                await self._refill()
                continue
            await self._flush()
            return

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._tls.write(data)  # into a memory BIO: never wants to wait
        await self._flush()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        want = 65536 if max_bytes is None else max_bytes
        parts: list[bytes] = []
        got = 0
        while got < want:
            try:
                chunk = self._tls.read(want - got)
            except ssl.SSLWantReadError:
                if parts:
                    break  # what has arrived, now; the rest on the next call
                await self._flush()  # a post-handshake message may want an answer
                await self._refill()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break  # close_notify, or a bare EOF: the end (see the class docstring)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        await self.transport.aclose()
