"""Replicas sharing a card, watched against their claims: a pure decision.

A shard placed on a share of a card claims `gpu_memory_mib` of it
(model.ShardSpec); its engine is told its share (`--gpu-memory-utilization`)
but nothing enforces it: an engine can grow past it (a CUDA graph, a fragment,
llama-server with no budget flag). The agent measures what each shard's
process group holds on its cards (nvidia-smi / NVML compute-apps), and
`watch_card` decides, for one card at one moment:

- which shards hold more than their claim, and by how much (`over`): each is
  reported; a shard whose measurement is unknown, or that claims no share
  (a whole card), is never over;
- whether the card is out of memory: its `memory.used` within `OOM_MARGIN_MIB`
  of its total, or the memory its processes are known to hold (foreign and
  the shards' measured, the unknown parts left out: a lower bound) at or past
  its total;
- and on a card out of memory, the ONE shard to replace: the one most over
  its claim (ties: the one that holds the most, then the smallest id). A
  shard within its claim is never picked (it kept its word; replacing it frees
  memory someone else will take), so a card full with no shard over picks
  none: a foreign process did it, and the card's health says so already.

`OOM_MARGIN_MIB`: an engine allocates its KV cache and activations in blocks of
tens to hundreds of MiB, so a card with under 256 MiB free is one allocation from
a CUDA out-of-memory error; 256 MiB is a third of a percent of an 80 GiB card, and
far below a share's claim, so it never reads a packed card (whose claims leave
`SHARED_HEADROOM_MIB`) as full.

A shard's measurement is one number, the most it holds on any one of its cards
(its claim is per card too); a shard spread over several cards is counted on
each at that figure.
"""

from __future__ import annotations

import attrs

OOM_MARGIN_MIB = 256


@attrs.frozen
class ShareUse:
    """One shard on a card: what it claims and what it holds."""

    shard_id: str
    replica_id: str | None
    claim_mib: int | None  # its share of the card; None: a whole card, no claim
    used_mib: int | None  # measured; None: unknown


@attrs.frozen
class CardUse:
    """One card: its memory and the shards on it."""

    total_mib: int | None
    used_mib: int | None  # the card's memory.used; None: unknown
    foreign_mib: int | None  # held by processes llmgw did not start; None: unknown
    shares: tuple[ShareUse, ...]


@attrs.frozen
class OverClaim:
    shard_id: str
    replica_id: str | None
    claim_mib: int
    used_mib: int

    @property
    def over_mib(self) -> int:
        return self.used_mib - self.claim_mib

    def words(self) -> str:
        """`holds 30720 MiB, claims 24576 (6144 over)` (events, ctl, logs)."""
        return f"holds {self.used_mib} MiB, claims {self.claim_mib} ({self.over_mib} over)"


@attrs.frozen
class CardVerdict:
    over: tuple[OverClaim, ...]  # in the order given
    out_of_memory: bool
    held_mib: int | None  # what the verdict read as used: the larger of memory.used and the
    # processes' known sum; None: neither known
    replace: OverClaim | None  # on a card out of memory: the one to replace

    def full_words(self, total_mib: int | None) -> str:
        """`holds 81400 of 81559 MiB` (the reason of a replacement)."""
        return f"holds {self.held_mib} of {total_mib} MiB"


def over_claim(share: ShareUse) -> OverClaim | None:
    if share.claim_mib is None or share.used_mib is None or share.used_mib <= share.claim_mib:
        return None
    return OverClaim(share.shard_id, share.replica_id, share.claim_mib, share.used_mib)


def apps_sum(card: CardUse) -> int | None:
    """What the card's processes are known to hold (foreign and shards; unknown parts
    left out, so a lower bound); None: nothing known."""
    parts = [s.used_mib for s in card.shares if s.used_mib is not None]
    if card.foreign_mib is not None:
        parts.append(card.foreign_mib)
    return sum(parts) if parts else None


def out_of_memory(card: CardUse, margin_mib: int = OOM_MARGIN_MIB) -> bool:
    if card.total_mib is None:
        return False
    if card.used_mib is not None and card.used_mib >= card.total_mib - margin_mib:
        return True
    known = apps_sum(card)
    return known is not None and known >= card.total_mib


def watch_card(card: CardUse, margin_mib: int = OOM_MARGIN_MIB) -> CardVerdict:
    """The module says what is decided."""
    over = tuple(o for s in card.shares if (o := over_claim(s)) is not None)
    full = out_of_memory(card, margin_mib)
    seen = [v for v in (card.used_mib, apps_sum(card)) if v is not None]
    pick = None
    if full and over:
        pick = min(over, key=lambda o: (-o.over_mib, -o.used_mib, o.shard_id))
    return CardVerdict(over, full, max(seen) if seen else None, pick)
