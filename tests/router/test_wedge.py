"""The router's wedge watch (llmgw/router/_wedge.py) against real fake-engine processes:
an engine wedged by `/fake/tokens` (its /health still 200) is quarantined, the requests
waiting on it are answered by the other engine, and the reason says what /health said."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import trio

from router.conftest import FakeEngine, sample, serve_router
from router.test_robustness import AUTH, chat

FAILURES = "llmgw_router_upstream_failures_total"
QUARANTINES = "llmgw_router_quarantines_total"


async def _load(h: httpx.AsyncClient, url: str, until: trio.Event, codes: list[int]) -> None:
    while not until.is_set():
        resp = await h.post(url, headers=AUTH, json=chat())
        codes.append(resp.status_code)


async def test_a_wedged_engine_is_quarantined_and_its_waiting_requests_served_elsewhere(
    start_engine: Callable[..., FakeEngine],
) -> None:
    slow = {"LLMGW_FAKE_TOKEN_DELAY": "0.02"}  # about 0.3 s an answer: always some in flight
    stuck, good = start_engine("chat", env=slow), start_engine("chat", env=slow)
    # least-load, not round-robin: with six clients in a closed loop, round-robin sends
    # every client in turn to the wedged engine, where it waits; once all six wait there
    # the other engine gets nothing, makes no progress, and nothing can be told from a
    # router that is itself stuck (about half the runs, before the switch to least-load).
    # A fleet's clients do not all wait on one engine; least-load keeps the good one busy.
    async with (
        serve_router(
            [stuck.endpoint("stuck"), good.endpoint("good")],
            wedge_after_s=1.0,
            wedge_quarantine_s=600.0,
            policy="least-load",
        ) as r,
        httpx.AsyncClient(timeout=60) as h,
    ):
        url = r.base_url + "/chat/completions"
        codes: list[int] = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(_load, h, url, done, codes)
            await trio.sleep(1.0)
            assert codes and stuck.stats()["completed"] > 0  # both served before
            wedged = await h.post(f"http://127.0.0.1:{stuck.port}/fake/tokens", json={"hang": True})
            assert wedged.json() == {"hang": True}
            wedged_at = trio.current_time()
            with trio.fail_after(10):
                while not r.router.fleet.quarantined():
                    await trio.sleep(0.05)
            took = trio.current_time() - wedged_at
            received = stuck.stats()["received"]
            served = len(codes)
            while len(codes) < served + 30:
                await trio.sleep(0.05)
            done.set()
        text = r.metrics_text()
        reason = r.router.fleet.quarantined()["stuck"]
        stats = r.router.statistics()["endpoints"]
        explained = r.router.explain("chat", "/v1/chat/completions", chat())
    # `ctl route` says so too: no candidate, named apart with its reason.
    assert [c["endpoint"] for c in explained["candidates"]] == ["good"]
    assert explained["quarantined"] == {"stuck": reason}
    # Quarantined within wedge_after_s + a tick (+ the health check that completes the
    # reason) + slack, and not before: its silence began with its last answer, at most
    # one answer's time (about 0.35 s) before the switch. Then nothing more went there.
    assert 0.6 <= took <= 3.0, took
    assert stuck.stats()["received"] == received
    assert set(codes) == {200}, sorted(set(codes))
    assert reason.startswith("wedged: ") and reason.endswith(", /health 200"), reason
    assert stats["stuck"]["quarantined"] == reason and stats["good"]["quarantined"] is None
    assert sample(text, QUARANTINES, model="chat", endpoint="stuck") == 1.0
    assert sample(text, QUARANTINES, endpoint="good") is None
    # The requests that were waiting on it were sent to the other engine, each counted.
    moved = sample(text, FAILURES, endpoint="stuck", phase="wedged")
    assert moved is not None and moved >= 1
    assert sample(text, "llmgw_router_retries_total", model="chat") == moved


async def test_the_quarantine_ends_after_wedge_quarantine_s_and_a_recovered_engine_serves(
    start_engine: Callable[..., FakeEngine],
) -> None:
    slow = {"LLMGW_FAKE_TOKEN_DELAY": "0.02"}
    stuck, good = start_engine("chat", env=slow), start_engine("chat", env=slow)
    async with (
        serve_router(
            [stuck.endpoint("stuck"), good.endpoint("good")],
            wedge_after_s=1.0,
            wedge_quarantine_s=2.0,
            policy="round-robin",
        ) as r,
        httpx.AsyncClient(timeout=60) as h,
    ):
        url = r.base_url + "/chat/completions"
        codes: list[int] = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(_load, h, url, done, codes)
            await trio.sleep(0.5)
            await h.post(f"http://127.0.0.1:{stuck.port}/fake/tokens", json={"hang": True})
            with trio.fail_after(10):
                while not r.router.fleet.quarantined():
                    await trio.sleep(0.05)
            await h.post(f"http://127.0.0.1:{stuck.port}/fake/tokens", json={"hang": False})
            completed = stuck.stats()["completed"]
            with trio.fail_after(10):  # let back in after 2 s, and it answers again
                while stuck.stats()["completed"] <= completed:
                    await trio.sleep(0.1)
            done.set()
        assert r.router.fleet.quarantined() == {}
    assert set(codes) == {200}


async def test_a_model_with_one_endpoint_is_never_quarantined(
    start_engine: Callable[..., FakeEngine],
) -> None:
    """Nothing to compare with: the request waits for first_byte_timeout_s as before."""
    only = start_engine("chat")
    async with (
        serve_router([only.endpoint("only")], wedge_after_s=0.5, first_byte_timeout_s=2.5) as r,
        httpx.AsyncClient(timeout=60) as h,
    ):
        await h.post(f"http://127.0.0.1:{only.port}/fake/tokens", json={"hang": True})
        resp = await h.post(r.base_url + "/chat/completions", headers=AUTH, json=chat())
        assert resp.status_code == 504, resp.text
        assert r.router.fleet.quarantined() == {}
        assert sample(r.metrics_text(), QUARANTINES) is None


async def test_a_long_non_streamed_answer_is_not_a_wedge_while_its_engine_counts_tokens(
    start_engine: Callable[..., FakeEngine],
) -> None:
    """A non-streamed answer sends nothing until it is done (3 s here, three times
    wedge_after_s), but the engine's generation counter on /metrics moves meanwhile:
    that is progress, and nothing is quarantined or cut."""
    slow = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "60", "LLMGW_FAKE_TOKEN_DELAY": "0.05"})
    fast = start_engine("chat", env={"LLMGW_FAKE_TOKEN_DELAY": "0.01"})
    async with (
        serve_router(
            [slow.endpoint("slow"), fast.endpoint("fast")],
            wedge_after_s=1.0,
            scrape_interval_s=0.2,
            policy="round-robin",
        ) as r,
        httpx.AsyncClient(timeout=60) as h,
    ):
        url = r.base_url + "/chat/completions"
        codes: list[int] = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(_load, h, url, done, codes)
            with trio.fail_after(30):
                while slow.stats()["completed"] < 2:
                    await trio.sleep(0.1)
            done.set()
        text = r.metrics_text()
        assert r.router.fleet.quarantined() == {}
    assert set(codes) == {200}
    assert sample(text, QUARANTINES) is None
    assert sample(text, FAILURES, phase="wedged") is None


async def test_a_counter_read_after_the_quarantine_lifts_it_only_for_tokens_made_after_it() -> None:
    """The engine's generation counter is read once a second: a move seen by the first
    scrape after a quarantine began may be tokens made just before the wedge, and must
    not lift it (it did, and the quarantined engine got requests again); a move between
    two scrapes both after it is the engine working again."""
    from llmgw.core import Breaker, BreakerConfig, WedgeConfig
    from llmgw.router._flight import Quarantine
    from llmgw.router._scraper import EndpointState
    from llmgw.router._types import Endpoint
    from llmgw.router._wedge import WedgeWatch

    state = EndpointState(
        Endpoint("stuck", "chat", "llama-server", "127.0.0.1", 9, 1), Breaker(BreakerConfig())
    )

    async def health(_: EndpointState) -> str:
        return "/health 200"

    watch = WedgeWatch(
        WedgeConfig(wedge_after_s=1.0, max_wait_s=600.0), 600.0,
        lambda: {"chat": [state]}, health, lambda model, endpoint: None,
    )  # fmt: skip
    try:
        async with trio.open_nursery() as nursery:
            state.quarantine = Quarantine(10.0, "wedged: 2 requests, no bytes for 1 s")
            state.generated, state.progress_at = 40.0, 10.6
            state.generated_moved = (9.6, 10.6)  # read at 10.6, made before it or after
            assert watch.check(11.0, nursery) == []
            assert state.quarantine is not None
            state.generated_moved = (10.6, 11.6)  # both reads after it: it generates again
            watch.check(12.0, nursery)
            assert state.quarantine is None
    finally:
        state.close()
