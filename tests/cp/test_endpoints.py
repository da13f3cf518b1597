"""The router's view of the fleet (llmgw/cp/_fleet/_endpoints.py): which shards are endpoints."""

from __future__ import annotations

from typing import Any

import trio
from helpers import register

from llmgw import core, model
from llmgw.cp._fleet._catalog import Catalog, parse
from llmgw.cp._fleet._endpoints import FleetEndpoints, endpoint_id
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._wake import Wakeup
from llmgw.router._types import Endpoint, Hold

POLICY = core.LivenessPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, lost_after_s=5.0)


def catalog() -> Catalog:
    cpu = [{"engine": "llama-server", "gpus_per_node": 0}]
    return parse(
        {
            "models": [
                {
                    "name": "chat",
                    "source": "/m/chat.gguf",
                    "served_names": ["chat", "chat-v2"],
                    "profiles": cpu,
                },
                {"name": "embed", "source": "/m/embed.gguf", "profiles": cpu},
            ]
        },
        "server.yaml",
    )


def shard(
    sid: str,
    name: str | None,
    port: int | None = 8100,
    state: str = "ready",
    rank: int = 0,
    replica: str | None = None,
) -> model.ShardReport:
    return model.ShardReport(
        sid,
        f"/m/{name}.gguf",
        "llama-server",
        state,
        port=port,
        replica_id=replica or f"r-{sid}",
        model_name=name,
        rank=rank,
        ranks=2 if rank else 1,
    )


async def test_only_ready_serving_ranks_of_catalog_models_are_endpoints() -> None:
    registry = NodeRegistry(POLICY)
    await register(
        registry,
        "n1",
        address="10.0.0.1:5000",
        shards=(
            shard("a", "chat"),
            shard("b", "chat", port=8101, state="loading"),  # not ready
            shard("c", "chat", port=8102, rank=1),  # a worker rank: not the one that serves
            shard("d", None, port=8103),  # started by hand: not the catalog's
            shard("e", "gone", port=8104),  # a model no longer in the catalog
            shard("f", "embed", port=None),  # no port known
            shard("g", "embed", port=8105),
        ),
    )
    fleet = FleetEndpoints(registry, catalog)
    assert dict(fleet.snapshot()) == {
        "chat": (Endpoint("r-a@n1", "chat", "llama-server", "10.0.0.1", 8100),),
        "chat-v2": (Endpoint("r-a@n1", "chat-v2", "llama-server", "10.0.0.1", 8100),),
        "embed": (Endpoint("r-g@n1", "embed", "llama-server", "10.0.0.1", 8105),),
    }
    assert endpoint_id("r-a", "n1") == "r-a@n1"
    assert "v1" in repr(fleet) and fleet.version == 1


async def test_version_moves_only_when_the_list_changes(autojump_clock: Any) -> None:
    registry = NodeRegistry(POLICY)
    retiring: set[str] = set()
    fleet = FleetEndpoints(registry, catalog, lambda: retiring)
    assert fleet.version == 1 and all(eps == () for eps in fleet.snapshot().values())
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _agent, peer, session = await register(
            registry, "n1", address="10.0.0.1:5000", shards=(shard("a", "chat"),)
        )
        fleet.refresh()
        assert fleet.version == 2 and len(fleet.snapshot()["chat"]) == 1
        fleet.refresh()  # nothing changed: the router is not made to re-read it
        assert fleet.version == 2

        # Unreachable (the agent is away, its engine serves on): still routed.
        peer.closed.set()
        await trio.sleep(0.5)
        assert registry.views()[0].state == "unreachable"
        fleet.refresh()
        assert fleet.version == 2 and len(fleet.snapshot()["chat"]) == 1
        # Lost: no longer.
        await trio.sleep(POLICY.lost_after_s + 1.5)
        assert registry.views()[0].state == "lost"
        fleet.refresh()
        assert fleet.version == 3 and fleet.snapshot()["chat"] == ()

        # Registered again, then its replica named retiring (a drain): left out.
        await register(registry, "n1", address="10.0.0.1:5000", shards=(shard("a", "chat"),))
        fleet.refresh()
        assert fleet.version == 4 and len(fleet.snapshot()["chat"]) == 1
        retiring.add("r-a")
        fleet.refresh()
        assert fleet.version == 5 and fleet.snapshot()["chat"] == ()
        del session
        nursery.cancel_scope.cancel()


async def test_a_register_storm_does_not_walk_the_fleet_per_registration() -> None:
    # Recomputing on every registration made a storm of N agents cost O(N^2)
    # (bench/fleet.py); the list is recomputed once, when next read.
    stale = Wakeup()  # made first: the registry pokes it, the list heeds it (as in _main)
    registry = NodeRegistry(POLICY, listeners=(stale.poke,))
    fleet = FleetEndpoints(registry, catalog)
    stale.on_poke(fleet.refresh)
    walks = 0
    records = registry.records

    def counting() -> list[Any]:
        nonlocal walks
        walks += 1
        return records()

    registry.records = counting  # type: ignore[method-assign]
    for i in range(50):
        await register(
            registry,
            f"n{i}",
            address=f"10.0.1.{i}:5000",
            shards=(shard(f"s{i}", "chat", replica=f"r{i}"),),
        )
    assert walks == 0
    assert len(fleet.snapshot()["chat"]) == 50 and walks == 1
    assert fleet.version == 1 and len(fleet.snapshot()["embed"]) == 0 and walks == 1


def test_a_model_the_autoscaler_may_take_to_zero_has_a_hold_on_each_served_name() -> None:
    cpu = [{"engine": "llama-server", "gpus_per_node": 0}]
    scaled = parse(
        {
            "models": [
                {
                    "name": "chat",
                    "source": "/m/chat.gguf",
                    "served_names": ["chat", "chat-v2"],
                    "autoscale": {"min": 0, "max": 4, "hold_max": 16, "hold_s": 90},
                    "profiles": cpu,
                },
                # Defaults: the core policy's (llmgw/core/_autoscale.py).
                {"name": "code", "source": "/m/code.gguf", "autoscale": {"max": 2},
                 "profiles": cpu},
                # Never below one replica: nothing to hold for.
                {"name": "embed", "source": "/m/embed.gguf", "autoscale": {"min": 1, "max": 3},
                 "profiles": cpu},
                {"name": "fixed", "source": "/m/fixed.gguf", "profiles": cpu},
            ]
        },
        "server.yaml",
    )  # fmt: skip
    current = [catalog()]
    fleet = FleetEndpoints(NodeRegistry(POLICY), lambda: current[0])
    assert fleet.holds() == {}  # no model autoscales
    v = fleet.version
    current[0] = scaled
    fleet.refresh()
    defaults = core.AutoscalePolicy()
    assert dict(fleet.holds()) == {
        "chat": Hold(16, 90.0),
        "chat-v2": Hold(16, 90.0),
        "code": Hold(defaults.hold_max, defaults.hold_s),
    }
    assert fleet.version > v  # the router re-reads: its holds changed
