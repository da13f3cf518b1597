"""server.yaml's `traffic:` (llmgw/cp/_fleet/_traffic.py): parsed with the catalog, refused
with every problem's path, and carried in the router's endpoint view to the control
plane's router, its workers and a standby."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import register
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core
from llmgw.cp._fleet._catalog import parse
from llmgw.cp._fleet._endpoints import (
    FleetEndpoints,
    PublishedEndpoints,
    decode_published,
    encode_endpoints,
)
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.errors import ConfigError
from llmgw.router import StaticEndpoints, decode_traffic, encode_traffic
from llmgw.router._types import Endpoint

CPU = [{"engine": "llama-server", "gpus_per_node": 0}]
POLICY = core.LivenessPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, lost_after_s=5.0)


def data(traffic: Any) -> dict[str, Any]:
    return {
        "models": [
            {"name": "qwen-v1", "source": "/m/v1.gguf", "profiles": CPU},
            {"name": "qwen-v2", "source": "/m/v2.gguf", "served_names": ["q2"], "profiles": CPU},
            {"name": "embed", "source": "/m/e.gguf", "served_names": ["embed", "e"],
             "profiles": CPU},
        ],
        "traffic": traffic,
    }  # fmt: skip


def test_a_split_is_read_with_each_version_under_its_first_served_name() -> None:
    catalog = parse(
        data({"qwen": {"split": {"qwen-v1": 90, "qwen-v2": 10}, "keys": {"key-b": "qwen-v2"}}}),
        "server.yaml",
    )
    assert catalog.traffic == (
        core.TrafficSplit(
            "qwen",
            (
                core.TrafficVersion("qwen-v1", "qwen-v1", 90),
                core.TrafficVersion("qwen-v2", "q2", 10),
            ),
            (("key-b", "qwen-v2"),),
        ),
    )
    assert parse(data(None), "server.yaml").traffic == ()


@pytest.mark.parametrize(
    ("traffic", "problems"),
    [
        ({"qwen": {"split": {"qwen-v3": 5}}},
         ["traffic.qwen.split.qwen-v3: no model 'qwen-v3' in the catalog "
          "(models: embed, qwen-v1, qwen-v2)"]),
        ({"qwen": {"split": {"qwen-v1": -1, "qwen-v2": True}}},
         ["traffic.qwen.split.qwen-v1: weight -1: a whole number, 0 or more",
          "traffic.qwen.split.qwen-v2: weight True: a whole number, 0 or more"]),
        ({"qwen": {"split": {"qwen-v1": 0, "qwen-v2": 0}}},
         ["traffic.qwen.split: the weights sum to 0, so no request could be sent anywhere; "
          "give at least one version a weight above 0"]),
        ({"qwen": {"split": {}}},
         ["traffic.qwen.split: empty; name at least one catalog model and its weight"]),
        ({"e": {"split": {"qwen-v1": 1}}},
         ["traffic.e: 'e' is also a served name of model 'embed'; a name is either a model's "
          "or a split's: rename the split, or take the name out of the model's served_names"]),
        ({"qwen": {"split": {"qwen-v1": 1}, "keys": {"key-b": "qwen-v2"}}},
         ["traffic.qwen.keys.key-b: 'qwen-v2' is not a version of this split "
          "(versions: qwen-v1)"]),
        ({"qwen": {"weights": {"qwen-v1": 1}}},
         ["traffic.qwen.split: required, but missing", "traffic.qwen.weights: unknown key"]),
        ([{"qwen-v1": 1}],
         ["traffic: expected a mapping of split name -> {split, keys}, got [{'qwen-v1': 1}]"]),
    ],
)  # fmt: skip
def test_a_bad_split_is_refused_naming_its_path(traffic: Any, problems: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse(data(traffic), "server.yaml")
    assert sorted(str(err.value).splitlines()) == sorted(f"server.yaml: {p}" for p in problems)


def test_the_splits_round_trip_as_json_and_junk_is_refused() -> None:
    splits = {
        t.name: t
        for t in parse(
            data({"qwen": {"split": {"qwen-v1": 3, "qwen-v2": 0}, "keys": {"k": "qwen-v2"}},
                  "canary": {"split": {"embed": 1}}}),
            "server.yaml",
        ).traffic
    }  # fmt: skip
    wire = json.loads(json.dumps(encode_traffic(splits)))
    assert decode_traffic(wire) == splits
    assert decode_traffic(None) == {}  # a sender from before the splits
    for junk, match in [
        ([], "expected"),
        ({"q": {"versions": [["a", "a", -1]]}}, "weight >= 0"),
        ({"q": {"versions": [["a", "a", 0]]}}, "no version with a weight"),
        ({"q": {"versions": [["a", "a", 1]], "keys": [["k"]]}}, "key pin"),
        ({"q": {"versions": "a"}}, "expected"),
    ]:
        with pytest.raises(ValueError, match=match):
            decode_traffic(junk)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values | st.dictionaries(st.text(max_size=4), st.fixed_dictionaries(
    {"versions": json_values, "keys": json_values}), max_size=3))  # fmt: skip
def test_decoding_any_json_gives_splits_or_a_value_error(data: Any) -> None:
    """What a worker or a standby reads is another process's (the store: another
    machine's): anything else than the splits is a ValueError, never another exception."""
    try:
        splits = decode_traffic(data)
    except ValueError:
        return
    for name, split in splits.items():
        assert split.name == name and sum(v.weight for v in split.versions) > 0


async def test_the_fleet_view_carries_the_splits_and_moves_its_version_when_they_change() -> None:
    registry = NodeRegistry(POLICY)
    await register(registry, "n1", address="10.0.0.1:5000")
    current = [parse(data({"qwen": {"split": {"qwen-v1": 90, "qwen-v2": 10}}}), "server.yaml")]
    fleet = FleetEndpoints(registry, lambda: current[0])
    before = fleet.version
    assert [v.weight for v in fleet.traffic()["qwen"].versions] == [90, 10]
    current[0] = parse(data({"qwen": {"split": {"qwen-v1": 50, "qwen-v2": 50}}}), "server.yaml")
    fleet.refresh()
    assert fleet.version == before + 1  # the router re-reads: new weights, nothing restarted
    assert [v.weight for v in fleet.traffic()["qwen"].versions] == [50, 50]
    fleet.refresh()
    assert fleet.version == before + 1  # unchanged: no new version


async def test_a_standby_routes_with_the_splits_the_leader_published() -> None:
    split = core.TrafficSplit("qwen", (core.TrafficVersion("qwen-v1", "qwen-v1", 1),))
    ep = Endpoint("r1@n1", "qwen-v1", "vllm", "10.0.0.1", 8100)
    body = encode_endpoints({"qwen-v1": (ep,)}, {"qwen": split})
    assert decode_published(body) == ({"qwen-v1": (ep,)}, {"qwen": split}, {})

    class Store:
        async def publish_endpoints(self, epoch: int, body_json: str) -> bool:
            return True

        async def published_endpoints(self) -> tuple[int, str, float] | None:
            return 1, body, 0.0

    published = PublishedEndpoints(Store())
    await published.read_once()
    assert dict(published.traffic()) == {"qwen": split}
    assert published.snapshot()["qwen-v1"] == (ep,)


def test_router_workers_get_the_splits_over_their_channel() -> None:
    from llmgw.cp._workers import RemoteEndpoints, _encode

    split = core.TrafficSplit(
        "qwen", (core.TrafficVersion("qwen-v1", "qwen-v1", 9), core.TrafficVersion("v2", "v2", 1)),
        (("key-b", "v2"),),
    )  # fmt: skip
    source = StaticEndpoints(
        [Endpoint("r1@n1", "qwen-v1", "vllm", "10.0.0.1", 8100)], ["v2"], [split]
    )
    remote = RemoteEndpoints()
    remote.apply(json.loads(json.dumps(_encode(source))))  # as the JSON line carries it
    assert dict(remote.traffic()) == {"qwen": split}
    assert remote.version == source.version
