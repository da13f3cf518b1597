"""What a model's answers teach the router about its next request: pure values.

Each served name keeps one `Estimates`; every answer whose engine reported
figures gives a new one (`learn`), and every request is priced from the current
one (`Estimates.request`) before an endpoint is chosen (llmgw/core/_scoring.py).

- `bytes_per_token`: the prompt rendering's bytes over the engine's
  `prompt_tokens`, a moving average (weight 0.1). Only prompts of 16 tokens
  or more are read, and only ratios within 0.05-64 (anything else is a report
  about another prompt than the one rendered). 4 until a reading.
- `output_tokens`: tokens per answer, a moving average (weight 0.1); a
  request's own `max_tokens` caps it. 64 until a reading.
- `decode_cost`: what one output token costs in prompt tokens, from
  llama.cpp's per-token timings (output ms per token over prompt ms per
  token), read only when the engine computed at least 256 prompt tokens (a
  handful is computed at a poor rate) and the ratio is within 0.1-10,000. It
  is their lower envelope: a reading below the estimate is taken at once, one
  above moves it 2 % of the way. An answer that shared the engine with
  another's prefill reads its tokens as about 10x dearer than they are
  (measured: 85 against 8 alone), and taken at face value that would make any
  busy endpoint look dear. 4 until a reading.

- `prompt_ms_per_token`: llama.cpp's own prefill rate (its timings'
  `prompt_per_token_ms`, read when it computed at least 256 prompt tokens), a
  moving average: how long a long prompt's prefill takes, which raises the
  wedge threshold for it (llmgw/core/_wedge.py). None for engines that report
  no timings.
- `answer_s_per_token`: the router's own measure of a whole (non-streamed)
  answer's time over its output tokens (`learn_pace`, answers of 8 tokens or
  more), a moving average: how long a non-streamed answer, which sends nothing
  until it is done, is expected to take.

None is unknown, and stays unknown until a reading comes: a figure is never
learned from a report that does not carry it.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from llmgw.core._scoring import RequestEstimate

DEFAULT_BYTES_PER_TOKEN = 4.0
DEFAULT_OUTPUT_TOKENS = 64.0
DEFAULT_DECODE_COST = 4.0
WEIGHT = 0.1
ENVELOPE_WEIGHT = 0.02  # how far a reading above the decode cost's envelope moves it
MIN_PROMPT_TOKENS = 16
BYTES_PER_TOKEN_RANGE = (0.05, 64.0)
MIN_COMPUTED_TOKENS = 256
MIN_PACE_TOKENS = 8
DECODE_COST_RANGE = (0.1, 10_000.0)


class EngineReport(Protocol):
    """What an engine said about one answer (llmgw/router/_surface.py's CacheReport)."""

    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def prompt_ms_per_token(self) -> float | None: ...
    @property
    def output_ms_per_token(self) -> float | None: ...
    @property
    def prompt_n(self) -> int | None: ...


def ewma(old: float | None, new: float, weight: float = WEIGHT) -> float:
    """A moving average; the first reading stands alone."""
    return new if old is None else old + weight * (new - old)


@attrs.frozen
class Estimates:
    """One model's learned figures (None: no reading yet, the default stands)."""

    bytes_per_token: float | None = None
    output_tokens: float | None = None
    decode_cost: float | None = None
    prompt_ms_per_token: float | None = None
    answer_s_per_token: float | None = None

    def first_byte_s(self, prompt_tokens: float, output_tokens: float, whole: bool) -> float | None:
        """How long the engine may take before its first byte, where it can be told:
        the prefill of `prompt_tokens` (uncached) at the learned rate, and for a `whole`
        (non-streamed) answer the `output_tokens` at the learned pace too; None: unknown."""
        prefill = (
            prompt_tokens * self.prompt_ms_per_token / 1000.0
            if self.prompt_ms_per_token is not None
            else None
        )
        if not whole:
            return prefill
        if self.answer_s_per_token is None:
            return prefill
        return (prefill or 0.0) + output_tokens * self.answer_s_per_token

    def request(self, prompt_bytes: int | None, max_tokens: int | None = None) -> RequestEstimate:
        """The estimate for a request whose prompt renders to `prompt_bytes` (None: a route
        with no prompt, priced by its output alone at the scorer's default decode cost)."""
        if prompt_bytes is None:
            return RequestEstimate(prompt_tokens=0.0, output_tokens=self.output(None))
        return RequestEstimate(
            prompt_tokens=prompt_bytes / (self.bytes_per_token or DEFAULT_BYTES_PER_TOKEN),
            output_tokens=self.output(max_tokens),
            decode_cost=self.decode_cost or DEFAULT_DECODE_COST,
        )

    def output(self, limit: int | None) -> float:
        """Expected output tokens, at most the request's own limit."""
        typical = self.output_tokens if self.output_tokens is not None else DEFAULT_OUTPUT_TOKENS
        return typical if limit is None else min(float(limit), typical)

    def tokens_per_block(self, block_bytes: int) -> float:
        """Prompt tokens in one prefix block of `block_bytes`."""
        return block_bytes / (self.bytes_per_token or DEFAULT_BYTES_PER_TOKEN)


def learn(estimates: Estimates, prompt_bytes: int | None, report: EngineReport) -> Estimates:
    """The estimates once `report` (about a prompt of `prompt_bytes`, None: no prompt) is
    counted; the same object when it taught nothing."""
    bytes_per_token, output_tokens, decode_cost, prompt_ms = (
        estimates.bytes_per_token,
        estimates.output_tokens,
        estimates.decode_cost,
        estimates.prompt_ms_per_token,
    )
    prompt_tokens = report.prompt_tokens
    if prompt_bytes is not None and prompt_tokens and prompt_tokens >= MIN_PROMPT_TOKENS:
        ratio = prompt_bytes / prompt_tokens
        if BYTES_PER_TOKEN_RANGE[0] <= ratio <= BYTES_PER_TOKEN_RANGE[1]:
            bytes_per_token = ewma(bytes_per_token, ratio)
    if report.completion_tokens is not None:
        output_tokens = ewma(output_tokens, float(report.completion_tokens))
    per_prompt, per_output = report.prompt_ms_per_token, report.output_ms_per_token
    if per_prompt and per_output and (report.prompt_n or 0) >= MIN_COMPUTED_TOKENS:
        ratio = per_output / per_prompt
        if DECODE_COST_RANGE[0] <= ratio <= DECODE_COST_RANGE[1]:
            old = decode_cost
            decode_cost = ratio if old is None or ratio < old else ewma(old, ratio, ENVELOPE_WEIGHT)
    if per_prompt and (report.prompt_n or 0) >= MIN_COMPUTED_TOKENS:
        prompt_ms = ewma(prompt_ms, per_prompt)
    if (bytes_per_token, output_tokens, decode_cost, prompt_ms) == (
        estimates.bytes_per_token,
        estimates.output_tokens,
        estimates.decode_cost,
        estimates.prompt_ms_per_token,
    ):
        return estimates
    return attrs.evolve(
        estimates,
        bytes_per_token=bytes_per_token,
        output_tokens=output_tokens,
        decode_cost=decode_cost,
        prompt_ms_per_token=prompt_ms,
    )


def learn_pace(estimates: Estimates, seconds: float, completion_tokens: int | None) -> Estimates:
    """The estimates once a whole answer of `completion_tokens` took `seconds` from send to
    its end (the router's clock); the same object when it taught nothing (under
    `MIN_PACE_TOKENS` tokens, or none reported)."""
    if completion_tokens is None or completion_tokens < MIN_PACE_TOKENS or seconds <= 0:
        return estimates
    pace = ewma(estimates.answer_s_per_token, seconds / completion_tokens)
    return attrs.evolve(estimates, answer_s_per_token=pace)
