"""The router's own load signals per served model, for the autoscaler (issue 25).

`LoadCounters` keeps what the request path cannot be asked for later: the prompt
tokens its in-flight requests still have the engines compute (each attempt's
estimate, `Sent` in llmgw/router/_attempt.py, taken back when its answer begins or
it ends), first bytes by TTFT bucket, and capacity refusals. `loads()` adds what
the fleet view knows now (each model's admission queue and in-flight count) and
the requests held at zero replicas (llmgw/router/_holds.py), as one
`core.RouterLoad` per model the view lists. It is read every 200 ms by the
control plane (llmgw/cp/_workers.py), so it does a dict walk and no more.

TTFT is counted for streamed answers, from the request's arrival (queueing and
holding included: what a client waits) to the first chunk sent to the client;
a whole answer's first byte is its last, so its time measures its length, not
its wait, and is left out. Counters only grow: readers difference two readings
(`core.grown`), and a restarted router starts from zero again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from llmgw.core import TTFT_BOUNDS, Admission, RouterLoad, ttft_bucket

_NO_TTFT = (0,) * (len(TTFT_BOUNDS) + 1)


class ModelCounts:
    """One served name's counters (the attempt loop adds to `uncached` directly)."""

    __slots__ = ("last_used", "rejected", "ttft", "uncached")

    def __init__(self) -> None:
        self.uncached = 0.0  # estimated prompt tokens sent and not yet answered
        self.ttft = [0] * (len(TTFT_BOUNDS) + 1)
        self.rejected = 0
        self.last_used: float | None = None  # wall clock of the last request sent

    def __repr__(self) -> str:
        first = sum(self.ttft)
        return f"<ModelCounts uncached={self.uncached:g} ttft={first} rejected={self.rejected}>"


class _Listed(Protocol):
    """What `loads` reads of a model (llmgw/router/_fleet.py Model)."""

    admission: Admission


class LoadCounters:
    """Per served name: uncached prompt tokens in flight, first bytes by TTFT bucket,
    capacity refusals (429/503: queue full, queue timeout, no replica, hold refused)."""

    def __init__(self) -> None:
        self._models: dict[str, ModelCounts] = {}  # names the router knows: bounded

    def __repr__(self) -> str:
        return f"<LoadCounters {self._models!r}>"

    def of(self, model: str) -> ModelCounts:
        counts = self._models.get(model)
        if counts is None:
            counts = self._models[model] = ModelCounts()
        return counts

    def first_byte(self, model: str, seconds: float) -> None:
        """A streamed answer's first chunk went to the client `seconds` after the
        request arrived."""
        self.of(model).ttft[ttft_bucket(seconds)] += 1

    def rejected(self, model: str) -> None:
        """A request for `model` was answered 429/503 for want of capacity."""
        self.of(model).rejected += 1

    def loads(
        self, models: Mapping[str, _Listed], held: Mapping[str, int]
    ) -> dict[str, RouterLoad]:
        """One `RouterLoad` per model in `models` (zeros included); `held`: requests
        held at zero replicas, by model."""
        out: dict[str, RouterLoad] = {}
        for name, model in models.items():
            adm = model.admission
            counts = self._models.get(name)
            out[name] = RouterLoad(
                queued=adm.queued + held.get(name, 0),
                in_flight=adm.in_flight,
                uncached_tokens=max(0, round(counts.uncached)) if counts else 0,
                ttft=tuple(counts.ttft) if counts else _NO_TTFT,
                rejected=counts.rejected if counts else 0,
                last_used=counts.last_used if counts else None,
            )
        return out
