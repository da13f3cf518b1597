"""Requests for a model at zero replicas, held until its first replica is ready.

A model the autoscaler may take to zero replicas comes with a `Hold` from the
endpoint source (llmgw/router/_types.py; the control plane's for every served
name of a catalog model with `autoscale: {min: 0}`). A request for it while it
has no endpoint waits here, before admission, and goes on as any other once the
fleet view gives the model an endpoint: its replica became ready. Each wait is
woken by the view's refresh (`Fleet.refreshed`); while any request is held the
router re-reads its source every 50 ms (not every second), so a held request goes
on within 50 ms of the view listing the replica.

Bounds, so a client never hangs: at most `hold.max` requests held at once per
model (each router worker its `share()` of it, at least 1), each at most `hold.s`
seconds. Past either: 503 with Retry-After at once (full: when the oldest held
request's hold ends, at least 1 s; held its longest: 1 s, the next is held
anew), in the route's error shape. A client that leaves while held is
cancelled like any other request, and its place is free at once. A model with
no hold is answered 503 at once, as before holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import trio

from llmgw.router import _surface
from llmgw.router._fleet import Fleet, Model
from llmgw.router._load import LoadCounters
from llmgw.router._tenants import share
from llmgw.router._types import Hold


class Holds:
    """The requests held per model, for one router (worker)."""

    def __init__(
        self,
        fleet: Fleet,
        load: LoadCounters,
        refused: Callable[[str, str], None],
        *,
        worker: int = 0,
        workers: int = 1,
    ) -> None:
        """`refused(model, reason)`: a hold refused a request ("full" or "timeout"),
        counted in the metrics; `load` counts it (and a 503 without a hold) as a
        capacity refusal."""
        self._fleet = fleet
        self._load = load
        self._refused = refused
        self._worker, self._workers = worker, workers
        self._held: dict[str, dict[int, float]] = {}  # model -> {request: its deadline}
        self._ids = itertools.count()

    def __repr__(self) -> str:
        return f"<Holds {self.held()}>"

    def held(self) -> dict[str, int]:
        """Requests held now, by model (models with none left out)."""
        return {name: len(waiting) for name, waiting in self._held.items()}

    def statistics(self) -> dict[str, int]:
        """Requests held now by model, every model with a hold included (0)."""
        return {name: 0 for name in self._fleet.holds()} | self.held()

    def limit(self, hold: Hold) -> int:
        """How many this router holds at once: its share of `hold.max`."""
        return max(1, share(hold.max, self._worker, self._workers))

    async def ready(self, model: Model) -> Model:
        """`model`, with no endpoint: wait for one when it has a hold, and return it
        as the view has it then; raises the 503 to answer otherwise."""
        name = model.name
        hold = self._fleet.holds().get(name)
        if hold is None:
            self._load.rejected(name)
            raise _surface.no_replica(name)
        now = trio.current_time()
        waiting = self._held.setdefault(name, {})
        limit = self.limit(hold)
        if len(waiting) >= limit:
            self._refuse(name, "full")
            bound = f"hold_max {hold.max}" + (
                f", {limit} on this router worker" if self._workers > 1 else ""
            )
            raise _surface.not_started(
                name,
                f"{len(waiting)} requests already wait for it ({bound})",
                min(waiting.values()) - now,
                model.adapter.base if model.adapter is not None else None,
            )
        me = next(self._ids)
        waiting[me] = now + hold.s
        try:
            with trio.move_on_at(now + hold.s):
                while True:
                    current = self._fleet.models().get(name)
                    if current is None:  # left the catalog while held
                        raise _surface.unknown_model(name)
                    if current.endpoints:
                        return current
                    await self._fleet.refreshed()
        finally:
            del waiting[me]
            if not waiting and self._held.get(name) is waiting:
                del self._held[name]
        self._refuse(name, "timeout")
        if model.adapter is not None:
            waited = f"it was waited for {hold.s:g} s (ctl adapters says why)"
            raise _surface.not_started(name, waited, 1.0, model.adapter.base)
        raise _surface.not_started(name, f"it was waited for {hold.s:g} s (hold_s)", 1.0)

    def _refuse(self, name: str, reason: str) -> None:
        self._load.rejected(name)
        self._refused(name, reason)
