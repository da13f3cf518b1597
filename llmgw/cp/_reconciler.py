"""The reconciler's I/O shell: observe, plan (pure), act, and again.

Every `interval_s` it turns the registry's shard reports into observations,
asks `core.reconcile` what to do, places each Start with `core.place`, and
sends start/stop commands through the agents' capabilities. After the
control plane starts it waits `settle_s` before acting, so that agents
re-register and their replicas are adopted rather than started again.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

import attrs
import trio

import llmgw.core._placement as placement
from llmgw import core, engines, model
from llmgw.core._reconcile import DesiredModel, ObservedShard, Plan, ReplicaView, Start, Stop
from llmgw.cp._catalog import Catalog, CatalogModel, Profile, engine_profile, fingerprint
from llmgw.cp._registry import NodeRecord, NodeRegistry
from llmgw.cp._shards import PORTS, free_port, ports_taken, to_shard_spec
from llmgw.errors import LlmgwError

log = logging.getLogger("llmgw.cp.reconciler")

RENDEZVOUS_PORTS = (29500, 29999)
FOREIGN_MEMORY_LIMIT_MIB = 1024  # a card with more held by others is not healthy for placement
PENDING_TTL_S = 120.0


@attrs.frozen
class Unplaced:
    model_name: str
    reasons: tuple[str, ...]


class Reconciler:
    def __init__(
        self,
        registry: NodeRegistry,
        catalog: Callable[[], Catalog],
        *,
        interval_s: float = 2.0,
        settle_s: float = 10.0,
        stop_grace_s: float = 30.0,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._registry = registry
        self._catalog = catalog
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.stop_grace_s = stop_grace_s
        self._clock = clock
        self._started_at: float | None = None
        self._first_seen: dict[str, float] = {}
        self._pending: dict[str, tuple[str, float]] = {}  # replica id -> (model, when)
        self._stopping: set[tuple[str, str]] = set()
        self._unplaced: dict[str, Unplaced] = {}
        self._last_plan = Plan((), ())
        self._last_notes: tuple[str, ...] = ()
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()

    def __repr__(self) -> str:
        return f"<Reconciler {self.statistics()}>"

    def statistics(self) -> dict[str, int]:
        return {
            "replicas": len(self._last_plan.replicas),
            "pending": len(self._pending),
            "stopping": len(self._stopping),
            "unplaced": len(self._unplaced),
        }

    def poke(self) -> None:
        """Something changed (a report, a catalog reload): plan again soon."""
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started_at = self._clock()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                with trio.move_on_after(self.interval_s):
                    await self._wake.wait()
                self._wake = trio.Event()
                try:
                    await self.tick()
                except LlmgwError as exc:
                    log.error("reconciling failed: %s; trying again", exc)

    # observe -----------------------------------------------------------------------------

    def observe(self) -> tuple[list[ObservedShard], dict[str, str]]:
        shards = []
        states = {}
        for rec in self._registry.records():
            states[rec.node_id] = rec.liveness.state.value
            for s in rec.shards:
                shards.append(
                    ObservedShard(
                        node_id=rec.node_id,
                        node_state=rec.liveness.state.value,
                        shard_id=s.shard_id,
                        state=s.state,
                        replica_id=s.replica_id,
                        model_name=s.model_name,
                        rank=s.rank,
                        ranks=s.ranks,
                        fingerprint=s.profile_fingerprint,
                        reason=s.reason,
                    )
                )
        return shards, states

    def desired(self, catalog: Catalog) -> list[DesiredModel]:
        out = []
        for m in catalog.models:
            prints = tuple(fingerprint(m, p) for p in m.profiles)
            timeouts = {fp: p.startup_timeout_s for fp, p in zip(prints, m.profiles, strict=True)}
            out.append(DesiredModel(m.name, m.replicas, prints, timeouts))
        return out

    def plan(self) -> Plan:
        now = self._clock()
        shards, states = self.observe()
        seen = {s.replica_id for s in shards if s.replica_id}
        for replica_id in seen:
            self._first_seen.setdefault(replica_id, now)
            self._pending.pop(replica_id, None)
        for replica_id, (_, when) in list(self._pending.items()):
            if now - when > PENDING_TTL_S:
                del self._pending[replica_id]
        pending: dict[str, int] = {}
        for model_name, _ in self._pending.values():
            pending[model_name] = pending.get(model_name, 0) + 1
        return core.reconcile(
            self.desired(self._catalog()), shards, states, self._first_seen, now, pending=pending
        )

    # act -----------------------------------------------------------------------------------

    async def tick(self) -> None:
        plan = self.plan()
        self._last_plan = plan
        if plan.notes != self._last_notes:
            for note in plan.notes:
                log.warning("%s", note)
            self._last_notes = plan.notes
        if self._started_at is not None and self._clock() - self._started_at < self.settle_s:
            return  # let agents re-register first: what runs is adopted, not started again
        catalog = self._catalog()
        starts = [a for a in plan.actions if isinstance(a, Start)]
        for action in plan.actions:
            if isinstance(action, Stop):
                self._stop_soon(action)
        placed_models = set()
        placer = self.placer() if starts else None
        for action in starts:
            m = catalog.model(action.model_name)
            if m is not None and placer is not None:
                await self._start(m, placer)
                placed_models.add(m.name)
        for name in list(self._unplaced):
            if catalog.model(name) is None or (
                name not in {a.model_name for a in starts} and name not in placed_models
            ):
                self._unplaced.pop(name, None)

    def _stop_soon(self, action: Stop) -> None:
        key = (action.node_id, action.shard_id)
        if key in self._stopping or self._nursery is None:
            return
        self._stopping.add(key)
        self._nursery.start_soon(self._stop, action)

    async def _stop(self, action: Stop) -> None:
        try:
            agent = self._registry.agent(action.node_id)
            if agent is None:
                return
            log.info("stopping shard %s on %s: %s", action.shard_id, action.node_id, action.reason)
            await agent.stop_shard(self._registry.epoch, action.shard_id, self.stop_grace_s)
            self._registry.forget_shard(action.node_id, action.shard_id)
        except LlmgwError as exc:
            log.warning("stopping %s on %s failed: %s", action.shard_id, action.node_id, exc)
        finally:
            self._stopping.discard((action.node_id, action.shard_id))
            self.poke()

    def facts(self) -> list[placement.NodeFacts]:
        cordoned = self._registry.cordoned
        return [
            attrs.evolve(node_facts(rec), cordoned=rec.node_id in cordoned)
            for rec in self._registry.records()
        ]

    def allocations(self) -> placement.Allocations:
        gpus: dict[str, frozenset[int]] = {}
        cpu: dict[str, int] = {}
        for rec in self._registry.records():
            index = {g.uuid: g.index for g in rec.inventory.gpus or ()}
            used = {index[u] for s in rec.shards for u in s.gpus if u in index}
            gpus[rec.node_id] = frozenset(used)
            cpu[rec.node_id] = sum(1 for s in rec.shards if not s.gpus)
        return placement.Allocations(gpus=gpus, cpu_replicas=cpu)

    def placer(self) -> placement.Placer:
        """The fleet indexed once; place several replicas with it, adding each."""
        return placement.Placer(self.facts(), self.allocations())

    def try_place(
        self, m: CatalogModel, placer: placement.Placer | None = None
    ) -> tuple[Profile, placement.Placement] | Unplaced:
        placer = placer or self.placer()
        reasons: list[str] = []
        for i, profile in enumerate(m.profiles):
            result = placer.place(placement_profile(m, profile))
            if isinstance(result, placement.Placement):
                return profile, result
            prefix = f"profile {i} ({profile.engine}, {profile.gpu_class or 'cpu'}): "
            if len(m.profiles) == 1:
                prefix = ""
            reasons += [prefix + r for r in result.reasons] or [prefix + "no node"]
        return Unplaced(m.name, tuple(reasons))

    async def _start(self, m: CatalogModel, placer: placement.Placer) -> None:
        found = self.try_place(m, placer)
        if isinstance(found, Unplaced):
            if self._unplaced.get(m.name) != found:
                log.warning("cannot place %s:\n  %s", m.name, "\n  ".join(found.reasons))
            self._unplaced[m.name] = found
            return
        self._unplaced.pop(m.name, None)
        profile, where = found
        placer.add(where)  # the next placement of this pass sees these cards taken
        replica_id = f"{m.name}-{secrets.token_hex(3)}"
        records = {r.node_id: r for r in self._registry.records()}
        specs = self._specs(m, profile, where, replica_id, records)
        self._pending[replica_id] = (m.name, self._clock())
        self._first_seen[replica_id] = self._clock()
        log.info(
            "starting replica %s of %s on %s",
            replica_id,
            m.name,
            ", ".join(f"{r.node_id}{list(r.gpu_indexes) or ''}" for r in where.ranks),
        )
        # Every rank together, the leader first.
        for node_id, spec in specs:
            agent = self._registry.agent(node_id)
            if agent is None:
                log.warning("replica %s: node %s went away before its start", replica_id, node_id)
                return
            try:
                report = await agent.start_shard(self._registry.epoch, spec)
            except LlmgwError as exc:
                log.warning("replica %s: starting rank %d on %s failed: %s", replica_id,
                            spec.rank, node_id, exc)  # fmt: skip
                return
            self._registry.note_shard(node_id, report)

    def _specs(
        self,
        m: CatalogModel,
        profile: Profile,
        where: placement.Placement,
        replica_id: str,
        records: dict[str, NodeRecord],
    ) -> list[tuple[str, model.ShardSpec]]:
        taken = ports_taken(records.values())
        first, last = profile.port_range or PORTS
        leader_host = records[where.ranks[0].node_id].host
        rendezvous = free_port(taken.get(leader_host, set()), *RENDEZVOUS_PORTS)
        taken.setdefault(leader_host, set()).add(rendezvous)
        addresses = tuple(records[r.node_id].host for r in where.ranks)
        eprofile = engine_profile(m, profile)
        fp = fingerprint(m, profile)
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
            )
            out.append((r.node_id, spec))
        return out

    # views ---------------------------------------------------------------------------------

    def replicas(self) -> list[ReplicaView]:
        return list(self._last_plan.replicas)

    def unplaced(self) -> list[Unplaced]:
        return list(self._unplaced.values())

    def first_seen(self, replica_id: str) -> float | None:
        return self._first_seen.get(replica_id)


def placement_profile(m: CatalogModel, p: Profile) -> placement.PlacementProfile:
    return placement.PlacementProfile(
        model=m.source,
        engine=p.engine,
        gpu_class=p.gpu_class,
        gpus_per_node=p.cards,
        nodes=p.nodes,
        min_memory_gb=p.min_memory_gb,
        node_selector=tuple(sorted(p.node_selector.items())),
        fabric=p.fabric,
        weights_bytes=None,
    )


def node_facts(rec: NodeRecord) -> placement.NodeFacts:
    inv = rec.inventory
    gpus = None
    if inv.gpus is not None:
        gpus = tuple(
            placement.GpuFacts(
                index=g.index,
                uuid=g.uuid,
                gpu_class=g.gpu_class,
                healthy=not g.ecc_uncorrected
                and (g.foreign_memory_mib or 0) <= FOREIGN_MEMORY_LIMIT_MIB,
                numa_node=g.numa_node,
            )
            for g in inv.gpus
        )
    own = [f for f in inv.usage.filesystems if not f.shared and f.free_bytes is not None]
    topo = inv.topology
    return placement.NodeFacts(
        node_id=rec.node_id,
        address=rec.host,
        ready=rec.liveness.state is core.NodeState.READY,
        state=None if rec.liveness.state is core.NodeState.READY else rec.liveness.state.value,
        labels=tuple((label.key, label.value) for label in inv.labels),
        engines=frozenset(e.name for e in inv.engines.found) if inv.engines else None,
        gpus=gpus,
        nvlinks=tuple((n.a, n.b, n.links) for n in topo.nvlinks) if topo else (),
        nic_distance=tuple((d.gpu, d.nic, d.distance) for d in topo.nic_distances) if topo else (),
        memory_total_bytes=inv.usage.memory_total_bytes,
        disk_free_bytes=max((f.free_bytes or 0 for f in own), default=None) if own else None,
        weights=_held(inv),
        fabrics=tuple((f.name, tuple(f.adapters), f.rate_gbps) for f in inv.fabrics),
    )


def _held(inv: model.Inventory) -> frozenset[str]:
    """Sources whose files the node holds: a local path is held when listed under it."""
    if inv.weights is None:
        return frozenset()
    return frozenset(f.path for f in inv.weights.files) | frozenset(
        str(p) for f in inv.weights.files for p in _parents(f.path)
    )


def _parents(path: str) -> Sequence[str]:
    parts = path.rstrip("/").split("/")
    return ["/".join(parts[:i]) for i in range(2, len(parts))]
