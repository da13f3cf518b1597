"""A fetch's progress in the registry (llmgw/cp/_fleet/_registry.py): kept beside the node's
record, with a smoothed rate; cleared by a transition, a new registration, a lost
connection and silence; never a state change anyone plans from; bounded."""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import trio
import trio.testing
from helpers import register
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core, model
from llmgw.cp._fleet._progress import (
    PROGRESS_PER_NODE,
    PROGRESS_RATE_TAU_S,
    PROGRESS_SILENCE_S,
    PROGRESS_SOURCE_MAX,
    FetchProgress,
    next_progress,
)
from llmgw.cp._fleet._registry import NodeRegistry

SRC = "mirror:/qwen-7b/"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _registry_at(clock: Clock, listeners: tuple[Callable[[], None], ...] = ()) -> NodeRegistry:
    return NodeRegistry(
        core.LivenessPolicy(), clock=clock, wall=lambda: 1000.0 + clock.now, listeners=listeners
    )


def _report(state: str, source: str | None = SRC) -> model.ShardReport:
    return model.ShardReport("s1", "/w/qwen", "vllm", state, source=source)


async def test_progress_is_stored_with_a_smoothed_rate_and_an_eta() -> None:
    clock = Clock()
    registry = _registry_at(clock)
    _agent, _peer, session = await register(registry, "a")
    await session.progress(model.Progress(SRC, 0, 1000))
    first = registry.progress("a")[SRC]
    assert (first.done_bytes, first.total_bytes, first.rate_bytes_per_s) == (0, 1000, None)
    assert first.eta_s is None  # no rate from one message
    assert first.at_wall == 1100.0
    clock.now += 1.0
    await session.progress(model.Progress(SRC, 100, 1000))
    assert registry.progress("a")[SRC].rate_bytes_per_s == 100.0
    clock.now += 2.0
    await session.progress(model.Progress(SRC, 700, 1000))  # 300 B/s over 2 s
    p = registry.progress("a")[SRC]
    keep = math.exp(-2.0 / PROGRESS_RATE_TAU_S)
    assert p.rate_bytes_per_s is not None
    assert math.isclose(p.rate_bytes_per_s, keep * 100 + (1 - keep) * 300)
    assert p.eta_s is not None and math.isclose(p.eta_s, 300 / p.rate_bytes_per_s)
    # No length: no eta, however fast.
    await session.progress(model.Progress("mirror:/x.gguf", 10))
    clock.now += 1.0
    await session.progress(model.Progress("mirror:/x.gguf", 20))
    x = registry.progress("a")["mirror:/x.gguf"]
    assert (x.total_bytes, x.rate_bytes_per_s, x.eta_s) == (None, 10.0, None)


async def test_a_restarted_download_starts_its_rate_again() -> None:
    clock = Clock()
    registry = _registry_at(clock)
    _agent, _peer, session = await register(registry, "a")
    await session.progress(model.Progress(SRC, 500, 1000))
    clock.now += 1
    await session.progress(model.Progress(SRC, 900, 1000))
    clock.now += 1
    await session.progress(model.Progress(SRC, 0, 1000))  # an ETag change: from 0
    assert registry.progress("a")[SRC].rate_bytes_per_s is None


async def test_progress_is_not_a_state_change() -> None:
    clock = Clock()
    heard: list[int] = []
    registry = _registry_at(clock, listeners=(lambda: heard.append(1),))
    _agent, _peer, session = await register(registry, "a", shards=(_report("starting"),))
    heard.clear()  # the registration was news; the progress below is not
    rec = registry.record("a")
    assert rec is not None
    before = attrs.asdict(rec, recurse=False)
    views = registry.views()
    clock.now += 5.0
    for done in range(0, 1000, 100):
        await session.progress(model.Progress(SRC, done, 1000))
    assert heard == []  # no reconciler poke
    assert attrs.asdict(rec, recurse=False) == before  # liveness, last seen, shards untouched
    clock.now -= 5.0
    assert registry.views() == views
    assert registry.progress("a")[SRC].done_bytes == 900


async def test_a_transition_for_the_source_clears_it_and_starting_does_not() -> None:
    clock = Clock()
    registry = _registry_at(clock)
    _agent, _peer, session = await register(registry, "a")
    await session.progress(model.Progress(SRC, 1, 10))
    await session.progress(model.Progress("mirror:/other/", 1, 10))
    await session.shard_status(_report("starting"))
    await session.shard_status(_report("loading", source=None))
    await session.shard_status(_report("failed", source="mirror:/third/"))
    assert set(registry.progress("a")) == {SRC, "mirror:/other/"}
    await session.shard_status(_report("loading"))
    assert set(registry.progress("a")) == {"mirror:/other/"}
    await session.shard_status(_report("failed", source="mirror:/other/"))
    assert registry.progress("a") == {}
    assert "a" not in registry._progress


async def test_a_new_registration_clears_it_and_the_old_session_is_ignored() -> None:
    clock = Clock()
    registry = _registry_at(clock)
    _agent, _peer, old = await register(registry, "a")
    await old.progress(model.Progress(SRC, 1, 10))
    _agent2, _peer2, new = await register(registry, "a")
    assert registry.progress("a") == {}
    await old.progress(model.Progress(SRC, 2, 10))  # a stale session's message
    assert registry.progress("a") == {}
    await new.progress(model.Progress(SRC, 3, 10))
    assert registry.progress("a")[SRC].done_bytes == 3


async def test_silence_clears_it() -> None:
    clock = Clock()
    registry = _registry_at(clock)
    _agent, _peer, session = await register(registry, "a")
    await session.progress(model.Progress(SRC, 1, 10))
    clock.now += PROGRESS_SILENCE_S - 0.5
    registry.tick()
    assert SRC in registry.progress("a")
    clock.now += 0.5
    assert registry.progress("a") == {}  # reading hides it before the tick drops it
    registry.tick()
    assert "a" not in registry._progress


async def test_a_lost_connection_clears_it() -> None:
    clock = Clock()
    registry = _registry_at(clock)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _agent, peer, session = await register(registry, "a")
        await session.progress(model.Progress(SRC, 1, 10))
        assert SRC in registry.progress("a")
        peer.closed.set()
        await trio.testing.wait_all_tasks_blocked()
        assert registry.progress("a") == {}
        await session.progress(model.Progress(SRC, 2, 10))  # its session is gone
        assert registry.progress("a") == {}
        nursery.cancel_scope.cancel()


async def test_a_node_holds_a_bounded_number_and_long_sources_are_ignored() -> None:
    clock = Clock()
    registry = _registry_at(clock)
    _agent, _peer, session = await register(registry, "a")
    for i in range(PROGRESS_PER_NODE + 6):
        await session.progress(model.Progress(f"mirror:/m{i}/", i, None))
        if i == 10:
            await session.progress(model.Progress("mirror:/m0/", 5, None))  # m0 is fresh again
    held = registry.progress("a")
    assert len(held) == PROGRESS_PER_NODE
    assert "mirror:/m0/" in held and "mirror:/m1/" not in held and "mirror:/m6/" not in held
    assert "mirror:/m7/" in held and f"mirror:/m{PROGRESS_PER_NODE + 5}/" in held
    longest = "mirror:/" + "x" * (PROGRESS_SOURCE_MAX - len("mirror:/"))
    await session.progress(model.Progress(longest + "y", 1, 2))
    await session.progress(model.Progress(SRC, -1, 2))
    await session.progress(model.Progress(SRC, 1, -2))
    held = registry.progress("a")
    assert longest + "y" not in held and SRC not in held
    await session.progress(model.Progress(longest, 1, 2))
    assert longest in registry.progress("a")


@given(
    steps=st.lists(
        st.tuples(st.floats(0.01, 100.0), st.integers(0, 10**9)), min_size=2, max_size=30
    )
)
def test_the_rate_stays_between_the_slowest_and_fastest_interval(
    steps: list[tuple[float, int]],
) -> None:
    last: FetchProgress | None = None
    now, done = 0.0, 0
    rates = []
    for dt, more in steps:
        now, done = now + dt, done + more
        if last is not None:
            rates.append(more / dt)
        last = next_progress(last, model.Progress(SRC, done, None), now=now, wall=now)
        if not rates:
            assert last.rate_bytes_per_s is None
            continue
        assert last.rate_bytes_per_s is not None
        slack = 1e-9 * max(rates) + 1e-9
        assert min(rates) - slack <= last.rate_bytes_per_s <= max(rates) + slack
