"""Retiring replicas: the reconciler names them, the router leaves them out.

A replica on a draining node whose replacement is ready retires (the drain rule,
llmgw/core/_drain.py), and so does an old one of a model being rolled out (the
rollout rule, llmgw/core/_rollout.py): the router sends it nothing new while the requests it
has finish. After each plan the reconciler notes the set (`note`), keeping when
each replica was first seen retiring (the drain's timeout counts from then);
the endpoint list reads it (`replicas`) and is told when it changes
(`on_change`). It is made before both, so that neither needs the other built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Retiring:
    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._on_change = on_change
        self._since: dict[str, float] = {}  # replica id -> the first pass that showed it retiring

    def __repr__(self) -> str:
        return f"<Retiring {sorted(self._since)}>"

    def replicas(self) -> frozenset[str]:
        """Replicas retiring (drained or rolled out): the router leaves them out."""
        return frozenset(self._since)

    def since(self) -> dict[str, float]:
        """Replica id -> when it was first seen retiring."""
        return dict(self._since)

    def note(self, retiring: Iterable[str], now: float) -> None:
        """The set a plan names; a change is told to `on_change`."""
        names = set(retiring)
        if names == set(self._since):
            return
        self._since = {r: self._since.get(r, now) for r in names}
        if self._on_change is not None:
            self._on_change()

    def clear(self) -> None:
        """A new term: nothing retires until a plan of it says so (and no one is told)."""
        self._since.clear()
