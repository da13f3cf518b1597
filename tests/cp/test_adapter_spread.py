"""The leader's adapter manager (llmgw/cp/_fleet/_adapters.py) spreads adapters over a
base's replicas by what they draw: its own `step`, on a fleet of two vLLM replicas whose
agents hold every fetch (so each load stays in flight and the test reads where it went).

Without the spread, both replicas look alike (no request in flight on either) and the
plan's last tie-break, the smallest id, sends every load to the first replica: the
second adapter then waits for the first's load, and a fleet that warms up loads one
replica with all the popular adapters.
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from llmgw import core, model
from llmgw.cp._fleet._adapters import DRAW_S, AdapterManager
from llmgw.cp._fleet._catalog import parse
from llmgw.cp._fleet._node_record import NodeRecord

PROFILE = {"engine": "vllm", "gpu_class": "h100-80g", "max_adapters": 2}
CATALOG = parse(
    {
        "models": [{"name": "qwen", "source": "hub/qwen", "replicas": 2, "profiles": [PROFILE]}],
        "adapters": [
            {"name": n, "base": "qwen", "source": f"mirror:/adapters/{n}"}
            for n in ("hot", "warm", "cool", "cold")
        ],
    },
    "server.yaml",
)


class HeldAgent:
    """An agent whose adapter fetches never end: a load stays in flight."""

    def __init__(self) -> None:
        self.fetches: list[str] = []

    async def fetch_adapter(self, epoch: int, source: str, engine: str) -> str:
        self.fetches.append(source)
        await trio.sleep_forever()
        raise AssertionError("unreachable")


class Fleet:
    def __init__(self) -> None:
        m = CATALOG.models[0]
        fingerprint = CATALOG.fingerprint(m, m.profiles[0])
        self.agents = {n: HeldAgent() for n in ("n1", "n2")}
        self.nodes = {
            n: NodeRecord(
                node_id=n,
                liveness=core.Liveness(core.NodeState.READY, 0.0, "ok", 0.0, True),
                generation=1,
                address="127.0.0.1:1",
                agent_version="t",
                inventory=model.Inventory(model.Host(n, cpu_count=None), gpus=None),
                shards=(
                    model.ShardReport(
                        f"s-{n}",
                        "hub/qwen",
                        "vllm",
                        model.ShardState.READY,
                        port=9,
                        profile_fingerprint=fingerprint,
                        replica_id=f"qwen-{n}",
                        model_name="qwen",
                    ),
                ),
                agent=None,
                last_seen_wall=0.0,
            )
            for n in ("n1", "n2")
        }
        self.demand: dict[str, core.RouterLoad] = {}

    # The registry the manager reads.
    def epoch(self) -> int:
        return 1

    def records(self) -> list[NodeRecord]:
        return list(self.nodes.values())

    def record(self, node_id: str) -> NodeRecord | None:
        return self.nodes.get(node_id)

    def agent(self, node_id: str) -> Any:
        return self.agents.get(node_id)

    def note_shard(self, node_id: str, shard: model.ShardReport) -> None:
        raise AssertionError("a runtime load reports no shard")


class Events:
    def record(self, kind: str, message: str, *, model_name: str | None = None) -> object:
        return None


def manager(fleet: Fleet) -> AdapterManager:
    return AdapterManager(
        lambda: CATALOG,
        fleet,
        acting=lambda: True,
        demand=lambda names: {n: fleet.demand[n] for n in names if n in fleet.demand},
        in_flight=lambda endpoint: 0,
        refresh=lambda: None,
        events=Events(),
    )


async def test_two_adapters_waiting_at_once_load_on_two_replicas() -> None:
    fleet = Fleet()
    adapters = manager(fleet)
    async with trio.open_nursery() as nursery:
        adapters._nursery = nursery
        fleet.demand = {"hot": core.RouterLoad(queued=6), "warm": core.RouterLoad(queued=2)}
        adapters.step(1000.0)
        await trio.testing.wait_all_tasks_blocked()
        # hot first (the catalog's order), on the first replica; warm does not wait for
        # it: the first replica draws hot's six waiting requests, the second none.
        assert adapters.loading("hot") == ("qwen-n1",)
        assert adapters.loading("warm") == ("qwen-n2",)
        assert fleet.agents["n1"].fetches == ["mirror:/adapters/hot"]
        assert fleet.agents["n2"].fetches == ["mirror:/adapters/warm"]
        assert adapters.draw("hot") == 6.0 and adapters.draw("cold") == 0.0
        nursery.cancel_scope.cancel()


async def test_a_third_adapter_goes_where_the_held_ones_draw_least() -> None:
    fleet = Fleet()
    adapters = manager(fleet)
    # n1 holds hot (busy), n2 holds warm (quiet): both have a free slot and no request
    # in flight counted against them, so only the draw tells them apart.
    adapters._runtime = {"qwen-n1": ("hot",), "qwen-n2": ("warm",)}
    async with trio.open_nursery() as nursery:
        adapters._nursery = nursery
        fleet.demand = {"hot": core.RouterLoad(in_flight=5), "warm": core.RouterLoad(in_flight=1)}
        adapters.step(1000.0)
        # The averages move toward what is drawn now, over about DRAW_S: half a time
        # constant later, hot has come down from 5 toward 0, not to it.
        fleet.demand = {"hot": core.RouterLoad(), "warm": core.RouterLoad(in_flight=1)}
        adapters.step(1000.0 + DRAW_S / 2)
        hot = adapters.draw("hot")
        assert hot is not None and 2.5 < hot < 4.0
        fleet.demand["cool"] = core.RouterLoad(queued=1)
        adapters.step(1000.0 + DRAW_S / 2 + 0.25)
        await trio.testing.wait_all_tasks_blocked()
        assert adapters.loading("cool") == ("qwen-n2",)
        assert fleet.agents["n1"].fetches == []
        nursery.cancel_scope.cancel()
