"""Fetch progress: what each node last said of each download, and how fast it goes.

Issue 12. Not a state transition: the registry keeps this book beside each node's
record, never in it, and nothing anyone plans from changes with it. A message
touches neither liveness nor the record (so it cannot reset a timer), and no
listener hears of it. Bounds: `PROGRESS_PER_NODE` sources a node (the least
recently updated go first), a source text of `PROGRESS_SOURCE_MAX` characters,
and `PROGRESS_SILENCE_S` after its last message a fetch is no longer news.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping

import attrs

from llmgw import model

log = logging.getLogger("llmgw.cp.registry")  # the registry's component

PROGRESS_SILENCE_S = 30.0  # no message for this long: the fetch is no longer news
PROGRESS_PER_NODE = 64  # a node may report this many sources at once; the oldest go first
PROGRESS_SOURCE_MAX = 4096  # characters; a longer source text is no catalog's
PROGRESS_RATE_TAU_S = 5.0  # the rate's smoothing: about the last five seconds count


@attrs.frozen
class FetchProgress:
    """What the registry knows of one fetch on one node."""

    source: str
    done_bytes: int
    total_bytes: int | None  # None: nobody said the length
    rate_bytes_per_s: float | None  # smoothed; None until two messages
    at: float  # clock value of the last message
    at_wall: float  # unix time of the last message

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate; None without a length or a rate."""
        if self.total_bytes is None or not self.rate_bytes_per_s:
            return None
        return max(0.0, self.total_bytes - self.done_bytes) / self.rate_bytes_per_s


def next_progress(
    last: FetchProgress | None, msg: model.Progress, *, now: float, wall: float
) -> FetchProgress:
    """The fetch's view after one more message (pure). The rate is an exponentially
    weighted mean of the rates between messages, weighted by the time between them, so
    irregular messages count for the time they cover; a count that went back (a
    download restarted from 0) starts the rate again."""
    rate: float | None = None
    if last is not None and msg.done_bytes >= last.done_bytes and now > last.at:
        dt = now - last.at
        seen = (msg.done_bytes - last.done_bytes) / dt
        if last.rate_bytes_per_s is None:
            rate = seen
        else:
            keep = math.exp(-dt / PROGRESS_RATE_TAU_S)
            rate = keep * last.rate_bytes_per_s + (1 - keep) * seen
    elif last is not None and msg.done_bytes >= last.done_bytes:
        rate = last.rate_bytes_per_s  # two messages in one instant: nothing new to learn
    return FetchProgress(msg.source, msg.done_bytes, msg.total_bytes, rate, now, wall)


class ProgressBook:
    """node -> source -> its fetch's progress, least recently updated first."""

    def __init__(self) -> None:
        self._nodes: dict[str, OrderedDict[str, FetchProgress]] = {}

    def __repr__(self) -> str:
        return f"<ProgressBook {sum(len(t) for t in self._nodes.values())} fetches>"

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def hear(self, node_id: str, msg: model.Progress, *, now: float, wall: float) -> None:
        """One more message from a node's current session; one out of bounds is dropped."""
        if (
            not isinstance(msg.source, str)
            or not msg.source
            or len(msg.source) > PROGRESS_SOURCE_MAX
            or msg.done_bytes < 0
            or (msg.total_bytes is not None and msg.total_bytes < 0)
        ):
            log.debug("%s: progress ignored (a source of %d characters, done %s, total %s)",
                      node_id, len(msg.source or ""), msg.done_bytes, msg.total_bytes)  # fmt: skip
            return
        table = self._nodes.setdefault(node_id, OrderedDict())
        last = table.pop(msg.source, None)
        table[msg.source] = next_progress(last, msg, now=now, wall=wall)
        while len(table) > PROGRESS_PER_NODE:
            table.popitem(last=False)

    def end(self, node_id: str, source: str) -> None:
        """The fetch is over (its shard started or failed): its news ends with it."""
        table = self._nodes.get(node_id)
        if table is not None:
            table.pop(source, None)
            if not table:
                del self._nodes[node_id]

    def drop(self, node_id: str) -> None:
        """The node's session ended, or a new one began: it reports its fetches anew."""
        self._nodes.pop(node_id, None)

    def clear(self) -> None:
        self._nodes.clear()

    def of(self, node_id: str, now: float) -> dict[str, FetchProgress]:
        """The node's fetches heard from in the last PROGRESS_SILENCE_S, by source."""
        table: Mapping[str, FetchProgress] = self._nodes.get(node_id) or {}
        return {s: p for s, p in table.items() if now - p.at < PROGRESS_SILENCE_S}

    def expire(self, now: float) -> None:
        """Forget every fetch silent for PROGRESS_SILENCE_S."""
        for node_id in list(self._nodes):
            table = self._nodes[node_id]
            for source in [s for s, p in table.items() if now - p.at >= PROGRESS_SILENCE_S]:
                del table[source]
            if not table:
                del self._nodes[node_id]
