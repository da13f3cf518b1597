"""The store's schema: ordered migrations per backend, applied at open.

Migration N brings the schema from version N-1 to N; `schema_version` records
each one applied. They run at open inside one transaction (on PostgreSQL under
an advisory lock, on SQLite under BEGIN IMMEDIATE), so two processes opening the
same store at once apply each step once. A store whose schema is newer than
this code knows is refused.

Version 0 with rows: before the store, router-only mode kept its keys in a
SQLite file of its own (`keys_db`, the router's SqliteKeyStore): one `api_keys`
table, the store's columns less `expires_at`, and no `schema_version`. Opened
as a store, that table is set aside, the migrations create the store's
tables, and its keys are copied in (never expiring) before it is dropped, all
in the one transaction: the keys keep their ids, secret digests and
revocations, and an interrupted open leaves the old file as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from llmgw.errors import ConfigError
from llmgw.store._backends import Backend, Exec

log = logging.getLogger("llmgw.store")

# Ordered: migration N brings the schema from version N-1 to N. Append, never edit.
_SQLITE_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE accounts (
        name TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, max_band TEXT,
        created_at REAL NOT NULL);
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY, secret_sha256 BLOB NOT NULL UNIQUE, tenant TEXT NOT NULL,
        models TEXT, default_band TEXT NOT NULL, max_band TEXT NOT NULL,
        created_at REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
        name TEXT NOT NULL DEFAULT '', expires_at REAL);
    CREATE TABLE node_overrides (
        node_id TEXT PRIMARY KEY, kind TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL);
    CREATE TABLE known_nodes (
        node_id TEXT PRIMARY KEY, address TEXT NOT NULL, last_seen REAL NOT NULL);
    CREATE TABLE lease (
        id INTEGER PRIMARY KEY CHECK (id = 1), holder TEXT, epoch INTEGER NOT NULL,
        expires_at REAL NOT NULL);
    INSERT INTO lease (id, holder, epoch, expires_at) VALUES (1, NULL, 0, 0);
    CREATE TABLE audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, actor TEXT NOT NULL,
        action TEXT NOT NULL, detail TEXT NOT NULL);
    CREATE TABLE usage (
        hour INTEGER NOT NULL, tenant TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
        requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, PRIMARY KEY (hour, tenant, key_id, model));
    """,
    # 2: the leader's endpoint list, for the standbys' routers (publish_endpoints).
    """
    CREATE TABLE published_endpoints (
        id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL, body TEXT,
        at REAL NOT NULL);
    INSERT INTO published_endpoints (id, epoch, body, at) VALUES (1, 0, NULL, 0);
    """,
    # 3: each model's rollout and its last settled version (llmgw/cp/_fleet/_rollouts.py).
    """
    CREATE TABLE rollouts (
        model TEXT PRIMARY KEY, body TEXT NOT NULL, at REAL NOT NULL);
    """,
    # 4: the event log (llmgw/cp/_observe/_event_keeper.py), newest `events_kept` rows,
    # and the admin pages' sessions, by the digest of their id (llmgw/cp/_pages/_sessions.py).
    """
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, body TEXT NOT NULL);
    CREATE TABLE admin_sessions (
        sid_sha256 BLOB PRIMARY KEY, expires_at REAL NOT NULL);
    """,
    # 5: tenants' per-minute budgets leased to the routers
    # (llmgw/store/_budget.py), and when each router last leased.
    """
    CREATE TABLE rate_budget (
        tenant TEXT NOT NULL, kind TEXT NOT NULL, win INTEGER NOT NULL,
        taken INTEGER NOT NULL, PRIMARY KEY (tenant, kind, win));
    CREATE TABLE rate_routers (router TEXT PRIMARY KEY, seen_at REAL NOT NULL);
    """,
    # 6: each control plane's routers' load, for the leader's autoscaler, and the
    # counts operators hold (`ctl autoscale pause`) (llmgw/store/_autoscale.py).
    """
    CREATE TABLE router_load (cp TEXT PRIMARY KEY, body TEXT NOT NULL, at REAL NOT NULL);
    CREATE TABLE autoscale_paused (
        model TEXT PRIMARY KEY, replicas INTEGER NOT NULL, actor TEXT NOT NULL,
        at REAL NOT NULL);
    """,
)
_PG_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE accounts (
        name TEXT PRIMARY KEY, rpm BIGINT, tpm BIGINT, max_band TEXT,
        created_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY, secret_sha256 BYTEA NOT NULL UNIQUE, tenant TEXT NOT NULL,
        models TEXT, default_band TEXT NOT NULL, max_band TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
        name TEXT NOT NULL DEFAULT '', expires_at DOUBLE PRECISION);
    CREATE TABLE node_overrides (
        node_id TEXT PRIMARY KEY, kind TEXT NOT NULL, reason TEXT NOT NULL,
        at DOUBLE PRECISION NOT NULL);
    CREATE TABLE known_nodes (
        node_id TEXT PRIMARY KEY, address TEXT NOT NULL, last_seen DOUBLE PRECISION NOT NULL);
    CREATE TABLE lease (
        id INTEGER PRIMARY KEY CHECK (id = 1), holder TEXT, epoch BIGINT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL);
    INSERT INTO lease (id, holder, epoch, expires_at) VALUES (1, NULL, 0, 0);
    CREATE TABLE audit (
        seq BIGSERIAL PRIMARY KEY, at DOUBLE PRECISION NOT NULL, actor TEXT NOT NULL,
        action TEXT NOT NULL, detail TEXT NOT NULL);
    CREATE TABLE usage (
        hour BIGINT NOT NULL, tenant TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
        requests BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL, PRIMARY KEY (hour, tenant, key_id, model));
    """,
    # 2: the leader's endpoint list, for the standbys' routers (publish_endpoints).
    """
    CREATE TABLE published_endpoints (
        id INTEGER PRIMARY KEY CHECK (id = 1), epoch BIGINT NOT NULL, body TEXT,
        at DOUBLE PRECISION NOT NULL);
    INSERT INTO published_endpoints (id, epoch, body, at) VALUES (1, 0, NULL, 0);
    """,
    # 3: each model's rollout and its last settled version (llmgw/cp/_fleet/_rollouts.py).
    """
    CREATE TABLE rollouts (
        model TEXT PRIMARY KEY, body TEXT NOT NULL, at DOUBLE PRECISION NOT NULL);
    """,
    # 4: the event log (llmgw/cp/_observe/_event_keeper.py), newest `events_kept` rows,
    # and the admin pages' sessions, by the digest of their id (llmgw/cp/_pages/_sessions.py).
    """
    CREATE TABLE events (
        seq BIGSERIAL PRIMARY KEY, at DOUBLE PRECISION NOT NULL, body TEXT NOT NULL);
    CREATE TABLE admin_sessions (
        sid_sha256 BYTEA PRIMARY KEY, expires_at DOUBLE PRECISION NOT NULL);
    """,
    # 5: tenants' per-minute budgets leased to the routers
    # (llmgw/store/_budget.py), and when each router last leased.
    """
    CREATE TABLE rate_budget (
        tenant TEXT NOT NULL, kind TEXT NOT NULL, win BIGINT NOT NULL,
        taken BIGINT NOT NULL, PRIMARY KEY (tenant, kind, win));
    CREATE TABLE rate_routers (router TEXT PRIMARY KEY, seen_at DOUBLE PRECISION NOT NULL);
    """,
    # 6: each control plane's routers' load, for the leader's autoscaler, and the
    # counts operators hold (`ctl autoscale pause`) (llmgw/store/_autoscale.py).
    """
    CREATE TABLE router_load (
        cp TEXT PRIMARY KEY, body TEXT NOT NULL, at DOUBLE PRECISION NOT NULL);
    CREATE TABLE autoscale_paused (
        model TEXT PRIMARY KEY, replicas BIGINT NOT NULL, actor TEXT NOT NULL,
        at DOUBLE PRECISION NOT NULL);
    """,
)
_PG_MIGRATE_LOCK = 0x6C6C6D67  # "llmg": the advisory lock that serializes migrations


@attrs.frozen
class Schema:
    """One backend's migrations and how they are applied."""

    migrations: tuple[str, ...]
    lock: str | None  # a statement that serializes migrators, run first in the transaction
    # SQLite: a version-0 file may be router-only mode's key file of before (module docstring).
    takes_old_router_keys: bool


SQLITE = Schema(_SQLITE_MIGRATIONS, None, takes_old_router_keys=True)
POSTGRES = Schema(
    _PG_MIGRATIONS, f"SELECT pg_advisory_xact_lock({_PG_MIGRATE_LOCK})", takes_old_router_keys=False
)

# What SqliteKeyStore's api_keys held; the store's api_keys has these and expires_at.
_OLD_KEY_COLUMNS = (
    "key_id, secret_sha256, tenant, models, default_band, max_band, created_at, revoked, name"
)
_OLD_KEYS_ASIDE = "api_keys_before_store"


def known_schema(backend: str) -> int:
    """The newest schema version this llmgw knows for "sqlite" or "postgresql"."""
    return len((SQLITE if backend == "sqlite" else POSTGRES).migrations)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _too_new(where: str, found: int, known: int) -> ConfigError:
    return ConfigError(
        f"the store at {where} has schema {found}; this llmgw knows up to {known}: upgrade llmgw"
    )


def _set_aside_old_router_keys(run: Exec) -> bool:
    """Rename a version-0 file's api_keys out of migration 1's way; whether there was one."""
    if not run("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'api_keys'"):
        return False
    run(f"ALTER TABLE api_keys RENAME TO {_OLD_KEYS_ASIDE}")
    return True


def _take_old_router_keys(run: Exec) -> int:
    """Copy the set-aside keys into the store's api_keys, then drop them; how many."""
    run(
        f"INSERT INTO api_keys ({_OLD_KEY_COLUMNS}, expires_at)"
        f" SELECT {_OLD_KEY_COLUMNS}, NULL FROM {_OLD_KEYS_ASIDE}"
    )
    count = int(run(f"SELECT COUNT(*) FROM {_OLD_KEYS_ASIDE}")[0][0])
    run(f"DROP TABLE {_OLD_KEYS_ASIDE}")
    return count


def migrate(backend: Backend, schema: Schema) -> int:
    """Bring the schema to the newest version; the version found before."""
    migrations: Sequence[str] = schema.migrations
    taken: list[int] = []

    def step(run: Exec) -> int:
        if schema.lock is not None:
            run(schema.lock)
        run("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        found = run("SELECT MAX(version) FROM schema_version")[0][0]
        found = int(found) if found is not None else 0
        if found > len(migrations):
            raise _too_new(backend.where, found, len(migrations))
        old_keys = found == 0 and schema.takes_old_router_keys and _set_aside_old_router_keys(run)
        for version in range(found + 1, len(migrations) + 1):
            for sql in _statements(migrations[version - 1]):
                run(sql)
            run("INSERT INTO schema_version (version) VALUES (?)", (version,))
        if old_keys:
            taken.append(_take_old_router_keys(run))
        return found

    found = backend.transaction(step)
    if found < len(migrations):
        log.info("store %s: schema %d -> %d", backend.where, found, len(migrations))
    if taken:
        log.info(
            "store %s: %d API keys of the router's key file kept (a key file from before the"
            " store; its keys never expire)",
            backend.where,
            taken[0],
        )
    return found
