"""The router's HTTP edge against hostile and careless clients, over raw sockets.

Each test runs against both listeners (`lean`, llmgw's own server, and
`hypercorn` behind llmgw/router/_hypercorn.py's guard) where hypercorn can hold
it; where it cannot, the case is marked lean-only with the reason (h11 under
hypercorn accepts it and the ASGI app never sees the difference).
"""

from __future__ import annotations

import email.utils
import functools
import itertools
import json
import logging
import re
import socket
import time
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest
import trio

from llmgw.router import _main, _server
from llmgw.router._types import Endpoint
from llmgw.web.limits import ListenerLimits
from router.conftest import SECRET_A, SERVERS, sample, serve_router

HOST = b"host: r\r\n"
AUTH = b"authorization: Bearer " + SECRET_A.encode() + b"\r\n"
LEAN_ONLY = "h11 under hypercorn accepts this and the ASGI app cannot see it"


async def exchange(
    port: int, data: bytes | Sequence[bytes], *, timeout: float = 10.0
) -> tuple[bytes, bool]:
    """Send `data` (or its pieces, one write each), read until EOF; (reply, closed)."""
    s = await trio.open_tcp_stream("127.0.0.1", port)
    pieces = [data] if isinstance(data, bytes) else list(data)
    reply = b""
    closed = False
    with trio.move_on_after(timeout):
        try:
            for piece in pieces:
                await s.send_all(piece)
        except trio.BrokenResourceError:
            pass
        try:
            while True:
                chunk = await s.receive_some(65536)
                if not chunk:
                    closed = True
                    break
                reply += chunk
        except trio.BrokenResourceError:
            closed = True
    await s.aclose()
    return reply, closed


def statuses(reply: bytes) -> list[int]:
    """The status of every response in `reply` (responses follow bodies directly)."""
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", reply)]


def header(reply: bytes, name: bytes) -> bytes | None:
    head = reply.split(b"\r\n\r\n", 1)[0]
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


# --- framing (RFC 9112) ---------------------------------------------------------------

_SMUGGLED = b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n"
_CHUNKED_BODY = b"0\r\n\r\n" + _SMUGGLED
_CL = b"content-length: %d\r\n" % len(_CHUNKED_BODY)
_TE = b"transfer-encoding: chunked\r\n"
_POST = b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST + AUTH

FRAMING = {
    # name: (request, listeners that must refuse it)
    "cl-then-te": (_POST + _CL + _TE + b"\r\n" + _CHUNKED_BODY, ("lean", "hypercorn")),
    "te-then-cl": (_POST + _TE + _CL + b"\r\n" + _CHUNKED_BODY, ("lean", "hypercorn")),
    "duplicate-cl-differing": (
        _POST + b"content-length: 2\r\ncontent-length: 3\r\n\r\n{}" + _SMUGGLED,
        ("lean", "hypercorn"),
    ),
    "duplicate-cl-identical": (  # h11 merges identical duplicates
        _POST + b"content-length: 2\r\ncontent-length: 2\r\n\r\n{}" + _SMUGGLED,
        ("lean",),
    ),
    "negative-cl": (_POST + b"content-length: -1\r\n\r\n" + _SMUGGLED, ("lean", "hypercorn")),
    "cl-list": (_POST + b"content-length: 2, 2\r\n\r\n{}" + _SMUGGLED, ("lean",)),
    "obs-fold": (  # h11 unfolds continuation lines
        b"GET /healthz HTTP/1.1\r\n" + HOST + b"x-a: b\r\n c\r\n\r\n" + _SMUGGLED,
        ("lean",),
    ),
    "bare-lf": (b"GET /healthz HTTP/1.1\n" + HOST.replace(b"\r", b"") + b"\n", ("lean",)),
    "space-before-colon": (
        b"GET /healthz HTTP/1.1\r\nhost : r\r\n\r\n" + _SMUGGLED,
        ("lean", "hypercorn"),
    ),
}


# Only the listeners that can hold each case: for the others, LEAN_ONLY says why.
@pytest.mark.parametrize(
    ("server", "case"),
    [(server, case) for case in sorted(FRAMING) for server in FRAMING[case][1]],
)
@pytest.mark.parametrize("feed", ["whole", "byte-by-byte"])
async def test_framing_errors_are_refused_and_close(server: str, case: str, feed: str) -> None:
    request, _ = FRAMING[case]
    async with serve_router([], server=server, run=False) as r:
        data = request if feed == "whole" else byte_by_byte(request)
        reply, closed = await exchange(r.port, data)
    got = statuses(reply)
    # A 400 (or a close with nothing), and never a second response on this connection.
    assert got in ([400], []), (case, reply[:300])
    assert closed, case
    assert b'"status": "ok"' not in reply and b'{"status":"ok"}' not in reply
    if server == "lean":
        assert got == [400]
        assert header(reply, b"connection") == b"close"
        assert header(reply, b"date") is not None


@SERVERS
async def test_a_well_framed_pipeline_is_still_served(server: str) -> None:
    """The control: the same bytes, framed once, give two answers on one connection."""
    body = b"{}"
    req = _POST + b"content-length: 2\r\n\r\n" + body + _SMUGGLED
    async with serve_router([], server=server, run=False) as r:
        s = await trio.open_tcp_stream("127.0.0.1", r.port)
        await s.send_all(req)
        reply = b""
        with trio.fail_after(10):
            while reply.count(b"HTTP/1.1 ") < 2 or not reply.endswith(b"}"):
                reply += await s.receive_some(65536)
        await s.aclose()
    assert statuses(reply) == [400, 200]  # the POST lacks "model"; the GET is health


_LAST = b"GET /healthz HTTP/1.1\r\n" + HOST + b"connection: close\r\n\r\n"

# Transfer-Encoding values: (lean, hypercorn). Only chunked is applied. Where chunked
# is not the final coding the length cannot be known: 400 (RFC 9112 §6.3) on the lean
# listener; h11 under hypercorn refuses every coding but chunked alike, with 501.
TRANSFER_CODINGS = {
    "gzip, chunked": (501, 501),  # llhttp alone framed it as chunked: gzip bytes as body
    "gzip\r\ntransfer-encoding: chunked": (501, 501),  # the same, in two fields
    "x-custom ,  chunked": (501, 501),
    "gzip": (400, 501),
    "identity": (400, 501),
    "chunked, gzip": (400, 501),
    "chunked, chunked": (400, 501),
}


@pytest.mark.parametrize("coding", sorted(TRANSFER_CODINGS))
def test_the_parser_refuses_a_coding_whole_and_byte_by_byte(coding: str) -> None:
    from llmgw.router._http1 import Failure, RequestParser

    data = _POST + b"transfer-encoding: " + coding.encode() + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    for pieces in ([data], byte_by_byte(data)):
        parser = RequestParser()
        for piece in pieces:
            parser.feed(piece)
        events = list(parser.events)
        assert [type(e) for e in events] == [Failure], events  # no Head reaches the app
        assert events[0].status == TRANSFER_CODINGS[coding][0], events  # type: ignore[union-attr]


@pytest.mark.parametrize("coding", sorted(TRANSFER_CODINGS))
@SERVERS
async def test_a_transfer_coding_other_than_chunked_is_refused_and_closes(
    server: str, coding: str
) -> None:
    lean, hyper = TRANSFER_CODINGS[coding]
    head = _POST + b"transfer-encoding: " + coding.encode() + b"\r\n\r\n"
    async with serve_router([], server=server, run=False) as r:
        reply, closed = await exchange(r.port, head + b"2\r\n{}\r\n0\r\n\r\n" + _SMUGGLED)
        # The control: plain chunked (in any case) is served, here a 400 for the lacking
        # "model", on a connection that goes on to the next request.
        served, _ = await exchange(
            r.port, _POST + b"transfer-encoding: Chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n" + _LAST
        )  # fmt: skip
    assert statuses(reply) == [lean if server == "lean" else hyper], reply[:300]
    assert closed
    assert statuses(served) == [400, 200], served[:300]
    if server == "lean" and lean == 501:
        assert b"applies no transfer coding but chunked" in reply


@pytest.mark.parametrize("method", [b"post", b"Post", b"get", b"head"])
@SERVERS
async def test_a_lowercase_method_is_no_method(server: str, method: bytes) -> None:
    """Methods are case-sensitive (RFC 9110 §9.1): 400 and closed on both listeners
    (hypercorn upper-cases the method before the app; llmgw's h11 connection refuses)."""
    if method in (b"get", b"head"):
        request = method + b" /healthz HTTP/1.1\r\n" + HOST + b"\r\n"
    else:
        request = method + b" /v1/chat/completions HTTP/1.1\r\n" + HOST + AUTH
        request += b"content-length: 2\r\n\r\n{}"
    async with serve_router([], server=server, run=False) as r:
        reply, closed = await exchange(r.port, request + _SMUGGLED)
        control, _ = await exchange(r.port, request.replace(method, method.upper()) + _LAST)
    assert statuses(reply) == [400], reply[:300]
    assert closed
    assert statuses(control) in ([200, 200], [400, 200]), control[:300]  # health, no model
    if server == "lean":
        assert b"methods are case-sensitive" in reply


@SERVERS
async def test_a_request_pipelined_behind_a_close_leaves_no_traceback(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On hypercorn a GET answered before its body was read says `connection: close`
    (the guard), and h11 takes a request pipelined behind it as a protocol error:
    hypercorn closes while the answer is being written. That close met the write
    (BusyResourceError in the app, a traceback per connection) until llmgw's
    connection let the write finish first; whether the answer's body still goes out
    depends on timing (docs/architecture.md). The lean listener, which sees the body
    has arrived, answers both."""
    request = b"GET /healthz HTTP/1.1\r\n" + HOST + b"content-length: 2\r\n\r\n{}" + _LAST
    ok = b'\r\n\r\n{"status": "ok"}'
    async with serve_router([], server=server, run=False) as r:
        for _ in range(20):
            reply, closed = await exchange(r.port, request)
            assert closed
            if server == "lean":
                assert statuses(reply) == [200, 200], reply[:300]
                assert reply.count(ok) == 2, reply
            else:
                assert statuses(reply) == [200], reply[:300]
                assert header(reply, b"connection") == b"close"
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert tracebacks == []


# --- HEAD, Allow, Date, x-request-id ----------------------------------------------------


async def _get_then_head(port: int, path: bytes, extra: bytes = b"") -> tuple[bytes, bytes]:
    """GET then HEAD then GET on one connection: the HEAD's head, the GET's whole reply."""
    s = await trio.open_tcp_stream("127.0.0.1", port)

    async def one(method: bytes) -> bytes:
        await s.send_all(method + b" " + path + b" HTTP/1.1\r\n" + HOST + extra + b"\r\n")
        data = b""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in data:
                data += await s.receive_some(65536)
            length = int(header(data, b"content-length") or b"0")
            if method == b"GET":
                while len(data.split(b"\r\n\r\n", 1)[1]) < length:
                    data += await s.receive_some(65536)
        return data

    get = await one(b"GET")
    head = await one(b"HEAD")
    again = await one(b"GET")  # the connection survived the HEAD, and no stray body came
    await s.aclose()
    assert statuses(again) == statuses(get), again
    assert again.split(b"\r\n\r\n", 1)[1].startswith(get.split(b"\r\n\r\n", 1)[1][:10])
    return head, get


@SERVERS
@pytest.mark.parametrize("path", [b"/healthz", b"/health", b"/v1/models", b"/v1/models/chat"])
async def test_head_is_get_without_a_body(server: str, path: bytes, start_engine: Any) -> None:
    fe = start_engine("chat")
    async with serve_router([fe.endpoint()], server=server, run=False) as r:
        head, get = await _get_then_head(r.port, path, AUTH)
    assert statuses(head) == statuses(get) == [200]
    assert head.endswith(b"\r\n\r\n")  # nothing after the head
    assert header(head, b"content-length") == header(get, b"content-length")
    assert int(header(get, b"content-length") or 0) > 0


async def test_head_on_the_metrics_listener() -> None:
    """The metrics listener runs on the lean server only (llmgw/router/_main.py)."""
    async with serve_router([], run=False) as r, trio.open_nursery() as nursery:
        port = await nursery.start(_server.serve, _main.metrics_app(r.router), "127.0.0.1", 0)
        for path in (b"/metrics", b"/healthz"):
            head, get = await _get_then_head(port, path)
            assert statuses(head) == [200]
            assert head.endswith(b"\r\n\r\n")
            assert header(head, b"content-length") == header(get, b"content-length")
        reply, _ = await exchange(
            port, b"POST /metrics HTTP/1.1\r\n" + HOST + b"connection: close\r\n\r\n"
        )
        assert statuses(reply) == [405]
        assert header(reply, b"allow") == b"GET, HEAD"
        nursery.cancel_scope.cancel()


@SERVERS
async def test_allow_date_and_request_ids(server: str) -> None:
    async with serve_router([], server=server, run=False) as r:
        replies = {}
        for name, req in {
            "405-post-route": b"GET /v1/chat/completions HTTP/1.1\r\n",
            "405-get-route": b"DELETE /v1/models HTTP/1.1\r\n",
            "404": b"GET /nowhere HTTP/1.1\r\n",
            "200": b"GET /healthz HTTP/1.1\r\n",
            "200-again": b"GET /healthz HTTP/1.1\r\n",
        }.items():
            replies[name], _ = await exchange(
                r.port, req + HOST + AUTH + b"connection: close\r\n\r\n"
            )
    assert statuses(replies["405-post-route"]) == [405]
    assert header(replies["405-post-route"], b"allow") == b"POST"
    assert statuses(replies["405-get-route"]) == [405]
    assert header(replies["405-get-route"], b"allow") == b"GET, HEAD"
    assert statuses(replies["404"]) == [404]
    ids = set()
    for name, reply in replies.items():
        date = header(reply, b"date")
        assert date is not None, name
        when = email.utils.parsedate_to_datetime(date.decode()).timestamp()
        assert abs(when - time.time()) < 60, (name, date)
        rid = header(reply, b"x-request-id")
        assert rid is not None and rid == header(reply, b"x-llmgw-request-id"), name
        ids.add(rid)
    assert len(ids) == len(replies)  # one id per request


async def _scripted_engine(nursery: trio.Nursery, reply_head: bytes, write_body: Any) -> int:
    """An engine that answers every request with `reply_head`, then `write_body(stream)`."""

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = await stream.receive_some(65536)
            if not more:
                return
            data += more
        body = data.partition(b"\r\n\r\n")[2]
        length = int(header(data, b"content-length") or b"0")
        while len(body) < length:
            body += await stream.receive_some(65536)
        try:
            await stream.send_all(reply_head)
            await write_body(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    listeners = await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"), handle, 0)
    return int(listeners[0].socket.getsockname()[1])


@SERVERS
async def test_the_engines_request_id_passes_and_logs_carry_ours(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    body = b'{"id":"x","object":"chat.completion","choices":[]}'

    async def once(stream: trio.SocketStream) -> None:
        await stream.send_all(body)

    caplog.set_level(logging.INFO, logger="llmgw.router")
    async with trio.open_nursery() as nursery:
        port = await _scripted_engine(
            nursery,
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: engine-77\r\n"
            b"content-length: %d\r\n\r\n" % len(body),
            once,
        )
        dead = Endpoint("chat@dead", "chat", "vllm", "127.0.0.1", _free_closed_port())
        eps = [Endpoint("chat@live", "chat", "vllm", "127.0.0.1", port), dead]
        async with serve_router(eps, server=server, run=False, retries=1) as r:
            req = json.dumps({"model": "chat", "messages": []}).encode()
            async with httpx.AsyncClient(base_url=r.url) as c:
                seen = []
                for _ in range(6):  # some go to the dead endpoint first, are retried, logged
                    resp = await c.post(
                        "/v1/chat/completions",
                        content=req,
                        headers={"authorization": f"Bearer {SECRET_A}"},
                    )
                    assert resp.status_code == 200
                    assert resp.headers["x-request-id"] == "engine-77"
                    seen.append(resp.headers["x-llmgw-request-id"])
        nursery.cancel_scope.cancel()
    tagged = [m for m in caplog.messages if "chat@dead" in m]
    assert tagged, caplog.messages
    for message in tagged:
        assert any(message.endswith(f"[request {rid}]") for rid in seen), message


def _free_closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the head-size limit ----------------------------------------------------------------


@pytest.mark.parametrize("size,status", [(20_000, 200), (40_000, 431)])
@pytest.mark.parametrize("write", [None, 8192, 1000])
async def test_head_limit_does_not_depend_on_segmentation(
    size: int, status: int, write: int | None
) -> None:
    """Lean only: hypercorn's h11 limit counts only the buffered part of a head, so a
    40 KB head passes in one write and fails in 8 KiB writes there."""
    req = b"GET /healthz HTTP/1.1\r\n" + HOST + b"x-big: " + b"a" * size + b"\r\n"
    req += b"connection: close\r\n\r\n"
    async with serve_router([], run=False) as r:  # max_head_bytes: 32768
        pieces = [req] if write is None else [req[i : i + write] for i in range(0, len(req), write)]
        reply, closed = await exchange(r.port, pieces)
    assert statuses(reply) == [status]
    assert closed


# --- timeouts on the client side --------------------------------------------------------


@SERVERS
async def test_a_one_byte_per_second_body_is_cut(server: str) -> None:
    async with serve_router([], server=server, run=False, client_body_timeout_s=1.0) as r:
        s = await trio.open_tcp_stream("127.0.0.1", r.port)
        await s.send_all(_POST + b"content-length: 100\r\n\r\n")
        start = trio.current_time()
        reply = b""
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:

                async def drip() -> None:
                    try:
                        for _ in range(100):
                            await s.send_all(b" ")
                            await trio.sleep(0.25)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

                nursery.start_soon(drip)
                while True:
                    try:
                        chunk = await s.receive_some(65536)
                    except trio.BrokenResourceError:
                        chunk = b""
                    if not chunk:
                        break
                    reply += chunk
                nursery.cancel_scope.cancel()
        took = trio.current_time() - start
        await s.aclose()
    assert statuses(reply) == [408], reply
    assert b"body_timeout_s" in reply
    assert 0.9 < took < 2.5, took


# Lean only: hypercorn's read_timeout bounds each read, not the head, and ends it
# without a 408 (a head that stalls closes there, llmgw's connection: see the next test).
@pytest.mark.parametrize("server", ["lean"])
async def test_a_slow_head_is_cut(server: str) -> None:
    async with serve_router([], server=server, run=False, client_head_timeout_s=1.0) as r:
        start = trio.current_time()
        reply, closed = await exchange(r.port, b"GET /healthz HTTP/1.1\r\nhost: r\r\n")
        took = trio.current_time() - start
    assert closed
    assert took < 3, took
    assert statuses(reply) == [408]
    assert b"head_timeout_s" in reply


async def test_a_stalled_head_on_hypercorn_is_closed_at_its_read_timeout() -> None:
    """hypercorn's read_timeout ends the read; the connection then closes at once (before
    llmgw's connection it stayed open until the keep-alive timer), though with no 408."""
    async with serve_router(
        [], server="hypercorn", run=False, client_head_timeout_s=1.0, client_keepalive_s=30.0
    ) as r:
        start = trio.current_time()
        reply, closed = await exchange(r.port, b"GET /healthz HTTP/1.1\r\nhost: r\r\n")
        took = trio.current_time() - start
    assert closed
    assert reply == b""
    assert 0.9 < took < 5, took


# On hypercorn through llmgw's connection (llmgw/router/_hypercorn.py): hypercorn shields
# its socket writes from cancellation, so no ASGI-level bound could cut such a client.
@SERVERS
async def test_a_client_that_stops_reading_frees_its_slot(server: str) -> None:
    idle = 1.0
    piece = b"data: " + b"x" * 65536 + b"\n\n"

    async def forever(stream: trio.SocketStream) -> None:
        while True:
            await stream.send_all(b"%x\r\n%b\r\n" % (len(piece), piece))

    async with trio.open_nursery() as nursery:
        port = await _scripted_engine(
            nursery,
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n",
            forever,
        )
        ep = Endpoint("chat@scripted", "chat", "vllm", "127.0.0.1", port)
        async with serve_router([ep], server=server, run=False, idle_timeout_s=idle) as r:
            metrics_port = await nursery.start(
                _server.serve, _main.metrics_app(r.router), "127.0.0.1", 0
            )
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
            await s.socket.connect(("127.0.0.1", r.port))
            body = json.dumps({"model": "chat", "messages": [], "stream": True}).encode()
            await s.send_all(_POST + b"content-length: %d\r\n\r\n" % len(body) + body)
            with trio.fail_after(10):
                first = await s.receive_some(100)
            assert first.startswith(b"HTTP/1.1 200"), first
            stopped = trio.current_time()  # from here the client reads nothing
            async with httpx.AsyncClient() as c:
                url = f"http://127.0.0.1:{metrics_port}/metrics"
                admitted = []
                with trio.fail_after(idle + 8):
                    while True:
                        text = (await c.get(url)).text
                        value = sample(text, "llmgw_router_admitted_requests", model="chat")
                        admitted.append(value)
                        if value == 0:
                            break
                        await trio.sleep(0.05)
            freed = trio.current_time() - stopped
            await s.aclose()
        nursery.cancel_scope.cancel()
    assert admitted[0] == 1  # it held its slot while the client was still there
    assert freed <= idle + 1.0, freed


# --- 413 that arrives --------------------------------------------------------------------


@SERVERS
async def test_413_reaches_the_async_sdk(server: str) -> None:
    async with serve_router([], server=server, run=False, max_body_bytes=1 << 20) as r:
        client = openai.AsyncOpenAI(base_url=r.base_url, api_key=SECRET_A, max_retries=0)
        big = "x" * (4 << 20)
        for _ in range(4):
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": big}]
                )
            assert info.value.status_code == 413
            assert "over the limit of 1048576 bytes" in info.value.message
        await client.close()


@SERVERS
async def test_413_then_the_body_is_read_and_the_close_is_clean(server: str) -> None:
    """Over a raw socket: every byte of a 4 MiB body is accepted (no reset while sending),
    then the 413 and a clean end of stream (a reset could destroy the answer unread)."""
    size = 4 << 20
    async with serve_router([], server=server, run=False, max_body_bytes=1 << 20) as r:
        s = await trio.open_tcp_stream("127.0.0.1", r.port)
        with trio.fail_after(20):
            await s.send_all(_POST + b"content-length: %d\r\n\r\n" % size)
            sent = 0
            piece = b"x" * 65536
            reply = b""

            async def read_all() -> None:
                nonlocal reply
                while chunk := await s.receive_some(65536):
                    reply += chunk

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                while sent < size:
                    await s.send_all(piece)  # BrokenResourceError here: a reset
                    sent += len(piece)
        await s.aclose()
    assert sent == size
    assert statuses(reply) == [413]
    assert header(reply, b"connection") == b"close"
    assert b"request_too_large" in reply


# --- the parser's fuzz inputs, against the real lean listener ------------------------------


def _fuzz_targets() -> Any:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "fuzz" / "targets.py"
    spec = importlib.util.spec_from_file_location("llmgw_fuzz_targets", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def _expected(data: bytes) -> list[int]:
    """What the listener must answer, from the pure parser: 200 per request it may serve,
    then the refusal; nothing after a close."""
    from llmgw.router._http1 import END, Failure, Head, RequestParser

    parser = RequestParser()
    parser.feed(data)
    out: list[int] = []
    events = list(parser.events)
    for i, event in enumerate(events):
        if type(event) is Failure:
            out.append(event.status)
            return out
        if type(event) is Head:
            rest = events[i + 1 :]
            body = list(itertools.takewhile(lambda e: type(e) is bytes, rest))
            after = rest[len(body)] if len(rest) > len(body) else None
            if event.expect_continue and (body or after is not END):
                out.append(100)  # the app reads a body: it is asked for
            if type(after) is Failure:
                out.append(after.status)  # a bad chunk: refused, closed
                return out
            if after is not END:
                out.append(408)  # the body never ends: cut at body_timeout_s
                return out
            out.append(200)
            if not event.keep_alive or event.last:
                return out  # closed after this answer
    if parser.in_head:
        out.append(408)  # a head begun and never finished
    return out


async def test_fuzz_inputs_against_the_listener() -> None:
    """Mutated requests (fuzz/targets.py's seeds and edits), whole and byte by byte: the
    listener answers exactly what the parser allows, a refusal is last, and the connection
    closes after it (lean only: this is the lean listener's parser)."""
    import random

    targets = _fuzz_targets()
    seeds = targets.TARGETS["http_request"].seeds
    rng = random.Random(10)
    alphabet = " \t\r\n:;,0123456789abcxyzHTPGETOS/-"
    served = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal served
        while True:  # the body first, as the router reads it
            message = await receive()
            if message["type"] != "http.request":
                return
            if not message.get("more_body"):
                break
        served += 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    limits = ListenerLimits(head_timeout_s=0.2, body_timeout_s=0.2, keepalive_s=0.2)
    cases = 0
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            functools.partial(_server.serve, limits=limits), app, "127.0.0.1", 0
        )
        for n in range(40):
            text = seeds[n % len(seeds)]
            edits = [
                (rng.randrange(1 << 20), rng.randrange(7), "".join(rng.choices(alphabet, k=3)))
                for _ in range(rng.randrange(0, 4))
            ]
            data = targets._mutate(text, edits).encode("latin-1", "replace")
            want = _expected(data)
            for feed in ("whole", "byte-by-byte"):
                before = served
                reply, closed = await exchange(
                    port, data if feed == "whole" else byte_by_byte(data), timeout=5
                )
                assert statuses(reply) == want, (feed, data, reply)
                assert served - before == want.count(200), (feed, data)
                assert closed, (feed, data)
                cases += 1
        nursery.cancel_scope.cancel()
    assert cases == 80


def test_listener_keys_are_bounded_and_reach_the_listeners() -> None:
    from llmgw.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _main.parse(
            {"keys_db": "/tmp/k.db", "client_body_timeout_s": 0, "max_head_bytes": 10},
            "router.yaml",
        )
    text = str(err.value)
    assert "router.yaml: client_body_timeout_s:" in text and "(got 0" in text, text
    assert "router.yaml: max_head_bytes:" in text and "10" in text, text
    _file, cfg, _eps = _main.parse(
        {
            "keys_db": "/tmp/k.db",
            "client_head_timeout_s": 5,
            "client_body_timeout_s": 7,
            "client_keepalive_s": 9,
            "idle_timeout_s": 3,
            "max_head_bytes": 4096,
        },
        "router.yaml",
    )
    limits = _main.listener_limits(cfg)
    assert (limits.head_timeout_s, limits.body_timeout_s, limits.keepalive_s) == (5, 7, 9)
    assert limits.send_timeout_s == 3  # a write to the client is bounded like an upstream read
    assert limits.max_head_bytes == 4096
    hc = _main._hypercorn("127.0.0.1:1", cfg)
    assert (hc.keep_alive_timeout, hc.h11_max_incomplete_size) == (9, 4096)
