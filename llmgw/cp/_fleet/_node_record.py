"""One node's record in the registry: how a registration builds it (or refuses an
impostor), how a heartbeat changes it, and the view the admin API shows of it.

Pure but for one log line (a refused impostor): the registry passes the clock
values in. A record lives as long as its
node's registration (`generation` tells one session from the next); the
registry owns the liveness transitions, this module only the fields.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import attrs

from llmgw import core, model
from llmgw.errors import RegistrationRefused
from llmgw.rpc import AgentHandle, PeerInfo

log = logging.getLogger("llmgw.cp.registry")  # the registry's component

REMOVED_KEPT = 1024  # removed shards whose last seq a node's record remembers


@attrs.define
class NodeRecord:
    node_id: str
    liveness: core.Liveness
    generation: int  # bumped on every registration; older sessions are ignored
    address: str
    agent_version: str
    inventory: model.Inventory
    shards: tuple[model.ShardReport, ...]
    agent: AgentHandle | None
    last_seen_wall: float
    registered_at: float = 0.0  # clock value of this registration
    conn_id: int | None = None  # the RPC connection, closed when this control plane steps down
    # Shards no longer held, by id: the seq of their last report, so a report older than
    # it (a command's reply overtaken by the removal) does not bring one back. Bounded.
    removed: dict[str, int] = attrs.field(factory=dict)

    def newest_seq(self, shard_id: str) -> int:
        """The seq of the newest report of the shard this record has seen (0: none)."""
        held = next((s for s in self.shards if s.shard_id == shard_id), None)
        return held.seq if held is not None else self.removed.get(shard_id, 0)

    def take(self, shard: model.ShardReport) -> bool:
        """Apply a report of one of the node's shards; False, and nothing changed, when it
        is older than the newest held or removed (a command's reply that the agent's own
        later report overtook)."""
        newest = self.newest_seq(shard.shard_id)
        if shard.seq and shard.seq < newest:
            log.debug("node %s: shard %s report %d (%s) is older than %d: dropped",
                      self.node_id, shard.shard_id, shard.seq, shard.state, newest)  # fmt: skip
            return False
        self.shards = (*(s for s in self.shards if s.shard_id != shard.shard_id), shard)
        if shard.state == model.ShardState.STOPPED:
            self.remove_shard(shard.shard_id)  # gone, its seq remembered
        return True

    def remove_shard(self, shard_id: str) -> None:
        seq = self.newest_seq(shard_id)
        self.shards = tuple(s for s in self.shards if s.shard_id != shard_id)
        if seq:
            self.removed.pop(shard_id, None)
            self.removed[shard_id] = seq
            while len(self.removed) > REMOVED_KEPT:
                del self.removed[next(iter(self.removed))]

    @property
    def host(self) -> str:
        """The host part of the agent's address: where its engines listen."""
        return self.address.rsplit(":", 1)[0].strip("[]")


def impostor(peer: PeerInfo, hello: model.Hello) -> RegistrationRefused | None:
    """The refusal of an agent whose certificate names another node; None: it is who
    it says it is."""
    if peer.common_name == hello.node_id:
        return None
    log.warning(
        "refused registration from %s: its certificate is for node %r but it claims to be node %r",
        peer.address,
        peer.common_name,
        hello.node_id,
    )
    return RegistrationRefused(
        f"refused: the client certificate is for node {peer.common_name!r} "
        f"but the agent claims to be node {hello.node_id!r}; issue one with "
        f"`llmgw ctl cert agent {hello.node_id}` or fix node_id in agent.yaml"
    )


def registered(
    peer: PeerInfo,
    hello: model.Hello,
    agent: AgentHandle,
    *,
    generation: int,
    now: float,
    wall: float,
) -> NodeRecord:
    """The record of a registration just accepted: ready, with what the hello said."""
    return NodeRecord(
        node_id=hello.node_id,
        liveness=core.registered(now),
        generation=generation,
        address=peer.address,
        agent_version=hello.agent_version,
        inventory=hello.inventory,
        shards=hello.shards,
        agent=agent,
        last_seen_wall=wall,
        registered_at=now,
        conn_id=peer.conn_id,
    )


def with_heartbeat(inventory: model.Inventory, beat: model.Heartbeat) -> model.Inventory:
    """The inventory after a heartbeat: its usage always, and what else it carried."""
    changes: dict[str, object] = {"usage": beat.usage}
    if beat.weights is not None:
        changes["weights"] = beat.weights
    if beat.engines is not None:
        changes["engines"] = beat.engines
    if beat.warnings is not None:
        changes["warnings"] = beat.warnings
    return attrs.evolve(inventory, **changes)  # type: ignore[arg-type]


def views(
    records: Iterable[NodeRecord],
    now_clock: float,
    now_wall: float,
    cordoned: Mapping[str, str],
    draining: Mapping[str, str],
) -> list[model.NodeView]:
    """The nodes as the admin API shows them; `since` on the wall clock."""
    return [
        model.NodeView(
            node_id=rec.node_id,
            state=rec.liveness.state.value,
            state_reason=rec.liveness.reason,
            since=now_wall - (now_clock - rec.liveness.since),
            last_seen=rec.last_seen_wall,
            address=rec.address,
            agent_version=rec.agent_version,
            inventory=rec.inventory,
            shards=rec.shards,
            cordoned=cordoned.get(rec.node_id),
            draining=draining.get(rec.node_id),
            generation=rec.generation,
        )
        for rec in records
    ]
