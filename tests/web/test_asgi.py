"""llmgw.web.asgi: the lifespan loop over real trio channels, and the JSON answer."""

from __future__ import annotations

import json
from typing import Any

import trio

from llmgw.web.asgi import HttpError, Message, lifespan, send_json


class _Server:
    """The server's side of a lifespan exchange: what it sends, what it was answered."""

    def __init__(self) -> None:
        self.to_app, self._receive = trio.open_memory_channel[Message](8)
        self._send, self.from_app = trio.open_memory_channel[Message](8)

    async def receive(self) -> Message:
        return await self._receive.receive()

    async def send(self, message: Message) -> None:
        await self._send.send(message)

    async def ask(self, kind: str) -> Message:
        await self.to_app.send({"type": kind})
        with trio.fail_after(5):
            return await self.from_app.receive()


async def test_startup_then_shutdown_are_answered_complete_and_the_loop_returns() -> None:
    server = _Server()
    ran: list[str] = []

    async def startup() -> None:
        ran.append("startup")

    async def shutdown() -> None:
        ran.append("shutdown")

    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def run() -> None:
            await lifespan(server.receive, server.send, startup=startup, shutdown=shutdown)
            done.set()

        nursery.start_soon(run)
        assert await server.ask("lifespan.startup") == {"type": "lifespan.startup.complete"}
        assert ran == ["startup"]
        assert await server.ask("lifespan.shutdown") == {"type": "lifespan.shutdown.complete"}
        with trio.fail_after(5):
            await done.wait()
    assert ran == ["startup", "shutdown"]


async def test_without_hooks_it_answers_as_the_apps_always_did() -> None:
    server = _Server()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lifespan, server.receive, server.send)
        assert await server.ask("lifespan.startup") == {"type": "lifespan.startup.complete"}
        assert await server.ask("lifespan.shutdown") == {"type": "lifespan.shutdown.complete"}


async def test_a_startup_hook_that_raises_answers_startup_failed_with_its_message() -> None:
    server = _Server()

    async def startup() -> None:
        raise RuntimeError("the key store at /var/lib/llmgw/keys.db is locked")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: lifespan(server.receive, server.send, startup=startup))
        assert await server.ask("lifespan.startup") == {
            "type": "lifespan.startup.failed",
            "message": "the key store at /var/lib/llmgw/keys.db is locked",
        }
    # the loop returned: the nursery closed without a shutdown message


async def test_a_shutdown_hook_that_raises_answers_shutdown_failed_with_its_message() -> None:
    server = _Server()

    async def shutdown() -> None:
        raise RuntimeError("usage flush: the store did not answer in 5 s")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: lifespan(server.receive, server.send, shutdown=shutdown))
        assert await server.ask("lifespan.startup") == {"type": "lifespan.startup.complete"}
        assert await server.ask("lifespan.shutdown") == {
            "type": "lifespan.shutdown.failed",
            "message": "usage flush: the store did not answer in 5 s",
        }


async def _answer(status: int, body: Any, **kw: Any) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await send_json(send, status, body, **kw)
    return sent


async def test_send_json_answers_status_content_type_length_and_body() -> None:
    start, body = await _answer(409, {"error": {"message": "standby", "code": 409}})
    data = b'{"error": {"message": "standby", "code": 409}}'
    assert start == {
        "type": "http.response.start",
        "status": 409,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))],
    }
    assert body == {"type": "http.response.body", "body": data}
    assert json.loads(body["body"]) == {"error": {"message": "standby", "code": 409}}


async def test_send_json_sends_bytes_as_rendered_and_headers_after_its_own() -> None:
    start, body = await _answer(200, b'{"status":"ok"}', headers=((b"retry-after", b"3"),))
    assert start["headers"] == [
        (b"content-type", b"application/json"),
        (b"content-length", b"15"),
        (b"retry-after", b"3"),
    ]
    assert body["body"] == b'{"status":"ok"}'


def test_http_error_carries_status_message_and_headers() -> None:
    exc = HttpError(405, "POST /healthz: only GET", headers=((b"allow", b"GET"),))
    assert (exc.status, str(exc), exc.headers) == (
        405,
        "POST /healthz: only GET",
        ((b"allow", b"GET"),),
    )
    assert HttpError(404, "no node 'n1'").headers == ()
