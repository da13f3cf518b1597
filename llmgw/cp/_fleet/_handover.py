"""The router's list in the first seconds of a term: the published list, handed over.

On election the leader's own fleet view is empty until the agents re-register with it;
`Handover` routes meanwhile by the list the standby was routing by (the one the old
leader published), merged endpoint by endpoint with the own view as it fills
(llmgw/core/_handover.py decides). It ends once every published endpoint's node has
registered (or its engine stopped answering), or `limit_s` after the election: the
old leader would have stopped routing to an agent-less node's engines once the node
was lost, `lost_after_s` after its last heartbeat, and this bound is that one.

Log lines: INFO "endpoints: handing over from the published list (N endpoints)" at
the start, INFO "endpoints: handover over after S s: ..." at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping

from llmgw import core
from llmgw.router import Endpoint, EndpointSource

log = logging.getLogger("llmgw.cp.endpoints")

RECHECK_S = 0.2  # the registry and the engines' health, read at most this often


def _node_of(endpoint: str) -> str:
    """The node in an endpoint id, `replica@node` (llmgw/cp/_fleet/_endpoints.py)."""
    return endpoint.rpartition("@")[2]


class Handover:
    """An EndpointSource over the own fleet view and the published list it replaces."""

    def __init__(
        self,
        fleet: EndpointSource,
        published: Mapping[str, tuple[Endpoint, ...]],
        *,
        registered: Callable[[], Collection[str]],
        unhealthy: Callable[[], Collection[str]],
        started_at: float,
        limit_s: float,
    ) -> None:
        self._fleet = fleet
        self._published = dict(published)
        self._registered = registered
        self._unhealthy = unhealthy
        self.started_at = started_at
        self.limit_s = limit_s
        self._gone: set[str] = set()  # published endpoints whose engine stopped answering
        self._checked: tuple[int, float] | None = None  # (fleet version, when)
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self.version = 0
        self.over = False
        log.info(
            "endpoints: handing over from the published list (%d endpoints) while the "
            "agents register",
            sum(len(eps) for eps in self._published.values()),
        )

    def __repr__(self) -> str:
        return f"<Handover v{self.version} over={self.over} gone={len(self._gone)}>"

    def update(self, now: float) -> None:
        """Merge again when the own view moved, or every RECHECK_S; end when done."""
        if self.over:
            return
        fleet_version = self._fleet.version
        if self._checked is not None:
            version, at = self._checked
            if version == fleet_version and now - at < RECHECK_S:
                return
        self._checked = (fleet_version, now)
        registered = set(self._registered())
        # Latched: an engine that stopped answering does not come back into a list that
        # only bridges a few seconds (it would flap with each reading).
        self._gone.update(self._unhealthy())
        waiting = core.handing_over(
            self._published, node_of=_node_of, registered=registered, unhealthy=self._gone
        )
        if not waiting or now - self.started_at >= self.limit_s:
            self.over = True
            log.info(
                "endpoints: handover over after %.1f s: %s",
                now - self.started_at,
                "every node of the published list registered or its engine stopped answering"
                if not waiting
                else f"{self.limit_s:g} s passed; nodes not registered by now are taken as lost",
            )
            return
        merged = core.handover_endpoints(
            self._fleet.snapshot(),
            self._published,
            node_of=_node_of,
            registered=registered,
            unhealthy=self._gone,
        )
        if merged != self._snapshot:
            self._snapshot = merged
            self.version += 1

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        return self._snapshot

    def traffic(self) -> Mapping[str, core.TrafficSplit]:
        return self._fleet.traffic()
