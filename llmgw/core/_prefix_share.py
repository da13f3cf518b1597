"""What router workers tell each other about their prefix indexes: facts, an outbox, a merge.

Pure: values in, index updates out (no clock of its own, no I/O).

With `workers: N`, the kernel hands each connection to one worker, so siblings of a
prompt meet different workers. Each worker's index (llmgw/core/_prefix.py) records
only what that worker sent, so without sharing each worker finds its own home for a
prompt and affinity weakens as workers are added. So each worker tells the others
what its index learned, off the request path, in batches:

Facts
    `Learned(endpoint_id, blocks, sent, delta)`: the chain `blocks` went to the
    endpoint (`sent`: a request with it was dispatched there since the last batch,
    so the engine will hold it), and `delta` more (negative: fewer) requests with it
    are in flight there than the last batch said. A worker notes +1 at dispatch
    and -1 when the request ends, exactly where its own index `begin`s and `end`s
    the chain. A request its index does not record (a spill is not a prompt's new
    home, here either; a route without a prompt) is noted with no blocks: a
    load-only fact, so that each worker counts the others' requests in flight at an
    endpoint (`RemotePending.in_flight`) beside its own, as the engine will, and the
    workers do not all pile onto the endpoint every index now names.

The outbox (one per worker, and one per worker at the relay)
    Facts coalesce by (endpoint, chain): a chain sent twice and ended once in one
    batch is one fact, `sent` and `delta` 1. Bounded in blocks (`max_blocks`):
    beyond it the oldest facts go (`dropped` counts them). A dropped fact costs
    only what no sharing would: the others learn that prompt later or not at all.

The merge rule (`merge`, at the receiver)
    A chain that was sent is recorded in the endpoint's index at the receiver's
    `now` (the batch is at most a tick old; its clock is the receiver's own); one
    only ended re-dates the blocks the index holds (`computed`: the engine held the
    chain until then). A positive `delta` `begin`s the chain as many times: a
    sibling this worker sends while the other's first is still in prefill is
    routed there all the same, and the engine's "not cached" for it teaches
    nothing (`Match.pending`), as for the worker's own requests. A negative delta
    `end`s only what `merge` itself began for the others (`RemotePending`), never
    the worker's own counts, and whatever the others never ended (a worker killed,
    a fact dropped) is ended after `max_age_s` (`RemotePending.expire`). Load-only
    facts move only the per-endpoint count. A fact for an endpoint the receiver
    does not list (its view is a moment behind) is skipped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import attrs

from llmgw.core._prefix import PrefixIndex

# Remote requests not heard to end within this long are taken to have ended.
REMOTE_PENDING_MAX_AGE_S = 120.0


@attrs.frozen
class Learned:
    """One fact about an endpoint's index (see the module doc)."""

    endpoint_id: str
    blocks: tuple[int, ...]
    sent: bool
    delta: int

    def to_json(self) -> list[object]:
        return [self.endpoint_id, int(self.sent), self.delta, list(self.blocks)]

    @classmethod
    def from_json(cls, value: object) -> Learned:
        """A fact from its JSON form; ValueError naming what is wrong."""
        if not (isinstance(value, list) and len(value) == 4):
            raise ValueError(f"a learned fact is [endpoint, sent, delta, blocks], got {value!r}")
        eid, sent, delta, blocks = value
        if not (
            isinstance(eid, str)
            and sent in (0, 1)
            and isinstance(delta, int)
            and isinstance(blocks, list)
            and all(isinstance(b, int) and 0 <= b < 1 << 64 for b in blocks)
        ):
            raise ValueError(
                "a learned fact is [endpoint id, 0 or 1, an integer, a list of unsigned "
                f"64-bit block hashes], got {value!r}"
            )
        return cls(eid, tuple(blocks), bool(sent), delta)


class Outbox:
    """Facts not yet told, coalesced by (endpoint, chain) and bounded in blocks."""

    __slots__ = ("_blocks", "_facts", "dropped", "max_blocks", "taken")

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be 1 or more, got {max_blocks}")
        self.max_blocks = max_blocks
        self._facts: OrderedDict[tuple[str, int | None], Learned] = OrderedDict()
        self._blocks = 0
        self.dropped = 0  # facts dropped for the bound, ever
        self.taken = 0  # facts taken to be told, ever

    def __len__(self) -> int:
        return len(self._facts)

    def __repr__(self) -> str:
        return (
            f"<Outbox {len(self._facts)} facts, {self._blocks}/{self.max_blocks} blocks, "
            f"{self.dropped} dropped>"
        )

    @property
    def blocks(self) -> int:
        return self._blocks

    def sent(self, endpoint_id: str, blocks: Sequence[int]) -> None:
        """A request with the chain was dispatched to the endpoint."""
        self.add(Learned(endpoint_id, tuple(blocks), True, 1))

    def ended(self, endpoint_id: str, blocks: Sequence[int]) -> None:
        """That request ended (answered, failed or cancelled)."""
        self.add(Learned(endpoint_id, tuple(blocks), False, -1))

    def add(self, fact: Learned) -> None:
        key = _key(fact.endpoint_id, fact.blocks)
        old = self._facts.pop(key, None)
        if old is not None:
            self._blocks -= len(old.blocks)
            fact = Learned(
                fact.endpoint_id, fact.blocks, old.sent or fact.sent, old.delta + fact.delta
            )
        if len(fact.blocks) > self.max_blocks:  # one chain over the whole bound: never sent
            self.dropped += 1
            return
        self._facts[key] = fact  # newest last
        self._blocks += len(fact.blocks)
        while self._blocks > self.max_blocks:
            _, gone = self._facts.popitem(last=False)
            self._blocks -= len(gone.blocks)
            self.dropped += 1

    def take(self) -> list[Learned]:
        """Every fact, oldest first; the outbox is empty after."""
        out = list(self._facts.values())
        self.taken += len(out)
        self._facts.clear()
        self._blocks = 0
        return out


def _key(endpoint_id: str, blocks: Sequence[int]) -> tuple[str, int | None]:
    """A chain is named by its endpoint and deepest hash; a load-only fact by its endpoint."""
    return (endpoint_id, blocks[-1] if blocks else None)


class RemotePending:
    """The others' requests in flight, as their facts said: the chains `merge` began in
    this worker's indexes for them, and how many there are per endpoint."""

    __slots__ = ("_begun", "_per_endpoint", "max_age_s")

    def __init__(self, max_age_s: float = REMOTE_PENDING_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        # (endpoint, deepest hash or None) -> [the index it was begun in (None: load
        # only), the chain, how many, when last begun]
        self._begun: dict[
            tuple[str, int | None], tuple[PrefixIndex | None, tuple[int, ...], int, float]
        ] = {}
        self._per_endpoint: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(self._per_endpoint.values())

    def __repr__(self) -> str:
        return f"<RemotePending {len(self)} requests on {len(self._begun)} chains>"

    def in_flight(self, endpoint_id: str) -> int:
        """The others' requests in flight at the endpoint (as far as their facts said)."""
        return self._per_endpoint.get(endpoint_id, 0)

    def _count(self, eid: str, n: int) -> None:
        total = self._per_endpoint.get(eid, 0) + n
        if total > 0:
            self._per_endpoint[eid] = total
        else:
            self._per_endpoint.pop(eid, None)

    def begin(
        self, eid: str, index: PrefixIndex | None, blocks: tuple[int, ...], n: int, now: float
    ) -> None:
        key = _key(eid, blocks)
        held = self._begun.get(key)
        count = n
        if held is not None:
            if held[0] is index:
                count += held[2]
            else:  # the endpoint's index was replaced: the old one's counts went with it
                self._count(eid, -held[2])
        if index is not None:
            for _ in range(n):
                index.begin(blocks)
        self._begun[key] = (index, blocks, count, now)
        self._count(eid, n)

    def end(self, eid: str, blocks: tuple[int, ...], n: int) -> None:
        """End up to `n` of what was begun for this chain there (never more)."""
        key = _key(eid, blocks)
        held = self._begun.get(key)
        if held is None:
            return
        index, chain, count, at = held
        k = min(n, count)
        if index is not None:
            for _ in range(k):
                index.end(chain)
        if count - k > 0:
            self._begun[key] = (index, chain, count - k, at)
        else:
            del self._begun[key]
        self._count(eid, -k)

    def expire(self, now: float) -> int:
        """End what was begun over `max_age_s` ago and never ended; how many requests."""
        old = [k for k, (_, _, _, at) in self._begun.items() if now - at > self.max_age_s]
        ended = 0
        for key in old:
            index, chain, count, _ = self._begun.pop(key)
            if index is not None:
                for _ in range(count):
                    index.end(chain)
            self._count(key[0], -count)
            ended += count
        return ended


def merge(
    indexes: Mapping[str, PrefixIndex],
    remote: RemotePending,
    facts: Iterable[Learned],
    now: float,
) -> int:
    """Apply the others' facts to this worker's indexes (the rule: the module doc).
    Returns how many facts applied (those for endpoints not listed here are skipped)."""
    applied = 0
    for fact in facts:
        index = indexes.get(fact.endpoint_id)
        if index is None:
            continue
        blocks = fact.blocks[: index.capacity]  # deeper than the index holds: no use
        if blocks and fact.sent:
            index.record(blocks, now)
        elif blocks:
            index.computed(blocks, now)
        if fact.delta > 0:
            remote.begin(fact.endpoint_id, index if blocks else None, blocks, fact.delta, now)
        elif fact.delta < 0:
            remote.end(fact.endpoint_id, blocks, -fact.delta)
        applied += 1
    return applied
