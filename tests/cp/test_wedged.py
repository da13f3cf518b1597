"""A replica a router quarantined as wedged, in the plan (llmgw/core/_reconcile.py) and
in the reconciler's memory (llmgw/cp/_fleet/_wedged.py): failed with the router's
reason, stopped and replaced, counted by its model's backoff, shown after it is gone."""

from __future__ import annotations

from llmgw.core import DesiredModel, ObservedShard, Start, Stop, reconcile
from llmgw.cp._fleet._backoffs import ModelBackoffs
from llmgw.cp._fleet._wedged import VISIBLE_S, WedgedReplicas

TINY = DesiredModel("tiny", 2, ("fp1",), {"fp1": 600.0})
WHY = "wedged: 3 requests, no bytes for 10 s, /health 200"


def shard(replica: str, node: str = "n1", state: str = "ready") -> ObservedShard:
    return ObservedShard(node, "ready", f"{replica}.0", state, replica, "tiny", 0, 1, "fp1")


def test_a_wedged_replica_is_failed_with_the_routers_reason_stopped_and_replaced() -> None:
    shards = [shard("r1"), shard("r2", "n2")]
    plan = reconcile([TINY], shards, {"n1": "ready", "n2": "ready"}, {}, 10.0,
                     wedged={"r2": WHY})  # fmt: skip
    assert plan.actions == (Stop("n2", "r2.0", f"replica r2 failed: {WHY}"), Start("tiny"))
    views = {v.replica_id: (v.state, v.reason) for v in plan.replicas}
    assert views == {"r1": ("ready", None), "r2": ("failed", WHY)}
    # Without the router's word the same fleet is left as it is.
    assert reconcile([TINY], shards, {"n1": "ready", "n2": "ready"}, {}, 10.0).actions == ()


def test_the_word_is_kept_while_reported_counted_once_and_shown_after_it_is_gone() -> None:
    told = {"r2": WHY}
    memory = WedgedReplicas(lambda: told)
    backoffs = ModelBackoffs()
    memory.note({"r1", "r2"}, 10.0)
    assert memory.reasons == {"r2": WHY}
    told = {}  # the router lifted it (a byte came, or its quarantine ran out): kept
    memory.note({"r1", "r2"}, 11.0)
    assert memory.reasons == {"r2": WHY}
    shards = [shard("r1"), shard("r2", "n2")]
    plan = reconcile([TINY], shards, {"n1": "ready", "n2": "ready"}, {}, 11.0,
                     wedged=memory.reasons)  # fmt: skip
    memory.planned(plan, 11.0)
    assert backoffs.note(plan, {"tiny"}, (), 11.0) is True  # one failure of the model
    assert backoffs.current()["tiny"].failures == 1
    assert backoffs.note(plan, {"tiny"}, (), 12.0) is False  # counted once
    # Gone (stopped): its reason is forgotten, its view shown for VISIBLE_S.
    memory.note({"r1"}, 20.0)
    assert memory.reasons == {}
    assert {r: (v.state, v.reason) for r, v in memory.views().items()} == {"r2": ("failed", WHY)}
    memory.note({"r1"}, 11.0 + VISIBLE_S + 1)
    assert memory.views() == {}
    # A replica the router names that is not reported (gone already) is not taken.
    told = {"r9": WHY}
    memory.note({"r1"}, 700.0)
    assert memory.reasons == {}
