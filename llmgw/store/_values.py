"""What the store keeps, as values, and the `Store` Protocol its users depend on.

Accounts (tenants) and API keys (hashed), node overrides, known nodes, the
leader lease, an audit log of operator actions and hourly usage; `StoreDump` is
all of it as rows, for moving a store. No I/O here: the backends and `SqlStore`
are the other modules of llmgw/store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

from llmgw.keys import ApiKey, UsageRow

OVERRIDE_KINDS = frozenset({"cordon", "drain", "forget"})


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
    rollouts: tuple[tuple[Any, ...], ...] = ()  # (model, body, at)
    events: tuple[tuple[Any, ...], ...] = ()  # (at, body), oldest first
    paused: tuple[tuple[Any, ...], ...] = ()  # (model, replicas, actor, at): held counts

    def describe(self) -> str:
        return (
            f"{len(self.accounts)} accounts, {len(self.keys)} API keys, "
            f"{len(self.overrides)} node overrides, {len(self.known_nodes)} known nodes, "
            f"{len(self.audit)} audit entries, {len(self.usage)} usage rows, "
            f"{len(self.rollouts)} rollouts, {len(self.events)} events, "
            f"{len(self.paused)} paused autoscalers, epoch {self.epoch}"
        )


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
    async def put_rollout(self, model: str, body_json: str) -> None: ...
    async def delete_rollout(self, model: str) -> bool: ...
    async def rollouts(self) -> dict[str, str]: ...
    async def add_events(self, rows: Sequence[tuple[float, str]], keep: int) -> None: ...
    async def recent_events(self, limit: int) -> list[tuple[int, float, str]]: ...
    async def put_admin_session(self, sid_sha256: bytes, expires_at: float, now: float) -> None: ...
    async def admin_session(self, sid_sha256: bytes) -> float | None: ...
    async def end_admin_session(self, sid_sha256: bytes) -> bool: ...
    async def put_router_load(self, cp: str, body_json: str, now: float) -> None: ...
    async def router_loads(self, since: float) -> list[tuple[str, str, float]]: ...
    async def pause_autoscale(self, model: str, replicas: int, actor: str, now: float) -> None: ...
    async def resume_autoscale(self, model: str) -> bool: ...
    async def autoscale_paused(self) -> dict[str, tuple[int, str, float]]: ...
    async def audit(self, actor: str, action: str, detail: str = "") -> None: ...
    async def recent_audit(self, limit: int = 100) -> list[AuditEntry]: ...
    async def add_usage(self, rows: Iterable[UsageRow]) -> None: ...
    async def usage(
        self, tenant: str | None = None, since: float | None = None
    ) -> list[UsageRow]: ...
    async def aclose(self) -> None: ...
