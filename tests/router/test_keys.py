"""API keys: hashed at rest, shown once, cached for lookups, revoked at once."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import pytest
import trio
import trio.testing

from llmgw.errors import ConfigError, DeadlineExceeded, UsageError
from llmgw.keys import ApiKey, digest
from llmgw.router._keys import CachedKeys, StaticKeys
from llmgw.router._main import open_keys_db
from llmgw.store import known_schema
from router.conftest import FakeEngine, serve_router


async def test_the_keys_db_keeps_only_hashes(tmp_path: Path) -> None:
    db = tmp_path / "state" / "keys.db"
    async with open_keys_db(db) as store:
        key, secret = await store.create(
            tenant="acme",
            models=["chat", "embed"],
            default_band="batch",
            max_band="interactive",
            name="ci",
        )
    assert secret.startswith("llmgw-") and len(secret) > 40
    assert key.tenant == "acme"
    assert key.models == frozenset({"chat", "embed"})
    assert (key.default_band, key.max_band, key.name) == ("batch", "interactive", "ci")

    raw = db.read_bytes() + (
        db.with_name("keys.db-wal").read_bytes() if db.with_name("keys.db-wal").exists() else b""
    )
    assert secret.encode() not in raw
    rows = sqlite3.connect(db).execute("SELECT secret_sha256 FROM api_keys").fetchall()
    assert rows == [(hashlib.sha256(secret.encode()).digest(),)]

    async with open_keys_db(db) as again:  # a new process's view: everything from the file
        assert await again.lookup(secret) == key
        assert await again.lookup(secret + "x") is None
        everything, _ = await again.create(tenant="other")
        assert everything.models is None and everything.max_band == "interactive"
        assert [k.key_id for k in await again.list()] == [key.key_id, everything.key_id]
        assert await again.revoke(key.key_id) is True
        assert await again.revoke("key-nope") is False
        revoked = await again.lookup(secret)
        assert revoked is not None and revoked.revoked


async def test_cache_serves_lookups_and_revocation_is_immediate(tmp_path: Path) -> None:
    async with (
        open_keys_db(tmp_path / "keys.db") as store,
        open_keys_db(tmp_path / "keys.db") as other,
    ):
        cached = CachedKeys(store, ttl_s=300)
        key, secret = await cached.create(tenant="acme")
        assert await cached.lookup(secret) == key
        assert await cached.lookup(secret) == key
        assert cached.statistics()["hits"] == 1 and cached.statistics()["misses"] == 1

        # Another process revokes it: this cache notices only after its TTL ...
        await other.revoke(key.key_id)
        assert await cached.lookup(secret) == key
        # ... but a revocation through this cache takes effect at once.
        key2, secret2 = await cached.create(tenant="acme")
        assert await cached.lookup(secret2) == key2
        assert await cached.revoke(key2.key_id) is True
        assert await cached.lookup(secret2) is None
        # Unknown secrets are remembered briefly too, so a flood does not hit the store.
        assert await cached.lookup("llmgw-made-up") is None
        misses = cached.statistics()["misses"]
        assert await cached.lookup("llmgw-made-up") is None
        assert cached.statistics()["misses"] == misses


# The keys database as a router before the store wrote it (its SqliteKeyStore): one
# table, no expires_at, no schema_version. Frozen: this is what operators' files hold.
OLD_KEYS_DB = """
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


def write_old_keys_db(path: Path, keys: list[tuple[ApiKey, str]]) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(OLD_KEYS_DB)
        for key, secret in keys:
            db.execute(
                "INSERT INTO api_keys (key_id, secret_sha256, tenant, models, default_band,"
                " max_band, created_at, revoked, name) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    key.key_id,
                    digest(secret),
                    key.tenant,
                    None if key.models is None else json.dumps(sorted(key.models)),
                    key.default_band,
                    key.max_band,
                    key.created_at,
                    int(key.revoked),
                    key.name,
                ),
            )
    finally:
        db.close()


async def test_a_keys_db_of_an_older_router_is_migrated_and_its_keys_still_work(
    tmp_path: Path, start_engine: Callable[..., FakeEngine]
) -> None:
    db = tmp_path / "keys.db"
    live = ApiKey(
        "key-0ld11ve", "acme", frozenset({"chat"}), "batch", "interactive", 1.7e9, name="ci"
    )
    gone = ApiKey("key-0ldg0ne", "beta", None, "interactive", "interactive", 1.7e9 + 1, True)
    write_old_keys_db(db, [(live, "llmgw-old-live"), (gone, "llmgw-old-gone")])

    fe = start_engine("chat")
    body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    async with open_keys_db(db) as keys:
        # Every field kept, and the keys never expire (the old file kept no expiry).
        assert await keys.list() == [live, gone]
        cached = CachedKeys(keys, ttl_s=300)
        async with (
            serve_router([fe.endpoint()], keys=cached) as r,
            httpx.AsyncClient(timeout=30) as h,
        ):
            url = r.base_url + "/chat/completions"
            ok = await h.post(url, headers={"Authorization": "Bearer llmgw-old-live"}, json=body)
            assert ok.status_code == 200, ok.text
            refused = await h.post(
                url, headers={"Authorization": "Bearer llmgw-old-gone"}, json=body
            )
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        # The migrated file is the store's: a new key may expire.
        made, _ = await keys.create(tenant="acme", expires_at=4e9)
        assert made.expires_at == 4e9

    with sqlite3.connect(db) as raw:
        tables = {n for (n,) in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        columns = {row[1] for row in raw.execute("PRAGMA table_info(api_keys)")}
        versions = [v for (v,) in raw.execute("SELECT version FROM schema_version ORDER BY 1")]
    assert {"api_keys", "accounts", "lease", "schema_version"} <= tables
    assert "api_keys_before_store" not in tables
    assert "expires_at" in columns
    assert versions == list(range(1, known_schema("sqlite") + 1))

    async with open_keys_db(db) as again:  # opened again: migrated once, nothing lost
        assert [k.key_id for k in await again.list()] == [live.key_id, gone.key_id, made.key_id]
        assert await again.lookup("llmgw-old-live") == live


async def test_static_keys_are_read_only() -> None:
    key = ApiKey("k1", "t", None, "interactive", "interactive", 0.0)
    static = StaticKeys([("llmgw-secret", key)])
    assert await static.lookup("llmgw-secret") == key
    assert await static.lookup("llmgw-other") is None
    with pytest.raises(UsageError):
        await static.revoke("k1")
    with pytest.raises(ConfigError, match="twice"):
        StaticKeys([("s", key), ("s", key)])


async def test_a_revoked_key_is_refused_by_the_router_at_once(
    tmp_path: Path, start_engine: Callable[..., FakeEngine]
) -> None:
    fe = start_engine("chat")
    body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    async with open_keys_db(tmp_path / "keys.db") as store:
        cached = CachedKeys(store, ttl_s=300)
        key, secret = await cached.create(tenant="acme", models=["chat"])
        async with (
            serve_router([fe.endpoint()], keys=cached) as r,
            httpx.AsyncClient(timeout=30) as h,
        ):
            url = r.base_url + "/chat/completions"
            auth = {"Authorization": f"Bearer {secret}"}
            assert (await h.post(url, headers=auth, json=body)).status_code == 200
            assert r.router.keys is cached
            await cached.revoke(key.key_id)
            refused = await h.post(url, headers=auth, json=body)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"


async def test_priority_band_header_is_capped_by_the_key(
    start_engine: Callable[..., FakeEngine],
) -> None:
    from router.conftest import SECRET_A, SECRET_LIMITED, sample

    fe = start_engine("chat")
    body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    async with serve_router([fe.endpoint()]) as r, httpx.AsyncClient(timeout=30) as h:
        url = r.base_url + "/chat/completions"
        limited = {"Authorization": f"Bearer {SECRET_LIMITED}"}
        # The limited key's highest band is batch: asking for interactive gets batch.
        resp = await h.post(url, headers={**limited, "X-LLMGW-Priority": "interactive"}, json=body)
        assert resp.status_code == 200
        a = {"Authorization": f"Bearer {SECRET_A}"}
        resp = await h.post(url, headers={**a, "X-LLMGW-Priority": "batch"}, json=body)
        assert resp.status_code == 200
        resp = await h.post(url, headers={**a, "X-LLMGW-Priority": "urgent"}, json=body)
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "unknown_band"
        text = r.metrics_text()
        assert sample(text, "llmgw_router_requests_total", band="batch", status="200") == 2.0
        assert sample(text, "llmgw_router_requests_total", band="interactive", status="200") is None


async def test_a_known_key_outlives_a_store_outage_and_an_unknown_one_is_503(
    start_engine: Callable[..., FakeEngine],
) -> None:
    """The store down (PostgreSQL gone): keys this router has seen keep working past the
    cache's TTL; a secret it has never seen cannot be checked: 503 with Retry-After, not
    a 500 and not a 401 (the key may well be valid)."""
    key = ApiKey("k1", "acme", None, "interactive", "interactive", 0.0)

    class FlakyStore(StaticKeys):
        down = False

        async def lookup(self, secret: str) -> ApiKey | None:
            if self.down:
                raise DeadlineExceeded("store postgresql://db:5432/llmgw: no answer within 10 s")
            return await super().lookup(secret)

    store = FlakyStore([("llmgw-known", key)])
    cached = CachedKeys(store, ttl_s=0.0)  # every lookup goes to the store
    fe = start_engine("chat")
    body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    async with serve_router([fe.endpoint()], keys=cached) as r, httpx.AsyncClient(timeout=30) as h:
        url = r.base_url + "/chat/completions"
        known = {"Authorization": "Bearer llmgw-known"}
        assert (await h.post(url, headers=known, json=body)).status_code == 200
        store.down = True
        assert (await h.post(url, headers=known, json=body)).status_code == 200
        assert cached.statistics()["stale_served"] == 1
        unknown = await h.post(url, headers={"Authorization": "Bearer llmgw-new"}, json=body)
        assert unknown.status_code == 503, unknown.text
        assert unknown.headers["retry-after"] == "5"
        assert unknown.json()["error"]["code"] == "key_store_unavailable"
        assert "no answer within 10 s" in unknown.json()["error"]["message"]
        store.down = False
        assert (await h.post(url, headers=known, json=body)).status_code == 200


class GatedStore(StaticKeys):
    """A KeyStore whose lookups can be held (a frozen store) and whose answer can change."""

    def __init__(self, secret: str, key: ApiKey) -> None:
        super().__init__([(secret, key)])
        self.answer: ApiKey | None = key
        self.calls = 0
        self.held = False
        self.gate = trio.Event()
        self.fail = False

    async def lookup(self, secret: str) -> ApiKey | None:
        self.calls += 1
        if self.held:
            await self.gate.wait()
        if self.fail:
            raise DeadlineExceeded("store postgresql://db:5432/llmgw: no answer within 10 s")
        return self.answer


KNOWN = ApiKey("k1", "acme", None, "interactive", "interactive", 0.0)


async def test_an_expired_entry_answers_at_once_and_one_refresh_brings_a_revocation() -> None:
    """The store frozen: a cached key whose entry has expired is answered from the cache
    (the first request waits INLINE_WAIT_S for the store, the next not at all), while
    exactly one lookup runs behind them; when the store answers that the key is revoked,
    the next request is refused, without asking it again."""
    store = GatedStore("llmgw-known", KNOWN)
    cached = CachedKeys(store, ttl_s=0.0, negative_ttl_s=300)  # every entry expires at once
    async with trio.open_nursery() as nursery:
        await nursery.start(cached.run)
        assert await cached.lookup("llmgw-known") == KNOWN  # nothing cached: asks the store
        assert store.calls == 1
        store.held = True
        store.answer = attrs.evolve(KNOWN, revoked=True)
        with trio.fail_after(1):  # the frozen store never answers: these must not wait
            for _ in range(5):
                assert await cached.lookup("llmgw-known") == KNOWN
        await trio.testing.wait_all_tasks_blocked()
        assert store.calls == 2  # one refresh, not five
        stats = cached.statistics()
        assert (stats["stale_served"], stats["refreshes"], stats["refreshing"]) == (5, 1, 1)
        store.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert cached.statistics()["refreshing"] == 0
        assert await cached.lookup("llmgw-known") is None
        assert store.calls == 2  # the revocation came from the refresh, now cached
        nursery.cancel_scope.cancel()


async def test_a_failed_refresh_keeps_the_cached_key_and_a_local_revocation_wins() -> None:
    """A refresh that fails keeps serving the key (the next request tries again); a
    refresh in flight while this process revokes the key does not bring it back."""
    store = GatedStore("llmgw-known", KNOWN)
    cached = CachedKeys(store, ttl_s=0.0, negative_ttl_s=300)
    async with trio.open_nursery() as nursery:
        await nursery.start(cached.run)
        assert await cached.lookup("llmgw-known") == KNOWN
        store.fail = True
        assert await cached.lookup("llmgw-known") == KNOWN
        await trio.testing.wait_all_tasks_blocked()
        assert cached.statistics()["refresh_failures"] == 1
        assert await cached.lookup("llmgw-known") == KNOWN  # still served; refreshed again
        await trio.testing.wait_all_tasks_blocked()
        assert (store.calls, cached.statistics()["refresh_failures"]) == (3, 2)

        store.fail, store.held = False, True
        assert await cached.lookup("llmgw-known") == KNOWN  # a refresh now hangs
        await trio.testing.wait_all_tasks_blocked()
        cached.invalidate("k1")  # revoked here meanwhile (the store says so from now on)
        store.answer, store.held = None, False
        store.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        # The refresh's answer, read before the revocation, was dropped: the next lookup
        # asks the store itself.
        assert await cached.lookup("llmgw-known") is None
        assert store.calls == 5
        nursery.cancel_scope.cancel()


async def test_while_the_store_answers_a_revocation_holds_within_the_ttl() -> None:
    """A key revoked in the store (by another control plane) is refused by every request
    past `ttl_s` while the store answers: refreshed from half the TTL on behind the
    requests, and a request that finds its entry past the TTL waits for the store's
    answer rather than take the cached key."""
    store = GatedStore("llmgw-known", KNOWN)
    cached = CachedKeys(store, ttl_s=1.0, negative_ttl_s=300)
    async with trio.open_nursery() as nursery:
        await nursery.start(cached.run)
        assert await cached.lookup("llmgw-known") == KNOWN
        store.answer = attrs.evolve(KNOWN, revoked=True)
        await trio.sleep(1.1)  # the TTL under test: nothing looked the key up meanwhile
        assert await cached.lookup("llmgw-known") is None  # waited for the store's answer
        assert store.calls == 2

        # Used all the time: refreshed from half the TTL on, so refused before the TTL.
        other = CachedKeys(GatedStore("llmgw-known", KNOWN), ttl_s=1.0, negative_ttl_s=300)
        await nursery.start(other.run)
        assert await other.lookup("llmgw-known") == KNOWN
        other.store.answer = attrs.evolve(KNOWN, revoked=True)  # type: ignore[attr-defined]
        began = time.monotonic()
        while await other.lookup("llmgw-known") is not None:
            assert time.monotonic() - began < 1.0, "admitted past the TTL"
            await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
