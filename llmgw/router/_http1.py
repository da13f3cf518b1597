"""HTTP/1.1 requests from bytes: llhttp (through httptools) plus the rules it leaves to us.

Sans-I/O (no trio, no sockets): `feed(data)` parses what has arrived and
appends events to `events`: a `Head`, the body as `bytes` pieces, `END` when
the message is complete, and at most one `Failure` (a status and a reason),
after which nothing more is ever parsed on this connection. The caller
answers a Failure and closes.

Why llhttp and not h11 (measured, docs/architecture.md): on a typical chat
request head llhttp parses in ~2-3 µs where h11 takes ~29 µs to parse and
~47 µs with the response written; and llhttp already refuses what RFC 9112
says a server must not guess at: Content-Length together with
Transfer-Encoding (either order; request smuggling), duplicate or malformed
Content-Length, obs-fold, bare LF, whitespace before the colon, chunked
before another coding, methods it does not know (a lowercase one among them).
What this module adds: Host required on HTTP/1.1 (RFC 9112 §3.2),
Transfer-Encoding refused on HTTP/1.0 (§6.1), a transfer coding other than
chunked (501, `gzip, chunked` among them: llhttp would frame it as chunked
and pass the gzip bytes on as the body; 400 where chunked is not last), HTTP
versions other than 1.0 and 1.1 (505), and one head-size limit that does not
depend on how TCP splits the head: the request line and header lines as
parsed, counted the same whatever the segmentation (and, against a head that
never ends, at most twice the limit of raw bytes buffered before 431).
"""

from __future__ import annotations

from collections import deque

import attrs
import httptools

END = "end"  # the request's message is complete


@attrs.frozen
class Head:
    method: str
    target: bytes
    http_version: str
    headers: list[tuple[bytes, bytes]]  # names lower-cased, values as sent
    keep_alive: bool
    expect_continue: bool
    # After this request, stop parsing: an Upgrade or CONNECT whose following bytes
    # are not HTTP/1.1 requests to us.
    last: bool = False


@attrs.frozen
class Failure:
    status: int
    reason: str


Event = Head | bytes | str | Failure

BAD_METHOD = (
    "the method is not one this server knows; methods are case-sensitive "
    "(POST, not post: RFC 9110 §9.1)"
)


def transfer_coding_refusal(values: list[bytes]) -> tuple[int, str] | None:
    """Why a request's Transfer-Encoding values cannot be served, or None for `chunked`.

    RFC 9112: chunked must be the final coding of a request, or its length cannot
    be known (§6.3: 400); a coding the server does not apply is 501 (§6.1), and
    chunked is the only one applied here (llhttp would read `gzip, chunked` as
    plain chunked and hand the app gzip bytes as the body).
    """
    codings = [c.strip().lower() for value in values for c in value.split(b",")]
    codings = [c for c in codings if c]
    shown = ", ".join(c.decode("latin-1") for c in codings)[:80]
    if not codings or codings[-1] != b"chunked":
        return 400, (
            f"Transfer-Encoding {shown!r} does not end in chunked: the body's length "
            "cannot be known (RFC 9112 §6.3)"
        )
    if b"chunked" in codings[:-1]:
        return 400, "Transfer-Encoding applies chunked more than once (RFC 9112 §7)"
    if len(codings) > 1:
        return 501, (
            f"Transfer-Encoding {shown!r}: this server applies no transfer coding "
            "but chunked (RFC 9112 §6.1)"
        )
    return None


class RequestParser:
    """One connection's requests. `events` fills as `feed` is called."""

    __slots__ = (
        "_head_raw",
        "_head_size",
        "_headers",
        "_parser",
        "_url",
        "events",
        "failed",
        "in_head",
        "in_message",
        "max_head_bytes",
        "pending_body",
    )

    def __init__(self, max_head_bytes: int = 32768) -> None:
        self.max_head_bytes = max_head_bytes
        self.events: deque[Event] = deque()
        self.failed: Failure | None = None
        self.in_message = False  # a request has begun and has not ended
        self.in_head = False
        self.pending_body = 0  # body bytes in `events` (the caller bounds what it buffers)
        self._parser = httptools.HttpRequestParser(self)
        self._url: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._head_raw = 0

    def __repr__(self) -> str:
        state = "failed" if self.failed else "head" if self.in_head else (
            "body" if self.in_message else "idle")  # fmt: skip
        return f"<RequestParser {state}, {len(self.events)} events>"

    def feed(self, data: bytes) -> None:
        if self.failed is not None or not data:
            return
        began_in_head = self.in_head
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The request before the upgrade is whole; what follows is not ours to parse.
            if self.events and self.failed is None:
                for i in range(len(self.events) - 1, -1, -1):
                    ev = self.events[i]
                    if type(ev) is Head:
                        self.events[i] = attrs.evolve(ev, last=True, keep_alive=False)
                        break
            self.failed = Failure(400, "nothing may follow an Upgrade or CONNECT request")
            if self.in_message:  # an upgrade with a body: the body was not parsed
                self._fail(400, "an Upgrade or CONNECT request with a body is not served")
            return
        except httptools.HttpParserInvalidMethodError:
            # Also what llhttp says of a lowercase method: 400 on every llmgw listener (a
            # lowercase token is no method; llhttp cannot tell one from garbage, so not 501).
            if self.failed is None:
                self._fail(400, BAD_METHOD)
            return
        except httptools.HttpParserError as exc:
            if self.failed is None:
                reason = str(exc) or type(exc).__name__
                self._fail(400, f"malformed HTTP/1.1 request: {reason}")
            return
        if self.in_head and self.failed is None:
            # Bytes buffered inside llhttp for a head that has not ended (a header line
            # without its end): bounded so a client cannot grow it without limit.
            # (The read in which the head began is not counted: one read is bounded.)
            if began_in_head:
                self._head_raw += len(data)
            if self._head_raw > 2 * self.max_head_bytes:
                self._fail(431, self._too_large_reason())

    def _fail(self, status: int, reason: str) -> None:
        self.failed = Failure(status, reason)
        self.events.append(self.failed)
        # Make any further feed a no-op; an exception inside a callback stops llhttp.
        self.in_head = self.in_message = False

    def _too_large_reason(self) -> str:
        return f"the request head is over the limit of {self.max_head_bytes} bytes"

    # --- llhttp callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.in_message = True
        self.in_head = True
        self._url = []
        self._headers = []
        self._head_size = 16  # "GET  HTTP/1.1\r\n" and the blank line, roughly
        self._head_raw = 0

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._grow(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._grow(len(name) + len(value) + 4)

    def _grow(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self.max_head_bytes and self.failed is None:
            self._fail(431, self._too_large_reason())
            raise _Stop()

    def on_headers_complete(self) -> None:
        self.in_head = False
        p = self._parser
        version = p.get_http_version()
        method = p.get_method().decode("ascii")
        headers = self._headers
        if version not in ("1.1", "1.0"):
            self._fail(505, f"HTTP/{version} is not served here; use HTTP/1.1")
            raise _Stop()
        expect = False
        host = te = False
        for name, value in headers:
            if name == b"host":
                host = True
            elif name == b"transfer-encoding":
                te = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
        if version == "1.1" and not host:
            self._fail(400, "an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)")
            raise _Stop()
        if te and version == "1.0":
            self._fail(400, "Transfer-Encoding on an HTTP/1.0 request (RFC 9112 §6.1)")
            raise _Stop()
        if te:
            refusal = transfer_coding_refusal(
                [value for name, value in headers if name == b"transfer-encoding"]
            )
            if refusal is not None:
                self._fail(*refusal)
                raise _Stop()
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        self._headers = []  # trailer fields of a chunked body go here, and are dropped
        self.events.append(
            Head(method, url, version, headers, p.should_keep_alive(), expect and version == "1.1")
        )

    def on_body(self, body: bytes) -> None:
        self.events.append(body)
        self.pending_body += len(body)

    def on_message_complete(self) -> None:
        self.in_message = False
        self.events.append(END)


class _Stop(httptools.HttpParserError):
    """Raised in a callback: llhttp stops, `feed` sees a parser error already recorded."""
