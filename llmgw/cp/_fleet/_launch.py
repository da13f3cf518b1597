"""A placed replica's shard specs: what each rank's agent is told to start.

Pure: placement chose the nodes and cards (`core.Placement`); this picks each
rank's engine port and the leader's rendezvous port (free on its host, counting
those of the shards reported and of the starts still in flight), the socket
interface the node names for the chosen fabric, and turns the engine's launch
plan (llmgw/engines) into a `model.ShardSpec` per rank, the leader first.

`relaunch_spec` is a running one-node replica's spec again with another list of LoRA
adapters (what llama-server needs to hold another adapter: llmgw/cp/_fleet/_adapters.py):
the same port, cards and fingerprint, from the profile it was started from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from llmgw import core, engines, model
from llmgw.cp._fleet._catalog import Catalog, CatalogModel, Profile, engine_profile
from llmgw.cp._fleet._node_record import NodeRecord
from llmgw.cp._fleet._shards import free_port, ports_taken, to_shard_spec

RENDEZVOUS_PORTS = (29500, 29999)


def shard_specs(
    catalog: Catalog,
    m: CatalogModel,
    profile: Profile,
    where: core.Placement,
    replica_id: str,
    records: Mapping[str, NodeRecord],
    *,
    flying: Iterable[tuple[str, model.ShardSpec]],
    engine_ports: tuple[int, int],
) -> list[tuple[str, model.ShardSpec]]:
    """(node, spec) for each rank of `m` (of `catalog`, whose declared engine versions
    are in the fingerprint). `flying`: the ranks of starts in flight, whose ports
    are taken too; `engine_ports`: the range for a profile with no port_range."""
    taken = ports_taken(records.values())
    for node_id, spec in flying:
        if node_id in records and spec.port is not None:
            taken.setdefault(records[node_id].host, set()).add(spec.port)
    first, last = profile.port_range or engine_ports
    leader_host = records[where.ranks[0].node_id].host
    rendezvous = free_port(taken.get(leader_host, set()), *RENDEZVOUS_PORTS)
    taken.setdefault(leader_host, set()).add(rendezvous)
    addresses = tuple(records[r.node_id].host for r in where.ranks)
    fp = catalog.fingerprint(m, profile)
    out = []
    for r in where.ranks:
        rec = records[r.node_id]
        host = rec.host
        port = free_port(taken.get(host, set()), first, last)
        taken.setdefault(host, set()).add(port)
        by_index = {g.index: g for g in rec.inventory.gpus or ()}
        cards = tuple(by_index[i] for i in r.gpu_indexes)
        share = _fraction(profile, cards, r.memory_mib)
        eprofile = engine_profile(m, profile, gpu_memory_fraction=share)
        if r.mig_uuids:  # the instances stand for their cards (CUDA_VISIBLE_DEVICES)
            cards = tuple(attrs.evolve(g, uuid=u) for g, u in zip(cards, r.mig_uuids, strict=True))
        assignment = engines.Assignment(
            rank=r.rank,
            node_addresses=addresses,
            gpus=cards,
            port=port,
            rendezvous_port=rendezvous,
            fabric_adapters=tuple(r.fabric_adapters),
            socket_interface=core.socket_interface(rec, where.fabric),
        )
        launch = engines.plan_launch(eprofile, assignment)
        spec = to_shard_spec(f"{replica_id}.{r.rank}", eprofile, launch, fingerprint=fp)
        spec = attrs.evolve(
            spec,
            replica_id=replica_id,
            model_name=m.name,
            rank=r.rank,
            ranks=len(where.ranks),
            gpus=tuple(r.mig_uuids or r.gpu_uuids),
            source=m.source,
            gpu_memory_mib=r.memory_mib,
        )
        out.append((r.node_id, spec))
    return out


def _fraction(
    profile: Profile, cards: tuple[model.Gpu, ...], memory_mib: int | None
) -> float | None:
    """A share's fraction of its card for the engine (the smallest card's, if several:
    the engine takes the same fraction of each); None: whole cards or a MIG instance."""
    if memory_mib is None or profile.gpu_memory_gib is None or not cards:
        return None
    totals = [g.memory_total_mib for g in cards if g.memory_total_mib]
    if len(totals) != len(cards):
        return None  # placement shares only cards of known size
    return engines.memory_fraction(profile.gpu_memory_gib, min(totals))


def relaunch_spec(
    catalog: Catalog,
    m: CatalogModel,
    profile: Profile,
    shard: model.ShardReport,
    record: NodeRecord,
    adapters: tuple[tuple[str, str], ...],
) -> model.ShardSpec:
    """`shard`'s spec (a one-node replica of `m` from `profile`, on `record`'s node) with
    `adapters` ((name, source), in the engine's order) held from launch."""
    if shard.ranks != 1 or shard.port is None or shard.replica_id is None:
        raise ValueError(f"shard {shard.shard_id} is not a running one-node replica")
    by_uuid = {g.uuid: g for g in record.inventory.gpus or ()}
    missing = [u for u in shard.gpus if u not in by_uuid]
    if missing:
        raise ValueError(f"node {record.node_id} no longer lists card(s) {', '.join(missing)}")
    cards = tuple(by_uuid[u] for u in shard.gpus)
    assignment = engines.Assignment(
        rank=0,
        node_addresses=(record.host,),
        gpus=cards,
        port=shard.port,
        rendezvous_port=shard.port,  # one node: nothing meets there
    )
    share = _fraction(profile, cards, shard.gpu_memory_mib)
    eprofile = attrs.evolve(
        engine_profile(m, profile, gpu_memory_fraction=share),
        adapters=tuple(engines.LaunchAdapter(name, source) for name, source in adapters),
    )
    launch = engines.plan_launch(eprofile, assignment)
    spec = to_shard_spec(shard.shard_id, eprofile, launch, fingerprint=shard.profile_fingerprint)
    return attrs.evolve(
        spec,
        replica_id=shard.replica_id,
        model_name=m.name,
        rank=0,
        ranks=1,
        gpus=tuple(shard.gpus),
        source=m.source,
        adapters=tuple(name for name, _ in adapters),
        adapter_sources=tuple(source for _, source in adapters),
        gpu_memory_mib=shard.gpu_memory_mib,
    )
