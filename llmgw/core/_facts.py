"""Facts for the reconcile plan and placement, read from what the nodes reported.

Pure: a node's record (what it registered, its last heartbeat) in, the values
`reconcile` and `place` decide from out. Nothing here reads a clock, a file or
a socket; the reconciler (llmgw/cp/_fleet/_reconciler.py) hands in the registry's
records and the catalog's entries, seen through the small Protocols below.

- `node_facts`: a node as placement sees it: ready or why not, its cards (each
  healthy or not: `gpu_healthy`), the engines it can run at the declared
  versions (`engine_facts`) and its words about the others, the disk free where
  its fetches write, and the weights it holds (`weights_key`'s names).
- `placement_profile`: a catalog profile as placement asks for it.
- `observed_shards`, `allocations`: the shards for the plan, and the cards and
  CPU replicas taken on each node (starts in flight included).
- `drain_input`: what the drain rule needs: the draining nodes, the requests in
  flight on each replica they touch, and since when each replica retires.
- `socket_interface`: the interface a node names for the fabric chosen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

from llmgw import model
from llmgw.core._drain import DrainInput
from llmgw.core._liveness import Liveness, NodeState
from llmgw.core._placement import Allocations, GpuFacts, NodeFacts, PlacementProfile
from llmgw.core._reconcile import ObservedShard
from llmgw.core._sharing import MigFacts
from llmgw.core._weights import cache_name, classify_source, is_cache_name
from llmgw.core._xid import unhealthy_words
from llmgw.errors import ConfigError

FOREIGN_MEMORY_LIMIT_MIB = 1024  # a card with more held by others is not healthy for placement


class NodeReport(Protocol):
    """A node's record as the registry keeps it (llmgw/cp/_fleet/_node_record.py)."""

    @property
    def node_id(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def liveness(self) -> Liveness: ...
    @property
    def inventory(self) -> model.Inventory: ...
    @property
    def shards(self) -> tuple[model.ShardReport, ...]: ...


class CatalogSource(Protocol):
    """A catalog model, as far as placement reads it: where its weights come from."""

    @property
    def source(self) -> str: ...


class CatalogProfile(Protocol):
    """A catalog profile, as far as placement reads it (llmgw/cp/_fleet/_catalog.py)."""

    @property
    def engine(self) -> str: ...
    @property
    def gpu_class(self) -> str | None: ...
    @property
    def cards(self) -> int: ...
    @property
    def nodes(self) -> int: ...
    @property
    def min_memory_gb(self) -> float | None: ...
    @property
    def node_selector(self) -> Mapping[str, str]: ...
    @property
    def fabric(self) -> str | None: ...
    @property
    def gpu_memory_gib(self) -> float | None: ...
    @property
    def mig(self) -> str | None: ...


def socket_interface(node: NodeReport, fabric: str | None) -> str | None:
    """The socket interface this node names for the fabric placement chose (agent.yaml's
    `fabrics.<name>.interface`, carried in its inventory); None: none chosen or named."""
    if fabric is None:
        return None
    return next((f.interface for f in node.inventory.fabrics if f.name == fabric), None)


def _fetched(source: str) -> bool:
    try:
        return classify_source(source).fetched
    except ConfigError:
        return False  # the catalog refuses it elsewhere; nothing is fetched for it


def weights_key(source: str) -> str:
    """What placement calls a source's weights (`PlacementProfile.model`, and what
    `node_facts` says a node holds): a fetched source's cache name, else the source
    as written (a local path, a hub id)."""
    return cache_name(source) if _fetched(source) else source


def placement_profile(
    m: CatalogSource, p: CatalogProfile, weights_bytes: int | None = None
) -> PlacementProfile:
    """`weights_bytes`: the source's size when it is fetched and known; None otherwise
    (a local path or a hub id: nothing to fetch, nothing to refuse)."""
    fetched = _fetched(m.source)
    return PlacementProfile(
        model=weights_key(m.source),
        engine=p.engine,
        gpu_class=p.gpu_class,
        gpus_per_node=p.cards,
        nodes=p.nodes,
        min_memory_gb=p.min_memory_gb,
        node_selector=tuple(sorted(p.node_selector.items())),
        fabric=p.fabric,
        weights_bytes=weights_bytes if fetched else None,
        gpu_memory_mib=None if p.gpu_memory_gib is None else math.ceil(p.gpu_memory_gib * 1024),
        mig=p.mig,
    )


def gpu_healthy(g: model.Gpu, usage: model.GpuUsage | None) -> bool:
    """Not marked unhealthy by its agent (an Xid or ECC fault that takes it out), no
    uncorrected ECC errors, and no more than the limit held by others.

    The newest heartbeat's reading wins over the registration's; a reading the
    heartbeat lacks (absent: not measured) falls back to the registration's.
    """
    ecc = usage.ecc_uncorrected if usage is not None else None
    if ecc is None:
        ecc = g.ecc_uncorrected
    foreign = usage.foreign_memory_mib if usage is not None else None
    if foreign is None:
        foreign = g.foreign_memory_mib
    if gpu_unusable(usage):
        return False
    return not ecc and (foreign or 0) <= FOREIGN_MEMORY_LIMIT_MIB


def _foreign(g: model.Gpu, usage: model.GpuUsage | None) -> int | None:
    """Memory on the card held by processes llmgw did not start: the newest reading."""
    foreign = usage.foreign_memory_mib if usage is not None else None
    return g.foreign_memory_mib if foreign is None else foreign


def gpu_unusable(usage: model.GpuUsage | None) -> bool:
    """The agent says the card is out (a fault class that makes it unusable). An agent
    that says nothing (older than the field) is unknown: never out for that."""
    return usage is not None and usage.health == model.GpuHealth.UNHEALTHY


def gpu_drains(nodes: Iterable[NodeReport]) -> dict[str, str]:
    """Replica id -> why, for every replica with a shard on a card its agent marked
    unusable: `gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus) on node01`. The
    drain rule replaces these and then stops them, as it does a draining node's, but
    only these: the node's other cards go on serving."""
    out: dict[str, str] = {}
    for rec in nodes:
        inv = rec.inventory
        usage = {u.index: u for u in inv.usage.gpus}
        sick = {
            g.uuid: unhealthy_words(g.index, usage[g.index].faults)
            for g in inv.gpus or ()
            if gpu_unusable(usage.get(g.index))
        }
        if not sick:
            continue
        for s in rec.shards:
            if s.replica_id is None or s.replica_id in out:
                continue
            bad = next((sick[u] for u in s.gpus if u in sick), None)
            if bad is not None:
                out[s.replica_id] = f"{bad} on {rec.node_id}"
    return out


# A percentage changes with every heartbeat of a download: placement's refusal names
# what the node is doing, not how far it is (`ctl nodes` shows that).
_PERCENT = re.compile(r"(?:, )?\d+(?:\.\d+)? ?%(?=\))|\s*\(\d+(?:\.\d+)? ?%\)")


def engine_facts(
    engines: model.Engines | None, declared: model.EngineDecls | None
) -> tuple[frozenset[str] | None, tuple[tuple[str, str], ...]]:
    """The engines a node can run for placement, and its words about the others.

    Found and, when the control plane declares that engine, either configured by the
    operator (agent.yaml's word wins) or at the declared version. The words: what the
    agent says of an engine it is still installing ("installing: downloading ..."), or
    that the one it has is another version ("has llama-server b6000, needs b6123")."""
    if engines is None:
        return None, ()
    wanted = {d.name: d.version for d in declared.engines} if declared is not None else {}
    runnable: set[str] = set()
    words: dict[str, str] = {}
    for e in engines.found:
        need = wanted.get(e.name)
        if need is None or e.state == "configured" or e.version == need:
            runnable.add(e.name)
        else:
            has = f" {e.version}" if e.version else " (version unknown)"
            words.setdefault(e.name, f"has {e.name}{has}, needs {need}")
    for p in engines.pending:
        if p.name in runnable:
            continue
        detail = _PERCENT.sub("", p.detail).strip()
        words[p.name] = f"{p.state}: {detail}" if detail else p.state
    said = tuple(sorted((n, w) for n, w in words.items() if n not in runnable))
    return frozenset(runnable), said


def engines_installing(
    engines: model.Engines | None, declared: model.EngineDecls | None
) -> frozenset[str]:
    """The declared engines the node cannot run yet and its agent works on: it says
    where it is with the install (installing, waiting, or failed, which it retries),
    or it has an install of another version, which it replaces once told of the
    declaration. Not an engine the node never had nor works on: only an operator ends
    that. Retiring a replica elsewhere installs none of these sooner."""
    if engines is None or declared is None:
        return frozenset()
    wanted = {d.name for d in declared.engines}
    runnable, _ = engine_facts(engines, declared)
    working = {p.name for p in engines.pending} | {
        e.name for e in engines.found if e.state == "installed"
    }
    return frozenset((working & wanted) - (runnable or frozenset()))


def node_facts(rec: NodeReport, declared: model.EngineDecls | None = None) -> NodeFacts:
    inv = rec.inventory
    runnable, engine_words = engine_facts(inv.engines, declared)
    gpus = None
    if inv.gpus is not None:
        usage = {u.index: u for u in inv.usage.gpus}
        gpus = tuple(
            GpuFacts(
                index=g.index,
                uuid=g.uuid,
                gpu_class=g.gpu_class,
                healthy=gpu_healthy(g, usage.get(g.index)),
                numa_node=g.numa_node,
                why=unhealthy_words(g.index, usage[g.index].faults)
                if gpu_unusable(usage.get(g.index))
                else None,
                memory_total_mib=g.memory_total_mib,
                foreign_mib=_foreign(g, usage.get(g.index)),
                mig_enabled=g.mig_mode == "enabled",
                mig=tuple(MigFacts(d.uuid, d.profile, d.memory_mib) for d in g.mig_devices),
            )
            for g in inv.gpus
        )
    own = [f for f in inv.usage.filesystems if not f.shared and f.free_bytes is not None]
    disk = max((f.free_bytes or 0 for f in own), default=None) if own else None
    weights_dir = inv.weights.dir if inv.weights is not None else None
    if weights_dir is not None:
        fs = filesystem_of(inv.usage.filesystems, weights_dir)
        if fs is not None and fs.free_bytes is not None:
            disk = fs.free_bytes  # shared or not: it is where the fetch writes
    topo = inv.topology
    return NodeFacts(
        node_id=rec.node_id,
        address=rec.host,
        ready=rec.liveness.state is NodeState.READY,
        state=None if rec.liveness.state is NodeState.READY else rec.liveness.state.value,
        labels=tuple((label.key, label.value) for label in inv.labels),
        engines=runnable,
        engine_words=engine_words,
        engines_installing=engines_installing(inv.engines, declared),
        gpus=gpus,
        nvlinks=tuple((n.a, n.b, n.links) for n in topo.nvlinks) if topo else (),
        nic_distance=tuple((d.gpu, d.nic, d.distance) for d in topo.nic_distances) if topo else (),
        memory_total_bytes=inv.usage.memory_total_bytes,
        disk_free_bytes=disk,
        weights=held(inv),
        fabrics=tuple((f.name, tuple(f.adapters), f.rate_gbps) for f in inv.fabrics),
        weights_dir=weights_dir,
    )


def _norm(path: str) -> str:
    return path.rstrip("/") or "/"


def filesystem_of(
    filesystems: Sequence[model.Filesystem], directory: str
) -> model.Filesystem | None:
    """The filesystem the agent says holds `directory` (one of its `paths`)."""
    want = _norm(directory)
    return next((f for f in filesystems if want in {_norm(p) for p in f.paths}), None)


def held(inv: model.Inventory) -> frozenset[str]:
    """The weights keys the node holds (see `weights_key`): a local path when a file is
    listed at or under it, and the cache name of each entry of its weights directory
    (the agent lists only complete entries: files under `<dir>/<cache name>/`)."""
    if inv.weights is None:
        return frozenset()
    files = inv.weights.files
    found = frozenset(f.path for f in files) | frozenset(
        str(p) for f in files for p in parents(f.path)
    )
    if inv.weights.dir is None:
        return found
    prefix = _norm(inv.weights.dir).rstrip("/") + "/"
    names = {
        rest.split("/", 1)[0]
        for f in files
        if f.path.startswith(prefix) and "/" in (rest := f.path[len(prefix) :])
    }
    return found | frozenset(n for n in names if is_cache_name(n))


def parents(path: str) -> Sequence[str]:
    """The directories above an absolute path, the root left out: "/a/b/c" has "/a",
    "/a/b"."""
    parts = path.rstrip("/").split("/")
    return ["/".join(parts[:i]) for i in range(2, len(parts))]


def observed_shards(
    nodes: Iterable[NodeReport],
) -> tuple[list[ObservedShard], dict[str, str]]:
    """Every shard the nodes report, as the plan observes it, and each node's state."""
    shards = []
    states = {}
    for rec in nodes:
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


def allocations(
    nodes: Iterable[NodeReport],
    flying: Iterable[tuple[str, model.ShardSpec]],
    without: Collection[str] = (),
) -> Allocations:
    """The cards and CPU replicas taken on each node: its shards', and those of the
    ranks of starts in flight (`flying`: node, spec) it has not reported yet, so the
    next pass does not give them again. `without`: replica ids counted as gone (what a
    placement would find if they were retired)."""
    in_flight = list(flying)
    gpus: dict[str, frozenset[int]] = {}
    cpu: dict[str, int] = {}
    claims: dict[str, dict[int, int]] = {}
    mig: dict[str, frozenset[str]] = {}
    for rec in nodes:
        index = {g.uuid: g.index for g in rec.inventory.gpus or ()}
        instances = {d.uuid for g in rec.inventory.gpus or () for d in g.mig_devices}
        reported = {s.shard_id for s in rec.shards}
        shards = [s for s in rec.shards if s.replica_id is None or s.replica_id not in without]
        mine = [
            spec
            for node_id, spec in in_flight
            if node_id == rec.node_id and spec.shard_id not in reported
        ]
        held: list[tuple[tuple[str, ...], int | None]] = [
            (s.gpus, s.gpu_memory_mib) for s in shards
        ] + [(spec.gpus, spec.gpu_memory_mib) for spec in mine]
        # Whole cards, shares of cards (MiB claimed on each), MIG instances.
        gpus[rec.node_id] = frozenset(
            index[u] for uuids, share in held if share is None for u in uuids if u in index
        )
        node_claims: dict[int, int] = {}
        for uuids, share in held:
            if share is None:
                continue
            for u in uuids:
                if u in index:
                    node_claims[index[u]] = node_claims.get(index[u], 0) + share
        claims[rec.node_id] = node_claims
        mig[rec.node_id] = frozenset(u for uuids, _ in held for u in uuids if u in instances)
        cpu[rec.node_id] = sum(1 for uuids, _ in held if not uuids)
    return Allocations(gpus=gpus, cpu_replicas=cpu, claims=claims, mig=mig)


def drain_input(
    shards: Sequence[ObservedShard],
    draining: Collection[str],
    in_flight: Callable[[str, str], int | None] | None,
    retiring_since: Mapping[str, float],
    timeout_s: float,
    *,
    also: Collection[str] = (),
    replicas: Mapping[str, str] | None = None,
) -> DrainInput:
    """The drain rule's input (and the rollout rule's). `in_flight(replica id, rank-0
    node)`: the router's count of requests there, asked only for the replicas a draining
    node touches and those in `also` (the stale ones a rollout may retire); None (no
    router here) leaves every count unknown. `replicas`: replica id -> why it drains on
    its own, its node serving on (a card of it is unusable: `gpu_drains`)."""
    nodes = frozenset(draining)
    counts: dict[str, int | None] = {}
    touched = {s.replica_id for s in shards if s.node_id in nodes and s.replica_id}
    touched |= set(also) | set(replicas or {})
    for s in shards:
        if s.replica_id in touched and s.rank == 0:
            counts[s.replica_id] = in_flight(s.replica_id, s.node_id) if in_flight else None
    return DrainInput(nodes, counts, dict(retiring_since), timeout_s, dict(replicas or {}))
