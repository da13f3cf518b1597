"""Placement: which nodes and which cards a replica gets.

`place(fleet, profile, allocations)` is a pure function: plain values in, a
`Placement` or a `Refusal` out, same input same output. `Placer` is the same
decision for many replicas in a row: it indexes the fleet once and keeps the
index current as placements are added, so each decision costs about the number
of index buckets, not the size of the fleet. `place()` is `Placer(fleet,
allocations).place(profile)`, and the tests hold the two to the same answers.

Filters (a node must pass them all; `None` is unknown and never excludes):

| stage | a node must have                      | or the refusal says                      |
|-------|---------------------------------------|------------------------------------------|
| 0     | ready                                 | `not ready (unreachable)`                |
| 1     | not cordoned                          | `cordoned`                               |
| 2     | every `node_selector` label           | `labels do not match zone=eu`            |
| 3     | GPU profile: known cards of the class | `GPUs unknown`, `has no h100-80g cards`  |
| 4     | the engine (engines None: allowed)    | `engine vllm not installed`, or the      |
|       |                                       | node's words: `installing: downloading   |
|       |                                       | llama-b6123-....tar.gz (16 MB)`          |
| 5     | min_memory_gb of memory (None: ok)    | `has 8 GB of memory, needs 24 GB`        |
| 6     | disk for the weights unless held      | `has 10 GB free on /w, needs 16 GB` (the |
|       | (disk None: ok)                       | weights dir; unknown: `10 GB free for    |
|       |                                       | weights, needs 16 GB`)                   |
| 7     | GPU profile: enough free healthy      | `2 free healthy h100-80g cards, needs 4` |
|       | cards of the class                    | `(6 in use, 1 unhealthy)`                |
| 8     | group over nodes: an ACTIVE port on   | `no ACTIVE port on ib-b`,                |
|       | the fabric (any one, if unnamed)      | `no fabric with an ACTIVE port`          |

GB is GiB (2**30 bytes), as `free -g` and the GPU class names count it. A
fabric only matters to a group of more than one node: a single node talks to
itself over NVLink or PCIe, so its placement has `fabric=None` and no adapters.

Scores, most important first (ties go to the smaller node id, then the smaller
card indexes, so the answer never depends on the order of the fleet):

- GPU replicas are bin-packed: the node left with the fewest free cards of the
  class wins, so whole nodes stay free for the large replicas.
- Then the best-connected set of free cards: most NVLink-connected pairs, then
  most NVLinks, then most pairs on one NUMA node. This ranks nodes as well as
  choosing cards inside one, because a tensor-parallel group pays for a poor
  interconnect on every token for as long as it runs.
- Then a node that already holds the weights (a one-time download saved).
- CPU replicas are spread: fewest CPU replicas already there, then one that
  holds the weights. Nothing stops two sharing a node.
- A group over several nodes takes the best nodes in that order among those
  with an ACTIVE port on one fabric: the profile's named fabric, or else
  whichever fabric gives the group the fewest free cards left, then the most
  NVLink, then the most nodes holding the weights, then the smaller name. Rank
  0 is the best node. Among equally connected cards, a group member takes the
  cards nearest the fabric's adapters, and each rank gets only that fabric's
  adapters on its node: those nearest its cards by `nic_distance` (PIX < PXB <
  PHB < NODE < SYS), or all of them where no distance is known.

A refusal names one reason per node, the first filter it fails, in the words
of the table. Nodes with the same reason share a line ("node01, node02, node03
and 40 more: cordoned"); lines go from the nodes that came closest to fitting
(the latest stage) to those that failed first, then by node id. At most
`MAX_REASON_LINES` such lines, then "... and N more nodes". A group of nodes
starts with a line saying how many would do ("ib-b: only 1 node with an ACTIVE
port, needs 2", or "only 1 node fits, needs 2").

A profile with `gpu_memory_mib` (a share of a card) or `mig` (a MIG instance)
passes stages 0-6 as above; llmgw/core/_sharing.py chooses its card and says
stage 7 card by card ("gpu 3 has 18 GiB unclaimed, needs 24", "no free
3g.40gb instance (gpu 0 has 1g.10gb x4)"). A card with a claim on it counts as
in use, and a MIG-enabled card is never offered, to whole-card profiles
("gpu 0 is MIG-enabled: whole-card profiles do not use it").

Besides the words, a refusal holds as data the nodes refused at stage 4 alone
while they install the profile's engine at the declared version
(`NodeFacts.engines_installing`; `Refusal.installing`): a rollout waits for
them rather than taking the refusal as a fleet without room.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import attrs

from llmgw.core._sharing import CardShares, MigFacts, mig_group_refusal, share_group_refusal

GIB: Final = 2**30
MAX_REASON_LINES: Final = 20
NAMES_PER_LINE: Final = 3
# Card subsets scored exactly; beyond this (more than 14 free cards) greedy.
EXACT_SUBSETS: Final = 5000

_DISTANCE: Final = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
_FAR: Final = len(_DISTANCE)  # unknown: farther than anything reported


# --- Values ---------------------------------------------------------------------


@attrs.frozen
class GpuFacts:
    """One card as placement sees it. `healthy` is False with uncorrected ECC
    errors or memory held by processes llmgw did not start."""

    index: int
    uuid: str
    gpu_class: str
    healthy: bool
    numa_node: int | None = None
    # Why its agent took it out, for the refusal: "gpu 1 unhealthy: Xid 79 (GPU has
    # fallen off the bus)"; None: healthy, or unhealthy for a reason placement reads
    # itself (ECC count, foreign memory).
    why: str | None = None
    # For shares of the card (llmgw/core/_sharing.py): its memory (None: unknown, so
    # it is not shared) and what processes llmgw did not start hold on it.
    memory_total_mib: int | None = None
    foreign_mib: int | None = None
    # MIG-enabled: it offers only its MIG instances, to profiles that name one.
    mig_enabled: bool = False
    mig: tuple[MigFacts, ...] = ()


@attrs.frozen
class NodeFacts:
    """One node as placement sees it. `None` is unknown and never excludes, except
    `gpus=None`: a GPU profile cannot be placed on cards nobody has seen."""

    node_id: str
    address: str
    ready: bool
    cordoned: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    engines: frozenset[str] | None = None
    # What the node says of an engine it cannot run yet, for the refusal: (name, words),
    # "installing: downloading llama-b6123-bin-cpu-x86_64.tar.gz (16 MB)", "failed: ...",
    # or "has llama-server b6000, needs b6123" (llmgw/core/_facts.py, engine_facts).
    engine_words: tuple[tuple[str, str], ...] = ()
    # The engines it cannot run yet but is installing at the declared version (the
    # same, as data: a refusal says which nodes only wait for that, `Refusal.installing`).
    engines_installing: frozenset[str] = frozenset()
    gpus: tuple[GpuFacts, ...] | None = None
    nvlinks: tuple[tuple[int, int, int], ...] = ()  # (gpu a, gpu b, link count)
    nic_distance: tuple[tuple[int, str, str], ...] = ()  # (gpu, adapter, PIX..SYS)
    memory_total_bytes: int | None = None
    disk_free_bytes: int | None = None  # free where the weights go
    weights: frozenset[str] = frozenset()  # weights keys it holds (PlacementProfile.model)
    fabrics: tuple[tuple[str, tuple[str, ...], float | None], ...] = ()  # ACTIVE adapters
    state: str | None = None  # liveness state when not ready: "unreachable", "lost"
    weights_dir: str | None = None  # where fetched weights go, for the refusal; None: unknown


@attrs.frozen
class PlacementProfile:
    """What one replica needs. `gpu_class=None` is a CPU replica (`gpus_per_node=0`)."""

    # The weights key, as in NodeFacts.weights: a fetched source's cache name
    # (llmgw.core.cache_name), a local path, or a hub id.
    model: str
    engine: str
    gpu_class: str | None
    gpus_per_node: int
    nodes: int = 1
    min_memory_gb: float | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    fabric: str | None = None  # the fabric a group must share; None: any one they share
    weights_bytes: int | None = None  # what a node that does not hold them fetches; None: unknown
    # A share of a card, per GPU: the replica takes this much memory on each of
    # gpus_per_node cards (llmgw/core/_sharing.py); None: whole cards.
    gpu_memory_mib: int | None = None
    mig: str | None = None  # a MIG profile ("3g.40gb"): the replica takes one instance of it

    def __attrs_post_init__(self) -> None:
        if self.gpu_memory_mib is not None and self.mig is not None:
            raise ValueError(
                f"a profile takes a share of a card ({self.gpu_memory_mib} MiB) or a MIG"
                f" instance ({self.mig}), not both"
            )
        if (self.gpu_memory_mib is not None or self.mig is not None) and self.gpu_class is None:
            raise ValueError("a share of a card or a MIG instance needs a gpu_class")
        if self.gpu_memory_mib is not None and self.gpu_memory_mib < 1:
            raise ValueError(f"gpu_memory_mib must be at least 1, not {self.gpu_memory_mib}")
        if self.nodes < 1:
            raise ValueError(f"a replica needs at least 1 node, not {self.nodes}")
        if self.gpu_class is None and self.gpus_per_node != 0:
            raise ValueError(f"a CPU profile takes 0 GPUs per node, not {self.gpus_per_node}")
        if self.gpu_class is not None and self.gpus_per_node < 1:
            raise ValueError(
                f"a {self.gpu_class} profile needs at least 1 GPU per node,"
                f" not {self.gpus_per_node}"
            )


def _gpu_map(m: Mapping[str, Iterable[int]]) -> Mapping[str, frozenset[int]]:
    return types.MappingProxyType(
        {k: s for k, s in ((k, frozenset(v)) for k, v in sorted(m.items())) if s}
    )


def _mig_map(m: Mapping[str, Iterable[str]]) -> Mapping[str, frozenset[str]]:
    return types.MappingProxyType(
        {k: s for k, s in ((k, frozenset(v)) for k, v in sorted(m.items())) if s}
    )


def _claims_map(m: Mapping[str, Mapping[int, int]]) -> Mapping[str, Mapping[int, int]]:
    out = {k: {i: n for i, n in sorted(v.items()) if n} for k, v in sorted(m.items())}
    return types.MappingProxyType({k: types.MappingProxyType(v) for k, v in out.items() if v})


def _count_map(m: Mapping[str, int]) -> Mapping[str, int]:
    return types.MappingProxyType({k: v for k, v in sorted(m.items()) if v})


@attrs.frozen
class RankPlacement:
    rank: int
    node_id: str
    address: str
    gpu_indexes: tuple[int, ...]  # () for a CPU replica
    gpu_uuids: tuple[str, ...]
    fabric_adapters: tuple[str, ...]  # () unless the group spans nodes
    memory_mib: int | None = None  # a share: MiB on each of gpu_indexes; None: whole cards
    # Placed on MIG instances (gpu_indexes/gpu_uuids: their cards): these go in
    # CUDA_VISIBLE_DEVICES instead of gpu_uuids.
    mig_uuids: tuple[str, ...] = ()


@attrs.frozen
class Placement:
    ranks: tuple[RankPlacement, ...]
    fabric: str | None  # None unless the group spans nodes

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(r.node_id for r in self.ranks)


@attrs.frozen
class Allocations:
    """What replicas already hold: whole cards by node, CPU replicas by node, MiB
    claimed by shares (node -> card index -> MiB) and MIG instances taken (node ->
    uuids).

    Empty entries are dropped, so two equal allocations compare equal."""

    gpus: Mapping[str, frozenset[int]] = attrs.field(factory=dict, converter=_gpu_map)
    cpu_replicas: Mapping[str, int] = attrs.field(factory=dict, converter=_count_map)
    claims: Mapping[str, Mapping[int, int]] = attrs.field(factory=dict, converter=_claims_map)
    mig: Mapping[str, frozenset[str]] = attrs.field(factory=dict, converter=_mig_map)

    def add(self, placement: Placement) -> Allocations:
        """These allocations with `placement`'s cards, shares and CPU replicas added."""
        return self._with(placement, 1)

    def remove(self, placement: Placement) -> Allocations:
        """These allocations with `placement` given back."""
        return self._with(placement, -1)

    def _with(self, placement: Placement, sign: int) -> Allocations:
        gpus = dict(self.gpus)
        cpu = dict(self.cpu_replicas)
        claims = {n: dict(c) for n, c in self.claims.items()}
        mig = dict(self.mig)
        for r in placement.ranks:
            nid = r.node_id
            if r.mig_uuids:
                had = mig.get(nid, frozenset())
                mig[nid] = had | set(r.mig_uuids) if sign > 0 else had - set(r.mig_uuids)
            elif r.memory_mib is not None:
                mine = claims.setdefault(nid, {})
                for i in r.gpu_indexes:
                    mine[i] = max(0, mine.get(i, 0) + sign * r.memory_mib)
            elif r.gpu_indexes:
                had_cards = gpus.get(nid, frozenset())
                cards = frozenset(r.gpu_indexes)
                gpus[nid] = had_cards | cards if sign > 0 else had_cards - cards
            else:
                cpu[nid] = max(0, cpu.get(nid, 0) + sign)
        return Allocations(gpus, cpu, claims, mig)


@attrs.frozen
class Refusal:
    """Why nothing fits: one line per reason, meant for the operator; `installing`: the
    nodes that fail only for the profile's engine, which they are installing at the
    declared version (a rollout waits for them rather than taking it as no room)."""

    reasons: tuple[str, ...]
    installing: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "\n".join(self.reasons)


def place(
    fleet: Iterable[NodeFacts],
    profile: PlacementProfile,
    allocations: Allocations | None = None,
) -> Placement | Refusal:
    """Where one replica of `profile` goes on `fleet`, given what is allocated."""
    return Placer(fleet, allocations).place(profile)


# --- Cards inside one node --------------------------------------------------------

_Score = tuple[int, int, int]  # NVLink-connected pairs, NVLinks, pairs on one NUMA node


@attrs.frozen
class _Topo:
    """The cards of one class on a node and how they are joined: shared by every
    node built alike, so card choices are computed once per kind of node."""

    indexes: tuple[int, ...]  # ascending
    links: tuple[tuple[int, int, int], ...]  # (a, b, links) with a < b, links > 0
    numa: tuple[int | None, ...]  # parallel to indexes


class _TopoTable:
    """Interned topologies and a memo of the best cards for (topology, free, count)."""

    def __init__(self) -> None:
        self._ids: dict[_Topo, int] = {}
        self._raw: dict[
            tuple[tuple[int, ...], tuple[int | None, ...], tuple[tuple[int, int, int], ...]], int
        ] = {}
        self._adj: list[dict[tuple[int, int], int]] = []
        self._numa: list[dict[int, int | None]] = []
        self._memo: dict[tuple[int, int, int], tuple[_Score, tuple[int, ...]]] = {}

    def intern(
        self,
        indexes: tuple[int, ...],
        numa: tuple[int | None, ...],
        nvlinks: tuple[tuple[int, int, int], ...],
    ) -> int:
        """The id of the topology of cards `indexes`. Nodes built alike report equal
        tuples, so the raw report is looked up first and normalised only once."""
        raw = (indexes, numa, nvlinks)
        tid = self._raw.get(raw)
        if tid is None:
            tid = self._raw[raw] = self._intern(_Topo(indexes, _links(indexes, nvlinks), numa))
        return tid

    def _intern(self, topo: _Topo) -> int:
        tid = self._ids.get(topo)
        if tid is None:
            tid = self._ids[topo] = len(self._adj)
            self._adj.append({(a, b): n for a, b, n in topo.links})
            self._numa.append(dict(zip(topo.indexes, topo.numa, strict=True)))
        return tid

    def score(self, tid: int, cards: tuple[int, ...]) -> _Score:
        adj = self._adj[tid]
        numa = self._numa[tid]
        pairs = links = same = 0
        for a, b in itertools.combinations(cards, 2):
            n = adj.get((a, b), 0) if a < b else adj.get((b, a), 0)
            if n:
                pairs += 1
                links += n
            na = numa[a]
            if na is not None and na == numa[b]:
                same += 1
        return pairs, links, same

    def best(self, tid: int, free: int, k: int) -> tuple[_Score, tuple[int, ...]]:
        """The best `k` of the free cards (bitmask `free`): highest score, then lowest indexes."""
        key = (tid, free, k)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self.choose(tid, _bits(free), k, None)
        return hit

    def choose(
        self, tid: int, free: tuple[int, ...], k: int, nic: Mapping[int, int] | None
    ) -> tuple[_Score, tuple[int, ...]]:
        """Best `k` of `free` by score, then (with `nic`) nearest the fabric, then lowest."""

        def key(cards: tuple[int, ...]) -> tuple[_Score, int]:
            near = -sum(nic.get(c, _FAR) for c in cards) if nic is not None else 0
            return self.score(tid, cards), near

        if k >= len(free):
            return self.score(tid, free), free
        if math.comb(len(free), k) <= EXACT_SUBSETS:
            best: tuple[int, ...] | None = None
            best_key: tuple[_Score, int] | None = None
            for cards in itertools.combinations(free, k):
                kk = key(cards)
                if best_key is None or kk > best_key:  # strictly: the first (lowest) stays
                    best, best_key = cards, kk
            assert best is not None and best_key is not None
            return best_key[0], best
        # Greedy beyond EXACT_SUBSETS: grow the set one card at a time.
        chosen: list[int] = []
        rest = list(free)
        while len(chosen) < k:
            pick = max(rest, key=lambda c: (key(tuple(sorted([*chosen, c]))), -c))
            chosen.append(pick)
            rest.remove(pick)
        cards = tuple(sorted(chosen))
        return self.score(tid, cards), cards


def _links(
    indexes: tuple[int, ...], nvlinks: tuple[tuple[int, int, int], ...]
) -> tuple[tuple[int, int, int], ...]:
    """The NVLinks among `indexes` as (a, b, links) with a < b; a pair reported
    twice (once from each end) counts once, at its larger count."""
    mine = set(indexes)
    links: dict[tuple[int, int], int] = {}
    for a, b, n in nvlinks:
        if a != b and n > 0 and a in mine and b in mine:
            pair = (min(a, b), max(a, b))
            links[pair] = max(links.get(pair, 0), n)
    return tuple((a, b, n) for (a, b), n in sorted(links.items()))


def _bits(mask: int) -> tuple[int, ...]:
    out: list[int] = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return tuple(out)


def _mask(indexes: Iterable[int]) -> int:
    m = 0
    for i in indexes:
        if i >= 0:
            m |= 1 << i
    return m


# --- The index ----------------------------------------------------------------------


class _Cards:
    """One class of cards on one node. `healthy` leaves out MIG-enabled cards (`mig`):
    whole-card profiles do not use them."""

    __slots__ = ("all", "healthy", "mig", "tid")

    def __init__(self, tid: int, all_mask: int, healthy: int, mig: int) -> None:
        self.tid = tid
        self.all = all_mask
        self.healthy = healthy & ~mig
        self.mig = mig


class _Node:
    __slots__ = ("_nic", "cards", "cpu", "fabrics", "facts", "labels", "used", "uuids")

    def __init__(self, facts: NodeFacts, topos: _TopoTable) -> None:
        self.facts = facts
        self.labels = dict(facts.labels)
        self.used = 0  # bitmask of card indexes allocated
        self.cpu = 0
        self.uuids: dict[int, str] = {}
        self.cards: dict[str, _Cards] = {}
        gpus: dict[int, GpuFacts] = {}
        for g in facts.gpus or ():
            if g.index < 0:
                raise ValueError(f"{facts.node_id}: GPU index {g.index} is negative")
            gpus.setdefault(g.index, g)  # a repeated index: the first report stands
        by_class: dict[str, list[GpuFacts]] = {}
        for i in sorted(gpus):
            by_class.setdefault(gpus[i].gpu_class, []).append(gpus[i])
            self.uuids[i] = gpus[i].uuid
        for cls, cards in by_class.items():
            idx = tuple(g.index for g in cards)
            tid = topos.intern(idx, tuple(g.numa_node for g in cards), facts.nvlinks)
            healthy = _mask(g.index for g in cards if g.healthy)
            mig = _mask(g.index for g in cards if g.mig_enabled)
            self.cards[cls] = _Cards(tid, _mask(idx), healthy, mig)
        self.fabrics: dict[str, tuple[str, ...]] = {}
        for name, adapters, _rate in facts.fabrics:
            merged = dict.fromkeys((*self.fabrics.get(name, ()), *adapters))
            if merged:
                self.fabrics[name] = tuple(merged)
        self._nic: dict[int, dict[str, int]] | None = None

    @property
    def nic(self) -> dict[int, dict[str, int]]:
        """Distance rank by card and adapter; read only for groups, so parsed late."""
        if self._nic is None:
            self._nic = {}
            for gpu, adapter, dist in self.facts.nic_distance:
                d = _DISTANCE.get(dist.upper(), _FAR)
                per = self._nic.setdefault(gpu, {})
                per[adapter] = min(per.get(adapter, _FAR), d)
        return self._nic

    def free(self, cls: str) -> int:
        c = self.cards[cls]
        return c.healthy & ~self.used


_StaticKey = tuple[
    str | None, str, tuple[tuple[str, str], ...], float | None, str | None, int | None
]
_Group = tuple[int, str]  # (stage, reason)


def _static_key(p: PlacementProfile) -> _StaticKey:
    held = p.model if p.weights_bytes is not None else None
    return (p.gpu_class, p.engine, p.node_selector, p.min_memory_gb, held, p.weights_bytes)


class Placer:
    """Places replica after replica on one fleet, keeping its index current.

    Built once from the fleet (linear in its size). The index holds only nodes
    that are ready and not cordoned: per GPU class, buckets by count of free
    healthy cards, and inside each bucket groups by (topology, free cards) so
    a group is scored once whatever its size; CPU nodes by CPU replica count;
    sets by engine, label, weights held and fabric; memory and disk sorted for
    thresholds. A profile's static filters become one set, cached per distinct
    static part of the profile. A decision then walks the buckets of its class
    from the fewest free cards up and stops at the first that has a candidate;
    the set work inside it runs in C. `add` moves the nodes a placement used to
    their new buckets.

    `place` does not change anything; `add` (or `remove`) records a decision.
    """

    def __init__(self, fleet: Iterable[NodeFacts], allocations: Allocations | None = None) -> None:
        allocations = allocations if allocations is not None else Allocations()
        self._topos = _TopoTable()
        self._nodes: dict[str, _Node] = {}
        for facts in fleet:
            if facts.node_id in self._nodes:
                raise ValueError(f"node {facts.node_id} appears twice in the fleet")
            self._nodes[facts.node_id] = _Node(facts, self._topos)
        self._gpu_alloc: dict[str, frozenset[int]] = dict(allocations.gpus)
        self._cpu_alloc: dict[str, int] = dict(allocations.cpu_replicas)
        self._share = CardShares(
            ((n, x.facts.gpus or ()) for n, x in self._nodes.items()),
            allocations.gpus,
            allocations.claims,
            allocations.mig,
        )
        for nid in {*self._gpu_alloc, *allocations.claims}:
            if nid in self._nodes:
                self._nodes[nid].used = _mask(self._gpu_alloc.get(nid, ())) | self._share.busy(nid)
        for nid, count in self._cpu_alloc.items():
            if nid in self._nodes:
                self._nodes[nid].cpu = count

        usable = {n for n, x in self._nodes.items() if x.facts.ready and not x.facts.cordoned}
        self._usable: frozenset[str] = frozenset(usable)
        self._class_nodes: dict[str, set[str]] = {}
        self._buckets: dict[str, dict[int, dict[tuple[int, int], set[str]]]] = {}
        self._cpu_buckets: dict[int, set[str]] = {}
        self._engines: dict[str, set[str]] = {}
        self._engines_unknown: set[str] = set()
        self._labels: dict[tuple[str, str], set[str]] = {}
        self._holders: dict[str, set[str]] = {}
        self._fabric_nodes: dict[str, set[str]] = {}
        memory: list[tuple[int, str]] = []
        disk: list[tuple[int, str]] = []
        for nid in sorted(usable):
            node = self._nodes[nid]
            f = node.facts
            for cls in node.cards:
                self._class_nodes.setdefault(cls, set()).add(nid)
                self._bucket_add(cls, nid, node)
            self._cpu_buckets.setdefault(node.cpu, set()).add(nid)
            if f.engines is None:
                self._engines_unknown.add(nid)
            else:
                for e in f.engines:
                    self._engines.setdefault(e, set()).add(nid)
            for pair in node.labels.items():
                self._labels.setdefault(pair, set()).add(nid)
            for model in f.weights:
                self._holders.setdefault(model, set()).add(nid)
            for name in node.fabrics:
                self._fabric_nodes.setdefault(name, set()).add(nid)
            if f.memory_total_bytes is not None:
                memory.append((f.memory_total_bytes, nid))
            if f.disk_free_bytes is not None:
                disk.append((f.disk_free_bytes, nid))
        memory.sort()
        disk.sort()
        self._memory = ([v for v, _ in memory], [n for _, n in memory])
        self._disk = ([v for v, _ in disk], [n for _, n in disk])
        self._eligible_cache: dict[_StaticKey, tuple[frozenset[str], bool]] = {}
        self._refusal_cache: dict[_StaticKey, tuple[dict[_Group, list[str]], list[str]]] = {}

    def __repr__(self) -> str:
        gpus = sum(len(v) for v in self._gpu_alloc.values())
        cpus = sum(self._cpu_alloc.values())
        return (
            f"<Placer nodes={len(self._nodes)} usable={len(self._usable)}"
            f" allocated_gpus={gpus} cpu_replicas={cpus}>"
        )

    @property
    def allocations(self) -> Allocations:
        """What is allocated now: the starting allocations plus every `add`."""
        claims, mig = self._share.claims(), self._share.mig_taken()
        return Allocations(self._gpu_alloc, self._cpu_alloc, claims, mig)

    # -- recording ---------------------------------------------------------------

    def add(self, placement: Placement) -> None:
        """Record `placement`: its cards, shares or MIG instances are taken and its
        CPU replicas counted."""
        _check_unallocated(placement, self._gpu_alloc, self._share)
        for r in placement.ranks:
            self._record(r, 1)

    def remove(self, placement: Placement) -> None:
        """Give back what `placement` held."""
        for r in placement.ranks:
            self._record(r, -1)

    def _record(self, r: RankPlacement, sign: int) -> None:
        nid = r.node_id
        if r.mig_uuids:
            self._share.take_mig(nid, r.mig_uuids, sign)
        elif r.memory_mib is not None:
            self._share.claim(nid, r.gpu_indexes, r.memory_mib, sign)
            self._set_gpus(nid, self._gpu_alloc.get(nid, frozenset()))
        elif r.gpu_indexes:
            had = self._gpu_alloc.get(nid, frozenset())
            cards = set(r.gpu_indexes)
            self._set_gpus(nid, had | cards if sign > 0 else had - cards)
        else:
            self._set_cpu(nid, max(0, self._cpu_alloc.get(nid, 0) + sign))

    def _set_gpus(self, nid: str, cards: frozenset[int]) -> None:
        if cards:
            self._gpu_alloc[nid] = cards
        else:
            self._gpu_alloc.pop(nid, None)
        self._share.set_whole(nid, cards)
        node = self._nodes.get(nid)
        if node is None:
            return
        indexed = nid in self._usable
        if indexed:
            for cls in node.cards:
                self._bucket_remove(cls, nid, node)
        node.used = _mask(cards) | self._share.busy(nid)
        if indexed:
            for cls in node.cards:
                self._bucket_add(cls, nid, node)

    def _set_cpu(self, nid: str, count: int) -> None:
        if count:
            self._cpu_alloc[nid] = count
        else:
            self._cpu_alloc.pop(nid, None)
        node = self._nodes.get(nid)
        if node is None:
            return
        if nid in self._usable:
            bucket = self._cpu_buckets[node.cpu]
            bucket.discard(nid)
            if not bucket:
                del self._cpu_buckets[node.cpu]
            self._cpu_buckets.setdefault(count, set()).add(nid)
        node.cpu = count

    def _bucket_add(self, cls: str, nid: str, node: _Node) -> None:
        free = node.free(cls)
        groups = self._buckets.setdefault(cls, {}).setdefault(free.bit_count(), {})
        groups.setdefault((node.cards[cls].tid, free), set()).add(nid)

    def _bucket_remove(self, cls: str, nid: str, node: _Node) -> None:
        free = node.free(cls)
        buckets = self._buckets[cls]
        count = free.bit_count()
        groups = buckets[count]
        key = (node.cards[cls].tid, free)
        members = groups[key]
        members.discard(nid)
        if not members:
            del groups[key]
            if not groups:
                del buckets[count]

    # -- deciding ------------------------------------------------------------------

    def place(self, profile: PlacementProfile) -> Placement | Refusal:
        """Where one replica of `profile` goes now. Records nothing: see `add`."""
        if profile.gpu_memory_mib is not None or profile.mig is not None:
            got = _share_decision(self._share, self._nodes, self._eligible(profile)[0], profile)
            return got or _share_refusal(self._share, self._nodes, self._static_refusal, profile)
        eligible, everything = self._eligible(profile)
        if profile.nodes == 1:
            chosen = self._ranked(profile, eligible, everything, None, 1)
            if chosen:
                return self._build(profile, chosen, None)
            return self._refuse(profile)
        n = profile.nodes
        names = [profile.fabric] if profile.fabric is not None else sorted(self._fabric_nodes)
        best: tuple[tuple[int, int, int, int, int, str], list[str], str] | None = None
        for name in names:
            ports = self._fabric_nodes.get(name)
            if ports is None or len(ports) < n or len(ports & eligible) < n:
                continue
            chosen = self._ranked(profile, eligible, everything, ports, n)
            if len(chosen) < n:
                continue
            key = self._group_key(profile, chosen, name)
            if best is None or key < best[0]:
                best = (key, chosen, name)
        if best is None:
            return self._refuse(profile)
        return self._build(profile, best[1], best[2])

    def _eligible(self, p: PlacementProfile) -> tuple[frozenset[str], bool]:
        """The indexed nodes passing the static filters, and whether that is all of
        the nodes the profile's buckets hold (so intersecting can be skipped)."""
        key = _static_key(p)
        hit = self._eligible_cache.get(key)
        if hit is not None:
            return hit
        if p.gpu_class is None:
            base: set[str] | frozenset[str] = self._usable
        else:
            base = self._class_nodes.get(p.gpu_class, set())
        s = set(base)
        s &= self._engines.get(p.engine, set()) | self._engines_unknown
        for pair in p.node_selector:
            s &= self._labels.get(pair, set())
        if p.min_memory_gb is not None:
            values, ids = self._memory
            s.difference_update(ids[: bisect.bisect_left(values, p.min_memory_gb * GIB)])
        if p.weights_bytes is not None:
            values, ids = self._disk
            short = set(ids[: bisect.bisect_left(values, p.weights_bytes)])
            s -= short - self._holders.get(p.model, set())
        hit = self._eligible_cache[key] = (frozenset(s), len(s) == len(base))
        return hit

    def _ranked(
        self,
        p: PlacementProfile,
        eligible: frozenset[str],
        everything: bool,
        within: set[str] | None,
        need: int,
    ) -> list[str]:
        """Up to `need` node ids, best first (see the module docstring for the order)."""
        holders = self._holders.get(p.model, set())
        out: list[str] = []

        def take(cands: set[str]) -> bool:
            held = cands & holders if holders else set()
            for part in (held, cands - held) if held else (cands,):
                if not part:
                    continue
                want = need - len(out)
                if want == 1:
                    out.append(min(part))
                elif len(part) <= want:
                    out.extend(sorted(part))
                else:
                    out.extend(heapq.nsmallest(want, part))
                if len(out) >= need:
                    return True
            return False

        def narrow(members: set[str]) -> set[str]:
            cands = members if everything else members & eligible
            if within is not None:
                cands = cands & within
            return cands

        if p.gpu_class is None:
            for count in sorted(self._cpu_buckets):
                cands = narrow(self._cpu_buckets[count])
                if cands and take(cands):
                    return out
            return out
        k = p.gpus_per_node
        buckets = self._buckets.get(p.gpu_class, {})
        for count in sorted(buckets):
            if count < k:
                continue
            levels: dict[_Score, set[str]] = {}
            for (tid, free), members in buckets[count].items():
                cands = narrow(members)
                if cands:
                    score = self._topos.best(tid, free, k)[0]
                    level = levels.get(score)
                    if level is None:
                        levels[score] = set(cands)
                    else:
                        level |= cands
            for score in sorted(levels, reverse=True):
                if take(levels[score]):
                    return out
        return out

    def _group_key(
        self, p: PlacementProfile, chosen: list[str], fabric: str
    ) -> tuple[int, int, int, int, int, str]:
        left = pairs = links = same = 0
        held = 0
        for nid in chosen:
            node = self._nodes[nid]
            if p.gpu_class is not None:
                free = node.free(p.gpu_class)
                left += free.bit_count() - p.gpus_per_node
                (a, b, c), _ = self._topos.best(node.cards[p.gpu_class].tid, free, p.gpus_per_node)
                pairs, links, same = pairs + a, links + b, same + c
            else:
                left += node.cpu
            held += p.model in node.facts.weights
        return left, -pairs, -links, -same, -held, fabric

    def _build(self, p: PlacementProfile, chosen: list[str], fabric: str | None) -> Placement:
        ranks: list[RankPlacement] = []
        for rank, nid in enumerate(chosen):
            node = self._nodes[nid]
            cards: tuple[int, ...] = ()
            if p.gpu_class is not None:
                c = node.cards[p.gpu_class]
                free = node.free(p.gpu_class)
                if fabric is None:
                    cards = self._topos.best(c.tid, free, p.gpus_per_node)[1]
                else:
                    near = {
                        g: min((d.get(a, _FAR) for a in node.fabrics[fabric]), default=_FAR)
                        for g, d in node.nic.items()
                    }
                    cards = self._topos.choose(c.tid, _bits(free), p.gpus_per_node, near)[1]
            adapters = _adapters(node, fabric, cards) if fabric is not None else ()
            ranks.append(
                RankPlacement(
                    rank=rank,
                    node_id=nid,
                    address=node.facts.address,
                    gpu_indexes=cards,
                    gpu_uuids=tuple(node.uuids[i] for i in cards),
                    fabric_adapters=adapters,
                )
            )
        return Placement(tuple(ranks), fabric)

    # -- refusing ------------------------------------------------------------------

    def _refuse(self, p: PlacementProfile) -> Refusal:
        if not self._nodes:
            return Refusal(("no nodes are registered",))
        static_groups, static_fit = self._static_refusal(p)
        groups = {g: list(ids) for g, ids in static_groups.items()}
        fit: list[str] = []
        if p.gpu_class is None:
            fit = list(static_fit)
        else:
            k = p.gpus_per_node
            cls = p.gpu_class
            for nid in static_fit:
                why = _short_of_cards(self._nodes[nid], cls, k, self._share.busy(nid))
                if why is None:
                    fit.append(nid)
                else:
                    groups.setdefault((7, why), []).append(nid)
        header: list[str] = []
        n = p.nodes
        if n > 1:
            if p.fabric is not None:
                with_port = []
                for nid in fit:
                    if p.fabric in self._nodes[nid].fabrics:
                        with_port.append(nid)
                    else:
                        groups.setdefault((8, f"no ACTIVE port on {p.fabric}"), []).append(nid)
                header.append(f"{p.fabric}: {_only(len(with_port))} with an ACTIVE port, needs {n}")
            elif len(fit) < n:
                header.append(f"{_only(len(fit))} fit{'s' if len(fit) <= 1 else ''}, needs {n}")
            else:
                counts: dict[str, int] = {}
                for nid in fit:
                    names = self._nodes[nid].fabrics
                    if not names:
                        groups.setdefault((8, "no fabric with an ACTIVE port"), []).append(nid)
                    for name in names:
                        counts[name] = counts.get(name, 0) + 1
                for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
                    header.append(f"{name}: {_only(count)} with an ACTIVE port, needs {n}")
        installing = _installing(self._nodes, static_groups, p)
        return Refusal((*header, *_summarise(groups)), installing)

    def _static_refusal(self, p: PlacementProfile) -> tuple[dict[_Group, list[str]], list[str]]:
        """Stages 0-6 for every node: those do not change as replicas are placed."""
        key = _static_key(p)
        hit = self._refusal_cache.get(key)
        if hit is not None:
            return hit
        groups: dict[_Group, list[str]] = {}
        fit: list[str] = []
        for nid, node in self._nodes.items():
            why = _static_reason(node, p)
            if why is None:
                fit.append(nid)
            else:
                groups.setdefault(why, []).append(nid)
        hit = self._refusal_cache[key] = (groups, fit)
        return hit


ENGINE_STAGE = 4


def _short_of_cards(node: _Node, cls: str, k: int, shared: int) -> str | None:
    """Stage 7 for whole cards: why `node` has fewer than `k` free healthy `cls` cards
    (`shared`: the cards with a share claimed on them, as a bitmask)."""
    c = node.cards[cls]
    free = (c.healthy & ~node.used).bit_count()
    if free >= k:
        return None
    in_use = (c.all & node.used & ~shared).bit_count()
    sick = (c.all & ~c.healthy & ~c.mig & ~node.used).bit_count()
    why = f"{free} free healthy {cls} card{_s(free)}, needs {k}"
    detail = [f"{in_use} in use"] if in_use else []
    detail += [f"{(c.all & shared).bit_count()} shared"] if c.all & shared else []
    detail += [f"{sick} unhealthy"] if sick else []
    said = [
        g.why
        for g in node.facts.gpus or ()
        if g.why and g.gpu_class == cls and not node.used >> g.index & 1
    ]
    said += [
        f"gpu {i} is MIG-enabled: whole-card profiles do not use it"
        for i in _bits(c.mig & ~node.used)
    ]
    if detail:
        why += f" ({', '.join(detail)})"
    if said:
        why += f"; {'; '.join(said)}"
    return why


def _share_decision(
    share: CardShares, nodes: Mapping[str, _Node], eligible: frozenset[str], p: PlacementProfile
) -> Placement | Refusal | None:
    """A share of cards or a MIG instance for `p` among `eligible`; a refusal for a
    group that cannot share; None when no node has room (the caller says why)."""
    cls, k, mib = p.gpu_class, p.gpus_per_node, p.gpu_memory_mib
    assert cls is not None
    if p.mig is not None and (k > 1 or p.nodes > 1):
        return Refusal((mig_group_refusal(p.mig, k, p.nodes),))
    if mib is not None and p.nodes > 1:
        return Refusal((share_group_refusal(mib, p.nodes),))
    if p.mig is not None:
        got = share.find_mig(cls, p.mig, eligible)
        if got is None:
            return None
        nid, index, uuid, instance = got
        address = nodes[nid].facts.address
        rank = RankPlacement(0, nid, address, (index,), (uuid,), (), None, (instance,))
        return Placement((rank,), None)
    assert mib is not None
    found = share.find_share(cls, k, mib, eligible)
    if found is None:
        return None
    node = nodes[found[0]]
    uuids = tuple(node.uuids[i] for i in found[1])
    rank = RankPlacement(0, found[0], node.facts.address, found[1], uuids, (), mib)
    return Placement((rank,), None)


def _share_refusal(
    share: CardShares,
    nodes: Mapping[str, _Node],
    static: Callable[[PlacementProfile], tuple[dict[_Group, list[str]], list[str]]],
    p: PlacementProfile,
) -> Refusal:
    """Why no node has room for `p`'s share or MIG instance: one line per reason,
    the nodes past the static filters saying card by card."""
    cls = p.gpu_class
    assert cls is not None
    static_groups, fit = static(p)
    groups = {g: list(ids) for g, ids in static_groups.items()}
    for nid in fit:
        if p.mig is not None:
            why = share.mig_why(nid, cls, p.mig)
        else:
            why = share.share_why(nid, cls, p.gpus_per_node, p.gpu_memory_mib or 0)
        groups.setdefault((7, why), []).append(nid)
    return Refusal(tuple(_summarise(groups)), _installing(nodes, static_groups, p))


def _check_unallocated(
    placement: Placement, whole: Mapping[str, frozenset[int]], share: CardShares
) -> None:
    """Raise when `placement` takes whole a card that is allocated or shared."""
    for r in placement.ranks:
        if r.memory_mib is None and not r.mig_uuids:
            taken, busy = whole.get(r.node_id, frozenset()), share.busy(r.node_id)
            again = {i for i in r.gpu_indexes if i in taken or busy >> i & 1}
            if again:
                raise ValueError(f"{r.node_id}: cards {sorted(again)} are already allocated")


def _installing(
    nodes: Mapping[str, _Node], static_groups: Mapping[_Group, list[str]], p: PlacementProfile
) -> tuple[str, ...]:
    """The nodes refused for `p`'s engine alone, which they are installing: once it is
    installed they pass every static filter (free cards may still be short then, and
    the next refusal says so)."""
    return tuple(
        sorted(
            nid
            for (stage, _why), ids in static_groups.items()
            if stage == ENGINE_STAGE
            for nid in ids
            if p.engine in nodes[nid].facts.engines_installing
            and _static_reason(nodes[nid], p, engine_ready=True) is None
        )
    )


def _static_reason(
    node: _Node, p: PlacementProfile, *, engine_ready: bool = False
) -> _Group | None:
    """The first static filter `node` fails for `p`; `engine_ready`: as if it had the engine."""
    f = node.facts
    if not f.ready:
        return 0, f"not ready ({f.state})" if f.state else "not ready"
    if f.cordoned:
        return 1, "cordoned"
    wrong = [f"{k}={v}" for k, v in p.node_selector if node.labels.get(k) != v]
    if wrong:
        return 2, f"labels do not match {', '.join(wrong)}"
    if p.gpu_class is not None:
        if f.gpus is None:
            return 3, "GPUs unknown"
        if p.gpu_class not in node.cards:
            return 3, f"has no {p.gpu_class} cards"
    if not engine_ready and f.engines is not None and p.engine not in f.engines:
        said = next((w for name, w in f.engine_words if name == p.engine), None)
        return ENGINE_STAGE, said or f"engine {p.engine} not installed"
    if (
        p.min_memory_gb is not None
        and f.memory_total_bytes is not None
        and f.memory_total_bytes < p.min_memory_gb * GIB
    ):
        has = math.floor(f.memory_total_bytes / GIB * 10) / 10
        return 5, f"has {_num(has)} GB of memory, needs {_num(p.min_memory_gb)} GB"
    if (
        p.weights_bytes is not None
        and p.model not in f.weights
        and f.disk_free_bytes is not None
        and f.disk_free_bytes < p.weights_bytes
    ):
        has = math.floor(f.disk_free_bytes / GIB * 10) / 10
        needs = math.ceil(p.weights_bytes / GIB * 10) / 10
        if f.weights_dir is not None:
            return 6, f"has {_num(has)} GB free on {f.weights_dir}, needs {_num(needs)} GB"
        return 6, f"{_num(has)} GB free for weights, needs {_num(needs)} GB"
    return None


def _adapters(node: _Node, fabric: str, cards: tuple[int, ...]) -> tuple[str, ...]:
    """The fabric's adapters nearest `cards`: per card those at its smallest known
    distance; all of them when a card has no known distance (or there are no cards)."""
    adapters = node.fabrics[fabric]
    if not cards:
        return adapters
    best: dict[str, int] = {}
    for card in cards:
        dist = node.nic.get(card, {})
        near = min((dist.get(a, _FAR) for a in adapters), default=_FAR)
        if near == _FAR:
            return adapters
        for a in adapters:
            if dist.get(a, _FAR) == near:
                best[a] = min(best.get(a, _FAR), near)
    order = {a: i for i, a in enumerate(adapters)}
    return tuple(sorted(best, key=lambda a: (best[a], order[a])))


def _summarise(groups: Mapping[_Group, list[str]]) -> list[str]:
    ordered = sorted(groups.items(), key=lambda kv: (-kv[0][0], min(kv[1]), kv[0][1]))
    lines: list[str] = []
    for (_stage, why), ids in ordered[:MAX_REASON_LINES]:
        names = heapq.nsmallest(NAMES_PER_LINE, ids)
        more = len(ids) - len(names)
        lines.append(f"{', '.join(names)}{f' and {more} more' if more else ''}: {why}")
    rest = sum(len(ids) for _, ids in ordered[MAX_REASON_LINES:])
    if rest:
        lines.append(f"... and {rest} more node{_s(rest)}")
    return lines


def _only(count: int) -> str:
    return "no node" if count == 0 else f"only {count} node{_s(count)}"


def _s(count: int) -> str:
    return "" if count == 1 else "s"


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{x:.1f}"
