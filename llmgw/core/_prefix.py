"""Where a prompt's prefix is already cached: block chains and a bounded index per endpoint.

Pure: bytes and clock values in, numbers out.

Blocks and chains
    A prompt (its canonical bytes: llmgw/router/_surface.py `prompt_bytes`) is
    cut into whole blocks of `block_bytes`; a partial last block is not hashed.
    Block i's hash covers block i and, through block i-1's hash, everything
    before it: two prompts share a hash at depth i exactly when their first
    i + 1 blocks are equal (a 64-bit collision aside, which costs only a wrong
    guess about a cache). The hash is Python's own (SipHash): the fastest here
    by far, and an index never leaves the process that made it.

The index (one per endpoint)
    The router's own record of the chains it has sent to an endpoint
    (predict-on-route: the burst of siblings that follows a first request is
    routed to it before any engine reports anything). An OrderedDict from block
    hash to the clock value of its last use, least recently used first:

    - Bounded: at most `capacity` blocks; beyond that the least recently used
      go. An entry costs about 100 bytes (the dict's slot and link, the int
      key; a chain's blocks share one float), so the default 8,192 blocks is
      under 1 MiB per endpoint and holds 2 MiB of prompt text at 256-byte blocks.
    - Prefix-closed: a chain is recorded deepest block first, so a block's
      parent is always at least as recent as the block. Eviction and expiry
      take the least recent first, so whenever block i is held, blocks 0..i-1
      are too, and a lookup is a binary search over the prompt's chain:
      O(log blocks) per endpoint, never a scan of the entries.
    - Time-decayed: a match counts for less as it ages (half of it per
      `half_life_s`), and an entry older than `EXPIRE_HALF_LIVES` half-lives is
      dropped: an engine's cache does not keep a prompt for ever.
    - Corrected by the engine: where an engine says how much of a prompt it
      had cached (`usage.prompt_tokens_details.cached_tokens`), the router
      compares it with the index's guess (`observe`). A guess that missed at
      age a says the engine keeps prompts for less than a; one that hit says
      for at least a. The index learns that retention (`retention_s`, None
      until a miss is seen) and gives no credit to older matches, so an engine
      with a small cache is not credited with prompts it has dropped.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import attrs

EXPIRE_HALF_LIVES = 8.0
# A report of at least this share of the guessed cached part counts as a hit.
_HIT_SHARE = 0.5
# How far one observation moves the learned retention toward what it saw.
_LEARN = 0.5


def chain(prompt: bytes, block_bytes: int) -> list[int]:
    """The chain hashes of the prompt's whole blocks, first block first."""
    out: list[int] = []
    h = 0
    end = len(prompt) - len(prompt) % block_bytes
    for i in range(0, end, block_bytes):
        h = hash((h, prompt[i : i + block_bytes]))
        out.append(h)
    return out


@attrs.frozen
class Match:
    """What the index holds of a chain: `blocks` deep, last used `age_s` ago."""

    blocks: int
    age_s: float | None  # None: nothing matched
    credit: float  # blocks, decayed by age; 0 past the learned retention


NO_MATCH = Match(0, None, 0.0)


class PrefixIndex:
    """One endpoint's record of the block chains sent there (see the module doc)."""

    __slots__ = (
        "_entries",
        "capacity",
        "half_life_s",
        "hits",
        "misses",
        "retention_s",
    )

    def __init__(self, capacity: int, half_life_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be 1 block or more, got {capacity}")
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ValueError(f"half_life_s must be a positive number, got {half_life_s}")
        self._entries: OrderedDict[int, float] = OrderedDict()
        self.capacity = capacity
        self.half_life_s = half_life_s
        self.retention_s: float | None = None
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        keep = "unknown" if self.retention_s is None else f"{self.retention_s:.1f} s"
        return (
            f"<PrefixIndex {len(self._entries)}/{self.capacity} blocks, retention {keep}, "
            f"{self.hits} hits {self.misses} misses>"
        )

    def match(self, blocks: Sequence[int], now: float) -> Match:
        """How deep the index holds `blocks`, and the credit that is worth now."""
        entries = self._entries
        if not blocks or blocks[0] not in entries:
            return NO_MATCH
        lo, hi = 1, len(blocks)  # blocks[:lo] held; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in entries:
                lo = mid
            else:
                hi = mid - 1
        age = max(0.0, now - entries[blocks[lo - 1]])
        if self.retention_s is not None and age > self.retention_s:
            return Match(lo, age, 0.0)
        return Match(lo, age, lo * 0.5 ** (age / self.half_life_s))

    def record(self, blocks: Sequence[int], now: float) -> None:
        """The chain was sent here at `now`: the engine will hold it."""
        entries = self._entries
        for h in reversed(blocks):  # deepest first: a parent stays more recent
            entries[h] = now
            entries.move_to_end(h)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
        horizon = now - EXPIRE_HALF_LIVES * self.half_life_s
        while entries:
            oldest = next(iter(entries.values()))
            if oldest >= horizon:
                break
            entries.popitem(last=False)

    def observe(self, guessed: Match, guessed_tokens: float, cached_tokens: int) -> str | None:
        """The engine said it had `cached_tokens` of a prompt the index guessed held
        `guessed_tokens` deep (matched at `guessed.age_s`): learn the retention.
        Returns "hit" or "miss" for the guess, None when nothing was guessed."""
        age = guessed.age_s
        if age is None or guessed_tokens <= 0:
            return None
        if cached_tokens >= _HIT_SHARE * guessed_tokens:
            self.hits += 1
            if self.retention_s is not None and age > self.retention_s:
                self.retention_s += _LEARN * (age - self.retention_s)
            return "hit"
        else:
            self.misses += 1
            if self.retention_s is None:
                self.retention_s = age
            elif age < self.retention_s:
                self.retention_s -= _LEARN * (self.retention_s - age)
            return "miss"

    def forget(self) -> None:
        """The engine restarted or was replaced: it holds nothing the index says."""
        self._entries.clear()
