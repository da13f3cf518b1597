"""The router's keys, read from the control plane's store (llmgw/store).

`StoreKeys` is the router's KeyStore over a Store: a key is looked up by its
secret's digest with its expiry and its tenant's limits (the account), which is
what admission needs; the router's CachedKeys in front keeps it off the store on
the request path.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.keys import ApiKey, digest
from llmgw.store import Store


class StoreKeys:
    """The KeyStore the router reads: the store's api_keys, joined with their accounts."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"<StoreKeys {self.store!r}>"

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
        return await self.store.create_key(
            tenant=tenant,
            models=models,
            default_band=default_band,
            max_band=max_band,
            name=name,
            expires_at=expires_at,
        )

    async def list(self) -> list[ApiKey]:
        return [k.key for k in await self.store.list_keys()]

    async def revoke(self, key_id: str) -> bool:
        return await self.store.revoke_key(key_id)

    async def lookup(self, secret: str) -> ApiKey | None:
        return await self.store.lookup_key(digest(secret))
