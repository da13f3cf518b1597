"""The store's contract, run against SQLite and a real PostgreSQL started here."""

from __future__ import annotations

import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import postgres_server

from llmgw.errors import ConfigError, DeadlineExceeded, LlmgwError, PeerError, UsageError
from llmgw.keys import TenantLimits, UsageRow, digest
from llmgw.store import SQLITE_FILE, Account, SqlStore, known_schema, open_store


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


def _raw(where: str) -> Any:
    """A connection of the test's own, beside the store's."""
    if where.startswith("postgresql://"):
        import psycopg

        return psycopg.connect(where, autocommit=True)
    return sqlite3.connect(Path(where) / SQLITE_FILE, isolation_level=None)


def _backend(where: str) -> str:
    return "postgresql" if where.startswith("postgresql://") else "sqlite"


@pytest.fixture(params=["sqlite", "postgresql"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a fresh, empty store is: a directory, or a PostgreSQL database emptied for this test."""
    if request.param == "sqlite":
        return str(tmp_path / "state")
    dsn: str = request.getfixturevalue("pg_dsn")
    with _raw(dsn) as conn:
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


async def test_accounts(store: SqlStore) -> None:
    assert await store.get_account("acme") is None
    acme = await store.create_account(Account("acme", rpm=60, tpm=None, max_band="interactive"))
    assert acme.created_at == pytest.approx(time.time(), abs=60)
    await store.create_account(Account("beta"))
    with pytest.raises(UsageError):
        await store.create_account(Account("acme"))
    with pytest.raises(UsageError, match="rpm is -1"):
        await store.create_account(Account("neg", rpm=-1))
    got = await store.get_account("acme")
    assert got == acme
    assert got is not None and got.tpm is None  # no limit stays None, never 0
    assert [a.name for a in await store.list_accounts()] == ["acme", "beta"]
    assert await store.update_account(Account("acme", rpm=None, tpm=1000, max_band="batch"))
    got = await store.get_account("acme")
    assert got is not None
    assert (got.rpm, got.tpm, got.max_band, got.created_at) == (
        None,
        1000,
        "batch",
        acme.created_at,
    )
    assert not await store.update_account(Account("nobody"))
    assert await store.delete_account("beta")
    assert not await store.delete_account("beta")
    assert [a.name for a in await store.list_accounts()] == ["acme"]


async def test_keys_by_digest_and_expiry(store: SqlStore) -> None:
    key, secret = await store.create_key(
        tenant="acme", models=["m1", "m2"], default_band="batch", max_band="interactive", name="ci"
    )
    assert secret.startswith("llmgw-")
    assert await store.lookup_key(digest(secret)) == key
    assert key.models == frozenset({"m1", "m2"}) and key.max_band == "interactive"
    assert await store.lookup_key(digest(secret + "x")) is None
    # only the digest is kept: the secret appears nowhere in the rows
    listed = await store.list_keys()
    assert [(k.key, k.expires_at) for k in listed] == [(key, None)]
    assert secret not in repr(listed)

    past, past_secret = await store.create_key(tenant="acme", expires_at=time.time() - 1)
    future, future_secret = await store.create_key(tenant="acme", expires_at=time.time() + 3600)
    assert await store.lookup_key(digest(past_secret)) is None
    assert await store.lookup_key(digest(future_secret)) == future
    assert {k.key.key_id for k in await store.list_keys()} == {
        key.key_id,
        past.key_id,
        future.key_id,
    }

    assert await store.revoke_key(key.key_id)
    revoked = await store.lookup_key(digest(secret))
    assert revoked is not None and revoked.revoked  # as KeyStore.lookup: revoked, not unknown
    assert not await store.revoke_key("key-none")
    # A key is read with its tenant's limits (what admission enforces), once it has an account.
    assert future.limits is None
    await store.create_account(Account("acme", rpm=60, tpm=None, max_band="batch"))
    limited = await store.lookup_key(digest(future_secret))
    assert limited is not None and limited.limits == TenantLimits(
        rpm=60, tpm=None, max_band="batch"
    )
    assert limited.expires_at == future.expires_at and limited.expires_at is not None
    with pytest.raises(UsageError, match="needs a tenant"):
        await store.create_key(tenant="")


async def test_node_overrides_and_known_nodes(store: SqlStore) -> None:
    await store.set_override("n1", "cordon", "disk")
    await store.set_override("n2", "forget", "gone")
    await store.set_override("n1", "drain", "maintenance")
    got = await store.overrides()
    assert [(o.node_id, o.kind, o.reason) for o in got] == [
        ("n1", "drain", "maintenance"),
        ("n2", "forget", "gone"),
    ]
    assert got[0].at == pytest.approx(time.time(), abs=60)
    with pytest.raises(UsageError, match="'pause' is not one of cordon, drain, forget"):
        await store.set_override("n1", "pause", "")
    assert await store.clear_override("n1")
    assert not await store.clear_override("n1")
    assert [o.node_id for o in await store.overrides()] == ["n2"]

    await store.remember_node("n1", "10.0.0.1:7000")
    await store.remember_node("n2", "10.0.0.2:7000")
    await store.remember_node("n1", "10.0.0.9:7000")
    nodes = await store.known_nodes()
    assert [(n.node_id, n.address) for n in nodes] == [
        ("n1", "10.0.0.9:7000"),
        ("n2", "10.0.0.2:7000"),
    ]
    assert nodes[0].last_seen == pytest.approx(time.time(), abs=60)
    assert await store.forget_node("n2")
    assert not await store.forget_node("n2")
    assert [n.node_id for n in await store.known_nodes()] == ["n1"]


async def _until_expired(store: SqlStore) -> None:
    with trio.fail_after(10):
        while True:
            lease = await store.current()
            if lease is not None and lease.expired:
                return
            await trio.sleep(0.05)


async def test_lease(store: SqlStore) -> None:
    assert await store.current() is None
    a = await store.try_acquire("cp-a", 30)
    assert a is not None and (a.holder, a.epoch, a.expired) == ("cp-a", 1, False)
    assert await store.current() == a
    assert await store.try_acquire("cp-b", 30) is None  # held
    # Its own holder takes it again at once, one epoch on (a control plane restarted on
    # the same address must not wait out its previous life's lease).
    again = await store.try_acquire("cp-a", 30)
    assert again is not None and (again.holder, again.epoch) == ("cp-a", 2)
    assert not await store.renew("cp-a", 1, 30)  # the previous life's epoch is over
    assert await store.renew("cp-a", 2, 30)
    assert not await store.renew("cp-b", 2, 30)
    assert not await store.renew("cp-a", 3, 30)
    a = again
    renewed = await store.current()
    assert renewed is not None and renewed.expires_at >= a.expires_at

    assert await store.renew("cp-a", 2, 0.3)  # shorten it, then let it lapse
    await _until_expired(store)
    b = await store.try_acquire("cp-b", 30)
    assert b is not None and (b.holder, b.epoch) == ("cp-b", 3)
    assert not await store.renew("cp-a", 2, 30)  # the deposed holder learns it lost
    assert await store.renew("cp-b", 3, 30)
    cur = await store.current()
    assert cur is not None and (cur.holder, cur.epoch, cur.expired) == ("cp-b", 3, False)
    with pytest.raises(UsageError):
        await store.try_acquire("cp-c", 0)


async def test_concurrent_acquirers_exactly_one_wins(store: SqlStore, where: str) -> None:
    others = [await open_store(where, timeout_s=10) for _ in range(3)]  # own connections
    contenders = [store, *others]
    try:
        for round_, ttl in ((1, 0.5), (2, 30.0)):
            won: list[tuple[int, Any]] = []

            async def race(i: int, s: SqlStore, ttl: float = ttl, won: list[Any] = won) -> None:
                won.append((i, await s.try_acquire(f"cp-{i}", ttl)))

            async with trio.open_nursery() as nursery:
                for i, s in enumerate(contenders):
                    nursery.start_soon(race, i, s)
            winners = [(i, lease) for i, lease in won if lease is not None]
            assert len(won) == 4 and len(winners) == 1, won
            i, lease = winners[0]
            assert (lease.holder, lease.epoch) == (f"cp-{i}", round_)
            if round_ == 1:
                await _until_expired(store)
    finally:
        for s in others:
            await s.aclose()


async def test_usage_adds_up(store: SqlStore) -> None:
    h0 = 1_700_000_000 - 1_700_000_000 % 3600
    h1 = h0 + 3600
    await store.add_usage(
        [
            UsageRow(h0, "acme", "k1", "m", 1, 10, 5),
            UsageRow(h0 + 59, "acme", "k1", "m", 2, 20, 7),  # same hour: adds
            UsageRow(h1, "acme", "k1", "m", 1, 1, 1),
            UsageRow(h1, "beta", "k2", "m", 4, 40, 4),
        ]
    )
    await store.add_usage([UsageRow(h1, "beta", "k2", "m", 1, 2, 3)])
    assert await store.usage() == [
        UsageRow(h0, "acme", "k1", "m", 3, 30, 12),
        UsageRow(h1, "acme", "k1", "m", 1, 1, 1),
        UsageRow(h1, "beta", "k2", "m", 5, 42, 7),
    ]
    assert await store.usage(tenant="beta") == [UsageRow(h1, "beta", "k2", "m", 5, 42, 7)]
    assert await store.usage(tenant="acme", since=h1 + 10) == [
        UsageRow(h1, "acme", "k1", "m", 1, 1, 1)
    ]
    assert await store.usage(tenant="nobody") == []
    # One transaction: a batch whose last row the database refuses writes nothing.
    with pytest.raises(LlmgwError):
        await store.add_usage(
            [UsageRow(h0, "acme", "k1", "m", 100, 100, 100), UsageRow(h0, None, "k", "m", 1, 1, 1)]  # type: ignore[arg-type]
        )
    assert (await store.usage(tenant="acme"))[0] == UsageRow(h0, "acme", "k1", "m", 3, 30, 12)
    with pytest.raises(UsageError, match="negative"):
        await store.add_usage([UsageRow(h0, "acme", "k1", "m", -1, 0, 0)])


async def test_audit(store: SqlStore) -> None:
    for i in range(3):
        await store.audit("admin", f"cordon n{i}", f"reason {i}")
    got = await store.recent_audit(2)
    assert [(e.actor, e.action, e.detail) for e in got] == [
        ("admin", "cordon n2", "reason 2"),
        ("admin", "cordon n1", "reason 1"),
    ]
    assert got[0].seq > got[1].seq and got[0].at >= got[1].at
    assert got[0].at == pytest.approx(time.time(), abs=60)


def _versions(where: str) -> list[int]:
    conn = _raw(where)
    try:
        return [int(r[0]) for r in conn.execute("SELECT version FROM schema_version ORDER BY 1")]
    finally:
        conn.close()


async def test_migrations_fresh_reopen_and_newer_refused(where: str) -> None:
    known = known_schema(_backend(where))
    s = await open_store(where)
    await s.create_account(Account("acme", rpm=5))
    await s.aclose()
    assert _versions(where) == list(range(1, known + 1))
    s = await open_store(where)  # re-open: nothing applied twice, data kept
    try:
        assert [a.name for a in await s.list_accounts()] == ["acme"]
    finally:
        await s.aclose()
    assert _versions(where) == list(range(1, known + 1))

    conn = _raw(where)
    try:
        conn.execute("INSERT INTO schema_version (version) VALUES (7)")
    finally:
        conn.close()
    shown = where if _backend(where) == "sqlite" else None
    with pytest.raises(ConfigError) as err:
        await open_store(where)
    text = str(err.value)
    assert text.endswith(f"has schema 7; this llmgw knows up to {known}: upgrade llmgw"), text
    assert text.startswith("the store at ")
    if shown is not None:
        assert str(Path(shown) / SQLITE_FILE) in text
    else:
        assert "postgresql://127.0.0.1:" in text and "/llmgw" in text
        assert ":" + where.split(":")[2].split("@")[0] + "@" not in text  # no password shown


async def test_racing_migrations_apply_once(where: str) -> None:
    """Four stores opening one new database at once: each migration applied once, none fails.
    Several rounds, because a lost race shows only now and then."""
    known = known_schema(_backend(where))
    for round_ in range(10):
        here = where
        if _backend(where) == "sqlite":
            here = str(Path(where) / f"round{round_}")
        elif round_:
            with _raw(where) as conn:
                conn.execute("DROP SCHEMA public CASCADE")
                conn.execute("CREATE SCHEMA public")
        opened: list[SqlStore] = []

        async def one(here: str = here, opened: list[SqlStore] = opened) -> None:
            opened.append(await open_store(here, timeout_s=20))

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(one)
            assert len(opened) == 4
            assert _versions(here) == list(range(1, known + 1))
            await opened[0].create_account(Account("acme"))
            assert [a.name for a in await opened[3].list_accounts()] == ["acme"]
        finally:
            for s in opened:
                await s.aclose()


async def test_locked_store_times_out_off_the_event_loop(where: str) -> None:
    """A statement held up by another connection's lock fails with DeadlineExceeded near the
    store's deadline, and the event loop keeps running meanwhile (the driver is in a thread)."""
    s = await open_store(where, timeout_s=0.5)
    conn = _raw(where)
    try:
        if _backend(where) == "sqlite":
            conn.execute("BEGIN IMMEDIATE")
        else:
            conn.autocommit = False
            conn.execute("SELECT * FROM lease FOR UPDATE")
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.sleep(0.02)

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            with pytest.raises(DeadlineExceeded, match=r"store .*"):
                await s.try_acquire("cp-a", 30)
            nursery.cancel_scope.cancel()
        took = trio.current_time() - start
        assert 0.4 <= took < 5, took
        assert ticks >= 5, ticks  # the loop ran while the driver waited (blocked: 1)
    finally:
        conn.rollback() if _backend(where) == "postgresql" else conn.execute("ROLLBACK")
        conn.close()
        await s.aclose()
    s = await open_store(where, timeout_s=5)
    try:
        lease = await s.try_acquire("cp-a", 30)  # the lock gone, the store works again
        assert lease is not None and lease.epoch == 1
    finally:
        await s.aclose()


async def test_unreachable_postgresql_names_the_address_not_the_password() -> None:
    with socket.socket() as s:  # a loopback port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PeerError) as err:
        await open_store(f"postgresql://llmgw:sekrit@127.0.0.1:{port}/llmgw", timeout_s=2)
    text = str(err.value)
    assert text.startswith(f"store postgresql://127.0.0.1:{port}/llmgw: "), text
    assert "sekrit" not in text


async def test_published_endpoints_are_fenced_by_the_lease(store: SqlStore, where: str) -> None:
    """The leader's endpoint list for the standbys' routers: written only at the lease's
    epoch, so a deposed leader cannot overwrite its successor's list."""
    assert await store.published_endpoints() is None  # nothing published: unknown, not empty
    a = await store.try_acquire("cp-a", 30)
    assert a is not None and a.epoch == 1
    assert await store.publish_endpoints(1, '{"models": {"tiny": []}}')
    got = await store.published_endpoints()
    assert got is not None and got[:2] == (1, '{"models": {"tiny": []}}')
    assert got[2] == pytest.approx(time.time(), abs=60)
    conn = _raw(where)
    try:
        conn.execute("UPDATE lease SET expires_at = 0")  # cp-a paused past its lease
    finally:
        conn.close()
    b = await store.try_acquire("cp-b", 30)
    assert b is not None and b.epoch == 2
    assert not await store.publish_endpoints(1, '{"models": {}}')  # the deposed one: refused
    assert await store.publish_endpoints(2, '{"models": {"big": []}}')
    assert not await store.publish_endpoints(3, "{}")  # a future epoch is nobody's
    got = await store.published_endpoints()
    assert got is not None and got[:2] == (2, '{"models": {"big": []}}')


async def test_events_keep_the_newest_in_order(store: SqlStore) -> None:
    """The event log's table holds the newest `keep` rows, oldest first, whatever was
    written before (retention is applied in the writing transaction)."""
    await store.add_events([(float(i), f'{{"n":{i}}}') for i in range(8)], keep=5)
    rows = await store.recent_events(100)
    assert [(at, body) for _seq, at, body in rows] == [
        (float(i), f'{{"n":{i}}}') for i in range(3, 8)
    ]
    assert [s for s, _, _ in rows] == sorted(s for s, _, _ in rows)
    await store.add_events([(8.0, '{"n":8}'), (9.0, '{"n":9}')], keep=5)
    assert [at for _s, at, _b in await store.recent_events(100)] == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert [at for _s, at, _b in await store.recent_events(2)] == [8.0, 9.0]
    with pytest.raises(ValueError, match="at least 1"):
        await store.add_events([(1.0, "{}")], keep=0)


async def test_admin_sessions_by_digest_expire_and_end(store: SqlStore, where: str) -> None:
    sid = b"\x01" * 32
    assert await store.admin_session(sid) is None
    await store.put_admin_session(sid, 2000.0, now=1000.0)
    await store.put_admin_session(b"\x02" * 32, 1500.0, now=1000.0)
    assert await store.admin_session(sid) == 2000.0
    # A later write deletes what expired by then.
    await store.put_admin_session(b"\x03" * 32, 3000.0, now=1600.0)
    assert await store.admin_session(b"\x02" * 32) is None
    assert await store.end_admin_session(sid) is True
    assert await store.admin_session(sid) is None
    assert await store.end_admin_session(sid) is False
    with _raw(where) as conn:
        rows = conn.execute("SELECT sid_sha256, expires_at FROM admin_sessions").fetchall()
    assert [(bytes(d), e) for d, e in rows] == [(b"\x03" * 32, 3000.0)]
