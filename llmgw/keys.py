"""API keys and what they used: the values the router and the control plane's store share.

An `ApiKey` (with its tenant's `TenantLimits`) is what a store answers for a
secret and what the router admits by; a `UsageRow` is one key's tokens for one
model in one hour, counted by the router and summed by the store. Neither side
owns them, so they live here, beside `llmgw.model`, and the control plane's
store needs nothing from the router to hold them.

Secrets are shown once, at creation (`llmgw-` + 32 random bytes, URL-safe);
stores keep only their SHA-256 (`digest`). No I/O here.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterable

import attrs

from llmgw.errors import UsageError

__all__ = [
    "SECRET_PREFIX",
    "ApiKey",
    "BudgetAsk",
    "BudgetGrant",
    "BudgetLeases",
    "TenantLimits",
    "UsageRow",
    "digest",
    "new_key",
    "new_secret",
]

SECRET_PREFIX = "llmgw-"


@attrs.frozen
class TenantLimits:
    """What a tenant (an account in the control plane's store) may use; None: no limit."""

    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # prompt + completion tokens per minute
    max_band: str | None = None  # the highest-priority band its keys may ask for


@attrs.frozen
class ApiKey:
    key_id: str
    tenant: str
    models: frozenset[str] | None  # None: every model
    default_band: str
    max_band: str  # the highest-priority band this key may ask for
    created_at: float
    revoked: bool = False
    name: str = ""
    expires_at: float | None = None  # wall clock; None: never
    # The tenant's limits, read with the key (the store joins its account); None: none known.
    limits: TenantLimits | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def usable(self, now: float) -> bool:
        """Not revoked and not expired at wall-clock `now`."""
        return not self.revoked and (self.expires_at is None or now < self.expires_at)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def new_key(
    *,
    tenant: str,
    models: Iterable[str] | None = None,
    default_band: str = "interactive",
    max_band: str | None = None,
    name: str = "",
) -> tuple[ApiKey, str]:
    """A new key and its secret (for a store to keep the key and the secret's digest)."""
    if not tenant:
        raise UsageError("a key needs a tenant")
    key = ApiKey(
        key_id="key-" + secrets.token_hex(6),
        tenant=tenant,
        models=None if models is None else frozenset(models),
        default_band=default_band,
        max_band=max_band or default_band,
        created_at=time.time(),
        name=name,
    )
    return key, new_secret()


@attrs.frozen
class BudgetAsk:
    """One router's lease on a tenant's budget for one window (llmgw/core/_budget.py):
    it gives back `give_back` (held, not used) first, then asks for `ask` more."""

    tenant: str
    kind: str  # "rpm" (requests) or "tpm" (tokens)
    window: int  # minutes since the epoch
    limit: int  # the tenant's limit of that kind, as the router knows it
    ask: int = 0
    give_back: int = 0


@attrs.frozen
class BudgetGrant:
    granted: int  # of what was asked
    taken: int  # the window's budget taken by every router, after this lease


@attrs.frozen
class BudgetLeases:
    """The store's answer to a batch of `BudgetAsk`s: a grant for each, in order, and how
    many router processes took budget within `ROUTER_SEEN_S` (this one included)."""

    grants: tuple[BudgetGrant, ...]
    routers: int


@attrs.frozen
class UsageRow:
    hour: int  # the hour's start, seconds since the epoch (a multiple of 3600)
    tenant: str
    key_id: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
