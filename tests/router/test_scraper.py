"""Engine load as the router reads it: per engine's names, llama.cpp's slots, absent when unknown."""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import pytest
import trio

from router.conftest import SECRET_A, FakeEngine, sample, serve_router

AUTH = {"Authorization": f"Bearer {SECRET_A}"}


async def until(check: Callable[[], object], timeout: float = 10.0) -> object:
    with trio.fail_after(timeout):
        while not (result := check()):
            await trio.sleep(0.05)
    return result


async def test_scraped_load_per_engine_and_dead_endpoints_become_unknown(
    start_engine: Callable[..., FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router")
    vllm = start_engine("chat", env={"LLMGW_FAKE_FIRST_TOKEN_DELAY": "30"})
    llama = start_engine("small", engine="llama-server", extra=["-np", "4"])
    sglang = start_engine("big", engine="sglang")
    eps = [vllm.endpoint("v"), llama.endpoint("l"), sglang.endpoint("s")]
    async with (
        serve_router(eps, scrape_interval_s=0.2, unhealthy_after_misses=3) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        # One request generating on vLLM for a long time: the scrape shows it running.
        async with trio.open_nursery() as nursery:
            body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}

            async def slow() -> None:
                await h.post(r.base_url + "/chat/completions", headers=AUTH, json=body)

            nursery.start_soon(slow)

            def running() -> bool:
                text = r.metrics_text()
                return sample(text, "llmgw_router_endpoint_running_requests", endpoint="v") == 1.0

            await until(running)
            text = r.metrics_text()
            assert sample(text, "llmgw_router_endpoint_in_flight_requests", endpoint="v") == 1.0
            assert sample(text, "llmgw_router_endpoint_waiting_requests", endpoint="v") == 0.0
            assert (
                sample(text, "llmgw_router_endpoint_kv_cache_usage_ratio", endpoint="v") or 0
            ) > 0
            # llama.cpp has no KV gauge: the busy share of its 4 slots stands in.
            assert sample(text, "llmgw_router_endpoint_kv_cache_usage_ratio", endpoint="l") == 0.0
            assert r.router.endpoint_states()["l"].slots == 4
            assert sample(text, "llmgw_router_endpoint_running_requests", endpoint="s") == 0.0
            nursery.cancel_scope.cancel()

        # The SGLang engine dies: its figures go stale and are left out, not shown as 0,
        # and after 3 failed readings it is unhealthy (and no longer listed as a model).
        sglang.proc.kill()
        sglang.proc.wait()

        def gone() -> bool:
            text = r.metrics_text()
            return sample(text, "llmgw_router_endpoint_healthy", endpoint="s") == 0.0

        await until(gone)
        await trio.sleep(0.7)  # more than 3 intervals since the last good reading
        text = r.metrics_text()
        for name in ("running_requests", "waiting_requests", "kv_cache_usage_ratio"):
            assert sample(text, f"llmgw_router_endpoint_{name}", endpoint="s") is None, name
            assert sample(text, f"llmgw_router_endpoint_{name}", endpoint="l") is not None, name
        assert sample(text, "llmgw_router_endpoint_healthy", endpoint="l") == 1.0
        listed = (await h.get(r.base_url + "/models", headers=AUTH)).json()
        assert sorted(m["id"] for m in listed["data"]) == ["chat", "small"]
        refused = await h.post(
            r.base_url + "/chat/completions",
            headers=AUTH,
            json={"model": "big", "messages": [{"role": "user", "content": "x"}]},
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_ready_replica"
    unhealthy = [rec.getMessage() for rec in caplog.records if "unhealthy" in rec.getMessage()]
    assert len(unhealthy) == 1
    assert unhealthy[0].startswith("endpoint s (big at 127.0.0.1:")
    assert "3 failed readings in a row" in unhealthy[0]


async def test_session_affinity_keeps_a_session_on_one_replica(
    start_engine: Callable[..., FakeEngine],
) -> None:
    a = start_engine("chat")
    b = start_engine("chat")
    async with (
        serve_router(
            [a.endpoint("a"), b.endpoint("b")], run=False, affinity_header="X-Session-Id"
        ) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
        for session in ("s1", "s2", "s3", "s4"):
            before = (a.stats()["completed"], b.stats()["completed"])
            for _ in range(4):
                resp = await h.post(
                    r.base_url + "/chat/completions",
                    headers={**AUTH, "X-Session-Id": session},
                    json=body,
                )
                assert resp.status_code == 200
            after = (a.stats()["completed"], b.stats()["completed"])
            moved = (after[0] - before[0], after[1] - before[1])
            assert sorted(moved) == [0, 4], (session, moved)
        # Across sessions both replicas are used (rendezvous hashing spreads them).
        assert a.stats()["completed"] > 0 and b.stats()["completed"] > 0
