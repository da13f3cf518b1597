"""Fleet metrics (issue 14): the control plane's view of its nodes, as Prometheus families.

A custom collector registered on the router's registry, so the admin listener's
`/metrics` carries both. It computes every family at scrape time from what the
control plane already holds (the registry's records with their latest usage,
the reconciler's replicas and unplaced models, the catalog's desired replicas):
no ticker, nothing stored twice.

Absent is not zero: a value nobody reported (None in the model) is left out, and so
is every usage figure of a node whose latest sample (its last heartbeat, or its
registration) is older than `max_age_s`. Inventory facts (CPUs, a card's memory, its
NVLinks, fabrics, engines) stay while the node is known. Label values are the
peer's text, cut to `LABEL_MAX` characters; prometheus_client escapes them.

`fleet_families` is pure (inputs in, families out); `FleetCollector` only gathers
its inputs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import attrs
import trio
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw import core, model
from llmgw.cp._fleet._autoscaler import ModelScale
from llmgw.cp._fleet._catalog import Catalog, CatalogModel
from llmgw.cp._fleet._placing import Unplaced
from llmgw.cp._fleet._registry import NodeRecord

MAX_AGE_S = 60.0  # a usage sample older than this is left out
LABEL_MAX = 128  # characters of a label value; a longer one is cut
ITEMS_MAX = 256  # GPUs, filesystems, shards, engines, fabrics per node: more are left out
MIB = 1 << 20


def cut(value: object) -> str:
    """A label value: the peer's text, bounded."""
    text = str(value)
    return text if len(text) <= LABEL_MAX else text[:LABEL_MAX]


def _num(value: float | int | None) -> float | None:
    """A reported number, or None for one nobody reported (or a NaN/inf nobody means)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


@attrs.frozen
class FleetInput:
    """What one scrape reads."""

    records: Sequence[NodeRecord]
    now: float  # the registry's clock, as the records' liveness.last_seen
    replicas: Sequence[core.ReplicaView] | None = None  # None: not known (no reconciler)
    unplaced: Sequence[Unplaced] = ()
    catalog: Catalog | None = None  # None: not known (no desired/ready families)
    count: Callable[[CatalogModel], int] | None = None  # the replicas wanted now (autoscaled)
    scales: Sequence[ModelScale] = ()  # the autoscaled models (the leader's figures)
    max_age_s: float = MAX_AGE_S


class _Families:
    """GaugeMetricFamily by name, created on first use, in a fixed order. A series whose
    labels repeat one already added (two filesystems an agent named alike, two values cut
    to one) is left out: one duplicate would make Prometheus refuse the whole scrape."""

    def __init__(self) -> None:
        self._by_name: dict[str, GaugeMetricFamily] = {}
        self._seen: set[tuple[str, tuple[str, ...]]] = set()

    def add(
        self, name: str, doc: str, labels: Mapping[str, object], value: float | int | None
    ) -> None:
        v = _num(value)
        if v is None:
            return  # absent is not zero
        fam = self._by_name.get(name)
        if fam is None:
            fam = self._by_name[name] = GaugeMetricFamily(name, doc, labels=list(labels))
        values = tuple(cut(x) for x in labels.values())
        if (name, values) in self._seen:
            return
        self._seen.add((name, values))
        fam.add_metric(list(values), v)

    def all(self) -> list[Metric]:
        return list(self._by_name.values())


DOCS = {
    "llmgw_node_state": "1 for the node's liveness state (ready, unreachable, lost), else 0",
    "llmgw_node_cpus": "logical CPUs the node reported",
    "llmgw_node_cpu_utilization_percent": "CPU utilisation of the node, 0..100",
    "llmgw_node_load": "load average over the window",
    "llmgw_node_memory_total_bytes": "memory of the node",
    "llmgw_node_memory_available_bytes": "memory available for new work",
    "llmgw_node_memory_used_bytes": "total minus available",
    "llmgw_node_disk_total_bytes": "size of a filesystem holding the node's directories",
    "llmgw_node_disk_free_bytes": "free space of that filesystem",
    "llmgw_gpu_memory_total_bytes": "memory of the card",
    "llmgw_gpu_memory_used_bytes": "memory in use on the card",
    "llmgw_gpu_utilization_percent": "utilisation of the card, 0..100",
    "llmgw_gpu_ecc_uncorrected_errors": "volatile uncorrected ECC errors since the driver loaded",
    "llmgw_gpu_foreign_memory_bytes": "card memory held by processes llmgw did not start",
    "llmgw_gpu_healthy": "1 while the card's agent finds no fault that takes it out, 0 after",
    "llmgw_gpu_nvlink_peers": "cards this card reaches by NVLink",
    "llmgw_shard_cpu_cores": "CPU cores the shard's processes use",
    "llmgw_shard_memory_bytes": "resident memory of the shard's processes",
    "llmgw_shard_gpu_memory_bytes": "GPU memory the shard's processes hold on its fullest card",
    "llmgw_replica_state": "1 for each replica's current state",
    "llmgw_model_desired_replicas": "replicas wanted now: the catalog's, or the autoscaler's",
    "llmgw_model_ready_replicas": "replicas in state ready",
    "llmgw_model_unplaced": "1 when the reconciler found no place for the model",
    "llmgw_autoscale_min_replicas": "an autoscaled model's min",
    "llmgw_autoscale_max_replicas": "an autoscaled model's max",
    "llmgw_autoscale_paused": "1 while an operator holds the model's count, else 0",
    "llmgw_autoscale_queued_requests": "requests waiting in every router, last sample",
    "llmgw_autoscale_in_flight_requests": "requests being answered, over every router",
    "llmgw_autoscale_uncached_prompt_tokens": "prompt tokens in flight the engines compute",
    "llmgw_autoscale_ttft_p90_seconds": "TTFT p90 of the first bytes in the last sample",
    "llmgw_autoscale_refused_requests": "429/503 for capacity in the last sample",
    "llmgw_engine_state": "1 for each engine's install state on the node",
    "llmgw_fabric_adapters": "adapters in the node's fabric",
    "llmgw_fabric_rate_bits_per_second": "the fabric's slowest active link",
}


def fleet_families(inp: FleetInput) -> list[Metric]:
    """Every fleet family for one scrape (pure)."""
    out = _Families()

    def add(name: str, labels: Mapping[str, object], value: float | int | None) -> None:
        out.add(name, DOCS[name], labels, value)

    for rec in inp.records:
        node = rec.node_id
        for state in core.NodeState:
            add(
                "llmgw_node_state",
                {"node": node, "state": state.value},
                1 if rec.liveness.state is state else 0,
            )
        inv = rec.inventory
        add("llmgw_node_cpus", {"node": node}, inv.host.cpu_count)
        fresh = inp.now - rec.liveness.last_seen <= inp.max_age_s
        usage = inv.usage if fresh else model.Usage()
        add("llmgw_node_cpu_utilization_percent", {"node": node}, usage.cpu_util_pct)
        for window, load in (("1m", usage.load1), ("5m", usage.load5), ("15m", usage.load15)):
            add("llmgw_node_load", {"node": node, "window": window}, load)
        total, avail = _num(usage.memory_total_bytes), _num(usage.memory_available_bytes)
        add("llmgw_node_memory_total_bytes", {"node": node}, total)
        add("llmgw_node_memory_available_bytes", {"node": node}, avail)
        if total is not None and avail is not None:
            add("llmgw_node_memory_used_bytes", {"node": node}, total - avail)
        for fs in usage.filesystems[:ITEMS_MAX]:
            labels = {"node": node, "mount": fs.mount, "shared": "true" if fs.shared else "false"}
            add("llmgw_node_disk_total_bytes", labels, fs.total_bytes)
            add("llmgw_node_disk_free_bytes", labels, fs.free_bytes)
        _gpus(add, node, inv, usage)
        models = {s.shard_id: s.model_name or s.model for s in rec.shards}
        for su in usage.shards[:ITEMS_MAX]:
            labels = {"node": node, "shard": su.shard_id, "model": models.get(su.shard_id, "")}
            add("llmgw_shard_cpu_cores", labels, su.cpu_cores)
            add("llmgw_shard_memory_bytes", labels, su.rss_bytes)
            gpu = su.gpu_memory_mib
            add("llmgw_shard_gpu_memory_bytes", labels, None if gpu is None else gpu * MIB)
        if inv.engines is not None:
            for e in inv.engines.found[:ITEMS_MAX]:
                add("llmgw_engine_state", {"node": node, "engine": e.name, "state": e.state}, 1)
            for p in inv.engines.pending[:ITEMS_MAX]:
                add("llmgw_engine_state", {"node": node, "engine": p.name, "state": p.state}, 1)
        for f in inv.fabrics[:ITEMS_MAX]:
            add("llmgw_fabric_adapters", {"node": node, "fabric": f.name}, len(f.adapters))
            rate = _num(f.rate_gbps)
            add(
                "llmgw_fabric_rate_bits_per_second",
                {"node": node, "fabric": f.name},
                None if rate is None else rate * 1e9,
            )
    for r in inp.replicas or ():
        labels = {
            "replica": r.replica_id,
            "model": r.model_name,
            "node": r.nodes[0] if r.nodes else "",
            "state": r.state,
        }
        add("llmgw_replica_state", labels, 1)
    if inp.catalog is not None:
        ready = Counter(
            r.model_name for r in inp.replicas or () if r.state == core.ReplicaState.READY
        )
        for m in inp.catalog.models:
            wanted = inp.count(m) if inp.count is not None else m.replicas
            add("llmgw_model_desired_replicas", {"model": m.name}, wanted)
            if inp.replicas is not None:
                add("llmgw_model_ready_replicas", {"model": m.name}, ready[m.name])
    for u in inp.unplaced:
        add("llmgw_model_unplaced", {"model": u.model_name}, 1)
    for s in inp.scales:
        labels = {"model": s.name}
        add("llmgw_autoscale_min_replicas", labels, s.policy.min)
        add("llmgw_autoscale_max_replicas", labels, s.policy.max)
        add("llmgw_autoscale_paused", labels, 1 if s.paused is not None else 0)
        if s.sample is not None:  # absent, not zero, before the first sample
            add("llmgw_autoscale_queued_requests", labels, s.sample.queued)
            add("llmgw_autoscale_in_flight_requests", labels, s.sample.in_flight)
            add("llmgw_autoscale_uncached_prompt_tokens", labels, s.sample.uncached_tokens)
            add("llmgw_autoscale_ttft_p90_seconds", labels, s.sample.ttft_p90_s)
            add("llmgw_autoscale_refused_requests", labels, s.sample.rejected)
    return out.all()


def _gpus(
    add: Callable[[str, Mapping[str, object], float | int | None], None],
    node: str,
    inv: model.Inventory,
    usage: model.Usage,
) -> None:
    if not inv.gpus:
        return  # None (could not tell) or () (no cards): no GPU series at all
    used = {g.index: g for g in usage.gpus}
    peers: dict[int, set[int]] = {}
    if inv.topology is not None:
        for link in inv.topology.nvlinks:
            if link.links > 0 and link.a != link.b:
                peers.setdefault(link.a, set()).add(link.b)
                peers.setdefault(link.b, set()).add(link.a)
    for g in inv.gpus[:ITEMS_MAX]:
        labels: dict[str, object] = {
            "node": node,
            "gpu": g.index,
            "uuid": g.uuid,
            "class": g.gpu_class,
        }
        total = _num(g.memory_total_mib)
        add("llmgw_gpu_memory_total_bytes", labels, None if total is None else total * MIB)
        u = used.get(g.index)
        if u is not None:
            mem, foreign = _num(u.memory_used_mib), _num(u.foreign_memory_mib)
            add("llmgw_gpu_memory_used_bytes", labels, None if mem is None else mem * MIB)
            add("llmgw_gpu_utilization_percent", labels, u.utilization_pct)
            add("llmgw_gpu_ecc_uncorrected_errors", labels, u.ecc_uncorrected)
            add(
                "llmgw_gpu_foreign_memory_bytes", labels, None if foreign is None else foreign * MIB
            )
            health = None if u.health is None else int(u.health == model.GpuHealth.OK)
            add("llmgw_gpu_healthy", labels, health)  # an older agent's: unknown, no series
        if inv.topology is not None:
            add("llmgw_gpu_nvlink_peers", labels, len(peers.get(g.index, ())))


class NodeSource(Protocol):
    """What the collector reads of the registry (NodeRegistry is one)."""

    def records(self) -> Sequence[NodeRecord]: ...


class ReplicaSource(Protocol):
    """What the collector reads of the reconciler (Reconciler is one)."""

    def replicas(self) -> Sequence[core.ReplicaView]: ...

    def unplaced(self) -> Sequence[Unplaced]: ...

    def count(self, m: CatalogModel) -> int: ...


class FleetCollector(Collector):
    """Registered on the registry `/metrics` serves; computes at every scrape."""

    def __init__(
        self,
        registry: NodeSource,
        *,
        reconciler: ReplicaSource | None = None,
        catalog: Callable[[], Catalog] | None = None,
        scales: Callable[[], Sequence[ModelScale]] | None = None,
        clock: Callable[[], float] = trio.current_time,  # the registry's clock
        max_age_s: float = MAX_AGE_S,
    ) -> None:
        self._registry = registry
        self._reconciler = reconciler
        self._scales = scales
        self._catalog = catalog
        self._clock = clock
        self.max_age_s = max_age_s

    def describe(self) -> Iterable[Metric]:
        return ()  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        rec = self._reconciler
        yield from fleet_families(
            FleetInput(
                records=self._registry.records(),
                now=self._clock(),
                replicas=rec.replicas() if rec is not None else None,
                unplaced=rec.unplaced() if rec is not None else (),
                catalog=self._catalog() if self._catalog is not None else None,
                count=rec.count if rec is not None else None,
                scales=self._scales() if self._scales is not None else (),
                max_age_s=self.max_age_s,
            )
        )
