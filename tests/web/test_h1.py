"""The shared HTTP/1.1 client parts: bounded reads, the response head, header lookups."""

from __future__ import annotations

import h11
import pytest
import trio
import trio.testing

from llmgw.web.h1 import Broken, Quiet, body_length, header, read_head, receive


async def test_read_head_skips_an_informational_answer_and_keeps_the_body() -> None:
    client, server = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    await client.send_all(conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")])))
    await server.send_all(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b'HTTP/1.1 200 OK\r\ncontent-length: 5\r\netag: "1"\r\n\r\nhello'
    )
    event = await read_head(conn, client, 1.0)
    assert (event.status_code, event.reason) == (200, b"OK")
    assert header(event.headers, b"etag") == b'"1"'
    assert header(event.headers, b"missing") is None
    data = conn.next_event()
    assert isinstance(data, h11.Data) and bytes(data.data) == b"hello"


async def test_a_close_before_the_head_is_a_protocol_error() -> None:
    client, server = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    await client.send_all(conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")])))
    await server.aclose()
    with pytest.raises(h11.RemoteProtocolError, match="ConnectionClosed"):
        await read_head(conn, client, 1.0)


async def test_receive_is_bounded_in_time(autojump_clock: trio.testing.MockClock) -> None:
    client, _server = trio.testing.memory_stream_pair()
    start = trio.current_time()
    with pytest.raises(Quiet):
        await receive(client, 7.0)
    assert trio.current_time() - start == pytest.approx(7.0)


async def test_receive_says_a_broken_stream_in_one_line() -> None:
    client, _server = trio.testing.memory_stream_pair()
    await client.aclose()
    with pytest.raises(Broken):
        await receive(client, 1.0)


@pytest.mark.parametrize(
    ("status", "headers", "length"),
    [
        (200, {"content-length": "12"}, 12),
        (200, {"content-length": "12", "transfer-encoding": "chunked"}, None),
        (204, {"content-length": "12"}, None),
        (304, {"content-length": "12"}, None),
        (200, {}, None),
        (200, {"content-length": "-1"}, None),
    ],
)
def test_body_length_only_when_content_length_frames_the_body(
    status: int, headers: dict[str, str], length: int | None
) -> None:
    assert body_length(status, headers) == length
