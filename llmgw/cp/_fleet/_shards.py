"""Turning an operator's request into a shard an agent can run.

`manual_shard` serves `llmgw ctl shard start`: one node, one replica, the
engine adapter deciding the exact command. Placement (which node, which cards)
is the catalog's job; here the operator names the node, and the first healthy
cards of the node are used.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath

from llmgw import engines, model
from llmgw.cp._fleet._registry import NodeRecord
from llmgw.errors import UsageError

PORTS = (8100, 8999)


def served_name_for(model_ref: str) -> str:
    """`/models/qwen2-0.5b.gguf` -> `qwen2-0.5b`; a hub id stays as it is."""
    if model_ref.startswith("/") or model_ref.startswith("."):
        path = PurePosixPath(model_ref.rstrip("/"))
        return path.stem if path.suffix in (".gguf", ".bin", ".safetensors") else path.name
    return model_ref


def to_shard_spec(
    shard_id: str,
    profile: engines.EngineProfile,
    plan: engines.LaunchPlan,
    *,
    fingerprint: str | None = None,
) -> model.ShardSpec:
    processes = tuple(
        model.ProcessSpec(
            name=p.name,
            argv=tuple(p.argv),
            env=tuple(model.EnvVar(k, v) for k, v in p.env),
            role=p.role,
            wait_host=p.wait_for[0] if p.wait_for else None,
            wait_port=p.wait_for[1] if p.wait_for else None,
            wait_timeout_s=p.wait_timeout_s,
        )
        for p in plan.processes
    )
    return model.ShardSpec(
        shard_id=shard_id,
        model=profile.model,
        engine=profile.engine,
        processes=processes,
        served_names=tuple(profile.served_names),
        serves_http=plan.serves_http,
        port=plan.port,
        health_path=plan.health_path,
        models_path=plan.models_path,
        profile_fingerprint=fingerprint,
    )


def ports_taken(records: Iterable[NodeRecord]) -> dict[str, set[int]]:
    """Ports of running shards, by host, not by node: agents sharing a host share its ports."""
    taken: dict[str, set[int]] = {}
    for rec in records:
        taken.setdefault(rec.host, set()).update(s.port for s in rec.shards if s.port is not None)
    return taken


def free_port(taken: set[int], first: int, last: int) -> int:
    # At random among the free ones: a port held by something outside llmgw
    # would otherwise be chosen again for every replacement.
    free = [p for p in range(first, last + 1) if p not in taken]
    if not free:
        raise UsageError(f"no free port in {first}-{last}")
    return secrets.choice(free)


def manual_shard(
    rec: NodeRecord,
    taken: set[int],
    *,
    engine: str,
    model_ref: str,
    port: int | None,
    args: Sequence[str],
    gpus: int | None,
    served_name: str | None,
) -> model.ShardSpec:
    """`taken`: ports already used on the node's host."""
    node_id, inventory = rec.node_id, rec.inventory
    if engine not in engines.ENGINES:
        raise UsageError(f"unknown engine {engine!r}; known: {', '.join(engines.ENGINES)}")
    if port is not None and port in taken:
        raise UsageError(f"{node_id}: port {port} is already used by another shard")
    port = port or free_port(taken, PORTS[0], PORTS[1])
    cards: tuple[model.Gpu, ...] = ()
    gpu_class = None
    if engine != "llama-server" or gpus:
        want = gpus or 1
        healthy = [g for g in (inventory.gpus or ()) if not g.ecc_uncorrected]
        if len(healthy) < want:
            raise UsageError(f"{node_id}: has {len(healthy)} healthy GPU(s), {engine} needs {want}")
        cards = tuple(healthy[:want])
        gpu_class = cards[0].gpu_class
    name = served_name or served_name_for(model_ref)
    profile = engines.EngineProfile(
        engine=engine,
        model=model_ref,
        served_names=(name,),
        gpu_class=gpu_class,
        gpus_per_node=len(cards),
        nodes=1,
        tp=1 if engine == "llama-server" else max(1, len(cards)),
        pp=1,
        engine_args=tuple(args),
    )
    assignment = engines.Assignment(
        rank=0,
        node_addresses=(rec.host,),
        gpus=cards,
        port=port,
        rendezvous_port=port + 1000,
    )
    engines.validate(profile, [cards] if cards else None)
    plan = engines.plan_launch(profile, assignment)
    shard_id = f"{name.replace('/', '-')[:40]}-{secrets.token_hex(3)}"
    return to_shard_spec(shard_id, profile, plan)
