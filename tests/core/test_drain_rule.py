"""The drain rule (llmgw/core/_drain.py) alone and inside the reconcile plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import DrainingReplica, DrainInput, drain_model
from llmgw.core._reconcile import DesiredModel, ObservedShard, Start, Stop, reconcile

QWEN = DesiredModel("qwen", 1, ("fp1",), {"fp1": 600.0})
NODES = {"n1": "ready", "n2": "ready", "n3": "ready"}


def shard(replica: str, node: str, state: str = "ready", rank: int = 0, ranks: int = 1):
    return ObservedShard(
        node, "ready", f"{replica}-{rank}", state, replica, "qwen", rank, ranks, "fp1"
    )


def plan(shards, drain, now=10.0, desired=(QWEN,), first_seen=None):
    seen = first_seen or {s.replica_id: 0.0 for s in shards}
    return reconcile(list(desired), shards, NODES, seen, now, drain=drain)


def states(p):
    return {v.replica_id: v.state for v in p.replicas}


# --- inside the plan ---------------------------------------------------------------------


def test_a_draining_replica_is_replaced_first_and_kept_meanwhile() -> None:
    p = plan([shard("r1", "n1")], DrainInput(nodes={"n1"}))
    assert p.actions == (Start("qwen"),)
    assert states(p) == {"r1": "draining"}
    (view,) = p.replicas
    assert "kept until its replacement is ready" in (view.reason or "")
    assert "0 ready replicas elsewhere, wants 1" in (view.reason or "")


def test_a_loading_replacement_keeps_the_old_replica_serving() -> None:
    shards = [shard("r1", "n1"), shard("r2", "n2", state="loading")]
    p = plan(shards, DrainInput(nodes={"n1"}))
    assert p.actions == ()  # the replacement counts as the model's replica: no second start
    assert states(p) == {"r1": "draining", "r2": "starting"}


def test_once_replaced_it_retires_and_stops_only_on_a_later_pass() -> None:
    shards = [shard("r1", "n1"), shard("r2", "n2")]
    first = plan(shards, DrainInput(nodes={"n1"}, in_flight={"r1": 0}))
    # The first pass takes it out of the router; a zero read before that proves nothing.
    assert first.actions == ()
    assert states(first) == {"r1": "retiring", "r2": "ready"}
    busy = DrainInput(nodes={"n1"}, in_flight={"r1": 2}, retiring_since={"r1": 10.0}, timeout_s=30)
    waiting = plan(shards, busy, now=20.0)
    assert waiting.actions == ()
    assert "waiting for 2 in-flight requests (10 of 30 s)" in (waiting.replicas[0].reason or "")
    idle = DrainInput(nodes={"n1"}, in_flight={"r1": 0}, retiring_since={"r1": 10.0})
    done = plan(shards, idle, now=11.0)
    assert done.actions == (
        Stop(
            "n1",
            "r1-0",
            "replica r1 retired: its node is draining; replaced, and no request is in flight",
        ),
    )


def test_the_drain_timeout_bounds_the_wait_for_in_flight_requests() -> None:
    shards = [shard("r1", "n1"), shard("r2", "n2")]
    drain = DrainInput(nodes={"n1"}, in_flight={"r1": 3}, retiring_since={"r1": 10.0}, timeout_s=30)
    assert plan(shards, drain, now=39.9).actions == ()
    (stop,) = plan(shards, drain, now=40.0).actions
    assert isinstance(stop, Stop) and stop.shard_id == "r1-0"
    assert "drain timeout of 30 s passed with 3 requests still in flight" in stop.reason
    unknown = DrainInput(nodes={"n1"}, retiring_since={"r1": 10.0}, timeout_s=30)
    assert plan(shards, unknown, now=39.0).actions == ()  # no router here: wait the timeout
    assert "an unknown number of" in plan(shards, unknown, now=40.0).actions[0].reason


def test_a_multi_node_replica_with_one_rank_on_a_draining_node_moves_whole() -> None:
    shards = [shard("r1", "n2", rank=0, ranks=2), shard("r1", "n1", rank=1, ranks=2)]
    p = plan(shards, DrainInput(nodes={"n1"}))
    assert p.actions == (Start("qwen"),)
    assert states(p) == {"r1": "draining"}
    shards += [shard("r2", "n3")]
    drain = DrainInput(nodes={"n1"}, in_flight={"r1": 0}, retiring_since={"r1": 1.0})
    stops = plan(shards, drain).actions
    assert sorted(a.shard_id for a in stops if isinstance(a, Stop)) == ["r1-0", "r1-1"]


def test_undrained_it_counts_again_and_the_extra_retires_as_a_drain_does() -> None:
    shards = [shard("r1", "n1"), shard("r2", "n2")]
    seen = {"r1": 0.0, "r2": 5.0}
    p = reconcile([QWEN], shards, NODES, seen, 10.0, drain=DrainInput())
    assert p.actions == ()  # out of the router first: it may be answering
    assert states(p) == {"r1": "ready", "r2": "retiring"}  # the newest
    busy = DrainInput(in_flight={"r2": 2}, retiring_since={"r2": 10.0})
    p = reconcile([QWEN], shards, NODES, seen, 11.0, drain=busy)
    assert p.actions == () and states(p)["r2"] == "retiring"
    assert "waiting for 2 in-flight requests" in str(p.replicas[1].reason)
    done = DrainInput(in_flight={"r2": 0}, retiring_since={"r2": 10.0})
    p = reconcile([QWEN], shards, NODES, seen, 12.0, drain=done)
    assert [a.shard_id for a in p.actions if isinstance(a, Stop)] == ["r2-0"]


def test_the_extra_named_first_retires_before_the_newest() -> None:
    shards = [shard("r1", "n1"), shard("r2", "n2")]
    p = reconcile([QWEN], shards, NODES, {"r1": 0.0, "r2": 5.0}, 10.0, drain=DrainInput(),
                  retire_first={"r1"})  # fmt: skip
    assert states(p) == {"r1": "retiring", "r2": "ready"}


def test_a_cut_off_control_plane_retires_nothing() -> None:
    nodes = {"n1": "ready", "n2": "ready", "n3": "lost", "n4": "lost", "n5": "lost"}
    shards = [shard("r1", "n1"), shard("r2", "n2")]
    drain = DrainInput(nodes={"n1"}, in_flight={"r1": 0}, retiring_since={"r1": 1.0})
    p = reconcile([QWEN], shards, nodes, {"r1": 0.0, "r2": 0.0}, 10.0, drain=drain)
    assert p.actions == ()
    assert states(p)["r1"] == "draining"


def test_a_model_that_left_the_catalog_is_stopped_at_once_even_on_a_draining_node() -> None:
    p = plan([shard("r1", "n1")], DrainInput(nodes={"n1"}), desired=())
    assert [a.shard_id for a in p.actions if isinstance(a, Stop)] == ["r1-0"]


# --- the rule alone: properties ----------------------------------------------------------


@st.composite
def situations(draw):
    k = draw(st.integers(0, 5))
    replicas = [
        DrainingReplica(f"r{i}", draw(st.booleans()), draw(st.floats(0, 100))) for i in range(k)
    ]
    ids = [r.replica_id for r in replicas]
    counts = st.one_of(st.none(), st.integers(0, 3))
    some = st.lists(st.sampled_from(ids), unique=True) if ids else st.just([])
    in_flight = {r: draw(counts) for r in draw(some)}
    since = {r: draw(st.floats(0, 200)) for r in draw(some)}
    drain = DrainInput(nodes={"n1"}, in_flight=in_flight, retiring_since=since, timeout_s=50.0)
    return (
        draw(st.integers(0, 4)),  # wanted
        draw(st.integers(0, 5)),  # ready elsewhere
        replicas,
        drain,
        draw(st.floats(0, 300)),  # now
        draw(st.booleans()),  # cut off
    )


@given(situations())
def test_serving_capacity_never_drops_below_what_is_wanted(s) -> None:
    wanted, elsewhere, replicas, drain, now, cut_off = s
    decisions = drain_model("qwen", wanted, elsewhere, replicas, drain, now, cut_off=cut_off)
    assert [d.replica_id for d in decisions] == [r.replica_id for r in replicas]
    ready = {r.replica_id for r in replicas if r.ready}
    routed = elsewhere + sum(
        1 for d in decisions if d.state == "draining" and d.replica_id in ready
    )
    assert routed >= min(wanted, elsewhere + len(ready))


@given(situations())
def test_a_ready_replica_stops_only_after_a_retiring_pass_and_with_nothing_in_flight(s) -> None:
    wanted, elsewhere, replicas, drain, now, cut_off = s
    by_id = {r.replica_id: r for r in replicas}
    for d in drain_model("qwen", wanted, elsewhere, replicas, drain, now, cut_off=cut_off):
        assert d.state in ("draining", "retiring")
        if d.stop:
            assert d.state == "retiring" and not cut_off
            if by_id[d.replica_id].ready:
                since = drain.retiring_since.get(d.replica_id)
                assert since is not None
                assert drain.in_flight.get(d.replica_id) == 0 or now - since >= drain.timeout_s


@given(situations())
def test_as_many_retire_as_the_ready_replicas_elsewhere_allow(s) -> None:
    wanted, elsewhere, replicas, drain, now, cut_off = s
    decisions = drain_model("qwen", wanted, elsewhere, replicas, drain, now, cut_off=cut_off)
    retiring = sum(1 for d in decisions if d.state == "retiring")
    expected = 0 if cut_off else min(len(replicas), max(0, elsewhere + len(replicas) - wanted))
    assert retiring == expected
