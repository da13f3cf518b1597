"""The replica states' table (llmgw/core/_replica.py), held to the reconcile plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw import core
from llmgw.core import _replica
from llmgw.core._reconcile import DesiredModel, ObservedShard, Plan, Stop, reconcile
from llmgw.core._replica import (
    ALIVE_REPLICA_STATES,
    BEHIND,
    MEANINGS,
    REPLACED_REPLICA_STATES,
    ReplicaMeaning,
    ReplicaState,
)
from llmgw.model import ShardState

R = ReplicaState

# The table as designed, written out again so that a change to the module's
# table is a deliberate change to this test too: (alive, replaced, behind).
EXPECTED = {
    "ready": (True, False, 0),
    "unreachable": (True, False, 1),
    "starting": (True, False, 2),
    "unhealthy": (True, True, 3),
    "lost": (False, True, 1),
    "failed": (False, True, None),
    "timed-out": (False, True, None),
    "incomplete": (False, True, None),
    "removed": (False, False, None),
    "extra": (False, False, None),
    "draining": (False, False, None),
    "retiring": (False, False, None),
}


def test_module_table_is_the_designed_table() -> None:
    got = {s.value: (m.alive, m.replaced, m.behind) for s, m in MEANINGS.items()}
    assert got == EXPECTED


def test_the_docstring_draws_the_module_table() -> None:
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in (_replica.__doc__ or "").splitlines()
        if line.startswith("| ")
    ]
    assert rows[0] == ["state", "alive", "replaced", "behind"]
    yes = {"yes": True, "no": False}
    drawn = {
        state: (yes[alive], yes[replaced], None if behind == "-" else int(behind))
        for state, alive, replaced, behind in rows[1:]
    }
    assert drawn == {s.value: (m.alive, m.replaced, m.behind) for s, m in MEANINGS.items()}
    assert list(drawn) == [s.value for s in ReplicaState]


def test_the_values_are_the_strings_the_api_always_showed() -> None:
    """StrEnum members equal their strings: the admin API, `ctl` and events see no change."""
    assert [s.value for s in ReplicaState] == list(EXPECTED)
    plain: str = "timed-out"  # as a JSON answer carries it
    assert plain == R.TIMED_OUT
    assert f"{R.EXTRA}" == "extra"


def test_the_columns_are_what_the_plan_and_the_event_log_used_to_spell_out() -> None:
    assert {"ready", "starting", "unreachable", "unhealthy"} == ALIVE_REPLICA_STATES
    assert {"failed", "timed-out", "lost", "incomplete", "unhealthy"} == REPLACED_REPLICA_STATES
    assert BEHIND == {"ready": 0, "unreachable": 1, "lost": 1, "starting": 2, "unhealthy": 3}
    assert core.ALIVE_REPLICA_STATES is ALIVE_REPLICA_STATES
    assert core.REPLACED_REPLICA_STATES is REPLACED_REPLICA_STATES
    assert (core.ReplicaState, core.ReplicaMeaning) == (ReplicaState, ReplicaMeaning)


def test_the_event_log_asks_the_table() -> None:
    from llmgw.cp._observe._events import REPLACED_STATES

    assert REPLACED_STATES is REPLACED_REPLICA_STATES


# --- the table against the plan ---------------------------------------------------------

QWEN = DesiredModel("qwen", 1, ("fp1",), {"fp1": 600.0})


def shard(
    replica: str,
    node: str = "n1",
    state: str = "ready",
    rank: int = 0,
    ranks: int = 1,
    node_state: str = "ready",
    model: str = "qwen",
) -> ObservedShard:
    return ObservedShard(
        node, node_state, f"{replica}-{rank}", state, replica, model, rank, ranks, "fp1", "why"
    )


def check(
    plan: Plan, shards: list[ObservedShard], derived: dict[str, str], wanted: int = 1
) -> None:
    """Every replica of `plan` is stopped or left exactly as its state's row says.

    `derived`: each replica's state as the plan derived it from its shards, before
    the plan renamed the ones it stops for being too many (extra).
    """
    members: dict[str, list[ObservedShard]] = {}
    for s in shards:
        if s.replica_id is not None and s.state != ShardState.STOPPED:
            members.setdefault(s.replica_id, []).append(s)
    stops: dict[str, list[Stop]] = {}
    owner = {s.shard_id: s.replica_id for s in shards}
    for a in plan.actions:
        if isinstance(a, Stop):
            stops.setdefault(owner[a.shard_id] or "", []).append(a)
    for view in plan.replicas:
        state = ReplicaState(view.state)  # raises for a state the table does not know
        mine = stops.get(view.replica_id, [])
        on_ready = {s.shard_id for s in members[view.replica_id] if s.node_state == "ready"}
        if state in ALIVE_REPLICA_STATES or (state is R.LOST and plan.holding):
            assert mine == [], view
            continue
        if state in (R.DRAINING, R.RETIRING):
            continue  # the drain rule's (tests/core/test_drain_rule.py)
        assert {a.shard_id for a in mine} == on_ready, view
        if state is R.EXTRA:
            assert MEANINGS[ReplicaState(derived[view.replica_id])].behind is not None
            why = f"replica {view.replica_id} retired: qwen wants {wanted} replicas; "
            assert all(a.reason.startswith(why) for a in mine), mine
        else:
            assert all(a.reason.startswith(f"replica {view.replica_id} {state}: ") for a in mine)


def derived_states(
    shards: list[ObservedShard],
    nodes: dict[str, str],
    first_seen: dict[str, float],
    now: float,
    unhealthy_since: dict[str, float] | None = None,
) -> dict[str, str]:
    """The states before extras are chosen: the same plan, wanting more than there are."""
    many = DesiredModel("qwen", 100, ("fp1",), {"fp1": 600.0})
    plan = reconcile([many], shards, nodes, first_seen, now, unhealthy_since=unhealthy_since)
    return {v.replica_id: v.state for v in plan.replicas}


rows = st.lists(
    st.tuples(
        st.integers(0, 4),  # replica
        st.integers(0, 1),  # rank
        st.integers(0, 3),  # node
        st.sampled_from(list(ShardState)),
        st.sampled_from([0.0, 10.0, 700.0]),  # first seen, before `now`
    ),
    max_size=10,
)
node_states = st.lists(st.sampled_from(["ready", "unreachable", "lost", "expected"]), min_size=4)


@given(rows, node_states, st.integers(0, 3), st.booleans(), st.sampled_from([0.0, 800.0]))
def test_random_fleets_are_planned_as_the_table_says(
    drawn: list[tuple[int, int, int, ShardState, float]],
    states: list[str],
    wanted: int,
    two_ranks: bool,
    unhealthy_since: float,
) -> None:
    nodes = {f"n{i}": state for i, state in enumerate(states[:4])}
    shards: list[ObservedShard] = []
    first_seen: dict[str, float] = {}
    for replica, rank, node, state, seen in drawn:
        name = f"r{replica}"
        if any(s.replica_id == name and s.rank == rank for s in shards):
            continue
        first_seen.setdefault(name, seen)
        node_id = f"n{node}"
        ranks = 2 if two_ranks else 1
        shards.append(shard(name, node_id, state, rank % ranks, ranks, nodes[node_id], "qwen"))
    now = 800.0
    since = {s.shard_id: unhealthy_since for s in shards}
    plan = reconcile(
        [DesiredModel("qwen", wanted, ("fp1",), {"fp1": 600.0})],
        shards,
        nodes,
        first_seen,
        now,
        unhealthy_since=since,
    )
    derived = derived_states(shards, nodes, first_seen, now, since)
    # The derived ones are the same but for the plan's own renaming: of too many, one
    # that serves nothing is extra (stopped), a ready one retiring (out of the router).
    for v in plan.replicas:
        assert v.state in (derived[v.replica_id], R.EXTRA) or (
            v.state == R.RETIRING and derived[v.replica_id] == R.READY
        )
    check(plan, shards, derived, wanted)
    # Of too many, the furthest behind go first, then the newest.
    extra = [v for v in plan.replicas if v.state in (R.EXTRA, R.RETIRING)]
    kept = [v for v in plan.replicas if ReplicaState(v.state) in ALIVE_REPLICA_STATES]
    for e in extra:
        for k in kept:
            e_key = (BEHIND[ReplicaState(derived[e.replica_id])], e.first_seen)
            k_key = (BEHIND[ReplicaState(derived[k.replica_id])], k.first_seen)
            assert e_key >= k_key


def test_every_state_is_reached_and_planned_as_its_row_says() -> None:
    """One fleet per state: the enum is exactly the set of states the plan gives."""
    three = {"n1": "ready", "n2": "ready", "n3": "ready"}
    cases: list[tuple[ReplicaState, list[ObservedShard], dict[str, str], dict[str, object]]] = [
        (R.READY, [shard("r1")], three, {}),
        (R.STARTING, [shard("r1", state="loading")], three, {}),
        (R.UNREACHABLE, [shard("r1", "n2", node_state="unreachable")], {**three, "n2": "unreachable"}, {}),
        (R.UNHEALTHY, [shard("r1", state="unhealthy")], three, {}),
        (R.LOST, [shard("r1", "n2", node_state="lost")], {**three, "n2": "lost"}, {}),
        (R.FAILED, [shard("r1", state="failed")], three, {}),
        (R.TIMED_OUT, [shard("r1", state="loading")], three, {"now": 700.0}),
        (R.INCOMPLETE, [shard("r1", ranks=2)], three, {"now": 61.0}),
        (R.REMOVED, [shard("r1", model="gone")], three, {}),
        (R.EXTRA, [shard("r0"), shard("r1", "n2", state="loading")], three, {}),
        (R.DRAINING, [shard("r1")], three, {"drain": core.DrainInput(nodes={"n1"})}),
        (R.RETIRING, [shard("r1"), shard("r0", "n2")], three, {"drain": core.DrainInput(nodes={"n1"})}),
    ]  # fmt: skip
    seen = set()
    for state, shards, nodes, kw in cases:
        now = float(kw.pop("now", 10.0))  # type: ignore[arg-type]
        first_seen = {s.replica_id or "": 0.0 for s in shards}
        plan = reconcile([QWEN], shards, nodes, first_seen, now, **kw)  # type: ignore[arg-type]
        (view,) = [v for v in plan.replicas if v.replica_id == "r1"]
        assert view.state is state, (state, view)
        seen.add(state)
        check(plan, shards, derived_states(shards, nodes, first_seen, now))
    assert seen == set(ReplicaState)
