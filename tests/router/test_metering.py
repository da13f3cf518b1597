"""Taking out exactly what asking for a stream's usage event added (pure: bytes in, bytes out).

Recorded streams (tests/data, INDEX.md sections 10 and 13) and hypothesis-made ones in
vLLM's shapes: an engine's stream asked for usage, stripped, is byte for byte the stream
it sends unasked, however the bytes are cut; a stream asking added nothing to passes
unchanged."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from helpers import FIXTURES
from hypothesis import assume, given
from hypothesis import strategies as st

from llmgw.router._metering import UsageStrip, ask_usage, strip_events
from llmgw.router._tokens import StreamUsage, cache_report, timings_usage

VLLM_ASKED = (FIXTURES / "vllm-chat-stream-include-usage.sse").read_bytes()
VLLM_NOT_ASKED = (FIXTURES / "vllm-chat-stream-no-usage.sse").read_bytes()
LLAMA_ASKED = (FIXTURES / "llama-server-chat-stream-include-usage.sse").read_bytes()
LLAMA_NOT_ASKED = (FIXTURES / "llama-server-chat-stream-no-usage.sse").read_bytes()
LLAMA_COMPLETIONS = (FIXTURES / "llama-server-completions-stream-no-usage.sse").read_bytes()


def strip_all(data: bytes, sizes: Iterable[int], *, nulls: bool) -> tuple[bytes, bytes]:
    """The stream fed in pieces of `sizes` (then the rest): (out, taken out)."""
    strip = UsageStrip(nulls=nulls)
    out, removed, pos = [], [], 0
    for n in sizes:
        o, r = strip.feed(data[pos : pos + n])
        out.append(o)
        removed.append(r)
        pos += n
    o, r = strip.feed(data[pos:])
    return b"".join(out) + o + strip.end(), b"".join(removed) + r


# --- asking -------------------------------------------------------------------------------


def test_usage_is_asked_only_for_streams_that_did_not_ask() -> None:
    chat: dict[str, Any] = {"model": "m", "messages": [], "stream": True}
    asked = ask_usage("/v1/chat/completions", chat)
    assert asked is not None
    assert json.loads(asked) == {**chat, "stream_options": {"include_usage": True}}
    other = {**chat, "stream_options": {"include_usage": False, "x": 1}}
    assert json.loads(ask_usage("/v1/completions", other) or b"") == {
        **chat,
        "stream_options": {"include_usage": True, "x": 1},
    }
    yes = {**chat, "stream_options": {"include_usage": True}}
    assert ask_usage("/v1/chat/completions", yes) is None  # it asked: the body as it came
    assert ask_usage("/v1/chat/completions", {**chat, "stream": False}) is None
    assert ask_usage("/v1/messages", chat) is None  # Anthropic's stream always says
    assert ask_usage("/v1/chat/completions", {**chat, "stream_options": "x"}) is None


# --- the recorded streams ----------------------------------------------------------------


def test_vllms_asked_stream_stripped_is_its_unasked_stream_byte_for_byte() -> None:
    out, removed = strip_all(VLLM_ASKED, [], nulls=True)
    assert out == VLLM_NOT_ASKED
    assert json.loads(removed.removeprefix(b"data: "))["usage"] == {
        "prompt_tokens": 20,
        "total_tokens": 26,
        "completion_tokens": 6,
    }
    # Without `nulls` only the usage event goes: the null members stay (SGLang's case).
    kept, _ = strip_all(VLLM_ASKED, [], nulls=False)
    assert kept.count(b',"usage":null}') == 7 and b'"choices":[]' not in kept


def test_llama_servers_usage_event_is_the_only_event_taken_out() -> None:
    out, removed = strip_all(LLAMA_ASKED, [], nulls=False)
    events = [e for e in LLAMA_ASKED.split(b"\n\n") if e]
    assert out == b"".join(e + b"\n\n" for e in events if b'"choices":[]' not in e)
    assert b'"timings"' in removed  # asked, llama-server moved its timings there:
    assert b'"timings"' not in out  # why llama-server is never asked
    # Streams with nothing asking added pass unchanged, with or without `nulls`.
    for stream in (LLAMA_NOT_ASKED, LLAMA_COMPLETIONS, VLLM_NOT_ASKED):
        for nulls in (False, True):
            assert strip_all(stream, [], nulls=nulls) == (stream, b"")


@given(st.data())
def test_the_strip_is_the_same_however_the_stream_is_cut(data: st.DataObject) -> None:
    stream = data.draw(
        st.sampled_from(
            [VLLM_ASKED, LLAMA_ASKED, LLAMA_COMPLETIONS, VLLM_ASKED.replace(b"\n\n", b"\r\n\r\n")]
        )
    )
    sizes = data.draw(st.lists(st.integers(0, 300), max_size=40))
    assert strip_all(stream, sizes, nulls=True) == strip_all(stream, [], nulls=True)


def test_a_blank_line_before_the_usage_event_passes_however_the_stream_is_cut() -> None:
    """Found by fuzz/targets.py usage_strip: a stream with an extra blank line before
    its usage event. Whole, the line went out with the event; in pieces that ended
    before the event, it was passed on. It is the stream's: it passes on both ways."""
    usage = LLAMA_ASKED.rindex(b"data: ", 0, LLAMA_ASKED.index(b'"choices":[]'))
    stream = LLAMA_ASKED[:usage] + b"\n" + LLAMA_ASKED[usage:]
    whole = strip_all(stream, [], nulls=False)
    for cut in range(usage - 2, usage + 3):
        assert strip_all(stream, [cut], nulls=False) == whole, cut
    assert whole[0].endswith(b"\n\n\n") or b"\n\n\n" in whole[0]
    assert whole[1].startswith(b"data: ")


def test_the_strip_fed_byte_by_byte() -> None:
    assert strip_all(VLLM_ASKED, [1] * len(VLLM_ASKED), nulls=True) == (
        VLLM_NOT_ASKED,
        strip_all(VLLM_ASKED, [], nulls=True)[1],
    )


# --- hypothesis-made streams in vLLM's shapes ---------------------------------------------

# Text that looks like what is being removed, inside JSON strings (escaped there).
TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(['"usage":null', ',"usage":null}', '"choices":[]', "\n\ndata: ", "usage"]),
)


def dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


@st.composite
def vllm_chat(draw: st.DrawFn) -> tuple[bytes, bytes, bool]:
    """(the stream unasked, the same asked, whether asking nulls the chunks' usage),
    serialized as vLLM does: members in model order, `usage` last."""
    head = {"id": "chatcmpl-" + draw(st.text("0123456789abcdef", min_size=1, max_size=8))}
    head.update(object="chat.completion.chunk", created=draw(st.integers(0, 2**31)), model="m")
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    for text in draw(st.lists(TEXT, max_size=6)):
        chunks.append({**head, "choices": [{"index": 0, "delta": {"content": text}}]})
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    nulls = draw(st.booleans())  # vLLM 0.5.3-0.6 (True) or later (False)
    sep = draw(st.sampled_from([b"\n\n", b"\r\n\r\n"]))
    usage = {"prompt_tokens": 3, "total_tokens": 3 + len(chunks), "completion_tokens": len(chunks)}
    plain = b"".join(b"data: " + dumps(c) + sep for c in chunks) + b"data: [DONE]" + sep
    asked = b"".join(b"data: " + dumps({**c, "usage": None} if nulls else c) + sep for c in chunks)
    asked += b"data: " + dumps({**head, "choices": [], "usage": usage}) + sep
    asked += b"data: [DONE]" + sep
    return plain, asked, nulls


@given(vllm_chat(), st.lists(st.integers(0, 200), max_size=30))
def test_any_vllm_chat_stream_asked_and_stripped_is_the_unasked_stream(
    streams: tuple[bytes, bytes, bool], sizes: list[int]
) -> None:
    plain, asked, _ = streams
    out, removed = strip_all(asked, sizes, nulls=True)
    assert out == plain
    assert json.loads(removed.strip().removeprefix(b"data: "))["choices"] == []
    # What was not asked passes as it is.
    assert strip_all(plain, sizes, nulls=True) == (plain, b"")


@given(vllm_chat())
def test_a_native_usage_null_stays_where_asking_did_not_put_it(
    streams: tuple[bytes, bytes, bool],
) -> None:
    # vLLM's completions chunks carry `"usage":null` asked or not: `nulls` is off there,
    # and a stream with them but no usage event (as sent unasked) passes unchanged.
    _, asked, nulls = streams
    assume(nulls)
    sep = b"\r\n\r\n" if b"\r\n\r\n" in asked else b"\n\n"
    native = b"".join(e + sep for e in asked.split(sep) if e and b'"choices":[]' not in e)
    assert native.count(b'"usage":null') >= 2
    assert strip_all(native, [], nulls=False) == (native, b"")


def test_a_null_member_anywhere_in_the_chunk_goes_with_one_comma() -> None:
    first = b'data: {"usage":null,"id":"x","choices":[]}\n\n'
    assert strip_events(first, True)[0] == b'data: {"id":"x","choices":[]}\n\n'
    middle = b'data: {"id":"x", "usage" : null ,"choices":[1]}\n\n'
    assert strip_events(middle, True)[0] == b'data: {"id":"x" ,"choices":[1]}\n\n'
    only = b'data: {"usage":null}\n\n'
    assert strip_events(only, True)[0] == b"data: {}\n\n"
    # A nested usage, or two: left alone (not told apart without a full parse).
    nested = b'data: {"id":"x","choices":[{"usage":null}]}\n\n'
    assert strip_events(nested, True) == (nested, b"")
    # Text that only looks like one is escaped in JSON, so never matched.
    text = dumps({"choices": [{"delta": {"content": '"usage":null'}}]}) + b"\n\n"
    assert strip_events(b"data: " + text, True) == (b"data: " + text, b"")


# --- reading llama-server's timings -------------------------------------------------------


def test_llama_servers_unasked_stream_is_counted_from_its_timings() -> None:
    # Recorded: the same request asked says usage 25 prompt (24 cached), 3 completion;
    # unasked, `timings` says cache_n + prompt_n and predicted_n.
    assert timings_usage(LLAMA_NOT_ASKED) == (0 + 25, 3)
    asked_usage = json.loads(LLAMA_ASKED.split(b"\n\n")[-3].removeprefix(b"data: "))["usage"]
    tally = StreamUsage()
    for event in LLAMA_NOT_ASKED.split(b"\n\n"):
        tally.add(event)
    assert (tally.prompt, tally.completion) == (25, 3)
    assert (asked_usage["prompt_tokens"], asked_usage["completion_tokens"]) == (25, 3)
    # A chunk with usage is read for it, not its timings (they agree when both are there).
    assert timings_usage(LLAMA_ASKED) == (24 + 1, 3)
    # The engine's report (what the estimates learn from) has the same counts.
    report = cache_report(LLAMA_NOT_ASKED)
    assert report is not None
    assert (report.prompt_tokens, report.cached_tokens, report.completion_tokens) == (25, 0, 3)
    assert report.prompt_n == 25 and report.prompt_ms_per_token is not None
    # A build without cache_n says only the uncached prompt: the prompt is not known.
    assert timings_usage(b'{"timings":{"prompt_n":4,"predicted_n":2}}') == (None, 2)
    assert timings_usage(b'{"choices":[]}') == (None, None)
