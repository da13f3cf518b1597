"""Through the router to fake engines: streaming, failing replicas, hangs, disconnects, fairness."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import trio

from llmgw.router._types import Endpoint
from llmgw.testing.cluster import free_port
from router.conftest import (
    SECRET_A,
    SECRET_B,
    SERVERS,
    FakeEngine,
    sample,
    serve_router,
)

AUTH_A = {"Authorization": f"Bearer {SECRET_A}"}
AUTH_B = {"Authorization": f"Bearer {SECRET_B}"}


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "chat",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": stream,
        **extra,
    }


async def until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    with trio.fail_after(timeout):
        while not (result := check()):
            await trio.sleep(0.02)
    return result


async def test_chunks_reach_the_client_as_the_engine_sends_them(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "6", "LLMGW_FAKE_TOKEN_DELAY": "0.3"})
    async with serve_router([fe.endpoint()]) as r, httpx.AsyncClient(timeout=30) as h:
        arrivals: list[tuple[float, str]] = []
        engine_when_first: dict[str, Any] = {}
        start = trio.current_time()
        async with h.stream(
            "POST", r.base_url + "/chat/completions", headers=AUTH_A, json=chat(True)
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                arrivals.append((trio.current_time() - start, line[6:]))
                content = [
                    json.loads(d)["choices"][0]["delta"].get("content")
                    for _, d in arrivals
                    if d != "[DONE]"
                ]
                if "tok0" in content and not engine_when_first:
                    engine_when_first.update(await trio.to_thread.run_sync(fe.stats))
        tokens = [json.loads(d)["choices"][0]["delta"].get("content") for _, d in arrivals[1:-1]]
        assert tokens == ["tok0", " tok1", " tok2", " tok3", " tok4", " tok5"]
        assert arrivals[-1][1] == "[DONE]"
        # When tok0 arrived, the engine was still generating: nothing was buffered.
        assert engine_when_first["completed"] == 0
        assert engine_when_first["running"] == 1
        # Chunks arrived spread over the generation (5 gaps of 0.3 s), not in one burst.
        first_token_at = arrivals[1][0]
        last_token_at = arrivals[-2][0]
        assert last_token_at - first_token_at > 1.0


async def test_a_refusing_replica_sends_requests_elsewhere_and_opens_its_breaker(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat")
    dead = Endpoint("dead", "chat", "vllm", "127.0.0.1", free_port())
    # No scraper (run=False): both endpoints' load is unknown, so both are chosen,
    # and it is the breaker, not the health check, that takes the dead one out.
    async with (
        serve_router(
            [dead, fe.endpoint("live")], run=False, breaker_failures=2, breaker_open_s=60.0
        ) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        for _ in range(12):
            resp = await h.post(r.base_url + "/chat/completions", headers=AUTH_A, json=chat())
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["message"]["content"].startswith("tok0")
        assert fe.stats()["completed"] == 12
        states = r.router.endpoint_states()
        assert states["dead"].breaker.state.value == "open"
        assert states["live"].breaker.state.value == "closed"
        text = r.metrics_text()
        state_metric = "llmgw_router_endpoint_breaker_state"
        assert sample(text, state_metric, endpoint="dead", state="open") == 1.0
        assert sample(text, state_metric, endpoint="dead", state="closed") == 0.0
        assert sample(text, "llmgw_router_retries_total", model="chat") == 2.0
        failures = "llmgw_router_upstream_failures_total"
        assert sample(text, failures, endpoint="dead", phase="connect") == 2.0


async def test_a_5xx_before_the_first_byte_is_retried_on_another_replica(
    start_engine: Callable[..., FakeEngine],
) -> None:
    bad = start_engine("chat", env={"LLMGW_FAKE_FAIL_RATE": "1"})
    good = start_engine("chat")
    async with (
        serve_router([bad.endpoint("bad"), good.endpoint("good")], run=False, retries=1) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        for _ in range(6):
            resp = await h.post(r.base_url + "/chat/completions", headers=AUTH_A, json=chat())
            assert resp.status_code == 200
        assert good.stats()["completed"] == 6
        assert bad.stats()["failed"] >= 1
        # With retries=0 and only the failing replica, its 500 reaches the client unchanged.
    async with (
        serve_router([bad.endpoint("bad")], run=False, retries=0) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        resp = await h.post(r.base_url + "/chat/completions", headers=AUTH_A, json=chat())
        assert resp.status_code == 500
        assert "EngineCore" in resp.json()["error"]["message"]


@SERVERS
async def test_a_replica_that_hangs_mid_stream_times_out_and_frees_the_slot(
    start_engine: Callable[..., FakeEngine], server: str
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_HANG_AFTER_TOKENS": "2"})
    async with (
        serve_router([fe.endpoint()], idle_timeout_s=1.0, server=server) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        lines: list[str] = []
        start = trio.current_time()
        broken: Exception | None = None
        try:
            async with h.stream(
                "POST", r.base_url + "/chat/completions", headers=AUTH_A, json=chat(True)
            ) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line:
                        lines.append(line)
        except httpx.RemoteProtocolError as exc:  # the stream was cut, not ended
            broken = exc
        elapsed = trio.current_time() - start
        assert broken is not None
        assert 0.9 < elapsed < 10
        assert [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in lines[1:3]] == [
            "tok0",
            " tok1",
        ]
        error = json.loads(lines[-1][6:])["error"]
        assert error["code"] == "idle"
        assert "1 s" in error["message"]
        model = r.router.models()["chat"]
        assert model.admission.in_flight == 0
        assert r.router.endpoint_states()[fe.endpoint().endpoint_id].in_flight == 0
        # The upstream connection was closed: the engine gave the request up.
        stats = await until(lambda: (s := fe.stats())["cancelled"] == 1 and s)
        assert stats["in_flight"] == 0
        assert sample(r.metrics_text(), "llmgw_router_requests_total", status="504") == 1.0


async def test_the_openai_client_sees_the_mid_stream_error(
    start_engine: Callable[..., FakeEngine],
) -> None:
    import openai

    fe = start_engine("chat", env={"LLMGW_FAKE_HANG_AFTER_TOKENS": "1"})
    async with serve_router([fe.endpoint()], idle_timeout_s=0.5) as r:
        with openai.OpenAI(base_url=r.base_url, api_key=SECRET_A, max_retries=0) as c:

            def run() -> tuple[list[str], BaseException | None]:
                got: list[str] = []
                try:
                    for ch in c.chat.completions.create(**chat(True)):
                        got.append(ch.choices[0].delta.content or "")
                except (openai.APIError, httpx.HTTPError) as exc:
                    return got, exc
                return got, None

            got, exc = await trio.to_thread.run_sync(run)
        assert got == ["", "tok0"]
        assert isinstance(exc, openai.APIError)
        assert "mid-response" in str(exc)


@SERVERS
async def test_a_client_that_disconnects_cancels_the_engine_request(
    start_engine: Callable[..., FakeEngine], server: str
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "50", "LLMGW_FAKE_TOKEN_DELAY": "0.1"})
    async with serve_router([fe.endpoint()], server=server) as r:
        client = await trio.open_tcp_stream("127.0.0.1", r.port)
        body = json.dumps(chat(True)).encode()
        await client.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n"
            b"content-type: application/json\r\nauthorization: Bearer %s\r\n"
            b"content-length: %d\r\n\r\n%s" % (SECRET_A.encode(), len(body), body)
        )
        received = b""
        with trio.fail_after(10):
            while b"tok1" not in received:
                received += await client.receive_some(65536)
        assert received.startswith(b"HTTP/1.1 200")
        await client.aclose()  # leave mid-stream
        stats = await until(lambda: (s := fe.stats())["cancelled"] == 1 and s)
        assert stats["completed"] == 0
        assert stats["in_flight"] == 0
        await until(lambda: r.router.models()["chat"].admission.in_flight == 0)
        assert r.router.endpoint_states()[fe.endpoint().endpoint_id].in_flight == 0
        await until(
            lambda: sample(r.metrics_text(), "llmgw_router_requests_total", status="499") == 1.0
        )


async def test_a_client_that_leaves_a_non_streamed_request_cancels_it(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_FIRST_TOKEN_DELAY": "30"})
    async with serve_router([fe.endpoint()]) as r, httpx.AsyncClient(timeout=30) as h:
        with trio.move_on_after(0.5):
            await h.post(r.base_url + "/chat/completions", headers=AUTH_A, json=chat())
        stats = await until(lambda: (s := fe.stats())["cancelled"] == 1 and s)
        assert stats["completed"] == 0
        await until(lambda: r.router.models()["chat"].admission.in_flight == 0)


async def test_two_tenants_in_one_band_both_make_progress(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine(
        "chat", env={"LLMGW_FAKE_TOKENS": "2", "LLMGW_FAKE_FIRST_TOKEN_DELAY": "0.05"}
    )
    done = {"tenant-a": 0, "tenant-b": 0}
    async with serve_router([fe.endpoint()], concurrency=2, queue_limit=1000) as r:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as h:
            # Each loop stops asking at the deadline and lets its last request finish:
            # cancelling a client mid-request is another test's subject.
            deadline = trio.current_time() + 4

            async def loop(tenant: str, headers: dict[str, str]) -> None:
                while trio.current_time() < deadline:
                    resp = await h.post(
                        r.base_url + "/chat/completions", headers=headers, json=chat()
                    )
                    assert resp.status_code == 200
                    done[tenant] += 1

            async with trio.open_nursery() as nursery:
                for _ in range(20):  # tenant a keeps 10x the requests of b waiting
                    nursery.start_soon(loop, "tenant-a", AUTH_A)
                for _ in range(2):
                    nursery.start_soon(loop, "tenant-b", AUTH_B)
        total = done["tenant-a"] + done["tenant-b"]
        assert total > 20
        # First come, first served would give b about 2 of every 22 admissions; turns
        # between tenants give it about one in two while both wait.
        assert done["tenant-b"] / total > 0.3, done
        assert done["tenant-a"] / total > 0.3, done
