"""Where a replica can go: the fleet as placement sees it, for the reconciler and `place`.

Placement itself is pure (llmgw/core/_placement.py); this gathers its input: each
node's facts (cordoned and draining nodes held, a node that did not answer the last
call left out until it is heard from again), the cards already given (the shards
reported plus the starts still in flight, `flying`), and each source's size
(llmgw/cp/_weights/_sizes.py: None unknown, MEASURING before its first measurement,
when nothing is placed, since a start could fetch onto a disk that cannot hold it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import attrs

from llmgw import core, model
from llmgw.cp._fleet._catalog import CatalogModel, Profile
from llmgw.cp._fleet._registry import NodeRecord, NodeRegistry
from llmgw.cp._weights._sizes import Measuring


@attrs.frozen
class Unplaced:
    model_name: str
    reasons: tuple[str, ...]
    # Nodes refused only because they are installing the engine at the declared version
    # (core.Refusal.installing, over every profile): the model waits for them, it is not
    # out of room.
    installing: tuple[str, ...] = ()


class Placing:
    def __init__(
        self,
        registry: NodeRegistry,
        flying: Callable[[], list[tuple[str, model.ShardSpec]]],
        clock: Callable[[], float],
        sizes: Callable[[str], int | Measuring | None] | None = None,
    ) -> None:
        self._registry = registry
        self._flying = flying  # every rank of the starts in flight: (node, spec)
        self._clock = clock
        # None: nothing knows sizes, so placement never refuses for disk.
        self._sizes = sizes
        self._unanswered: dict[str, float] = {}  # node -> when a call to it timed out

    def __repr__(self) -> str:
        return f"<Placing unanswered {sorted(self._unanswered)}>"

    def unanswered(self, node_id: str) -> None:
        """A call to `node_id` timed out: leave it out until it is heard from again."""
        self._unanswered[node_id] = self._clock()

    def clear(self) -> None:
        self._unanswered.clear()

    def facts(self) -> list[core.NodeFacts]:
        held = self._registry.cordoned.keys() | self._registry.draining.keys()
        out = []
        for rec in self._registry.records():
            facts = attrs.evolve(
                core.node_facts(rec, self._registry.engines), cordoned=rec.node_id in held
            )
            if self._silent_since_unanswered(rec):
                facts = attrs.evolve(facts, ready=False, state="did not answer the last call")
            out.append(facts)
        return out

    def _silent_since_unanswered(self, rec: NodeRecord) -> bool:
        """A node that did not answer a call, and has not been heard from since: placement
        leaves it out, so the next pass does not send it the same start again."""
        when = self._unanswered.get(rec.node_id)
        if when is None:
            return False
        if rec.liveness.last_seen > when:
            del self._unanswered[rec.node_id]
            return False
        return True

    def allocations(self, without: Collection[str] = ()) -> core.Allocations:
        # Starts in flight hold their cards too: the next pass must not give them again.
        return core.allocations(self._registry.records(), self._flying(), without)

    def placer(self, without: Collection[str] = ()) -> core.Placer:
        """The fleet indexed once; place several replicas with it, adding each.
        `without`: as if these replicas were gone (what retiring them would free)."""
        return core.Placer(self.facts(), self.allocations(without))

    def try_place(
        self, m: CatalogModel, placer: core.Placer | None = None
    ) -> tuple[Profile, core.Placement] | Unplaced:
        placer = placer or self.placer()
        reasons: list[str] = []
        installing: set[str] = set()
        for i, profile in enumerate(m.profiles):
            result = placer.place(core.placement_profile(m, profile, self._weights_bytes(m.source)))
            if isinstance(result, core.Placement):
                return profile, result
            prefix = f"profile {i} ({profile.engine}, {profile.gpu_class or 'cpu'}): "
            if len(m.profiles) == 1:
                prefix = ""
            reasons += [prefix + r for r in result.reasons] or [prefix + "no node"]
            installing.update(result.installing)
        return Unplaced(m.name, tuple(reasons), tuple(sorted(installing)))

    def _weights_bytes(self, source: str) -> int | None:
        got = self._sizes(source) if self._sizes is not None else None
        return None if isinstance(got, Measuring) else got

    def measuring(self, m: CatalogModel) -> bool:
        """Its source's size is not measured yet: placing it waits for the size task."""
        return self._sizes is not None and isinstance(self._sizes(m.source), Measuring)
