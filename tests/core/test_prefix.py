from __future__ import annotations

import gc
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core._prefix import EXPIRE_HALF_LIVES, NO_MATCH, PrefixIndex, chain

B = 16


def test_blocks_are_whole_and_chained() -> None:
    assert chain(b"", B) == []
    assert chain(b"x" * 15, B) == []  # a partial block is not hashed
    a = chain(b"A" * 16 + b"B" * 16 + b"C" * 16, B)
    b = chain(b"A" * 16 + b"B" * 16 + b"D" * 16 + b"tail", B)
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    # The same block after a different history is a different link of the chain.
    c = chain(b"Z" * 16 + b"B" * 16, B)
    assert c[1] != a[1]


def test_a_recorded_chain_matches_as_deep_as_it_is_shared() -> None:
    index = PrefixIndex(capacity=1000, half_life_s=60)
    system = b"s" * 160  # ten blocks
    index.record(chain(system + b"q" * 32, B), now=0)
    m = index.match(chain(system + b"other question...", B), now=0)
    assert m.blocks == 10 and m.age_s == 0 and m.credit == 10
    assert index.match(chain(b"unrelated" * 10, B), now=0) is NO_MATCH
    assert index.match([], now=0) is NO_MATCH


def test_credit_halves_per_half_life_and_old_entries_expire() -> None:
    index = PrefixIndex(capacity=1000, half_life_s=10)
    blocks = chain(b"p" * 64, B)
    index.record(blocks, now=0)
    assert index.match(blocks, now=10).credit == pytest.approx(2.0)
    assert index.match(blocks, now=20).credit == pytest.approx(1.0)
    # Another record well past the horizon sweeps the old chain out.
    index.record(chain(b"n" * 32, B), now=EXPIRE_HALF_LIVES * 10 + 1)
    assert len(index) == 2
    assert index.match(blocks, now=EXPIRE_HALF_LIVES * 10 + 1) is NO_MATCH


def test_capacity_bounds_the_blocks_least_recently_used_first() -> None:
    index = PrefixIndex(capacity=8, half_life_s=60)
    old = chain(b"o" * 64, B)  # 4 blocks
    new = chain(b"n" * 64, B)
    index.record(old, now=0)
    index.record(new, now=1)
    assert len(index) == 8
    index.record(old, now=2)  # touched: now the most recent
    index.record(chain(b"x" * 32, B), now=3)  # 2 more: the 2 oldest go, from `new`'s tail
    assert len(index) == 8
    assert index.match(old, now=3).blocks == 4
    assert index.match(new, now=3).blocks == 2  # its deepest blocks went first


def test_memory_per_block_is_as_documented() -> None:
    """The module doc says about 100 bytes a block; 8,192 blocks under 1 MiB."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(capacity=8192, half_life_s=60)
    for i in range(64):
        index.record(chain(i.to_bytes(4, "big") * 1024, 256), now=float(i))  # 16 blocks each
    blocks = len(index)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert blocks == 1024
    assert used / blocks < 160, f"{used / blocks:.0f} bytes a block"
    assert used / blocks * 8192 < 1.3 * 2**20


def test_the_engine_teaches_the_index_how_fast_to_decay() -> None:
    index = PrefixIndex(capacity=1000, half_life_s=600)
    blocks = chain(b"p" * 160, B)
    index.record(blocks, now=0)
    guess = index.match(blocks, now=30)
    assert index.half_life_s == 600 and guess.credit == pytest.approx(10 * 0.5 ** (30 / 600))
    # The engine had none of it at age 30: the half-life moves halfway toward 30.
    assert index.observe(guess, guessed_tokens=40, cached_tokens=0) == "miss"
    assert index.half_life_s == pytest.approx(315)
    assert index.observe(index.match(blocks, now=30), 40, cached_tokens=0) == "miss"
    assert index.half_life_s == pytest.approx(172.5)
    # An old match still counts for something: it breaks ties toward the prompt's home.
    assert 0 < index.match(blocks, now=1000).credit < 0.2
    # A hit younger than the half-life teaches nothing; an older one moves it up.
    assert index.observe(index.match(blocks, now=100), 40, cached_tokens=40) == "hit"
    assert index.half_life_s == pytest.approx(172.5)
    assert index.observe(index.match(blocks, now=372.5), 40, cached_tokens=39) == "hit"
    assert index.half_life_s == pytest.approx(272.5)
    assert index.observe(NO_MATCH, 0, cached_tokens=100) is None
    assert (index.hits, index.misses) == (2, 2)
    index.forget()
    assert len(index) == 0 and index.half_life_s == 600


def test_a_miss_while_the_prefix_is_in_flight_there_teaches_nothing() -> None:
    """A sibling sent while its first is still in prefill (or, in llama.cpp, held in a
    busy slot) is reported uncached: that is no eviction, and the half-life stays."""
    index = PrefixIndex(capacity=1000, half_life_s=60)
    first = chain(b"s" * 160 + b"first question..", B)
    sibling = chain(b"s" * 160 + b"second question.", B)
    index.record(first, now=0)
    index.begin(first)
    guess = index.match(sibling, now=0.4)
    assert guess.blocks == 10 and guess.pending
    assert index.observe(guess, 40, cached_tokens=0) == "pending"
    assert index.half_life_s == 60 and index.misses == 0
    # Its answer begins at 0.8 s: the engine holds it from then.
    index.computed(first, now=0.8)
    assert index.match(sibling, now=0.8).age_s == 0
    index.end(first)
    later = index.match(sibling, now=10)
    assert not later.pending
    assert index.observe(later, 40, cached_tokens=0) == "miss"
    assert index.half_life_s == pytest.approx(34.6)  # age 9.2: held from 0.8 s
    assert index._pending == {}


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity must be 1 block or more, got 0"):
        PrefixIndex(capacity=0, half_life_s=1)
    with pytest.raises(ValueError, match="half_life_s must be a positive number, got 0"):
        PrefixIndex(capacity=1, half_life_s=0)


# -- properties ----------------------------------------------------------------------------

prompts = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(0, 5)), min_size=1, max_size=60
)


def _prompt(family: int, depth: int, tail: int) -> bytes:
    """Family f's shared blocks, `depth` of them, then a tail of its own."""
    return b"".join(bytes([family, i]) * 8 for i in range(depth)) + bytes([200 + tail]) * 16


@settings(max_examples=200)
@given(prompts, st.integers(1, 40), st.integers(0, 59))
def test_the_index_stays_prefix_closed_and_binary_search_equals_a_walk(
    recorded: list[tuple[int, int, int]], capacity: int, probe: int
) -> None:
    """Whatever is recorded and evicted, a held block's parents are held, so the binary
    search in `match` finds exactly what a walk from the first block finds; and the
    index never holds more than its capacity."""
    index = PrefixIndex(capacity=capacity, half_life_s=5)
    for t, (f, d, tail) in enumerate(recorded):
        index.record(chain(_prompt(f, d, tail), B), now=float(t))
        assert len(index) <= capacity
    now = float(len(recorded))
    for f, d, tail in recorded:
        blocks = chain(_prompt(f, d, tail), B)
        walked = 0
        while walked < len(blocks) and blocks[walked] in index._entries:
            walked += 1
        held = [h in index._entries for h in blocks]
        assert held == [True] * walked + [False] * (len(blocks) - walked)
        assert index.match(blocks, now).blocks == walked
    f, d, tail = recorded[probe % len(recorded)]
    last = chain(_prompt(*recorded[-1]), B)
    assert index.match(last, now).blocks == min(len(last), capacity)


@settings(max_examples=100)
@given(st.binary(max_size=600), st.binary(max_size=600), st.sampled_from([1, 7, 16, 64]))
def test_chains_agree_exactly_as_far_as_the_prompts_share_whole_blocks(
    a: bytes, b: bytes, block: int
) -> None:
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    ca, cb = chain(a, block), chain(b, block)
    common = 0
    while common < min(len(ca), len(cb)) and ca[common] == cb[common]:
        common += 1
    assert common == min(shared // block, len(ca), len(cb))
