"""Accounts in the admin API: tenants and their limits, the API keys of each (with
expiry and the bands they may use), and the usage they recorded."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

import attrs

from llmgw.cp._admin._common import audit, need_store
from llmgw.cp._admin._http import HttpError, Route, expect, route
from llmgw.keys import ApiKey
from llmgw.router import KeyStore
from llmgw.store import Account, Store

log = logging.getLogger("llmgw.cp.admin")

USAGE_DEFAULT_SINCE_S = 7 * 86400
EPOCH_FROM = 1e9  # a `since` at least this is seconds since the epoch (2001), else seconds ago
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_NAME_RULE = "letters, digits and . _ @ -, starting with a letter or digit, at most 128"


class Tenants:
    """`/api/v1/keys...`, `/api/v1/tenants...` and `/api/v1/usage`. Without a key store
    or a store, the routes that need one answer 404; without bands, no band is checked."""

    def __init__(
        self, store: Store | None, keys: KeyStore | None, bands: Mapping[str, int] | None
    ) -> None:
        # Accounts, usage and the audit log (llmgw/store); None: none kept here.
        self._store = store
        self._keys = keys
        # The router's priority bands, name -> rank (0 is the highest): what a tenant's or
        # a key's max_band may name. None: not checked here (no router configured).
        self._bands = dict(bands) if bands is not None else None
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/keys", self.keys_list),
            route("POST", "/api/v1/keys", self.keys_create),
            route("DELETE", "/api/v1/keys/{key_id}", self.keys_revoke),
            route("GET", "/api/v1/tenants", self.tenants_list),
            route("POST", "/api/v1/tenants", self.tenants_create),
            route("GET", "/api/v1/tenants/{tenant}", self.tenants_get),
            route("PATCH", "/api/v1/tenants/{tenant}", self.tenants_set),
            route("DELETE", "/api/v1/tenants/{tenant}", self.tenants_delete),
            route("GET", "/api/v1/usage", self.usage),
        )

    def _need_keys(self) -> KeyStore:
        if self._keys is None:
            raise HttpError(404, "this control plane keeps no API keys")
        return self._keys

    def _band_rank(self, what: str, band: str) -> int | None:
        """The rank of a configured band (0 is the highest); a band not configured is
        refused, naming those that are. None when no bands are known here."""
        if self._bands is None:
            return None
        if band not in self._bands:
            known = ", ".join(sorted(self._bands, key=self._bands.__getitem__))
            raise HttpError(400, f"{what}: no band {band!r}; the router's bands are {known}")
        return self._bands[band]

    async def keys_list(self, **_: Any) -> tuple[int, Any]:
        keys = await self._need_keys().list()
        now = time.time()
        return 200, {"keys": [_key_json(k, now) for k in keys]}

    async def keys_create(self, body: Any, **_: Any) -> tuple[int, Any]:
        request = expect(
            body,
            {"tenant": str},
            {"models": list, "default_band": str, "max_band": str, "name": str,
             "expires_at": object},
        )  # fmt: skip
        keys = self._need_keys()
        tenant = request["tenant"]
        if not _NAME.match(tenant):
            raise HttpError(400, f"tenant: {tenant[:80]!r} is not a tenant name ({_NAME_RULE})")
        default_band = request.get("default_band", "interactive")
        default_rank = self._band_rank("default_band", default_band)
        max_band = request.get("max_band")
        if max_band is not None:
            self._band_rank("max_band", max_band)
        expires_at = request.get("expires_at")
        now = time.time()
        if expires_at is not None and (
            not isinstance(expires_at, (int, float))
            or isinstance(expires_at, bool)
            or not math.isfinite(expires_at)
            or expires_at <= now
        ):
            raise HttpError(400, f"expires_at: {expires_at!r} is not a time in the future, in "
                                 f"seconds since the epoch (now is {now:.0f})")  # fmt: skip
        created = False
        if self._store is not None:
            account = await self._store.get_account(tenant)
            if account is None:
                # Keys for a new tenant make its account, with no limits (and say so).
                await self._store.create_account(Account(tenant))
                await audit(
                    self._store, "tenant create", f"{tenant}: no limits (with its first key)"
                )
                created = True
            elif account.max_band is not None:
                cap = self._band_rank("tenant max_band", account.max_band)
                if max_band is not None:
                    asked = self._band_rank("max_band", max_band)
                    if cap is not None and asked is not None and asked < cap:
                        raise HttpError(
                            400,
                            f"max_band {max_band!r} is above tenant {tenant}'s highest band "
                            f"{account.max_band!r}; ask for {account.max_band!r} or lower, or "
                            f"raise the tenant's (llmgw ctl tenants set {tenant} --max-band ...)",
                        )
                elif cap is not None and default_rank is not None and default_rank < cap:
                    max_band = account.max_band  # the key asks for less than its tenant may
        models = request.get("models")
        key, secret = await keys.create(
            tenant=tenant,
            models=[str(m) for m in models] if models is not None else None,
            default_band=default_band,
            max_band=max_band,
            name=request.get("name", ""),
            expires_at=None if expires_at is None else float(expires_at),
        )
        expiry = "never expires" if key.expires_at is None else f"expires at {key.expires_at:.0f}"
        await audit(self._store, "key create", f"{key.key_id} for tenant {tenant}; {expiry}")
        return 201, {"key": _key_json(key, time.time()), "secret": secret,
                     "tenant_created": created}  # fmt: skip

    async def keys_revoke(self, key_id: str, **_: Any) -> tuple[int, Any]:
        if not await self._need_keys().revoke(key_id):
            raise HttpError(404, f"no API key {key_id!r}")
        log.info("API key %s revoked", key_id)
        await audit(self._store, "key revoke", key_id)
        return 200, {"revoked": key_id}

    def _limits(self, body: Any, *, partial: bool) -> dict[str, Any]:
        """rpm, tpm (counts >= 0) and max_band (a configured band), each null for none."""
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        problems = []
        out: dict[str, Any] = {}
        for field in ("rpm", "tpm"):
            if field in body:
                value = body[field]
                if value is not None and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 0
                ):
                    problems.append(f"{field}: expected a count >= 0 or null, got {value!r}")
                out[field] = value
        if "max_band" in body:
            band = body["max_band"]
            if band is not None and not isinstance(band, str):
                problems.append(f"max_band: expected a band name or null, got {band!r}")
            out["max_band"] = band
        allowed = {"rpm", "tpm", "max_band"} | (set() if partial else {"name"})
        problems += [f"{k}: unknown field" for k in body if k not in allowed]
        if problems:
            raise HttpError(400, "; ".join(problems))
        if isinstance(out.get("max_band"), str):
            self._band_rank("max_band", out["max_band"])
        return out

    async def _tenant_json(
        self, account: Account, keys: list[ApiKey] | None = None
    ) -> dict[str, Any]:
        """The tenant with its limits and how many usable keys it has (of `keys`, every
        key, when given: a list of tenants reads them once)."""
        if keys is None:
            keys = await self._need_keys().list()
        now = time.time()
        keys = [k for k in keys if k.tenant == account.name]
        return {
            "name": account.name,
            "rpm": account.rpm,
            "tpm": account.tpm,
            "max_band": account.max_band,
            "created_at": account.created_at,
            "keys": sum(k.usable(now) for k in keys),
        }

    async def _account(self, tenant: str) -> Account:
        account = await need_store(self._store).get_account(unquote(tenant))
        if account is None:
            raise HttpError(404, f"no tenant {unquote(tenant)!r}")
        return account

    def _limits_changed(self) -> None:
        # This process's router reads limits with its keys: make it read them again now
        # (router workers in other processes: within their key cache's TTL).
        invalidate = getattr(self._keys, "invalidate", None)
        if invalidate is not None:
            invalidate()

    async def tenants_list(self, **_: Any) -> tuple[int, Any]:
        accounts = await need_store(self._store).list_accounts()
        keys = await self._need_keys().list()
        return 200, {"tenants": [await self._tenant_json(a, keys) for a in accounts]}

    async def tenants_get(self, tenant: str, **_: Any) -> tuple[int, Any]:
        return 200, {"tenant": await self._tenant_json(await self._account(tenant))}

    async def tenants_create(self, body: Any, **_: Any) -> tuple[int, Any]:
        store = need_store(self._store)
        limits = self._limits(body, partial=False)
        name = body.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise HttpError(400, f"name: {str(name)[:80]!r} is not a tenant name ({_NAME_RULE})")
        if await store.get_account(name) is not None:
            raise HttpError(409, f"tenant {name} exists; change its limits with "
                                 f"`llmgw ctl tenants set {name}`")  # fmt: skip
        account = await store.create_account(Account(name, **limits))
        await audit(self._store, "tenant create", f"{name}: {_limits_text(account)}")
        return 201, {"tenant": await self._tenant_json(account)}

    async def tenants_set(self, tenant: str, body: Any, **_: Any) -> tuple[int, Any]:
        store = need_store(self._store)
        account = await self._account(tenant)
        limits = self._limits(body, partial=True)
        if not limits:
            raise HttpError(400, "nothing to change: give rpm, tpm or max_band")
        changed = attrs.evolve(account, **limits)
        if not await store.update_account(changed):
            raise HttpError(404, f"no tenant {account.name!r}")
        self._limits_changed()
        await audit(self._store, "tenant set", f"{account.name}: {_limits_text(changed)}")
        return 200, {"tenant": await self._tenant_json(changed)}

    async def tenants_delete(self, tenant: str, **_: Any) -> tuple[int, Any]:
        store = need_store(self._store)
        account = await self._account(tenant)
        live = [k for k in await self._need_keys().list()
                if k.tenant == account.name and not k.revoked]  # fmt: skip
        if live:
            raise HttpError(
                409,
                f"tenant {account.name} has {len(live)} unrevoked key"
                f"{'s' if len(live) != 1 else ''} ({', '.join(k.key_id for k in live[:5])}"
                f"{', ...' if len(live) > 5 else ''}); revoke them first "
                "(llmgw ctl keys revoke KEY)",
            )
        await store.delete_account(account.name)
        self._limits_changed()
        await audit(self._store, "tenant delete", account.name)
        return 200, {"deleted": account.name}

    async def usage(self, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        store = need_store(self._store)
        raw = query.get("since", str(USAGE_DEFAULT_SINCE_S))
        try:
            since = float(raw)
        except ValueError:
            since = -1.0
        if not (since >= 0 and math.isfinite(since)):
            raise HttpError(400, f"since: expected seconds ago (under {EPOCH_FROM:g}) or seconds "
                                 f"since the epoch, got {raw!r}")  # fmt: skip
        if since < EPOCH_FROM:
            since = time.time() - since
        rows = await store.usage(tenant=query.get("tenant") or None, since=since)
        totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
        out = []
        for r in rows:
            out.append({"hour": r.hour, "tenant": r.tenant, "key_id": r.key_id, "model": r.model,
                        "requests": r.requests, "prompt_tokens": r.prompt_tokens,
                        "completion_tokens": r.completion_tokens})  # fmt: skip
            totals["requests"] += r.requests
            totals["prompt_tokens"] += r.prompt_tokens
            totals["completion_tokens"] += r.completion_tokens
        return 200, {"rows": out, "totals": totals}


def _key_json(key: ApiKey, now: float) -> dict[str, Any]:
    state = "revoked" if key.revoked else "active" if key.usable(now) else "expired"
    return {
        "key_id": key.key_id,
        "tenant": key.tenant,
        "models": sorted(key.models) if key.models is not None else None,
        "default_band": key.default_band,
        "max_band": key.max_band,
        "created_at": key.created_at,
        "revoked": key.revoked,
        "name": key.name,
        "expires_at": key.expires_at,
        "state": state,
    }


def _limits_text(account: Account) -> str:
    return ", ".join(
        f"{name} {'none' if value is None else value}"
        for name, value in (("rpm", account.rpm), ("tpm", account.tpm),
                            ("max_band", account.max_band))
    )  # fmt: skip
