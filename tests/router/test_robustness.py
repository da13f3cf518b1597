"""The router against bad input and bad engines: hostile JSON, replies that are not HTTP,
bodies that hang or break after the head, and one model's own GET."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import trio

from llmgw.router._types import Endpoint
from router.conftest import (
    SECRET_A,
    SECRET_LIMITED,
    SERVERS,
    FakeEngine,
    sample,
    serve_router,
)

AUTH = {"Authorization": f"Bearer {SECRET_A}"}
FAILURES = "llmgw_router_upstream_failures_total"


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


# --- scripted engines: a listener that answers each request with the bytes it is given --


async def _read_request(stream: trio.SocketStream) -> bool:
    """Read one whole request (head and Content-Length body); False at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return False
        body += chunk
    return True


Script = Callable[[trio.SocketStream], Awaitable[None]]


@asynccontextmanager
async def scripted_engine(script: Script) -> AsyncIterator[tuple[int, list[int]]]:
    """An engine on loopback that runs `script` after each request it reads, then closes.

    Yields its port and a list that gets one entry per request it has read.
    """
    seen: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(30):
                if await _read_request(stream):
                    seen.append(1)
                    await script(stream)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        yield port, seen
        nursery.cancel_scope.cancel()


def replies(data: bytes) -> Script:
    async def script(stream: trio.SocketStream) -> None:
        await stream.send_all(data)

    return script


# --- bad JSON ----------------------------------------------------------------------------

DEEP_ARRAY = b"[" * 1000 + b"]" * 1000  # 2 KB, 1,000 levels: the body
BAD_BODIES = {
    "1000 nested arrays": DEEP_ARRAY,
    "1000 nested arrays in a field": b'{"model": "chat", "messages": ' + DEEP_ARRAY + b"}",
    "1000 nested objects": b'{"a": ' * 1000 + b"1" + b"}" * 1000,
    "100000 opening brackets": b"[" * 100_000,
    "an integer of 5000 digits": b'{"model": "chat", "messages": [], "n": ' + b"7" * 5000 + b"}",
    "not UTF-8": b'{"model": "\xff\xfe", "messages": []}',
    "a top-level array": b'[{"model": "chat"}]',
    "truncated": b'{"model": "chat", "messages": [{"role": ',
    "NUL bytes": b"\x00" * 64,
}


@SERVERS
async def test_bad_json_of_any_shape_is_a_400_in_openai_shape_and_logs_no_traceback(
    start_engine: Callable[..., FakeEngine], server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the fix the 1,000-deep body hit RecursionError in json.loads: a plain-text
    500 "internal error" and a logged traceback per request."""
    caplog.set_level(logging.DEBUG)
    fe = start_engine("chat")
    async with (
        serve_router([fe.endpoint()], server=server) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        for what, body in BAD_BODIES.items():
            resp = await h.post(
                r.base_url + "/chat/completions",
                headers={**AUTH, "content-type": "application/json"},
                content=body,
            )
            assert resp.status_code == 400, (what, resp.status_code, resp.text)
            assert resp.headers["content-type"] == "application/json", what
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "code", "param"}, what
            assert (error["type"], error["code"], error["param"]) == (
                "invalid_request_error",
                "invalid_json",
                None,
            ), what
        deep = (
            await h.post(r.base_url + "/chat/completions", headers=AUTH, content=DEEP_ARRAY)
        ).json()
        assert "more than 128 levels deep" in deep["error"]["message"]
        assert "max_json_depth" in deep["error"]["message"]
        # A body nested as deep as a real tool schema, with brackets inside its strings
        # (which do not nest), still goes through.
        schema: Any = {"type": "string", "description": "[[[[ {{{{ " * 50}
        for _ in range(30):
            schema = {"type": "object", "properties": {"x": schema}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        ok = await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat(tools=tools))
        assert ok.status_code == 200, ok.text
    assert fe.stats()["received"] == 1  # none of the bad bodies reached the engine
    tracebacks = [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]
    assert tracebacks == []


async def test_the_depth_limit_is_configurable_and_bounded() -> None:
    from llmgw.config import BoundError
    from llmgw.router._router import RouterConfig

    assert RouterConfig(max_json_depth=4).max_json_depth == 4
    with pytest.raises(BoundError, match="max_json_depth"):
        RouterConfig(max_json_depth=100_000)


# --- replies that are not HTTP, before anything reached the client -----------------------

GARBAGE = {
    "not HTTP at all": (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "protocol"),
    "a bad Content-Length": (
        b"HTTP/1.1 200 OK\r\ncontent-length: lots\r\n\r\n{}",
        "protocol",
    ),
    "a head cut short": (b"HTTP/1.1 200 OK\r\ncontent-ty", "protocol"),
    "a whole answer cut short": (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{",
        "mid_body",
    ),
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_an_engine_reply_that_is_not_http_is_retried_on_another_endpoint(
    start_engine: Callable[..., FakeEngine], garbage: str
) -> None:
    """Before the fix these were 502s (3 of 16 in the issue) though nothing had reached
    the client: only failures with no byte of a reply at all were retried."""
    data, phase = GARBAGE[garbage]
    good = start_engine("chat")
    async with scripted_engine(replies(data)) as (port, seen):
        bad = Endpoint("bad", "chat", "vllm", "127.0.0.1", port)
        # No scraper: both loads unknown, so the choice is random and both get chosen.
        async with (
            serve_router([bad, good.endpoint("good")], run=False, breaker_failures=100) as r,
            httpx.AsyncClient(timeout=30) as h,
        ):
            for i in range(16):
                resp = await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat())
                assert resp.status_code == 200, (i, resp.text)
                assert resp.json()["choices"][0]["message"]["content"].startswith("tok0")
            text = r.metrics_text()
        assert len(seen) >= 3  # the bad endpoint was chosen, and every time the client got 200
        assert good.stats()["completed"] == 16
        assert sample(text, FAILURES, endpoint="bad", phase=phase) == len(seen)
        assert sample(text, "llmgw_router_retries_total", model="chat") == len(seen)


# --- failures after the first byte: counted by phase, and heard by the breaker ------------


async def _stream_once(h: httpx.AsyncClient, url: str) -> str:
    """One streamed chat; "ok" when it ended with [DONE], else the error code sent."""
    lines: list[str] = []
    try:
        async with h.stream("POST", url, headers=AUTH, json=chat(True)) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
    except httpx.RemoteProtocolError:
        pass  # the router cuts a broken stream after its error event
    if lines and lines[-1] == "data: [DONE]":
        return "ok"
    return str(json.loads(lines[-1][6:])["error"]["code"])


async def test_an_engine_that_hangs_mid_stream_is_counted_and_its_breaker_opens(
    start_engine: Callable[..., FakeEngine],
) -> None:
    """Before the fix the hang was in no failure count, and every head had been a success
    for the breaker: an engine that always hangs mid-stream kept its full share."""
    hang = start_engine("chat", env={"LLMGW_FAKE_HANG_AFTER_TOKENS": "1"})
    good = start_engine("chat")
    async with (
        serve_router(
            [hang.endpoint("hang"), good.endpoint("good")],
            run=False,
            idle_timeout_s=0.3,
            breaker_failures=2,
            breaker_open_s=600.0,
        ) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        outcomes = [await _stream_once(h, r.base_url + "/chat/completions") for _ in range(24)]
        states = r.router.endpoint_states()
        text = r.metrics_text()
    # Two broken streams (the threshold), then nothing more was sent to that engine.
    assert outcomes.count("idle") == 2, outcomes
    assert outcomes.count("ok") == 22
    assert hang.stats()["received"] == 2
    assert good.stats()["completed"] == 22
    assert states["hang"].breaker.state.value == "open"
    assert states["hang"].breaker.statistics()["broken_total"] == 2
    assert states["good"].breaker.state.value == "closed"
    assert sample(text, FAILURES, endpoint="hang", phase="idle") == 2.0
    assert sample(text, FAILURES, endpoint="good") is None
    assert sample(text, "llmgw_router_endpoint_breaker_state", endpoint="hang", state="open") == 1.0


async def test_a_stream_cut_mid_body_is_counted_as_mid_body() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "tok0"}}]}\n\n'
    cut = head + b"%x\r\n%s\r\n" % (len(event), event)  # one chunk, then the connection closes
    async with scripted_engine(replies(cut)) as (port, seen):
        ep = Endpoint("cut", "chat", "vllm", "127.0.0.1", port)
        async with (
            serve_router([ep], run=False, breaker_failures=2) as r,
            httpx.AsyncClient(timeout=30) as h,
        ):
            url = r.base_url + "/chat/completions"
            assert [await _stream_once(h, url) for _ in range(2)] == ["mid_body", "mid_body"]
            third = await h.post(url, headers=AUTH, json=chat(True))
            text = r.metrics_text()
    assert len(seen) == 2
    assert third.status_code == 503  # its breaker is open: nothing else to send it to
    assert sample(text, FAILURES, endpoint="cut", phase="mid_body") == 2.0
    assert sample(text, "llmgw_router_requests_total", model="chat", status="502") == 2.0


# --- GET /v1/models/{model} -------------------------------------------------------------


async def test_one_model_is_retrieved_in_openai_shape_and_unknown_ones_are_404(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat")
    # A served name with a slash and a colon, as Hugging Face names and tags have them.
    slashy = Endpoint("slashy", "org/chat:v1", "vllm", "127.0.0.1", fe.port)
    async with serve_router([slashy], models=["idle"]) as r:

        def run() -> tuple[Any, ...]:
            with openai.OpenAI(base_url=r.base_url, api_key=SECRET_A, max_retries=0) as c:
                found = c.models.retrieve("org/chat:v1")
                errors = []
                for name in ("nope", "idle"):  # unknown; known with no ready replica
                    try:
                        c.models.retrieve(name)
                    except openai.NotFoundError as exc:
                        errors.append(exc)
            with openai.OpenAI(base_url=r.base_url, api_key=SECRET_LIMITED, max_retries=0) as c:
                try:  # a key that may use only "chat" cannot see that this name exists
                    c.models.retrieve("org/chat:v1")
                except openai.NotFoundError as exc:
                    errors.append(exc)
            return found, errors

        found, errors = await trio.to_thread.run_sync(run)
    assert (found.id, found.object, found.owned_by) == ("org/chat:v1", "model", "llmgw")
    assert len(errors) == 3
    for exc in errors:
        assert exc.status_code == 404
        assert exc.body is not None
        assert exc.body["code"] == "model_not_found"  # type: ignore[index]
        assert exc.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert "'nope'" in errors[0].message
