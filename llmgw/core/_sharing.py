"""Sharing a card: a share of its memory, or one of its MIG instances.

A profile with `gpu_memory_mib` takes that much memory on each of
`gpus_per_node` cards of its class on one node; a profile with `mig` takes one
free MIG instance of that profile. `Placer` (llmgw/core/_placement.py) asks
`CardShares` where such a replica goes and tells it what was added; the
static filters (ready, labels, engine, memory, disk) are the Placer's.

What a card offers a share (all in MiB):

    free = memory_total_mib - llmgw's claims on it - foreign_mib - SHARED_HEADROOM_MIB

and a share fits when `free >= gpu_memory_mib`: nothing is over-committed. The
headroom is 1 GiB per shared card: every engine process on a card holds a CUDA
context (about 0.5 GiB on an H100 with current drivers) outside the fraction of
memory its engine is told to use, and the allocator rounds; 1 GiB covers two
or three such contexts and still lets three 24 GiB replicas share an 80 GiB
card (73 GiB), which a 2 GiB or larger rule would also allow but a per-replica
rule of 3 GiB would not. Unknown foreign memory counts as none: the card's
`healthy` already says that no more than the facts' limit
(`FOREIGN_MEMORY_LIMIT_MIB`, 1 GiB) is held by others.

A card is offered to shares when it is healthy, not MIG-enabled, not allocated
whole, and its total memory is known (unknown total: not shared, and the
refusal says so). Whole-card profiles never take a card with a claim on it
(the Placer counts a claimed card as in use) nor a MIG-enabled card.

Which card, best first: a card already shared before an empty one (whole
cards stay free for large models); then the fullest card that fits (best
fit); for an empty card, then the node with the fewest whole cards free (a
whole node stays free); then the smaller node id and card index. A share of
N cards takes, on the first node in that order with N cards that fit, the N
best of its cards by the same order.

MIG: a MIG-enabled card offers only its instances, and only to profiles that
name an instance profile ("3g.40gb"). A replica takes one free instance: the
smallest node id with one, then the lowest card index and uuid. CUDA does not
run tensor parallelism across MIG instances, so a MIG profile with more than
one GPU per node or more than one node is refused (`mig_group_refusal`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    from llmgw.core._placement import GpuFacts

SHARED_HEADROOM_MIB: Final = 1024

_Entry = tuple[int, int, str, int]  # (free MiB, whole cards free on its node, node, card)
_NONE: Final[frozenset[str]] = frozenset()
_NO_MIG: Final[frozenset[tuple[str, str]]] = frozenset()


@attrs.frozen
class MigFacts:
    """One MIG instance: its uuid ("MIG-..."), profile ("3g.40gb") and memory."""

    uuid: str
    profile: str
    memory_mib: int | None


def mig_group_refusal(mig: str, gpus_per_node: int, nodes: int) -> str:
    """The words for a MIG profile asked for more than one instance."""
    return (
        f"MIG profile {mig} takes one instance on one node, not {gpus_per_node} GPU"
        f"{'' if gpus_per_node == 1 else 's'} per node on {nodes} node{'' if nodes == 1 else 's'}:"
        " CUDA does not run tensor parallelism across MIG instances"
    )


def share_group_refusal(mib: int, nodes: int) -> str:
    return (
        f"a share of a card ({_gib(mib)} GiB) is placed on one node, not {nodes}:"
        " a group over nodes takes whole cards"
    )


def _offer(g: GpuFacts) -> int | None:
    """What card `g` offers shares with nothing claimed on it; None: it takes none."""
    if not g.healthy or g.mig_enabled or g.memory_total_mib is None:
        return None
    return g.memory_total_mib - (g.foreign_mib or 0) - SHARED_HEADROOM_MIB


def _distinct(gpus: tuple[GpuFacts, ...]) -> tuple[GpuFacts, ...]:
    """The cards by ascending index, a repeated index's first report standing."""
    if all(a.index < b.index for a, b in itertools.pairwise(gpus)):
        return gpus
    first: dict[int, GpuFacts] = {}
    for g in gpus:
        first.setdefault(g.index, g)
    return tuple(first[i] for i in sorted(first))


class CardShares:
    """Memory claims and MIG instances taken, per card, indexed for placement: per
    class, the cards that take shares in two lists sorted best first (shared cards,
    then empty ones), and per (class, MIG profile) the nodes with a free instance."""

    def __init__(
        self,
        nodes: Iterable[tuple[str, tuple[GpuFacts, ...]]],
        whole: Mapping[str, frozenset[int]],
        claims: Mapping[str, Mapping[int, int]],
        mig: Mapping[str, frozenset[str]],
    ) -> None:
        self._nodes = nodes  # read when a share is first placed: whole cards pay nothing
        self._cards: dict[str, tuple[GpuFacts, ...]] | None = None
        self._whole = {n: frozenset(c) for n, c in whole.items()}
        self._claims = {n: {i: m for i, m in c.items() if m} for n, c in claims.items()}
        self._claims = {n: c for n, c in self._claims.items() if c}
        self._taken = {n: set(u) for n, u in mig.items() if u}
        self._fits: dict[str, tuple[list[_Entry], list[_Entry]]] = {}
        self._entries: dict[str, list[tuple[str, int, _Entry]]] = {}
        self._mig_nodes: dict[tuple[str, str], list[str]] = {}
        self._mig_member: dict[str, set[tuple[str, str]]] = {}
        self._dirty: set[str] = set()

    # -- what is held ----------------------------------------------------------------

    def claims(self) -> dict[str, dict[int, int]]:
        return {n: dict(c) for n, c in self._claims.items()}

    def mig_taken(self) -> dict[str, frozenset[str]]:
        return {n: frozenset(u) for n, u in self._taken.items()}

    def busy(self, nid: str) -> int:
        """The cards of `nid` with a claim on them, as a bitmask."""
        claimed = self._claims.get(nid)
        if not claimed:
            return 0
        m = 0
        for i in claimed:
            m |= 1 << i
        return m

    def set_whole(self, nid: str, cards: frozenset[int]) -> None:
        """The cards of `nid` allocated whole are now `cards`."""
        self._whole[nid] = cards
        if self._cards is not None:
            self._dirty.add(nid)  # re-indexed when a share is next placed: whole cards stay fast

    def claim(self, nid: str, cards: Iterable[int], mib: int, sign: int) -> None:
        """Add (`sign` 1) or give back (-1) a claim of `mib` on each of `cards`."""
        self._flush()
        mine = self._claims.setdefault(nid, {})
        for i in cards:
            if sign > 0 and i in self._whole.get(nid, ()):
                raise ValueError(f"{nid}: card {i} is allocated whole, it takes no share")
            left = mine.get(i, 0) + sign * mib
            if left > 0:
                mine[i] = left
            else:
                mine.pop(i, None)
        if not mine:
            del self._claims[nid]
        self._refresh(nid)

    def take_mig(self, nid: str, uuids: Iterable[str], sign: int) -> None:
        """Take (`sign` 1) or give back (-1) MIG instances."""
        self._flush()
        taken = self._taken.setdefault(nid, set())
        for u in uuids:
            if sign > 0:
                if u in taken:
                    raise ValueError(f"{nid}: MIG instance {u} is already taken")
                taken.add(u)
            else:
                taken.discard(u)
        if not taken:
            del self._taken[nid]
        self._refresh(nid)

    # -- deciding ------------------------------------------------------------------

    def find_share(
        self, cls: str, k: int, mib: int, eligible: frozenset[str]
    ) -> tuple[str, tuple[int, ...]] | None:
        """The node and `k` cards for a share of `mib` on each, or None: the sorted
        lists walked best first, or, when few nodes are eligible (a narrow
        node_selector), those nodes' entries compared (the same answer)."""
        self._flush()
        fits = self._fits.get(cls, ([], []))
        if len(eligible) * 8 < len(fits[0]) + len(fits[1]):
            return self._by_node(cls, k, mib, eligible)
        return self._walk(cls, k, mib, eligible)

    def _walk(
        self, cls: str, k: int, mib: int, eligible: frozenset[str]
    ) -> tuple[str, tuple[int, ...]] | None:
        seen: set[str] = set()
        for fits in self._fits.get(cls, ()):
            for j in range(bisect.bisect_left(fits, (mib,)), len(fits)):
                nid = fits[j][2]
                if nid not in eligible or nid in seen:
                    continue
                if k == 1:
                    return nid, (fits[j][3],)
                seen.add(nid)
                cards = self._fitting(nid, cls, mib)
                if len(cards) >= k:
                    return nid, tuple(sorted(cards[:k]))
        return None

    def _by_node(
        self, cls: str, k: int, mib: int, eligible: frozenset[str]
    ) -> tuple[str, tuple[int, ...]] | None:
        """What `_walk` finds: the node with `k` cards that fit whose best card
        comes first in the lists' order."""
        best: tuple[int, _Entry] | None = None
        for nid in eligible:
            fit = [(t, e) for c, t, e in self._entries.get(nid, ()) if c == cls and e[0] >= mib]
            # The lists may hold fewer entries of a node than it has fitting cards (an
            # empty card stands for its node's others): count its cards, as the walk does.
            if not fit or (k > 1 and len(self._fitting(nid, cls, mib)) < k):
                continue
            top = min(fit)
            if best is None or top < best:
                best = top
        if best is None:
            return None
        nid = best[1][2]
        if k == 1:
            return nid, (best[1][3],)
        return nid, tuple(sorted(self._fitting(nid, cls, mib)[:k]))

    def _fitting(self, nid: str, cls: str, mib: int) -> list[int]:
        claimed = self._claims.get(nid, {})
        order = []
        for c in self._flush()[nid]:
            free = self._free(nid, c)
            if c.gpu_class == cls and free is not None and free >= mib:
                order.append((0 if c.index in claimed else 1, free, c.index))
        return [i for _, _, i in sorted(order)]

    def find_mig(
        self, cls: str, profile: str, eligible: frozenset[str]
    ) -> tuple[str, int, str, str] | None:
        """(node, card index, card uuid, instance uuid) of a free instance, or None."""
        self._flush()
        for nid in self._mig_nodes.get((cls, profile), ()):
            if nid in eligible:
                taken = self._taken.get(nid, set())
                for c in self._flush()[nid]:
                    if c.gpu_class == cls and c.mig_enabled:
                        for m in sorted(c.mig, key=lambda m: m.uuid):
                            if m.profile == profile and m.uuid not in taken:
                                return nid, c.index, c.uuid, m.uuid
        return None

    # -- refusing ------------------------------------------------------------------

    def share_why(self, nid: str, cls: str, k: int, mib: int) -> str:
        """Why `nid` takes no share of `mib` on `k` of its `cls` cards, card by card."""
        words: list[str] = []
        fit = 0
        for c in self._flush().get(nid, ()):
            if c.gpu_class != cls:
                continue
            free = self._free(nid, c)
            if free is not None and free >= mib:
                fit += 1
            elif c.mig_enabled:
                words.append(f"gpu {c.index} is MIG-enabled: shared profiles do not use it")
            elif not c.healthy:
                words.append(c.why or f"gpu {c.index} unhealthy{_foreign_words(c)}")
            elif c.index in self._whole.get(nid, ()):
                words.append(f"gpu {c.index} is allocated whole")
            elif c.memory_total_mib is None:
                words.append(f"gpu {c.index} memory total unknown: not shared")
            else:
                has = _gib(max(free or 0, 0), up=False)
                words.append(f"gpu {c.index} has {has} GiB unclaimed, needs {_gib(mib)}")
        if k > 1:
            words.insert(
                0,
                f"{fit} {cls} card{'' if fit == 1 else 's'} with {_gib(mib)} GiB"
                f" unclaimed, needs {k}",
            )
        return "; ".join(words)

    def mig_why(self, nid: str, cls: str, profile: str) -> str:
        """Why `nid` has no free `profile` instance on its `cls` cards."""
        taken = self._taken.get(nid, set())
        said = []
        for c in self._flush().get(nid, ()):
            if c.gpu_class != cls or not c.mig_enabled:
                continue
            if not c.mig:
                said.append(f"gpu {c.index} has no instances")
                continue
            parts = []
            for prof, group in itertools.groupby(
                sorted(c.mig, key=lambda m: m.profile), key=lambda m: m.profile
            ):
                ms = list(group)
                used = sum(m.uuid in taken for m in ms)
                parts.append(f"{prof} x{len(ms)}" + (f" ({used} taken)" if used else ""))
            said.append(f"gpu {c.index} has {', '.join(parts)}")
        if not said:
            return f"no MIG-enabled {cls} card"
        return f"no free {profile} instance ({'; '.join(said)})"

    # -- the index -----------------------------------------------------------------

    def _flush(self) -> dict[str, tuple[GpuFacts, ...]]:
        """The cards, indexed and current (built on first use)."""
        if self._cards is None:
            self._cards = {}
            for nid, gpus in self._nodes:
                if gpus:
                    self._cards[nid] = _distinct(gpus)
            for nid in self._cards:
                self._refresh(nid, bulk=True)
            for lists in self._fits.values():
                for fits in lists:
                    fits.sort()
            for ids in self._mig_nodes.values():
                ids.sort()
            self._dirty = set()
        for nid in sorted(self._dirty):
            self._refresh(nid)
        return self._cards

    def _free(self, nid: str, c: GpuFacts) -> int | None:
        """What `c` offers a share now; None: it takes no shares."""
        offer = _offer(c)
        if offer is None or c.index in self._whole.get(nid, ()):
            return None
        return offer - self._claims.get(nid, {}).get(c.index, 0)

    def _refresh(self, nid: str, *, bulk: bool = False) -> None:
        """Re-index `nid`'s cards after a change; `bulk`: appended, sorted by the caller."""
        put = list.append if bulk else bisect.insort
        self._dirty.discard(nid)
        for cls, tier, entry in self._entries.pop(nid, ()):
            fits = self._fits[cls][tier]
            del fits[bisect.bisect_left(fits, entry)]
        cards = (self._cards or {}).get(nid)
        if cards is None:
            return
        claimed = self._claims.get(nid, {})
        whole = self._whole.get(nid, ())
        offers = []
        whole_free: dict[str, int] = {}
        for c in cards:
            offer = _offer(c)
            if offer is not None and c.index not in whole:
                on = claimed.get(c.index, 0)
                offers.append((c, offer - on, on))
                if not on:
                    whole_free[c.gpu_class] = whole_free.get(c.gpu_class, 0) + 1
        # One entry per (class, tier, room): the lowest index of the cards alike stands
        # for them (the order would put it first), so a fresh node takes one entry.
        entries: list[tuple[str, int, _Entry]] = []
        done: set[tuple[str, int, int]] = set()
        for c, free, on in offers:
            tier = 0 if on else 1
            if (c.gpu_class, tier, free) in done:
                continue
            done.add((c.gpu_class, tier, free))
            entry = (free, 0 if on else whole_free[c.gpu_class], nid, c.index)
            put(self._fits.setdefault(c.gpu_class, ([], []))[tier], entry)
            entries.append((c.gpu_class, tier, entry))
        if entries:
            self._entries[nid] = entries
        taken = self._taken.get(nid, _NONE)
        mig = {
            (c.gpu_class, m.profile)
            for c in cards
            if c.mig_enabled
            for m in c.mig
            if m.uuid not in taken
        }
        before = self._mig_member.pop(nid, _NO_MIG)
        for key in before - mig:
            ids = self._mig_nodes[key]
            del ids[bisect.bisect_left(ids, nid)]
        for key in mig - before:
            put(self._mig_nodes.setdefault(key, []), nid)
        if mig:
            self._mig_member[nid] = mig


def _gib(mib: int, *, up: bool = True) -> str:
    """MiB as GiB to a tenth: rounded up for what is needed, down for what is had."""
    tenths = -(-mib * 10 // 1024) if up else mib * 10 // 1024
    return str(tenths // 10) if tenths % 10 == 0 else f"{tenths / 10:.1f}"


def _foreign_words(c: GpuFacts) -> str:
    """Why a card with no fault named is out: what others hold on it, when known."""
    if c.foreign_mib:
        return f": {c.foreign_mib} MiB held by processes llmgw did not start"
    return ""
