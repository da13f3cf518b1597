"""A model's load as routers see it: the autoscaler's signals (llmgw/core/_autoscale.py).

Each router (the control plane's own, each router worker, a standby's) keeps a
`RouterLoad` per served model: gauges (what waits and runs now) and counters since
the router started (first bytes by TTFT bucket, capacity refusals). Loads from
several routers are summed with `merge`; a control plane turns two readings of the
same router into the counters' growth with `grown` (a router that restarted counts
from zero again: its reading is all growth), and the summed growth of every router
into one `LoadSample` with `sample`. Counters, not percentiles, cross processes:
p90s of two routers cannot be combined, their buckets can.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs

# Upper bounds (seconds) of the TTFT buckets; a last, unbounded bucket follows.
TTFT_BOUNDS: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
    120.0,
)  # fmt: skip


@attrs.frozen
class RouterLoad:
    """One router's figures for one model."""

    queued: int = 0  # waiting in the router: the admission queue, and held at zero replicas
    in_flight: int = 0  # sent to an engine, not finished
    uncached_tokens: int = 0  # prompt tokens of the in-flight requests the engines must compute
    # Counters since the router started: first bytes by TTFT bucket (len(TTFT_BOUNDS) + 1),
    # and requests answered 429 or 503 for want of capacity (full queue, queue timeout,
    # no replica, hold past its bounds).
    ttft: tuple[int, ...] = (0,) * (len(TTFT_BOUNDS) + 1)
    rejected: int = 0
    # Wall clock of the last request this router sent to an engine for it (None: none
    # since it started): what the adapter manager's least-recently-used order reads.
    last_used: float | None = None

    def as_json(self) -> list[object]:
        out: list[object] = [
            self.queued, self.in_flight, self.uncached_tokens, list(self.ttft), self.rejected
        ]  # fmt: skip
        if self.last_used is not None:  # a reader from before it takes the five others
            out.append(self.last_used)
        return out

    @classmethod
    def from_json(cls, value: object) -> RouterLoad:
        """The inverse of `as_json`; raises ValueError naming what is wrong (a peer's
        report is not trusted to be well formed)."""
        if not isinstance(value, list) or len(value) not in (5, 6):
            raise ValueError(
                "a load is [queued, in_flight, uncached_tokens, [ttft...], rejected(, last_used)]"
            )
        last = value[5] if len(value) == 6 else None
        if last is not None and (
            isinstance(last, bool) or not isinstance(last, (int, float)) or not math.isfinite(last)
        ):
            raise ValueError(f"last_used must be a unix time, not {last!r:.40}")
        queued, in_flight, uncached, ttft, rejected = value[:5]
        counts = [queued, in_flight, uncached, rejected]
        if not all(_count(v) for v in counts):
            raise ValueError(f"load counts must be non-negative integers, not {counts}")
        if not isinstance(ttft, list) or len(ttft) != len(TTFT_BOUNDS) + 1:
            raise ValueError(f"ttft must be {len(TTFT_BOUNDS) + 1} bucket counts")
        if not all(_count(v) for v in ttft):
            raise ValueError("ttft bucket counts must be non-negative integers")
        return cls(queued, in_flight, uncached, tuple(ttft), rejected, last)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def ttft_bucket(seconds: float) -> int:
    """The index of the bucket a TTFT of `seconds` counts in."""
    for i, bound in enumerate(TTFT_BOUNDS):
        if seconds <= bound:
            return i
    return len(TTFT_BOUNDS)


def merge(loads: Iterable[RouterLoad]) -> RouterLoad:
    """The sum of several routers' loads for one model."""
    out = RouterLoad()
    for load in loads:
        used = [t for t in (out.last_used, load.last_used) if t is not None]
        out = RouterLoad(
            out.queued + load.queued,
            out.in_flight + load.in_flight,
            out.uncached_tokens + load.uncached_tokens,
            tuple(a + b for a, b in zip(out.ttft, load.ttft, strict=True)),
            out.rejected + load.rejected,
            max(used) if used else None,
        )
    return out


def merge_models(loads: Iterable[Mapping[str, RouterLoad]]) -> dict[str, RouterLoad]:
    """Per model, the sum over routers (a model one router does not report adds nothing)."""
    by_model: dict[str, list[RouterLoad]] = {}
    for one in loads:
        for name, load in one.items():
            by_model.setdefault(name, []).append(load)
    return {name: merge(parts) for name, parts in by_model.items()}


def grown(before: RouterLoad | None, now: RouterLoad) -> RouterLoad:
    """`now` with its counters replaced by their growth since `before` (the same
    router's previous reading). A counter that went down means the router restarted:
    all of `now` is growth. Gauges are `now`'s."""
    if (
        before is None
        or now.rejected < before.rejected
        or any(b > a for a, b in zip(now.ttft, before.ttft, strict=True))
    ):
        return now
    return attrs.evolve(
        now,
        ttft=tuple(a - b for a, b in zip(now.ttft, before.ttft, strict=True)),
        rejected=now.rejected - before.rejected,
    )


@attrs.frozen
class LoadSample:
    """One reading of a model's load over every router, for the autoscaler."""

    at: float  # the clock when it was read
    queued: int
    in_flight: int
    uncached_tokens: int
    ttft_p90_s: float | None  # of first bytes since the last sample; None: there were none
    rejected: int  # 429/503 for capacity since the last sample
    first_bytes: int = 0  # how many first bytes the p90 is of

    @property
    def demand(self) -> int:
        """Requests that want a replica now: waiting and running."""
        return self.queued + self.in_flight


def sample(at: float, load: RouterLoad) -> LoadSample:
    """`load` (gauges now, counters grown since the last sample) as a sample at `at`."""
    return LoadSample(
        at,
        load.queued,
        load.in_flight,
        load.uncached_tokens,
        ttft_quantile(load.ttft, 0.9),
        load.rejected,
        sum(load.ttft),
    )


def ttft_quantile(buckets: tuple[int, ...], q: float) -> float | None:
    """The `q` quantile of the bucketed TTFTs: the upper bound of the bucket it falls in
    (a quantile in the last, unbounded bucket is reported as twice the last bound); None
    without any count."""
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], not {q}")
    total = sum(buckets)
    if total == 0:
        return None
    # The nearest rank, ceil(q x total), less a hair: 0.55 x 100 is 55.00000000000001 in
    # floating point, and its ceiling 56 would be the wrong rank.
    rank = max(1, math.ceil(q * total * (1 - 1e-12)))
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= rank:
            return TTFT_BOUNDS[i] if i < len(TTFT_BOUNDS) else 2 * TTFT_BOUNDS[-1]
    return 2 * TTFT_BOUNDS[-1]  # unreachable: the counts sum to total
