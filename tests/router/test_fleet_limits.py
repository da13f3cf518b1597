"""Tenant limits across routers (llmgw/router/_budgets.py, _leases.py): routers leasing
from one real store (SQLite here; PostgreSQL in tests/cp/test_budget_store.py and the
two-control-plane test in tests/integration/test_fleet_limits.py), driven tick by tick
on a wall clock the test sets."""

from __future__ import annotations

import ast
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import httpx
import pytest
import trio
from helpers import postgres_server
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from llmgw.core import grant_budget, restore_budget
from llmgw.errors import DeadlineExceeded
from llmgw.keys import ApiKey, BudgetAsk, BudgetGrant, BudgetLeases, TenantLimits
from llmgw.router._budgets import STORE_SLOW_S, FleetLimiter
from llmgw.router._keys import StaticKeys
from llmgw.router._leases import TenantAdmission
from llmgw.store import SqlStore, open_store
from router.conftest import FakeEngine, sample, serve_router

T0 = 1_800_000_000.0  # a window's start
RPM = TenantLimits(rpm=120)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStore]:
    s = await open_store(tmp_path / "state")
    try:
        yield s
    finally:
        await s.aclose()


class Routers:
    """Router processes (a `FleetLimiter` each) sharing one store, on the test's clock."""

    def __init__(self, store: SqlStore, n: int) -> None:
        self.store = store
        self.limiters = [FleetLimiter(routers=1, clock=lambda: 0.0) for _ in range(n)]
        self.admitted = [0] * n

    async def tick(self, now: float) -> None:
        """Each router's lease loop, once: what it plans, leased from the store."""
        for i, lim in enumerate(self.limiters):
            asks = lim.plan(now)
            if asks:
                lim.leased(asks, await self.store.lease_budget(f"r{i}", now, asks), now)

    def ask(self, i: int, now: float, limits: TenantLimits = RPM) -> bool:
        ok = self.limiters[i].admit("acme", limits, now) is None
        self.admitted[i] += ok
        return ok


async def run(
    routers: Routers, start: float, end: float, busy: Sequence[tuple[float, float]]
) -> None:
    """From `start` to `end`: the lease loops every 50 ms; router i asks for a request
    every 100 ms while busy[i] = (from, to) holds."""
    now = start
    step = 0
    while now < end:
        await routers.tick(now)
        if step % 2 == 0:
            for i, (a, b) in enumerate(busy):
                if a <= now - start < b:
                    routers.ask(i, now)
        step += 1
        now = start + step * 0.05


class _Rule:
    """The store's lease rule (core/_budget.py, as llmgw/store/_budget.py applies it) in a
    dict, for a property over thousands of schedules."""

    def __init__(self) -> None:
        self.taken: dict[tuple[str, str, int], int] = {}
        self.seen: set[str] = set()

    def lease(self, router: str, asks: Sequence[BudgetAsk]) -> BudgetLeases:
        self.seen.add(router)
        grants = []
        for a in asks:
            key = (a.tenant, a.kind, a.window)
            taken = restore_budget(self.taken.get(key, 0), a.give_back)
            got = grant_budget(a.limit, taken, a.ask)
            self.taken[key] = taken + got
            grants.append(BudgetGrant(got, taken + got))
        return BudgetLeases(tuple(grants), len(self.seen))


@given(
    routers=st.integers(1, 4),
    rpm=st.integers(1, 40),
    # Gaps up to 1.5 s: tens of events in a window, asks and the lease loops interleaved.
    events=st.lists(
        st.tuples(st.integers(0, 3), st.floats(0, 1.5), st.sampled_from(["ask", "lease"])),
        max_size=300,
    ),
)
@example(routers=1, rpm=1, events=[(0, 0.0, "ask")] * 4)
def test_routers_together_never_admit_more_than_the_limit_plus_one_credit_each(
    routers: int, rpm: int, events: list[tuple[int, float, str]]
) -> None:
    rule = _Rule()
    lims = [FleetLimiter(routers=routers, clock=lambda: 0.0) for _ in range(routers)]
    admitted: Counter[int] = Counter()
    now = T0
    for who, gap, what in events:
        now += gap
        lim = lims[who % routers]
        if what == "lease":
            asks = lim.plan(now)
            if asks:
                lim.leased(asks, rule.lease(f"r{who % routers}", asks), now)
        elif lim.admit("acme", TenantLimits(rpm=rpm), now) is None:
            admitted[int(now // 60)] += 1
    for window, n in admitted.items():
        assert n <= rpm + routers, (window, n)  # one request on credit per router
        assert rule.taken.get(("acme", "rpm", window), 0) <= rpm


async def test_two_busy_routers_admit_the_limit_between_them(store: SqlStore) -> None:
    routers = Routers(store, 2)
    # Each asks 10 a second (1,200 a minute together) against 120 a minute.
    await run(routers, T0, T0 + 60, [(0, 60), (0, 60)])
    total = sum(routers.admitted)
    # Exactly the limit, plus at most one request on credit per router (the first of the
    # window, before its first lease came back).
    assert 120 <= total <= 122, routers.admitted
    assert min(routers.admitted) >= 40, routers.admitted  # both got a fair part
    assert await store.budget_taken("acme", "rpm", int(T0 // 60)) == 120
    assert routers.limiters[0].routers == 2  # the store counted both
    # The next window starts afresh: its leases were taken ahead in the last 2 s.
    await run(routers, T0 + 60, T0 + 120, [(0, 60), (0, 60)])
    assert 240 <= sum(routers.admitted) <= 244, routers.admitted


async def test_an_idle_router_gives_back_what_it_holds_and_the_busy_one_uses_it(
    store: SqlStore,
) -> None:
    routers = Routers(store, 2)
    # r0 is busy for 5 s (about 50 requests' demand), then idle; r1 from 10 s on.
    await run(routers, T0, T0 + 60, [(0, 5), (10, 60)])
    a, b = routers.admitted
    assert 119 <= a + b <= 122, routers.admitted  # nothing stranded in r0's lease
    assert routers.limiters[0].statistics()["tenants"]["acme"]["rpm"]["held"] == 0  # type: ignore[index]
    assert a >= 40 and b >= 60, routers.admitted


async def test_refusals_say_when_the_budget_comes_back(store: SqlStore) -> None:
    routers = Routers(store, 1)
    lim = routers.limiters[0]
    await run(routers, T0, T0 + 30, [(0, 30)])
    assert routers.admitted == [120]
    refused = lim.admit("acme", RPM, T0 + 30.2)
    assert refused is not None and refused.reason == "rpm"
    assert refused.retry_after_s == 30  # the window ends at T0 + 60
    assert refused.message == "tenant acme: over its 120 requests per minute; retry in 30 s"
    # A router whose lease is still on its way (not spent): come back in a second.
    fresh = FleetLimiter(clock=lambda: 0.0)
    assert fresh.admit("acme", RPM, T0) is None  # the window's first, on credit
    waiting = fresh.admit("acme", RPM, T0 + 0.01)
    assert waiting is not None and waiting.retry_after_s == 1
    assert fresh.statistics()["credited"] == 1


async def test_with_the_store_down_each_router_admits_its_part_of_the_limit(
    store: SqlStore,
) -> None:
    routers = Routers(store, 2)
    await run(routers, T0, T0 + 1, [(0, 1), (0, 1)])  # both leased: the store counts 2
    lim = routers.limiters[0]
    assert lim.routers == 2
    lim.lease_failed(lim.plan(T0 + 60), T0 + 60)  # the next window: the store is down
    admitted = sum(lim.admit("acme", RPM, T0 + 60 + i / 100) is None for i in range(200))
    assert admitted == 60  # 120 / 2 routers, for this window
    refused = lim.admit("acme", RPM, T0 + 70)
    assert refused is not None and refused.retry_after_s == 50
    assert lim.statistics()["fallback_admitted"] == 60
    # One that never reached the store splits the limit between its own workers.
    alone = FleetLimiter(routers=4, clock=lambda: 0.0)
    alone.lease_failed([], T0)
    assert sum(alone.admit("acme", RPM, T0 + i / 100) is None for i in range(100)) == 30


async def test_a_lease_that_does_not_come_back_counts_as_the_store_down() -> None:
    lim = FleetLimiter(clock=lambda: 0.0)
    assert lim.admit("acme", RPM, T0) is None  # on credit
    assert lim.plan(T0)  # a lease goes out, and hangs (a frozen store)
    assert lim.admit("acme", RPM, T0 + 0.5) is not None  # still on its way: 429, 1 s
    down = T0 + STORE_SLOW_S + 0.5
    assert not lim.fallback(T0 + STORE_SLOW_S - 0.5) and lim.fallback(down)
    admitted = sum(lim.admit("acme", RPM, down + i / 100) is None for i in range(200))
    assert admitted == 119  # its whole part (one router known) less the one on credit


async def test_tokens_are_reserved_at_admission_and_settled_with_the_answer(
    store: SqlStore,
) -> None:
    routers = Routers(store, 1)
    lim = routers.limiters[0]
    tpm = TenantLimits(tpm=1000)
    window = int(T0 // 60)
    assert routers.ask(0, T0, tpm)  # on credit; nothing known of its tokens yet
    lim.charge("acme", 300, T0 + 0.1)  # its answer: 300 tokens, a debt
    await routers.tick(T0 + 0.2)  # the lease pays the debt first
    assert await store.budget_taken("acme", "tpm", window) >= 300  # type: ignore[operator]
    stats = lim.statistics()["tenants"]["acme"]["tpm"]  # type: ignore[index]
    held = stats["held"]
    assert held > 0
    # The next request reserves the tenant's 300 tokens per request at admission...
    assert routers.ask(0, T0 + 0.3, tpm)
    assert lim.statistics()["tenants"]["acme"]["tpm"]["held"] == held - 300  # type: ignore[index]
    # ... and its answer of 100 gives 200 back.
    lim.charge("acme", 100, T0 + 0.4)
    assert lim.statistics()["tenants"]["acme"]["tpm"]["held"] == held - 100  # type: ignore[index]
    # Over a window, what the store granted covers every token charged, and is the limit.
    spent = 400
    now = T0 + 0.5
    while now < T0 + 59:
        await routers.tick(now)
        if routers.ask(0, now, tpm):
            lim.charge("acme", 100, now + 0.01)
            spent += 100
        now += 0.1
    assert await store.budget_taken("acme", "tpm", window) == 1000
    assert 1000 <= spent <= 1000 + 100 + 300, spent  # at most the last answer over


class _Flaky:
    """A budget source that fails while `down`, else leases from the real store."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.down = True
        self.calls = 0

    async def lease_budget(
        self, router: str, now: float, asks: Sequence[BudgetAsk]
    ) -> BudgetLeases:
        self.calls += 1
        if self.down:
            raise DeadlineExceeded("store postgresql://db/llmgw: no answer in 10 s")
        return await self.store.lease_budget(router, now, asks)


async def until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.02)


async def test_the_lease_loop_falls_back_while_the_store_fails_and_resumes(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    wall = lambda: T0 + 10 + trio.current_time() % 30  # noqa: E731 - inside one window
    source = _Flaky(store)
    tenants = TenantAdmission(0, 2, source, clock=wall, retry_s=0.2)
    lim = tenants.limiter
    assert isinstance(lim, FleetLimiter)
    caplog.set_level(logging.WARNING, "llmgw.router.leases")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tenants.run)
        assert lim.admit("acme", RPM, wall()) is None  # on credit
        await until("the first lease fails", lambda: lim.store_ok is False)
        assert lim.fallback(wall())
        assert "cannot lease budgets from the store (store postgresql://db/llmgw: no answer" in (
            caplog.text
        )
        assert "admits its own part of every limit (1/2)" in caplog.text
        assert sum(lim.admit("acme", RPM, wall()) is None for _ in range(100)) == 59  # 60 - 1
        source.down = False
        await until("a lease comes back", lambda: lim.store_ok is True)
        assert "the store answers again" in caplog.text
        nursery.cancel_scope.cancel()


def _chat_key(rpm: int) -> StaticKeys:
    limits = TenantLimits(rpm=rpm)
    return StaticKeys(
        [
            (
                "secret-acme",
                ApiKey("key-acme", "acme", None, "interactive", "interactive", 0.0, limits=limits),
            )
        ]
    )


async def _away_from_a_minute_turn() -> None:
    """Requests of one test fall in one window: not within 5 s of the next minute."""
    left = 60 - time.time() % 60
    if left < 5:
        await trio.sleep(left + 0.1)


async def test_through_the_router_a_limit_is_leased_from_the_store_and_refused_past_it(
    store: SqlStore, start_engine: Callable[..., FakeEngine]
) -> None:
    fe = start_engine("chat")
    await _away_from_a_minute_turn()
    async with (
        serve_router([fe.endpoint()], keys=_chat_key(5), budget=store) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        lim = r.router.tenants.limiter
        assert isinstance(lim, FleetLimiter)
        url = r.base_url + "/chat/completions"
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        auth = {"Authorization": "Bearer secret-acme"}
        # Back to back: the first on credit, the others from leases, waiting a moment for
        # one on its way rather than refused while the tenant is under its limit.
        codes = [(await h.post(url, headers=auth, json=body)).status_code for _ in range(7)]
        assert codes == [200] * 5 + [429] * 2
        assert lim.statistics()["credited"] == 1
        text = generate_latest(r.router.metrics_registry).decode()
        assert sample(text, "llmgw_router_tenant_budget_store_ok") == 1
        answered = sample(text, "llmgw_router_tenant_budget_leases_total", outcome="answered")
        assert answered is not None and answered >= 2
        over = await h.post(url, headers=auth, json=body)
        assert over.status_code == 429
        wait = int(over.headers["retry-after"])
        assert abs(wait - (60 - time.time() % 60)) <= 1.5
        assert over.json()["error"]["message"] == (
            f"tenant acme: over its 5 requests per minute; retry in {wait} s"
        )
        assert await store.budget_taken("acme", "rpm", int(time.time() // 60)) == 5


@pytest.fixture
async def stopped_postgresql() -> AsyncIterator[SqlStore]:
    """A store on a real PostgreSQL that was stopped after the store opened it."""
    with contextlib.ExitStack() as stack:
        dsn = stack.enter_context(postgres_server())
        s = await open_store(dsn, timeout_s=3)
        stack.close()  # the server stops: the store's connection is gone
        try:
            yield s
        finally:
            with contextlib.suppress(Exception):
                await s.aclose()


async def test_through_the_router_with_the_store_down_each_worker_admits_its_part(
    stopped_postgresql: SqlStore, start_engine: Callable[..., FakeEngine]
) -> None:
    fe = start_engine("chat")
    source = stopped_postgresql  # down from the start: this router never reached it
    await _away_from_a_minute_turn()
    async with (
        serve_router([fe.endpoint()], keys=_chat_key(6), budget=source, workers=2) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        lim = r.router.tenants.limiter
        assert isinstance(lim, FleetLimiter)
        url = r.base_url + "/chat/completions"
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        auth = {"Authorization": "Bearer secret-acme"}
        assert (await h.post(url, headers=auth, json=body)).status_code == 200  # on credit
        await until("the first lease fails", lambda: lim.store_ok is False)
        codes = [(await h.post(url, headers=auth, json=body)).status_code for _ in range(4)]
        assert codes == [200, 200, 429, 429]  # 6 / 2 workers = 3 this minute, on its own
        text = generate_latest(r.router.metrics_registry).decode()
        assert sample(text, "llmgw_router_tenant_budget_store_ok") == 0
        assert sample(text, "llmgw_router_tenant_budget_fallback_admitted_total") == 2
        assert sample(text, "llmgw_router_tenant_budget_credited_total") == 1
        assert sample(text, "llmgw_router_tenant_budget_leases_total", outcome="answered") == 0
        failed = sample(text, "llmgw_router_tenant_budget_leases_total", outcome="failed")
        assert failed is not None and failed >= 1


def test_the_limiter_does_no_io() -> None:
    source = Path(__file__).parents[2] / "llmgw" / "router" / "_budgets.py"
    tree = ast.parse(source.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"trio", "socket", "capnp", "httpx", "os", "pathlib", "time"}
