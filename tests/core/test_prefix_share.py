"""What router workers tell each other about their prefix indexes (llmgw/core/_prefix_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core._prefix import PrefixIndex, chain
from llmgw.core._prefix_share import Learned, Outbox, RemotePending, merge

B = 16


def _chain(family: int, depth: int) -> tuple[int, ...]:
    return tuple(chain(b"".join(bytes([family, i]) * 8 for i in range(depth)), B))


def test_chains_are_equal_in_every_process() -> None:
    """Workers are processes with hash seeds of their own: a chain must not depend on one."""
    code = "from llmgw.core import chain; print(chain(b'x' * 40 + b'y' * 40, 16))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert seen == {f"{chain(b'x' * 40 + b'y' * 40, 16)}\n"}
    assert all(0 <= h < 1 << 64 for h in chain(b"z" * 64, 16))


def test_the_outbox_coalesces_by_endpoint_and_chain() -> None:
    box = Outbox(max_blocks=100)
    a, b = _chain(1, 4), _chain(2, 3)
    box.sent("e1", a)
    box.sent("e1", a)
    box.ended("e1", a)
    box.sent("e2", a)  # the same chain elsewhere: a fact of its own
    box.ended("e1", b)  # ended only (its dispatch went out in an earlier batch)
    assert len(box) == 3 and box.blocks == 11
    assert box.take() == [
        Learned("e1", a, True, 1),
        Learned("e2", a, True, 1),
        Learned("e1", b, False, -1),
    ]
    assert len(box) == 0 and box.blocks == 0 and box.take() == []


def test_the_outbox_drops_its_oldest_facts_beyond_its_bound() -> None:
    box = Outbox(max_blocks=10)
    box.sent("e", _chain(1, 4))
    box.sent("e", _chain(2, 4))
    box.sent("e", _chain(3, 4))  # 12 blocks: the oldest goes
    assert [f.blocks for f in box.take()] == [_chain(2, 4), _chain(3, 4)]
    box.sent("e", _chain(4, 11))  # over the whole bound: never sent
    assert box.take() == [] and box.dropped == 2
    with pytest.raises(ValueError, match="max_blocks must be 1 or more, got 0"):
        Outbox(0)


def test_merge_records_begins_and_ends_only_what_it_began() -> None:
    index = PrefixIndex(capacity=100, half_life_s=60)
    remote = RemotePending(max_age_s=30)
    own, theirs = _chain(1, 5), _chain(2, 5)
    index.record(own, now=0)
    index.begin(own)  # this worker's own request
    applied = merge(
        {"e": index},
        remote,
        [Learned("e", theirs, True, 2), Learned("gone", theirs, True, 1)],
        now=1.0,
    )
    assert applied == 1  # "gone" is not listed here
    m = index.match(theirs, now=1.0)
    assert (m.blocks, m.age_s, m.pending) == (5, 0.0, True)
    # An end for a chain it never began for the others ends nothing of its own.
    merge({"e": index}, remote, [Learned("e", own, False, -3)], now=2.0)
    assert index.match(own, now=2.0).pending
    # One of theirs ended: one still in flight there; then the other.
    merge({"e": index}, remote, [Learned("e", theirs, False, -1)], now=3.0)
    assert index.match(theirs, now=3.0).pending and len(remote) == 1
    merge({"e": index}, remote, [Learned("e", theirs, False, -5)], now=4.0)
    m = index.match(theirs, now=4.0)
    assert not m.pending and m.age_s == 0.0  # re-dated: the engine held it till now
    assert len(remote) == 0
    index.end(own)
    assert index._pending == {}


def test_the_others_requests_in_flight_are_counted_per_endpoint() -> None:
    """Load-only facts (a spill, a route without a prompt) move only the count; chains
    move it too. The count is what a worker adds to its own in-flight figure."""
    index = PrefixIndex(capacity=100, half_life_s=60)
    remote = RemotePending(max_age_s=30)
    theirs = _chain(4, 3)
    facts = [Learned("e", (), True, 2), Learned("e", theirs, True, 1), Learned("f", (), True, 1)]
    merge({"e": index, "f": PrefixIndex(10, 60)}, remote, facts, now=0.0)
    assert (remote.in_flight("e"), remote.in_flight("f"), remote.in_flight("g")) == (3, 1, 0)
    assert len(index) == 3  # the load-only facts recorded nothing
    merge({"e": index}, remote, [Learned("e", (), False, -5)], now=1.0)
    assert remote.in_flight("e") == 1  # never below what was begun: the chain's one
    box = Outbox(max_blocks=10)
    box.sent("e", ())
    box.sent("e", ())
    box.ended("e", ())
    assert box.take() == [Learned("e", (), True, 1)]
    assert remote.expire(now=40.0) == 2 and len(remote) == 0


def test_what_the_others_never_end_is_ended_after_max_age() -> None:
    index = PrefixIndex(capacity=100, half_life_s=60)
    remote = RemotePending(max_age_s=30)
    theirs = _chain(3, 4)
    merge({"e": index}, remote, [Learned("e", theirs, True, 1)], now=0.0)
    assert remote.expire(now=29.0) == 0 and index.match(theirs, 29.0).pending
    assert remote.expire(now=31.0) == 1
    assert not index.match(theirs, 31.0).pending and index._pending == {}


def test_a_fact_is_checked_from_its_json_form() -> None:
    fact = Learned("r1@n1", (1, 2, (1 << 64) - 1), True, 1)
    assert Learned.from_json(fact.to_json()) == fact
    for bad in (
        ["e", 1, 1],
        ["e", 2, 1, [1]],
        ["e", 1, 1, [-1]],
        ["e", 1, 1, [1 << 64]],
        [1, 1, 1, [1]],
        ["e", 1, "1", [1]],
    ):
        with pytest.raises(ValueError, match="a learned fact is"):
            Learned.from_json(bad)


# -- properties ----------------------------------------------------------------------------

events = st.lists(
    st.tuples(
        st.sampled_from(["send", "spill", "end", "tick"]),
        st.sampled_from(["e1", "e2"]),
        st.integers(0, 3),  # the prompt family
        st.integers(1, 6),  # its depth in blocks
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(events)
def test_a_worker_that_hears_every_batch_holds_what_the_other_sent_and_its_in_flight(
    script: list[tuple[str, str, int, int]],
) -> None:
    """Worker A sends (or spills) and ends requests and tells its outbox to B at every
    tick; B's indexes then hold every chain A's hold, B's pending marks exactly the
    chains A has in flight, B counts A's requests in flight per endpoint, and once A's
    requests have all ended and been told, B has nothing pending (its own counts
    untouched)."""
    cap = 1000
    a = {e: PrefixIndex(cap, 60) for e in ("e1", "e2")}
    b = {e: PrefixIndex(cap, 60) for e in ("e1", "e2")}
    box, remote = Outbox(max_blocks=10_000), RemotePending()
    in_flight: list[tuple[str, tuple[int, ...]]] = []
    b_own = _chain(9, 3)
    b["e1"].record(b_own, 0.0)
    b["e1"].begin(b_own)
    now = 0.0

    def tick() -> None:
        merge(b, remote, box.take(), now)
        for e in a:
            held = set(a[e]._entries)
            assert held <= set(b[e]._entries)
            assert {h for h in a[e]._pending} == {h for h in b[e]._pending} - (
                set(b_own) if e == "e1" else set()
            )
            assert remote.in_flight(e) == sum(1 for x, _ in in_flight if x == e)

    for kind, e, family, depth in script:
        now += 1.0
        blocks = _chain(family, depth)
        if kind == "send":
            a[e].record(blocks, now)
            a[e].begin(blocks)
            box.sent(e, blocks)
            in_flight.append((e, blocks))
        elif kind == "spill":  # not recorded where it went: its load only
            box.sent(e, ())
            in_flight.append((e, ()))
        elif kind == "end" and in_flight:
            e, blocks = in_flight.pop(0)
            if blocks:
                a[e].end(blocks)
            box.ended(e, blocks)
        else:
            tick()
    for e, blocks in in_flight:
        if blocks:
            a[e].end(blocks)
        box.ended(e, blocks)
    in_flight.clear()
    now += 1.0
    tick()
    assert len(remote) == 0
    assert b["e1"]._pending == dict.fromkeys(b_own, 1) and b["e2"]._pending == {}


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.sampled_from(["e1", "e2", "e3"]), st.integers(0, 5), st.integers(1, 8)),
        max_size=40,
    ),
    st.integers(1, 40),
)
def test_the_outbox_stays_within_its_bound_and_keeps_the_newest(
    sent: list[tuple[str, int, int]], bound: int
) -> None:
    box = Outbox(max_blocks=bound)
    for e, family, depth in sent:
        box.sent(e, _chain(family, depth))
        assert box.blocks <= bound
    facts = box.take()
    assert sum(len(f.blocks) for f in facts) <= bound
    keys = [(f.endpoint_id, f.blocks[-1]) for f in facts]
    assert len(set(keys)) == len(keys)  # coalesced
    if sent and len(_chain(sent[-1][1], sent[-1][2])) <= bound:
        e, family, depth = sent[-1]
        assert facts[-1].endpoint_id == e and facts[-1].blocks == _chain(family, depth)
