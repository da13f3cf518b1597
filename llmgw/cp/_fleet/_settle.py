"""The settle: after its start, or an election, the reconciler acts only once the fleet is back.

It does not act until every node known at the start (the registry's list, kept
in the store) has registered again, or `settle_s` has passed since the last
registration (or the start), at most `SETTLE_MAX_FACTOR` times `settle_s` after
the start (core's `guard_release_at`): agents re-register first, and their
replicas are adopted rather than started again. A node forgotten meanwhile is
not waited for. It latches: once settled it stays so until the next `begin`.
Log lines: the wait once, when it begins, and "settled after N s ..." when it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Set

from llmgw.core import guard_release_at
from llmgw.cp._fleet._node_record import NodeRecord

log = logging.getLogger("llmgw.cp.reconciler")  # the reconciler's component


class Settle:
    def __init__(self, settle_s: float, clock: Callable[[], float]) -> None:
        self.settle_s = settle_s
        self._clock = clock
        self._started_at: float | None = None
        self._settled = False  # latches once the fleet has re-registered after the start
        self._expected: frozenset[str] = frozenset()
        self._note: str | None = None  # the wait last said

    def __repr__(self) -> str:
        return f"<Settle settled={self._settled} expected={len(self._expected)}>"

    @property
    def settled(self) -> bool:
        return self._settled

    def begin(self, known: Iterable[str]) -> None:
        """Settle from now, waiting for the nodes `known` now."""
        self._started_at = self._clock()
        self._settled = False
        self._note = None
        self._expected = frozenset(known)

    def done(self, records: Iterable[NodeRecord], known: Set[str]) -> bool:
        """Whether the reconciler may act now; the first pass that waits says why."""
        waiting = self.waiting(records, known)
        if waiting is not None and self._note is None:
            log.info("%s", waiting)  # once; "settled ..." follows
        self._note = waiting
        return waiting is None

    def waiting(self, records: Iterable[NodeRecord], known: Set[str]) -> str | None:
        """Why the reconciler does not act yet, or None once it may."""
        if self._settled or self._started_at is None:
            return None
        now, start = self._clock(), self._started_at
        registered = {r.node_id: r.registered_at for r in records if r.registered_at >= start}
        expected = self._expected & known  # a forgotten node is not waited for
        missing = sorted(expected - registered.keys())
        release = guard_release_at(start, registered, self.settle_s)
        if (expected and not missing) or now >= release:
            self._settled = True
            if missing:
                log.info(
                    "settled after %.0f s: %d of %d known nodes registered; not yet: %s",
                    now - start, len(expected) - len(missing), len(expected),
                    ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else ""),
                )  # fmt: skip
            else:
                log.info("settled after %.0f s: every known node registered",
                         now - start)  # fmt: skip
            return None
        if not expected:  # a first start, or a store that has no known nodes yet
            return f"waiting {release - now:.0f} s for agents to register before acting"
        return (
            f"waiting for {len(missing)} of {len(expected)} known nodes to register "
            f"(at most {release - now:.0f} s more) before acting"
        )
