"""The router through the official `openai` client: answers, streams and every error status."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import trio

from router.conftest import (
    SECRET_A,
    SECRET_LIMITED,
    SERVERS,
    FakeEngine,
    RunningRouter,
    sample,
    serve_router,
)

_clients: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def client(r: RunningRouter, key: str = SECRET_A, **kw: Any) -> openai.OpenAI:
    c = openai.OpenAI(base_url=r.base_url, api_key=key, max_retries=0, timeout=30, **kw)
    _clients.append(c)
    return c


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def test_chat_completions_and_models(start_engine: Callable[..., FakeEngine]) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "5"})
    emb = start_engine("embed", engine="llama-server")
    async with serve_router([fe.endpoint(), emb.endpoint()], models=["ghost"]) as r:
        c = client(r)
        answer = await in_thread(
            lambda: c.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hello there"}]
            )
        )
        assert answer.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4"
        assert answer.model == "chat"
        assert answer.usage is not None and answer.usage.completion_tokens == 5

        models = await in_thread(lambda: c.models.list())
        # "ghost" is known but has no replica: not listed.
        assert sorted(m.id for m in models.data) == ["chat", "embed"]
        limited = await in_thread(lambda: client(r, SECRET_LIMITED).models.list())
        assert [m.id for m in limited.data] == ["chat"]

        await _until(
            lambda: (
                sample(r.metrics_text(), "llmgw_router_requests_total", model="chat", status="200")
                == 1.0
            )
        )
        text = r.metrics_text()
        assert sample(text, "llmgw_router_completion_tokens_total", model="chat") == 5.0
        assert sample(text, "llmgw_router_prompt_tokens_total", model="chat") == 5.0


@SERVERS
async def test_streamed_chat_passes_chunks_and_usage(
    start_engine: Callable[..., FakeEngine], server: str
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "4", "LLMGW_FAKE_TOKEN_DELAY": "0.02"})
    async with serve_router([fe.endpoint()], server=server) as r:
        c = client(r)

        def run() -> list[Any]:
            stream = c.chat.completions.create(
                model="chat",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(stream)

        chunks = await in_thread(run)
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert content == "tok0 tok1 tok2 tok3"
        assert chunks[0].choices[0].delta.role == "assistant"
        finishing = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishing[-1] == "stop"
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4

        # Untouched bytes: the raw stream ends with [DONE], as the engine sent it.
        async with httpx.AsyncClient(timeout=30) as h:
            raw = await h.post(
                r.base_url + "/chat/completions",
                headers={"Authorization": f"Bearer {SECRET_A}"},
                json={
                    "model": "chat",
                    "messages": [{"role": "user", "content": "x"}],
                    "stream": True,
                },
            )
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert raw.text.endswith("data: [DONE]\n\n")
        assert raw.text.count("data: ") == 1 + 4 + 1  # role, tokens, [DONE]
        await _until(
            lambda: (
                sample(
                    r.metrics_text(), "llmgw_router_time_to_first_token_seconds_count", model="chat"
                )
                == 2.0
            )
        )


async def test_completions_and_embeddings(start_engine: Callable[..., FakeEngine]) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "3"})
    emb = start_engine("embed", engine="llama-server", env={"LLMGW_FAKE_EMBED_DIM": "8"})
    async with serve_router([fe.endpoint(), emb.endpoint()]) as r:
        c = client(r)
        done = await in_thread(lambda: c.completions.create(model="chat", prompt="once upon"))
        assert done.choices[0].text == "tok0 tok1 tok2"
        vectors = await in_thread(
            lambda: c.embeddings.create(model="embed", input=["a", "b"], encoding_format="float")
        )
        assert len(vectors.data) == 2
        assert len(vectors.data[0].embedding) == 8
        assert vectors.data[0].embedding != vectors.data[1].embedding
        assert emb.stats()["completed"] == 1


@SERVERS
async def test_error_statuses_raise_the_sdk_exceptions(
    start_engine: Callable[..., FakeEngine], server: str
) -> None:
    fe = start_engine("chat")
    other = start_engine("other")
    async with serve_router(
        [fe.endpoint(), other.endpoint()], models=["ghost"], max_body_bytes=4096, server=server
    ) as r:
        c = client(r)
        msgs = [{"role": "user", "content": "hi"}]

        with pytest.raises(openai.NotFoundError) as nf:
            await in_thread(lambda: c.chat.completions.create(model="nope", messages=msgs))
        assert nf.value.status_code == 404
        assert nf.value.code == "model_not_found"
        assert "nope" in nf.value.message

        with pytest.raises(openai.BadRequestError) as bad:
            await in_thread(lambda: c.post("/completions", cast_to=object, body={"model": "chat"}))
        assert bad.value.code == "missing_field"
        assert "prompt" in bad.value.message

        with pytest.raises(openai.BadRequestError) as bad_json:
            await in_thread(
                lambda: c.post(
                    "/chat/completions",
                    cast_to=object,
                    content=b"{not json",
                    options={"headers": {"Content-Type": "application/json"}},
                )
            )
        assert bad_json.value.code == "invalid_json"

        with pytest.raises(openai.AuthenticationError) as bad_key:
            await in_thread(
                lambda: client(r, "llmgw-wrong").chat.completions.create(
                    model="chat", messages=msgs
                )
            )
        assert bad_key.value.status_code == 401
        assert bad_key.value.code == "invalid_api_key"

        with pytest.raises(openai.AuthenticationError) as missing:
            await in_thread(
                lambda: c.chat.completions.create(
                    model="chat", messages=msgs, extra_headers={"Authorization": openai.Omit()}
                )
            )
        assert missing.value.code == "missing_api_key"

        with pytest.raises(openai.PermissionDeniedError) as denied:
            await in_thread(
                lambda: client(r, SECRET_LIMITED).chat.completions.create(
                    model="other", messages=msgs
                )
            )
        assert denied.value.status_code == 403
        assert denied.value.code == "model_not_allowed"

        with pytest.raises(openai.InternalServerError) as unavailable:
            await in_thread(lambda: c.chat.completions.create(model="ghost", messages=msgs))
        assert unavailable.value.status_code == 503
        assert unavailable.value.code == "no_ready_replica"

        with pytest.raises(openai.APIStatusError) as too_big:
            await in_thread(
                lambda: c.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "x" * 5000}]
                )
            )
        assert too_big.value.status_code == 413
        assert too_big.value.code == "request_too_large"

        await _until(
            lambda: sample(r.metrics_text(), "llmgw_router_requests_total", status="413") == 1.0
        )
        text = r.metrics_text()
        for status in ("404", "400", "401", "403", "503", "413"):
            assert (sample(text, "llmgw_router_requests_total", status=status) or 0) >= 1, status
        # A made-up model name never becomes a label.
        assert "nope" not in text
        assert fe.stats()["received"] == 0  # nothing refused reached an engine


async def test_over_capacity_is_429_with_retry_after(
    start_engine: Callable[..., FakeEngine],
) -> None:
    from llmgw.core._admission import Band

    fe = start_engine("chat", env={"LLMGW_FAKE_FIRST_TOKEN_DELAY": "3"})
    async with serve_router(
        [fe.endpoint()],
        concurrency=1,
        queue_limit=1,
        bands=[Band("interactive", 0, 0.5), Band("batch", 1, 5.0)],
    ) as r:
        c = client(r)
        msgs = [{"role": "user", "content": "hi"}]
        results: list[Any] = []

        async def slow() -> None:
            try:
                results.append(
                    await in_thread(lambda: c.chat.completions.create(model="chat", messages=msgs))
                )
            except openai.APIError as exc:  # pragma: no cover - reported below
                results.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            await _until(lambda: r.router.models()["chat"].admission.in_flight == 1)
            # The queue (limit 1) takes one; it waits out its band's 0.5 s timeout.
            start = trio.current_time()
            async with trio.open_nursery() as inner:

                async def queued() -> None:
                    with pytest.raises(openai.RateLimitError) as timeout:
                        await in_thread(
                            lambda: c.chat.completions.create(model="chat", messages=msgs)
                        )
                    results.append(("queued", trio.current_time() - start, timeout.value))

                inner.start_soon(queued)
                await _until(lambda: r.router.models()["chat"].admission.queued == 1)
                # Queue full: refused at once.
                with pytest.raises(openai.RateLimitError) as full:
                    await in_thread(lambda: c.chat.completions.create(model="chat", messages=msgs))
                assert full.value.status_code == 429
                assert int(full.value.response.headers["retry-after"]) >= 1
                assert "queue" in full.value.message
        # The queued request waited out its band's 0.5 s, no less (and not the 3 s the
        # slow one took), and was told so; the slow one was answered after it.
        assert [type(x).__name__ for x in results] == ["tuple", "ChatCompletion"]
        label, waited, timed_out = results[0]
        assert label == "queued"
        assert 0.45 <= waited < 2.5, waited
        assert timed_out.status_code == 429
        assert "waited 0.5 s (the interactive band's queue timeout)" in timed_out.message
        assert int(timed_out.response.headers["retry-after"]) >= 1
        assert results[1].choices[0].message.content.startswith("tok0")
        text = r.metrics_text()
        refused = "llmgw_router_admission_refused_total"
        assert sample(text, refused, model="chat", reason="queue_full") == 1.0
        assert sample(text, refused, model="chat", reason="queue_timeout") == 1.0


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.01)
