"""A model's restart backoff (llmgw/core/_backoff.py) and how the plan obeys it
(llmgw/core/_reconcile.py): the delay doubles per failure up to its cap, the count
goes only when a replica started after the last failure stays ready, and a model in
backoff starts nothing before its time, then one replica at a time, while every
other model is planned exactly as without it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import Backoff, BackoffPolicy, backoff_failure, backoff_settled
from llmgw.core._reconcile import DesiredModel, ObservedShard, Start, reconcile

POLICY = BackoffPolicy()


def test_a_first_failure_is_replaced_at_once_then_the_wait_doubles_from_5_s_to_5_min() -> None:
    b = None
    delays = []
    for i in range(10):
        b = backoff_failure(b, float(i), "refused", started_after=i)
        delays.append(b.delay_s(POLICY))
    assert delays == [0, 5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert b is not None and b.failures == 10 and b.last_at == 9.0
    assert b.next_try_at(POLICY) == 309.0


def test_failures_of_one_round_count_once() -> None:
    # Ten replicas started together (the model had no failure then) all fail: one round.
    b = None
    for i in range(10):
        b = backoff_failure(b, 1.0 + i / 100, f"refused {i}", started_after=0)
    assert b == Backoff(1, 1.0, "refused 9")
    # The probe started after that failure counts; so does a replica adopted (unknown).
    b = backoff_failure(b, 2.0, "again", started_after=1)
    assert (b.failures, b.last_at) == (2, 2.0)
    b = backoff_failure(b, 3.0, "adopted", started_after=None)
    assert (b.failures, b.last_at) == (3, 3.0)


@given(st.integers(1, 10_000), st.floats(0.1, 100), st.floats(1, 10_000))
def test_the_delay_never_shrinks_and_never_passes_its_cap(
    failures: int, base: float, extra: float
) -> None:
    policy = BackoffPolicy(base_s=base, max_s=base + extra)
    b = Backoff(failures, 0.0, "x")
    more = Backoff(failures + 1, 0.0, "x")
    assert (
        (b.delay_s(policy) == 0) if failures == 1 else (base <= b.delay_s(policy) <= policy.max_s)
    )
    assert more.delay_s(policy) >= b.delay_s(policy)


def test_the_operators_line() -> None:
    b = Backoff(6, 100.0, "rank 0 on cpu-1 failed: bad source")
    assert b.describe(120.0, POLICY) == (
        "next try in 60 s after 6 failures: rank 0 on cpu-1 failed: bad source"
    )
    assert Backoff(2, 0.0, "r").describe(1.0, POLICY) == "next try in 4 s after 2 failures: r"
    assert Backoff(1, 0.0, "r").describe(0.0, POLICY) == "trying again after 1 failure: r"
    assert (
        b.describe(500.0, POLICY)
        == "trying again after 6 failures: rank 0 on cpu-1 failed: bad source"
    )


def test_only_a_replica_ready_since_the_last_failure_and_for_long_enough_resets() -> None:
    b = Backoff(3, 100.0, "x")
    assert backoff_settled(None, [], 0.0, POLICY) is None
    # Ready before the failure: proves nothing about what failed after it.
    assert backoff_settled(b, [50.0], 1000.0, POLICY) == b
    # Ready after it, but not for 60 s yet.
    assert backoff_settled(b, [130.0], 189.0, POLICY) == b
    assert backoff_settled(b, [50.0, 130.0], 190.0, POLICY) is None


def test_a_policy_that_makes_no_sense_is_refused() -> None:
    with pytest.raises(ValueError, match="base_s <= max_s"):
        BackoffPolicy(base_s=10, max_s=5)
    with pytest.raises(ValueError, match="base_s <= max_s"):
        BackoffPolicy(base_s=0)
    with pytest.raises(ValueError, match="reset_s"):
        BackoffPolicy(reset_s=-1)


# The plan ---------------------------------------------------------------------------------


def shard(replica: str, model: str, state: str = "ready") -> ObservedShard:
    return ObservedShard("n1", "ready", f"{replica}-0", state, replica, model, 0, 1, "fp")


B15 = Backoff(2, 10.0, "x")  # 2 failures, the last at 10 s: next try at 15 s


def test_a_model_in_backoff_starts_nothing_before_its_time_then_one_at_a_time() -> None:
    bad = DesiredModel("bad", 3, ("fp",))
    nodes = {"n1": "ready"}
    assert reconcile([bad], [], nodes, {}, 10.0).actions == (Start("bad"),) * 3
    held = reconcile([bad], [], nodes, {}, 10.0, backoff={"bad": B15})
    assert held.actions == ()
    due = reconcile([bad], [], nodes, {}, 15.0, backoff={"bad": B15})
    assert due.actions == (Start("bad"),)
    # While the one tried is pending or starting, no other.
    assert reconcile([bad], [], nodes, {}, 20.0, pending={"bad": 1},
                     backoff={"bad": B15}).actions == ()  # fmt: skip
    starting = [shard("r1", "bad", "loading")]
    assert reconcile([bad], starting, nodes, {"r1": 16.0}, 20.0,
                     backoff={"bad": B15}).actions == ()  # fmt: skip
    # One started before the last failure goes on loading and holds nothing back.
    assert reconcile([bad], starting, nodes, {"r1": 9.0}, 20.0,
                     backoff={"bad": B15}).actions == (Start("bad"),)  # fmt: skip
    # Once it is ready the next one is tried.
    ready = [shard("r1", "bad")]
    assert reconcile([bad], ready, nodes, {"r1": 16.0}, 20.0,
                     backoff={"bad": B15}).actions == (Start("bad"),)  # fmt: skip


models = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 4)),
    min_size=1,
    max_size=4,
    unique_by=lambda t: t[0],
)
states = st.sampled_from(["ready", "loading", "failed", "unhealthy"])


@given(
    models,
    st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), states), max_size=8),
    st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.floats(0, 20), max_size=2),
    st.floats(0, 20),
)
def test_backoff_only_ever_holds_back_its_own_models_starts(
    wanted: list[tuple[str, int]],
    running: list[tuple[str, str]],
    until: dict[str, float],
    now: float,
) -> None:
    desired = [DesiredModel(name, n, ("fp",)) for name, n in wanted]
    shards = [shard(f"r{i}", name, state) for i, (name, state) in enumerate(running)]
    nodes = {"n1": "ready"}
    free = reconcile(desired, shards, nodes, {}, now)
    # Two failures, the last 5 s before `until`: the next try is at `until`.
    backoff = {name: Backoff(2, t - 5, "x") for name, t in until.items()}
    held = reconcile(desired, shards, nodes, {}, now, backoff=backoff)

    def starts(plan: object, name: str) -> int:
        return sum(1 for a in plan.actions if a == Start(name))  # type: ignore[attr-defined]

    # Stops are the same: a backoff never keeps a failed replica or stops a good one.
    assert [a for a in held.actions if not isinstance(a, Start)] == [
        a for a in free.actions if not isinstance(a, Start)
    ]
    for name, _ in wanted:
        if name not in until:
            assert starts(held, name) == starts(free, name)
        elif now < backoff[name].next_try_at(POLICY):  # `until`, as floats round it
            assert starts(held, name) == 0
        else:  # its time has come: one start, unless one of it is starting already
            trying = any(m == name and state == "loading" for m, state in running)
            assert starts(held, name) == (0 if trying else min(1, starts(free, name)))
