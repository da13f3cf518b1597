"""A newly elected leader's router keeps the published list until its own view fills
(llmgw/cp/_fleet/_handover.py, RoleEndpoints in llmgw/cp/_fleet/_endpoints.py)."""

from __future__ import annotations

from llmgw.cp._fleet._endpoints import PublishedEndpoints, RoleEndpoints
from llmgw.router._types import Endpoint, StaticEndpoints

A = Endpoint("r1@n1", "m", "llama-server", "10.0.0.1", 9001)
B = Endpoint("r2@n2", "m", "llama-server", "10.0.0.2", 9002)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def promoted(limit_s: float = 60.0):  # type: ignore[no-untyped-def]
    """A standby routing by the published [A, B], its own view empty; then elected."""
    fleet = StaticEndpoints([], ["m"])
    published = PublishedEndpoints(None)  # type: ignore[arg-type]
    published.adopt({"m": (A, B)})  # as if read from the store
    state = {"leading": False, "registered": set(), "unhealthy": set()}
    clock = Clock()
    role = RoleEndpoints(
        fleet,
        published,
        lambda: bool(state["leading"]),
        registered=lambda: state["registered"],  # type: ignore[arg-type,return-value]
        unhealthy=lambda: state["unhealthy"],  # type: ignore[arg-type,return-value]
        handover_s=limit_s,
        clock=clock,
    )
    assert role.snapshot() == {"m": (A, B)}
    state["leading"] = True
    return role, fleet, state, clock


def test_an_election_keeps_routing_by_the_published_list() -> None:
    role, fleet, state, clock = promoted()
    v = role.version
    assert role.snapshot() == {"m": (A, B)}, "never the empty own view"
    assert role.handover is not None and role.handovers == 1
    # n1 registers with its replica at a new port: its own report replaces the published.
    moved = Endpoint("r1@n1", "m", "llama-server", "10.0.0.1", 9100)
    fleet.replace([moved], ["m"])
    state["registered"] = {"n1"}
    assert role.snapshot() == {"m": (moved, B)} and role.version > v
    # n2 registers: the handover is over, the own view is the list.
    fleet.replace([moved, B], ["m"])
    state["registered"] = {"n1", "n2"}
    clock.now += 1
    assert role.snapshot() == {"m": (moved, B)}
    assert role.handover is None


def test_a_node_that_registers_without_its_replica_drops_it() -> None:
    role, _fleet, state, clock = promoted()
    state["registered"] = {"n2"}  # n2's engine is gone: its registration says so
    clock.now += 1
    assert role.snapshot() == {"m": (A,)}


def test_a_silent_engine_leaves_the_list_and_stays_out() -> None:
    role, _fleet, state, clock = promoted()
    state["unhealthy"] = {"r2@n2"}
    clock.now += 1
    assert role.snapshot() == {"m": (A,)}
    state["unhealthy"] = set()  # a new EndpointState starts healthy: no flapping back
    clock.now += 1
    assert role.snapshot() == {"m": (A,)}


def test_the_handover_ends_after_its_bound() -> None:
    role, _fleet, _state, clock = promoted(limit_s=30.0)
    assert role.snapshot() == {"m": (A, B)}
    clock.now += 30.0
    assert role.snapshot() == {"m": ()}  # nodes never back by now are lost
    assert role.handover is None


def test_no_handover_from_nothing() -> None:
    fleet = StaticEndpoints([A], ["m"])
    role = RoleEndpoints(fleet, PublishedEndpoints(None), lambda: True)  # type: ignore[arg-type]
    assert role.snapshot() == {"m": (A,)} and role.handover is None
