"""The store's connections: SQLite and PostgreSQL, the blocking half, run in a worker thread.

A backend is one connection and one operation, `transaction(fn)`: `fn` gets an
`Exec` that runs one statement and returns its rows, all inside one
transaction (SQLite's BEGIN IMMEDIATE; psycopg's transaction block). Every
statement is bounded by the driver, because a worker thread cannot be cancelled
mid-statement: SQLite's busy timeout; PostgreSQL's connect, statement and lock
timeouts and TCP user timeout. The drivers' exceptions become llmgw errors here,
saying whose fault: a constraint is the caller's (UsageError), a lock held too
long is a deadline (DeadlineExceeded), a lost connection the peer's (PeerError),
anything else the configuration's (ConfigError).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from llmgw.errors import ConfigError, DeadlineExceeded, PeerError, UsageError

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


class Exec(Protocol):
    def __call__(self, sql: str, args: Sequence[Any] = ()) -> Rows: ...


class Backend(Protocol):
    where: str  # for messages: a path, or a DSN without its credentials
    now_sql: str  # an SQL expression for "now", seconds since the epoch
    shared: bool  # whether other control planes may open this store too

    def transaction(self, fn: Callable[[Exec], T]) -> T: ...
    def close(self) -> None: ...


class Sqlite:
    # SQLite's own clock: the store's machine.
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    shared = False  # one machine's file

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

    def transaction(self, fn: Callable[[Exec], T]) -> T:
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


class Postgres:
    # The database's clock, so every control plane reads the lease against one clock.
    now_sql = "CAST(EXTRACT(EPOCH FROM now()) AS DOUBLE PRECISION)"
    shared = True  # a leader must hold the lease against the other control planes

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

    def transaction(self, fn: Callable[[Exec], T]) -> T:
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
