"""API keys: who is calling, for which tenant, which models and priority bands.

The values (`ApiKey`, `TenantLimits`, `digest`, `new_key`) live in `llmgw.keys`
and the keys themselves in the store (llmgw/store, `StoreKeys`) or a
configuration file (`StaticKeys`); here is how the router reads them.
Secrets are shown once, at creation; stores keep only their SHA-256. The router
looks keys up through `CachedKeys`, so a request costs a dictionary lookup, not
a store round trip, even when the entry has expired (it is refreshed behind the
request); a revocation through the same `CachedKeys` takes effect at once in
this process, and within the cache's TTL plus one store answer in any other.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Protocol

import trio

from llmgw.errors import ConfigError, LlmgwError, UsageError
from llmgw.keys import ApiKey, digest
from llmgw.store import Store

log = logging.getLogger("llmgw.router.keys")


class KeyStore(Protocol):
    """Where keys live: the store (`StoreKeys`: the control plane's, or router-only mode's
    SQLite file) or a configuration file's static keys. Async."""

    async def create(
        self,
        *,
        tenant: str,
        models: Iterable[str] | None = None,
        default_band: str = "interactive",
        max_band: str | None = None,
        name: str = "",
        expires_at: float | None = None,
    ) -> tuple[ApiKey, str]:
        """Store a new key; returns it and its secret (never retrievable again)."""
        ...

    async def list(self) -> list[ApiKey]: ...

    async def revoke(self, key_id: str) -> bool:
        """Revoke; False when no such key exists."""
        ...

    async def lookup(self, secret: str) -> ApiKey | None:
        """The key with this secret, revoked or not; None for an unknown secret."""
        ...


class StoreKeys:
    """The KeyStore over the store's api_keys (llmgw/store), each key joined with its
    tenant's account: its expiry and limits, which is what admission needs.

    The control plane's router and its workers read the control plane's store
    through it; router-only mode, the store in its `keys_db` SQLite file
    (`open_sqlite_file`). Creating a key is the store's `create_key` either way.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"<StoreKeys {self.store!r}>"

    async def create(
        self,
        *,
        tenant: str,
        models: Iterable[str] | None = None,
        default_band: str = "interactive",
        max_band: str | None = None,
        name: str = "",
        expires_at: float | None = None,
    ) -> tuple[ApiKey, str]:
        return await self.store.create_key(
            tenant=tenant,
            models=models,
            default_band=default_band,
            max_band=max_band,
            name=name,
            expires_at=expires_at,
        )

    async def list(self) -> list[ApiKey]:
        return [k.key for k in await self.store.list_keys()]

    async def revoke(self, key_id: str) -> bool:
        return await self.store.revoke_key(key_id)

    async def lookup(self, secret: str) -> ApiKey | None:
        return await self.store.lookup_key(digest(secret))


class StaticKeys:
    """Keys given in a configuration file (router-only mode); read-only."""

    def __init__(self, keys: Iterable[tuple[str, ApiKey]]) -> None:
        self._by_digest: dict[bytes, ApiKey] = {}
        for secret, key in keys:
            d = digest(secret)
            if d in self._by_digest:
                raise ConfigError(f"API key {key.key_id}: the same secret is given twice")
            self._by_digest[d] = key

    def __repr__(self) -> str:
        return f"<StaticKeys {len(self._by_digest)} keys>"

    async def create(
        self,
        *,
        tenant: str,
        models: Iterable[str] | None = None,
        default_band: str = "interactive",
        max_band: str | None = None,
        name: str = "",
        expires_at: float | None = None,
    ) -> tuple[ApiKey, str]:
        raise UsageError("these keys come from the configuration file; edit it to add one")

    async def list(self) -> list[ApiKey]:
        return sorted(self._by_digest.values(), key=lambda k: k.key_id)

    async def revoke(self, key_id: str) -> bool:
        raise UsageError("these keys come from the configuration file; edit it to revoke one")

    async def lookup(self, secret: str) -> ApiKey | None:
        return self._by_digest.get(digest(secret))

    def lookup_now(self, secret: str) -> ApiKey | None:
        return self._by_digest.get(digest(secret))


# How long a request whose cached key is past its TTL waits for the store's fresh answer
# before it takes the cached one (only while the store has been answering).
INLINE_WAIT_S = 0.25


def _usable(key: ApiKey | None) -> ApiKey | None:
    """A cached key as a request may use it: None once it has expired while cached."""
    return key if key is not None and key.usable(time.time()) else None


class CachedKeys:
    """A store's lookups, remembered for `ttl_s` (unknown secrets for `negative_ttl_s`).

    A cached key is looked up again behind the requests that use it from half its
    TTL on (one lookup in flight per secret, in `run`'s nursery), and the answer
    replaces the entry: while the store answers, a key revoked elsewhere is refused
    within `ttl_s`. A request that finds its entry past the TTL waits for that
    lookup at most `INLINE_WAIT_S`, then is answered from the cache: a slow or
    frozen store never delays a request whose key is cached by more than that, and
    once a wait has run out nothing waits again until the store next answers. A
    refresh that fails keeps the cached key, for as long as the store does not
    answer: refusing known good keys during a store outage would turn a store
    problem into an outage of every router. A secret with nothing usable cached
    (never seen, unknown or revoked) waits for the store. Without `run` (nothing
    to refresh in), an expired entry is looked up in line.

    At most `max_entries` are kept; when full, the cache starts over, so a
    flood of made-up secrets costs store lookups, never memory.
    """

    def __init__(
        self,
        store: KeyStore,
        ttl_s: float = 30.0,
        *,
        negative_ttl_s: float = 2.0,
        max_entries: int = 100_000,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self._cache: dict[bytes, tuple[ApiKey | None, float]] = {}
        self._nursery: trio.Nursery | None = None
        self._refreshing: dict[bytes, trio.Event] = {}  # set when the lookup is over
        self._store_silent = False  # a wait ran out; cleared by the store's next answer
        self._warned_at = -math.inf
        self.hits = 0
        self.misses = 0
        self.stale_served = 0  # cached keys answered past their TTL (refresh pending or failed)
        self.refreshes = 0  # lookups started behind a request
        self.refresh_failures = 0

    def __repr__(self) -> str:
        return (
            f"<CachedKeys {len(self._cache)} cached, {self.hits} hits, {self.misses} misses,"
            f" {self.stale_served} stale, {len(self._refreshing)} refreshing>"
        )

    def statistics(self) -> dict[str, int]:
        return {
            "cached": len(self._cache),
            "hits": self.hits,
            "misses": self.misses,
            "stale_served": self.stale_served,
            "refreshes": self.refreshes,
            "refreshing": len(self._refreshing),
            "refresh_failures": self.refresh_failures,
        }

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery that refreshes run in (the router runs this), until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._refreshing.clear()

    async def lookup(self, secret: str) -> ApiKey | None:
        """The usable key for `secret`: None when unknown or revoked."""
        d = digest(secret)
        now = time.monotonic()
        entry = self._cache.get(d)
        if entry is not None and entry[0] is not None and self._nursery is not None:
            # Known: refreshed behind the request from half the TTL on; past the TTL,
            # the request waits a moment for the store (so a revocation holds within
            # the TTL while the store answers), then takes the cached answer.
            if entry[1] - now > self.ttl_s / 2:
                self.hits += 1
                return _usable(entry[0])
            done = self._refreshing.get(d)
            if done is None:
                done = self._refreshing[d] = trio.Event()
                self.refreshes += 1
                self._nursery.start_soon(self._refresh, secret, d, entry)
            if entry[1] > now:
                self.hits += 1
                return _usable(entry[0])
            if not self._store_silent:
                with trio.move_on_after(INLINE_WAIT_S):
                    await done.wait()
                if not done.is_set():
                    self._store_silent = True
            fresh = self._cache.get(d)
            if fresh is not entry and fresh is not None:  # the store's answer, or a new one
                self.hits += 1
                return _usable(fresh[0])
            if fresh is entry:  # the store did not answer in time: the cached key
                self.stale_served += 1
                return _usable(entry[0])
            entry = None  # revoked here meanwhile: asked again below
        if entry is not None and entry[1] > now:
            self.hits += 1
            return _usable(entry[0])
        self.misses += 1
        try:
            key = await self.store.lookup(secret)
        except LlmgwError as exc:
            # The store is down (or slow past its deadline): a key this process has
            # already seen keeps working on what it knew, revocations of the last
            # ttl_s aside; one it has never seen cannot be checked (the caller answers 503).
            if entry is not None and entry[0] is not None and entry[0].usable(time.time()):
                self.stale_served += 1
                self._warn(exc)
                return entry[0]
            raise
        return self._remember(d, key, now)

    async def _refresh(self, secret: str, d: bytes, entry: tuple[ApiKey | None, float]) -> None:
        try:
            key = await self.store.lookup(secret)
        except LlmgwError as exc:
            self.refresh_failures += 1
            self._warn(exc)  # the cached key stays; the next request tries again
            self._finished(d)
            return
        except BaseException:
            self._finished(d)
            raise
        self._store_silent = False
        if self._cache.get(d) is entry:  # not invalidated (revoked here) meanwhile
            self._remember(d, key, time.monotonic())
        self._finished(d)  # after the answer is in: a waiting request reads it

    def _finished(self, d: bytes) -> None:
        done = self._refreshing.pop(d, None)
        if done is not None:
            done.set()

    def _remember(self, d: bytes, key: ApiKey | None, now: float) -> ApiKey | None:
        if key is not None and (key.revoked or not key.usable(time.time())):
            key = None
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[d] = (key, now + (self.ttl_s if key is not None else self.negative_ttl_s))
        return key

    def _warn(self, exc: LlmgwError) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            log.warning(
                "key store unreachable; serving cached keys (%d answered stale so far): %s",
                self.stale_served,
                exc,
            )

    async def create(
        self,
        *,
        tenant: str,
        models: Iterable[str] | None = None,
        default_band: str = "interactive",
        max_band: str | None = None,
        name: str = "",
        expires_at: float | None = None,
    ) -> tuple[ApiKey, str]:
        key, secret = await self.store.create(
            tenant=tenant,
            models=models,
            default_band=default_band,
            max_band=max_band,
            name=name,
            expires_at=expires_at,
        )
        self._cache.pop(digest(secret), None)  # a cached "unknown" must not outlive the key
        return key, secret

    async def list(self) -> list[ApiKey]:
        return await self.store.list()

    async def revoke(self, key_id: str) -> bool:
        found = await self.store.revoke(key_id)
        self.invalidate(key_id)
        return found

    def invalidate(self, key_id: str | None = None) -> None:
        """Forget one key (or, with None, everything) so the next lookup asks the store."""
        if key_id is None:
            self._cache.clear()
            return
        for d, (key, _) in list(self._cache.items()):
            if key is not None and key.key_id == key_id:
                del self._cache[d]
