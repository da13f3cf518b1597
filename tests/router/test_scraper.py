"""Engine load as the router reads it: per engine's names, llama.cpp's slots, absent when unknown."""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
from helpers import llama_server_binary, start_router

from llmgw.testing.cluster import free_port, wait_for
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
            # llama.cpp has no KV gauge: unknown, not its busy slots (a stale copy of running).
            assert sample(text, "llmgw_router_endpoint_kv_cache_usage_ratio", endpoint="l") is None
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
        for name in ("running_requests", "waiting_requests"):  # llama.cpp has no KV gauge
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


async def test_llama_cpp_slots_set_the_concurrency_unless_slots_are_declared(
    start_engine: Callable[..., FakeEngine],
) -> None:
    """Before the fix the scraped slot count changed nothing: the limit stayed at
    slots_per_endpoint (64) per endpoint."""
    two = start_engine("small", engine="llama-server", extra=["-np", "2"])
    three = start_engine("small", engine="llama-server", extra=["-np", "3"])
    declared = start_engine("other", engine="llama-server", extra=["-np", "2"])
    eps = [two.endpoint("two"), three.endpoint("three"), declared.endpoint("declared", slots=5)]
    async with serve_router(eps, scrape_interval_s=0.2) as r:

        def limits() -> tuple[float | None, float | None]:
            text = r.metrics_text()
            limit = "llmgw_router_concurrency_limit"
            return sample(text, limit, model="small"), sample(text, limit, model="other")

        await until(lambda: limits() == (5.0, 5.0))  # 2 + 3 from /slots; 5 as declared
        assert r.router.endpoint_states()["declared"].slots == 5
        # An endpoint with no /slots (vLLM) counts slots_per_endpoint.
        r.source.replace([*eps, start_engine("small").endpoint("vllm")])
        await until(lambda: limits() == (69.0, 5.0))


@pytest.mark.slow
def test_a_real_two_slot_llama_server_gets_two_requests_at_a_time(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Router-only mode, no `slots:` declared: the router reads the engine's /slots and
    admits 2 of 6 concurrent requests; the other 4 wait in its queue, not at the engine."""
    binary = llama_server_binary()
    engine_port, port, metrics_port = free_port(), free_port(), free_port()
    engine_log = tmp_path / "llama-server.log"
    router_log = tmp_path / "router.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        argv = [binary, "-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(engine_port)]
        argv += ["-np", "2", "--ctx-size", "4096", "--threads", "1", "--metrics"]
        with open(engine_log, "wb") as f:
            procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT))
        engine = f"http://127.0.0.1:{engine_port}"
        wait_for(
            "llama-server healthy",
            lambda: httpx.get(engine + "/health", timeout=2).status_code == 200,
            timeout=60,
            interval=0.1,
        )
        cfg = tmp_path / "router.yaml"
        cfg.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f"metrics_listen: 127.0.0.1:{metrics_port}\n"
            f"endpoints:\n  - {{model: tiny, engine: llama-server, url: '{engine}'}}\n"
            "keys:\n  - {key: llmgw-static-one, tenant: t0}\n"
            "scrape_interval_s: 0.2\n"
        )
        procs.append(start_router(cfg, router_log))
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

        def metric(name: str, **labels: str) -> float | None:
            try:
                text = httpx.get(metrics_url, timeout=5).text
            except httpx.HTTPError:
                return None
            return sample(text, name, model="tiny", **labels)

        wait_for(
            "the router's limit from the engine's /slots",
            lambda: metric("llmgw_router_concurrency_limit") == 2.0,
            timeout=20,
            interval=0.1,
        )
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1500,  # about 0.3 s each here: long enough to be seen waiting
            "ignore_eos": True,
        }
        headers = {"Authorization": "Bearer llmgw-static-one"}

        def one(_: int) -> int:
            with httpx.Client(timeout=60) as c:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                return c.post(url, json=body, headers=headers).status_code

        admitted: list[float] = []
        queued: list[float] = []
        busy: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(one, i) for i in range(6)]
            while not all(f.done() for f in futures):
                admitted.append(metric("llmgw_router_admitted_requests") or 0.0)
                queued.append(metric("llmgw_router_queue_depth", band="interactive") or 0.0)
                slots = httpx.get(engine + "/slots", timeout=5).json()
                busy.append(sum(1 for s in slots if s["is_processing"]))
                time.sleep(0.01)
            statuses = [f.result() for f in futures]
        assert statuses == [200] * 6
        assert max(admitted) == 2.0, admitted
        assert max(queued) >= 1.0, queued  # the rest waited in the router's queue
        assert max(busy) == 2
        wait_text = httpx.get(metrics_url, timeout=5).text
        waits = sample(wait_text, "llmgw_router_queue_wait_seconds_sum", model="tiny")
        assert waits is not None and waits > 0.2  # 4 requests waited for a slot
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
