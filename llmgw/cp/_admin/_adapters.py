"""LoRA adapters in the admin API: each catalog adapter, the replicas that hold it, the
loads in flight, its demand and this leader's loads, evictions and failures
(llmgw/cp/_fleet/_adapters.py). What replicas hold is the fleet's; the counts are the
leader's since it was elected (a standby answers its own: none)."""

from __future__ import annotations

from typing import Any, Protocol

from llmgw.cp._admin._http import HttpError, Route, route
from llmgw.cp._fleet._adapters import AdapterStatus


class AdapterSource(Protocol):
    def status(self) -> list[AdapterStatus]: ...


def adapter_json(s: AdapterStatus) -> dict[str, Any]:
    c = s.counts
    return {
        "name": s.name,
        "base": s.base,
        "source": s.source,
        "held_by": [{"replica": r, "node": n} for r, n in s.held_by],
        "loading_on": list(s.loading_on),
        "queued": s.queued,  # null: no router reports it
        "in_flight": s.in_flight,
        "draw": s.draw,  # queued + in flight averaged over ~30 s; null: not read (a standby)
        "last_used": c.last_used,  # unix time; null: not used under this leader
        "loads": c.loads,
        "evictions": c.evictions,
        "failures": c.failures,
        "last_error": c.last_error,
    }


class AdapterRoutes:
    """`/api/v1/adapters` and `/api/v1/adapters/{name}`."""

    def __init__(self, adapters: AdapterSource | None) -> None:
        self._adapters = adapters
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/adapters", self.list),
            route("GET", "/api/v1/adapters/{name}", self.one),
        )

    def _need(self) -> AdapterSource:
        if self._adapters is None:
            raise HttpError(404, "this control plane runs no catalog")
        return self._adapters

    async def list(self, **_: Any) -> tuple[int, Any]:
        return 200, {"adapters": [adapter_json(s) for s in self._need().status()]}

    async def one(self, name: str, **_: Any) -> tuple[int, Any]:
        found = next((s for s in self._need().status() if s.name == name), None)
        if found is None:
            raise HttpError(404, f"no adapter {name!r} in the catalog")
        return 200, adapter_json(found)
