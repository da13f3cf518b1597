"""The router's own load signals (llmgw/router/_load.py, `Router.loads()`), through real
requests to a fake engine: queued, in flight, uncached prompt tokens, TTFT buckets
measured from arrival, and capacity refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import trio

from llmgw.core import Band, RouterLoad, ttft_bucket
from router.conftest import SECRET_A, FakeEngine, serve_router

AUTH = {"Authorization": f"Bearer {SECRET_A}"}
DELAY = 1.0  # the engine's time to its first token


def chat(model: str = "chat", stream: bool = True) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "x" * 400}], "stream": stream}


async def until(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    with trio.fail_after(timeout):
        while not (got := check()):
            await trio.sleep(0.01)
    return got


async def test_loads_count_queue_in_flight_uncached_ttft_and_refusals(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine(
        "chat", env={"LLMGW_FAKE_FIRST_TOKEN_DELAY": str(DELAY), "LLMGW_FAKE_TOKENS": "2"}
    )
    async with (
        serve_router(
            [fe.endpoint()],
            models=["idle"],  # known, no replica, no hold
            concurrency=1,
            queue_limit=1,
            bands=[Band("interactive", 0, 30.0)],
        ) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        url = r.base_url + "/chat/completions"
        # Every model the view lists, zeros included.
        assert r.router.loads() == {"chat": RouterLoad(), "idle": RouterLoad()}
        statuses: list[int] = []

        async def ask(body: dict[str, Any]) -> None:
            async with h.stream("POST", url, headers=AUTH, json=body) as resp:
                await resp.aread()
                statuses.append(resp.status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, chat())
            first = await until(lambda: (x := r.router.loads()["chat"]).in_flight == 1 and x)
            # Sent, the engine not yet answering: its prompt is the engine's to compute.
            assert first.uncached_tokens > 0 and first.queued == 0
            nursery.start_soon(ask, chat())
            await until(lambda: r.router.loads()["chat"].queued == 1)
            # Queue full: a 429 at once, counted as a capacity refusal.
            full = await h.post(url, headers=AUTH, json=chat())
            assert full.status_code == 429
            now = r.router.loads()["chat"]
            assert (now.queued, now.in_flight, now.rejected) == (1, 1, 1)
        assert statuses == [200, 200]
        done = r.router.loads()["chat"]
        assert (done.queued, done.in_flight, done.uncached_tokens) == (0, 0, 0)
        # Two first bytes, timed from arrival: the first waited for the engine (about
        # DELAY), the second for the first's whole answer in the queue too (twice that);
        # timed from leaving the queue, both would be in the first's bucket.
        assert sum(done.ttft) == 2
        counted = [i for i, n in enumerate(done.ttft) for _ in range(n)]
        assert counted[0] >= ttft_bucket(DELAY)
        assert counted[1] >= ttft_bucket(2 * DELAY), done.ttft
        assert done.rejected == 1
        # A whole answer's first byte is its last: not a TTFT.
        whole = await h.post(url, headers=AUTH, json=chat(stream=False))
        assert whole.status_code == 200
        assert sum(r.router.loads()["chat"].ttft) == 2
        # No replica and no hold: a 503 at once, counted for that model.
        idle = await h.post(url, headers=AUTH, json=chat("idle"))
        assert idle.status_code == 503
        assert r.router.loads()["idle"].rejected == 1
        assert r.router.loads()["chat"].rejected == 1
