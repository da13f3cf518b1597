"""The control plane's event log, as the store keeps it: one row an event, its body JSON.

The body is the control plane's (llmgw/cp/_observe/_event_keeper.py); the store keeps
the rows in the order they were written (`seq`) and only the newest `keep` of them:
each write deletes what fell out, in the same transaction, so the table never holds
more than `keep` rows however long the fleet runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.store._backends import Exec
from llmgw.store._runner import Runner

ADD_EVENT = "INSERT INTO events (at, body) VALUES (?, ?)"
# seq only grows: whatever lies `keep` or more below the newest is older than the newest
# `keep` rows (gaps in seq only make fewer rows stay).
PRUNE_EVENTS = "DELETE FROM events WHERE seq <= (SELECT MAX(seq) FROM events) - ?"


class EventStore:
    """The `events` table."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def add_events(self, rows: Sequence[tuple[float, str]], keep: int) -> None:
        """Append (at, body) rows, in order, and keep only the newest `keep` rows."""
        if keep < 1:
            raise ValueError(f"keep: expected at least 1 event kept, got {keep!r}")
        batch = [(float(at), str(body)) for at, body in rows]
        if not batch:
            return

        def write(run: Exec) -> None:
            for args in batch:
                run(ADD_EVENT, args)
            run(PRUNE_EVENTS, (int(keep),))

        await self._run.tx(write)

    async def recent_events(self, limit: int) -> list[tuple[int, float, str]]:
        """The newest `limit` rows as (seq, at, body), oldest first."""
        rows = await self._run.q(
            "SELECT seq, at, body FROM events ORDER BY seq DESC LIMIT ?", (int(limit),)
        )
        return [(int(s), float(a), str(b)) for s, a, b in reversed(rows)]
