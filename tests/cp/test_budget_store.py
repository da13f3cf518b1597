"""The store's lease operations on tenants' per-minute budgets, on SQLite and a real
PostgreSQL: grants stop at the limit, give-backs restore it, routers are counted, and
four routers leasing at once on their own connections never take more than the limit.
The autoscaler's tables ride along (one PostgreSQL per file is what costs): routers'
loads by control plane, fresh ones only, and held counts that survive a reopen."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
from helpers import postgres_server

from llmgw.errors import UsageError
from llmgw.keys import BudgetAsk, BudgetGrant
from llmgw.store import SqlStore, open_store

NOW = 1_800_000_000.0  # a window's start: 30,000,000 minutes since the epoch
W = int(NOW // 60)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


@pytest.fixture(params=["sqlite", "postgresql"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "state")
    dsn: str = request.getfixturevalue("pg_dsn")
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return dsn


@pytest.fixture
async def store(where: str) -> AsyncIterator[SqlStore]:
    s = await open_store(where, timeout_s=10)
    try:
        yield s
    finally:
        await s.aclose()


def ask(
    n: int, *, back: int = 0, kind: str = "rpm", window: int = W, tenant: str = "acme"
) -> BudgetAsk:
    return BudgetAsk(tenant, kind, window, 100, ask=n, give_back=back)


async def test_leases_stop_at_the_limit_and_give_backs_restore_it(store: SqlStore) -> None:
    assert await store.budget_taken("acme", "rpm", W) is None
    got = await store.lease_budget("r1", NOW, [ask(60), ask(1000, kind="tpm")])
    assert got.grants == (BudgetGrant(60, 60), BudgetGrant(100, 100))
    assert got.routers == 1
    got = await store.lease_budget("r2", NOW + 1, [ask(60)])
    assert got.grants == (BudgetGrant(40, 100),)  # what was left, not what was asked
    assert got.routers == 2
    assert (await store.lease_budget("r2", NOW + 2, [ask(5)])).grants == (BudgetGrant(0, 100),)
    # r1 gives back 30 it did not use and asks for 10 in the same lease: 20 stay free.
    assert (await store.lease_budget("r1", NOW + 3, [ask(10, back=30)])).grants == (
        BudgetGrant(10, 80),
    )
    assert await store.budget_taken("acme", "rpm", W) == 80
    # The next window, and another tenant, have their own budgets.
    nxt = await store.lease_budget("r1", NOW + 4, [ask(7, window=W + 1), ask(3, tenant="zeta")])
    assert nxt.grants == (BudgetGrant(7, 7), BudgetGrant(3, 3))
    assert await store.budget_taken("acme", "rpm", W) == 80


async def test_routers_seen_long_ago_and_old_windows_are_dropped(store: SqlStore) -> None:
    await store.lease_budget("old", NOW, [ask(5)])
    later = NOW + 700  # past KEEP_S: the window and the router are deleted
    got = await store.lease_budget("new", later, [ask(1, window=int(later // 60))])
    assert got.routers == 1
    assert await store.budget_taken("acme", "rpm", W) is None


async def test_bad_asks_are_refused_naming_the_value(store: SqlStore) -> None:
    with pytest.raises(UsageError, match=r"kind 'rps' is not one of \('rpm', 'tpm'\)"):
        await store.lease_budget("r1", NOW, [ask(1, kind="rps")])
    with pytest.raises(UsageError, match="must be 0 or more"):
        await store.lease_budget("r1", NOW, [ask(-1)])


async def test_four_routers_leasing_at_once_never_take_more_than_the_limit(
    store: SqlStore, where: str
) -> None:
    others = [await open_store(where, timeout_s=10) for _ in range(3)]  # own connections
    routers = [store, *others]
    granted: list[int] = []
    try:

        async def lease(i: int, s: SqlStore) -> None:
            for _ in range(15):
                got = await s.lease_budget(f"r{i}", NOW, [ask(3), ask(2, tenant="zeta")])
                granted.append(got.grants[0].granted)

        async with trio.open_nursery() as nursery:
            for i, s in enumerate(routers):
                nursery.start_soon(lease, i, s)
    finally:
        for s in others:
            await s.aclose()
    # 4 routers x 15 leases x 3 asked = 180 > 100: exactly the limit is granted.
    assert sum(granted) == 100, granted
    assert await store.budget_taken("acme", "rpm", W) == 100
    assert await store.budget_taken("zeta", "rpm", W) == 100  # 4 x 15 x 2 = 120 asked


async def test_router_loads_are_kept_per_control_plane_and_old_ones_dropped(
    store: SqlStore, where: str
) -> None:
    await store.put_router_load("cp-a", '{"w0": {}}', NOW)
    await store.put_router_load("cp-b", '{"w0": {"m": 1}}', NOW + 1)
    await store.put_router_load("cp-a", '{"w0": {"m": 2}}', NOW + 2)  # replaces its row
    assert await store.router_loads(NOW - 10) == [
        ("cp-a", '{"w0": {"m": 2}}', NOW + 2),
        ("cp-b", '{"w0": {"m": 1}}', NOW + 1),
    ]
    assert [cp for cp, _, _ in await store.router_loads(NOW + 1.5)] == ["cp-a"]
    await store.put_router_load("cp-c", "{}", NOW + 1000)  # cp-a and cp-b are 600 s old
    assert [cp for cp, _, _ in await store.router_loads(0)] == ["cp-c"]


async def test_held_counts_outlive_a_reopen_and_resume_deletes_them(
    store: SqlStore, where: str
) -> None:
    await store.pause_autoscale("qwen", 3, "admin", NOW)
    await store.pause_autoscale("qwen", 2, "ops", NOW + 5)  # held again: the newer count
    await store.pause_autoscale("llama", 0, "admin", NOW)
    again = await open_store(where, timeout_s=10)
    try:
        assert await again.autoscale_paused() == {
            "qwen": (2, "ops", NOW + 5),
            "llama": (0, "admin", NOW),
        }
        assert await again.resume_autoscale("qwen") is True
        assert await again.resume_autoscale("qwen") is False
        dump = await again.export_rows()
        assert dump.paused == (("llama", 0, "admin", NOW),)
    finally:
        await again.aclose()
    assert await store.autoscale_paused() == {"llama": (0, "admin", NOW)}
