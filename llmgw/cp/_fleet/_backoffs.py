"""The reconciler's restart backoff, per model: what the pure value (llmgw/core/_backoff.py)
needs remembered between passes.

Each failed replica is counted once (`_counted`), each start records its model's count
of failures then (`_started_after`, so failures of one round count once), and each
replica now ready when it became so (`_ready_at`, for the reset). Everything is keyed
by replica id and pruned to the replicas still present, so nothing grows for ever.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Set

from llmgw import core
from llmgw.core import Plan, ReplicaView

log = logging.getLogger("llmgw.cp.reconciler")

# What counts as its model's failure; a lost node, a drain, a catalog change or a
# scale-down is not the model's fault.
FAILURE_STATES = frozenset(
    {core.ReplicaState.FAILED, core.ReplicaState.TIMED_OUT, core.ReplicaState.INCOMPLETE}
)


class ModelBackoffs:
    def __init__(self, policy: core.BackoffPolicy | None = None) -> None:
        self.policy = policy if policy is not None else core.BackoffPolicy()
        self._backoff: dict[str, core.Backoff] = {}
        self._counted: set[str] = set()
        self._started_after: dict[str, int] = {}  # replica id -> its model's failures then
        self._ready_at: dict[str, float] = {}

    def current(self) -> dict[str, core.Backoff]:
        """Every model's backoff, for the plan."""
        return dict(self._backoff)

    def clear(self) -> None:
        """A new term: every model starts from zero."""
        self._backoff.clear()
        self._counted.clear()
        self._started_after.clear()

    def started(self, replica_id: str, model_name: str) -> None:
        b = self._backoff.get(model_name)
        self._started_after[replica_id] = b.failures if b is not None else 0

    def failed(self, model_name: str, replica_id: str, reason: str, now: float) -> None:
        """One failure of the model's replica (counted once per replica)."""
        self._counted.add(replica_id)
        before = self._backoff.get(model_name)
        b = core.backoff_failure(before, now, reason, self._started_after.get(replica_id))
        self._backoff[model_name] = b
        if before is None or b.failures > before.failures:
            log.warning(
                "%s: %s; its next start waits %.0f s",
                model_name,
                f"{b.failures} failures in a row" if b.failures > 1 else "a replica failed",
                b.delay_s(self.policy),
            )

    def note(self, plan: Plan, models: Set[str], others: Collection[str], now: float) -> bool:
        """Count the plan's newly failed replicas, let go a model whose new replica has
        stayed ready, forget models that left the catalog (`models`); True when a failure
        was counted (the pass plans again). `others`: replica ids not in the plan still
        to remember (starts in flight, starts that failed)."""
        noted = False
        self._ready_at = {
            v.replica_id: self._ready_at.get(v.replica_id, now)
            for v in plan.replicas
            if v.state == core.ReplicaState.READY
        }
        for v in plan.replicas:
            if v.state in FAILURE_STATES and v.replica_id not in self._counted:
                self.failed(v.model_name, v.replica_id, v.reason or v.state, now)
                noted = True
        ready: dict[str, list[float]] = {}
        for v in plan.replicas:
            if v.replica_id in self._ready_at:
                ready.setdefault(v.model_name, []).append(self._ready_at[v.replica_id])
        for name, b in list(self._backoff.items()):
            left = core.backoff_settled(b, ready.get(name, []), now, self.policy)
            if left is None:
                log.info("%s: ready again after %d failures", name, b.failures)
            if left is None or name not in models:
                del self._backoff[name]
        keep = {v.replica_id for v in plan.replicas} | set(others)
        self._counted &= keep
        self._started_after = {r: n for r, n in self._started_after.items() if r in keep}
        return noted

    def holding(
        self, replicas: Collection[ReplicaView], wanted: dict[str, int]
    ) -> dict[str, core.Backoff]:
        """The models whose starts the backoff holds back: in backoff and short of the
        replicas `wanted` (model -> count). One whose replacement is ready is not
        shown, though its count is kept until that replica has stayed ready a while."""
        out = {}
        for name, b in self._backoff.items():
            alive = sum(
                1 for v in replicas if v.model_name == name and v.state in core.ALIVE_REPLICA_STATES
            )
            if name in wanted and alive < wanted[name]:
                out[name] = b
        return out
