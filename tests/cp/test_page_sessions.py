"""The admin pages' sessions kept in the store (llmgw/cp/_pages/_sessions.py): a login on
one control plane holds on another that shares the store; a logout on either is honoured
on both; the store keeps only digests; a store outage delays the write, loses nothing."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.cp._pages._sessions import SESSION_TTL_S, Sessions, csrf_of
from llmgw.errors import PeerError
from llmgw.store import SQLITE_FILE, SqlStore, open_store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStore]:
    s = await open_store(tmp_path / "state", timeout_s=10)
    try:
        yield s
    finally:
        await s.aclose()


async def until(what: str, check: Callable[[], Awaitable[Any]], timeout: float = 10.0) -> Any:
    """Poll `check` until it returns something true; fail naming `what`."""
    with trio.move_on_after(timeout):
        while not (got := await check()):
            await trio.sleep(0.05)
        return got
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


async def test_a_login_holds_on_the_other_control_plane_and_a_logout_on_both(
    store: SqlStore, tmp_path: Path
) -> None:
    a = Sessions(store, check_s=0.2)
    b = Sessions(store, check_s=0.2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.writer)
        nursery.start_soon(b.writer)
        sid, mine = a.create()
        assert await a.get(sid) is mine  # at once, before any write
        other = await until("b knows a's session", lambda: b.get(sid))
        assert other.csrf == mine.csrf == csrf_of(sid)  # forms from either are accepted
        assert abs(other.expires - mine.expires) < 1e-6
        assert await b.get("not-a-session") is None
        b.end(sid)  # log out on b
        assert await b.get(sid) is None
        # a answers from memory, looks it up again behind once check_s passed: gone.
        await until("a honours b's logout", lambda: _gone(a, sid))
        nursery.cancel_scope.cancel()
    # Only the id's digest is in the store, never the id or the CSRF token.
    import sqlite3

    with sqlite3.connect(tmp_path / "state" / SQLITE_FILE) as raw:
        dump = "\n".join(raw.iterdump())
    assert sid not in dump and mine.csrf not in dump


async def _gone(sessions: Sessions, sid: str) -> bool:
    return await sessions.get(sid) is None


async def test_an_expired_session_is_refused_everywhere(store: SqlStore) -> None:
    now = [1_700_000_000.0]
    a = Sessions(store, clock=lambda: now[0])
    b = Sessions(store, clock=lambda: now[0])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.writer)
        sid, _ = a.create()
        await until("written", lambda: store.admin_session(hashlib.sha256(sid.encode()).digest()))
        assert await b.get(sid) is not None
        now[0] += SESSION_TTL_S
        assert await a.get(sid) is None and await b.get(sid) is None
        assert await Sessions(store, clock=lambda: now[0]).get(sid) is None
        nursery.cancel_scope.cancel()


class Flaky:
    """A store whose session calls fail while `down` (as a lost connection does)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.down = False
        self.failed = 0

    def _check(self) -> None:
        if self.down:
            self.failed += 1
            raise PeerError("store postgresql://db:5432/llmgw: connection refused")

    async def put_admin_session(self, sid_sha256: bytes, expires_at: float, now: float) -> None:
        self._check()
        await self.store.put_admin_session(sid_sha256, expires_at, now)

    async def admin_session(self, sid_sha256: bytes) -> float | None:
        self._check()
        return await self.store.admin_session(sid_sha256)

    async def end_admin_session(self, sid_sha256: bytes) -> bool:
        self._check()
        return await self.store.end_admin_session(sid_sha256)


async def test_a_login_during_a_store_outage_works_here_and_reaches_the_others_later(
    store: SqlStore,
) -> None:
    flaky = Flaky(store)
    flaky.down = True
    a = Sessions(flaky, check_s=0.1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.writer)
        sid, session = a.create()
        await until("a failed write", lambda: _true(flaky.failed >= 1))
        # Logged in here all along, and not logged out by a check that cannot answer.
        await trio.sleep(0.3)
        assert await a.get(sid) is session
        flaky.down = False
        other = Sessions(store)
        # Retried after the backoff (1 s first): then the other control plane knows it.
        found = await until("the write retried", lambda: other.get(sid), timeout=10)
        assert found.csrf == session.csrf and a.store_failures >= 1
        nursery.cancel_scope.cancel()


async def _true(value: bool) -> bool:
    await trio.lowlevel.checkpoint()
    return value
