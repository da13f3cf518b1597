"""Splicing a cut stream with its continuation (llmgw/router/_continue.py), fed with
llama-server's recorded streams (tests/data/llama-server-*.sse)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import ContinuationRefusal, resume_plan
from llmgw.router._continue import Join

DATA = Path(__file__).parent.parent / "data"
CHAT_SSE = (DATA / "llama-server-chat-stream-include-usage.sse").read_bytes()
COMPLETIONS_SSE = (DATA / "llama-server-completions-stream-no-usage.sse").read_bytes()
PREFILL_SSE = (DATA / "llama-server-chat-stream-prefill.sse").read_bytes()
CHAT = "/v1/chat/completions"


def events(data: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in data.split(b"\n\n") if e]


def chunks(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in events(data) if e.startswith(b"data: {")]


def join(path: str = CHAT, **extra: Any) -> Join:
    request = {"model": "tiny", "temperature": 0, "stream": True, "max_tokens": 8, **extra}
    request.setdefault("messages", [{"role": "user", "content": "hi"}])
    request.setdefault("prompt", "hi")
    return Join(resume_plan(path, request))


def test_the_first_stream_passes_unchanged_and_its_text_is_kept() -> None:
    j = join()
    cut = b"".join(events(CHAT_SSE)[:3])  # the role, " hello", " or"
    assert j.feed(cut) == cut
    assert (j.text, j.tokens, j.finished) == (" hello or", 2, False)
    assert j.refusal() is None
    body = json.loads(j.body("llama-server"))
    assert body["messages"][-1] == {"role": "assistant", "content": " hello or"}
    assert body["max_tokens"] == 6


def test_a_half_event_is_held_until_it_ends_and_never_read_as_sent() -> None:
    j = join()
    first = events(CHAT_SSE)[1]
    assert j.feed(first[:40]) == b""
    assert (j.text, j.tokens) == ("", 0)
    assert j.feed(first[40:]) == first
    assert j.text == " hello"


def test_a_continued_stream_becomes_the_first_ones() -> None:
    j = join()
    j.feed(b"".join(events(CHAT_SSE)[:3]))
    first_id = chunks(CHAT_SSE)[0]["id"]
    j.begin()
    other = CHAT_SSE.replace(first_id.encode(), b"chatcmpl-other").replace(
        b'"created":1796149249', b'"created":1796149999'
    )
    out = j.feed(other)
    got = chunks(out)
    assert {c["id"] for c in got} == {first_id}
    assert {c["created"] for c in got} == {1796149249}
    # The continuation's role-only opening is gone: the client had one.
    assert all("role" not in c["choices"][0]["delta"] for c in got if c["choices"])
    assert [c["choices"][0]["delta"].get("content") for c in got if c["choices"]] == [
        " hello",
        " or",
        "\ufffd",
        None,
    ]
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]].count("length") == 1
    # The usage is the whole answer's: the 2 tokens sent before were the continuation's
    # prompt (25) and are the answer's (3 + 2); the total is the engine's.
    assert got[-1]["usage"]["completion_tokens"] == 5
    assert got[-1]["usage"]["prompt_tokens"] == 23
    assert got[-1]["usage"]["total_tokens"] == 28
    assert out.endswith(b"data: [DONE]\n\n")
    assert j.text == " hello or hello or\ufffd" and j.tokens == 5 and j.finished


def test_a_completions_stream_joins_on_its_text() -> None:
    j = join("/v1/completions")
    j.feed(b"".join(events(COMPLETIONS_SSE)[:2]))
    assert (j.text, j.tokens) == ("N|", 2)
    body = json.loads(j.body("vllm"))
    assert body["prompt"] == "hiN|" and body["max_tokens"] == 6


def test_what_the_stream_shows_can_refuse_it() -> None:
    j = join()
    j.feed(CHAT_SSE)  # a finish went out: only the end was lost
    assert j.refusal() is ContinuationRefusal.FINISHED
    j = join()
    reasoning = {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}], "id": "x"}
    j.feed(b"data: " + json.dumps(reasoning).encode() + b"\n\n")
    assert j.refusal() is ContinuationRefusal.REASONING
    j = join()
    tool = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}], "id": "x"}
    j.feed(b"data: " + json.dumps(tool).encode() + b"\n\n")
    assert j.refusal() is ContinuationRefusal.TOOLS
    assert join(n=2).refusal() is ContinuationRefusal.N


@given(cuts=st.lists(st.integers(0, len(CHAT_SSE)), max_size=8))
def test_however_the_bytes_arrive_the_client_gets_the_same_events(cuts: list[int]) -> None:
    j = join()
    points = sorted(set(cuts))
    parts = [CHAT_SSE[a:b] for a, b in zip([0, *points], [*points, len(CHAT_SSE)], strict=True)]
    out = b"".join(j.feed(p) for p in parts) + j.rest()
    assert out == CHAT_SSE
    assert j.text == " hello or\ufffd" and j.tokens == 3


def test_llama_servers_repeated_prefill_is_taken_out() -> None:
    """Recorded: given the uninterrupted run's first two tokens as a prefill, llama-server
    starts its answer with them again and then writes the run's third token."""
    j = join()
    j.feed(b"".join(events(CHAT_SSE)[:3]))  # the role, " hello", " or": then the cut
    assert json.loads(j.body("llama-server"))["messages"][-1]["content"] == " hello or"
    j.begin()
    got = chunks(j.feed(PREFILL_SSE))
    contents = [c["choices"][0]["delta"].get("content") for c in got if c["choices"]]
    assert contents[0] == "\ufffd"  # the prefill taken out of " hello or\ufffd"
    uninterrupted = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks(CHAT_SSE) if c["choices"]
    )
    assert j.text.startswith(uninterrupted) and len(j.text) > len(uninterrupted)
    # An engine that does not repeat the prefill (vLLM): its first text is kept.
    j = join()
    j.feed(b"".join(events(CHAT_SSE)[:3]))
    j.body("vllm")
    j.begin()
    got = chunks(j.feed(PREFILL_SSE))
    assert next(c["choices"][0]["delta"].get("content") for c in got if c["choices"]) == (
        " hello or\ufffd"
    )
