"""The event log kept in the store: written off the request path, read back at start and
at each election.

`EventKeeper.run` is a task of its own. Every `flush_s` (or at once when woken) it
takes the events the log recorded and the store does not have yet (`EventLog.unsaved`)
and writes them in batches of `batch` rows, one transaction each; the store keeps the
newest `keep` (llmgw/store/_events.py). Nothing that records an event waits for this:
the registry's handlers and the reconciler only append to the log in memory.

A write that fails (the store down, slow or frozen: every call is bounded by the
store's own timeout) leaves the events in the log, shown as before, and still to be
written; it is tried again after a backoff that doubles from `retry_min_s` to
`retry_max_s`. Up to EventLog's `unsaved` bound (10,000) wait; past it the oldest
go, counted (`unsaved_dropped`): at the default `events_kept` that is what the store
would keep anyway, so an outage loses none the store would have held.

`reload()` (the election's) asks the task to read the store's newest `keep` events and
rebuild the log from them (`EventLog.replace`) before it writes again, retried the same
way; `load()` does it now, for the start.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import trio

from llmgw.cp._observe import _event_codec
from llmgw.cp._observe._events import EventLog, Recorded
from llmgw.errors import LlmgwError, UsageError

log = logging.getLogger("llmgw.cp.events")

DEFAULT_KEEP = 10_000
FLUSH_S = 0.5
BATCH = 500
RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0


class EventRows(Protocol):
    """The store's events table (llmgw/store/_events.py)."""

    async def add_events(self, rows: Sequence[tuple[float, str]], keep: int) -> None: ...
    async def recent_events(self, limit: int) -> list[tuple[int, float, str]]: ...


class EventKeeper:
    def __init__(
        self,
        events: EventLog,
        store: EventRows,
        *,
        keep: int = DEFAULT_KEEP,
        flush_s: float = FLUSH_S,
        batch: int = BATCH,
        retry_min_s: float = RETRY_MIN_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        if keep < 1:
            raise ValueError(f"events_kept: expected at least 1, got {keep!r}")
        self.events = events
        self._store = store
        self.keep = keep
        self.flush_s = flush_s
        self.batch = batch
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self._wake = trio.Event()
        self._reload = False
        self.written = 0  # events the store took
        self.loaded = 0  # events read back at the last load
        self.failures = 0  # writes or loads the store failed
        self.unreadable = 0  # stored rows that could not be read back (skipped)

    def __repr__(self) -> str:
        return f"<EventKeeper {self.statistics()}>"

    def statistics(self) -> dict[str, int]:
        return {
            "written": self.written,
            "loaded": self.loaded,
            "failures": self.failures,
            "unreadable": self.unreadable,
            "unsaved": self.events.statistics()["unsaved"],
        }

    def wake(self) -> None:
        """Write what is waiting now rather than at the next `flush_s`."""
        self._wake.set()

    def reload(self) -> None:
        """Rebuild the log from the store before the next write (this control plane was
        elected: the one before it recorded what happened until now)."""
        self._reload = True
        self._wake.set()

    async def load(self) -> None:
        """Rebuild the log from the store's newest `keep` events, then what was recorded
        here and not yet written; the store's error is raised."""
        rows = await self._store.recent_events(self.keep)
        kept: list[Recorded] = []
        for seq, at, body in rows:
            try:
                kept.append(_event_codec.decode(seq, at, body))
            except UsageError as exc:
                self.unreadable += 1
                log.warning("events: skipped a stored event: %s", exc)
        self.events.replace(kept)
        self._reload = False
        self.loaded = len(kept)
        log.info("events: %d read from the store", len(kept))

    async def flush(self) -> int:
        """Write every unsaved event now; how many. On the store's error what is not
        written stays for the next try, and the error is raised."""
        done = 0
        while batch := self.events.unsaved(self.batch):
            await self._store.add_events([_event_codec.encode(r) for r in batch], self.keep)
            self.events.saved(batch[-1].event.seq)
            done += len(batch)
            self.written += len(batch)
        return done

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Writes (and reloads when asked) until cancelled; retries a failing store with
        a doubling backoff, and never raises for it."""
        task_status.started()
        backoff = 0.0
        while True:
            with trio.move_on_after(self.flush_s):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                if self._reload:
                    await self.load()
                await self.flush()
            except LlmgwError as exc:
                self.failures += 1
                backoff = min(self.retry_max_s, max(self.retry_min_s, backoff * 2))
                log.warning(
                    "events: the store failed (%d events wait, kept in memory; tried again "
                    "in %g s): %s",
                    self.events.statistics()["unsaved"],
                    backoff,
                    exc,
                )
                await trio.sleep(backoff)
                self._wake.set()
                continue
            if backoff:
                log.info("events: the store answers again; every waiting event is written")
            backoff = 0.0
