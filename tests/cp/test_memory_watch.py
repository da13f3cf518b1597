"""The reconciler's memory watch (llmgw/cp/_fleet/_memory_watch.py) on a real NodeRegistry:
what heartbeats say each shard holds, read against its claim card by card."""

from __future__ import annotations

from typing import Any

import trio

from llmgw import core, model
from llmgw.cp._fleet._memory_watch import OVER_CLAIM, MemoryWatch
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.rpc import PeerInfo

TOTAL = 81559
CLAIM = 24576


def shard(sid: str, claim: int | None = CLAIM, uuid: str = "GPU-a") -> model.ShardReport:
    return model.ShardReport(
        shard_id=sid, model="m", engine="vllm", state="ready", replica_id=f"r-{sid}",
        model_name="small", gpus=(uuid,), gpu_memory_mib=claim,
    )  # fmt: skip


async def setup(registry: NodeRegistry, shards: tuple[model.ShardReport, ...]) -> Any:
    gpus = (
        model.Gpu(0, "GPU-a", "H100", "h100-80g", memory_total_mib=TOTAL),
        model.Gpu(1, "GPU-b", "H100", "h100-80g", memory_total_mib=TOTAL),
    )
    inv = model.Inventory(model.Host("g1"), gpus=gpus)
    peer = PeerInfo(1, "10.0.0.1:5000", "g1", trio.Event())
    session, _ = await registry.register(peer, model.Hello("g1", "test", inv, shards), None)  # type: ignore[arg-type]
    return session


async def beat(session: Any, seq: int, used: int, held: dict[str, int | None]) -> None:
    usage = model.Usage(
        gpus=(model.GpuUsage(0, memory_used_mib=used, foreign_memory_mib=0),),
        shards=tuple(model.ShardUsage(s, gpu_memory_mib=m) for s, m in held.items()),
    )
    await session.heartbeat(model.Heartbeat(seq=seq, usage=usage))


def over_events(registry: NodeRegistry) -> list[str]:
    return [e.message for e in registry.events.events(limit=100) if e.kind == OVER_CLAIM]


async def test_over_claim_is_said_once_per_episode_and_a_full_card_replaces_the_worst() -> None:
    policy = core.LivenessPolicy(heartbeat_interval_s=1.0, lost_after_s=5.0)
    registry = NodeRegistry(policy)
    shards = (shard("a"), shard("b"), shard("c"), shard("w", claim=None, uuid="GPU-b"))
    session = await setup(registry, shards)
    watch = MemoryWatch(registry)
    reported = {f"r-{s}" for s in "abcw"}
    await beat(session, 1, 60000, {"a": 20000, "b": 20000, "c": None, "w": 70000})
    watch.note(reported)
    assert over_events(registry) == [] and watch.reasons == {}  # a whole card is not watched

    # b grows past its claim: said once, however many passes see it.
    await beat(session, 2, 70000, {"a": 20000, "b": 30000, "c": None})
    watch.note(reported)
    watch.note(reported)
    said = "replica r-b over its claim on gpu 0 of g1: holds 30000 MiB, claims 24576 (5424 over)"
    assert over_events(registry) == [said]
    view = core.ReplicaView("r-b", "small", "ready", ("g1",), 0.0, False, None)
    assert watch.annotate([view])[0].reason == said.removeprefix("replica r-b ")
    assert watch.reasons == {}  # the card has room: nothing replaced

    # Back within, then over again: a new episode, said again.
    await beat(session, 3, 60000, {"a": 20000, "b": 24000, "c": None})
    watch.note(reported)
    assert watch.annotate([view])[0].reason is None
    await beat(session, 4, 70000, {"a": 20000, "b": 26000, "c": None})
    watch.note(reported)
    assert len(over_events(registry)) == 2

    # The card fills (memory.used within the margin of its total): the one most over goes.
    await beat(session, 5, TOTAL - 10, {"a": 25000, "b": 40000, "c": None})
    watch.note(reported)
    assert watch.reasons == {
        "r-b": f"out of memory: gpu 0 of g1 holds {TOTAL - 10} of {TOTAL} MiB; "
        "this replica holds 40000 MiB, claims 24576 (15424 over)"
    }
    # Replacing it frees the card; the word stays while the replica is reported, and goes
    # with it; a's own over-claim was said once.
    await beat(session, 6, 50000, {"a": 25000, "c": None})
    watch.note(reported)
    assert list(watch.reasons) == ["r-b"]
    watch.note(reported - {"r-b"})
    assert watch.reasons == {}
    assert sum("r-a" in m for m in over_events(registry)) == 1
