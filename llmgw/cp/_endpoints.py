"""The router's view of the fleet: the serving rank of every ready replica.

Recomputed when read after the registry or the catalog changed; the router
re-reads it only when `version` moves. Engines keep serving while their agent
restarts, so a replica on an unreachable node stays routable (the router's
breaker judges the engine itself); one on a lost node does not.

A replica on a draining node stays routable until its replacement is ready;
then the reconciler names it retiring (`retiring()`), it leaves this list, and
the router sends it nothing new while its last requests finish. Leaving it
out from the start of the drain would make a model whose only replica is
there unservable for as long as the replacement takes to load.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from llmgw.cp._catalog import Catalog
from llmgw.cp._registry import NodeRegistry
from llmgw.router._types import Endpoint


def endpoint_id(replica_id: str | None, node_id: str) -> str:
    """The router's id for a replica's serving rank (it keys in-flight counts on it)."""
    return f"{replica_id}@{node_id}"


class FleetEndpoints:
    def __init__(
        self,
        registry: NodeRegistry,
        catalog: Callable[[], Catalog],
        retiring: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self._registry = registry
        self._catalog = catalog
        self._retiring = retiring  # replica ids the router must send nothing new
        self._version = 0
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self._stale = True

    def __repr__(self) -> str:
        sizes = {m: len(e) for m, e in self.snapshot().items()}
        return f"<FleetEndpoints v{self.version} {sizes}>"

    @property
    def version(self) -> int:
        if self._stale:
            self._recompute()
        return self._version

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        if self._stale:
            self._recompute()
        return self._snapshot

    def refresh(self) -> None:
        """Something changed: recompute when the list is next read.

        Called on every registration and shard report; recomputing there walked
        the whole fleet per event, O(N^2) over a register storm of N agents.
        """
        self._stale = True

    def _recompute(self) -> None:
        self._stale = False
        catalog = self._catalog()
        served: dict[str, list[Endpoint]] = {name: [] for m in catalog.models for name in m.names}
        retiring = self._retiring()
        for rec in self._registry.records():
            if rec.liveness.state.value == "lost":
                continue
            for s in rec.shards:
                m = catalog.model(s.model_name) if s.model_name else None
                if m is None or s.rank != 0 or s.state != "ready" or s.port is None:
                    continue
                if s.replica_id is not None and s.replica_id in retiring:
                    continue
                for name in m.names:
                    served[name].append(
                        Endpoint(
                            endpoint_id=endpoint_id(s.replica_id, rec.node_id),
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
