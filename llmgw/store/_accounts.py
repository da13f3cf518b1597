"""Accounts (tenants and their limits) and their API keys, kept as SHA-256 digests.

The one place a key is made and kept: `create_key` (the control plane's
`llmgw ctl keys create`, router-only mode's `llmgw-router keys create`) and
`put_key` (a key made elsewhere, moved in). A lookup joins the key's account,
so admission reads the key, its expiry and its tenant's limits at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from llmgw.errors import UsageError
from llmgw.keys import ApiKey, TenantLimits, digest, new_key
from llmgw.store._runner import Runner
from llmgw.store._values import Account, StoredKey

log = logging.getLogger("llmgw.store")

KEY_COLUMNS = "key_id, tenant, models, default_band, max_band, created_at, revoked, name"
# A key as stored: its secret's digest, KEY_COLUMNS, its expiry.
INSERT_KEY = (
    f"INSERT INTO api_keys (secret_sha256, {KEY_COLUMNS}, expires_at) VALUES (?,?,?,?,?,?,?,?,?,?)"
)
ACCOUNT_COLUMNS = "name, rpm, tpm, max_band, created_at"
INSERT_ACCOUNT = f"INSERT INTO accounts ({ACCOUNT_COLUMNS}) VALUES (?,?,?,?,?)"


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


def _key_args(key: ApiKey, secret_digest: bytes) -> tuple[Any, ...]:
    return (
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


class AccountStore:
    """The `accounts` and `api_keys` tables."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    # accounts

    async def create_account(self, account: Account) -> Account:
        if not account.name:
            raise UsageError("an account needs a name")
        _check_limit("rpm", account.rpm)
        _check_limit("tpm", account.tpm)
        stored = attrs.evolve(account, created_at=account.created_at or time.time())
        await self._run.q(
            INSERT_ACCOUNT,
            (stored.name, stored.rpm, stored.tpm, stored.max_band, stored.created_at),
        )
        return stored

    async def update_account(self, account: Account) -> bool:
        """Replace the limits of an existing account; False when there is none."""
        _check_limit("rpm", account.rpm)
        _check_limit("tpm", account.tpm)
        rows = await self._run.q(
            "UPDATE accounts SET rpm = ?, tpm = ?, max_band = ? WHERE name = ? RETURNING name",
            (account.rpm, account.tpm, account.max_band, account.name),
        )
        return bool(rows)

    async def get_account(self, name: str) -> Account | None:
        rows = await self._run.q(f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE name = ?", (name,))
        return _row_account(rows[0]) if rows else None

    async def list_accounts(self) -> list[Account]:
        rows = await self._run.q(f"SELECT {ACCOUNT_COLUMNS} FROM accounts ORDER BY name")
        return [_row_account(r) for r in rows]

    async def delete_account(self, name: str) -> bool:
        rows = await self._run.q("DELETE FROM accounts WHERE name = ? RETURNING name", (name,))
        return bool(rows)

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
        await self._run.q(INSERT_KEY, _key_args(key, digest(secret)))
        log.info("API key %s created for tenant %s", key.key_id, tenant)
        return key, secret

    async def put_key(self, key: ApiKey, secret_digest: bytes) -> None:
        """Keep a key made elsewhere (an older key file, another store) as it is: its id,
        its secret's digest, revoked or not, its expiry."""
        await self._run.q(INSERT_KEY, _key_args(key, secret_digest))

    async def list_keys(self) -> list[StoredKey]:
        rows = await self._run.q(
            f"SELECT {KEY_COLUMNS}, expires_at FROM api_keys ORDER BY created_at, key_id"
        )
        out = []
        for r in rows:
            expires_at = None if r[8] is None else float(r[8])
            out.append(StoredKey(attrs.evolve(_row_key(r), expires_at=expires_at), expires_at))
        return out

    async def revoke_key(self, key_id: str) -> bool:
        rows = await self._run.q(
            "UPDATE api_keys SET revoked = 1 WHERE key_id = ? RETURNING key_id", (key_id,)
        )
        if rows:
            log.info("API key %s revoked", key_id)
        return bool(rows)

    async def lookup_key(self, secret_digest: bytes) -> ApiKey | None:
        """The key with this SHA-256 secret, revoked or not, with its expiry and its tenant's
        limits (None when the tenant has no account); None when unknown or expired."""
        now = self._run.now_sql
        cols = ", ".join(f"k.{c.strip()}" for c in KEY_COLUMNS.split(","))
        rows = await self._run.q(
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
