"""Where a prompt's prefix is already cached: block chains and a bounded index per endpoint.

Pure: bytes and clock values in, numbers out.

Blocks and chains
    A prompt (its canonical bytes: llmgw/router/_surface.py `prompt_bytes`) is
    cut into whole blocks of `block_bytes`; a partial last block is not hashed.
    Block i's hash covers block i and, through block i-1's hash, everything
    before it: two prompts share a hash at depth i exactly when their first
    i + 1 blocks are equal (a 64-bit collision aside, which costs only a wrong
    guess about a cache). The hash is BLAKE2b with an 8-byte digest, salted
    with the previous block's: the same in every process, so router workers
    can tell each other what their indexes learned (llmgw/core/_prefix_share.py).
    Measured here: 0.7 us a 256-byte block (an 8 KB prompt in 23 us); Python's
    own hash() takes 0.2 us but is seeded afresh in every process.

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
    - Time-decayed: a match counts for less as it ages, half of it per
      half-life, and an entry older than `EXPIRE_HALF_LIVES` configured
      half-lives is dropped: an engine's cache does not keep a prompt for ever.
    - Corrected by the engine: where an engine says how much of a prompt it
      had cached (`usage.prompt_tokens_details.cached_tokens`), the router
      compares it with the index's guess (`observe`). A guess that missed at
      age a says the engine keeps prompts for less than that; one that hit
      says at least that. The endpoint's half-life (`half_life_s`, from the
      configured one down to `MIN_HALF_LIFE_S`) moves halfway toward the age
      of each miss younger than it and of each hit older than it, so an
      engine with a small cache gets little credit for old matches. Never
      none: an old match still breaks a tie toward where the prompt last
      went, so the router keeps sending a prompt to one engine (which then
      holds it) instead of spreading it, and a cold cache over every
      endpoint. Measured on two llama-servers with a hard cut-off instead,
      the learned cut-off fell to 1.4 s, homes drifted, and the engines' hit
      ratio fell to round robin's.
    - In flight is not evicted: a chain is `begin`-ed at dispatch, `computed`
      when its answer starts (its blocks' times move to that moment: the
      engine holds it from then) and `end`-ed when the request ends. A sibling
      matched while another request with its prefix is in flight there is
      routed there all the same (its later siblings hit), but the engine's
      "not cached" for it is no sign of eviction and teaches nothing
      (`Match.pending`): the first may still be in prefill, and llama.cpp
      cannot share a prompt held in a busy slot. Measured on two
      llama-servers without this, siblings 0.4-0.6 s behind their first
      "missed", the retention fell below a second, and the index stopped
      crediting anything.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence

import attrs

EXPIRE_HALF_LIVES = 8.0
MIN_HALF_LIFE_S = 0.1
# A report of at least this share of the guessed cached part counts as a hit.
_HIT_SHARE = 0.5
# How far one observation moves the learned retention toward what it saw.
_LEARN = 0.5


def chain(prompt: bytes, block_bytes: int, under: str = "") -> list[int]:
    """The chain hashes of the prompt's whole blocks, first block first (unsigned
    64-bit; equal in every process). `under`: the LoRA adapter the prompt is computed
    under ("": the base), which starts the chain, so one prompt under two adapters
    shares no block (an engine's cache of one is no use to the other)."""
    out: list[int] = []
    digest = _start(under)
    end = len(prompt) - len(prompt) % block_bytes
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    for i in range(0, end, block_bytes):
        digest = blake2b(prompt[i : i + block_bytes], digest_size=8, salt=digest).digest()
        out.append(from_bytes(digest, "little"))
    return out


def _start(under: str) -> bytes:
    """The salt a chain starts from: none for the base, else the adapter's own."""
    if not under:
        return b""
    return hashlib.blake2b(under.encode(), digest_size=8, person=b"llmgw-lora").digest()


@attrs.frozen
class Match:
    """What the index holds of a chain: `blocks` deep, last used `age_s` ago."""

    blocks: int
    age_s: float | None  # None: nothing matched
    credit: float  # blocks, decayed by age; 0 past the learned retention
    # Another request with the deepest matched block is in flight there: the engine
    # may not hold it where this one can use it yet (still in prefill, or, in
    # llama.cpp, in a busy slot's memory), so "not cached" says nothing of how long
    # it keeps prompts.
    pending: bool = False


NO_MATCH = Match(0, None, 0.0)


class PrefixIndex:
    """One endpoint's record of the block chains sent there (see the module doc)."""

    __slots__ = (
        "_entries",
        "_pending",
        "capacity",
        "half_life_s",
        "hits",
        "max_half_life_s",
        "misses",
    )

    def __init__(self, capacity: int, half_life_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be 1 block or more, got {capacity}")
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ValueError(f"half_life_s must be a positive number, got {half_life_s}")
        self._entries: OrderedDict[int, float] = OrderedDict()
        # Blocks of chains of requests in flight here: block -> how many. At most the
        # endpoint's in-flight requests' blocks.
        self._pending: dict[int, int] = {}
        self.capacity = capacity
        self.max_half_life_s = half_life_s  # as configured
        self.half_life_s = half_life_s  # as learned from the engine
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"<PrefixIndex {len(self._entries)}/{self.capacity} blocks, "
            f"half-life {self.half_life_s:.1f} s, "
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
        deepest = blocks[lo - 1]
        age = max(0.0, now - entries[deepest])
        return Match(lo, age, lo * 0.5 ** (age / self.half_life_s), deepest in self._pending)

    def record(self, blocks: Sequence[int], now: float) -> None:
        """The chain was sent here at `now`: the engine will hold it."""
        entries = self._entries
        for h in reversed(blocks):  # deepest first: a parent stays more recent
            entries[h] = now
            entries.move_to_end(h)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
        horizon = now - EXPIRE_HALF_LIVES * self.max_half_life_s
        while entries:
            oldest = next(iter(entries.values()))
            if oldest >= horizon:
                break
            entries.popitem(last=False)

    def begin(self, blocks: Sequence[int]) -> None:
        """A request with this chain was sent here; `end` it when it ends."""
        pending = self._pending
        for h in blocks:
            pending[h] = pending.get(h, 0) + 1

    def computed(self, blocks: Sequence[int], now: float) -> None:
        """That request's answer has begun: the engine holds the chain from `now`."""
        entries = self._entries
        for h in reversed(blocks):  # as record(): parents stay more recent
            if h in entries:
                entries[h] = now
                entries.move_to_end(h)

    def end(self, blocks: Sequence[int]) -> None:
        """That request has ended (answered, failed or cancelled)."""
        pending = self._pending
        for h in blocks:
            n = pending.get(h, 0)
            if n <= 1:
                pending.pop(h, None)
            else:
                pending[h] = n - 1

    def observe(self, guessed: Match, guessed_tokens: float, cached_tokens: int) -> str | None:
        """The engine said it had `cached_tokens` of a prompt the index guessed held
        `guessed_tokens` deep (matched at `guessed.age_s`): learn the half-life.
        Returns "hit", "miss", "pending" (a miss while another request with the
        prefix was in flight there: nothing learned), or None when nothing was guessed."""
        age = guessed.age_s
        if age is None or guessed_tokens <= 0:
            return None
        if guessed.pending and cached_tokens < _HIT_SHARE * guessed_tokens:
            return "pending"
        if cached_tokens >= _HIT_SHARE * guessed_tokens:
            self.hits += 1
            if age > self.half_life_s:
                self.half_life_s = min(
                    self.max_half_life_s, self.half_life_s + _LEARN * (age - self.half_life_s)
                )
            return "hit"
        self.misses += 1
        if age < self.half_life_s:
            self.half_life_s = max(
                MIN_HALF_LIFE_S, self.half_life_s - _LEARN * (self.half_life_s - age)
            )
        return "miss"

    def forget(self) -> None:
        """The engine restarted or was replaced: it holds nothing the index says."""
        self._entries.clear()  # pending counts stay: their requests still end
        self.half_life_s = self.max_half_life_s
