"""The port chooser and `ctl shard start`'s checks (llmgw/cp/_fleet/_shards.py)."""

from __future__ import annotations

import pytest
from helpers import register

from llmgw import core, model
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._shards import PORTS, free_port, manual_shard, ports_taken, served_name_for
from llmgw.errors import UsageError


def test_free_port_never_picks_a_taken_one_and_spreads() -> None:
    taken = {8100, 8101, 8103}
    picks = {free_port(taken, 8100, 8105) for _ in range(300)}
    # Every free one comes up (at random: a port held outside llmgw is not chosen
    # again and again), and no taken one ever does.
    assert picks == {8102, 8104, 8105}
    assert free_port({1, 2}, 1, 3) == 3
    assert free_port(set(), 7000, 7000) == 7000


def test_no_free_port_names_the_range() -> None:
    with pytest.raises(UsageError, match=r"^no free port in 8100-8102$"):
        free_port({8100, 8101, 8102}, 8100, 8102)


def shard(sid: str, port: int | None, state: str = "ready") -> model.ShardReport:
    return model.ShardReport(sid, "/m", "llama-server", state, port=port)


async def test_ports_are_taken_per_host_not_per_node() -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    # Two agents on one host (node-a and node-b) and one on another.
    await register(
        registry, "node-a", shards=(shard("s1", 8100), shard("s2", None)), address="10.1.1.1:5000"
    )
    await register(registry, "node-b", shards=(shard("s3", 8101),), address="10.1.1.1:5001")
    await register(registry, "node-c", shards=(shard("s4", 8100),), address="[fd00::7]:5000")
    assert ports_taken(registry.records()) == {"10.1.1.1": {8100, 8101}, "fd00::7": {8100}}


def test_served_name_from_a_path_or_an_id() -> None:
    assert served_name_for("/models/qwen2-0.5b.gguf") == "qwen2-0.5b"
    assert served_name_for("/models/llama-3-8b/") == "llama-3-8b"
    assert served_name_for("./weights/model.safetensors") == "model"
    assert served_name_for("Qwen/Qwen2-0.5B") == "Qwen/Qwen2-0.5B"


async def test_manual_shard_checks_name_the_node_and_the_numbers() -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    gpus = (
        model.Gpu(0, "GPU-0", "H100", "h100-80g"),
        model.Gpu(1, "GPU-1", "H100", "h100-80g", ecc_uncorrected=3),
    )
    await register(registry, "g1", inventory=model.Inventory(model.Host("g1"), gpus=gpus))
    rec = registry.record("g1")
    assert rec is not None
    kw = {"model_ref": "/models/m", "args": (), "served_name": None}
    with pytest.raises(UsageError, match=r"^unknown engine 'tgi'; known: "):
        manual_shard(rec, set(), engine="tgi", port=None, gpus=None, **kw)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"^g1: port 8200 is already used by another shard$"):
        manual_shard(rec, {8200}, engine="vllm", port=8200, gpus=None, **kw)  # type: ignore[arg-type]
    # One card has uncorrected ECC errors: 1 healthy, 2 asked for.
    with pytest.raises(UsageError, match=r"^g1: has 1 healthy GPU\(s\), vllm needs 2$"):
        manual_shard(rec, set(), engine="vllm", port=None, gpus=2, **kw)  # type: ignore[arg-type]
    spec = manual_shard(rec, {8100}, engine="vllm", port=None, gpus=1, **kw)  # type: ignore[arg-type]
    assert spec.port is not None and PORTS[0] <= spec.port <= PORTS[1] and spec.port != 8100
    assert spec.served_names == ("m",) and spec.shard_id.startswith("m-")
