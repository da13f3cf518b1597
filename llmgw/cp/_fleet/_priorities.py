"""Priorities on a full fleet: a model that wants more replicas than it has and cannot be
placed may take the cards of idle replicas of lower-priority models (llmgw/core/_displace.py
decides which; this gathers its input and carries it out).

After each acting pass, for each model placement refused (the reconciler's unplaced):
the holders are the ready replicas of other models, each with its model's priority,
whether it is idle (the router has nothing in flight there and its model has nothing
queued; unknown counts as busy), and how many replicas its model has above its min (an
autoscaled model's `min`; a fixed count is its own min, so it is never displaced).
`fits(freed)` asks placement, as if those replicas were gone. Separately, of a model
scaling down, the replicas whose cards a refused model could use retire first. The
victims' models are
lowered by as many replicas (`lower`: the autoscaler's count), and the victims are
named to the plan to retire first, so they drain (their requests finish) and free
their cards; the next pass places the wanting model. While a displacement's victims
are alive nothing more is displaced for that model. The words (who holds the room and
why it may or may not be taken) are `why(model)`, for `ctl status`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping

from llmgw import core
from llmgw.cp._fleet._catalog import Catalog, CatalogModel
from llmgw.cp._fleet._placing import Placing, Unplaced
from llmgw.cp._fleet._registry import NodeRegistry

log = logging.getLogger("llmgw.cp.priorities")


class Priorities:
    def __init__(
        self,
        registry: NodeRegistry,
        placing: Placing,
        *,
        in_flight: Callable[[str, str], int | None] | None,
        queued: Callable[[str], int | None],
        lower: Callable[[str, int, str], None],
    ) -> None:
        self._registry = registry
        self._placing = placing
        self._in_flight = in_flight  # (replica, rank-0 node) -> the routers' count
        self._queued = queued  # model -> requests waiting for it in the routers; None unknown
        self._lower = lower  # (model, replicas fewer, why): the victims' models' counts
        self._victims: dict[str, tuple[str, ...]] = {}  # wanting model -> victims alive
        self._why: dict[str, str] = {}
        # Replicas of models scaling down whose cards a model placement refused could
        # use: a scale-down takes these first.
        self._helps: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"<Priorities displacing {self._victims}>"

    def retire_first(self) -> frozenset[str]:
        victims = {r for victims in self._victims.values() for r in victims}
        return frozenset(victims | self._helps)

    def why(self, model_name: str) -> str | None:
        return self._why.get(model_name)

    def after_pass(
        self,
        catalog: Catalog,
        plan: core.Plan,
        unplaced: Mapping[str, Unplaced],
        count: Callable[[CatalogModel], int],
    ) -> None:
        alive = [v for v in plan.replicas if v.state in core.ALIVE_REPLICA_STATES]
        alive_ids = {v.replica_id for v in alive}
        for name, victims in list(self._victims.items()):
            if not alive_ids & set(victims):
                del self._victims[name]  # freed: the next pass places it
        self._why = {n: w for n, w in self._why.items() if n in unplaced or n in self._victims}
        has = Counter(v.model_name for v in alive)  # each model's live replicas
        self._helps = self._helping(catalog, alive, has, unplaced, count)
        for name in sorted(unplaced):
            m = catalog.model(name)
            if m is None or name in self._victims or count(m) <= has.get(name, 0):
                continue
            holders = self._holders(catalog, alive, has, exclude=name)

            def fits(freed: frozenset[str], m: CatalogModel = m) -> bool:
                found = self._placing.try_place(m, self._placing.placer(without=freed))
                return not isinstance(found, Unplaced)

            wants = count(m)
            done = core.displace(name, m.priority, wants, has.get(name, 0), holders, fits)
            if done is None:
                self._why[name] = core.no_room(
                    name, wants, has.get(name, 0), holders, fits, priority=m.priority
                )
                continue
            self._victims[name] = done.victims
            self._why[name] = done.reason
            log.warning("%s", done.reason)
            by_model: dict[str, int] = {}
            for h in holders:
                if h.replica_id in done.victims:
                    by_model[h.model_name] = by_model.get(h.model_name, 0) + 1
            for victim_model, n in sorted(by_model.items()):
                self._lower(victim_model, n, done.reason)

    def _helping(
        self,
        catalog: Catalog,
        alive: Collection[core.ReplicaView],
        has: Mapping[str, int],
        unplaced: Mapping[str, Unplaced],
        count: Callable[[CatalogModel], int],
    ) -> frozenset[str]:
        shrinking = {m.name for m in catalog.models if count(m) < has.get(m.name, 0)}
        if not shrinking or not unplaced:
            return frozenset()
        wanting = [m for name in sorted(unplaced) if (m := catalog.model(name)) is not None]
        out = set()
        for v in alive:
            if v.model_name not in shrinking:
                continue
            placer = self._placing.placer(without=frozenset({v.replica_id}))
            if any(not isinstance(self._placing.try_place(m, placer), Unplaced) for m in wanting):
                out.add(v.replica_id)
        return frozenset(out)

    def _holders(
        self,
        catalog: Catalog,
        alive: Collection[core.ReplicaView],
        has: Mapping[str, int],
        exclude: str,
    ) -> list[core.Holder]:
        cards = self._cards()
        out = []
        for v in alive:
            other = catalog.model(v.model_name)
            if other is None or other.name == exclude or v.state != core.ReplicaState.READY:
                continue
            floor = other.autoscale.min if other.autoscale is not None else has[other.name]
            flying = self._in_flight(v.replica_id, v.nodes[0]) if self._in_flight else None
            idle = flying == 0 and self._queued(other.name) == 0
            spare = max(0, has[other.name] - floor)
            held = cards.get(v.replica_id, 0)
            out.append(core.Holder(v.replica_id, other.name, other.priority, idle, spare, held))
        return out

    def _cards(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rec in self._registry.records():
            for s in rec.shards:
                if s.replica_id is not None:
                    out[s.replica_id] = out.get(s.replica_id, 0) + len(s.gpus)
        return out
