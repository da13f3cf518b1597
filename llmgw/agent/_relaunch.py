"""`relaunchShard` on the agent: a running shard started again with other LoRA adapters.

llama-server takes its adapters at launch only, so a replica of it changes the
adapters it holds by a relaunch: the same shard (id, port, cards, replica) from
a spec that differs only in `adapters` and `adapter_sources`
(`llmgw.core.relaunch_refusal` names anything else that differs, and the
relaunch is refused with it).

In this order:

1. The new spec's sources are made ready (`Sources.prepare`: every source
   fetched or checked, single flight, whole or nothing) while the old engine
   still serves. A source that cannot be made ready is the caller's error,
   naming the source; the old engine goes on as it was.
2. `Supervisor.replace`, shielded: the old processes are stopped (SIGTERM to
   each process group, SIGKILL after the grace; their exits are no failure),
   spec.json is written, and the shard is started again through the same launch
   as a new one. It reports starting (the state table's RELAUNCHED event),
   then loading and ready through shardStatus, with new pids and the same port;
   run.json holds the new argv, so a restarted agent adopts the relaunched engine.

One relaunch per shard at a time: a second one while the first is under way is
refused (`UsageError`, saying so), not queued: the control plane, which asked
for the first, hears how it ended and decides again. The same spec again
answers the shard as it is (a retried command). A `stopShard` during a
relaunch wins: while the sources are being made ready it cancels them, and
during step 2 the relaunch sees the stop and starts nothing; either way the
relaunch answers `NotFound`, the shard having been stopped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from llmgw import model
from llmgw.agent._sources import SourceError
from llmgw.core import RUNNING_SHARD_STATES, relaunch_refusal
from llmgw.errors import NotFound, UsageError

if TYPE_CHECKING:
    from llmgw.agent._supervisor import Supervisor

# Part of the supervisor, as operators know it.
log = logging.getLogger("llmgw.agent.supervisor")


async def relaunch(sup: Supervisor, spec: model.ShardSpec, grace_s: float) -> model.ShardReport:
    shard_id = spec.shard_id
    where = f"node {sup.node_id}" if sup.node_id else "this node"
    shard = sup.shard_of(shard_id)
    if shard is None:
        raise NotFound(f"relaunch: no shard {shard_id!r} on {where}")
    if shard.state not in RUNNING_SHARD_STATES:
        raise UsageError(
            f"relaunch {shard_id} on {where}: it is {shard.state.value}, and only a running "
            "shard is relaunched (start it again instead)"
        )
    refusal = relaunch_refusal(shard.spec, spec)
    if refusal is not None:
        raise UsageError(f"relaunch {shard_id} on {where}: {refusal}")
    if shard.relaunch is not None:
        raise UsageError(
            f"relaunch {shard_id} on {where}: a relaunch of it is under way; ask again "
            "once that one has answered"
        )
    if spec == shard.spec:
        return shard.report()  # a retried command: it runs this spec already
    log.info(
        "shard %s: relaunching with adapters %s (was %s)",
        shard_id,
        ", ".join(spec.adapters) or "none",
        ", ".join(shard.spec.adapters) or "none",
    )
    stopped = NotFound(f"relaunch {shard_id} on {where}: the shard was stopped meanwhile")
    try:
        with trio.CancelScope() as scope:
            shard.relaunch, shard.pending = scope, spec
            try:
                local = await sup.prepare(spec)
            except SourceError as exc:
                raise UsageError(
                    f"relaunch {shard_id} on {where}: {exc}; it goes on with its adapters as "
                    "they were"
                ) from None
        if scope.cancelled_caught or shard.stopping:
            raise stopped
        replaced = await sup.replace(shard, spec, local, grace_s)
    finally:
        shard.relaunch = shard.pending = None
    if not replaced:
        if shard.stopping:
            raise stopped
        raise UsageError(
            f"relaunch {shard_id} on {where}: the engine {shard.state.value} before it was "
            f"stopped for the relaunch ({(shard.reason or 'no reason').splitlines()[0]})"
        )
    return shard.report()
