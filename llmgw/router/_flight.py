"""One attempt in flight to an endpoint, as the wedge watch (llmgw/router/_wedge.py) sees it.

A `Flight` says when the attempt was sent, holds the response once its head
came (whose `last_byte_at` the HTTP client moves with every read), and, while
the attempt waits on the engine with nothing sent to the client yet, the
cancel scope around that wait. A `Quarantine` is an endpoint taken out of the
choice, since when and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import trio

from llmgw.core import InFlight
from llmgw.router._upstream import Response


class Flight:
    __slots__ = ("expected_first_byte_s", "response", "scope", "started_at")

    def __init__(self, started_at: float, expected_first_byte_s: float | None) -> None:
        self.started_at = started_at
        self.expected_first_byte_s = expected_first_byte_s  # None: unknown
        self.response: Response | None = None
        self.scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        return (
            f"<Flight sent at {self.started_at:.1f} last byte {self.last_byte_at()} "
            f"{'cancellable' if self.scope is not None else 'committed'}>"
        )

    def last_byte_at(self) -> float | None:
        resp = self.response
        return None if resp is None else resp.last_byte_at

    @contextlib.contextmanager
    def cancellable(self) -> Iterator[trio.CancelScope]:
        """Around a wait on the engine while nothing has reached the client: the watch may
        cancel it (`scope.cancelled_caught` then says so), and the attempt is retried."""
        scope = trio.CancelScope()
        self.scope = scope
        try:
            with scope:
                yield scope
        finally:
            self.scope = None

    def cancel(self) -> bool:
        """Cancel the wait, if the attempt is in one; whether it was."""
        if self.scope is None:
            return False
        self.scope.cancel()
        return True

    def activity(self) -> InFlight:
        return InFlight(self.started_at, self.last_byte_at(), self.expected_first_byte_s)


@attrs.frozen
class Quarantine:
    at: float
    reason: str
    # The reason is whole (the engine's /health asked): the control plane is told then.
    checked: bool = False
