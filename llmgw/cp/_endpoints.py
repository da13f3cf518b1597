"""The router's view of the fleet: the serving rank of every ready replica.

Recomputed whenever the registry or the catalog changes; the router re-reads
it only when `version` moves. Engines keep serving while their agent restarts,
so a replica on an unreachable node stays routable (the router's breaker
judges the engine itself); one on a lost node does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from llmgw.cp._catalog import Catalog
from llmgw.cp._registry import NodeRegistry
from llmgw.router._types import Endpoint


class FleetEndpoints:
    def __init__(self, registry: NodeRegistry, catalog: Callable[[], Catalog]) -> None:
        self._registry = registry
        self._catalog = catalog
        self._version = 0
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self.refresh()

    def __repr__(self) -> str:
        sizes = {m: len(e) for m, e in self._snapshot.items()}
        return f"<FleetEndpoints v{self._version} {sizes}>"

    @property
    def version(self) -> int:
        return self._version

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        return self._snapshot

    def refresh(self) -> None:
        catalog = self._catalog()
        served: dict[str, list[Endpoint]] = {name: [] for m in catalog.models for name in m.names}
        for rec in self._registry.records():
            if rec.liveness.state.value == "lost":
                continue
            for s in rec.shards:
                m = catalog.model(s.model_name) if s.model_name else None
                if m is None or s.rank != 0 or s.state != "ready" or s.port is None:
                    continue
                for name in m.names:
                    served[name].append(
                        Endpoint(
                            endpoint_id=f"{s.replica_id}@{rec.node_id}",
                            model=name,
                            engine=s.engine,
                            host=rec.host,
                            port=s.port,
                        )
                    )
        snapshot = {
            name: tuple(sorted(eps, key=lambda e: e.endpoint_id)) for name, eps in served.items()
        }
        if snapshot != self._snapshot:
            self._snapshot = snapshot
            self._version += 1
