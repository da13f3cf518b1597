"""How a streamed answer's tokens are counted on each engine, without changing the stream.

The router counts every answer's tokens for its tenant. A whole answer says them
(`usage`); an OpenAI-shaped stream says them only when the request sets
`stream_options.include_usage`, which changes the stream the client reads. So
the router asks for that only where the engine says nothing otherwise, and then
takes out exactly what asking added (llmgw/router/_metering.py). Facts from the
engines' own source:

- llama-server ends every chat stream's last event with `timings` (`cache_n`,
  `prompt_n`, `predicted_n`), asked or not (`to_json_oaicompat_chat_stream`:
  `if (timings.prompt_n >= 0) deltas.back().push_back({"timings", ...})`), and
  its `/v1/completions` stream has `usage` in its last choice's event unasked
  (tests/data/llama-server-*-stream-*.sse). Asking would move `timings` into a
  separate usage-only event, out of the client's reach. Nothing is asked.
- vLLM says nothing unasked. Asked, it adds a usage-only event
  (`"choices":[]`) before `[DONE]`; its chat chunks are dumped with
  `exclude_unset`, and vLLM 0.5.3 to 0.6 set `chunk.usage = None` on every
  other chat chunk when asked (vllm-project/vllm#6652), which puts
  `"usage":null` into each of them. Its completions chunks are dumped with
  every field, `"usage":null` included, asked or not: those stay.
- SGLang says nothing unasked; asked, it adds the usage-only event. Its other
  chunks carry usage only with `continuous_usage_stats`, asked or not.

Server-side switches exist (vLLM `--enable-force-include-usage`, SGLang's
default-include-usage setting) but do not help: they make the engine send the
usage event to every client, which the router would have to take out just the
same, and vLLM's has changed meaning between releases (some apply it only to
requests that carry `stream_options`, so a request without would go
uncounted). Asking per request counts every request on every version.
"""

from __future__ import annotations

import attrs

# The routes whose streams carry usage only when asked (OpenAI's chat and completions).
METERED_STREAM_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})

# Engines whose streams say their tokens unasked (see the module docstring).
_SAYS_UNASKED = frozenset({"llama-server"})
# Engines whose chat chunks get `"usage":null` when the usage event is asked for.
_NULL_WHEN_ASKED = frozenset({"vllm"})


@attrs.frozen
class StreamMetering:
    """How one engine's stream on one route is counted."""

    ask: bool  # ask for the usage event on the client's behalf (and take it out again)
    nulls: bool  # asking also put `"usage":null` into the other chunks: take those out too


_READS = StreamMetering(ask=False, nulls=False)
_ASKS = StreamMetering(ask=True, nulls=False)
_ASKS_NULLS = StreamMetering(ask=True, nulls=True)


def stream_metering(engine: str, path: str) -> StreamMetering:
    """How a streamed answer to `path` from `engine` is counted, for a client that did
    not ask for the usage event itself. An engine not known here is asked (the only
    way an OpenAI-shaped stream is sure to say its tokens)."""
    if path not in METERED_STREAM_ROUTES or engine in _SAYS_UNASKED:
        return _READS
    if engine in _NULL_WHEN_ASKED and path == "/v1/chat/completions":
        return _ASKS_NULLS
    return _ASKS
