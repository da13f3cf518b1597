"""API keys: who is calling, for which tenant, which models and priority bands.

The values (`ApiKey`, `TenantLimits`, `digest`, `new_key`) live in `llmgw.keys`,
shared with the control plane's store; here are the stores keys are kept in.
Secrets are shown once, at creation; stores keep only their SHA-256. The router
looks keys up through `CachedKeys`, so a request costs a dictionary lookup, not
a store round trip; a revocation through the same `CachedKeys` takes effect at
once in this process, and within the cache's TTL in any other.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import trio

from llmgw.errors import ConfigError, LlmgwError, UsageError
from llmgw.keys import ApiKey, digest, new_key

log = logging.getLogger("llmgw.router.keys")


class KeyStore(Protocol):
    """Where keys live: the control plane's store (llmgw/cp/_accounts.py StoreKeys), a
    configuration file's static keys, or the standalone router's SQLite file. Async."""

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


_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    secret_sha256 BLOB NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    models TEXT,
    default_band TEXT NOT NULL,
    max_band TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0,
    name TEXT NOT NULL DEFAULT ''
)
"""
_COLUMNS = "key_id, tenant, models, default_band, max_band, created_at, revoked, name"


def _row_key(row: tuple[object, ...]) -> ApiKey:
    key_id, tenant, models, default_band, max_band, created_at, revoked, name = row
    return ApiKey(
        key_id=str(key_id),
        tenant=str(tenant),
        models=None if models is None else frozenset(json.loads(str(models))),
        default_band=str(default_band),
        max_band=str(max_band),
        created_at=float(created_at),  # type: ignore[arg-type]
        revoked=bool(revoked),
        name=str(name),
    )


class SqliteKeyStore:
    """Keys in one SQLite file; every statement runs in a worker thread, off the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"<SqliteKeyStore {self.path}>"

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=5000")
            db.execute(_SCHEMA)
            self._db = db
        return self._db

    def _run(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        with self._lock:
            try:
                return self._connect().execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise ConfigError(f"key store {self.path}: {exc}") from None

    async def _call(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        return await trio.to_thread.run_sync(self._run, sql, args)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

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
        if expires_at is not None:
            raise UsageError(
                f"{self.path}: this key file keeps no expiry; keys that expire live in the "
                "control plane's store"
            )
        key, secret = new_key(
            tenant=tenant, models=models, default_band=default_band, max_band=max_band, name=name
        )
        await self._call(
            f"INSERT INTO api_keys (secret_sha256, {_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                digest(secret),
                key.key_id,
                key.tenant,
                None if key.models is None else json.dumps(sorted(key.models)),
                key.default_band,
                key.max_band,
                key.created_at,
                0,
                key.name,
            ),
        )
        log.info("API key %s created for tenant %s", key.key_id, tenant)
        return key, secret

    async def list(self) -> list[ApiKey]:
        rows = await self._call(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, key_id")
        return [_row_key(r) for r in rows]

    async def revoke(self, key_id: str) -> bool:
        rows = await self._call(
            "UPDATE api_keys SET revoked = 1 WHERE key_id = ? RETURNING key_id", (key_id,)
        )
        if rows:
            log.info("API key %s revoked", key_id)
        return bool(rows)

    async def lookup(self, secret: str) -> ApiKey | None:
        rows = await self._call(
            f"SELECT {_COLUMNS} FROM api_keys WHERE secret_sha256 = ?", (digest(secret),)
        )
        return _row_key(rows[0]) if rows else None


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
