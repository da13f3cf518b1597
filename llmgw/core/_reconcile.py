"""Reconciling: (desired, observed) -> actions, as a pure function.

The fleet is authoritative about what runs: replicas are rebuilt from the
shards agents report, grouped by replica id. The I/O shell (llmgw.cp) feeds in
the catalog and the reports, performs the actions (placing each Start), and
feeds the results back as new reports; a failure re-plans from what is
observed, never from what was hoped.

Rules, in order:
- a shard without a replica id was started by hand: left alone;
- a replica whose model left the catalog: stopped;
- a replica with a failed rank, a rank on a lost node, a rank missing after
  `rank_grace_s`, a rank unhealthy for longer than `unhealthy_replace_s`
  (counted from `unhealthy_since`, which the shell keeps), or not ready within
  its profile's startup timeout (counted from when it was first seen; progress
  does not reset it): stopped and replaced;
- a live replica a router quarantined as wedged (`wedged`: replica id -> the
  router's reason, llmgw/core/_wedge.py): failed with that reason, so stopped
  and replaced (the router sends it nothing meanwhile), and counted as its
  model's failure by the backoff;
- a replica with a rank on an unreachable node, or a rank unhealthy for less
  than `unhealthy_replace_s`: left alone, and counted;
- more replicas than wanted: the least advanced, then those already retiring, then
  those the shell names (`retire_first`), then the newest, retire: one that serves
  is taken out of the router and stopped once nothing is in flight there (the drain
  rule's `retire`, llmgw/core/_drain.py), one that does not is stopped at once;
- fewer: a Start per missing replica (`pending` starts count as present),
  except for a model in its restart backoff (`backoff`, llmgw/core/_backoff.py):
  nothing before its next try, then one replica at a time (none while one
  started since its last failure is pending or starting; replicas started
  before it go on loading and do not hold the replacement back);
- the guard: while more than half the fleet is away (unreachable, lost, or
  expected but not registered yet), nothing is rescheduled (this control
  plane is probably the one cut off), and the plan says so;
- the guard's hysteresis: once the guard has held (`guard_held_at`: the last
  time a plan said `cut_off`), it goes on holding until the nodes coming back
  have had `settle_s` to report: until `settle_s` has passed since the guard
  last held and since the last node became ready after that (`ready_since`),
  or at once when no node is away any more; never longer than `settle_max_s`
  after the guard last held. Nodes still away then are the normal case:
  unreachable ones are left alone, lost ones replaced. So a fleet that comes
  back one node at a time, each within `settle_s` of the one before, has
  nothing started for it (tests/core/test_reconcile.py proves it);
- a live replica with a rank on a draining node, or on a card its agent marked
  unusable (`drain.replicas`, llmgw/core/_xid.py: that card only): not counted as one of its
  model's replicas (so it is replaced), and kept or stopped by the drain rule
  (llmgw/core/_drain.py: kept until its replacement is ready, then taken out
  of the router, then stopped once nothing is in flight or the timeout passed);
- a model with live stale replicas (another profile fingerprint than the
  catalog's) is rolled out: the rollout rule (llmgw/core/_rollout.py) decides
  its starts (under the backoff above) and which stale replicas retire, by
  the model's `max_surge` and `max_unavailable`, and what the plan says of it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import attrs

from llmgw.core._backoff import Backoff, BackoffPolicy
from llmgw.core._drain import DRAINING, DrainingReplica, DrainInput, drain_model, retire
from llmgw.core._liveness import NodeState
from llmgw.core._replica import ALIVE_REPLICA_STATES, BEHIND, ReplicaState
from llmgw.core._rollout import (
    RolloutControl,
    RolloutMember,
    RolloutPolicy,
    RolloutStep,
    rollout_model,
)
from llmgw.model import ShardState


@attrs.frozen
class DesiredModel:
    name: str
    replicas: int
    fingerprints: tuple[str, ...]  # of its profiles; a replica with another one is stale
    startup_timeout_s: Mapping[str, float] = attrs.field(factory=dict)  # per fingerprint
    rollout: RolloutPolicy = attrs.field(factory=RolloutPolicy)


@attrs.frozen
class ObservedShard:
    node_id: str
    node_state: str  # a NodeState value: ready, unreachable, lost
    shard_id: str
    state: str  # a ShardState value: starting, loading, ready, unhealthy, failed, stopped
    replica_id: str | None
    model_name: str | None
    rank: int
    ranks: int
    fingerprint: str | None
    reason: str | None = None


@attrs.frozen
class Start:
    model_name: str


@attrs.frozen
class Stop:
    node_id: str
    shard_id: str
    reason: str


@attrs.frozen
class ReplicaView:
    replica_id: str
    model_name: str
    # A ReplicaState value (llmgw/core/_replica.py says what each means); the shell
    # adds failed for a start that never reached its agent, starting for one pending.
    state: str
    nodes: tuple[str, ...]
    first_seen: float
    stale: bool
    reason: str | None


@attrs.frozen
class Plan:
    actions: tuple[Start | Stop, ...]
    replicas: tuple[ReplicaView, ...]
    notes: tuple[str, ...] = ()
    cut_off: bool = False  # more than half the fleet away now: the shell records when
    holding: bool = False  # the guard holds (cut off, or its hysteresis): nothing rescheduled
    rollouts: tuple[RolloutStep, ...] = ()  # the models being rolled out, and how far


ALIVE = ALIVE_REPLICA_STATES
BACKOFF_POLICY = BackoffPolicy()
SETTLE_MAX_FACTOR = 6.0  # the hysteresis never holds longer than this many settle times


def guard_release_at(
    held_at: float,
    ready_since: Mapping[str, float],
    settle_s: float,
    settle_max_s: float | None = None,
) -> float:
    """When a guard that last held at `held_at` lets go, if no node is away.

    `settle_s` after the last of: the guard's last hold, and every node's
    return (`ready_since`) since then; at most `settle_max_s` (default
    `SETTLE_MAX_FACTOR` times `settle_s`) after the hold, so a fleet whose
    nodes keep flapping is not held for ever.
    """
    cap = settle_max_s if settle_max_s is not None else SETTLE_MAX_FACTOR * settle_s
    last = max([held_at, *(t for t in ready_since.values() if t >= held_at)])
    return min(last + settle_s, held_at + cap)


def _replica_state(
    shards: Sequence[ObservedShard],
    desired: DesiredModel | None,
    first_seen: float,
    now: float,
    rank_grace_s: float,
    unhealthy_since: Mapping[str, float],
    unhealthy_replace_s: float,
) -> tuple[ReplicaState, str | None]:
    if desired is None:
        return ReplicaState.REMOVED, "its model left the catalog"
    for s in shards:
        if s.node_state == NodeState.LOST:
            return ReplicaState.LOST, f"node {s.node_id} is lost"
    for s in shards:
        if s.state == ShardState.FAILED:
            why = s.reason or "no reason given"
            return ReplicaState.FAILED, f"rank {s.rank} on {s.node_id} failed: {why}"
    ranks = max(s.ranks for s in shards)
    if len({s.rank for s in shards}) < ranks and now - first_seen > rank_grace_s:
        present = sorted({s.rank for s in shards})
        return ReplicaState.INCOMPLETE, f"only ranks {present} of {ranks} are running"
    if any(s.node_state == NodeState.UNREACHABLE for s in shards):
        why = "a node of it is unreachable; left alone until it is lost"
        return ReplicaState.UNREACHABLE, why
    sick = [s for s in shards if s.state == ShardState.UNHEALTHY]
    if sick:
        s = sick[0]
        since = min(unhealthy_since.get(x.shard_id, now) for x in sick)
        what = f"rank {s.rank} on {s.node_id} is unhealthy: {s.reason or 'no reason given'}"
        if now - since > unhealthy_replace_s:
            limit = f"{unhealthy_replace_s:g} s"
            return ReplicaState.FAILED, f"{what}; for {now - since:.0f} s, longer than {limit}"
        return ReplicaState.UNHEALTHY, f"{what}; replaced if it lasts {unhealthy_replace_s:g} s"
    if all(s.state == ShardState.READY for s in shards) and len(shards) >= ranks:
        return ReplicaState.READY, None
    fingerprint = shards[0].fingerprint
    timeout = desired.startup_timeout_s.get(fingerprint or "", None)
    if timeout is not None and now - first_seen > timeout:
        why = f"not ready within its startup timeout of {timeout:g} s"
        return ReplicaState.TIMED_OUT, why
    return ReplicaState.STARTING, None


def reconcile(
    desired: Sequence[DesiredModel],
    shards: Sequence[ObservedShard],
    node_states: Mapping[str, str],
    first_seen: Mapping[str, float],
    now: float,
    *,
    pending: Mapping[str, int] | None = None,
    rank_grace_s: float = 60.0,
    drain: DrainInput | None = None,
    unhealthy_since: Mapping[str, float] | None = None,
    unhealthy_replace_s: float = 30.0,
    guard_held_at: float | None = None,
    ready_since: Mapping[str, float] | None = None,
    settle_s: float = 10.0,
    settle_max_s: float | None = None,
    backoff: Mapping[str, Backoff] | None = None,
    backoff_policy: BackoffPolicy = BACKOFF_POLICY,
    rollouts: Mapping[str, RolloutControl] | None = None,
    wedged: Mapping[str, str] | None = None,
    settling: bool = False,
    retire_first: Collection[str] = (),
) -> Plan:
    """The actions that bring `shards` toward `desired`.

    `node_states`: node -> ready, unreachable, lost, or anything else for a
    node that is expected but has not registered (all but ready count as away).
    `first_seen`: replica id -> when the control plane first saw or started it.
    `pending`: model -> replicas started but not yet reported by their agent.
    `drain`: draining nodes and what the drain rule needs (llmgw/core/_drain.py).
    `unhealthy_since`: shard id -> when it was first seen unhealthy.
    `guard_held_at`, `ready_since` (node -> when it last became ready),
    `settle_s`, `settle_max_s`: the guard's hysteresis, in the module's rules.
    `backoff`: model -> its restart backoff, under `backoff_policy`.
    `rollouts`: model -> the operator's word and the shell's memory of its rollout.
    `wedged`: replica id -> why a router quarantined it as wedged.
    `retire_first`: replicas to retire first when their model has too many (on nodes
    another model needs, or displaced by a higher priority: the shell says which).
    `settling`: the shell still waits for the known nodes to register after its start or
    an election (llmgw/cp/_fleet/_settle.py): the plan holds as it would, but says nothing
    of being cut off; right after a takeover every node is away only because it has not
    re-registered yet, and the settle's own line says what it waits for.
    """
    pending = pending or {}
    unhealthy_since = unhealthy_since or {}
    wanted = {d.name: d for d in desired}
    by_replica: dict[str, list[ObservedShard]] = {}
    for s in shards:
        if s.replica_id is not None and s.state != ShardState.STOPPED:
            by_replica.setdefault(s.replica_id, []).append(s)

    away = sum(1 for state in node_states.values() if state != NodeState.READY)
    cut_off = bool(node_states) and away * 2 > len(node_states)
    notes: list[str] = []
    holding = cut_off
    if cut_off and not settling:
        notes.append(
            f"{away} of {len(node_states)} nodes are unreachable, lost or not yet registered: "
            "this control plane is probably the one cut off, so nothing is rescheduled"
        )
    elif guard_held_at is not None and away:
        release = guard_release_at(guard_held_at, ready_since or {}, settle_s, settle_max_s)
        if now < release:
            holding = True
            notes.append(
                f"{away} of {len(node_states)} nodes are still away after most of the fleet "
                f"was: nothing is rescheduled for {release - now:.0f} s more, while nodes "
                "coming back report what they run"
            )

    actions: list[Start | Stop] = []
    views: list[ReplicaView] = []
    alive: dict[str, list[tuple[str, ReplicaView]]] = {}
    draining: dict[str, list[ReplicaView]] = {}  # model -> its live replicas on draining nodes

    def stop_all(members: Sequence[ObservedShard], why: str) -> None:
        for s in members:
            if s.node_state == NodeState.READY:  # an unreachable agent cannot be told; later
                actions.append(Stop(s.node_id, s.shard_id, why))

    for replica_id in sorted(by_replica):
        members = sorted(by_replica[replica_id], key=lambda s: s.rank)
        model_name = members[0].model_name or "?"
        d = wanted.get(model_name)
        seen = first_seen.get(replica_id, now)
        state, reason = _replica_state(
            members, d, seen, now, rank_grace_s, unhealthy_since, unhealthy_replace_s
        )
        if wedged and replica_id in wedged and state in ALIVE:
            state, reason = ReplicaState.FAILED, wedged[replica_id]
        stale = d is not None and any(
            s.fingerprint is not None and s.fingerprint not in d.fingerprints for s in members
        )
        view = ReplicaView(
            replica_id, model_name, state, tuple(s.node_id for s in members), seen, stale, reason
        )
        if (
            state in ALIVE
            and drain is not None
            and (set(view.nodes) & set(drain.nodes) or replica_id in drain.replicas)
        ):
            draining.setdefault(model_name, []).append(view)
        elif state in ALIVE:
            alive.setdefault(model_name, []).append((replica_id, view))
        elif state is ReplicaState.LOST and holding:
            alive.setdefault(model_name, []).append((replica_id, view))  # hold on: maybe us
        else:
            stop_all(members, f"replica {replica_id} {state}: {reason}")
        views.append(view)

    steps: list[RolloutStep] = []
    retired: dict[str, tuple[str, str]] = {}  # replica id -> (state, reason), from rollouts
    for d in desired:
        have = alive.get(d.name, [])
        old = [(r, v) for r, v in have if v.stale]
        new = [(r, v) for r, v in have if not v.stale]
        missing = d.replicas - len(have) - pending.get(d.name, 0)
        too_many = have
        control = (rollouts or {}).get(d.name, RolloutControl())
        if old or control.active:
            step = rollout_model(
                d.name, d.replicas,
                [RolloutMember(r, v.state == ReplicaState.READY, v.first_seen) for r, v in old],
                [RolloutMember(r, v.state == ReplicaState.READY, v.first_seen) for r, v in new],
                pending.get(d.name, 0), d.rollout, control,
                drain or DrainInput(), now, holding=holding,
            )  # fmt: skip
            steps.append(step)
            for dec in step.decisions:
                retired[dec.replica_id] = (ReplicaState.RETIRING if dec.retiring else "",
                                           dec.reason)  # fmt: skip
                if dec.stop:
                    stop_all(by_replica[dec.replica_id],
                             f"replica {dec.replica_id} retired: {dec.reason}")  # fmt: skip
            missing, too_many = step.starts, new
        if len(too_many) > d.replicas:
            # Too many: the least advanced first (they serve nothing), then those already
            # retiring (a scale-down walks forward), then those the shell names, then the
            # newest. A replica that serves is retired as a drain retires one (out of the
            # router, stopped once nothing is in flight): scaling down loses no request.
            drained = drain or DrainInput()

            def worst(
                rv: tuple[str, ReplicaView], drained: DrainInput = drained
            ) -> tuple[int, bool, bool, float]:
                r, v = rv
                return (-BEHIND[ReplicaState(v.state)], r not in drained.retiring_since,
                        r not in retire_first, -v.first_seen)  # fmt: skip

            doomed = [r for r, _ in sorted(too_many, key=worst)[: len(too_many) - d.replicas]]
            views_of = dict(too_many)
            for replica_id in sorted(doomed):
                why = f"{d.name} wants {d.replicas} replicas"
                ready = views_of[replica_id].state == ReplicaState.READY
                out = retire(replica_id, ready, drained, now, why, replaced=False)
                if holding and not out.stop:
                    continue  # cut off: keep serving; nothing retires
                if out.stop:
                    stop_all(by_replica[replica_id], f"replica {replica_id} retired: {out.reason}")
                state = ReplicaState.RETIRING if ready else ReplicaState.EXTRA
                retired[replica_id] = (state, out.reason)
        elif missing > 0 and not holding:
            b = (backoff or {}).get(d.name)
            if b is not None:
                trying = pending.get(d.name, 0) + sum(
                    1
                    for _, v in have
                    if v.state == ReplicaState.STARTING and v.first_seen >= b.last_at
                )
                missing = 0 if now < b.next_try_at(backoff_policy) or trying else 1
            actions += [Start(d.name)] * missing
    views = [
        attrs.evolve(v, state=retired[v.replica_id][0] or v.state, reason=retired[v.replica_id][1])
        if v.replica_id in retired
        else v
        for v in views
    ]
    if drain is not None and draining:
        views = _apply_drain(wanted, alive, draining, drain, now, holding, views, stop_all,
                             by_replica)  # fmt: skip
    return Plan(tuple(actions), tuple(views), tuple(notes), cut_off=cut_off, holding=holding,
                rollouts=tuple(steps))  # fmt: skip


# draining (the rule itself is llmgw/core/_drain.py) -----------------------------------------


def _apply_drain(
    wanted: Mapping[str, DesiredModel],
    alive: Mapping[str, list[tuple[str, ReplicaView]]],
    draining: Mapping[str, list[ReplicaView]],
    drain: DrainInput,
    now: float,
    cut_off: bool,
    views: list[ReplicaView],
    stop_all: Callable[[Sequence[ObservedShard], str], None],
    by_replica: Mapping[str, list[ObservedShard]],
) -> list[ReplicaView]:
    decided: dict[str, tuple[str, str]] = {}
    for model_name, mine in sorted(draining.items()):
        d = wanted[model_name]  # a live replica's model is in the catalog
        ready_elsewhere = sum(
            1 for _, v in alive.get(model_name, []) if v.state == ReplicaState.READY
        )
        rows = [
            DrainingReplica(
                v.replica_id,
                v.state == ReplicaState.READY,
                v.first_seen,
                DRAINING if set(v.nodes) & set(drain.nodes) else drain.replicas[v.replica_id],
            )
            for v in mine
        ]
        for dec in drain_model(model_name, d.replicas, ready_elsewhere, rows, drain, now,
                               cut_off=cut_off):  # fmt: skip
            decided[dec.replica_id] = (dec.state, dec.reason)
            if dec.stop:
                why = f"replica {dec.replica_id} retired: {dec.reason}"
                stop_all(by_replica[dec.replica_id], why)
    return [
        attrs.evolve(v, state=decided[v.replica_id][0], reason=decided[v.replica_id][1])
        if v.replica_id in decided
        else v
        for v in views
    ]
