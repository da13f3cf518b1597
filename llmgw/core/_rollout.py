"""Rolling a model onto a new version: a pure rule, one model at a time.

A model's replicas whose profile fingerprint is not one of the catalog's are
`old` (stale); the others are `new`. While any old one is alive, the
reconcile plan hands the model to this rule instead of its count rule. With
`wanted` replicas, `max_surge` S and `max_unavailable` U (defaults 1 and 0):

- starts: new replicas are started while the model has fewer than `wanted`
  new ones, and never more than `wanted + S` live (old, new and pending
  starts together);
- retiring: an old replica that serves nothing (not ready) retires at once;
  ready old ones retire while the ready replicas left serving (ready old ones
  not retiring, plus ready new ones) stay at least `wanted - U`. A retiring
  replica is taken out of the router first and stopped on a later pass at
  zero in flight, or after the drain's timeout (the drain rule's
  `retire`, llmgw/core/_drain.py): a rollout is a drain by version;
- no room: when the last pass could not place a new replica (`no_room`) and
  S > 0 but U = 0, the fleet cannot surge; the rule falls back to one at a
  time (U = 1 for that model) and says so;
- installing: when that pass was refused on some node only because the node is
  still installing the profile's engine at the declared version (`installing`,
  its node ids), the fleet is not out of room: the rule does not fall back,
  old replicas keep serving as the policy says, and the status names the nodes
  it waits for;
- paused (by the operator): nothing new starts beyond keeping the count,
  nothing more retires; what is retiring finishes;
- stopped: after `max_failures` new replicas failed since the rollout began
  the rule stops by itself and says why; old replicas keep serving (none
  retires, a retiring one goes back to serving), starts only keep the count;
- holding (the control plane looks cut off): nothing retires and nothing
  starts beyond the count.

The rollout is done when no old replica is alive and `wanted` new ones are
ready; once it has begun (`active`), the rule applies until then, also after
the last old replica is gone, and a version that fails `max_failures` times
stops it even so. `RolloutRecord` is what the
control plane keeps of one (and the store holds, so that a restart or a
failover continues it): from which fingerprints to which, paused, the failures
counted, why it stopped; `undo` turns it around, back to the previous
fingerprints.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from llmgw.core._drain import DrainInput, retire

ROLLING = "rolled out to a new version"


class RolloutPhase(enum.StrEnum):
    ROLLING = "rolling"
    PAUSED = "paused"
    STOPPED = "stopped"
    DONE = "done"


@attrs.frozen
class RolloutPolicy:
    """A model's `rollout:` in the catalog."""

    max_surge: int = 1
    max_unavailable: int = 0
    max_failures: int = 3


@attrs.frozen
class RolloutControl:
    """What the plan needs beyond the fleet: the operator's word and the shell's memory."""

    paused: bool = False
    failures: int = 0  # new replicas that failed since the rollout began
    no_room: bool = False  # the last pass could not place a new replica of the model
    active: bool = False  # a rollout is under way: the rule applies even with no old replica
    # Of that refusal, the nodes refused only because they are installing the profile's
    # engine at the declared version: the rollout waits for them instead of falling back.
    installing: tuple[str, ...] = ()


@attrs.frozen
class RolloutMember:
    replica_id: str
    ready: bool
    first_seen: float


@attrs.frozen
class RolloutDecision:
    replica_id: str
    retiring: bool  # taken out of the router (and stopped when `stop`); else kept as it is
    stop: bool
    reason: str


@attrs.frozen
class RolloutStep:
    model_name: str
    phase: RolloutPhase
    starts: int
    decisions: tuple[RolloutDecision, ...]  # one per old replica, in the order given
    status: str  # in the operator's words


def _keep(r: RolloutMember, why: str) -> RolloutDecision:
    return RolloutDecision(r.replica_id, retiring=False, stop=False, reason=why)


def _retire(r: RolloutMember, drain: DrainInput, now: float) -> RolloutDecision:
    d = retire(r.replica_id, r.ready, drain, now, ROLLING)
    return RolloutDecision(r.replica_id, retiring=True, stop=d.stop, reason=d.reason)


def rollout_model(
    model_name: str,
    wanted: int,
    old: Sequence[RolloutMember],
    new: Sequence[RolloutMember],
    pending_new: int,
    policy: RolloutPolicy,
    control: RolloutControl,
    drain: DrainInput,
    now: float,
    *,
    holding: bool = False,
) -> RolloutStep:
    """One pass of the rule (the module's docstring) for `model_name`."""
    live = len(old) + len(new) + pending_new
    keep_count = max(0, wanted - live)
    new_ready = sum(1 for r in new if r.ready)
    counts = f"{len(new)} of {wanted} new ({new_ready} ready), {len(old)} old left" + (
        f", {pending_new} starting" if pending_new else ""
    )
    failed = control.failures >= policy.max_failures
    installing = (
        f"; waiting for the engine to be installed on {_nodes(control.installing)}"
        if control.installing
        else ""
    )
    if not old and not failed:
        starts = max(0, wanted - len(new) - pending_new)
        if new_ready >= wanted:
            return RolloutStep(model_name, RolloutPhase.DONE, starts, (), f"done: {counts}")
        # Every old one is gone (max_unavailable let them go): it ends when the new are ready.
        why = f"rolling: {counts}; waiting for the new replicas to be ready{installing}"
        return RolloutStep(model_name, RolloutPhase.ROLLING, starts, (), why)

    if failed:
        why = (
            f"stopped: {control.failures} new replicas failed (the limit is "
            f"{policy.max_failures}); "
            + ("the old ones keep serving" if old else
               f"no old replica is left: `llmgw ctl rollout undo {model_name}` goes back")
        )  # fmt: skip
        decisions = [_keep(r, why) for r in old]
        return RolloutStep(model_name, RolloutPhase.STOPPED, keep_count, tuple(decisions),
                           f"{why}; {counts}")  # fmt: skip

    if control.paused or holding:
        phase = RolloutPhase.PAUSED if control.paused else RolloutPhase.ROLLING
        why = (
            "paused by an operator"
            if control.paused
            else "held: this control plane looks cut off from most of the fleet"
        )
        decisions = [
            _retire(r, drain, now)
            if r.replica_id in drain.retiring_since and not holding
            else _keep(r, why)
            for r in old
        ]
        return RolloutStep(model_name, phase, keep_count, tuple(decisions), f"{why}; {counts}")

    unavailable = policy.max_unavailable
    fallback = installing
    no_room = control.no_room and not control.installing  # installs end by themselves
    if no_room and policy.max_surge > 0 and unavailable == 0:
        unavailable = 1
        fallback = "; the fleet has no room for an extra replica, so one at a time"
    starts = max(0, min(wanted + policy.max_surge - live, wanted - len(new) - pending_new))
    old_ready = sum(1 for r in old if r.ready)
    may_retire_ready = max(0, old_ready + new_ready - max(0, wanted - unavailable))

    def priority(r: RolloutMember) -> tuple[bool, float, float, str]:
        # Already retiring first (a rollout walks forward), then the oldest.
        since = drain.retiring_since.get(r.replica_id)
        return (since is None, since or 0.0, r.first_seen, r.replica_id)

    ready_old = sorted((r for r in old if r.ready), key=priority)
    chosen = {r.replica_id for r in ready_old[:may_retire_ready]}
    why = (
        f"{ROLLING}; kept until a new replica is ready ({new_ready} ready, "
        f"{model_name} wants {wanted}, at most {unavailable} unavailable){fallback}"
    )
    decisions = [
        _retire(r, drain, now) if not r.ready or r.replica_id in chosen else _keep(r, why)
        for r in old
    ]
    status = (
        f"rolling: {counts}; at most {policy.max_surge} extra, {unavailable} unavailable{fallback}"
    )
    return RolloutStep(model_name, RolloutPhase.ROLLING, starts, tuple(decisions), status)


def _nodes(ids: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(ids[:most])
    more = len(ids) - most
    return shown + (f" and {more} more" if more > 0 else "")


@attrs.frozen
class RolloutRecord:
    """One model's rollout, as the control plane keeps it (and the store holds it)."""

    model_name: str
    to: tuple[str, ...]  # the fingerprints rolled to
    previous: tuple[str, ...]  # the fingerprints rolled from (undo goes back to them)
    started_at: float  # wall clock
    paused: bool = False
    failures: int = 0
    undone: bool = False  # turned back by `undo`: `to` is the earlier version
    finished_at: float | None = None
    phase: str = RolloutPhase.ROLLING
    status: str = ""

    def undo(self, now: float) -> RolloutRecord:
        """Back to the previous fingerprints: a rollout of its own, from zero failures."""
        return RolloutRecord(
            self.model_name,
            to=self.previous,
            previous=self.to,
            started_at=now,
            undone=not self.undone,
        )
