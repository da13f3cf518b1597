"""The learning estimates (llmgw/core/_estimates.py): properties over any run of reports."""

from __future__ import annotations

import math

import attrs
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import Estimates, learn
from llmgw.core._estimates import (
    BYTES_PER_TOKEN_RANGE,
    DECODE_COST_RANGE,
    DEFAULT_BYTES_PER_TOKEN,
    DEFAULT_DECODE_COST,
    DEFAULT_OUTPUT_TOKENS,
)


@attrs.frozen
class Report:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_ms_per_token: float | None = None
    output_ms_per_token: float | None = None
    prompt_n: int | None = None


maybe_int = st.none() | st.integers(min_value=0, max_value=200_000)
maybe_ms = st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False)
reports = st.builds(
    Report,
    prompt_tokens=maybe_int,
    completion_tokens=maybe_int,
    prompt_ms_per_token=maybe_ms,
    output_ms_per_token=maybe_ms,
    prompt_n=maybe_int,
)
prompt_bytes = st.none() | st.integers(min_value=0, max_value=10_000_000)
answers = st.lists(st.tuples(prompt_bytes, reports), max_size=40)


def _run(history: list[tuple[int | None, Report]]) -> list[Estimates]:
    est = Estimates()
    seen = [est]
    for size, report in history:
        est = learn(est, size, report)
        seen.append(est)
    return seen


@given(answers)
def test_learned_figures_stay_within_their_bounds(history: list[tuple[int | None, Report]]) -> None:
    for est in _run(history):
        if est.bytes_per_token is not None:
            assert BYTES_PER_TOKEN_RANGE[0] <= est.bytes_per_token <= BYTES_PER_TOKEN_RANGE[1]
        if est.decode_cost is not None:
            assert DECODE_COST_RANGE[0] <= est.decode_cost <= DECODE_COST_RANGE[1]
        if est.output_tokens is not None:
            completions = [
                r.completion_tokens for _, r in history if r.completion_tokens is not None
            ]
            assert min(completions) - 1e-6 <= est.output_tokens <= max(completions) + 1e-6


@given(answers)
def test_a_figure_is_unknown_until_a_report_carries_it(
    history: list[tuple[int | None, Report]],
) -> None:
    """None is unknown: never turned into 0 or a default on the way, and never learned
    from a report without the figure."""
    est = _run(history)[-1]
    if all(r.completion_tokens is None for _, r in history):
        assert est.output_tokens is None
    if all(size is None or not r.prompt_tokens for size, r in history):
        assert est.bytes_per_token is None
    if all(not (r.prompt_ms_per_token and r.output_ms_per_token) for _, r in history):
        assert est.decode_cost is None


@given(st.lists(reports, max_size=20), reports)
def test_a_known_figure_stays_known(history: list[Report], report: Report) -> None:
    est = _run([(1000, r) for r in history])[-1]
    after = learn(est, 1000, report)
    for name in ("bytes_per_token", "output_tokens", "decode_cost"):
        if getattr(est, name) is not None:
            assert getattr(after, name) is not None


@given(
    st.floats(min_value=0.1, max_value=10_000),
    st.floats(min_value=0.1, max_value=10_000),
    st.floats(min_value=0.01, max_value=100),
)
def test_the_decode_cost_is_a_lower_envelope(old: float, ratio: float, per_prompt: float) -> None:
    """A reading below the estimate is taken at once; one above moves it 2 % of the way."""
    est = Estimates(decode_cost=old)
    report = Report(
        prompt_ms_per_token=per_prompt, output_ms_per_token=ratio * per_prompt, prompt_n=256
    )
    got = learn(est, None, report).decode_cost
    assert got is not None
    reading = (ratio * per_prompt) / per_prompt
    if not DECODE_COST_RANGE[0] <= reading <= DECODE_COST_RANGE[1]:
        assert got == old
    elif reading < old:
        assert got == reading
    else:
        assert math.isclose(got, old + 0.02 * (reading - old), rel_tol=1e-9)
        assert old <= got <= reading


@given(reports, st.integers(min_value=0, max_value=255))
def test_a_handful_of_computed_tokens_teaches_no_decode_cost(report: Report, n: int) -> None:
    got = learn(Estimates(), None, attrs.evolve(report, prompt_n=n))
    assert got.decode_cost is None


@given(st.integers(min_value=1, max_value=10_000_000), st.integers(min_value=0, max_value=15))
def test_a_short_prompt_teaches_no_bytes_per_token(size: int, tokens: int) -> None:
    got = learn(Estimates(), size, Report(prompt_tokens=tokens))
    assert got.bytes_per_token is None


@given(reports)
def test_a_report_that_teaches_nothing_gives_the_same_estimates(report: Report) -> None:
    est = Estimates(bytes_per_token=3.5, output_tokens=100.0, decode_cost=6.0)
    bare = Report(prompt_tokens=report.prompt_tokens)  # with no prompt, teaches nothing
    assert learn(est, None, bare) is est


@given(
    st.builds(
        Estimates,
        bytes_per_token=st.none() | st.floats(min_value=0.05, max_value=64),
        output_tokens=st.none() | st.floats(min_value=0, max_value=100_000),
        decode_cost=st.none() | st.floats(min_value=0.1, max_value=10_000),
    ),
    st.none() | st.integers(min_value=0, max_value=10_000_000),
    st.none() | st.integers(min_value=1, max_value=100_000),
)
def test_the_request_estimate(est: Estimates, size: int | None, max_tokens: int | None) -> None:
    req = est.request(size, max_tokens)
    typical = DEFAULT_OUTPUT_TOKENS if est.output_tokens is None else est.output_tokens
    assert req.unit >= 1.0
    if size is None:  # a route with no prompt: its output alone, at the scorer's default
        assert (req.prompt_tokens, req.output_tokens, req.decode_cost) == (0.0, typical, 4.0)
        return
    assert req.prompt_tokens == size / (est.bytes_per_token or DEFAULT_BYTES_PER_TOKEN)
    assert req.decode_cost == (est.decode_cost or DEFAULT_DECODE_COST)
    assert req.output_tokens == (typical if max_tokens is None else min(max_tokens, typical))
    assert est.tokens_per_block(256) == 256 / (est.bytes_per_token or DEFAULT_BYTES_PER_TOKEN)


def test_before_any_report_the_defaults_stand() -> None:
    req = Estimates().request(4000, None)
    assert (req.prompt_tokens, req.output_tokens, req.decode_cost) == (1000.0, 64.0, 4.0)


def test_a_reading_moves_the_average_a_tenth_of_the_way() -> None:
    est = learn(Estimates(), 4000, Report(prompt_tokens=1000, completion_tokens=10))
    assert (est.bytes_per_token, est.output_tokens) == (4.0, 10.0)  # the first stands alone
    est = learn(est, 3000, Report(prompt_tokens=1000, completion_tokens=110))
    assert est.bytes_per_token is not None and math.isclose(est.bytes_per_token, 3.9)
    assert est.output_tokens == 20.0


# --- what the wedge threshold reads (llmgw/core/_wedge.py) -------------------------------


def test_the_prefill_rate_is_llama_cpps_own_read_only_from_long_prefills() -> None:
    from llmgw.core._estimates import MIN_COMPUTED_TOKENS

    short = learn(Estimates(), None, Report(prompt_ms_per_token=2.0, prompt_n=10))
    assert short.prompt_ms_per_token is None
    est = learn(Estimates(), None, Report(prompt_ms_per_token=2.0, prompt_n=MIN_COMPUTED_TOKENS))
    assert est.prompt_ms_per_token == 2.0
    est = learn(est, None, Report(prompt_ms_per_token=12.0, prompt_n=1000))
    assert est.prompt_ms_per_token == 3.0  # moving average, weight 0.1
    # 5,000 uncached prompt tokens at 3 ms each, streamed: 15 s before the first byte.
    assert est.first_byte_s(5000, 100, whole=False) == 15.0
    assert Estimates().first_byte_s(5000, 100, whole=False) is None  # unknown: no raise


def test_a_whole_answers_pace_is_the_routers_own_measure() -> None:
    from llmgw.core import learn_pace

    assert learn_pace(Estimates(), 4.0, 4) == Estimates()  # under 8 tokens: nothing
    assert learn_pace(Estimates(), 4.0, None) == Estimates()
    est = learn_pace(Estimates(), 4.0, 100)
    assert est.answer_s_per_token == 0.04
    # Not streamed, nothing comes before the whole answer: prefill (unknown: 0) + output.
    assert est.first_byte_s(5000, 200, whole=True) == 8.0
    assert est.first_byte_s(5000, 200, whole=False) is None
