"""Autoscaling against a day-shaped trace (a benchmark, not a test).

A discrete-event simulation in simulated time (it runs in seconds): one model, a router
in front of it (a FIFO queue: at most `QUEUE_LIMIT` waiting, each for `QUEUE_TIMEOUT_S`
as the router's interactive band; with no replica ready, requests are held as the router
holds them at zero replicas, up to the policy's `hold_max` requests and `hold_s`
seconds), and a fleet of fake engines: a replica takes `--start-s` seconds from its
start to ready, serves `--slots` requests at once, each for an exponential time of mean
`--service-s` seconds after a prefill of `PREFILL_S` (its first byte). Every
`SAMPLE_S` seconds the router's figures become a `LoadSample` as the control plane makes
them (llmgw/core/_load.py: a `RouterLoad` of gauges and counters, `grown`, `sample`),
and the real `core.autoscale()` decides the desired count; the fleet starts replicas
to it, and lowers by draining (a draining replica takes nothing new and stops when its
last request ends). A replica counts GPU time from its start until it stops.

The trace: a day compressed into `--day-min` simulated minutes (480: a real hour is 20
minutes), Poisson arrivals at a rate that is near zero at night (and zero for three
hours of it), ramps up over three hours in the morning to `--peak` requests per second,
dips at lunch and falls in the evening; three spikes of 5x the current rate, of 2 to 3
minutes each. The hours are compressed, the spikes and start times are not (a spike
lasts minutes, an engine starts in seconds, whatever the day's length), so the spikes
weigh 3x more of the day's minutes than in 24 hours: 8 of 480. No autoscaler that starts
replicas in 60-120 s serves a 3-minute 5x spike within a 2 s TTFT, so those minutes are
lost whatever it does; at `--day-min 240` they are 3.3 % of the minutes, and with the
morning's first request at zero replicas that misses 95 % at 60 and 120 s (94.7 %, 92.3 %:
the best fixed count then needs 24 replicas, sized for the spikes). `--quick` (a day in
120 minutes) is for a smoke run: its spikes are 7 % of its minutes.

The sample period is the control plane's (`SAMPLE_S`); the trace (seed 1, 2, 3) gives
the same verdicts: the figures move by a few tenths of a percent.

Printed for each start time (10, 60 and 120 s), with the goals of issue 25 beside them:
- minutes whose TTFT p90 is within `--slo-s` (goal >= 95 %): every minute with an
  arrival counts, a refused request counts as an infinite TTFT in its minute;
- GPU-hours against the best fixed replica count in hindsight: the fewest replicas,
  always ready, that meet the same 95 % on the same trace (goal <= 1.15x);
- requests answered 503 or 429 for capacity, inside the spikes (arrived during one) and
  outside them (goal 0 outside);
- scale events (raises and lowerings of the desired count).

The policy is `AutoscalePolicy`'s defaults with `min: 0`, `max: --max` and
`requests_per_replica` 3/4 of the engine's slots (the operator's setting: what a replica
serves well at once, with room left for a burst while another starts).

Run: `.venv/bin/python bench/autoscale.py [--quick] [--json FILE]`.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.core import (
    TTFT_BOUNDS,
    AutoscalePolicy,
    AutoscaleState,
    LoadSample,
    RouterLoad,
    autoscale,
    grown,
    sample,
    ttft_bucket,
)

SAMPLE_S = 5.0  # the router's signals and the decision, every 5 s
QUEUE_LIMIT = 1024  # RouterConfig.queue_limit
QUEUE_TIMEOUT_S = 30.0  # the interactive band's queue timeout
PREFILL_S = 0.3  # request dispatched -> first byte
SPIKE_FACTOR = 5.0
GOAL_MINUTES = 0.95
GOAL_RATIO = 1.15


@attrs.frozen
class Engine:
    start_s: float
    slots: int
    service_s: float


@attrs.frozen
class Trace:
    day_s: float
    peak: float  # requests per second in the day's busy hours
    spikes: tuple[tuple[float, float], ...]  # (from, to) in simulated seconds
    # Simulated before the day starts (the end of the day before), not counted: the day
    # begins with the fleet the night left, not with a cold one.
    warmup_s: float = 1800.0

    def hour(self, t: float) -> float:
        return 24.0 * t / self.day_s

    def base(self, t: float) -> float:
        """The rate before spikes: a working day's shape over 24 (compressed) hours."""
        h = self.hour(t)
        shape = [  # (hour, share of the peak), linear between
            (0, 0.15), (1, 0.05), (2, 0.0), (5, 0.0), (6, 0.05), (9, 1.0), (12, 1.0),
            (12.5, 0.75), (13.5, 0.75), (14, 1.0), (17, 1.0), (20, 0.3), (24, 0.15),
        ]  # fmt: skip
        for (h0, v0), (h1, v1) in itertools.pairwise(shape):
            if h0 <= h < h1:
                return self.peak * (v0 + (v1 - v0) * (h - h0) / (h1 - h0))
        return self.peak * shape[-1][1]

    def in_spike(self, t: float) -> bool:
        return any(a <= t < b for a, b in self.spikes)

    def rate(self, t: float) -> float:
        return self.base(t) * (SPIKE_FACTOR if self.in_spike(t) else 1.0)

    def arrivals(self, seed: int) -> list[tuple[float, float]]:
        """(arrival time, service time) of every request, by thinning a Poisson process,
        from `-warmup_s` (the end of the day before) to the end of the day."""
        rng = random.Random(seed)
        top = self.peak * SPIKE_FACTOR
        out: list[tuple[float, float]] = []
        t = -self.warmup_s
        while True:
            t += rng.expovariate(top)
            if t >= self.day_s:
                return out
            if rng.random() * top < self.rate(t % self.day_s):
                out.append((t, rng.expovariate(1.0)))  # service in units of the mean


def day_trace(day_min: float, peak: float) -> Trace:
    day_s = day_min * 60.0
    spikes = []
    for hour, length_min in ((10.5, 3.0), (14.5, 2.0), (16.25, 3.0)):
        start = hour / 24.0 * day_s
        spikes.append((start, start + 60.0 * length_min))
    return Trace(day_s, peak, tuple(spikes))


@attrs.define
class Replica:
    started: float
    ready_at: float
    busy: int = 0
    draining: bool = False
    stopped: float | None = None

    def ready(self, now: float) -> bool:
        return self.stopped is None and not self.draining and now >= self.ready_at


@attrs.define
class Result:
    minutes: int = 0
    minutes_ok: int = 0
    gpu_s: float = 0.0
    refused_in: int = 0
    refused_out: int = 0
    raises: int = 0
    lowerings: int = 0
    requests: int = 0
    peak_desired: int = 0
    bad_minutes: list[int] = attrs.Factory(list)  # minutes of the day over the SLO
    refused_out_at: list[float] = attrs.Factory(list)  # arrivals refused outside spikes
    # Every change of the desired count: (at, desired, the decision's reason).
    decisions: list[tuple[float, int, str]] = attrs.Factory(list)

    @property
    def share_ok(self) -> float:
        return self.minutes_ok / self.minutes if self.minutes else 1.0


def simulate(
    trace: Trace,
    arrivals: Sequence[tuple[float, float]],
    engine: Engine,
    *,
    policy: AutoscalePolicy | None = None,
    fixed: int = 0,
    slo_s: float,
) -> Result:
    """One day: autoscaled by `policy`, or `fixed` replicas ready all day."""
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, what: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, what))

    replicas: list[Replica] = []
    queue: deque[tuple[float, float, float]] = deque()  # (arrived, service, deadline)
    ttft_by_minute: dict[int, list[float]] = {}
    result = Result(requests=len(arrivals))
    ttft_counts = [0] * (len(TTFT_BOUNDS) + 1)
    rejected = 0
    in_flight = 0
    held_max = policy.hold_max if policy else 0
    held_s = policy.hold_s if policy else QUEUE_TIMEOUT_S

    def record(arrived: float, ttft: float) -> None:
        if arrived >= 0:
            ttft_by_minute.setdefault(int(arrived // 60), []).append(ttft)

    def refuse(arrived: float) -> None:
        nonlocal rejected
        rejected += 1
        record(arrived, math.inf)
        if arrived < 0:
            return
        if trace.in_spike(arrived):
            result.refused_in += 1
        else:
            result.refused_out += 1
            result.refused_out_at.append(arrived)

    def stop(r: Replica, now: float) -> None:
        r.stopped = now
        result.gpu_s += max(0.0, now - max(r.started, 0.0))

    def dispatch(now: float) -> None:
        nonlocal in_flight
        while queue:
            free = [r for r in replicas if r.ready(now) and r.busy < engine.slots]
            if not free:
                return
            arrived, service, deadline = queue.popleft()
            if deadline < now:
                refuse(arrived)
                continue
            r = max(free, key=lambda r: engine.slots - r.busy)
            r.busy += 1
            in_flight += 1
            ttft = now - arrived + PREFILL_S
            ttft_counts[ttft_bucket(ttft)] += 1
            record(arrived, ttft)
            push(now + PREFILL_S + service * engine.service_s, "done", r)

    def expire(now: float) -> None:
        keep: deque[tuple[float, float, float]] = deque()
        for item in queue:
            if item[2] < now:
                refuse(item[0])
            else:
                keep.append(item)
        queue.clear()
        queue.extend(keep)

    def scale_to(desired: int, now: float) -> None:
        live = [r for r in replicas if r.stopped is None and not r.draining]
        for _ in range(desired - len(live)):
            r = Replica(now, now + engine.start_s)
            replicas.append(r)
            push(r.ready_at, "ready", r)
        surplus = len(live) - desired
        if surplus <= 0:
            return
        # Starting ones go first (nothing to drain), the newest first; then the least busy.
        order = sorted(live, key=lambda r: (r.ready(now), r.busy, -r.started))
        for r in order[:surplus]:
            r.draining = True
            if r.busy == 0:
                stop(r, now)

    for i, (t, service) in enumerate(arrivals):
        push(t, "arrive", (t, service, i))
    if policy is None:
        for _ in range(fixed):
            replicas.append(Replica(-trace.warmup_s, -trace.warmup_s))
    state = AutoscaleState(0)
    samples: deque[LoadSample] = deque()
    before: RouterLoad | None = None
    t = -trace.warmup_s
    while t <= trace.day_s:
        push(t, "tick")
        t += SAMPLE_S
    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            arrived, service, _ = what
            any_ready = any(r.ready(now) for r in replicas)
            if not any_ready and policy is not None:
                if len(queue) >= held_max:
                    refuse(arrived)
                    continue
                queue.append((arrived, service, arrived + held_s))
            elif len(queue) >= QUEUE_LIMIT:
                refuse(arrived)
                continue
            else:
                queue.append((arrived, service, arrived + QUEUE_TIMEOUT_S))
            dispatch(now)
        elif kind == "done":
            r = what
            r.busy -= 1
            in_flight -= 1
            if r.draining and r.busy == 0 and r.stopped is None:
                stop(r, now)
            dispatch(now)
        elif kind == "ready":
            dispatch(now)
        elif kind == "tick" and policy is not None:
            expire(now)
            load = RouterLoad(len(queue), in_flight, 0, tuple(ttft_counts), rejected)
            samples.append(sample(now, grown(before, load)))
            before = load
            while samples and samples[0].at < now - max(policy.window_s, policy.trend_window_s):
                samples.popleft()
            ready = sum(1 for r in replicas if r.ready(now))
            decision = autoscale(policy, list(samples), state, now, ready=ready)
            if decision.desired > state.desired and now >= 0:
                result.raises += 1
            elif decision.desired < state.desired and now >= 0:
                result.lowerings += 1
            if decision.desired != state.desired:
                result.decisions.append((now, decision.desired, decision.reason))
            state = decision.state
            result.peak_desired = max(result.peak_desired, state.desired)
            scale_to(state.desired, now)
            dispatch(now)
    for r in replicas:
        if r.stopped is None:
            stop(r, max(trace.day_s, now))
    for minute, ttfts in sorted(ttft_by_minute.items()):
        result.minutes += 1
        ttfts.sort()
        p90 = ttfts[max(0, math.ceil(0.9 * len(ttfts)) - 1)]
        if p90 <= slo_s:
            result.minutes_ok += 1
        else:
            result.bad_minutes.append(minute)
    return result


def best_fixed(run: Callable[[int], Result], most: int) -> tuple[int, Result] | tuple[None, None]:
    """The fewest replicas, always ready, whose day meets the minutes goal (a binary
    search: more replicas never serve a minute worse)."""
    lo, hi = 1, most
    found: tuple[int, Result] | tuple[None, None] = (None, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        r = run(mid)
        if r.share_ok >= GOAL_MINUTES:
            found = (mid, r)
            hi = mid - 1
        else:
            lo = mid + 1
    return found


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a day in 120 minutes at 2/s")
    ap.add_argument("--day-min", type=float, default=480.0)
    ap.add_argument("--peak", type=float, default=5.0, help="requests/s in busy hours")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--service-s", type=float, default=8.0)
    ap.add_argument("--slo-s", type=float, default=2.0, help="TTFT p90 per minute")
    ap.add_argument("--max", type=int, default=40)
    ap.add_argument("--start-s", type=float, nargs="*", default=[10.0, 60.0, 120.0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--decisions", action="store_true", help="print every change and why")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    opts = ap.parse_args()
    if opts.quick:
        opts.day_min, opts.peak, opts.max = 120.0, 2.0, 16
    trace = day_trace(opts.day_min, opts.peak)
    arrivals = trace.arrivals(opts.seed)
    policy = AutoscalePolicy(min=0, max=opts.max, requests_per_replica=0.75 * opts.slots)
    spikes = ", ".join(f"{(b - a) / 60:g} min at {a / 60:g}" for a, b in trace.spikes)
    print(
        f"trace: a day in {opts.day_min:g} simulated minutes, {len(arrivals)} requests, "
        f"peak {opts.peak:g}/s, spikes of {SPIKE_FACTOR:g}x: {spikes}"
    )
    print(f"engine: {opts.slots} slots, {opts.service_s:g} s a request; SLO {opts.slo_s:g} s")
    print(f"policy: {policy}")
    fixed_engine = Engine(0.0, opts.slots, opts.service_s)
    n_fixed, fixed = best_fixed(
        lambda n: simulate(trace, arrivals, fixed_engine, fixed=n, slo_s=opts.slo_s), opts.max
    )
    if fixed is None:
        print(f"best fixed count in hindsight: none up to {opts.max} meets {GOAL_MINUTES:.0%}")
    else:
        print(
            f"best fixed count in hindsight: {n_fixed} replicas, {fixed.gpu_s / 3600:.2f} "
            f"GPU-hours, {fixed.share_ok:.1%} of minutes within the SLO, "
            f"{fixed.refused_in} refused inside spikes, {fixed.refused_out} outside"
        )
    rows = []
    unmet: list[str] = []
    for start_s in opts.start_s:
        r = simulate(
            trace, arrivals, Engine(start_s, opts.slots, opts.service_s), policy=policy,
            slo_s=opts.slo_s,
        )  # fmt: skip
        ratio = r.gpu_s / fixed.gpu_s if fixed else math.nan
        met = {
            "minutes": r.share_ok >= GOAL_MINUTES,
            "gpu_hours": ratio <= GOAL_RATIO,
            "refused_outside": r.refused_out == 0,
        }
        print(f"start time {start_s:g} s:")
        print(
            f"  minutes with TTFT p90 <= {opts.slo_s:g} s: {r.share_ok:.1%} of {r.minutes} "
            f"(goal >= {GOAL_MINUTES:.0%}): {verdict(met['minutes'])}"
        )
        if r.bad_minutes:
            print(f"    over the SLO: minutes {', '.join(map(str, r.bad_minutes))}")
        against = fixed.gpu_s / 3600 if fixed else math.nan
        print(
            f"  GPU-hours: {r.gpu_s / 3600:.2f} against {against:.2f} fixed: {ratio:.2f}x "
            f"(goal <= {GOAL_RATIO}x): {verdict(met['gpu_hours'])}"
        )
        print(
            f"  refused (503/429): {r.refused_in} inside spikes, {r.refused_out} outside "
            f"(goal 0 outside): {verdict(met['refused_outside'])}"
        )
        print(
            f"  scale events: {r.raises + r.lowerings} ({r.raises} raises, "
            f"{r.lowerings} lowerings), at most {r.peak_desired} replicas"
        )
        if opts.decisions:
            for at, desired, reason in r.decisions:
                print(f"    {at / 60:7.2f} min  {desired:3d}  {reason}")
        unmet += [f"{name} at {start_s:g} s" for name, ok in met.items() if not ok]
        rows.append({
            "start_s": start_s, "minutes": r.minutes, "share_ok": r.share_ok,
            "bad_minutes": r.bad_minutes, "gpu_hours": r.gpu_s / 3600, "gpu_ratio": ratio,
            "refused_inside": r.refused_in, "refused_outside": r.refused_out,
            "raises": r.raises, "lowerings": r.lowerings, "met": met,
        })  # fmt: skip
    print("goals not met: " + (", ".join(unmet) if unmet else "none"))
    if opts.json:
        opts.json.write_text(json.dumps({
            "requests": len(arrivals), "fixed_replicas": n_fixed,
            "fixed_gpu_hours": fixed.gpu_s / 3600 if fixed else None, "runs": rows,
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
