"""The new leader's endpoint list while its own fleet view fills (llmgw/core/_handover.py)."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core


@attrs.frozen
class Ep:
    endpoint_id: str
    port: int = 1


def node_of(eid: str) -> str:
    return eid.rpartition("@")[2]


NODES = ("n1", "n2", "n3")
REPLICAS = ("r1", "r2", "r3")
MODELS = ("m", "k")

endpoint_ids = st.builds(lambda r, n: f"{r}@{n}", st.sampled_from(REPLICAS), st.sampled_from(NODES))


def views() -> st.SearchStrategy[dict[str, tuple[Ep, ...]]]:
    return st.dictionaries(
        st.sampled_from(MODELS),
        st.lists(
            st.builds(Ep, endpoint_ids, st.integers(1, 3)), unique_by=lambda e: e.endpoint_id
        ).map(lambda eps: tuple(sorted(eps, key=lambda e: e.endpoint_id))),
    )


def merge(own, published, registered=(), unhealthy=()):  # type: ignore[no-untyped-def]
    return core.handover_endpoints(
        own, published, node_of=node_of, registered=set(registered), unhealthy=set(unhealthy)
    )


def test_an_empty_own_view_routes_by_the_published_list() -> None:
    published = {"m": (Ep("r1@n1"), Ep("r2@n2"))}
    assert merge({"m": ()}, published) == published


def test_an_endpoint_of_the_own_view_replaces_the_published_one() -> None:
    own = {"m": (Ep("r1@n1", port=9),)}
    published = {"m": (Ep("r1@n1", port=5), Ep("r2@n2"))}
    assert merge(own, published, registered={"n1"}) == {"m": (Ep("r1@n1", port=9), Ep("r2@n2"))}


def test_a_registered_node_is_what_it_reports() -> None:
    # n1 registered and reports nothing ready: its published endpoint goes.
    published = {"m": (Ep("r1@n1"), Ep("r2@n2"))}
    assert merge({"m": ()}, published, registered={"n1"}) == {"m": (Ep("r2@n2"),)}
    assert core.handing_over(published, node_of=node_of, registered={"n1"}, unhealthy=set())
    assert not core.handing_over(
        published, node_of=node_of, registered={"n1", "n2"}, unhealthy=set()
    )


def test_an_engine_that_does_not_answer_leaves_the_list() -> None:
    published = {"m": (Ep("r1@n1"), Ep("r2@n2"))}
    assert merge({"m": ()}, published, unhealthy={"r2@n2"}) == {"m": (Ep("r1@n1"),)}
    assert not core.handing_over(published, node_of=node_of, registered={"n1"}, unhealthy={"r2@n2"})


@given(views(), views(), st.sets(st.sampled_from(NODES)), st.sets(endpoint_ids))
def test_the_merge(own, published, registered, unhealthy) -> None:  # type: ignore[no-untyped-def]
    got = merge(own, published, registered, unhealthy)
    assert set(got) == set(own) | set(published)
    for name, eps in got.items():
        ids = [e.endpoint_id for e in eps]
        assert ids == sorted(set(ids)), "one entry per endpoint, sorted"
        mine = {e.endpoint_id: e for e in own.get(name, ())}
        theirs = {e.endpoint_id: e for e in published.get(name, ())}
        # Everything the own view holds is routed, as the own view says.
        for _eid, e in mine.items():
            assert e in eps
        for e in eps:
            if e.endpoint_id in mine:
                assert e == mine[e.endpoint_id]
            else:
                # From the published list only while its node is away and its engine answers.
                assert theirs[e.endpoint_id] == e
                assert node_of(e.endpoint_id) not in registered
                assert e.endpoint_id not in unhealthy
        # Never through an empty view: a model left with nothing had nothing to keep.
        if not eps:
            assert not mine
            assert all(node_of(eid) in registered or eid in unhealthy for eid in theirs), (
                name,
                theirs,
            )


@given(views(), views(), st.sets(endpoint_ids))
def test_once_every_node_registered_the_own_view_is_the_list(own, published, unhealthy) -> None:  # type: ignore[no-untyped-def]
    got = merge(own, published, NODES, unhealthy)
    assert {n: eps for n, eps in got.items() if n in own} == own
    assert all(not eps for n, eps in got.items() if n not in own)
    assert not core.handing_over(published, node_of=node_of, registered=NODES, unhealthy=unhealthy)
