"""Autoscaling: a window of load samples -> a model's desired replica count.

`autoscale(policy, samples, state, now)` is the whole decision; the control plane's
shell keeps the samples (llmgw/core/_load.py `sample`, one every few seconds) and the
`AutoscaleState` between calls, and acts on `desired`. It reads the samples of the last
`window_s` seconds:

- target: ceil(mean demand / requests_per_replica); demand = requests queued + in flight.
- trend: the least-squares slope of the requests IN FLIGHT over the last
  `trend_window_s` (a longer span than the window: a slope over 30 s is mostly noise),
  counted only as far as it stands out of the noise (its lower two-standard-error
  bound), projected `predict_s` ahead (about a replica's start time) from the fitted
  count now, plus what waits now. It may only raise, never lower, the count. In flight,
  not demand: a queue that grows while replicas start is a backlog the target already
  counts, and projecting it would start a replica per request held (measured: 34
  replicas for 1.5 requests/s on a cold model with a 120 s start, bench/autoscale.py).
- ttft: the window's TTFT p90 readings (weighted by first bytes) over `ttft_p90_s`
  while requests waited: one more replica.
- rejected: requests refused for capacity: one more replica.

ttft and rejected read only the samples taken after the last raise: a refusal that a
raise has already answered is not answered again while that raise's replicas start.

Hysteresis. The count is raised as soon as the load asks for more than `desired`, by
at most `max_step_up` per decision and no sooner than `up_cooldown_s` after the last
raise. It is lowered only once the load has asked for fewer continuously for
`scale_down_after_s`, judged by the window's PEAK demand with a margin (`DOWN_MARGIN`:
the peak must fit the smaller count with 10 % to spare), one replica per decision, no
sooner than `down_cooldown_s` after the last change. A load anywhere between
ceil(mean / target) and ceil(peak x 1.1 / target) replicas is therefore left alone:
that band is what keeps a steady load from flapping. `low_since` is the first sample of
the window in which the load first asked for fewer (not before the last raise), so the
wait counts from when the load fell, to within a sample; a `scale_down_after_s` shorter
than `window_s` is allowed and then means "the whole window asked for fewer".
Without requests_per_replica (a TTFT target alone) demand says nothing of how many
replicas it needs: the load asks for one fewer while nothing waits and TTFT p90 stays
under half its target, and each step down waits a full `scale_down_after_s` from the
last change (a probe: a queue with a slow TTFT brings the replica back).

From zero: at 0 replicas, demand in the latest sample starts max(1, min) replicas at
once (more when the target asks, up to `max_step_up`), with no cooldown: those
requests are being held. No sample in the window keeps the count: absent is not zero,
so missing signals never lower anything. The result is always within [min, max].

Bounds held by the properties of tests/core/test_autoscale.py (a sample and a decision
every `dt`):
- a constant load D never moves the count both ways, and leaves it in the band
  [clamp(ceil(D / target)), clamp(ceil(1.1 D / target))] by t0 + the raises (or
  lowerings) it needs, each after its cooldown (+ dt), the first lowering after
  scale_down_after_s; a count in the band never changes;
- after a step up of the load to D at time t_s, desired >= clamp(ceil(D / target)) at
  every decision from t_s + window_s + dt + n x (up_cooldown_s + dt) on, where n is the
  raises needed: ceil((that count - desired before) / max_step_up);
- a lowering at t needs every sample of [t - scale_down_after_s, t] to have asked
  for fewer (ceil(1.1 x its demand / target) below the count then); raises are
  `up_cooldown_s` apart, a lowering `down_cooldown_s` after the last change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import attrs

from llmgw.core._load import LoadSample

# The peak must fit the lower count with this fraction to spare before a replica goes:
# a load sitting on a boundary (a peak of 8.0 at 4 per replica) keeps its replicas.
DOWN_MARGIN = 0.1
# How many standard errors of the slope are taken off before the trend counts: the
# in-flight count of a steady load wanders (Poisson arrivals, requests of seconds), and
# its slope, projected 60 s ahead, would start replicas for nothing; a real ramp stands
# out of that noise by more than two standard errors.
TREND_STDERRS = 2.0
_EPS = 1e-9


@attrs.frozen
class AutoscalePolicy:
    """A model's `autoscale:` in the catalog, validated (llmgw/cp/_fleet/_catalog.py).

    The defaults were tuned with bench/autoscale.py (a day-shaped trace with 5x spikes,
    engines starting in 10, 60 and 120 s, requests_per_replica 6 for 8 slots); the
    figures quoted are its GPU-hours against the best fixed count at a 60 s start, all
    with >= 97 % of minutes within the SLO and no refusal outside the spikes."""

    min: int = 0  # 0 scales to zero: a model nobody asks for holds no card
    max: int = 1  # the operator's ceiling: what the model may take of the fleet
    # Targets: None = not used; at least one is set. Demand = requests queued + in flight.
    # requests_per_replica: what one replica serves well at once; set it below the
    # engine's slots (llama-server -np, vLLM max_num_seqs) to leave room for a burst
    # while a new replica starts (the bench: 6 for 8 slots).
    requests_per_replica: float | None = 4.0
    # Off: the queue is in demand already, so a wait raises the count through the
    # target; a TTFT target of 2 s changed no minute in the bench and added replicas
    # while others started (+0.3 GPU-hours at 120 s). For a model whose long prompts
    # make TTFT slow before any queue forms.
    ttft_p90_s: float | None = None
    # The samples the target reads: 30 s is 30 samples (the leader samples every
    # second), a mean that a burst of one sample does not swing, short enough that a
    # step is followed within it.
    window_s: float = 30.0
    # The load must have asked for fewer this long: a replica that took 60-120 s to
    # start is not given back for a lull shorter than a few start times. 120 s saved
    # 12 % of the GPU-hours and lost 2 to 4 more minutes at each start time (95.7 % of
    # minutes at 120 s, at the goal's edge).
    scale_down_after_s: float = 300.0
    # Replicas added by one decision at most: a 5x spike on 7 replicas asks for 28 more,
    # 8 at a time reaches it in 30 s; 4 lost 3 more minutes at a 10 s start.
    max_step_up: int = 8
    # Between two raises: two samples, so a raise's effect (requests moving to new
    # replicas) is not mistaken for more load. The first raise from zero waits none.
    up_cooldown_s: float = 10.0
    # Between two lowerings (one replica each, after scale_down_after_s): the fleet a
    # spike left comes down in minutes, not a quarter of an hour (30 s: 1.17x the fixed
    # count's GPU-hours, 10 s: 1.04x, the same minutes within the SLO).
    down_cooldown_s: float = 10.0
    # How far ahead a rising trend is projected: about the start time of a replica,
    # so it is ready when the projected load arrives. At a 120 s start the trend keeps
    # 4 minutes of the day within the SLO that no trend loses (96.4 % against 95.4 %).
    predict_s: float = 60.0
    # The samples the trend's slope is fitted to (with window_s, the longer): over 30 s
    # the slope of a steady load is mostly noise (1.26x the fixed count's GPU-hours, the
    # trend raising and scale-down undoing it every 5 minutes); over 120 s, 1.04x,
    # near no trend at all (1.01x).
    trend_window_s: float = 120.0
    # Requests held while a model has no ready replica, beyond that 503 at once: a burst
    # of a few dozen requests on a cold model is served, a flood is refused early.
    hold_max: int = 64
    # How long one is held at most: longer than a large model's start (120 s) with room
    # to spare, shorter than a client's usual 5-10 min timeout.
    hold_s: float = 180.0


@attrs.frozen
class AutoscaleState:
    """What a model's autoscaler remembers between decisions (the shell keeps it)."""

    desired: int
    changed_at: float | None = None  # the last change of `desired`
    raised_at: float | None = None  # the last raise
    low_since: float | None = None  # since when the load has asked for fewer than desired


@attrs.frozen
class AutoscaleDecision:
    desired: int
    state: AutoscaleState
    rule: str  # what set it: see RULES
    signal: str  # the figure it read, in words: "5.2 requests per replica over 30 s (target 4)"
    reason: str  # one line for `ctl status` and the event: the rule and the signal


RULES = (
    "steady",  # within the targets: unchanged
    "target",  # demand per replica over the target: raised
    "ttft",  # TTFT p90 over its target with requests waiting: raised
    "rejected",  # requests refused for capacity: raised
    "trend",  # the rising trend projected predict_s ahead: raised (never lowers)
    "from-zero",  # demand at zero replicas: one at once
    "scale-down",  # the load asked for fewer for scale_down_after_s: lowered by one
    "cooldown",  # a change is due but its cooldown holds it
    "min",  # clamped to min
    "max",  # clamped to max
)


def validate_policy(policy: AutoscalePolicy, where: str) -> list[str]:
    """Every problem with `policy`, each as "{where}.field: value, what would be right"."""
    p = policy
    out: list[str] = []

    def bad(field: str, value: object, right: str) -> None:
        out.append(f"{where}.{field}: {value!r}; {right}")

    if p.min < 0:
        bad("min", p.min, "must be 0 or more (0 scales the model to zero)")
    if p.max < 1:
        bad("max", p.max, "must be at least 1 (a model that may never run: remove it)")
    elif p.max < p.min:
        bad("max", p.max, f"must be at least min ({p.min})")
    if p.requests_per_replica is None and p.ttft_p90_s is None:
        bad("target", None, "set requests_per_replica, ttft_p90_s or both")
    for name in ("requests_per_replica", "ttft_p90_s"):
        value = getattr(p, name)
        if value is not None and not _positive(value):
            bad(name, value, "must be a positive number (or unset)")
    for name in ("window_s", "hold_s"):
        if not _positive(getattr(p, name)):
            bad(name, getattr(p, name), "must be a positive number of seconds")
    # scale_down_after_s below window_s is allowed: then the window alone is the wait.
    durations = ("scale_down_after_s", "up_cooldown_s", "down_cooldown_s", "predict_s",
                 "trend_window_s")  # fmt: skip
    for name in durations:
        value = getattr(p, name)
        if not (math.isfinite(value) and value >= 0):
            bad(name, value, "must be 0 or more seconds")
    if p.max_step_up < 1:
        bad("max_step_up", p.max_step_up, "must be at least 1")
    if p.hold_max < 0:
        bad("hold_max", p.hold_max, "must be 0 or more (0: refuse at once at zero replicas)")
    return out


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


@attrs.frozen
class _Want:
    count: int
    rule: str
    signal: str


def _at(s: LoadSample) -> float:
    return s.at


def _num(x: float) -> str:
    return f"{x:g}"


def _replicas(demand: float, per_replica: float) -> int:
    return max(0, math.ceil(demand / per_replica - _EPS))


def _per_replica(demand: float, replicas: int) -> str:
    if replicas == 0:
        return f"{demand:.1f} requests at 0 replicas"
    return f"{demand / replicas:.1f} requests per replica"


def _slope(window: Sequence[LoadSample]) -> tuple[float, float, float] | None:
    """(slope, its standard error, the fitted value at the last sample) of the requests
    in flight over time by least squares; None under 3 samples or with no spread in time."""
    n = len(window)
    if n < 3:
        return None
    ts = [s.at for s in window]
    ds = [float(s.in_flight) for s in window]
    mt, md = sum(ts) / n, sum(ds) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx <= 0:
        return None
    slope = sum((t - mt) * (d - md) for t, d in zip(ts, ds, strict=True)) / sxx
    sse = sum((d - (md + slope * (t - mt))) ** 2 for t, d in zip(ts, ds, strict=True))
    stderr = math.sqrt(max(sse, 0.0) / (n - 2) / sxx)
    return slope, stderr, md + slope * (ts[-1] - mt)


def _weighted_p90(readings: Sequence[LoadSample]) -> float | None:
    """The TTFT p90 readings' mean, each weighted by the first bytes it is of; None
    without a reading."""
    seen = [(s.ttft_p90_s, max(s.first_bytes, 1)) for s in readings if s.ttft_p90_s is not None]
    if not seen:
        return None
    return sum(p * w for p, w in seen) / sum(w for _, w in seen)


@attrs.frozen
class _Reading:
    wants: tuple[_Want, ...]  # what each raise rule asks for (those that apply)
    need: int  # what the load asks for by the lowering test (peak, margin, every rule)
    low_signal: str  # the words of that test


def _read(
    policy: AutoscalePolicy,
    window: Sequence[LoadSample],
    history: Sequence[LoadSample],
    state: AutoscaleState,
) -> _Reading:
    cur = state.desired
    w = _num(policy.window_s)
    r = policy.requests_per_replica
    mean = sum(s.demand for s in window) / len(window)
    peak = max(s.demand for s in window)
    since_raise = [s for s in window if state.raised_at is None or s.at > state.raised_at]
    wants: list[_Want] = []
    need = 0
    low_signal = ""
    if r is not None:
        n = _replicas(mean, r)
        wants.append(_Want(n, "target", f"{_per_replica(mean, cur)} over {w} s (target {_num(r)})"))
        need = max(n, _replicas(peak * (1 + DOWN_MARGIN), r))
        low_signal = f"at most {_per_replica(peak, cur)} over {w} s (target {_num(r)})"
        fit = _slope(history)
        if fit is not None and policy.predict_s > 0:
            slope, stderr, now_fit = fit
            rising = slope - TREND_STDERRS * stderr
            if rising > 0:
                ahead = window[-1].queued + now_fit + rising * policy.predict_s
                n = _replicas(ahead, r)
                wants.append(
                    _Want(
                        n,
                        "trend",
                        f"in flight rising {rising:.2f}/s: {ahead:.1f} requests in "
                        f"{_num(policy.predict_s)} s (target {_num(r)} per replica)",
                    )
                )
                need = max(need, n)
    if policy.ttft_p90_s is not None:
        target = policy.ttft_p90_s
        waited = any(s.queued > 0 for s in since_raise)
        p90 = _weighted_p90(since_raise)
        if p90 is not None and p90 > target and waited:
            wants.append(
                _Want(
                    cur + 1,
                    "ttft",
                    f"TTFT p90 {p90:.2f} s over {w} s with requests waiting "
                    f"(target {_num(target)} s)",
                )
            )
        # Lowering: any reading over target holds the count; without a demand target
        # the load asks for one fewer when nothing waited and TTFT kept under half of it.
        window_p90 = _weighted_p90(window)
        over = window_p90 is not None and window_p90 > target
        if over:
            need = max(need, cur)
        if r is None:
            queued = any(s.queued > 0 for s in window)
            if peak == 0:
                low_signal = f"no requests over {w} s"
            elif queued or (window_p90 is not None and window_p90 > target / 2):
                need = max(need, cur)
            else:
                need = max(need, cur - 1)
                shown = "no first bytes" if window_p90 is None else f"{window_p90:.2f} s"
                low_signal = (
                    f"nothing waited over {w} s, TTFT p90 {shown} "
                    f"(under half the target {_num(target)} s)"
                )
    refused = sum(s.rejected for s in since_raise)
    if refused > 0:
        wants.append(_Want(cur + 1, "rejected", f"{refused} requests refused for capacity"))
    if any(s.rejected > 0 for s in window):
        need = max(need, cur)
    need = max([need, *(want.count for want in wants)])
    return _Reading(tuple(wants), need, low_signal or "the load asks for fewer")


def autoscale(
    policy: AutoscalePolicy,
    samples: Sequence[LoadSample],
    state: AutoscaleState,
    now: float,
    *,
    ready: int | None = None,
) -> AutoscaleDecision:
    """The desired count of a model now, from every sample the shell holds (oldest first;
    those at or after `now - window_s` are read). `ready` (replicas ready now, None:
    unknown) is only put into the words: the decision is about desired."""
    cur = state.desired
    lo, hi = policy.min, policy.max
    tail = "" if ready is None else f"; {ready} ready"

    def decided(
        desired: int,
        rule: str,
        signal: str,
        words: str,
        *,
        low_since: float | None,
        raised: bool = False,
    ) -> AutoscaleDecision:
        new_state = AutoscaleState(
            desired,
            now if desired != cur else state.changed_at,
            now if raised else state.raised_at,
            low_since,
        )
        return AutoscaleDecision(desired, new_state, rule, signal, f"{words}: {signal}{tail}")

    # Sorted here too: the latest sample is the one from zero reads, the first the one a
    # spell asking for fewer counts from.
    window = sorted((s for s in samples if now - policy.window_s <= s.at <= now), key=_at)
    if not window:
        signal = f"no signal over {_num(policy.window_s)} s (absent is not zero)"
        if cur < lo:
            words = f"raised {cur} -> {lo} (min)"
            return decided(lo, "min", signal, words, low_since=None, raised=True)
        if cur > hi:
            return decided(hi, "max", signal, f"lowered {cur} -> {hi} (max)", low_since=None)
        return decided(cur, "steady", signal, f"kept {cur}", low_since=None)
    span = max(policy.window_s, policy.trend_window_s)
    history = sorted((s for s in samples if now - span <= s.at <= now), key=_at)
    reading = _read(policy, window, history, state)
    top = max(reading.wants, key=lambda want: want.count, default=None)
    latest = window[-1]
    if cur == 0 and latest.demand > 0:
        # Those requests are being held: no cooldown, and as many as the target asks.
        new = min(hi, max(1, lo, min(top.count if top else 0, policy.max_step_up)))
        signal = f"{latest.demand} requests waiting at 0 replicas"
        words = f"started 0 -> {new}"
        return decided(new, "from-zero", signal, words, low_since=None, raised=True)
    signal = top.signal if top else reading.low_signal
    if cur < lo:
        words = f"raised {cur} -> {lo} (min)"
        return decided(lo, "min", signal, words, low_since=None, raised=True)
    if cur > hi:
        return decided(hi, "max", signal, f"lowered {cur} -> {hi} (max)", low_since=None)
    if top is not None and top.count > cur:
        return _raise(policy, state, now, top, decided)
    if reading.need >= cur:
        return decided(cur, "steady", signal, f"steady at {cur}", low_since=None)
    return _lower(policy, state, now, window, reading, decided)


class _Decided(Protocol):
    def __call__(
        self,
        desired: int,
        rule: str,
        signal: str,
        words: str,
        *,
        low_since: float | None,
        raised: bool = False,
    ) -> AutoscaleDecision: ...


def _raise(
    policy: AutoscalePolicy, state: AutoscaleState, now: float, top: _Want, decided: _Decided
) -> AutoscaleDecision:
    cur, hi, wanted = state.desired, policy.max, top.count
    if cur >= hi:
        return decided(cur, "max", top.signal, f"held at max {hi} (wants {wanted})", low_since=None)
    if state.raised_at is not None and now - state.raised_at < policy.up_cooldown_s:
        left = state.raised_at + policy.up_cooldown_s - now
        words = f"held at {cur} (wants {wanted}; {left:.0f} s cooldown)"
        return decided(cur, "cooldown", top.signal, words, low_since=None)
    stepped = min(wanted, cur + policy.max_step_up)
    new = min(stepped, hi)
    notes = []
    if stepped < wanted:
        notes.append(f"step {policy.max_step_up}")
    if new < stepped:
        notes.append(f"max {hi}")
    note = f" ({', '.join(notes)}; wants {wanted})" if notes else ""
    rule = "max" if new < stepped else top.rule
    words = f"raised {cur} -> {new}{note}"
    return decided(new, rule, top.signal, words, low_since=None, raised=True)


def _lower(
    policy: AutoscalePolicy,
    state: AutoscaleState,
    now: float,
    window: Sequence[LoadSample],
    reading: _Reading,
    decided: _Decided,
) -> AutoscaleDecision:
    """The load asks for fewer than desired: lowered by one once it has for
    scale_down_after_s and the last change is down_cooldown_s old."""
    cur, lo, signal = state.desired, policy.min, reading.low_signal
    if cur <= lo:
        return decided(cur, "min", signal, f"held at min {lo}", low_since=None)
    since = state.low_since
    if since is None:
        # The samples judged "fewer" count from the window's first, but not from before
        # the last raise; without a demand target "quiet" was judged at the count then,
        # so not from before the last change either.
        after_change = state.raised_at
        if policy.requests_per_replica is None and state.changed_at is not None:
            after_change = state.changed_at
        since = window[0].at if after_change is None else max(window[0].at, after_change)
    waited = now - since
    after = policy.scale_down_after_s
    asks = f"asks for {reading.need}"
    if waited < after:
        words = f"steady at {cur} ({asks}; lowers after {_num(after)} s, {waited:.0f} s so far)"
        return decided(cur, "steady", signal, words, low_since=since)
    if state.changed_at is not None and now - state.changed_at < policy.down_cooldown_s:
        left = state.changed_at + policy.down_cooldown_s - now
        words = f"held at {cur} ({asks}; {left:.0f} s cooldown)"
        return decided(cur, "cooldown", signal, words, low_since=since)
    new = cur - 1
    # Without a demand target each step down is a probe: the next waits a full spell.
    keep = since if reading.need < new and policy.requests_per_replica is not None else None
    words = f"lowered {cur} -> {new} ({asks}, {waited:.0f} s below)"
    return decided(new, "scale-down", signal, words, low_since=keep)
