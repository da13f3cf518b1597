"""The rollout rule (llmgw/core/_rollout.py), through the reconcile plan that applies it.

The properties drive a small simulated fleet pass by pass: the plan's starts
become new replicas that load for a few passes (or fail, for a broken
version), its stops remove replicas, the router's in-flight counts are drawn,
and a fleet without room refuses the starts that would not fit.
"""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import (
    DesiredModel,
    DrainInput,
    ObservedShard,
    RolloutControl,
    RolloutMember,
    RolloutPhase,
    RolloutPolicy,
    RolloutRecord,
    Start,
    Stop,
    reconcile,
    rollout_model,
)

OLD, NEW = "fp-old", "fp-new"


@attrs.define
class Sim:
    wanted: int
    policy: RolloutPolicy
    target: tuple[str, ...] = (NEW,)
    capacity: int | None = None  # replicas the fleet can hold; None: room for any
    broken: frozenset[str] = frozenset()  # fingerprints that never become ready
    replicas: dict[str, list] = attrs.field(factory=dict)  # id -> [fp, passes to ready]
    retiring_since: dict[str, float] = attrs.field(factory=dict)
    failures: int = 0
    counted: set[str] = attrs.field(factory=set)
    no_room: bool = False
    installing: int = 0  # starts refused before every node has installed the new engine
    waiting: bool = False  # the last pass was refused only by nodes installing it
    paused: bool = False
    now: float = 0.0
    made: int = 0
    history: list = attrs.field(factory=list)

    def add(self, fp: str, load: int) -> None:
        self.made += 1
        self.replicas[f"r{self.made}"] = [fp, load]

    def shards(self) -> list[ObservedShard]:
        out = []
        for rid, (fp, load) in sorted(self.replicas.items()):
            if fp in self.broken and load <= 0:
                state, why = "failed", "the engine exited"
            else:
                state, why = ("ready" if load <= 0 else "loading"), None
            out.append(ObservedShard("n1", "ready", f"{rid}-0", state, rid, "m", 0, 1, fp, why))
        return out

    def step(self, in_flight: dict[str, int]) -> object:
        desired = DesiredModel("m", self.wanted, self.target, {f: 1e9 for f in self.target},
                               rollout=self.policy)  # fmt: skip
        drain = DrainInput((), in_flight, dict(self.retiring_since), 300.0)
        control = RolloutControl(paused=self.paused, failures=self.failures,
                                 no_room=self.no_room, active=True,
                                 installing=("n1",) if self.waiting else ())  # fmt: skip
        seen = {rid: 0.0 for rid in self.replicas}
        plan = reconcile([desired], self.shards(), {"n1": "ready"}, seen, self.now, drain=drain,
                         rollouts={"m": control})  # fmt: skip
        for v in plan.replicas:
            if v.state == "failed" and v.replica_id not in self.counted:
                self.counted.add(v.replica_id)
                self.failures += 1
        stopped = {a.shard_id.rsplit("-", 1)[0] for a in plan.actions if isinstance(a, Stop)}
        for rid in stopped:
            del self.replicas[rid]
        self.retiring_since = {
            v.replica_id: self.retiring_since.get(v.replica_id, self.now)
            for v in plan.replicas
            if v.state == "retiring" and v.replica_id not in stopped
        }
        starts = sum(1 for a in plan.actions if isinstance(a, Start))
        room = starts if self.capacity is None else max(0, self.capacity - len(self.replicas))
        self.no_room = starts > room
        self.waiting = False
        if self.installing > 0 and starts:  # nothing can be placed, not for want of room
            self.installing -= 1
            # Refused everywhere (no_room), but only by nodes installing the engine.
            room, self.no_room, self.waiting = 0, True, True
        for _ in range(min(starts, room)):
            self.add(self.target[0], 1 + self.made % 3)
        for r in self.replicas.values():
            r[1] -= 1
        self.now += 1.0
        self.history.append(plan)
        return plan

    def serving(self) -> int:
        return sum(
            1
            for rid, (fp, load) in self.replicas.items()
            if load <= 0 and fp not in self.broken and rid not in self.retiring_since
        )


policies = st.builds(
    RolloutPolicy,
    max_surge=st.integers(0, 3),
    max_unavailable=st.integers(0, 2),
    max_failures=st.integers(1, 4),
).filter(lambda p: p.max_surge + p.max_unavailable > 0)


def fleet(wanted: int, policy: RolloutPolicy, **kw: object) -> Sim:
    sim = Sim(wanted, policy, **kw)  # type: ignore[arg-type]
    for _ in range(wanted):
        sim.add(OLD, 0)
    return sim


def run(sim: Sim, data: st.DataObject, passes: int = 200) -> RolloutPhase:
    """Pass after pass until the rollout is done or stopped, checking the bounds each pass."""
    for _ in range(passes):
        before = sim.serving()
        flying = {rid: data.draw(st.sampled_from([0, 0, 1]), label="in flight")
                  for rid in sim.replicas}  # fmt: skip
        plan = sim.step(flying)
        steps = plan.rollouts
        phase = steps[0].phase if steps else RolloutPhase.DONE
        unavailable = sim.policy.max_unavailable
        if (sim.no_room and not sim.waiting) or any("no room" in s.status for s in steps):
            unavailable = max(unavailable, 1)
        # Live: what runs plus what is being started, never more than max_surge extra.
        assert len(sim.replicas) <= sim.wanted + sim.policy.max_surge, plan
        # Ready and routed: never fewer than wanted - max_unavailable (it started at wanted,
        # and nothing that was ready fails in this simulation).
        floor = sim.wanted - unavailable
        assert sim.serving() >= min(floor, before), (sim.serving(), floor, plan)
        if phase in (RolloutPhase.DONE, RolloutPhase.STOPPED):
            return phase
    raise AssertionError(f"the rollout did not end in {passes} passes: {sim.history[-1]}")


@settings(max_examples=150, deadline=None)
@given(wanted=st.integers(1, 6), policy=policies, data=st.data())
def test_a_rollout_keeps_its_bounds_and_ends_with_every_replica_new(
    wanted: int, policy: RolloutPolicy, data: st.DataObject
) -> None:
    sim = fleet(wanted, policy)
    assert run(sim, data) is RolloutPhase.DONE
    for _ in range(6):  # the last new ones finish loading
        sim.step({})
    assert sorted(fp for fp, _ in sim.replicas.values()) == [NEW] * wanted
    assert sim.serving() == wanted


@settings(max_examples=100, deadline=None)
@given(wanted=st.integers(1, 5), policy=policies, data=st.data())
def test_a_fleet_without_room_rolls_one_at_a_time_and_says_so(
    wanted: int, policy: RolloutPolicy, data: st.DataObject
) -> None:
    sim = fleet(wanted, policy, capacity=wanted)
    assert run(sim, data) is RolloutPhase.DONE
    statuses = [s.status for p in sim.history for s in p.rollouts]
    if policy.max_unavailable == 0:
        assert any("no room for an extra replica, so one at a time" in s for s in statuses)


@settings(max_examples=100, deadline=None)
@given(wanted=st.integers(1, 5), policy=policies, install=st.integers(1, 12), data=st.data())
def test_while_the_nodes_install_the_new_engine_nothing_falls_back_and_the_status_says_so(
    wanted: int, policy: RolloutPolicy, install: int, data: st.DataObject
) -> None:
    # `run` holds the ready replicas to wanted - max_unavailable on every pass while the
    # refusals are only the nodes' installs: the one-at-a-time fallback never fires.
    sim = fleet(wanted, policy, installing=install)
    assert run(sim, data) is RolloutPhase.DONE
    waited = [s.status for p in sim.history for s in p.rollouts
              if "waiting for the engine" in s.status]  # fmt: skip
    assert waited and all(
        s.endswith("waiting for the engine to be installed on n1") for s in waited
    )
    assert all("no room" not in s.status for p in sim.history for s in p.rollouts), (
        "the fallback fired while the nodes installed"
    )


def test_installing_keeps_the_only_replica_that_no_room_would_retire() -> None:
    policy = RolloutPolicy()  # surge 1, unavailable 0
    old = [RolloutMember("a", True, 0.0)]
    drain = DrainInput((), {}, {}, 300.0)
    no_room = rollout_model("m", 1, old, [], 0, policy, RolloutControl(no_room=True), drain, 1.0)
    assert [d.retiring for d in no_room.decisions] == [True]  # the fallback: one at a time
    installing = RolloutControl(no_room=True, installing=("n1", "n2", "n3", "n4"))
    waits = rollout_model("m", 1, old, [], 0, policy, installing, drain, 1.0)
    assert [d.retiring for d in waits.decisions] == [False]
    assert waits.starts == 1
    assert waits.status == (
        "rolling: 0 of 1 new (0 ready), 1 old left; at most 1 extra, 0 unavailable; waiting "
        "for the engine to be installed on n1, n2, n3 and 1 more"
    )


@settings(max_examples=100, deadline=None)
@given(wanted=st.integers(1, 5), policy=policies, data=st.data())
def test_a_version_that_never_becomes_ready_stops_the_rollout_and_the_old_ones_serve(
    wanted: int, policy: RolloutPolicy, data: st.DataObject
) -> None:
    sim = fleet(wanted, policy, broken=frozenset({NEW}))
    assert run(sim, data, passes=400) is RolloutPhase.STOPPED
    last = sim.history[-1].rollouts[0]
    assert last.status.startswith("stopped: ")
    assert f"new replicas failed (the limit is {policy.max_failures})" in last.status
    # Stopped with the old ones serving: at least wanted - max_unavailable of them,
    # and none of them is taken out of the router any more.
    old = [rid for rid, (fp, _) in sim.replicas.items() if fp == OLD]
    assert len(old) >= wanted - policy.max_unavailable
    sim.step({})
    assert not sim.retiring_since


@settings(max_examples=100, deadline=None)
@given(wanted=st.integers(1, 5), policy=policies, halfway=st.integers(0, 8), data=st.data())
def test_undo_goes_back_to_the_previous_fingerprint(
    wanted: int, policy: RolloutPolicy, halfway: int, data: st.DataObject
) -> None:
    record = RolloutRecord("m", to=(NEW,), previous=(OLD,), started_at=0.0)
    sim = fleet(wanted, policy)
    for _ in range(halfway):
        sim.step({rid: 0 for rid in sim.replicas})
    back = record.undo(now=50.0)
    assert (back.to, back.previous, back.undone, back.failures) == ((OLD,), (NEW,), True, 0)
    sim.target = back.to
    sim.failures = 0
    run(sim, data)
    for _ in range(6):
        sim.step({})
    assert sorted(fp for fp, _ in sim.replicas.values()) == [OLD] * wanted
    assert back.undo(now=60.0).to == (NEW,)  # and undoing the undo rolls forward again


def member(rid: str, ready: bool = True) -> RolloutMember:
    return RolloutMember(rid, ready, 0.0)


def test_the_defaults_surge_one_and_retire_only_once_the_new_one_is_ready() -> None:
    policy, control, drain = RolloutPolicy(), RolloutControl(), DrainInput()
    old = [member("a"), member("b")]
    step = rollout_model("m", 2, old, [], 0, policy, control, drain, 0.0)
    assert (step.phase, step.starts) == (RolloutPhase.ROLLING, 1)
    assert [d.retiring for d in step.decisions] == [False, False]
    assert "kept until a new replica is ready (0 ready, m wants 2" in step.decisions[0].reason
    loading = rollout_model("m", 2, old, [member("c", ready=False)], 0, policy, control, drain, 1.0)
    assert (loading.starts, [d.retiring for d in loading.decisions]) == (0, [False, False])
    ready = rollout_model("m", 2, old, [member("c")], 0, policy, control, drain, 2.0)
    # The first retiring pass takes it out of the router; it stops on a later one.
    assert [(d.retiring, d.stop) for d in ready.decisions] == [(True, False), (False, False)]
    later = DrainInput(in_flight={"a": 0}, retiring_since={"a": 2.0})
    gone = rollout_model("m", 2, old, [member("c")], 0, policy, control, later, 3.0)
    assert [(d.retiring, d.stop) for d in gone.decisions] == [(True, True), (False, False)]
    assert "no request is in flight" in gone.decisions[0].reason


def test_paused_starts_nothing_new_and_lets_the_retiring_one_finish() -> None:
    old = [member("a"), member("b")]
    drain = DrainInput(in_flight={"a": 0}, retiring_since={"a": 1.0})
    step = rollout_model("m", 2, old, [member("c")], 0, RolloutPolicy(),
                         RolloutControl(paused=True), drain, 5.0)  # fmt: skip
    assert (step.phase, step.starts) == (RolloutPhase.PAUSED, 0)
    assert [(d.retiring, d.stop) for d in step.decisions] == [(True, True), (False, False)]
    assert step.decisions[1].reason == "paused by an operator"
    assert step.status.startswith("paused by an operator; 1 of 2 new (1 ready), 2 old left")


def test_a_stopped_rollout_keeps_the_count_with_the_old_ones() -> None:
    step = rollout_model("m", 3, [member("a"), member("b")], [], 0, RolloutPolicy(),
                         RolloutControl(failures=3), DrainInput(), 0.0)  # fmt: skip
    assert step.phase is RolloutPhase.STOPPED
    assert step.starts == 1  # one short of 3: kept at the count, not surged
    assert not any(d.retiring for d in step.decisions)
