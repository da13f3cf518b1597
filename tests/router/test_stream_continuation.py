"""Through the router to fake engines: a stream cut after its head is continued on another
endpoint, or ends with the final error event in its API's shape, counted either way
(Anthropic's shape on /v1/messages: tests/router/test_surface.py).

The fake engine writes the same text whatever its prompt, so these tests check the
splice (one id, one role, one finish, one [DONE], the request the second engine got)
and the counting; that the joined text equals an uninterrupted run's is shown on a
real llama-server (tests/integration/test_stream_continuation_e2e.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import trio

from router.conftest import SECRET_A, FakeEngine, sample, serve_router

AUTH_A = {"Authorization": f"Bearer {SECRET_A}"}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "chat",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "temperature": 0,
        "max_tokens": 8,
        **extra,
    }


async def until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    with trio.fail_after(timeout):
        while not (result := check()):
            await trio.sleep(0.02)
    return result


async def read_stream(
    h: httpx.AsyncClient, url: str, body: dict[str, Any], on_first: Callable[[], Any]
) -> tuple[list[bytes], bool]:
    """The SSE events the client got, and whether the connection was cut."""
    got: list[bytes] = []
    called = False
    try:
        async with h.stream("POST", url, headers=AUTH_A, json=body) as resp:
            assert resp.status_code == 200
            buf = b""
            async for raw in resp.aiter_raw():
                buf += raw
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    got.append(event)
                    if not called and b"tok0" in event:
                        called = True
                        await on_first()
    except httpx.RemoteProtocolError:
        return got, True
    return got, False


def payloads(events: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        data = e.split(b"data: ", 1)[1]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def test_a_cut_greedy_chat_stream_is_continued_on_another_endpoint(
    start_engine: Callable[..., FakeEngine],
) -> None:
    hanging = start_engine("chat", engine="llama-server", env={"LLMGW_FAKE_HANG_AFTER_TOKENS": "2"})
    healthy = start_engine("chat", engine="llama-server")
    async with (
        serve_router([hanging.endpoint()], idle_timeout_s=2.0, scrape_interval_s=0.1) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):

        async def second_endpoint() -> None:
            # Only now is there another endpoint: the first request went to the hanging one.
            r.source.replace([hanging.endpoint(), healthy.endpoint()])
            await until(lambda: healthy.endpoint().endpoint_id in r.router.endpoint_states())

        events, cut = await read_stream(
            h,
            r.base_url + "/chat/completions",
            chat(stream_options={"include_usage": True}),
            second_endpoint,
        )
        assert not cut
        got = payloads(events)
        assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
        chunks = [c for c in got[:-1] if isinstance(c, dict)]
        assert all("error" not in c for c in chunks), chunks
        assert len({c["id"] for c in chunks}) == 1
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert [d for d in deltas if "role" in d] == [deltas[0]]  # one role, the first's
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert len([f for f in finishes if f]) == 1
        text = "".join(d.get("content") or "" for d in deltas)
        # The hanging engine's two tokens, then the fake's fixed text from the healthy
        # one, asked for the 6 tokens left (a real engine would go on from the prefill).
        assert text == "tok0 tok1" + "tok0 tok1 tok2 tok3 tok4 tok5"
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage[-1]["completion_tokens"] == 2 + 6
        stats = healthy.stats()
        assert stats["completed"] == 1
        metrics = r.metrics_text()
        labels = {"model": "chat", "api": "openai"}
        assert sample(metrics, "llmgw_router_stream_cuts_total", outcome="continued", **labels) == 1
        assert sample(metrics, "llmgw_router_requests_total", status="200") == 1


async def test_a_stream_that_may_not_be_continued_ends_with_the_error_event(
    start_engine: Callable[..., FakeEngine],
) -> None:
    hanging = start_engine("chat", engine="llama-server", env={"LLMGW_FAKE_HANG_AFTER_TOKENS": "2"})
    healthy = start_engine("chat", engine="llama-server")
    async with (
        serve_router(
            [hanging.endpoint()], idle_timeout_s=1.0, scrape_interval_s=0.1, retries=2
        ) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):

        async def second_endpoint() -> None:
            r.source.replace([hanging.endpoint(), healthy.endpoint()])
            await until(lambda: healthy.endpoint().endpoint_id in r.router.endpoint_states())

        for body, reason in ((chat(n=2), "n"), (chat(logprobs=True), "logprobs")):
            r.source.replace([hanging.endpoint()])
            await until(lambda: len(r.router.endpoint_states()) == 1)
            events, cut = await read_stream(
                h, r.base_url + "/chat/completions", body, second_endpoint
            )
            assert cut  # never taken for a complete answer
            got = payloads(events)
            assert "[DONE]" not in got
            error = got[-1]["error"]
            assert error["type"] == "upstream_error" and error["code"] == "idle"
            assert "mid-response" in error["message"]
            metrics = r.metrics_text()
            assert (
                sample(
                    metrics,
                    "llmgw_router_stream_cuts_total",
                    model="chat",
                    api="openai",
                    outcome="error",
                    reason=reason,
                )
                == 1
            )
        assert healthy.stats()["received"] == 0  # nothing was sent to be continued


async def test_a_greedy_stream_with_nowhere_to_continue_ends_with_the_error_event(
    start_engine: Callable[..., FakeEngine],
) -> None:
    hanging = start_engine("chat", engine="llama-server", env={"LLMGW_FAKE_HANG_AFTER_TOKENS": "2"})
    sglang = start_engine("chat", engine="sglang")
    async with (
        serve_router([hanging.endpoint()], idle_timeout_s=1.0, scrape_interval_s=0.1) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):

        async def nothing() -> None:
            pass

        async def sglang_too() -> None:
            # SGLang's chat has no prefill llmgw relies on: it is not sent the rest.
            r.source.replace([hanging.endpoint(), sglang.endpoint()])
            await until(lambda: sglang.endpoint().endpoint_id in r.router.endpoint_states())

        url = r.base_url + "/chat/completions"
        for on_first, reason, words in (
            (nothing, "no_replica", "no other endpoint could continue it"),
            (sglang_too, "engine", "no other replica's engine can continue a chat answer"),
        ):
            events, cut = await read_stream(h, url, chat(), on_first)
            assert cut
            error = payloads(events)[-1]["error"]
            assert error["code"] == "idle" and words in error["message"], error
            labels = {"model": "chat", "api": "openai", "outcome": "error", "reason": reason}
            assert sample(r.metrics_text(), "llmgw_router_stream_cuts_total", **labels) == 1
        assert sglang.stats()["received"] == 0
