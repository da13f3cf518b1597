"""The autoscaling decision (llmgw/core/_autoscale.py).

The properties run the decision over simulated time the way the control plane does:
a sample and a decision every `dt` seconds, the state carried from one decision to
the next, the samples the shell would hold. Bounds asserted (the module docstring
states them): never outside [min, max]; a constant load moves the count one way only
and leaves it, by an exact time, in the band [ceil(D/target), ceil(1.1 D/target)] where
it stays; after a step up to D the count is at least ceil(D/target) from
t_step + window_s + dt + n (up_cooldown_s + dt) on; a lowering needs every sample of the
last scale_down_after_s to have asked for fewer; from zero is immediate; the trend never
lowers the count.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import attrs
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmgw.core import (
    AUTOSCALE_RULES,
    AutoscaleDecision,
    AutoscalePolicy,
    AutoscaleState,
    LoadSample,
    autoscale,
    validate_policy,
)
from llmgw.core._autoscale import DOWN_MARGIN


def load(
    at: float,
    queued: int = 0,
    in_flight: int = 0,
    *,
    ttft_p90_s: float | None = None,
    rejected: int = 0,
    first_bytes: int = 0,
) -> LoadSample:
    return LoadSample(at, queued, in_flight, 0, ttft_p90_s, rejected, first_bytes)


def steady(policy: AutoscalePolicy, demand: int, desired: int, now: float = 100.0, **kw):
    samples = [load(now - i * 5, 0, demand) for i in range(6, -1, -1)]
    return autoscale(policy, samples, AutoscaleState(desired, **kw), now)


def ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))


def clamp(policy: AutoscalePolicy, n: int) -> int:
    return max(policy.min, min(policy.max, n))


# --- strategies --------------------------------------------------------------------------


@st.composite
def policies(draw, *, demand_target: bool | None = None) -> AutoscalePolicy:
    lo = draw(st.integers(0, 4))
    hi = draw(st.integers(max(lo, 1), lo + 12))
    with_rpp = draw(st.booleans()) if demand_target is None else demand_target
    rpp = draw(st.sampled_from([0.5, 1.0, 2.0, 3.5, 4.0, 8.0])) if with_rpp else None
    ttft = draw(st.none() | st.sampled_from([0.5, 2.0, 5.0])) if with_rpp else 2.0
    return AutoscalePolicy(
        min=lo,
        max=hi,
        requests_per_replica=rpp,
        ttft_p90_s=ttft,
        window_s=draw(st.sampled_from([10.0, 30.0, 60.0])),
        scale_down_after_s=draw(st.sampled_from([0.0, 20.0, 60.0, 300.0])),
        max_step_up=draw(st.integers(1, 8)),
        up_cooldown_s=draw(st.sampled_from([0.0, 5.0, 10.0, 30.0])),
        down_cooldown_s=draw(st.sampled_from([0.0, 10.0, 30.0])),
        predict_s=draw(st.sampled_from([0.0, 30.0, 60.0])),
        trend_window_s=draw(st.sampled_from([0.0, 60.0, 120.0])),
    )


def sample_lists(now: float = 200.0):
    one = st.builds(
        load,
        at=st.floats(0, now),
        queued=st.integers(0, 60),
        in_flight=st.integers(0, 60),
        ttft_p90_s=st.none() | st.floats(0.01, 240),
        rejected=st.integers(0, 3),
        first_bytes=st.integers(0, 50),
    )
    return st.lists(one, max_size=30).map(lambda xs: sorted(xs, key=lambda s: s.at))


@st.composite
def ramps(draw, now: float = 200.0) -> list[LoadSample]:
    """Samples every 5 s of a load rising (or falling) along a line, with a little noise:
    what makes the trend speak."""
    start, slope = draw(st.floats(0, 30)), draw(st.floats(-0.5, 1.0))
    noise = draw(st.lists(st.integers(-1, 1), min_size=41, max_size=41))
    queued = draw(st.integers(0, 5))
    return [
        load(t, queued, max(0, round(start + slope * t) + noise[i]))
        for i, t in enumerate(range(0, int(now) + 1, 5))
    ]


def states(now: float = 200.0):
    moment = st.none() | st.floats(0, now)
    return st.builds(AutoscaleState, st.integers(0, 30), moment, moment, moment)


# --- one decision ------------------------------------------------------------------------


@given(policies(), sample_lists(), states(), st.none() | st.integers(0, 30))
def test_never_outside_min_and_max_and_every_decision_says_why(
    policy: AutoscalePolicy, samples: list[LoadSample], state: AutoscaleState, ready: int | None
) -> None:
    d = autoscale(policy, samples, state, 200.0, ready=ready)
    assert policy.min <= d.desired <= policy.max
    assert d.state.desired == d.desired
    assert d.rule in AUTOSCALE_RULES
    assert d.signal and d.signal in d.reason
    assert d.reason.endswith("" if ready is None else f"; {ready} ready")
    if d.desired != state.desired:
        assert d.state.changed_at == 200.0
    if d.desired > state.desired:
        assert d.state.raised_at == 200.0
    # One replica fewer per decision, except a max the operator lowered.
    if d.desired < state.desired and state.desired <= policy.max:
        assert d.desired == state.desired - 1 and d.rule == "scale-down"


@given(policies(), sample_lists(), states(), st.randoms())
def test_the_order_the_samples_come_in_does_not_matter(
    policy: AutoscalePolicy, samples: list[LoadSample], state: AutoscaleState, rng
) -> None:
    unique = list({s.at: s for s in samples}.values())
    shuffled = unique[:]
    rng.shuffle(shuffled)
    assert autoscale(policy, shuffled, state, 200.0) == autoscale(policy, unique, state, 200.0)


@settings(max_examples=300)
@given(policies(demand_target=True), sample_lists() | ramps(), states())
def test_the_trend_never_lowers_the_count(
    policy: AutoscalePolicy, samples: list[LoadSample], state: AutoscaleState
) -> None:
    with_trend = autoscale(policy, samples, state, 200.0)
    without = autoscale(attrs.evolve(policy, predict_s=0.0), samples, state, 200.0)
    assert with_trend.desired >= without.desired
    if with_trend.rule == "trend":
        assert with_trend.desired > state.desired


@given(policies(), sample_lists(), states(), st.integers(1, 40), st.integers(0, 40))
def test_from_zero_is_immediate_whatever_the_cooldown(
    policy: AutoscalePolicy,
    samples: list[LoadSample],
    state: AutoscaleState,
    queued: int,
    in_flight: int,
) -> None:
    state = attrs.evolve(state, desired=0, raised_at=199.0, changed_at=199.0)
    d = autoscale(policy, [*samples, load(200.0, queued, in_flight)], state, 200.0)
    assert d.rule == "from-zero"
    assert max(1, policy.min) <= d.desired <= policy.max
    assert d.desired <= max(1, policy.min, policy.max_step_up)
    assert d.reason.startswith(f"started 0 -> {d.desired}: {queued + in_flight} requests waiting")


@given(policies(), states(), sample_lists(now=100.0))
def test_no_sample_in_the_window_keeps_the_count(
    policy: AutoscalePolicy, state: AutoscaleState, old: list[LoadSample]
) -> None:
    # Every sample is older than the window: absent is not zero, nothing is lowered.
    now = 100.0 + policy.window_s + 1
    d = autoscale(policy, old, state, now)
    assert d.desired == clamp(policy, state.desired)
    assert d.state.low_since is None
    assert "no signal over" in d.signal


# --- over time ----------------------------------------------------------------------------


@attrs.define
class Run:
    """Decisions every `dt` from t0 to t_end on the load `at(t) -> (queued, in flight)`."""

    policy: AutoscalePolicy
    at: Callable[[float], tuple[int, int]]
    dt: float
    state: AutoscaleState
    history: list[LoadSample] = attrs.Factory(list)
    log: list[tuple[float, int, AutoscaleDecision]] = attrs.Factory(list)  # (t, before, d)

    def run(self, t0: float, t_end: float, *, ttft: float | None = None) -> None:
        keep = max(self.policy.window_s, self.policy.trend_window_s) + self.dt
        n = 0
        while (t := t0 + n * self.dt) <= t_end:
            q, f = self.at(t)
            self.history.append(load(t, q, f, ttft_p90_s=ttft, first_bytes=5 if ttft else 0))
            while self.history[0].at < t - keep:
                self.history.pop(0)
            d = autoscale(self.policy, self.history, self.state, t)
            self.log.append((t, self.state.desired, d))
            self.state = d.state
            n += 1

    def counts(self) -> list[int]:
        return [d.desired for _, _, d in self.log]


def monotone(xs: list[int]) -> bool:
    pairs = list(itertools.pairwise(xs))
    return all(a <= b for a, b in pairs) or all(a >= b for a, b in pairs)


@settings(max_examples=150)
@given(
    policies(demand_target=True),
    st.integers(0, 40),
    st.integers(0, 40),
    st.sampled_from([1.0, 2.0, 5.0]),
    st.data(),
)
def test_a_constant_load_settles_by_an_exact_time_and_never_flaps(
    policy: AutoscalePolicy, queued: int, in_flight: int, dt: float, data: st.DataObject
) -> None:
    r = policy.requests_per_replica
    assert r is not None
    demand = queued + in_flight
    low = clamp(policy, ceil(demand / r))  # reached from below
    high = clamp(policy, max(ceil(demand / r), ceil(demand * (1 + DOWN_MARGIN) / r)))
    d0 = data.draw(st.integers(policy.min, policy.max), label="desired at t0")
    t0 = 1000.0
    past = st.none() | st.floats(t0 - 100, t0)
    raised, changed = data.draw(past, label="raised_at"), data.draw(past, label="changed_at")
    if raised is not None and changed is not None:
        changed = max(changed, raised)
    # A TTFT reading within its target (or none), no refusals: demand alone moves it.
    ttft = None if policy.ttft_p90_s is None else policy.ttft_p90_s * 0.9
    run = Run(policy, lambda t: (queued, in_flight), dt, AutoscaleState(d0, changed, raised))
    # The exact bound: the raises or lowerings needed, each after its cooldown.
    if d0 < low:
        n = math.ceil((low - d0) / policy.max_step_up)
        pending = 0.0 if d0 == 0 or raised is None else max(0.0, raised + policy.up_cooldown_s - t0)
        bound = t0 + pending + (n - 1) * (policy.up_cooldown_s + dt) + dt
    elif d0 > high:
        n = d0 - high
        pending = 0.0 if changed is None else max(0.0, changed + policy.down_cooldown_s - t0)
        bound = (
            t0
            + max(policy.scale_down_after_s, pending)
            + (n - 1) * (policy.down_cooldown_s + dt)
            + dt
        )
    else:
        bound = t0
    run.run(t0, bound + 2 * (policy.window_s + policy.scale_down_after_s) + 100, ttft=ttft)
    counts = run.counts()
    assert monotone([d0, *counts])
    assert low <= counts[-1] <= high
    for t, _, d in run.log:
        if t >= bound:
            assert d.desired == counts[-1], (t, bound, d.reason)
    if low <= d0 <= high:
        assert set(counts) == {d0}


@settings(max_examples=150)
@given(
    policies(demand_target=True),
    st.integers(0, 30),
    st.integers(1, 60),
    st.sampled_from([1.0, 2.0, 5.0]),
)
def test_a_step_up_is_followed_within_one_window_and_the_raises_it_takes(
    policy: AutoscalePolicy, before: int, more: int, dt: float
) -> None:
    r = policy.requests_per_replica
    assert r is not None
    policy = attrs.evolve(policy, ttft_p90_s=None)
    after = before + more
    k1, k2 = clamp(policy, ceil(before / r)), clamp(policy, ceil(after / r))
    assume(k2 > k1)
    t_step = 1000.0
    # Settled on the first load: samples of it for the whole window before the step.
    run = Run(policy, lambda t: (0, before if t < t_step else after), dt, AutoscaleState(k1))
    run.run(t_step - max(policy.window_s, policy.trend_window_s) - dt, t_step - dt)
    assert all(d.desired == k1 for _, _, d in run.log)
    run.state = AutoscaleState(k1)  # no cooldown pending at the step
    n = math.ceil((k2 - k1) / policy.max_step_up)
    bound = t_step + policy.window_s + dt + n * (policy.up_cooldown_s + dt)
    run.run(t_step, bound + 3 * policy.window_s)
    followed = t_step + policy.window_s + dt  # the count moves within one window
    for t, _, d in run.log:
        if t >= followed:
            assert d.desired > k1, (t, followed, d.reason)
        if t >= bound:  # and reaches what the load needs after the raises' cooldowns
            assert d.desired >= k2, (t, bound, d.reason)


@settings(max_examples=150)
@given(
    policies(demand_target=True),
    st.lists(st.integers(0, 40), min_size=5, max_size=40),
    st.sampled_from([1.0, 5.0]),
    st.integers(0, 12),
)
def test_a_lowering_needs_scale_down_after_s_of_samples_asking_for_fewer_and_cooldowns_hold(
    policy: AutoscalePolicy, levels: list[int], dt: float, d0: int
) -> None:
    r = policy.requests_per_replica
    assert r is not None
    policy = attrs.evolve(policy, ttft_p90_s=None)
    hold = 40.0  # each level lasts 40 s

    def at(t: float) -> tuple[int, int]:
        return 0, levels[min(len(levels) - 1, int(t // hold))]

    run = Run(policy, at, dt, AutoscaleState(clamp(policy, d0)))
    run.run(0.0, hold * len(levels) + policy.scale_down_after_s + 200)
    by_time = {t: (before, d.desired) for t, before, d in run.log}
    raises = [t for t, before, d in run.log if d.desired > before and before > 0]
    assert all(b - a >= policy.up_cooldown_s for a, b in itertools.pairwise(raises))
    changes = [t for t, before, d in run.log if d.desired != before]
    for a, b in itertools.pairwise(changes):
        if by_time[b][1] < by_time[b][0]:
            assert b - a >= policy.down_cooldown_s
    for t, _, d in run.log:
        if d.rule != "scale-down":
            continue
        assert t >= policy.scale_down_after_s
        for u, (was, became) in by_time.items():
            if t - policy.scale_down_after_s <= u <= t:
                asked = ceil(at(u)[1] * (1 + DOWN_MARGIN) / r)
                assert asked < max(was, became), (t, u, d.reason)


def test_a_step_down_waits_scale_down_after_s_from_the_last_high_sample() -> None:
    policy = AutoscalePolicy(min=0, max=10, requests_per_replica=4.0, window_s=30.0,
                             scale_down_after_s=300.0, down_cooldown_s=10.0)  # fmt: skip
    run = Run(policy, lambda t: (0, 32 if t < 600 else 4), 5.0, AutoscaleState(8))
    run.run(0.0, 2000.0)
    changes = [(t, d.desired, d.reason) for t, before, d in run.log if d.desired != before]
    # The last sample of 32 is at 595; the first that asks for fewer is at 600.
    assert changes[0][:2] == (900.0, 7)
    assert changes[0][2].startswith("lowered 8 -> 7 (asks for 2, 300 s below): at most")
    # Then one per down_cooldown_s down to ceil(4 x 1.1 / 4) = 2.
    assert [c[:2] for c in changes] == [(900.0 + 10 * i, 7 - i) for i in range(6)]


# --- the words ---------------------------------------------------------------------------


def test_a_raise_names_the_rule_the_signal_and_the_result() -> None:
    policy = AutoscalePolicy(max=8, requests_per_replica=4.0, predict_s=0.0)
    d = steady(policy, 16, 2)
    assert (d.desired, d.rule) == (4, "target")
    assert d.signal == "8.0 requests per replica over 30 s (target 4)"
    assert d.reason == "raised 2 -> 4: 8.0 requests per replica over 30 s (target 4)"
    assert d.state == AutoscaleState(4, 100.0, 100.0, None)


def test_a_raise_is_bounded_by_the_step_the_cooldown_and_max() -> None:
    policy = AutoscalePolicy(max=8, requests_per_replica=1.0, max_step_up=3, predict_s=0.0)
    d = steady(policy, 20, 2)
    assert (d.desired, d.rule) == (5, "target")
    assert d.reason.startswith("raised 2 -> 5 (step 3; wants 20): ")
    held = steady(policy, 20, 5, raised_at=95.0)
    assert (held.desired, held.rule) == (5, "cooldown")
    assert held.reason.startswith("held at 5 (wants 20; 5 s cooldown): ")
    capped = steady(policy, 20, 6)
    assert (capped.desired, capped.rule) == (8, "max")
    assert capped.reason.startswith("raised 6 -> 8 (step 3, max 8; wants 20): ")
    at_max = steady(policy, 20, 8)
    assert (at_max.desired, at_max.rule) == (8, "max")
    assert at_max.reason.startswith("held at max 8 (wants 20): ")


def test_min_and_max_clamp_a_count_the_policy_no_longer_allows() -> None:
    policy = AutoscalePolicy(min=2, max=4, requests_per_replica=4.0)
    up = steady(policy, 0, 1)
    assert (up.desired, up.rule) == (2, "min")
    assert up.reason.startswith("raised 1 -> 2 (min): ")
    down = steady(policy, 0, 9)
    assert (down.desired, down.rule) == (4, "max")
    idle = steady(policy, 0, 2)
    assert (idle.desired, idle.rule) == (2, "min")
    assert idle.reason == "held at min 2: at most 0.0 requests per replica over 30 s (target 4)"


def test_ttft_over_target_with_requests_waiting_adds_one_and_only_once_per_raise() -> None:
    policy = AutoscalePolicy(max=8, requests_per_replica=None, ttft_p90_s=2.0)
    samples = [load(90.0 + i * 5, 3, 4, ttft_p90_s=4.0, first_bytes=10) for i in range(3)]
    d = autoscale(policy, samples, AutoscaleState(2), 100.0)
    assert (d.desired, d.rule) == (3, "ttft")
    assert d.signal == "TTFT p90 4.00 s over 30 s with requests waiting (target 2 s)"
    # The readings before that raise are not counted again (its replica is starting).
    again = autoscale(policy, samples, d.state, 130.0 - 1)
    assert again.desired == 3
    # Without requests waiting a slow TTFT is not for more replicas.
    calm = [attrs.evolve(s, queued=0) for s in samples]
    assert autoscale(policy, calm, AutoscaleState(2), 100.0).desired == 2


def test_refusals_add_one() -> None:
    policy = AutoscalePolicy(max=8, requests_per_replica=4.0, predict_s=0.0)
    samples = [load(100.0, 0, 4, rejected=7)]
    d = autoscale(policy, samples, AutoscaleState(1), 100.0)
    assert (d.desired, d.rule, d.signal) == (2, "rejected", "7 requests refused for capacity")


def test_the_trend_starts_a_replica_before_the_queue_builds_and_ignores_noise() -> None:
    policy = AutoscalePolicy(max=10, requests_per_replica=4.0, predict_s=60.0)
    ramp = [load(t, 0, 4 + t // 5) for t in range(0, 121, 5)]
    d = autoscale(policy, ramp, AutoscaleState(2), 120.0)
    # 28 in flight now, rising 0.2/s: 40 in 60 s -> 10 replicas, not 7 for now's load.
    assert d.rule == "trend" and d.desired == 10
    assert d.signal.startswith("in flight rising 0.20/s: 40.0 requests in 60 s")
    noisy = [load(t, 0, 20 + (5 if (t // 5) % 2 else -5)) for t in range(0, 121, 5)]
    assert autoscale(policy, noisy, AutoscaleState(6), 120.0).rule == "steady"


def test_a_ttft_only_policy_probes_down_one_spell_at_a_time() -> None:
    policy = AutoscalePolicy(max=8, requests_per_replica=None, ttft_p90_s=2.0,
                             scale_down_after_s=60.0, down_cooldown_s=0.0)  # fmt: skip
    run = Run(policy, lambda t: (0, 3), 5.0, AutoscaleState(5))
    run.run(0.0, 200.0, ttft=0.5)
    lowered = [t for t, before, d in run.log if d.desired < before]
    # 60 s from the first sample, then 60 s more from each lowering: a full spell each.
    assert lowered == [60.0, 120.0, 180.0]


# --- validation ---------------------------------------------------------------------------


def test_a_valid_policy_has_no_problem() -> None:
    assert validate_policy(AutoscalePolicy(), "models[0].autoscale") == []
    assert validate_policy(AutoscalePolicy(min=0, max=8, scale_down_after_s=0.0), "m") == []


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"min": -1}, "m.min: -1; must be 0 or more (0 scales the model to zero)"),
        ({"max": 0}, "m.max: 0; must be at least 1 (a model that may never run: remove it)"),
        ({"min": 3, "max": 2}, "m.max: 2; must be at least min (3)"),
        (
            {"requests_per_replica": None},
            "m.target: None; set requests_per_replica, ttft_p90_s or both",
        ),
        (
            {"requests_per_replica": 0.0},
            "m.requests_per_replica: 0.0; must be a positive number (or unset)",
        ),
        ({"ttft_p90_s": -1.0}, "m.ttft_p90_s: -1.0; must be a positive number (or unset)"),
        ({"window_s": 0.0}, "m.window_s: 0.0; must be a positive number of seconds"),
        ({"hold_s": math.inf}, "m.hold_s: inf; must be a positive number of seconds"),
        ({"scale_down_after_s": -1.0}, "m.scale_down_after_s: -1.0; must be 0 or more seconds"),
        ({"up_cooldown_s": math.nan}, "m.up_cooldown_s: nan; must be 0 or more seconds"),
        ({"trend_window_s": -5.0}, "m.trend_window_s: -5.0; must be 0 or more seconds"),
        ({"max_step_up": 0}, "m.max_step_up: 0; must be at least 1"),
        (
            {"hold_max": -2},
            "m.hold_max: -2; must be 0 or more (0: refuse at once at zero replicas)",
        ),
    ],
)
def test_every_problem_names_the_field_the_value_and_what_is_right(
    changes: dict[str, object], problem: str
) -> None:
    policy = attrs.evolve(AutoscalePolicy(max=4), **changes)
    assert validate_policy(policy, "m") == [problem]


def test_every_problem_is_reported_at_once() -> None:
    policy = AutoscalePolicy(min=-1, max=0, max_step_up=0, hold_max=-1)
    assert [p.split(":")[0] for p in validate_policy(policy, "x")] == [
        "x.min", "x.max", "x.max_step_up", "x.hold_max"
    ]  # fmt: skip
