"""API keys: who is calling, for which tenant, which models and priority bands.

The values (`ApiKey`, `TenantLimits`, `digest`, `new_key`) live in `llmgw.keys`
and the keys themselves in the store (llmgw/store, `StoreKeys`) or a
configuration file (`StaticKeys`); here is how the router reads them.
Secrets are shown once, at creation; stores keep only their SHA-256. The router
looks keys up through `CachedKeys`, so a request costs a dictionary lookup, not
a store round trip; a revocation through the same `CachedKeys` takes effect at
once in this process, and within the cache's TTL in any other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

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


class CachedKeys:
    """A store's lookups, remembered for `ttl_s` (unknown secrets for `negative_ttl_s`).

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
        self.hits = 0
        self.misses = 0
        self.stale_served = 0  # cached keys answered past their TTL while the store failed

    def __repr__(self) -> str:
        return f"<CachedKeys {len(self._cache)} cached, {self.hits} hits, {self.misses} misses>"

    def statistics(self) -> dict[str, int]:
        return {
            "cached": len(self._cache),
            "hits": self.hits,
            "misses": self.misses,
            "stale_served": self.stale_served,
        }

    async def lookup(self, secret: str) -> ApiKey | None:
        """The usable key for `secret`: None when unknown or revoked."""
        d = digest(secret)
        now = time.monotonic()
        entry = self._cache.get(d)
        if entry is not None and entry[1] > now:
            self.hits += 1
            cached = entry[0]
            if cached is not None and not cached.usable(time.time()):
                return None  # expired while cached
            return cached
        self.misses += 1
        try:
            key = await self.store.lookup(secret)
        except LlmgwError as exc:
            # The store is down (or slow past its deadline): a key this process has
            # already seen keeps working on what it knew, revocations of the last
            # ttl_s aside; one it has never seen cannot be checked (the caller answers 503).
            if entry is not None and entry[0] is not None and entry[0].usable(time.time()):
                self.stale_served += 1
                if self.stale_served % 1000 == 1:
                    log.warning("key store unreachable; serving cached keys: %s", exc)
                return entry[0]
            raise
        if key is not None and (key.revoked or not key.usable(time.time())):
            key = None
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[d] = (key, now + (self.ttl_s if key is not None else self.negative_ttl_s))
        return key

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
