"""The full-fleet shell (llmgw/cp/_fleet/_priorities.py): what it hands the decision and
what it does with the answer. Placement is stood in for by a rule (a model fits when a
named replica's cards are free); the decision itself is llmgw/core/_displace.py's
(tests/core/test_displace.py)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from llmgw import core
from llmgw.cp._fleet._catalog import parse
from llmgw.cp._fleet._placing import Unplaced

CPU = [{"engine": "llama-server"}]
CATALOG = parse(
    {
        "models": [
            {"name": "low", "source": "x/l", "priority": 0, "autoscale": {"max": 2},
             "profiles": CPU},
            {"name": "high", "source": "x/h", "priority": 1, "autoscale": {"max": 1},
             "profiles": CPU},
            {"name": "fixed", "source": "x/f", "replicas": 1, "priority": -1, "profiles": CPU},
        ]
    },
    "server.yaml",
)  # fmt: skip


class Placing:
    """`model` fits when one of `frees[model]` is among the replicas taken as gone."""

    def __init__(self, frees: dict[str, set[str]]) -> None:
        self.frees = frees

    def placer(self, without: Collection[str] = ()) -> frozenset[str]:
        return frozenset(without)

    def try_place(self, m: Any, placer: frozenset[str]) -> object:
        if placer & self.frees.get(m.name, set()):
            return ("profile", "placement")
        return Unplaced(m.name, ("no room",))


class Registry:
    def records(self) -> list[object]:
        return []


def view(replica: str, model_name: str) -> core.ReplicaView:
    return core.ReplicaView(replica, model_name, "ready", ("n1",), 0.0, False, None)


def shell(frees: dict[str, set[str]], busy: set[str] = frozenset(), queued: int = 0) -> Any:
    from llmgw.cp._fleet._priorities import Priorities

    lowered: list[tuple[str, int, str]] = []
    p = Priorities(
        Registry(),  # type: ignore[arg-type]
        Placing(frees),  # type: ignore[arg-type]
        in_flight=lambda replica, node: 1 if replica in busy else 0,
        queued=lambda name: queued,
        lower=lambda name, n, why: lowered.append((name, n, why)),
    )
    return p, lowered


PLAN = core.Plan((), (view("l1", "low"), view("l2", "low"), view("f1", "fixed")))
WANTS = {"low": 2, "high": 1, "fixed": 1}


def count(m: Any) -> int:
    return WANTS[m.name]


def test_an_idle_lower_replica_is_displaced_lowered_and_retired_first() -> None:
    p, lowered = shell({"high": {"l2"}})
    p.after_pass(CATALOG, PLAN, {"high": Unplaced("high", ("no room",))}, count)
    assert p.retire_first() == {"l2"}
    assert [(name, n) for name, n, _ in lowered] == [("low", 1)]
    assert "high wants 1, has 0" in (p.why("high") or "")
    # While its victim lives nothing more is displaced for it.
    p.after_pass(CATALOG, PLAN, {"high": Unplaced("high", ("no room",))}, count)
    assert len(lowered) == 1
    # The victim gone, the displacement is over.
    gone = core.Plan((), (view("l1", "low"), view("f1", "fixed")))
    p.after_pass(CATALOG, gone, {}, count)
    assert p.retire_first() == frozenset()


def test_busy_fixed_and_higher_replicas_are_not_displaced_and_the_words_say_why() -> None:
    p, lowered = shell({"high": {"l1", "l2"}, "low": {"f1"}}, busy={"l1", "l2"})
    p.after_pass(CATALOG, PLAN, {"high": Unplaced("high", ("no room",))}, count)
    assert lowered == [] and p.retire_first() == frozenset()
    assert "low" in (p.why("high") or "")
    # A fixed count is its own min: never displaced, whoever asks.
    p.after_pass(CATALOG, PLAN, {"low": Unplaced("low", ("no room",))}, lambda m: 3)
    assert lowered == [] and "fixed" in (p.why("low") or "")


def test_a_scale_down_takes_first_the_replica_a_refused_model_could_use() -> None:
    p, lowered = shell({"fixed": {"l1"}})
    plan = core.Plan((), (view("l1", "low"), view("l2", "low")))
    shrinking = {"low": 1, "high": 1, "fixed": 2}  # fixed wants one more and has no room
    p.after_pass(
        CATALOG, plan, {"fixed": Unplaced("fixed", ("no room",))}, lambda m: shrinking[m.name]
    )
    assert p.retire_first() == {"l1"} and lowered == []
