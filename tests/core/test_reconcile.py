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


def test_extras_stop_least_advanced_then_newest() -> None:
    shards = [shard("old"), shard("new"), shard("loading", state="loading")]
    plan = reconcile([QWEN], shards, {"n1": "ready"}, {"old": 1.0, "new": 5.0, "loading": 0.0}, 9.0)
    assert [a.shard_id for a in plan.actions if isinstance(a, Stop)] == ["loading-0"]


def test_changed_profile_shows_stale_but_keeps_serving() -> None:
    changed = DesiredModel("qwen", 1, ("fp2",), {"fp2": 600.0})
    plan = reconcile([changed], [shard("r1", fp="fp1")], {"n1": "ready"}, {}, 1.0)
    assert plan.actions == ()
    assert plan.replicas[0].stale


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
