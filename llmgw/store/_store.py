"""`SqlStore`: the `Store` on one backend, composed of one repository per resource.

Accounts and keys, nodes, audit, usage, the lease and moves each keep their
own tables (their modules beside this one) and share one `Runner`, so they
share one connection, one lock and one bound on every wait. `open_store`
opens the control plane's store (a directory for SQLite, or a PostgreSQL DSN);
`open_sqlite_file` opens the store in one named SQLite file, as router-only
mode keeps its keys (`keys_db`). Both migrate the schema to this llmgw's
newest (llmgw/store/_schema.py) and refuse a newer one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import trio

from llmgw.errors import ConfigError
from llmgw.keys import ApiKey, BudgetAsk, BudgetLeases, UsageRow
from llmgw.store._accounts import AccountStore
from llmgw.store._audit import AuditStore
from llmgw.store._autoscale import AutoscaleStore
from llmgw.store._backends import Backend, Postgres, Sqlite
from llmgw.store._budget import BudgetStore
from llmgw.store._events import EventStore
from llmgw.store._lease import LeaseStore
from llmgw.store._move import StoreMove
from llmgw.store._nodes import NodeStore
from llmgw.store._rollouts import RolloutStore
from llmgw.store._runner import Runner
from llmgw.store._schema import POSTGRES, SQLITE, Schema, migrate
from llmgw.store._sessions import SessionStore
from llmgw.store._usage import UsageStore
from llmgw.store._values import (
    Account,
    AuditEntry,
    KnownNode,
    Lease,
    NodeOverride,
    Store,
    StoredKey,
    StoreDump,
)

SQLITE_FILE = "store.sqlite3"


class SqlStore:
    """The Store on one backend. Open with `open_store` or `open_sqlite_file`."""

    def __init__(self, backend: Backend, timeout_s: float) -> None:
        self._runner = runner = Runner(backend, timeout_s)
        self.timeout_s = timeout_s
        self._accounts = AccountStore(runner)
        self._nodes = NodeStore(runner)
        self._audit = AuditStore(runner)
        self._usage = UsageStore(runner)
        self._lease = LeaseStore(runner)
        self._move = StoreMove(runner)
        self._rollouts = RolloutStore(runner)
        self._events = EventStore(runner)
        self._sessions = SessionStore(runner)
        self._budget = BudgetStore(runner)
        self._autoscale = AutoscaleStore(runner)

    def __repr__(self) -> str:
        return f"<SqlStore {self.where}, {self.calls} calls>"

    @property
    def where(self) -> str:
        return self._runner.where

    @property
    def calls(self) -> int:
        return self._runner.calls

    @property
    def shared(self) -> bool:
        """Whether other control planes may open this store too (PostgreSQL), so that a
        leader must hold the lease against them; SQLite is one machine's file."""
        return self._runner.backend.shared

    async def aclose(self) -> None:
        await self._runner.aclose()

    # accounts and API keys (_accounts.py)

    async def create_account(self, account: Account) -> Account:
        return await self._accounts.create_account(account)

    async def update_account(self, account: Account) -> bool:
        return await self._accounts.update_account(account)

    async def get_account(self, name: str) -> Account | None:
        return await self._accounts.get_account(name)

    async def list_accounts(self) -> list[Account]:
        return await self._accounts.list_accounts()

    async def delete_account(self, name: str) -> bool:
        return await self._accounts.delete_account(name)

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
        return await self._accounts.create_key(
            tenant=tenant,
            models=models,
            default_band=default_band,
            max_band=max_band,
            name=name,
            expires_at=expires_at,
        )

    async def put_key(self, key: ApiKey, secret_digest: bytes) -> None:
        await self._accounts.put_key(key, secret_digest)

    async def list_keys(self) -> list[StoredKey]:
        return await self._accounts.list_keys()

    async def revoke_key(self, key_id: str) -> bool:
        return await self._accounts.revoke_key(key_id)

    async def lookup_key(self, secret_digest: bytes) -> ApiKey | None:
        return await self._accounts.lookup_key(secret_digest)

    # nodes (_nodes.py)

    async def set_override(self, node_id: str, kind: str, reason: str) -> None:
        await self._nodes.set_override(node_id, kind, reason)

    async def clear_override(self, node_id: str) -> bool:
        return await self._nodes.clear_override(node_id)

    async def overrides(self) -> list[NodeOverride]:
        return await self._nodes.overrides()

    async def remember_node(self, node_id: str, address: str) -> None:
        await self._nodes.remember_node(node_id, address)

    async def known_nodes(self) -> list[KnownNode]:
        return await self._nodes.known_nodes()

    async def forget_node(self, node_id: str) -> bool:
        return await self._nodes.forget_node(node_id)

    # the leader lease and the endpoint list under it (_lease.py)

    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None:
        return await self._lease.try_acquire(holder, ttl_s)

    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool:
        return await self._lease.renew(holder, epoch, ttl_s)

    async def current(self) -> Lease | None:
        return await self._lease.current()

    async def publish_endpoints(self, epoch: int, body_json: str) -> bool:
        return await self._lease.publish_endpoints(epoch, body_json)

    async def published_endpoints(self) -> tuple[int, str, float] | None:
        return await self._lease.published_endpoints()

    # rollouts (_rollouts.py)

    async def put_rollout(self, model: str, body_json: str) -> None:
        await self._rollouts.put_rollout(model, body_json)

    async def delete_rollout(self, model: str) -> bool:
        return await self._rollouts.delete_rollout(model)

    async def rollouts(self) -> dict[str, str]:
        return await self._rollouts.rollouts()

    # the control plane's events (_events.py) and the admin pages' sessions (_sessions.py)

    async def add_events(self, rows: Sequence[tuple[float, str]], keep: int) -> None:
        await self._events.add_events(rows, keep)

    async def recent_events(self, limit: int) -> list[tuple[int, float, str]]:
        return await self._events.recent_events(limit)

    async def put_admin_session(self, sid_sha256: bytes, expires_at: float, now: float) -> None:
        await self._sessions.put_admin_session(sid_sha256, expires_at, now)

    async def admin_session(self, sid_sha256: bytes) -> float | None:
        return await self._sessions.admin_session(sid_sha256)

    async def end_admin_session(self, sid_sha256: bytes) -> bool:
        return await self._sessions.end_admin_session(sid_sha256)

    # audit (_audit.py) and usage (_usage.py)

    async def audit(self, actor: str, action: str, detail: str = "") -> None:
        await self._audit.audit(actor, action, detail)

    async def recent_audit(self, limit: int = 100) -> list[AuditEntry]:
        return await self._audit.recent_audit(limit)

    async def add_usage(self, rows: Iterable[UsageRow]) -> None:
        await self._usage.add_usage(rows)

    async def usage(self, tenant: str | None = None, since: float | None = None) -> list[UsageRow]:
        return await self._usage.usage(tenant, since)

    # tenants' per-minute budgets, leased to the routers (_budget.py)

    async def lease_budget(
        self, router: str, now: float, asks: Sequence[BudgetAsk]
    ) -> BudgetLeases:
        return await self._budget.lease_budget(router, now, asks)

    async def budget_taken(self, tenant: str, kind: str, window: int) -> int | None:
        return await self._budget.budget_taken(tenant, kind, window)

    # routers' load for the leader's autoscaler, and held counts (_autoscale.py)

    async def put_router_load(self, cp: str, body_json: str, now: float) -> None:
        await self._autoscale.put_router_load(cp, body_json, now)

    async def router_loads(self, since: float) -> list[tuple[str, str, float]]:
        return await self._autoscale.router_loads(since)

    async def pause_autoscale(self, model: str, replicas: int, actor: str, now: float) -> None:
        await self._autoscale.pause_autoscale(model, replicas, actor, now)

    async def resume_autoscale(self, model: str) -> bool:
        return await self._autoscale.resume_autoscale(model)

    async def autoscale_paused(self) -> dict[str, tuple[int, str, float]]:
        return await self._autoscale.autoscale_paused()

    # moving a store (_move.py; llmgw-cp init --postgres)

    async def export_rows(self) -> StoreDump:
        return await self._move.export_rows()

    async def import_rows(self, dump: StoreDump) -> None:
        await self._move.import_rows(dump)


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


async def _open(backend: Backend, schema: Schema, timeout_s: float) -> SqlStore:
    store = SqlStore(backend, timeout_s)
    try:
        await trio.to_thread.run_sync(migrate, backend, schema)
    except BaseException:
        await trio.to_thread.run_sync(backend.close)
        raise
    return store


async def open_store(where: str | Path, *, timeout_s: float = 10.0) -> SqlStore:
    """A `postgresql://…` DSN, or a directory that holds (or will hold) the SQLite file.

    Migrates the schema to this llmgw's newest; refuses a newer one.
    """
    if isinstance(where, str) and where.startswith(("postgresql://", "postgres://")):  # noqa: ASYNC240
        return await _open(Postgres(where, timeout_s), POSTGRES, timeout_s)
    return await _open(Sqlite(Path(where) / SQLITE_FILE, timeout_s), SQLITE, timeout_s)


async def open_sqlite_file(path: Path, *, timeout_s: float = 10.0) -> SqlStore:
    """The store in the SQLite file `path` (made, with its directory, when missing), as
    router-only mode keeps its keys; a key file from before the store is migrated in."""
    return await _open(Sqlite(path, timeout_s), SQLITE, timeout_s)
