"""A model's load as routers report it (llmgw/core/_load.py): the wire form and its
refusals, the counters' growth across a router's restart, the bucketed TTFT quantile."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import (
    TTFT_BOUNDS,
    LoadSample,
    RouterLoad,
    grown,
    merge_loads,
    sample,
    ttft_bucket,
    ttft_quantile,
)

N = len(TTFT_BOUNDS) + 1


def buckets(*pairs: tuple[int, int]) -> tuple[int, ...]:
    out = [0] * N
    for index, count in pairs:
        out[index] = count
    return tuple(out)


# --- the wire form ------------------------------------------------------------------------


@given(
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**9),
    st.lists(st.integers(0, 10**9), min_size=N, max_size=N),
    st.integers(0, 10**6),
    st.none() | st.floats(0, 4e9),
)
def test_as_json_and_from_json_are_inverses(
    queued: int, in_flight: int, uncached: int, ttft: list[int], rejected: int, used: float | None
) -> None:
    load = RouterLoad(queued, in_flight, uncached, tuple(ttft), rejected, used)
    assert RouterLoad.from_json(load.as_json()) == load
    # With no last use it is the five figures a reader from before last_used takes.
    assert len(load.as_json()) == (5 if used is None else 6)


def test_merged_last_use_is_the_latest() -> None:
    loads = [RouterLoad(last_used=10.0), RouterLoad(), RouterLoad(last_used=30.0)]
    assert merge_loads(loads).last_used == 30.0
    assert merge_loads([RouterLoad(), RouterLoad()]).last_used is None


SHAPE = "a load is [queued, in_flight, uncached_tokens, [ttft...], rejected(, last_used)]"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"queued": 1}, SHAPE),
        ([0, 0, 0, [0] * N], SHAPE),
        ([0, 0, 0, [0] * N, 0, "now"], "last_used must be a unix time, not 'now'"),
        ([0, 0, 0, [0] * N, 0, float("inf")], "last_used must be a unix time, not inf"),
        ([-1, 0, 0, [0] * N, 0], "load counts must be non-negative integers, not [-1, 0, 0, 0]"),
        ([0, 1.5, 0, [0] * N, 0], "load counts must be non-negative integers, not [0, 1.5, 0, 0]"),
        (
            [0, 0, 0, [0] * N, True],
            "load counts must be non-negative integers, not [0, 0, 0, True]",
        ),
        ([0, 0, "3", [0] * N, 0], "load counts must be non-negative integers, not [0, 0, '3', 0]"),
        ([0, 0, 0, [0] * (N - 1), 0], f"ttft must be {N} bucket counts"),
        ([0, 0, 0, "0" * N, 0], f"ttft must be {N} bucket counts"),
        ([0, 0, 0, [0] * (N - 1) + [-2], 0], "ttft bucket counts must be non-negative integers"),
        ([0, 0, 0, [0] * (N - 1) + [None], 0], "ttft bucket counts must be non-negative integers"),
    ],
)
def test_from_json_refuses_what_a_router_would_not_send(value: object, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        RouterLoad.from_json(value)
    assert str(caught.value) == message


# --- growth -------------------------------------------------------------------------------


def test_growth_is_the_counters_difference_and_the_gauges_of_now() -> None:
    before = RouterLoad(5, 5, 100, buckets((1, 10), (4, 2)), 3)
    now = RouterLoad(1, 2, 40, buckets((1, 12), (4, 2), (9, 1)), 4)
    assert grown(before, now) == RouterLoad(1, 2, 40, buckets((1, 2), (9, 1)), 1)
    assert grown(None, now) == now
    assert grown(now, now) == RouterLoad(1, 2, 40, buckets(), 0)


def test_a_router_that_restarted_counts_all_of_its_reading_as_growth() -> None:
    before = RouterLoad(0, 0, 0, buckets((1, 10), (4, 2)), 3)
    # Its rejected count went back (the others grew), or one bucket did.
    assert grown(before, RouterLoad(0, 1, 0, buckets((1, 11), (4, 2)), 1)).rejected == 1
    restarted = RouterLoad(0, 1, 0, buckets((1, 11)), 3)
    assert grown(before, restarted) == restarted


@given(
    st.lists(st.integers(0, 50), min_size=N, max_size=N),
    st.lists(st.integers(0, 50), min_size=N, max_size=N),
    st.integers(0, 50),
    st.integers(0, 50),
)
def test_growth_never_goes_negative_and_adds_up(
    a: list[int], more: list[int], rejected: int, extra: int
) -> None:
    before = RouterLoad(0, 0, 0, tuple(a), rejected)
    after = RouterLoad(
        0, 0, 0, tuple(x + y for x, y in zip(a, more, strict=True)), rejected + extra
    )
    g = grown(before, after)
    assert g.ttft == tuple(more) and g.rejected == extra
    # Whatever the two readings, the growth is a reading a sample can be made of.
    other = grown(after, before)
    assert min(other.ttft) >= 0 and other.rejected >= 0


# --- the TTFT quantile --------------------------------------------------------------------


def test_the_quantile_is_the_upper_bound_of_its_bucket() -> None:
    assert ttft_quantile(buckets(), 0.9) is None
    assert ttft_quantile(buckets((0, 9), (5, 1)), 0.9) == TTFT_BOUNDS[0]
    assert ttft_quantile(buckets((0, 8), (5, 2)), 0.9) == TTFT_BOUNDS[5]
    # In the last, unbounded bucket: twice the last bound.
    assert ttft_quantile(buckets((N - 1, 1)), 0.9) == 2 * TTFT_BOUNDS[-1]
    # 0.55 x 100 is 55.00000000000001 in floating point: still rank 55, not 56.
    assert ttft_quantile(buckets((0, 55), (3, 45)), 0.55) == TTFT_BOUNDS[0]
    with pytest.raises(ValueError, match=r"a quantile is in \(0, 1\], not 0"):
        ttft_quantile(buckets((0, 1)), 0)


@given(
    st.lists(st.floats(0, 400, allow_nan=False), min_size=1, max_size=300),
    st.sampled_from(["0.5", "0.55", "0.9", "0.95", "0.99", "1"]),
)
def test_the_bucketed_quantile_is_the_bound_of_the_bucket_of_the_exact_one(
    seconds: list[float], q: str
) -> None:
    counts = [0] * N
    for s in seconds:
        counts[ttft_bucket(s)] += 1
    exact = sorted(seconds)[math.ceil(Fraction(q) * len(seconds)) - 1]
    i = ttft_bucket(exact)
    assert ttft_quantile(tuple(counts), float(q)) == (
        TTFT_BOUNDS[i] if i < len(TTFT_BOUNDS) else 2 * TTFT_BOUNDS[-1]
    )
    assert exact <= (TTFT_BOUNDS[i] if i < len(TTFT_BOUNDS) else math.inf)


def test_a_sample_is_the_gauges_the_p90_and_how_many_first_bytes_it_is_of() -> None:
    load = RouterLoad(3, 4, 900, buckets((2, 9), (7, 1)), 2)
    assert sample(12.5, load) == LoadSample(12.5, 3, 4, 900, TTFT_BOUNDS[2], 2, 10)
    assert sample(12.5, load).demand == 7
    assert sample(1.0, RouterLoad()).ttft_p90_s is None
