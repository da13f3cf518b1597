"""A request's priority band, and its tenant's limits on it.

The band is the `X-LLMGW-Priority` header's, else the key's default, and never
above the key's highest (`max_band`: a higher one is lowered to it). The
tenant's limits (llmgw/router/_tenants.py in one process, llmgw/router/_budgets.py
across the fleet) then refuse a band above the
tenant's ceiling (403) or a request over its requests or tokens per minute
(429, with Retry-After).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from llmgw.core import Band
from llmgw.keys import ApiKey, TenantLimits
from llmgw.router import _surface
from llmgw.router._tenants import Refused, ceiling

log = logging.getLogger("llmgw.router")

PRIORITY_HEADER = b"x-llmgw-priority"


class Bands:
    """The configured bands, and the tenant limits applied to a request's band."""

    def __init__(
        self,
        bands: Iterable[Band],
        admit: Callable[[str, TenantLimits], Awaitable[Refused | None]],
        on_refused: Callable[[str, str], None],
    ) -> None:
        """`admit(tenant, limits)`: the tenant's requests and tokens per minute
        (llmgw/router/_leases.py TenantAdmission); `on_refused(tenant, reason)`: counts a
        refusal (the tenant metrics)."""
        self._bands = {b.name: b for b in bands}
        self._ranks = {b.name: b.rank for b in self._bands.values()}
        self._admit = admit
        self._on_refused = on_refused
        self._unknown_ceilings: set[tuple[str, str]] = set()  # logged once each

    def __repr__(self) -> str:
        return f"<Bands {', '.join(self._bands)}>"

    def band(self, headers: Iterable[tuple[bytes, bytes]], key: ApiKey) -> Band:
        """The request's band: asked for (400 for an unknown one), else the key's default
        (403 when that is not configured); at most the key's highest."""
        asked: str | None = None
        for header, value in headers:
            if header == PRIORITY_HEADER:
                asked = value.decode("latin-1").strip()
                break
        name = asked or key.default_band
        band = self._bands.get(name)
        if band is None:
            known = ", ".join(self._bands)
            if asked:
                raise _surface.unknown_band("X-LLMGW-Priority", asked, known)
            raise _surface.default_band_unknown(key.key_id, name, known)
        cap = self._bands.get(key.max_band)
        if cap is not None and band.rank < cap.rank:
            band = cap
        return band

    async def admit_tenant(self, key: ApiKey, band: Band) -> None:
        """The tenant's band ceiling (403) and its requests and tokens per minute (429)."""
        limits = key.limits
        if limits is None:
            return
        tenant = key.tenant
        refused: Refused | None = None
        if limits.max_band is not None:
            if limits.max_band in self._ranks:
                refused = ceiling(tenant, band.name, limits.max_band, self._ranks)
            elif (tenant, limits.max_band) not in self._unknown_ceilings:
                self._unknown_ceilings.add((tenant, limits.max_band))
                log.warning(
                    "tenant %s: its highest band %r is not a configured band (the bands "
                    "are %s); no band ceiling for it",
                    tenant,
                    limits.max_band,
                    ", ".join(self._bands),
                )
        if refused is None:
            refused = await self._admit(tenant, limits)
        if refused is None:
            return
        self._on_refused(tenant, refused.reason)
        if refused.reason == "band":
            raise _surface.band_not_allowed(refused.message)
        raise _surface.rate_limited(refused.message, refused.retry_after_s)
