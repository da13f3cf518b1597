"""The reconciler's memory of replicas a router quarantined as wedged (and of those the
memory watch replaces: llmgw/cp/_fleet/_memory_watch.py, the same path).

A router (this control plane's, or one of its workers: llmgw/cp/_workers.py)
quarantines an endpoint whose requests get no bytes while the model's other
endpoints make progress (llmgw/core/_wedge.py) and says why. The reconciler
takes its word: the replica is failed with that reason (llmgw/core/_reconcile.py),
so stopped and replaced, and counted by its model's backoff. The word is
kept while the replica is reported, so a quarantine the router lifts (the
engine sent a byte again, or its quarantine ran out) does not undo a
replacement under way; and the replica's last view is shown in `ctl replicas`
for `VISIBLE_S` after it is gone, so the operator sees why it was replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping

from llmgw.core import Plan, ReplicaView

log = logging.getLogger("llmgw.cp.reconciler")

VISIBLE_S = 600.0


class WedgedReplicas:
    def __init__(self, source: Callable[[], Mapping[str, str]] | None) -> None:
        """`source()`: replica id -> the router's reason, for those quarantined now."""
        self._source = source
        self.reasons: dict[str, str] = {}
        self._views: dict[str, tuple[ReplicaView, float]] = {}  # replica id -> (view, when)

    def __repr__(self) -> str:
        return f"<WedgedReplicas {sorted(self.reasons)} shown {sorted(self._views)}>"

    def note(self, reported: Collection[str], now: float) -> None:
        """Before a plan: the routers' word on the replicas still `reported`."""
        self.reasons = {r: why for r, why in self.reasons.items() if r in reported}
        told = self._source() if self._source is not None else {}
        for replica_id, why in told.items():
            if replica_id in reported and replica_id not in self.reasons:
                log.warning("replica %s is replaced: %s", replica_id, why)
                self.reasons[replica_id] = why
        self._views = {
            r: (v, at)
            for r, (v, at) in self._views.items()
            if r in reported or now - at <= VISIBLE_S
        }

    def planned(self, plan: Plan, now: float) -> None:
        """After a plan: keep the views of the wedged replicas, to show once they are gone."""
        for v in plan.replicas:
            if v.replica_id in self.reasons:
                self._views[v.replica_id] = (v, now)

    def views(self) -> dict[str, ReplicaView]:
        return {r: v for r, (v, _) in self._views.items()}
