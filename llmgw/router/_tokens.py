"""What an answer says of its tokens, in each API's words: the prompt and completion
counts of a body or a stream (`usage`, `StreamUsage`; llama-server's `timings` among
them), and the prompt-cache and pace figures the router learns from (`cache_report`).

Pure: byte patterns over bodies and stream events, no JSON parse of the whole.
"""

from __future__ import annotations

import re

import attrs

# --- the counts --------------------------------------------------------------------------

# OpenAI's chat and completions say prompt/completion; Responses and Anthropic's
# Messages say input/output. The quote before the name keeps
# `cache_read_input_tokens` out, and escaped text (`\"prompt_tokens\"`) never matches.
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')


# llama-server's `timings`: the prompt tokens served from its cache and computed, and the
# tokens generated (server-task.cpp `result_timings::to_json`).
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d+)')
_PROMPT_N_TOKENS = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_PREDICTED_N = re.compile(rb'"predicted_n"\s*:\s*(\d+)')


def timings_usage(data: bytes) -> tuple[int | None, int | None]:
    """The prompt and completion token counts in llama-server's `timings` (the last
    event of every chat stream, asked or not): `cache_n + prompt_n` and `predicted_n`
    (None: not said; a build without `cache_n` says only the uncached part, so its
    prompt is not known)."""
    pos = data.find(b'"timings"')
    if pos < 0:
        return None, None
    cache_n = _CACHE_N.search(data, pos)
    prompt_n = _PROMPT_N_TOKENS.search(data, pos)
    predicted = _PREDICTED_N.search(data, pos)
    return (
        int(cache_n.group(1)) + int(prompt_n.group(1))
        if cache_n is not None and prompt_n is not None
        else None,
        int(predicted.group(1)) if predicted is not None else None,
    )


def usage(data: bytes) -> tuple[int | None, int | None]:
    """The prompt and completion token counts from the first `"usage"` on: the first
    prompt count and the last completion count (None: not said)."""
    pos = data.find(b'"usage"')
    if pos < 0:
        return None, None
    prompt = _PROMPT_TOKENS.search(data, pos)
    completions = _COMPLETION_TOKENS.findall(data, pos)
    return (
        int(prompt.group(1)) if prompt is not None else None,
        int(completions[-1]) if completions else None,
    )


class StreamUsage:
    """What a stream's usage events add to the token counters as they pass.

    The prompt is counted once. Completion counts in a stream are cumulative
    (Anthropic's message_start says 0 and its message_delta the total; vLLM's
    continuous usage stats repeat it in every chunk; llama-server's `timings` with
    `timings_per_token` too), so each adds what it grew by. A chunk with a `usage`
    is read for it; one without, for llama-server's `timings`.
    """

    __slots__ = ("completion", "prompt")

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.completion: int | None = None

    def add(self, chunk: bytes) -> tuple[int | None, int | None]:
        """What `chunk` adds: its `usage`, else llama-server's `timings`."""
        prompt, completion = usage(chunk)
        if prompt is None and completion is None:
            prompt, completion = timings_usage(chunk)
        if self.prompt is not None:
            prompt = None
        elif prompt is not None:
            self.prompt = prompt
        if completion is not None:
            if self.completion is None or completion > self.completion:
                completion, self.completion = completion - (self.completion or 0), completion
            else:
                completion = None
        return prompt, completion


# --- the prompt cache and the pace ------------------------------------------------------


@attrs.frozen
class CacheReport:
    """What an engine said about one answer's prompt: absent figures are None."""

    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    prompt_ms_per_token: float | None  # llama.cpp's timings
    output_ms_per_token: float | None
    prompt_n: int | None  # llama.cpp: the prompt tokens it computed (the uncached part)


_CACHED_TOKENS = re.compile(rb'"(?:cached_tokens|cache_read_input_tokens|cache_n)"\s*:\s*(\d+)')
_NUMBER = rb"\s*:\s*(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
_PROMPT_PER_TOKEN = re.compile(rb'"prompt_per_token_ms"' + _NUMBER)
_OUTPUT_PER_TOKEN = re.compile(rb'"predicted_per_token_ms"' + _NUMBER)


def cache_report(data: bytes) -> CacheReport | None:
    """The prompt-cache figures in a body or a stream's last events; None when there are none.

    OpenAI's shape (`usage.prompt_tokens_details.cached_tokens`: llama.cpp, vLLM
    with --enable-prompt-tokens-details, SGLang with --enable-cache-report), Anthropic's
    (`cache_read_input_tokens`) and llama.cpp's `timings` (`cache_n`).
    """
    pos = data.find(b'"usage"')
    tpos = data.find(b'"timings"')
    if pos < 0 and tpos < 0:
        return None
    start = min(p for p in (pos, tpos) if p >= 0)
    prompt, completion = usage(data) if pos >= 0 else (None, None)
    if prompt is None and completion is None and tpos >= 0:
        prompt, completion = timings_usage(data)  # llama-server's stream, not asked for usage
    cached = _CACHED_TOKENS.search(data, start)
    ppt = _PROMPT_PER_TOKEN.search(data, start)
    opt = _OUTPUT_PER_TOKEN.search(data, start)
    prompt_n = _PROMPT_N_TOKENS.search(data, start)
    return CacheReport(
        prompt_tokens=prompt,
        cached_tokens=int(cached.group(1)) if cached is not None else None,
        completion_tokens=completion,
        prompt_ms_per_token=float(ppt.group(1)) if ppt is not None else None,
        output_ms_per_token=float(opt.group(1)) if opt is not None else None,
        prompt_n=int(prompt_n.group(1)) if prompt_n is not None else None,
    )
