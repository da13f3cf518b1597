"""The admin pages' logged-in browsers: random session ids, kept in memory and in the store.

A login makes a random id (`secrets.token_urlsafe(32)`, the cookie's value) and its
CSRF token, derived from it (a digest under a label of its own), so any control plane
that sees the cookie knows the token without keeping it. The store keeps only the
SHA-256 of the id and when it expires (llmgw/store/_sessions.py): a session made on
one control plane is valid on every other that shares the store, and after a failover.

Nothing on a page request waits for a write: `create` and `end` change memory at once
and queue the write; `writer` (a task of its own) writes the queue, retrying a failing
store with a doubling backoff, so a login during a store outage works here and reaches
the others once the store answers. A session this process knows is answered from memory;
once its last check is `check_s` old it is looked up again behind the request (by the
writer), so a logout or an expiry elsewhere is honoured within `check_s` plus a write.
An id this process has not seen is looked up in the store, bounded by `lookup_s`; a store
that does not answer in time leaves that browser logged out here (it logs in again).
Sessions last SESSION_TTL_S; at most MAX_SESSIONS are held in memory (the least recently
used goes first; the store still has it).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from llmgw.errors import LlmgwError

log = logging.getLogger("llmgw.cp.pages")

SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 256
CHECK_S = 5.0
LOOKUP_S = 2.0
RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0


class SessionRows(Protocol):
    """The store's admin_sessions table (llmgw/store/_sessions.py)."""

    async def put_admin_session(self, sid_sha256: bytes, expires_at: float, now: float) -> None: ...
    async def admin_session(self, sid_sha256: bytes) -> float | None: ...
    async def end_admin_session(self, sid_sha256: bytes) -> bool: ...


@attrs.define
class Session:
    csrf: str
    expires: float  # wall clock, seconds since the epoch
    checked: float = 0.0  # when the store last said it holds it (wall clock)


def digest(sid: str) -> bytes:
    """What the store keeps of a session id."""
    return hashlib.sha256(sid.encode()).digest()


def csrf_of(sid: str) -> str:
    """The session's CSRF token: from its id, under a label of its own (the store's digest
    of the id does not give it, and the token does not give the id)."""
    raw = hashlib.sha256(b"llmgw admin csrf\0" + sid.encode()).digest()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


class Sessions:
    def __init__(
        self,
        store: SessionRows | None = None,
        *,
        clock: Callable[[], float] = time.time,
        check_s: float = CHECK_S,
        lookup_s: float = LOOKUP_S,
    ) -> None:
        self._store = store
        self._clock = clock
        self.check_s = check_s
        self.lookup_s = lookup_s
        self._by_digest: OrderedDict[bytes, Session] = OrderedDict()
        # digest -> expiry to write, or None to delete; oldest first
        self._writes: OrderedDict[bytes, float | None] = OrderedDict()
        self._checks: set[bytes] = set()  # known sessions to look up again
        self._wake = trio.Event()
        self.store_failures = 0

    def __repr__(self) -> str:
        return (
            f"<Sessions {len(self._by_digest)} held, {len(self._writes)} to write, "
            f"{self.store_failures} store failures>"
        )

    def __len__(self) -> int:
        return len(self._by_digest)

    def _hold(self, key: bytes, session: Session) -> None:
        self._by_digest[key] = session
        self._by_digest.move_to_end(key)
        while len(self._by_digest) > MAX_SESSIONS:
            self._by_digest.popitem(last=False)

    def _queue(self, key: bytes, expires: float | None) -> None:
        if self._store is None:
            return
        self._writes[key] = expires
        self._writes.move_to_end(key)
        while len(self._writes) > 4 * MAX_SESSIONS:  # a store out for long: bounded
            self._writes.popitem(last=False)
        self._wake.set()

    def create(self) -> tuple[str, Session]:
        sid = secrets.token_urlsafe(32)
        now = self._clock()
        session = Session(csrf_of(sid), now + SESSION_TTL_S, now)
        key = digest(sid)
        self._hold(key, session)
        self._queue(key, session.expires)
        return sid, session

    async def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        key, now = digest(sid), self._clock()
        found = self._by_digest.get(key)
        if found is not None:
            if found.expires <= now:
                del self._by_digest[key]
                return None
            self._by_digest.move_to_end(key)
            stale = self._store is not None and now - found.checked >= self.check_s
            if stale and key not in self._writes:  # not yet written: the store cannot know it
                self._checks.add(key)
                self._wake.set()
            return found
        if self._store is None or (key in self._writes and self._writes[key] is None):
            return None  # unknown here, or ended here and not yet deleted from the store
        try:
            with trio.fail_after(self.lookup_s):
                expires = await self._store.admin_session(key)
        except (LlmgwError, trio.TooSlowError) as exc:
            self.store_failures += 1
            log.warning("admin pages: cannot look a session up in the store: %s",
                        exc or f"no answer in {self.lookup_s:g} s")  # fmt: skip
            return None
        if expires is None or expires <= now:
            return None
        session = Session(csrf_of(sid), expires, now)
        self._hold(key, session)
        return session

    def end(self, sid: str | None) -> None:
        if sid:
            key = digest(sid)
            self._by_digest.pop(key, None)
            self._checks.discard(key)
            self._queue(key, None)

    async def _check(self, key: bytes) -> None:
        assert self._store is not None
        expires = await self._store.admin_session(key)
        held = self._by_digest.get(key)
        if held is None or key in self._writes:
            return
        if expires is None or expires <= self._clock():
            del self._by_digest[key]  # ended or expired on another control plane
        else:
            held.expires, held.checked = expires, self._clock()

    async def _write(self, key: bytes, expires: float | None) -> None:
        assert self._store is not None
        if expires is None:
            await self._store.end_admin_session(key)
        else:
            await self._store.put_admin_session(key, expires, self._clock())

    async def writer(self) -> None:
        """Writes logins and logouts and looks known sessions up again; runs until
        cancelled, retrying a failing store with a doubling backoff."""
        if self._store is None:
            return
        backoff = 0.0
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            try:
                while self._writes:
                    key, expires = next(iter(self._writes.items()))
                    await self._write(key, expires)
                    if self._writes.get(key, 0.0) == expires:  # unchanged meanwhile
                        del self._writes[key]
                while self._checks:
                    key = next(iter(self._checks))
                    await self._check(key)
                    self._checks.discard(key)
            except LlmgwError as exc:
                self.store_failures += 1
                backoff = min(RETRY_MAX_S, max(RETRY_MIN_S, backoff * 2))
                log.warning("admin pages: the store failed (%d session writes wait; tried "
                            "again in %g s): %s", len(self._writes), backoff, exc)  # fmt: skip
                await trio.sleep(backoff)
                self._wake.set()
                continue
            backoff = 0.0
