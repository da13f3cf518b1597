"""Draining a node: replace what runs there first, then let it go quietly.

A pure rule the reconcile plan applies to every live replica with a rank on a
draining node (one model at a time). Such a replica does not count toward the
model's wanted replicas, so the plan starts its replacement elsewhere; the
rule decides what happens to the replica itself:

| state    | when                                                    | routed | stopped |
|----------|---------------------------------------------------------|--------|---------|
| draining | the model has too few ready replicas elsewhere          | yes    | no      |
| retiring | not ready itself (it serves nothing)                    | no     | at once |
| retiring | ready, on the first pass with enough ready elsewhere    | no     | no      |
| retiring | later passes, once the router reports none in flight or | no     | yes     |
|          | the drain timeout has passed since it began retiring    |        |         |

"Enough" is counted per replica: with `wanted` replicas, `ready_elsewhere`
ready ones off draining nodes and `k` draining ones, `ready_elsewhere + k -
wanted` of the draining ones may retire, so serving capacity never drops
below what is wanted while replacements load. The first retiring pass never
stops: it is what takes the replica out of the router's list (the I/O shell
refreshes the endpoints from the plan), and only a later reading of the
router's in-flight count can say that nothing is still being answered there.
While the control plane looks cut off (the reconcile guard), nothing retires.
Unknown in-flight counts (no router in this process) wait for the timeout.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from llmgw.core._replica import ReplicaState

DRAINING = "its node is draining"


@attrs.frozen
class DrainInput:
    """What the plan needs to know about draining, from the I/O shell."""

    nodes: Collection[str] = frozenset()  # draining node ids
    # replica id -> requests the router is proxying to it now; absent or None: unknown
    in_flight: Mapping[str, int | None] = attrs.field(factory=dict)
    # replica id -> clock value of the first pass that showed it retiring
    retiring_since: Mapping[str, float] = attrs.field(factory=dict)
    timeout_s: float = 300.0
    # replica id -> why it drains though its node does not: a card it uses is unusable
    # ("gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus) on node01")
    replicas: Mapping[str, str] = attrs.field(factory=dict)


@attrs.frozen
class DrainingReplica:
    replica_id: str
    ready: bool  # every rank ready (it may be serving)
    first_seen: float
    why: str = DRAINING  # what it is replaced for: its node drains, or a card of it failed


@attrs.frozen
class DrainDecision:
    replica_id: str
    state: ReplicaState  # draining | retiring
    stop: bool
    reason: str


def drain_model(
    model_name: str,
    wanted: int,
    ready_elsewhere: int,
    replicas: Sequence[DrainingReplica],
    drain: DrainInput,
    now: float,
    *,
    cut_off: bool = False,
) -> list[DrainDecision]:
    """One decision per draining replica of `model_name`, in `replicas`' order."""
    may_retire = 0 if cut_off else max(0, ready_elsewhere + len(replicas) - wanted)

    def priority(r: DrainingReplica) -> tuple[bool, bool, float, float, str]:
        # What serves nothing goes first (that keeps the most capacity), then what is
        # already retiring (a drain walks forward; it does not swap replicas back and
        # forth), then the oldest.
        since = drain.retiring_since.get(r.replica_id)
        return (r.ready, since is None, since or 0.0, r.first_seen, r.replica_id)

    retiring = {r.replica_id for r in sorted(replicas, key=priority)[:may_retire]}
    out = []
    for r in replicas:
        if r.replica_id not in retiring:
            if cut_off:
                why = "kept: this control plane looks cut off from most of the fleet"
            else:
                why = (
                    f"kept until its replacement is ready ({model_name} has {ready_elsewhere} "
                    f"ready replica{'s' if ready_elsewhere != 1 else ''} elsewhere, wants {wanted})"
                )
            decision = DrainDecision(r.replica_id, ReplicaState.DRAINING, False, f"{r.why}; {why}")
            out.append(decision)
            continue
        out.append(retire(r.replica_id, r.ready, drain, now, r.why))
    return out


def retire(
    replica_id: str,
    ready: bool,
    drain: DrainInput,
    now: float,
    why: str = DRAINING,
    *,
    replaced: bool = True,
) -> DrainDecision:
    """A replica that may retire (`why` it is replaced, or, `replaced` False, no longer
    needed: a scale-down): out of the router on the first pass, stopped on a later one
    at zero in flight or after the timeout; at once when it serves nothing. The rollout
    rule (llmgw/core/_rollout.py) and a scale-down retire the same way."""
    done = "replaced" if replaced else "not needed"

    def decide(stop: bool, reason: str) -> DrainDecision:
        return DrainDecision(replica_id, ReplicaState.RETIRING, stop, f"{why}; {reason}")

    since = drain.retiring_since.get(replica_id)
    if not ready:
        return decide(True, f"it was not serving, and is {done}")  # nothing can be in flight
    if since is None:
        return decide(False, f"{done}, so the router sends it nothing new")
    flying = drain.in_flight.get(replica_id)
    waited = now - since
    count = "an unknown number of" if flying is None else str(flying)
    if flying == 0:
        return decide(True, f"{done}, and no request is in flight")
    if waited >= drain.timeout_s:
        return decide(
            True,
            f"{done}, and the drain timeout of {drain.timeout_s:g} s passed with {count} "
            "requests still in flight",
        )
    return decide(
        False,
        f"{done}, waiting for {count} in-flight requests ({waited:.0f} of {drain.timeout_s:g} s)",
    )
