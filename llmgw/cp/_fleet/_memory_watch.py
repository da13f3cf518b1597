"""The reconciler's watch of replicas sharing a card: over their claims, and out of memory.

Each heartbeat carries what every shard's process group holds on its cards
(model.ShardUsage.gpu_memory_mib, from the agent's compute-apps reading) beside
each card's memory.used and foreign memory. Before each plan `note` reads the
registry's records, card by card (the cards a shard with a claim,
`gpu_memory_mib`, runs on), and asks `core.watch_card`:

- a shard over its claim is reported once per episode: an `over-claim` event
  (`replica small-5bed34 over its claim on gpu 0 of g1: holds 30720 MiB, claims
  24576 (6144 over)`) and a warning; the episode ends when it is back within it
  (or gone), and a new one is reported again. While it is over, its replica's
  line in `ctl replicas` says so (`annotate`).
- on a card out of memory, the one shard `core.watch_card` picks has its
  replica failed with the reason (`out of memory: gpu 0 of g1 holds 81400 of
  81559 MiB; this replica holds 40960 MiB, claims 24576 (16384 over)`): the
  reconciler stops it and starts a replacement, as it does for a replica a router
  quarantined as wedged (llmgw/cp/_fleet/_wedged.py shows its last view for ten
  minutes, and the reason is on its `replica-stopped` event). The word is kept
  while the replica is reported, so memory freed by the stop undoes nothing.

Only what is measured decides: a shard or card whose numbers are unknown is
never over and never picked (llmgw/core/_card_memory.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping

import attrs

from llmgw import core
from llmgw.cp._fleet._registry import NodeRegistry

log = logging.getLogger("llmgw.cp.reconciler")

OVER_CLAIM = "over-claim"  # the event kind of a replica holding more than its claim


class MemoryWatch:
    def __init__(self, registry: NodeRegistry) -> None:
        self._registry = registry
        self.reasons: dict[str, str] = {}  # replica id -> why it is replaced (out of memory)
        self.over: dict[tuple[str, str], str] = {}  # (node, shard) -> how far over, now
        self._over_replicas: dict[str, str] = {}  # replica id -> the same, for `annotate`

    def __repr__(self) -> str:
        return f"<MemoryWatch over {sorted(self.over)} replacing {sorted(self.reasons)}>"

    def with_routers(
        self, wedged: Callable[[], Mapping[str, str]] | None
    ) -> Callable[[], Mapping[str, str]]:
        """The replicas to fail now: the routers' wedged ones and this watch's picks."""

        def either() -> Mapping[str, str]:
            told = dict(wedged()) if wedged is not None else {}
            return self.reasons | told

        return either

    def note(self, reported: Collection[str]) -> None:
        """Before a plan: read every shared card's memory and decide (the module says what)."""
        self.reasons = {r: why for r, why in self.reasons.items() if r in reported}
        over: dict[tuple[str, str], str] = {}
        over_replicas: dict[str, str] = {}
        for rec in self._registry.records():
            inv = rec.inventory
            used_by = {u.shard_id: u.gpu_memory_mib for u in inv.usage.shards}
            usage = {g.index: g for g in inv.usage.gpus}
            for gpu in inv.gpus or ():
                on = [s for s in rec.shards if gpu.uuid in s.gpus]
                if not any(s.gpu_memory_mib is not None for s in on):
                    continue  # no share on it: whole cards are not watched here
                u = usage.get(gpu.index)
                card = core.CardUse(
                    gpu.memory_total_mib,
                    u.memory_used_mib if u is not None else None,
                    u.foreign_memory_mib if u is not None else None,
                    tuple(
                        core.ShareUse(s.shard_id, s.replica_id, s.gpu_memory_mib,
                                      used_by.get(s.shard_id))
                        for s in on
                    ),
                )  # fmt: skip
                verdict = core.watch_card(card)
                where = f"gpu {gpu.index} of {rec.node_id}"
                models = {s.shard_id: s.model_name or s.model for s in on}
                for o in verdict.over:
                    words = f"over its claim on {where}: {o.words()}"
                    over[(rec.node_id, o.shard_id)] = words
                    if o.replica_id is not None:
                        over_replicas[o.replica_id] = words
                    if (rec.node_id, o.shard_id) not in self.over:
                        who = f"replica {o.replica_id}" if o.replica_id else f"shard {o.shard_id}"
                        log.warning("%s %s", who, words)
                        self._registry.events.record(
                            OVER_CLAIM, f"{who} {words}", node_id=rec.node_id,
                            replica_id=o.replica_id, model_name=models.get(o.shard_id),
                            shard_id=o.shard_id,
                        )  # fmt: skip
                pick = verdict.replace
                if pick is None or pick.replica_id is None or pick.replica_id in self.reasons:
                    continue
                if pick.replica_id not in reported:
                    continue
                why = (
                    f"out of memory: {where} {verdict.full_words(gpu.memory_total_mib)}; "
                    f"this replica {pick.words()}"
                )
                log.warning("replica %s: %s: replacing it", pick.replica_id, why)
                self.reasons[pick.replica_id] = why
        self.over, self._over_replicas = over, over_replicas

    def annotate(self, views: list[core.ReplicaView]) -> list[core.ReplicaView]:
        """The views with each live replica over its claim saying so (`ctl replicas`)."""
        out = []
        for v in views:
            words = self._over_replicas.get(v.replica_id)
            if words is not None and v.state in core.ALIVE_REPLICA_STATES:
                v = attrs.evolve(v, reason=f"{v.reason}; {words}" if v.reason else words)
            out.append(v)
        return out
