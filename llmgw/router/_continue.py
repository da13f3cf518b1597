"""Splicing a cut stream with its continuation, so the client reads one answer.

A `Join` watches a continuable stream's events as they go to the client
(`sent`), keeping what the continuation needs: the text so far, the tokens
it took (one per text-bearing event, llmgw/core/_continuation.py), the
stream's id, created and model, and whether the engine ever streamed anything
that is not plain text (reasoning, tool calls: those cannot be extended as
text). After a cut, `body(engine)` is the request for another replica (or the
refusal), and the continued stream's events go through `rewrite`: its chunks
take the first stream's id, created, model and fingerprint; its opening
role-only delta is dropped (the client had one already), and so is the prefill
an engine repeats at the start of its text (llama-server does); its usage is the
whole answer's (the text so far counted as completion, not prompt; the total
is the engine's). Its one finish_reason and one `[DONE]` end the answer.

Events are passed on whole (an event cut short at the break never reaches the
client), so the text the client was sent is exactly what the join extends.
No I/O here: bytes in, bytes out.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.core import ContinuationRefusal, ResumePlan, continuation_body, prefill_echo
from llmgw.router._tokens import StreamUsage

_R = ContinuationRefusal
_MAX_HELD = 1 << 20  # an event longer than this: given up on (the stream is not joinable)
_STREAM_KEYS = ("id", "created", "model", "system_fingerprint")
_TOOL_KEYS = frozenset({"tool_calls", "function_call"})


def _split(data: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events (each with its blank line) and the incomplete rest."""
    events: list[bytes] = []
    start = 0
    while True:
        lf = data.find(b"\n\n", start)
        crlf = data.find(b"\r\n\r\n", start)
        ends = [e for e in (lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1) if e >= 0]
        if not ends:
            return events, data[start:]
        end = min(ends)
        events.append(data[start:end])
        start = end


def _data(event: bytes) -> bytes | None:
    lines = [ln[5:].lstrip(b" ") for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"".join(lines) if lines else None


class Join:
    """One continuable stream: what was sent, and how continued streams are spliced in."""

    __slots__ = (
        "_base",
        "_echo",
        "_echo_next",
        "_held",
        "_ids",
        "_pieces",
        "_plan",
        "broke",
        "continued",
        "finished",
        "tally",
        "tokens",
        "unjoinable",
    )

    def __init__(self, plan: ResumePlan) -> None:
        self._plan = plan
        self._held = b""
        self._ids: dict[str, Any] = {}
        self._base = 0  # tokens sent before the stream now relayed began
        self._echo_next = ""  # what the engine last asked will repeat of the text so far
        self._echo = ""  # what the continued stream now relayed is expected to repeat
        self._pieces: list[str] = []  # the text so far, as it came (joined when asked)
        self.tokens = 0
        self.finished = False  # a finish_reason went to the client
        self.unjoinable: _R | None = None  # what the engine streamed that is not text
        self.continued = 0  # continuations begun
        self.broke = ""  # how the last stream relayed broke (an upstream failure's phase)
        # The usage counted so far, across the streams: each adds what it grew by.
        self.tally = StreamUsage()

    def __repr__(self) -> str:
        return (
            f"<Join {self._plan.kind} tokens={self.tokens} continued={self.continued}"
            f" finished={self.finished} unjoinable={self.unjoinable}>"
        )

    @property
    def text(self) -> str:
        """The answer's text the client has been sent."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def feed(self, chunk: bytes) -> bytes:
        """A relayed stream's bytes, as whole events for the client: the first stream's
        unchanged, a continued one's rewritten (`rewrite`); both read for the join."""
        return self.rewrite(chunk) if self.continued else self.sent(chunk)

    def sent(self, chunk: bytes) -> bytes:
        """The first stream's bytes: whole events, passed on unchanged and read."""
        events = self._whole(chunk)
        for event in events:
            payload = _data(event)
            if payload is not None and payload != b"[DONE]":
                self._read(payload)
        return b"".join(events)

    def rest(self) -> bytes:
        """What is held when a stream ends (an event cut short is passed on as it is)."""
        held, self._held = self._held, b""
        return held

    def refusal(self) -> _R | None:
        """Why the answer cannot be continued now (None: it can)."""
        if self._plan.refusal is not None:
            return self._plan.refusal
        if self.unjoinable is not None:
            return self.unjoinable
        if self.finished:
            return _R.FINISHED
        return None

    def body(self, engine: str) -> bytes | ContinuationRefusal:
        """The continuation request for a replica running `engine`."""
        body = continuation_body(self._plan, engine, self.text, self.tokens)
        if isinstance(body, ContinuationRefusal):
            return body
        self._echo_next = prefill_echo(self._plan, engine, self.text)
        return json.dumps(body, separators=(",", ":")).encode()

    def begin(self) -> None:
        """A continued stream is about to be relayed: nothing of a cut one is kept."""
        self._held = b""
        self._base = self.tokens
        self._echo, self._echo_next = self._echo_next, ""
        self.continued += 1

    def rewrite(self, chunk: bytes) -> bytes:
        """A continued stream's bytes, as the one stream the client is reading."""
        out: list[bytes] = []
        for event in self._whole(chunk):
            payload = _data(event)
            if payload is None or payload == b"[DONE]":
                out.append(event)
                continue
            try:
                doc = json.loads(payload)
            except ValueError:
                out.append(event)
                continue
            if not isinstance(doc, dict) or "choices" not in doc:
                out.append(event)  # an engine's error event: the client's to read
                continue
            if not self._splice(doc):
                continue
            self._read_doc(doc)
            out.append(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(out)

    # --- reading -----------------------------------------------------------------------

    def _whole(self, chunk: bytes) -> list[bytes]:
        data = self._held + chunk if self._held else chunk
        events, self._held = _split(data)
        if len(self._held) > _MAX_HELD:
            events.append(self._held)
            self._held = b""
            self.unjoinable = _R.EVENT
        return events

    def _read(self, payload: bytes) -> None:
        try:
            doc = json.loads(payload)
        except ValueError:
            self.unjoinable = _R.EVENT
            return
        if isinstance(doc, dict):
            self._read_doc(doc)

    def _read_doc(self, doc: dict[str, Any]) -> None:
        if not self._ids:
            self._ids = {k: doc[k] for k in _STREAM_KEYS if k in doc}
        choices = doc.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.unjoinable = _R.N
                continue
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self._plan.kind == "completions":
                text = choice.get("text")
            else:
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    continue
                for key, value in delta.items():
                    if key not in ("role", "content") and value not in (None, "", []):
                        # Not text to extend: a tool call's arguments, or a reasoning field.
                        self.unjoinable = _R.TOOLS if key in _TOOL_KEYS else _R.REASONING
                text = delta.get("content")
            if isinstance(text, str) and text:
                self._pieces.append(text)
                self.tokens += 1

    # --- splicing ----------------------------------------------------------------------

    def _splice(self, doc: dict[str, Any]) -> bool:
        """Make a continued chunk one of the first stream's; False: drop it."""
        for key in _STREAM_KEYS:
            if key in self._ids:
                doc[key] = self._ids[key]
            elif key in doc and key != "model":
                del doc[key]
        usage = doc.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                # The text so far was the continuation's prompt; it is the answer's.
                usage["prompt_tokens"] = max(0, prompt - self._base)
                usage["completion_tokens"] = completion + self._base
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices:
            return True
        keep = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason") is not None:
                keep = True
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                content = delta.get("content")
                if self._echo and isinstance(content, str) and content:
                    # The first text: the prefill repeated, then the engine's own. One
                    # that does not start with the whole prefill is not a repeat (an
                    # engine build that does not echo): passed on as it is.
                    if content.startswith(self._echo):
                        delta["content"] = content[len(self._echo) :]
                    self._echo = ""
                if any(v not in (None, "") for v in delta.values()):
                    keep = True
            elif choice.get("text"):
                keep = True
        return keep or isinstance(usage, dict)
