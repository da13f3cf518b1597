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
  `rank_grace_s`, or not ready within its profile's startup timeout (counted
  from when it was first seen; progress does not reset it): stopped and
  replaced;
- a replica with a rank on an unreachable node: left alone, and counted;
- more replicas than wanted: the least advanced, then the newest, stopped;
- fewer: a Start per missing replica;
- more than half the fleet unreachable or lost at once: nothing is
  rescheduled (the control plane is the one cut off), and the plan says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs


@attrs.frozen
class DesiredModel:
    name: str
    replicas: int
    fingerprints: tuple[str, ...]  # of its profiles; a replica with another one is stale
    startup_timeout_s: Mapping[str, float] = attrs.field(factory=dict)  # per fingerprint


@attrs.frozen
class ObservedShard:
    node_id: str
    node_state: str  # ready, unreachable, lost
    shard_id: str
    state: str  # starting, loading, ready, failed, stopped
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
    state: str  # ready, starting, unreachable, failed, timed-out, lost, incomplete, removed, extra
    nodes: tuple[str, ...]
    first_seen: float
    stale: bool
    reason: str | None


@attrs.frozen
class Plan:
    actions: tuple[Start | Stop, ...]
    replicas: tuple[ReplicaView, ...]
    notes: tuple[str, ...] = ()


ALIVE = ("ready", "starting", "unreachable")


def _replica_state(
    shards: Sequence[ObservedShard],
    desired: DesiredModel | None,
    first_seen: float,
    now: float,
    rank_grace_s: float,
) -> tuple[str, str | None]:
    if desired is None:
        return "removed", "its model left the catalog"
    for s in shards:
        if s.node_state == "lost":
            return "lost", f"node {s.node_id} is lost"
    for s in shards:
        if s.state == "failed":
            return "failed", f"rank {s.rank} on {s.node_id} failed: {s.reason or 'no reason given'}"
    ranks = max(s.ranks for s in shards)
    if len({s.rank for s in shards}) < ranks and now - first_seen > rank_grace_s:
        present = sorted({s.rank for s in shards})
        return "incomplete", f"only ranks {present} of {ranks} are running"
    if any(s.node_state == "unreachable" for s in shards):
        return "unreachable", "a node of it is unreachable; left alone until it is lost"
    if all(s.state == "ready" for s in shards) and len(shards) >= ranks:
        return "ready", None
    fingerprint = shards[0].fingerprint
    timeout = desired.startup_timeout_s.get(fingerprint or "", None)
    if timeout is not None and now - first_seen > timeout:
        return "timed-out", f"not ready within its startup timeout of {timeout:g} s"
    return "starting", None


def reconcile(
    desired: Sequence[DesiredModel],
    shards: Sequence[ObservedShard],
    node_states: Mapping[str, str],
    first_seen: Mapping[str, float],
    now: float,
    *,
    pending: Mapping[str, int] | None = None,
    rank_grace_s: float = 60.0,
) -> Plan:
    """The actions that bring `shards` toward `desired`.

    `first_seen`: replica id -> when the control plane first saw or started it.
    `pending`: model -> replicas started but not yet reported by their agent.
    """
    pending = pending or {}
    wanted = {d.name: d for d in desired}
    by_replica: dict[str, list[ObservedShard]] = {}
    for s in shards:
        if s.replica_id is not None and s.state != "stopped":
            by_replica.setdefault(s.replica_id, []).append(s)

    away = sum(1 for state in node_states.values() if state != "ready")
    cut_off = bool(node_states) and away * 2 > len(node_states)
    notes: list[str] = []
    if cut_off:
        notes.append(
            f"{away} of {len(node_states)} nodes are unreachable or lost: this control plane "
            "is probably the one cut off, so nothing is rescheduled"
        )

    actions: list[Start | Stop] = []
    views: list[ReplicaView] = []
    alive: dict[str, list[tuple[str, ReplicaView]]] = {}

    def stop_all(members: Sequence[ObservedShard], why: str) -> None:
        for s in members:
            if s.node_state == "ready":  # an unreachable agent cannot be told; later
                actions.append(Stop(s.node_id, s.shard_id, why))

    for replica_id in sorted(by_replica):
        members = sorted(by_replica[replica_id], key=lambda s: s.rank)
        model_name = members[0].model_name or "?"
        d = wanted.get(model_name)
        seen = first_seen.get(replica_id, now)
        state, reason = _replica_state(members, d, seen, now, rank_grace_s)
        stale = d is not None and any(
            s.fingerprint is not None and s.fingerprint not in d.fingerprints for s in members
        )
        view = ReplicaView(
            replica_id, model_name, state, tuple(s.node_id for s in members), seen, stale, reason
        )
        if state in ALIVE:
            alive.setdefault(model_name, []).append((replica_id, view))
        elif state == "lost" and cut_off:
            alive.setdefault(model_name, []).append((replica_id, view))  # hold on: maybe us
        else:
            stop_all(members, f"replica {replica_id} {state}: {reason}")
        views.append(view)

    order = {"ready": 0, "unreachable": 1, "lost": 1, "starting": 2}
    for d in desired:
        have = alive.get(d.name, [])
        if len(have) > d.replicas:
            # The least advanced first, then the newest.
            worst = sorted(have, key=lambda rv: (-order[rv[1].state], -rv[1].first_seen))
            doomed = {replica_id for replica_id, _ in worst[: len(have) - d.replicas]}
            for replica_id in sorted(doomed):
                stop_all(by_replica[replica_id], f"{d.name} wants {d.replicas} replicas")
            views = [
                attrs.evolve(v, state="extra", reason=f"{d.name} wants {d.replicas} replicas")
                if v.replica_id in doomed
                else v
                for v in views
            ]
        elif len(have) + pending.get(d.name, 0) < d.replicas and not cut_off:
            actions += [Start(d.name)] * (d.replicas - len(have) - pending.get(d.name, 0))
    return Plan(tuple(actions), tuple(views), tuple(notes))
