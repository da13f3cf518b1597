"""The wake-ups and the retiring set that the assembly makes before the parts that share them."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.cp._fleet._retiring import Retiring
from llmgw.cp._fleet._wake import Wakeup


async def test_a_poke_before_the_wait_ends_it_at_once_and_only_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wake = Wakeup()
    wake.poke()
    wake.poke()  # two pokes before one wait: one wake-up
    t0 = trio.current_time()
    await wake.wait(5.0)
    assert trio.current_time() == t0
    await wake.wait(5.0)  # nothing since: the timeout ends it
    assert trio.current_time() == t0 + 5.0
    assert wake.pokes == 2


async def test_a_poke_during_the_wait_wakes_the_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wake = Wakeup()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def poke_later() -> None:
            await trio.sleep(1.0)
            wake.poke()

        nursery.start_soon(poke_later)
        await wake.wait(60.0)
    assert trio.current_time() == t0 + 1.0


def test_a_part_built_later_is_called_on_every_poke_from_then_on() -> None:
    wake = Wakeup()
    wake.poke()  # before anyone heeds: nobody is called
    heard: list[str] = []
    wake.on_poke(lambda: heard.append("a"))
    wake.on_poke(lambda: heard.append("b"))
    wake.poke()
    wake.poke()
    assert heard == ["a", "b", "a", "b"]
    assert repr(wake) == "<Wakeup pokes=3 pending=True>"


def test_retiring_keeps_when_each_was_first_seen_and_tells_only_of_changes() -> None:
    changes: list[frozenset[str]] = []
    retiring = Retiring(on_change=lambda: changes.append(retiring.replicas()))
    retiring.note(["r1"], now=10.0)
    retiring.note(["r1"], now=11.0)  # the same set: nobody is told, r1's time stays
    retiring.note(["r1", "r2"], now=12.0)
    assert retiring.since() == {"r1": 10.0, "r2": 12.0}
    retiring.note(["r2"], now=13.0)
    assert retiring.since() == {"r2": 12.0}
    assert changes == [frozenset({"r1"}), frozenset({"r1", "r2"}), frozenset({"r2"})]
    retiring.clear()  # a new term: the set is empty, and nobody is told
    assert retiring.replicas() == frozenset() and len(changes) == 3
    retiring.since()["x"] = 1.0  # a copy: the caller cannot change it
    assert retiring.since() == {}
