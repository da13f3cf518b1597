"""Requests for a model at zero replicas held until its first is ready (llmgw/router/_holds.py),
through the real router on loopback: held then answered, refused past `max` or `s` with
503 and Retry-After at once, a leaving client's place freed, no hold: 503 at once."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from llmgw.router import Hold
from router.conftest import SECRET_A, SERVERS, FakeEngine, RunningRouter, sample, serve_router

AUTH = {"Authorization": f"Bearer {SECRET_A}"}


def chat(stream: bool = False) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def until(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    with trio.fail_after(timeout):
        while not (got := check()):
            await trio.sleep(0.01)
    return got


def at_zero(r: RunningRouter, hold: Hold) -> None:
    r.source.replace([], ["chat"], holds={"chat": hold})
    r.router.refresh()


def held(r: RunningRouter) -> int:
    return r.router.holds.held().get("chat", 0)


async def test_held_requests_are_answered_once_a_replica_is_ready(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "3"})
    hold = Hold(4, 60.0)
    async with serve_router([]) as r, httpx.AsyncClient(timeout=60) as h:
        at_zero(r, hold)
        # Listed while at zero: a request for it is answered, later.
        models = await h.get(r.base_url + "/models", headers=AUTH)
        assert [m["id"] for m in models.json()["data"]] == ["chat"]
        answers: list[httpx.Response] = []
        bodies: list[bytes] = []

        async def ask(stream: bool) -> None:
            resp = await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat(stream))
            answers.append(resp)
            bodies.append(resp.content)

        async with trio.open_nursery() as nursery:
            for stream in (False, True, False):
                nursery.start_soon(ask, stream)
            await until(lambda: held(r) == 3)
            assert r.router.loads()["chat"].queued == 3  # held requests wait: queued
            assert sample(r.metrics_text(), "llmgw_router_held", model="chat") == 3.0
            await trio.sleep(0.5)
            assert answers == [] and held(r) == 3  # still held: nothing answered meanwhile
            # The replica is ready: the view gives the model its endpoint.
            r.source.replace([fe.endpoint()], ["chat"], holds={"chat": hold})
        assert sorted(a.status_code for a in answers) == [200, 200, 200]
        assert sum(b"tok0" in b for b in bodies) == 3
        assert held(r) == 0
        assert sample(r.metrics_text(), "llmgw_router_held", model="chat") == 0.0
        assert fe.stats()["completed"] == 3
        text = r.metrics_text()
        assert sample(text, "llmgw_router_requests_total", model="chat", status="200") == 3.0
        assert sample(text, "llmgw_router_requests_total", status="503") is None
        assert r.router.loads()["chat"].rejected == 0


@pytest.mark.parametrize("route", ["openai", "anthropic"])
async def test_past_hold_max_the_next_is_refused_at_once_with_retry_after(route: str) -> None:
    async with serve_router([]) as r, httpx.AsyncClient(timeout=60) as h:
        at_zero(r, Hold(2, 30.0))

        async def ask() -> None:
            await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)
            await until(lambda: held(r) == 2)
            start = trio.current_time()
            if route == "anthropic":
                msgs = [{"role": "user", "content": "x"}]
                body = {"model": "chat", "max_tokens": 5, "messages": msgs}
                third = await h.post(r.base_url + "/messages", headers=AUTH, json=body)
            else:
                third = await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat())
            took = trio.current_time() - start
            nursery.cancel_scope.cancel()
        assert third.status_code == 503
        assert took < 2.0, took  # at once, not after a wait
        # When the oldest held request's hold ends (30 s, less what it has waited).
        assert 20 <= int(third.headers["retry-after"]) <= 30
        error = third.json()
        if route == "anthropic":
            assert error["type"] == "error"
            assert error["error"]["type"] == "overloaded_error"
            message = error["error"]["message"]
        else:
            assert error["error"]["code"] == "no_ready_replica"
            assert error["error"]["type"] == "service_unavailable"
            message = error["error"]["message"]
        assert "'chat'" in message and "hold_max 2" in message
        text = r.metrics_text()
        assert sample(text, "llmgw_router_hold_refused_total", model="chat", reason="full") == 1.0
        assert r.router.loads()["chat"].rejected == 1


async def test_a_request_held_past_hold_s_gets_503_with_retry_after() -> None:
    async with serve_router([]) as r, httpx.AsyncClient(timeout=60) as h:
        at_zero(r, Hold(4, 0.5))
        start = trio.current_time()
        resp = await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat())
        took = trio.current_time() - start
        assert resp.status_code == 503
        assert 0.45 <= took < 3.0, took
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "no_ready_replica"
        assert "0.5 s (hold_s)" in resp.json()["error"]["message"]
        assert held(r) == 0
        text = r.metrics_text()
        assert sample(text, "llmgw_router_hold_refused_total", model="chat", reason="timeout") == 1
        assert r.router.loads()["chat"].rejected == 1


@SERVERS
async def test_a_client_that_leaves_while_held_frees_its_place(
    start_engine: Callable[..., FakeEngine], server: str
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "2"})
    hold = Hold(1, 60.0)
    async with serve_router([], server=server) as r, httpx.AsyncClient(timeout=60) as h:
        at_zero(r, hold)
        client = await trio.open_tcp_stream("127.0.0.1", r.port)
        body = json.dumps(chat()).encode()
        await client.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n"
            b"content-type: application/json\r\nauthorization: Bearer %s\r\n"
            b"content-length: %d\r\n\r\n%s" % (SECRET_A.encode(), len(body), body)
        )
        await until(lambda: held(r) == 1)
        await client.aclose()  # leaves while held
        await until(lambda: held(r) == 0)
        # Its place is free: the next is held (not refused as full), then answered.
        answer: list[httpx.Response] = []

        async def ask() -> None:
            answer.append(await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await until(lambda: held(r) == 1)
            r.source.replace([fe.endpoint()], ["chat"], holds={"chat": hold})
        assert answer[0].status_code == 200
        text = r.metrics_text()
        assert sample(text, "llmgw_router_hold_refused_total", model="chat", reason="full") is None
        await until(
            lambda: sample(r.metrics_text(), "llmgw_router_requests_total", status="499") == 1.0
        )


async def test_without_a_hold_a_model_at_zero_is_503_at_once() -> None:
    async with serve_router([], models=["chat"]) as r, httpx.AsyncClient(timeout=60) as h:
        models = await h.get(r.base_url + "/models", headers=AUTH)
        assert models.json()["data"] == []  # not listed: nothing would answer it
        start = trio.current_time()
        resp = await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat())
        assert trio.current_time() - start < 2.0
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "5"
        assert resp.json()["error"]["code"] == "no_ready_replica"
        assert "no replica of it is ready" in resp.json()["error"]["message"]
        assert held(r) == 0 and r.router.loads()["chat"].rejected == 1
        assert "llmgw_router_held{" not in r.metrics_text()  # no hold: no series
