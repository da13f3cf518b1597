"""A wake-up shared by parts that need each other: made first, handed to each.

The registry, the size task and the catalog tell the reconciler to plan again,
and the reconciler needs the registry; the registry tells the endpoint list to
recompute, and the list needs the registry. Rather than set a hook on a part
already built, the assembly (llmgw/cp/_main.py) makes a `Wakeup` first and
hands it to both sides: a part that has news calls `poke()`; a task waits for
the next poke (`wait`), and a part built after the pokers asks, once, at
assembly, to be called on each (`on_poke`), as the endpoint list does, whose
refresh only marks it stale.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


class Wakeup:
    def __init__(self) -> None:
        self._event = trio.Event()
        self._heed: list[Callable[[], None]] = []
        self.pokes = 0

    def __repr__(self) -> str:
        return f"<Wakeup pokes={self.pokes} pending={self._event.is_set()}>"

    def poke(self) -> None:
        """Something changed: wake the waiter (now, or at its next wait) and call each
        part that asked to be."""
        self.pokes += 1
        self._event.set()
        for call in self._heed:
            call()

    def on_poke(self, call: Callable[[], None]) -> None:
        """Call `call` on every poke from now on (a part built after those that poke)."""
        self._heed.append(call)

    async def wait(self, timeout_s: float) -> None:
        """Until a poke, or `timeout_s`; a poke since the last wait ends it at once."""
        with trio.move_on_after(timeout_s):
            await self._event.wait()
        self._event = trio.Event()
