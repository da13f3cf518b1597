"""A placed replica's shard specs: what each rank's agent is told to start.

Pure: placement chose the nodes and cards (`core.Placement`); this picks each
rank's engine port and the leader's rendezvous port (free on its host, counting
those of the shards reported and of the starts still in flight), the socket
interface the node names for the chosen fabric, and turns the engine's launch
plan (llmgw/engines) into a `model.ShardSpec` per rank, the leader first.
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
    eprofile = engine_profile(m, profile)
    fp = catalog.fingerprint(m, profile)
    out = []
    for r in where.ranks:
        rec = records[r.node_id]
        host = rec.host
        port = free_port(taken.get(host, set()), first, last)
        taken.setdefault(host, set()).add(port)
        by_index = {g.index: g for g in rec.inventory.gpus or ()}
        assignment = engines.Assignment(
            rank=r.rank,
            node_addresses=addresses,
            gpus=tuple(by_index[i] for i in r.gpu_indexes),
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
            gpus=tuple(r.gpu_uuids),
            source=m.source,
        )
        out.append((r.node_id, spec))
    return out
