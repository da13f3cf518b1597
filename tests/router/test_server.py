"""The lean HTTP/1.1 server and the upstream pool, over real sockets."""

from __future__ import annotations

import json
from collections.abc import Callable

import trio

from llmgw.router._upstream import ConnectFailed, Pool, Timeouts, UpstreamTimeout
from llmgw.testing.cluster import free_port
from router.conftest import SECRET_A, FakeEngine, serve_router


def _post(body: bytes, *, close: bool = False) -> bytes:
    extra = b"connection: close\r\n" if close else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + SECRET_A.encode() + b"\r\n" + extra
        + b"content-length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


async def _read_responses(stream: trio.SocketStream, n: int) -> list[bytes]:
    """Read until `n` complete content-length responses have arrived."""
    data = b""
    with trio.fail_after(10):
        while data.count(b"HTTP/1.1 ") < n or not _complete(data, n):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    return [b"HTTP/1.1 " + part for part in data.split(b"HTTP/1.1 ")[1:]]


def _complete(data: bytes, n: int) -> bool:
    parts = data.split(b"HTTP/1.1 ")[1:]
    if len(parts) < n:
        return False
    head, _, body = parts[-1].partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


async def test_keep_alive_pipelining_and_bad_requests(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "2"})
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "x"}]}).encode()
    async with serve_router([fe.endpoint()], run=False) as r:
        s = await trio.open_tcp_stream("127.0.0.1", r.port)
        # Two requests in one write: both answered, in order, on the same connection.
        await s.send_all(_post(body) + _post(b"{oops"))
        first, second = await _read_responses(s, 2)
        assert first.startswith(b"HTTP/1.1 200 ")
        assert b"tok0 tok1" in first
        assert second.startswith(b"HTTP/1.1 400 ")
        assert b"invalid_json" in second
        # A GET (an app that never reads the empty body) keeps the connection too.
        await s.send_all(
            b"GET /v1/models HTTP/1.1\r\nhost: r\r\nauthorization: Bearer "
            + SECRET_A.encode()
            + b"\r\n\r\n"
        )
        (models,) = await _read_responses(s, 1)
        assert models.startswith(b"HTTP/1.1 200 ")
        assert b'"chat"' in models
        # Still open: another on the same connection.
        await s.send_all(_post(body, close=True))
        (third,) = await _read_responses(s, 1)
        assert third.startswith(b"HTTP/1.1 200 ")
        with trio.fail_after(5):
            assert await s.receive_some(100) == b""  # closed as asked
        await s.aclose()

        s = await trio.open_tcp_stream("127.0.0.1", r.port)
        await s.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        with trio.fail_after(5):
            reply = await s.receive_some(65536)
        assert reply.startswith(b"HTTP/1.1 400 ")
        await s.aclose()
        assert fe.stats()["completed"] == 2


async def test_pool_survives_an_engine_closing_idle_connections(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_KEEPALIVE": "0.3"})
    pool = Pool("127.0.0.1", fe.port, keepalive_s=30)
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "x"}]}).encode()
    t = Timeouts(connect_s=5, first_byte_s=10, idle_s=10)
    for _ in range(3):
        resp = await pool.request(b"POST", b"/v1/chat/completions", body, timeouts=t)
        assert resp.status == 200
        assert b"tok0" in await resp.read()
        resp.close()
        await trio.sleep(0.6)  # the engine drops the idle connection meanwhile
    assert fe.stats()["completed"] == 3
    assert pool.connects == 3  # each reuse found the connection closed and dialled again
    # Back to back, the connection is reused.
    for _ in range(3):
        resp = await pool.request(b"POST", b"/v1/chat/completions", body, timeouts=t)
        await resp.read()
        resp.close()
    assert pool.connects == 4
    pool.close()


async def test_pool_timeouts_and_refusals() -> None:
    dead = Pool("127.0.0.1", free_port())
    t = Timeouts(connect_s=2, first_byte_s=0.3, idle_s=0.3)
    try:
        await dead.request(b"GET", b"/", timeouts=t)
    except ConnectFailed as exc:
        assert exc.before_response
        assert "cannot connect" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("a closed port must refuse")

    async def silent(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, silent, 0)
        port = listeners[0].socket.getsockname()[1]
        pool = Pool("127.0.0.1", port)
        start = trio.current_time()
        try:
            await pool.request(b"GET", b"/", timeouts=t)
        except UpstreamTimeout as exc:
            assert exc.phase == "first_byte"
            assert exc.before_response
        else:  # pragma: no cover
            raise AssertionError("a silent server must time out")
        assert 0.25 < trio.current_time() - start < 3
        nursery.cancel_scope.cancel()
