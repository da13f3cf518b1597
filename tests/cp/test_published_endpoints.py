"""The leader's endpoint list through the store, for a standby's router (llmgw/cp/_fleet/_endpoints.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from llmgw.cp._fleet._endpoints import (
    EndpointPublisher,
    PublishedEndpoints,
    RoleEndpoints,
    decode_endpoints,
    decode_published,
    encode_endpoints,
)
from llmgw.router import Hold, decode_holds
from llmgw.router._types import Endpoint, StaticEndpoints
from llmgw.store import open_store

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
endpoints = st.builds(
    Endpoint,
    endpoint_id=names,
    model=st.just("m"),
    engine=st.sampled_from(["vllm", "sglang", "llama-server"]),
    host=names,
    port=st.integers(1, 65535),
    slots=st.none() | st.integers(0, 1024),
)


@given(st.dictionaries(names, st.lists(endpoints, max_size=4), max_size=4))
def test_the_list_round_trips(raw: dict[str, list[Endpoint]]) -> None:
    import attrs

    snapshot = {name: tuple(attrs.evolve(e, model=name) for e in eps) for name, eps in raw.items()}
    assert decode_endpoints(encode_endpoints(snapshot)) == snapshot


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[]", "expected"),
        ('{"models": []}', "expected"),
        ('{"models": {"m": {}}}', "list of endpoints"),
        ('{"models": {"m": [1]}}', "not an object"),
        ('{"models": {"m": [{"endpoint_id": "e", "engine": "vllm", "host": "h", "port": 0}]}}',
         "port 0 is not a port"),
        ('{"models": {"m": [{"endpoint_id": "e", "engine": "vllm", "host": "h", "port": true}]}}',
         "is not a port"),
        ('{"models": {"m": [{"endpoint_id": 5, "engine": "vllm", "host": "h", "port": 80}]}}',
         "must be strings"),
    ],
)  # fmt: skip
def test_a_malformed_list_is_refused_naming_what(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_endpoints(text)


async def test_the_standby_routes_from_what_the_leader_published(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    try:
        lease = await store.try_acquire("cp-a", 30)
        assert lease is not None
        fleet = StaticEndpoints(
            [Endpoint("r1@n1", "tiny", "llama-server", "10.0.0.1", 9001)], models=["tiny"]
        )
        leading = True
        publisher = EndpointPublisher(
            store, fleet, lambda: leading, lambda: lease.epoch, every_s=0.05
        )
        published = PublishedEndpoints(store, every_s=0.05)
        # The leader's own router reads the fleet; a standby's the published list.
        mine = RoleEndpoints(fleet, PublishedEndpoints(store), lambda: True)
        theirs = RoleEndpoints(StaticEndpoints(), published, lambda: False)
        assert theirs.snapshot() == {}  # nothing published yet: no endpoints, not an error
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            nursery.start_soon(published.run)
            v0 = theirs.version
            with trio.fail_after(10):
                while theirs.snapshot() != fleet.snapshot():
                    await trio.sleep(0.02)
            assert theirs.version > v0 and mine.snapshot() == fleet.snapshot()
            # A change is published, and only a change: the same list is written once.
            writes = publisher.published
            await trio.sleep(0.3)
            assert publisher.published == writes == 1
            fleet.replace([Endpoint("r2@n2", "tiny", "vllm", "10.0.0.2", 9002)], ["tiny"])
            with trio.fail_after(10):
                while [e.endpoint_id for e in theirs.snapshot()["tiny"]] != ["r2@n2"]:
                    await trio.sleep(0.02)
            assert publisher.published == 2
            # Deposed: it publishes nothing more.
            leading = False
            fleet.replace([], ["tiny"])
            await trio.sleep(0.3)
            assert publisher.published == 2
            assert [e.endpoint_id for e in theirs.snapshot()["tiny"]] == ["r2@n2"]
            nursery.cancel_scope.cancel()
        row = await store.published_endpoints()
        assert row is not None and json.loads(row[1])["models"]["tiny"][0]["port"] == 9002
    finally:
        await store.aclose()


def test_the_role_switch_moves_the_version() -> None:
    fleet = StaticEndpoints([Endpoint("r1@n1", "m", "vllm", "h", 1)])
    other = PublishedEndpoints(None)  # type: ignore[arg-type]
    leading = True
    role = RoleEndpoints(fleet, other, lambda: leading)
    v = role.version
    assert role.snapshot() == fleet.snapshot() and role.version == v
    leading = False
    # Deposed (say the store is down): it keeps routing to the engines it knew as the
    # leader, not to nothing, until the store answers with the leader's list.
    assert role.version > v and role.snapshot() == fleet.snapshot()
    assert other.reading  # a standby reads the store; a leader does not
    leading = True
    assert role.snapshot() == fleet.snapshot() and not other.reading


async def test_a_deposed_leader_routes_to_what_it_knew_until_the_store_answers() -> None:
    class Store:
        row: tuple[int, str, float] | None = None

        async def published_endpoints(self) -> tuple[int, str, float] | None:
            return self.row

    known = Endpoint("r1@n1", "m", "vllm", "h", 1)
    fleet = StaticEndpoints([known])
    store = Store()
    published = PublishedEndpoints(store)  # type: ignore[arg-type]
    leading = True
    role = RoleEndpoints(fleet, published, lambda: leading)
    assert role.snapshot() == {"m": (known,)}
    leading = False
    fleet.replace([], ["m"])  # step_down forgets the fleet: the router must not
    assert role.snapshot() == {"m": (known,)}
    await published.read_once()  # the store has nothing yet: still what it knew
    assert role.snapshot() == {"m": (known,)}
    theirs = Endpoint("r2@n2", "m", "vllm", "h2", 2)
    store.row = (2, encode_endpoints({"m": (theirs,)}), 0.0)
    v = role.version
    await published.read_once()  # the new leader's list replaces it
    assert role.version > v and role.snapshot() == {"m": (theirs,)}


def test_holds_round_trip_through_the_published_list() -> None:
    ep = Endpoint("r1@n1", "m", "vllm", "h", 1)
    holds = {"m": Hold(8, 120.0), "z": Hold(1, 0.5)}
    body = encode_endpoints({"m": (ep,)}, {}, holds)
    assert decode_published(body) == ({"m": (ep,)}, {}, holds)
    # A leader from before the holds published none: none.
    assert decode_published(json.dumps({"models": {}}))[2] == {}


@pytest.mark.parametrize(
    ("holds", "match"),
    [
        ([], "expected"),
        ({"m": [8, 120]}, "expected"),
        ({"m": {"max": 8}}, "expected"),
        ({"m": {"max": 8, "s": 1, "x": 1}}, "expected"),
        ({"m": {"max": 0, "s": 1}}, "'m': a hold's max must be a number of requests, 1 or more, not 0"),
        ({"m": {"max": True, "s": 1}}, "not True"),
        ({"m": {"max": 2.5, "s": 1}}, "not 2.5"),
        ({"m": {"max": "8", "s": 1}}, "not '8'"),
        ({"m": {"max": 8, "s": 0}}, "s must be a number of seconds above 0, not 0"),
        ({"m": {"max": 8, "s": -1}}, "not -1"),
        ({"m": {"max": 8, "s": "60"}}, "not '60'"),
        ({"m": {"max": 8, "s": None}}, "not None"),
    ],
)  # fmt: skip
def test_malformed_holds_are_refused_naming_what(holds: object, match: str) -> None:
    text = json.dumps({"models": {}, "holds": holds})
    with pytest.raises(ValueError, match=match):
        decode_published(text)
    with pytest.raises(ValueError, match=match):
        decode_holds(holds)


def test_infinite_hold_seconds_are_refused() -> None:
    with pytest.raises(ValueError, match="not inf"):
        decode_published('{"models": {}, "holds": {"m": {"max": 1, "s": Infinity}}}')


async def test_a_standby_holds_as_the_leader_does(tmp_path: Path) -> None:
    """The leader's holds reach a standby's router through the store, and a role switch
    hands the router the holds of the list it then routes by."""
    store = await open_store(tmp_path)
    try:
        lease = await store.try_acquire("cp-a", 30)
        assert lease is not None
        fleet = StaticEndpoints([], ["cold"], holds={"cold": Hold(8, 60.0)})
        publisher = EndpointPublisher(store, fleet, lambda: True, lambda: lease.epoch, every_s=0.05)
        published = PublishedEndpoints(store, every_s=0.05)
        leading = False
        role = RoleEndpoints(StaticEndpoints(), published, lambda: leading)
        assert role.holds() == {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            nursery.start_soon(published.run)
            v = role.version
            with trio.fail_after(10):
                while role.holds() != {"cold": Hold(8, 60.0)}:
                    await trio.sleep(0.02)
            assert role.version > v
            nursery.cancel_scope.cancel()
        mine = StaticEndpoints([], ["cold"], holds={"cold": Hold(2, 5.0)})
        own = RoleEndpoints(mine, published, lambda: leading)
        assert own.holds() == {"cold": Hold(8, 60.0)}  # a standby: the published ones
        leading = True
        assert own.holds() == {"cold": Hold(2, 5.0)}  # leading: its own catalog's
        v = own.version
        mine.replace([], ["cold"])  # the catalog no longer scales it to zero
        assert own.version > v and own.holds() == {}
    finally:
        await store.aclose()
