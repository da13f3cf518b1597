"""The control plane's store: what it must keep, on SQLite or PostgreSQL.

Accounts (tenants) and API keys (hashed), node overrides, known nodes, the
leader lease and its epoch, an audit log of operator actions and hourly usage.
Not what runs: the fleet is authoritative for that.

One connection per store, used from one worker thread at a time (a trio.Lock
orders the callers); the blocking driver never runs on the event loop. Every
call is bounded: waiting for the connection by `fail_after`, the statement
itself by the driver (SQLite's busy timeout; PostgreSQL's connect, statement
and lock timeouts and TCP user timeout), because a worker thread cannot be
cancelled mid-statement.

Schema migrations are ordered SQL per backend, applied at open inside one
transaction (on PostgreSQL under an advisory lock, on SQLite under BEGIN
IMMEDIATE), so two processes opening the same store at once apply each step
once. A store whose schema is newer than this code knows is refused.

llmgw-cp opens it at start (server.yaml `store:`, `store_location`).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import attrs
import trio

from llmgw.errors import ConfigError, DeadlineExceeded, PeerError, UsageError
from llmgw.keys import ApiKey, TenantLimits, UsageRow, digest, new_key

log = logging.getLogger("llmgw.cp.store")

T = TypeVar("T")
Rows = list[tuple[Any, ...]]
OVERRIDE_KINDS = frozenset({"cordon", "drain", "forget"})
SQLITE_FILE = "store.sqlite3"
_PG_MIGRATE_LOCK = 0x6C6C6D67  # "llmg": the advisory lock that serializes migrations


# --- values -----------------------------------------------------------------------------


@attrs.frozen
class Account:
    """A tenant and its limits; None means no limit."""

    name: str
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute
    max_band: str | None = None  # the highest priority band its keys may ask for
    created_at: float = 0.0


@attrs.frozen
class StoredKey:
    key: ApiKey
    expires_at: float | None  # None: never


@attrs.frozen
class NodeOverride:
    node_id: str
    kind: str  # cordon | drain | forget
    reason: str
    at: float


@attrs.frozen
class KnownNode:
    node_id: str
    address: str
    last_seen: float


@attrs.frozen
class Lease:
    holder: str
    epoch: int
    expires_at: float  # on the database's clock (PostgreSQL) or the store's (SQLite)
    expired: bool


@attrs.frozen
class AuditEntry:
    seq: int
    at: float
    actor: str
    action: str
    detail: str


class Store(Protocol):
    """What the control plane keeps. Every method is async and bounded."""

    async def create_account(self, account: Account) -> Account: ...
    async def update_account(self, account: Account) -> bool: ...
    async def get_account(self, name: str) -> Account | None: ...
    async def list_accounts(self) -> list[Account]: ...
    async def delete_account(self, name: str) -> bool: ...
    async def create_key(
        self,
        *,
        tenant: str,
        models: Iterable[str] | None = None,
        default_band: str = "interactive",
        max_band: str | None = None,
        name: str = "",
        expires_at: float | None = None,
    ) -> tuple[ApiKey, str]: ...
    async def put_key(self, key: ApiKey, secret_digest: bytes) -> None: ...
    async def list_keys(self) -> list[StoredKey]: ...
    async def revoke_key(self, key_id: str) -> bool: ...
    async def lookup_key(self, secret_digest: bytes) -> ApiKey | None: ...
    async def set_override(self, node_id: str, kind: str, reason: str) -> None: ...
    async def clear_override(self, node_id: str) -> bool: ...
    async def overrides(self) -> list[NodeOverride]: ...
    async def remember_node(self, node_id: str, address: str) -> None: ...
    async def known_nodes(self) -> list[KnownNode]: ...
    async def forget_node(self, node_id: str) -> bool: ...
    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None: ...
    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool: ...
    async def current(self) -> Lease | None: ...
    async def publish_endpoints(self, epoch: int, body_json: str) -> bool: ...
    async def published_endpoints(self) -> tuple[int, str, float] | None: ...
    async def audit(self, actor: str, action: str, detail: str = "") -> None: ...
    async def recent_audit(self, limit: int = 100) -> list[AuditEntry]: ...
    async def add_usage(self, rows: Iterable[UsageRow]) -> None: ...
    async def usage(
        self, tenant: str | None = None, since: float | None = None
    ) -> list[UsageRow]: ...
    async def aclose(self) -> None: ...


# --- schema -----------------------------------------------------------------------------

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
)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _too_new(where: str, found: int, known: int) -> ConfigError:
    return ConfigError(
        f"the store at {where} has schema {found}; this llmgw knows up to {known}: upgrade llmgw"
    )


# --- backends: the blocking half, run in a worker thread ----------------------------------


class _Exec(Protocol):
    def __call__(self, sql: str, args: Sequence[Any] = ()) -> Rows: ...


class _Backend(Protocol):
    where: str
    now_sql: str  # an SQL expression for "now", seconds since the epoch

    def transaction(self, fn: Callable[[_Exec], T]) -> T: ...
    def close(self) -> None: ...


class _Sqlite:
    # SQLite's own clock: the store's machine.
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.where = str(path)
        self.path = path
        self.timeout_s = timeout_s
        self._db: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=self.timeout_s
            )
            db.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    db.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        db.close()
                        raise
                    # Switching to WAL while another connection opens the same new file
                    # fails at once, without the busy handler: wait for it here.
                    time.sleep(0.01)
            self._db = db
        return self._db

    def transaction(self, fn: Callable[[_Exec], T]) -> T:
        try:
            db = self._connect()

            def run(sql: str, args: Sequence[Any] = ()) -> Rows:
                return db.execute(sql, tuple(args)).fetchall()

            db.execute("BEGIN IMMEDIATE")  # take the write lock now, not on the first write
            try:
                result = fn(run)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return result
        except sqlite3.IntegrityError as exc:
            raise UsageError(f"store {self.where}: {exc}") from None
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise DeadlineExceeded(
                    f"store {self.where}: locked by another connection"
                    f" (waited up to {self.timeout_s:g} s): {exc}"
                ) from None
            raise ConfigError(f"store {self.where}: {exc}") from None
        except sqlite3.Error as exc:
            raise ConfigError(f"store {self.where}: {exc}") from None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


class _Postgres:
    # The database's clock, so every control plane reads the lease against one clock.
    now_sql = "CAST(EXTRACT(EPOCH FROM now()) AS DOUBLE PRECISION)"

    def __init__(self, dsn: str, timeout_s: float) -> None:
        try:
            import psycopg
        except ImportError:  # pragma: no cover - a main dependency
            raise ConfigError(
                "store: a postgresql:// DSN needs psycopg (pip install psycopg)"
            ) from None
        self._psycopg = psycopg
        self.dsn = dsn
        self.timeout_s = timeout_s
        try:
            info = psycopg.conninfo.conninfo_to_dict(dsn)
        except psycopg.ProgrammingError:
            # not the driver's text: it may quote the DSN, password and all
            raise ConfigError(
                "store DSN is not a valid PostgreSQL address;"
                " expected postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
            ) from None
        self.where = (
            f"postgresql://{info.get('host', '')}:{info.get('port', 5432)}/{info.get('dbname', '')}"
        )
        self._db: Any = None

    def _connect(self) -> Any:
        if self._db is None:
            ms = max(1, int(self.timeout_s * 1000))
            self._db = self._psycopg.connect(
                self.dsn,
                connect_timeout=max(1, int(self.timeout_s + 0.999)),
                options=f"-c statement_timeout={ms} -c lock_timeout={ms}",
                tcp_user_timeout=ms,
                keepalives=1,
                keepalives_idle=max(1, int(self.timeout_s)),
                autocommit=False,
            )
        return self._db

    def transaction(self, fn: Callable[[_Exec], T]) -> T:
        pg = self._psycopg
        try:
            db = self._connect()
            with db.transaction(), db.cursor() as cur:

                def run(sql: str, args: Sequence[Any] = ()) -> Rows:
                    cur.execute(sql.replace("?", "%s"), tuple(args))
                    return list(cur.fetchall()) if cur.description is not None else []

                return fn(run)
        except pg.errors.UniqueViolation as exc:
            raise UsageError(f"store {self.where}: {exc}".strip()) from None
        except (pg.errors.QueryCanceled, pg.errors.LockNotAvailable) as exc:
            raise DeadlineExceeded(
                f"store {self.where}: no answer within {self.timeout_s:g} s: {exc}".strip()
            ) from None
        except pg.OperationalError as exc:
            self.close()  # a broken connection is not reused: the next call dials again
            raise PeerError(f"store {self.where}: {exc}".strip()) from None
        except pg.Error as exc:
            raise ConfigError(f"store {self.where}: {exc}".strip()) from None

    def close(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            finally:
                self._db = None


def _migrate(backend: _Backend, migrations: Sequence[str], lock: str | None) -> int:
    """Bring the schema to the newest version; the version found before."""

    def step(run: _Exec) -> int:
        if lock is not None:
            run(lock)
        run("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        found = run("SELECT MAX(version) FROM schema_version")[0][0]
        found = int(found) if found is not None else 0
        if found > len(migrations):
            raise _too_new(backend.where, found, len(migrations))
        for version in range(found + 1, len(migrations) + 1):
            for sql in _statements(migrations[version - 1]):
                run(sql)
            run("INSERT INTO schema_version (version) VALUES (?)", (version,))
        return found

    found = backend.transaction(step)
    if found < len(migrations):
        log.info("store %s: schema %d -> %d", backend.where, found, len(migrations))
    return found


# --- the store --------------------------------------------------------------------------

_KEY_COLUMNS = "key_id, tenant, models, default_band, max_band, created_at, revoked, name"


def _row_key(row: Sequence[Any]) -> ApiKey:
    key_id, tenant, models, default_band, max_band, created_at, revoked, name = row[:8]
    return ApiKey(
        key_id=str(key_id),
        tenant=str(tenant),
        models=None if models is None else frozenset(json.loads(str(models))),
        default_band=str(default_band),
        max_band=str(max_band),
        created_at=float(created_at),
        revoked=bool(revoked),
        name=str(name),
    )


def _row_account(row: Sequence[Any]) -> Account:
    name, rpm, tpm, max_band, created_at = row
    return Account(
        name=str(name),
        rpm=None if rpm is None else int(rpm),
        tpm=None if tpm is None else int(tpm),
        max_band=None if max_band is None else str(max_band),
        created_at=float(created_at),
    )


def _check_limit(what: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value < 0):
        raise UsageError(f"account limit {what} is {value!r}; it must be a count >= 0 or none")


class SqlStore:
    """The Store on one backend. Open with `open_store`."""

    def __init__(self, backend: _Backend, timeout_s: float) -> None:
        self._backend = backend
        self.timeout_s = timeout_s
        self._lock = trio.Lock()  # one call at a time on the one connection
        self.calls = 0

    def __repr__(self) -> str:
        return f"<SqlStore {self._backend.where}, {self.calls} calls>"

    @property
    def where(self) -> str:
        return self._backend.where

    @property
    def shared(self) -> bool:
        """Whether other control planes may open this store too (PostgreSQL), so that a
        leader must hold the lease against them; SQLite is one machine's file."""
        return isinstance(self._backend, _Postgres)

    async def _tx(self, fn: Callable[[_Exec], T]) -> T:
        try:
            with trio.fail_after(self.timeout_s):
                await self._lock.acquire()
        except trio.TooSlowError:
            raise DeadlineExceeded(
                f"store {self.where}: busy for {self.timeout_s:g} s with another call"
            ) from None
        try:
            self.calls += 1
            return await trio.to_thread.run_sync(self._backend.transaction, fn)
        finally:
            self._lock.release()

    async def _q(self, sql: str, args: Sequence[Any] = ()) -> Rows:
        return await self._tx(lambda run: run(sql, args))

    async def aclose(self) -> None:
        async with self._lock:
            await trio.to_thread.run_sync(self._backend.close)

    # accounts

    async def create_account(self, account: Account) -> Account:
        if not account.name:
            raise UsageError("an account needs a name")
        _check_limit("rpm", account.rpm)
        _check_limit("tpm", account.tpm)
        stored = attrs.evolve(account, created_at=account.created_at or time.time())
        await self._q(
            "INSERT INTO accounts (name, rpm, tpm, max_band, created_at) VALUES (?,?,?,?,?)",
            (stored.name, stored.rpm, stored.tpm, stored.max_band, stored.created_at),
        )
        return stored

    async def update_account(self, account: Account) -> bool:
        """Replace the limits of an existing account; False when there is none."""
        _check_limit("rpm", account.rpm)
        _check_limit("tpm", account.tpm)
        rows = await self._q(
            "UPDATE accounts SET rpm = ?, tpm = ?, max_band = ? WHERE name = ? RETURNING name",
            (account.rpm, account.tpm, account.max_band, account.name),
        )
        return bool(rows)

    async def get_account(self, name: str) -> Account | None:
        rows = await self._q(
            "SELECT name, rpm, tpm, max_band, created_at FROM accounts WHERE name = ?", (name,)
        )
        return _row_account(rows[0]) if rows else None

    async def list_accounts(self) -> list[Account]:
        rows = await self._q(
            "SELECT name, rpm, tpm, max_band, created_at FROM accounts ORDER BY name"
        )
        return [_row_account(r) for r in rows]

    async def delete_account(self, name: str) -> bool:
        return bool(await self._q("DELETE FROM accounts WHERE name = ? RETURNING name", (name,)))

    # API keys

    async def create_key(
        self,
        *,
        tenant: str,
        models: Iterable[str] | None = None,
        default_band: str = "interactive",
        max_band: str | None = None,
        name: str = "",
        expires_at: float | None = None,
    ) -> tuple[ApiKey, str]:
        """Store a new key; returns it and its secret, which is never retrievable again."""
        key, secret = new_key(
            tenant=tenant, models=models, default_band=default_band, max_band=max_band, name=name
        )
        key = attrs.evolve(key, expires_at=expires_at)
        await self._q(
            f"INSERT INTO api_keys (secret_sha256, {_KEY_COLUMNS}, expires_at)"
            " VALUES (?,?,?,?,?,?,?,?,?,?)",
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
                expires_at,
            ),
        )
        log.info("API key %s created for tenant %s", key.key_id, tenant)
        return key, secret

    async def put_key(self, key: ApiKey, secret_digest: bytes) -> None:
        """Keep a key made elsewhere (an older key file, another store) as it is: its id,
        its secret's digest, revoked or not, its expiry."""
        await self._q(
            f"INSERT INTO api_keys (secret_sha256, {_KEY_COLUMNS}, expires_at)"
            " VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                bytes(secret_digest),
                key.key_id,
                key.tenant,
                None if key.models is None else json.dumps(sorted(key.models)),
                key.default_band,
                key.max_band,
                key.created_at,
                int(key.revoked),
                key.name,
                key.expires_at,
            ),
        )

    async def list_keys(self) -> list[StoredKey]:
        rows = await self._q(
            f"SELECT {_KEY_COLUMNS}, expires_at FROM api_keys ORDER BY created_at, key_id"
        )
        out = []
        for r in rows:
            expires_at = None if r[8] is None else float(r[8])
            out.append(StoredKey(attrs.evolve(_row_key(r), expires_at=expires_at), expires_at))
        return out

    async def revoke_key(self, key_id: str) -> bool:
        rows = await self._q(
            "UPDATE api_keys SET revoked = 1 WHERE key_id = ? RETURNING key_id", (key_id,)
        )
        return bool(rows)

    async def lookup_key(self, secret_digest: bytes) -> ApiKey | None:
        """The key with this SHA-256 secret, revoked or not, with its expiry and its tenant's
        limits (None when the tenant has no account); None when unknown or expired."""
        now = self._backend.now_sql
        cols = ", ".join(f"k.{c.strip()}" for c in _KEY_COLUMNS.split(","))
        rows = await self._q(
            f"SELECT {cols}, k.expires_at, a.name, a.rpm, a.tpm, a.max_band"
            " FROM api_keys k LEFT JOIN accounts a ON a.name = k.tenant"
            f" WHERE k.secret_sha256 = ? AND (k.expires_at IS NULL OR k.expires_at > {now})",
            (bytes(secret_digest),),
        )
        if not rows:
            return None
        row = rows[0]
        expires_at, account, rpm, tpm, max_band = row[8:13]
        limits = (
            None
            if account is None
            else TenantLimits(
                rpm=None if rpm is None else int(rpm),
                tpm=None if tpm is None else int(tpm),
                max_band=None if max_band is None else str(max_band),
            )
        )
        return attrs.evolve(
            _row_key(row),
            expires_at=None if expires_at is None else float(expires_at),
            limits=limits,
        )

    # nodes

    async def set_override(self, node_id: str, kind: str, reason: str) -> None:
        if kind not in OVERRIDE_KINDS:
            raise UsageError(
                f"node override {kind!r} is not one of {', '.join(sorted(OVERRIDE_KINDS))}"
            )
        now = self._backend.now_sql
        await self._q(
            f"INSERT INTO node_overrides (node_id, kind, reason, at) VALUES (?, ?, ?, {now})"
            " ON CONFLICT (node_id) DO UPDATE SET kind = excluded.kind,"
            " reason = excluded.reason, at = excluded.at",
            (node_id, kind, reason),
        )

    async def clear_override(self, node_id: str) -> bool:
        rows = await self._q(
            "DELETE FROM node_overrides WHERE node_id = ? RETURNING node_id", (node_id,)
        )
        return bool(rows)

    async def overrides(self) -> list[NodeOverride]:
        rows = await self._q(
            "SELECT node_id, kind, reason, at FROM node_overrides ORDER BY node_id"
        )
        return [NodeOverride(str(n), str(k), str(r), float(a)) for n, k, r, a in rows]

    async def remember_node(self, node_id: str, address: str) -> None:
        now = self._backend.now_sql
        await self._q(
            f"INSERT INTO known_nodes (node_id, address, last_seen) VALUES (?, ?, {now})"
            " ON CONFLICT (node_id) DO UPDATE SET address = excluded.address,"
            " last_seen = excluded.last_seen",
            (node_id, address),
        )

    async def known_nodes(self) -> list[KnownNode]:
        rows = await self._q("SELECT node_id, address, last_seen FROM known_nodes ORDER BY node_id")
        return [KnownNode(str(n), str(a), float(s)) for n, a, s in rows]

    async def forget_node(self, node_id: str) -> bool:
        rows = await self._q(
            "DELETE FROM known_nodes WHERE node_id = ? RETURNING node_id", (node_id,)
        )
        return bool(rows)

    # the leader lease

    def _lease(self, row: Sequence[Any]) -> Lease:
        holder, epoch, expires_at, now = row
        return Lease(str(holder), int(epoch), float(expires_at), float(expires_at) <= float(now))

    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None:
        """Take the lease when it is free, expired or already this holder's (a control plane
        restarted on the same address), with the epoch one higher; None when another holds it.

        One UPDATE whose condition the database re-checks on the locked row, so of
        two control planes racing for an expired lease exactly one gets it.
        """
        if not holder:
            raise UsageError("a lease needs a holder")
        if not ttl_s > 0:
            raise UsageError(f"lease length {ttl_s!r} s; it must be > 0")
        now = self._backend.now_sql
        rows = await self._q(
            f"UPDATE lease SET holder = ?, epoch = epoch + 1, expires_at = {now} + ?"
            f" WHERE id = 1 AND (holder IS NULL OR holder = ? OR expires_at <= {now})"
            f" RETURNING holder, epoch, expires_at, {now}",
            (holder, float(ttl_s), holder),
        )
        if not rows:
            return None
        lease = self._lease(rows[0])
        log.info("lease taken by %s, epoch %d", holder, lease.epoch)
        return lease

    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool:
        """Extend the lease; only its holder at its epoch may, and False tells it it lost."""
        if not ttl_s > 0:
            raise UsageError(f"lease length {ttl_s!r} s; it must be > 0")
        now = self._backend.now_sql
        rows = await self._q(
            f"UPDATE lease SET expires_at = {now} + ?"
            " WHERE id = 1 AND holder = ? AND epoch = ? RETURNING epoch",
            (float(ttl_s), holder, int(epoch)),
        )
        return bool(rows)

    async def current(self) -> Lease | None:
        """The lease as it stands (expired or not); None when nobody ever took it."""
        now = self._backend.now_sql
        rows = await self._q(
            f"SELECT holder, epoch, expires_at, {now} FROM lease"
            " WHERE id = 1 AND holder IS NOT NULL"
        )
        return self._lease(rows[0]) if rows else None

    # the leader's endpoint list

    async def publish_endpoints(self, epoch: int, body_json: str) -> bool:
        """Keep the leader's endpoint list for the standbys' routers. Fenced: written only
        while `epoch` is the lease's, so a deposed leader cannot overwrite its successor's
        list; False when refused."""
        now = self._backend.now_sql
        rows = await self._q(
            f"UPDATE published_endpoints SET epoch = ?, body = ?, at = {now}"
            " WHERE id = 1 AND ? = (SELECT epoch FROM lease WHERE id = 1) RETURNING epoch",
            (int(epoch), body_json, int(epoch)),
        )
        return bool(rows)

    async def published_endpoints(self) -> tuple[int, str, float] | None:
        """(epoch, the list as published, when) of the last list; None when none was."""
        rows = await self._q(
            "SELECT epoch, body, at FROM published_endpoints WHERE id = 1 AND body IS NOT NULL"
        )
        if not rows:
            return None
        epoch, body, at = rows[0]
        return int(epoch), str(body), float(at)

    # audit

    async def audit(self, actor: str, action: str, detail: str = "") -> None:
        now = self._backend.now_sql
        await self._q(
            f"INSERT INTO audit (at, actor, action, detail) VALUES ({now}, ?, ?, ?)",
            (actor, action, detail),
        )

    async def recent_audit(self, limit: int = 100) -> list[AuditEntry]:
        """The newest `limit` entries, newest first."""
        rows = await self._q(
            "SELECT seq, at, actor, action, detail FROM audit ORDER BY seq DESC LIMIT ?",
            (int(limit),),
        )
        return [AuditEntry(int(s), float(a), str(w), str(x), str(d)) for s, a, w, x, d in rows]

    # usage

    async def add_usage(self, rows: Iterable[UsageRow]) -> None:
        """Add each row's counts to its (hour, tenant, key, model) row, all in one transaction."""
        batch = []
        for r in rows:
            if min(r.requests, r.prompt_tokens, r.completion_tokens) < 0:
                raise UsageError(f"usage row {r!r} has a negative count")
            batch.append(
                (
                    r.hour - r.hour % 3600,
                    r.tenant,
                    r.key_id,
                    r.model,
                    r.requests,
                    r.prompt_tokens,
                    r.completion_tokens,
                )
            )
        if not batch:
            return
        sql = (
            "INSERT INTO usage (hour, tenant, key_id, model, requests, prompt_tokens,"
            " completion_tokens) VALUES (?,?,?,?,?,?,?)"
            " ON CONFLICT (hour, tenant, key_id, model) DO UPDATE SET"
            " requests = usage.requests + excluded.requests,"
            " prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
            " completion_tokens = usage.completion_tokens + excluded.completion_tokens"
        )

        def write(run: _Exec) -> None:
            for args in batch:
                run(sql, args)

        await self._tx(write)

    async def usage(self, tenant: str | None = None, since: float | None = None) -> list[UsageRow]:
        """Rows from the hour containing `since` on, for one tenant or all."""
        where: list[str] = []
        args: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if since is not None:
            where.append("hour >= ?")
            args.append(int(since) - int(since) % 3600)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        rows = await self._q(
            "SELECT hour, tenant, key_id, model, requests, prompt_tokens, completion_tokens"
            f" FROM usage{clause} ORDER BY hour, tenant, key_id, model",
            args,
        )
        return [
            UsageRow(int(h), str(t), str(k), str(m), int(q), int(p), int(c))
            for h, t, k, m, q, p, c in rows
        ]

    # --- moving a store (llmgw-cp init --postgres; llmgw/cp/_init_pg.py) ---------------

    async def export_rows(self) -> StoreDump:
        """Everything kept here, as rows, read in one transaction: what a move copies."""

        def read(run: _Exec) -> StoreDump:
            lease = run("SELECT epoch FROM lease WHERE id = 1")
            return StoreDump(
                accounts=tuple(
                    tuple(r)
                    for r in run(
                        "SELECT name, rpm, tpm, max_band, created_at FROM accounts ORDER BY name"
                    )
                ),
                keys=tuple(
                    (bytes(r[0]), *r[1:])
                    for r in run(
                        f"SELECT secret_sha256, {_KEY_COLUMNS}, expires_at FROM api_keys"
                        " ORDER BY created_at, key_id"
                    )
                ),
                overrides=tuple(
                    tuple(r)
                    for r in run(
                        "SELECT node_id, kind, reason, at FROM node_overrides ORDER BY node_id"
                    )
                ),
                known_nodes=tuple(
                    tuple(r)
                    for r in run(
                        "SELECT node_id, address, last_seen FROM known_nodes ORDER BY node_id"
                    )
                ),
                audit=tuple(
                    tuple(r)
                    for r in run("SELECT at, actor, action, detail FROM audit ORDER BY seq")
                ),
                usage=tuple(
                    tuple(r)
                    for r in run(
                        "SELECT hour, tenant, key_id, model, requests, prompt_tokens,"
                        " completion_tokens FROM usage ORDER BY hour, tenant, key_id, model"
                    )
                ),
                epoch=int(lease[0][0]) if lease else 0,
            )

        return await self._tx(read)

    async def import_rows(self, dump: StoreDump) -> None:
        """Copy `dump` in, all in one transaction; refused (UsageError) when this store
        already holds accounts or keys: one store is never merged into another.

        The lease is left free with the epoch at least the dump's, so the next leader's
        epoch is above every epoch agents saw from the store the dump came from.
        """

        def write(run: _Exec) -> None:
            accounts = int(run("SELECT COUNT(*) FROM accounts")[0][0])
            keys = int(run("SELECT COUNT(*) FROM api_keys")[0][0])
            if accounts or keys:
                raise UsageError(
                    f"the store at {self.where} already holds {accounts} accounts and {keys}"
                    " API keys: moving one store into another is refused"
                )
            for row in dump.accounts:
                run(
                    "INSERT INTO accounts (name, rpm, tpm, max_band, created_at)"
                    " VALUES (?,?,?,?,?)",
                    row,
                )
            for row in dump.keys:
                run(
                    f"INSERT INTO api_keys (secret_sha256, {_KEY_COLUMNS}, expires_at)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?)",
                    row,
                )
            for row in dump.overrides:
                run(
                    "INSERT INTO node_overrides (node_id, kind, reason, at) VALUES (?,?,?,?)"
                    " ON CONFLICT (node_id) DO UPDATE SET kind = excluded.kind,"
                    " reason = excluded.reason, at = excluded.at",
                    row,
                )
            for row in dump.known_nodes:
                run(
                    "INSERT INTO known_nodes (node_id, address, last_seen) VALUES (?,?,?)"
                    " ON CONFLICT (node_id) DO UPDATE SET address = excluded.address,"
                    " last_seen = excluded.last_seen",
                    row,
                )
            for row in dump.audit:
                run("INSERT INTO audit (at, actor, action, detail) VALUES (?,?,?,?)", row)
            for row in dump.usage:
                run(
                    "INSERT INTO usage (hour, tenant, key_id, model, requests, prompt_tokens,"
                    " completion_tokens) VALUES (?,?,?,?,?,?,?)"
                    " ON CONFLICT (hour, tenant, key_id, model) DO UPDATE SET"
                    " requests = usage.requests + excluded.requests,"
                    " prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
                    " completion_tokens = usage.completion_tokens + excluded.completion_tokens",
                    row,
                )
            run(
                "UPDATE lease SET holder = NULL, expires_at = 0,"
                " epoch = CASE WHEN epoch > ? THEN epoch ELSE ? END WHERE id = 1",
                (dump.epoch, dump.epoch),
            )

        await self._tx(write)
        log.info("store %s: imported %s", self.where, dump.describe())


@attrs.frozen
class StoreDump:
    """A store's rows, columns as `SqlStore.export_rows` reads them, for a move."""

    accounts: tuple[tuple[Any, ...], ...]
    keys: tuple[tuple[Any, ...], ...]  # with each secret's digest
    overrides: tuple[tuple[Any, ...], ...]
    known_nodes: tuple[tuple[Any, ...], ...]
    audit: tuple[tuple[Any, ...], ...]
    usage: tuple[tuple[Any, ...], ...]
    epoch: int  # the lease's: agents refuse a leader below the highest they saw

    def describe(self) -> str:
        return (
            f"{len(self.accounts)} accounts, {len(self.keys)} API keys, "
            f"{len(self.overrides)} node overrides, {len(self.known_nodes)} known nodes, "
            f"{len(self.audit)} audit entries, {len(self.usage)} usage rows, epoch {self.epoch}"
        )


# --- end of moving a store ---------------------------------------------------------------


def known_schema(backend: str) -> int:
    """The newest schema version this llmgw knows for "sqlite" or "postgresql"."""
    return len(_SQLITE_MIGRATIONS if backend == "sqlite" else _PG_MIGRATIONS)


def _conforms(store: SqlStore) -> Store:
    return store  # mypy checks here that SqlStore is a Store


def store_location(value: str | None, state_dir: Path, source: str) -> str | Path:
    """server.yaml's `store:` as `open_store` takes it: the state dir (SQLite) for null, a
    DSN as given, or the DSN read from the file an absolute path names."""
    if value is None:
        return state_dir
    if value.startswith(("postgresql://", "postgres://")):
        return value
    path = Path(value)
    if not path.is_absolute():
        raise ConfigError(
            f"{source}: store: {value[:60]!r} is neither a postgresql:// DSN nor the "
            "absolute path of a file holding one"
        )
    try:
        dsn = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{source}: store: {path}: cannot read the DSN file: {exc.strerror}"
        ) from None
    if not dsn.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"{source}: store: {path} does not hold a postgresql:// DSN")
    return dsn


async def open_store(where: str | Path, *, timeout_s: float = 10.0) -> SqlStore:
    """A `postgresql://…` DSN, or a directory that holds (or will hold) the SQLite file.

    Migrates the schema to this llmgw's newest; refuses a newer one.
    """
    if isinstance(where, str) and where.startswith(("postgresql://", "postgres://")):  # noqa: ASYNC240
        pg = _Postgres(where, timeout_s)
        backend: _Backend = pg
        migrations, lock = _PG_MIGRATIONS, f"SELECT pg_advisory_xact_lock({_PG_MIGRATE_LOCK})"
    else:
        backend = _Sqlite(Path(where) / SQLITE_FILE, timeout_s)
        migrations, lock = _SQLITE_MIGRATIONS, None
    store = SqlStore(backend, timeout_s)
    try:
        await trio.to_thread.run_sync(_migrate, backend, migrations, lock)
    except BaseException:
        await trio.to_thread.run_sync(backend.close)
        raise
    return store
