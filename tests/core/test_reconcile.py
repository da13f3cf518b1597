from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core._reconcile import DesiredModel, ObservedShard, Start, Stop, reconcile

QWEN = DesiredModel("qwen", 2, ("fp1",), {"fp1": 600.0})


def shard(
    replica: str,
    node: str = "n1",
    state: str = "ready",
    rank: int = 0,
    ranks: int = 1,
    node_state: str = "ready",
    model: str = "qwen",
    fp: str = "fp1",
) -> ObservedShard:
    return ObservedShard(
        node, node_state, f"{replica}-{rank}", state, replica, model, rank, ranks, fp
    )


def test_missing_replicas_are_started_and_running_ones_adopted() -> None:
    plan = reconcile([QWEN], [shard("r1")], {"n1": "ready"}, {"r1": 0.0}, 10.0)
    assert plan.actions == (Start("qwen"),)
    assert [(v.replica_id, v.state, v.stale) for v in plan.replicas] == [("r1", "ready", False)]


def test_pending_starts_are_not_started_twice() -> None:
    plan = reconcile([QWEN], [shard("r1")], {"n1": "ready"}, {}, 10.0, pending={"qwen": 1})
    assert plan.actions == ()


def test_failed_replica_is_stopped_and_replaced() -> None:
    shards = [shard("r1"), shard("r2", state="failed")]
    plan = reconcile([QWEN], shards, {"n1": "ready"}, {}, 10.0)
    assert (
        Stop("n1", "r2-0", "replica r2 failed: rank 0 on n1 failed: no reason given")
        in plan.actions
    )
    assert plan.actions.count(Start("qwen")) == 1


def test_startup_timeout_counts_from_first_seen() -> None:
    shards = [shard("r1"), shard("r2", state="loading")]
    assert reconcile([QWEN], shards, {"n1": "ready"}, {"r2": 0.0}, 599.0).actions == ()
    plan = reconcile([QWEN], shards, {"n1": "ready"}, {"r2": 0.0}, 601.0)
    assert Start("qwen") in plan.actions
    assert any(isinstance(a, Stop) and "startup timeout of 600 s" in a.reason for a in plan.actions)


def test_model_left_the_catalog_is_stopped_and_hand_started_shards_left_alone() -> None:
    manual = ObservedShard("n1", "ready", "by-hand", "ready", None, None, 0, 1, None)
    plan = reconcile([], [shard("r1"), manual], {"n1": "ready"}, {}, 1.0)
    assert plan.actions == (Stop("n1", "r1-0", "replica r1 removed: its model left the catalog"),)


def test_unreachable_left_alone_until_lost() -> None:
    nodes = {"n1": "unreachable", "n2": "ready", "n3": "ready"}
    shards = [shard("r1", "n1", node_state="unreachable"), shard("r2", "n2")]
    assert reconcile([QWEN], shards, nodes, {}, 1.0).actions == ()
    nodes["n1"] = "lost"
    shards[0] = shard("r1", "n1", node_state="lost")
    assert reconcile([QWEN], shards, nodes, {}, 1.0).actions == (Start("qwen"),)


def test_cut_off_control_plane_reschedules_nothing_and_says_so() -> None:
    nodes = {"n1": "lost", "n2": "lost", "n3": "ready"}
    shards = [shard("r1", "n1", node_state="lost"), shard("r2", "n2", node_state="lost")]
    plan = reconcile([QWEN], shards, nodes, {}, 1.0)
    assert plan.actions == ()
    assert "nothing is rescheduled" in plan.notes[0]


def test_while_settling_a_fleet_not_yet_back_holds_without_saying_cut_off() -> None:
    nodes = {"n1": "absent", "n2": "absent", "n3": "ready"}
    shards = [shard("r1", "n1", node_state="absent"), shard("r2", "n2", node_state="absent")]
    plan = reconcile([QWEN], shards, nodes, {}, 1.0, settling=True)
    assert plan.actions == () and plan.cut_off and plan.holding
    assert not any("cut off" in n for n in plan.notes), plan.notes


def test_extras_stop_least_advanced_then_newest() -> None:
    shards = [shard("old"), shard("new"), shard("loading", state="loading")]
    plan = reconcile([QWEN], shards, {"n1": "ready"}, {"old": 1.0, "new": 5.0, "loading": 0.0}, 9.0)
    assert [a.shard_id for a in plan.actions if isinstance(a, Stop)] == ["loading-0"]


def test_changed_profile_shows_stale_keeps_serving_and_starts_its_replacement() -> None:
    changed = DesiredModel("qwen", 1, ("fp2",), {"fp2": 600.0})
    plan = reconcile([changed], [shard("r1", fp="fp1")], {"n1": "ready"}, {}, 1.0)
    assert plan.actions == (Start("qwen"),)  # the rollout's surge of one
    assert (plan.replicas[0].stale, plan.replicas[0].state) == (True, "ready")
    assert plan.rollouts[0].status.startswith("rolling: 0 of 1 new (0 ready), 1 old left")


def test_multinode_rank_missing_after_grace_is_incomplete() -> None:
    shards = [shard("r1", rank=0, ranks=2)]
    assert (
        reconcile([QWEN], shards, {"n1": "ready"}, {"r1": 0.0}, 30.0, pending={"qwen": 1}).actions
        == ()
    )
    plan = reconcile([QWEN], shards, {"n1": "ready"}, {"r1": 0.0}, 61.0, pending={"qwen": 1})
    assert plan.replicas[0].state == "incomplete"


states = st.sampled_from(["starting", "loading", "ready", "failed"])
node_states = st.sampled_from(["ready", "unreachable", "lost"])


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), states, node_states), max_size=12),
    st.integers(0, 4),
)
def test_never_more_starts_than_missing_and_never_stops_unreachable(rows, wanted) -> None:
    d = DesiredModel("qwen", wanted, ("fp1",), {"fp1": 100.0})
    nodes: dict[str, str] = {}
    shards = []
    for replica, node, state, nstate in rows:
        nodes.setdefault(f"n{node}", nstate)
        shards.append(shard(f"r{replica}-{node}", f"n{node}", state, node_state=nodes[f"n{node}"]))
    plan = reconcile([d], shards, nodes, {}, 50.0)
    starts = sum(isinstance(a, Start) for a in plan.actions)
    alive = sum(v.state in ("ready", "starting", "unreachable") for v in plan.replicas)
    assert starts <= max(0, wanted - alive)
    for a in plan.actions:
        if isinstance(a, Stop):
            assert nodes[a.node_id] == "ready"


# Unhealthy shards ------------------------------------------------------------------------


def test_unhealthy_replica_is_kept_within_its_bound_then_replaced() -> None:
    one = DesiredModel("qwen", 1, ("fp1",), {"fp1": 600.0})
    sick = ObservedShard(
        "n1", "ready", "r1-0", "unhealthy", "r1", "qwen", 0, 1, "fp1", "/health failed 3 times"
    )
    within = reconcile(
        [one], [sick], {"n1": "ready"}, {"r1": 0.0}, 100.0,
        unhealthy_since={"r1-0": 80.0}, unhealthy_replace_s=30.0,
    )  # fmt: skip
    assert within.actions == ()
    assert within.replicas[0].state == "unhealthy"
    assert "/health failed 3 times" in (within.replicas[0].reason or "")
    past = reconcile(
        [one], [sick], {"n1": "ready"}, {"r1": 0.0}, 111.0,
        unhealthy_since={"r1-0": 80.0}, unhealthy_replace_s=30.0,
    )  # fmt: skip
    assert past.actions == (
        Stop(
            "n1",
            "r1-0",
            "replica r1 failed: rank 0 on n1 is unhealthy: /health failed 3 times; "
            "for 31 s, longer than 30 s",
        ),
        Start("qwen"),
    )


def test_unhealthy_extra_is_the_one_stopped() -> None:
    one = DesiredModel("qwen", 1, ("fp1",), {"fp1": 600.0})
    shards = [shard("good"), shard("sick", state="unhealthy")]
    plan = reconcile([one], shards, {"n1": "ready"}, {"good": 5.0, "sick": 1.0}, 10.0)
    assert [a.shard_id for a in plan.actions if isinstance(a, Stop)] == ["sick-0"]


# The guard and its hysteresis ------------------------------------------------------------

FLEET = ("n0", "n1", "n2", "n3")
ONE_EACH = DesiredModel("qwen", 4, ("fp1",), {"fp1": 600.0})


def on_each(states: dict[str, str]) -> list[ObservedShard]:
    return [shard(f"r-{n}", n, node_state=states[n]) for n in FLEET]


def test_guard_holds_after_the_fleet_comes_back_until_the_last_return_settles() -> None:
    # 3 of 4 were lost (the guard held at t=10); n1 is back at 11, n2 at 12; n3 stays lost.
    states = {"n0": "ready", "n1": "ready", "n2": "ready", "n3": "lost"}
    since = {"n0": 0.0, "n1": 11.0, "n2": 12.0}

    def at(now: float):
        return reconcile(
            [ONE_EACH], on_each(states), states, {}, now,
            guard_held_at=10.0, ready_since=since, settle_s=3.0,
        )  # fmt: skip

    held = at(14.9)
    assert held.actions == () and held.holding and not held.cut_off
    assert "nothing is rescheduled for 0 s more" in held.notes[0]
    assert [v.state for v in held.replicas if v.replica_id == "r-n3"] == ["lost"]
    # Settled: n3 is the normal lost case, its replica replaced.
    assert at(15.1).actions == (Start("qwen"),)
    assert not at(15.1).holding


def test_guard_lets_go_at_once_when_every_node_is_back() -> None:
    states = dict.fromkeys(FLEET, "ready")
    plan = reconcile(
        [ONE_EACH], on_each(states), states, {}, 10.5,
        guard_held_at=10.0, ready_since=dict.fromkeys(FLEET, 10.2), settle_s=3.0,
    )  # fmt: skip
    assert plan.actions == () and not plan.holding


def test_guard_hysteresis_is_capped() -> None:
    # Nodes keep coming back (and going again): the window never passes the cap.
    states = {"n0": "ready", "n1": "ready", "n2": "ready", "n3": "lost"}
    plan = reconcile(
        [ONE_EACH], on_each(states), states, {}, 28.1,
        guard_held_at=10.0, ready_since={"n0": 27.0, "n1": 28.0}, settle_s=3.0,
    )  # fmt: skip
    assert plan.actions == (Start("qwen"),)  # 10 + 6 x 3 = 28: held no longer


def test_no_guard_history_is_the_normal_lost_case() -> None:
    states = {"n0": "ready", "n1": "ready", "n2": "ready", "n3": "lost"}
    plan = reconcile([ONE_EACH], on_each(states), states, {}, 5.0, settle_s=3.0)
    assert plan.actions == (Start("qwen"),) and not plan.holding


class GuardSim:
    """The pure plan, with the two facts the shell keeps: when the guard last held, and
    when each node last became ready."""

    def __init__(self, nodes: int, settle_s: float) -> None:
        self.nodes = [f"n{i}" for i in range(nodes)]
        self.states = dict.fromkeys(self.nodes, "ready")
        self.ready_since = dict.fromkeys(self.nodes, 0.0)
        self.held_at: float | None = None
        self.settle_s = settle_s
        self.desired = DesiredModel("qwen", nodes, ("fp1",), {"fp1": 1e9})
        self.actions: list[tuple[float, object]] = []

    def plan(self, now: float) -> None:
        shards = [shard(f"r-{n}", n, node_state=self.states[n]) for n in self.nodes]
        plan = reconcile(
            [self.desired], shards, self.states, {}, now,
            guard_held_at=self.held_at, ready_since=dict(self.ready_since),
            settle_s=self.settle_s, settle_max_s=1e9,
        )  # fmt: skip
        if plan.cut_off:
            self.held_at = now
        self.actions += [(now, a) for a in plan.actions]

    def set(self, node: str, state: str, now: float) -> None:
        if state == "ready" and self.states[node] != "ready":
            self.ready_since[node] = now
        self.states[node] = state


SETTLE = 3.0
away_state = st.sampled_from(["unreachable", "lost"])


@st.composite
def partitions(draw: st.DrawFn) -> tuple[int, list[str], list[tuple]]:
    """Most of a fleet goes away at once; then, round after round, a node may go away
    (again) and an away node comes back, each return within SETTLE of the previous one
    (a leave between two returns included); the last away nodes come back the same way."""
    n = draw(st.integers(2, 7))
    gone = draw(st.lists(st.integers(0, n - 1), min_size=n // 2 + 1, max_size=n, unique=True))
    initial = [draw(away_state) for _ in gone]
    rounds = draw(
        st.lists(
            st.tuples(
                st.none() | st.tuples(st.integers(0, n - 1), away_state),  # who leaves, how
                st.floats(0, SETTLE * 0.45),  # gap before the leave
                st.integers(0, n - 1),  # which away node returns (index among the away)
                st.floats(0, SETTLE * 0.45),  # gap before the return
            ),
            max_size=12,
        )
    )
    tail = draw(st.lists(st.floats(0, SETTLE * 0.9), min_size=n, max_size=n))
    return n, [f"n{i}:{s}" for i, s in zip(gone, initial, strict=True)], [*rounds, tail]


@given(partitions(), st.floats(0.0, SETTLE * 0.9))
def test_a_fleet_coming_back_within_its_settle_time_has_nothing_started_or_stopped(
    scenario: tuple[int, list[str], list[tuple]], first_gap: float
) -> None:
    """No sequence of nodes leaving and returning makes a replica start that a node
    reporting within its settle time already runs (nor a stop): the guard's hysteresis."""
    n, gone, steps = scenario
    *rounds, tail = steps
    sim = GuardSim(n, SETTLE)
    now = 0.0
    sim.plan(now)
    now = 1.0
    for entry in gone:  # together, as a partition does
        node, state = entry.split(":")
        sim.set(node, state, now)
    sim.plan(now)
    assert sim.held_at == now  # the guard held: most of the fleet is away

    def tick_to(until: float) -> None:
        nonlocal now
        t = now
        while t + 0.25 < until:  # the shell plans every interval and on every change
            t += 0.25
            sim.plan(t)
        now = until
        sim.plan(now)

    tick_to(now + first_gap)
    for leave, gap_leave, pick, gap_return in rounds:
        if leave is not None:
            idx, state = leave
            tick_to(now + gap_leave)
            sim.set(f"n{idx}", state, now)
            sim.plan(now)
        away = [x for x in sim.nodes if sim.states[x] != "ready"]
        if away:
            tick_to(now + gap_return)
            sim.set(away[pick % len(away)], "ready", now)
            sim.plan(now)
    for gap in tail:
        away = [x for x in sim.nodes if sim.states[x] != "ready"]
        if not away:
            break
        tick_to(now + gap)
        sim.set(away[0], "ready", now)
        sim.plan(now)
    tick_to(now + 2 * SETTLE)  # and well past the last settle: still nothing to do
    assert all(s == "ready" for s in sim.states.values())
    assert sim.actions == []


@given(st.integers(3, 7), st.data())
def test_a_node_still_away_after_the_settle_time_is_the_normal_lost_case(
    n: int, data: st.DataObject
) -> None:
    """The hysteresis is not "never": once the returning nodes have settled, a node
    still lost has its replica replaced, and not a moment before."""
    sim = GuardSim(n, SETTLE)
    gone = data.draw(st.lists(st.integers(0, n - 1), min_size=n // 2 + 1, max_size=n, unique=True))
    for i in gone:
        sim.set(f"n{i}", "lost", 1.0)
    sim.plan(1.0)
    t = 1.0
    for i in gone[1:]:  # all but the first come back, each within SETTLE of the one before
        t += data.draw(st.floats(0, SETTLE * 0.9))
        sim.set(f"n{i}", "ready", t)
        sim.plan(t)
    last = t
    while t < last + SETTLE + 1:
        t += 0.25
        sim.plan(t)
    # 1 of n >= 3 away: not cut off, so only the hysteresis held it.
    starts = [when for when, a in sim.actions if a == Start("qwen")]
    assert len(starts) == len(sim.actions)  # nothing but the replacement
    assert starts and last + SETTLE <= min(starts) <= last + SETTLE + 0.25
