"""Asking an engine for a stream's usage event, and taking out exactly what that added.

Pure: bytes in, bytes out. Whether an engine is asked at all is the table in
llmgw/core/_metering.py (`stream_metering`): llama-server says its tokens
unasked and is never asked, so its stream reaches the client as it was sent.
Where the engine is asked on a client's behalf, what asking added is taken out
again (`UsageStrip`): the usage-only event (`"choices":[]` and a `usage`
object, before `[DONE]`), and, where the table says asking put them there, the
`"usage":null` keys of the other chunks. Every other byte passes unchanged, in
whole events; an event is parsed only when it has `"usage"` in it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw.core import METERED_STREAM_ROUTES

# An event held back while it is incomplete is given up on (passed on as it is) past this.
MAX_HELD_EVENT_BYTES = 1 << 20
_EVENT_END = re.compile(rb"(?<=\n\n)|(?<=\r\n\r\n)")
_USAGE = b'"usage"'
# A `usage` key: a JSON string followed by a colon is a key, and a quote inside a
# string is escaped (so a `"usage"` in text, or a string value "usage", never matches).
_USAGE_KEY = re.compile(rb'(?<!\\)"usage"\s*:')
# A `"usage":null` member with the comma that joins it to a neighbour.
_NULL_USAGE = re.compile(rb'(,\s*)?(?<!\\)"usage"\s*:\s*null(\s*,)?')


def ask_usage(path: str, request: dict[str, Any]) -> bytes | None:
    """The body that asks for the usage event when a streamed request did not
    (`stream_options.include_usage: true` added); None when there is nothing to ask
    (not a stream, not a metered route, or the client asked itself).

    A `stream_options` that is not an object is left for the engine to refuse.
    """
    if path not in METERED_STREAM_ROUTES or request.get("stream") is not True:
        return None
    options = request.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return None
    if options.get("include_usage") is True:
        return None
    asked = {**request, "stream_options": {**options, "include_usage": True}}
    return json.dumps(asked, separators=(",", ":")).encode()


def _data(event: bytes) -> bytes:
    return b"".join(
        line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")
    )


def _chunk(event: bytes) -> dict[str, Any] | None:
    try:
        chunk = json.loads(_data(event))
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


def _without_null_usage(event: bytes) -> bytes:
    """`event` without its chunk's top-level `"usage":null` member; unchanged when the
    chunk has no such member, or has more than one `usage` key (a nested one could not
    be told from the top-level one without a full parse)."""
    if len(_USAGE_KEY.findall(event)) != 1:
        return event
    m = _NULL_USAGE.search(event)
    if m is None:
        return event
    chunk = _chunk(event)
    if chunk is None or "usage" not in chunk or chunk["usage"] is not None:
        return event
    start, end = m.start(), m.end()
    if m.group(1) is not None and m.group(2) is not None:
        end -= len(m.group(2))  # between two members: one comma still joins them
    return event[:start] + event[end:]


def _usage_only(event: bytes) -> bool:
    """An SSE event whose data is a chunk with no choices and a usage object: the event
    `include_usage` adds (llama.cpp, vLLM, SGLang and OpenAI send it after the last choice)."""
    chunk = _chunk(event)
    return chunk is not None and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)


def strip_events(whole: bytes, nulls: bool) -> tuple[bytes, bytes]:
    """Whole SSE events, less what asking for usage added: (what the client gets, the
    usage events taken out). `nulls`: the other chunks' `"usage":null` go too."""
    if _USAGE not in whole:
        return whole, b""
    kept: list[bytes] = []
    removed: list[bytes] = []
    for event in _EVENT_END.split(whole):
        if not event or _USAGE not in event:
            kept.append(event)
        elif _usage_only(event):
            # Blank lines before it are the stream's, not the event's: they pass on, so
            # the output is the same whether the stream came whole or in pieces.
            body = event.lstrip(b"\r\n")
            kept.append(event[: len(event) - len(body)])
            removed.append(body)
        else:
            kept.append(_without_null_usage(event) if nulls else event)
    return b"".join(kept), b"".join(removed)


def _events_end(data: bytes) -> int:
    """Where the last whole SSE event in `data` ends (0: none ends in it)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class UsageStrip:
    """`strip_events` over a stream as it arrives: bytes are passed on in whole events
    (an incomplete one is held until its end arrives, or given up on past
    `MAX_HELD_EVENT_BYTES` and passed on as it is).

    Recorded from llama-server (tests/data/llama-server-chat-stream-*.sse), asked,
    its chat stream ends with a separate usage event (and `timings` moves there from
    the last choice's event), which is why llama-server is never asked; recorded
    vLLM shapes: tests/data/vllm-chat-stream-*.sse.
    """

    __slots__ = ("_held", "nulls")

    def __init__(self, *, nulls: bool) -> None:
        self._held = b""
        self.nulls = nulls

    def __repr__(self) -> str:
        return f"<UsageStrip nulls={self.nulls} held={len(self._held)}>"

    def feed(self, chunk: bytes) -> tuple[bytes, bytes]:
        """(what the client gets now, the usage events taken out)."""
        data = self._held + chunk if self._held else chunk
        end = _events_end(data)
        if end == 0:
            if len(data) > MAX_HELD_EVENT_BYTES:
                self._held = b""
                return data, b""
            self._held = data
            return b"", b""
        whole, self._held = data[:end], data[end:]
        return strip_events(whole, self.nulls)

    def end(self) -> bytes:
        """What is held when the stream ends (an event cut short: passed on as it is)."""
        held, self._held = self._held, b""
        return held
