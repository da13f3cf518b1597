"""The rest of the API surface: Responses, Anthropic's Messages, rerank, score, audio, tokenize.

Through the real router (lean listener and hypercorn) to scripted engines that
record what they were sent and answer with bytes the test chose, and to a
real llama-server, with the real `openai` and `anthropic` SDKs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import attrs
import h11
import httpx
import openai
import pytest
import trio
from helpers import llama_server_binary
from hypothesis import given
from hypothesis import strategies as st

from llmgw.router._surface import (
    ROUTES,
    HttpError,
    anthropic_type,
    api_key,
    error_body,
    form_fields,
    form_model,
    stream_error,
)
from llmgw.router._tokens import StreamUsage, usage
from llmgw.router._types import Endpoint
from llmgw.testing.cluster import free_port, wait_for
from router.conftest import SECRET_A, SECRET_LIMITED, SERVERS, sample, serve_router

AUTH = {"Authorization": f"Bearer {SECRET_A}"}


# --- the pure part ----------------------------------------------------------------------


def test_every_route_the_engines_serve_is_in_the_table() -> None:
    assert set(ROUTES) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/rerank",
        "/v2/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/tokenize",
        "/detokenize",
    }
    assert {p for p, r in ROUTES.items() if r.errors == "anthropic"} == {
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
    assert {p for p, r in ROUTES.items() if r.body == "form"} == {
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
    assert ROUTES["/v1/messages"].required == "messages"


def test_the_surface_is_pure() -> None:
    import ast

    import llmgw.router._surface as surface
    import llmgw.web.asgi as asgi

    def imports(module: Any) -> set[str]:
        names: set[str] = set()
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module or "")
        return {n if n.startswith("llmgw.") else n.split(".")[0] for n in names} - {"__future__"}

    # No trio, no sockets, no HTTP library: routes, parsing and error bodies only.
    # (array, itertools: the JSON nesting check in C; math: Retry-After's whole seconds;
    # llmgw.web.asgi: the HttpError it refines, itself of json and types only.)
    pure = {"array", "attrs", "collections", "itertools", "json", "math", "re", "typing"}
    assert imports(surface) == pure | {"llmgw.web.asgi"}
    assert imports(asgi) == {"collections", "json", "typing"}


def test_the_key_comes_from_bearer_or_x_api_key() -> None:
    assert api_key([(b"authorization", b"Bearer  k1 ")]) == "k1"
    assert api_key([(b"x-api-key", b"k2")]) == "k2"
    # Both sent: Bearer wins, whichever comes first.
    assert api_key([(b"x-api-key", b"k2"), (b"authorization", b"bearer k1")]) == "k1"
    assert api_key([(b"authorization", b"Basic eDp5"), (b"x-api-key", b"k2")]) == "k2"
    assert api_key([(b"authorization", b"Basic eDp5")]) is None
    assert api_key([(b"x-api-key", b"  ")]) is None
    assert api_key([]) is None


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_anthropic_error_types_by_status(status: int, kind: str) -> None:
    assert anthropic_type(status) == kind
    exc = HttpError(status, "it went wrong", type="whatever", code="c")
    assert error_body("anthropic", exc) == {
        "type": "error",
        "error": {"type": kind, "message": "it went wrong"},
    }
    assert error_body("openai", exc) == {
        "error": {"message": "it went wrong", "type": "whatever", "code": "c", "param": None}
    }
    # The same, as the event that ends a stream broken after its head was sent.
    event = stream_error("anthropic", "it went wrong", status=status, code="c")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ", 1)[1]) == error_body("anthropic", exc)


def test_token_usage_is_read_in_each_apis_words() -> None:
    chat = b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}'
    assert usage(chat) == (7, 3)
    responses = b'{"output":[],"usage":{"input_tokens":25,"input_tokens_details":{"cached_tokens":24},"output_tokens":4}}'
    assert usage(responses) == (25, 4)
    messages = (
        b'{"content":[],"usage":{"cache_read_input_tokens":24,"input_tokens":1,"output_tokens":5}}'
    )
    assert usage(messages) == (1, 5)
    # Text that quotes a field name is escaped in JSON: not a count.
    assert usage(b'{"text":"\\"usage\\": {\\"prompt_tokens\\": 9}"}') == (None, None)
    assert usage(b'{"usage":{"total_tokens":3}}') == (None, None)

    # Anthropic's stream: the prompt at message_start, the cumulative output at message_delta.
    tally = StreamUsage()
    assert tally.add(MESSAGE_EVENTS[0]) == (3, 0)
    assert tally.add(MESSAGE_EVENTS[-2]) == (None, 1)
    # vLLM's continuous usage: every chunk repeats the prompt and the total so far.
    tally = StreamUsage()
    chunks = [b'"usage":{"prompt_tokens":5,"completion_tokens":%d}' % n for n in (1, 2, 2, 4)]
    assert [tally.add(c) for c in chunks] == [(5, 1), (None, 1), (None, None), (None, 2)]


def _multipart(data: dict[str, str], audio: bytes = b"RIFF\x00\x01fake") -> tuple[bytes, bytes]:
    """A form as httpx (the openai SDK's transport) encodes it: (content-type, body)."""
    request = httpx.Request(
        "POST", "http://x/", data=data, files={"file": ("a.wav", audio, "audio/wav")}
    )
    return request.headers["content-type"].encode(), request.read()


def test_the_model_is_read_from_a_real_multipart_form() -> None:
    ctype, body = _multipart({"model": "whisper", "stream": "true", "language": "en"})
    assert form_model(body, ctype) == ("whisper", True)
    # The file part is skipped whatever it holds, even text that looks like a part.
    tricky = b'\r\nContent-Disposition: form-data; name="model"\r\n\r\nwrong\r\n'
    ctype, body = _multipart({"model": "whisper"}, audio=tricky * 3)
    assert form_model(body, ctype) == ("whisper", False)
    # The field after the file is found too; a quoted boundary is understood.
    quoted = b'multipart/form-data; boundary="b-1"'
    body = (
        b'--b-1\r\nContent-Disposition: form-data; name="file"; filename="m.wav"\r\n\r\n'
        b"\x00\x01\r\n--b-1\r\ncontent-disposition: form-data; name=model\r\n\r\nw2\r\n--b-1--\r\n"
    )
    assert form_model(body, quoted) == ("w2", False)


@pytest.mark.parametrize(
    ("ctype", "body", "says"),
    [
        (None, b"", "Content-Type must be multipart/form-data with a boundary (got none)"),
        (b"application/json", b"{}", "(got 'application/json')"),
        (b"multipart/form-data", b"", "has no boundary parameter"),
        (b"multipart/form-data; boundary=zz", b"--yy\r\n", "no part that starts with the boundary"),
        (b"multipart/form-data; boundary=zz", b"--zz\r\nname", "headers do not end"),
        (
            b"multipart/form-data; boundary=zz",
            b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm',
            "does not end with the boundary",
        ),
        (
            b"multipart/form-data; boundary=zz",
            b'--zz\r\nContent-Disposition: form-data; name="language"\r\n\r\nen\r\n--zz--',
            "model: required, a form field naming a served model",
        ),
        (
            b"multipart/form-data; boundary=zz",
            b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\n\xff\r\n--zz--',
            "the field 'model' is not UTF-8 text",
        ),
    ],
)
def test_a_bad_form_is_a_400_that_says_what_is_wrong(
    ctype: bytes | None, body: bytes, says: str
) -> None:
    with pytest.raises(HttpError) as err:
        form_model(body, ctype)
    assert err.value.status == 400 and err.value.code == "invalid_form"
    assert says in str(err.value)


def test_a_real_form_cut_at_every_length_parses_or_is_a_400() -> None:
    ctype, body = _multipart({"model": "whisper", "language": "en"}, audio=b"\x00" * 40)
    complete = 0
    for i in range(len(body) + 1):
        try:
            model, _ = form_model(body[:i], ctype)
        except HttpError as exc:
            assert exc.status == 400 and exc.code == "invalid_form"
        else:
            assert model == "whisper"  # never a truncated name
            complete += 1
    # A value only once the closing delimiter has come: a cut form is a 400, not a guess.
    closing = b"--" + ctype.split(b"boundary=")[1] + b"--"
    assert complete == len(body) - (body.rindex(closing) + len(closing)) + 1


@given(st.binary(max_size=300), st.sampled_from([b"zz", b"--", b"a\r\n"]))
def test_any_form_body_parses_or_is_a_400(body: bytes, boundary: bytes) -> None:
    ctype = b"multipart/form-data; boundary=" + boundary
    for data in (body, b"--" + boundary + b"\r\n" + body):
        try:
            fields = form_fields(data, ctype, frozenset({"model"}))
        except HttpError as exc:
            assert exc.status == 400
        else:
            assert set(fields) <= {"model"}


# --- scripted engines ---------------------------------------------------------------------


@attrs.define
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def _json_reply(status: int, body: bytes) -> list[bytes]:
    reason = {200: b"OK", 404: b"Not Found", 501: b"Not Implemented"}.get(status, b"X")
    return [
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (status, reason, len(body), body)
    ]


def _sse_reply(events: Sequence[bytes]) -> list[bytes]:
    """A chunked SSE answer, each piece its own chunk and its own write."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return [head, *(b"%x\r\n%s\r\n" % (len(e), e) for e in events), b"0\r\n\r\n"]


VLLM_404 = _json_reply(404, b'{"detail":"Not Found"}')
CUT = b"(the engine closes its connection here)"
HOLD = b"(the engine waits for its release here)"


@attrs.define
class Scripted:
    """An engine on loopback that answers each path with the bytes scripted for it
    (a vLLM-style 404 for the rest) and records every request."""

    script: dict[str, list[bytes]]
    seen: list[Seen] = attrs.field(factory=list)
    port: int = 0
    release: trio.Event = attrs.field(factory=trio.Event)  # what HOLD waits for

    def endpoint(self, model: str, engine: str = "vllm") -> Endpoint:
        return Endpoint(f"{model}@{self.port}", model, engine, "127.0.0.1", self.port, None)

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._connection, listeners)
            task_status.started()

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            request: h11.Request | None = None
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return
            assert request is not None
            path = request.target.decode()
            if request.method == b"GET" and path in ("/metrics", "/health"):
                await stream.send_all(_METRICS)  # the scraper's: no load known, healthy
                conn = _next_exchange(conn)
                continue
            self.seen.append(
                Seen(
                    request.method.decode(),
                    path,
                    {k.decode(): v.decode("latin-1") for k, v in request.headers},
                    body,
                )
            )
            for piece in self.script.get(path, VLLM_404):
                if piece is CUT:
                    await stream.aclose()
                    return
                if piece is HOLD:
                    await self.release.wait()
                    continue
                await stream.send_all(piece)
            conn = _next_exchange(conn)


_METRICS = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 0\r\n\r\n"


def _next_exchange(conn: h11.Connection) -> h11.Connection:
    # Raw bytes were written past h11: start the next exchange on a fresh state.
    fresh = h11.Connection(h11.SERVER)
    fresh.receive_data(conn.trailing_data[0])
    return fresh


@asynccontextmanager
async def scripted(*scripts: dict[str, list[bytes]]) -> AsyncIterator[list[Scripted]]:
    engines = [Scripted(dict(s)) for s in scripts]
    async with trio.open_nursery() as nursery:
        for e in engines:
            await nursery.start(e.serve)
        yield engines
        nursery.cancel_scope.cancel()


async def counted(r: Any, value: float, **labels: str) -> None:
    """Wait until `llmgw_router_requests_total{labels}` reaches `value`, then check it stays."""
    name = "llmgw_router_requests_total"
    with trio.move_on_after(10):
        while sample(r.metrics_text(), name, **labels) != value:
            await trio.sleep(0.01)
    assert sample(r.metrics_text(), name, **labels) == value


def _body(reply: list[bytes]) -> bytes:
    return b"".join(reply).split(b"\r\n\r\n", 1)[1]


@SERVERS
async def test_rerank_score_tokenize_and_detokenize_go_to_the_engine_serving_the_model(
    server: str,
) -> None:
    paths = [
        "/v1/rerank",
        "/v2/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/tokenize",
        "/detokenize",
    ]
    script_a = {p: _json_reply(200, b'{"engine":"a","path":"%s"}' % p.encode()) for p in paths}
    script_b = {p: _json_reply(200, b'{"engine":"b","path":"%s"}' % p.encode()) for p in paths}
    async with (
        scripted(script_a, script_b) as (a, b),
        serve_router([a.endpoint("rank-a"), b.endpoint("rank-b")], server=server) as r,
        httpx.AsyncClient(base_url=r.url, headers=AUTH, timeout=30) as h,
    ):
        for path in paths:
            for model, engine in (("rank-a", a), ("rank-b", b)):
                sent = json.dumps({"model": model, "query": "q", "documents": ["x", "é"]})
                resp = await h.post(
                    path, content=sent, headers={"content-type": "application/json"}
                )
                assert resp.status_code == 200, resp.text
                assert resp.content == _body(engine.script[path])
                last = engine.seen[-1]
                assert (last.method, last.path, last.body) == ("POST", path, sent.encode())
        assert a.paths() == paths and b.paths() == paths
        # Counted like chat: per model, by status (hypercorn may answer before the count).
        for model in ("rank-a", "rank-b"):
            await counted(r, 7.0, model=model, status="200")
        # The model is still needed, and said so.
        resp = await h.post("/tokenize", json={"content": "hello"})
        assert resp.status_code == 400
        assert "model: required" in resp.json()["error"]["message"]
        assert len(a.seen) == len(b.seen) == len(paths)


@SERVERS
async def test_audio_is_routed_by_the_form_model_and_passed_on_unchanged(server: str) -> None:
    reply = _json_reply(200, b'{"text":"hello there"}')
    paths = ("/v1/audio/transcriptions", "/v1/audio/translations")
    async with (
        scripted(dict.fromkeys(paths, reply), dict.fromkeys(paths, reply)) as (a, b),
        serve_router([a.endpoint("whisper"), b.endpoint("other")], server=server) as r,
    ):
        c = openai.OpenAI(base_url=r.base_url, api_key=SECRET_A, max_retries=0, timeout=30)
        audio = bytes(range(256)) * 4
        with c:
            text = await trio.to_thread.run_sync(
                lambda: c.audio.transcriptions.create(
                    model="whisper", file=("a.wav", audio, "audio/wav"), language="en"
                )
            )
        assert text.text == "hello there"
        assert [s.path for s in a.seen] == ["/v1/audio/transcriptions"] and b.seen == []
        got = a.seen[0]
        assert got.headers["content-type"].startswith("multipart/form-data; boundary=")
        assert audio in got.body and b'name="model"\r\n\r\nwhisper\r\n' in got.body
        # Byte for byte what the client sent, boundary and all.
        ctype, body = _multipart({"model": "other"}, audio)
        async with httpx.AsyncClient(base_url=r.url, headers=AUTH, timeout=30) as h:
            resp = await h.post(paths[1], content=body, headers={"content-type": ctype.decode()})
            assert resp.status_code == 200 and resp.json() == {"text": "hello there"}
            assert b.seen[0].body == body and b.seen[0].headers["content-type"] == ctype.decode()
            resp = await h.post(paths[0], json={"model": "whisper"})
            assert resp.status_code == 400
            assert resp.json()["error"]["code"] == "invalid_form"
            assert "got 'application/json'" in resp.json()["error"]["message"]
        assert len(a.seen) == 1


@SERVERS
async def test_an_engine_that_does_not_serve_a_route_answers_for_itself(server: str) -> None:
    # Two replicas of one model; neither serves /v1/responses (vLLM-style 404) or
    # rerank (llama.cpp's 501 without --reranking).
    llama_501 = _json_reply(
        501,
        b'{"error":{"code":501,"message":"This server does not support reranking. '
        b'Start it with `--reranking`","type":"not_supported_error"}}',
    )
    script = {"/v1/rerank": llama_501}
    async with (
        scripted(script, script) as (a, b),
        serve_router(
            [a.endpoint("m"), b.endpoint("m")], server=server, breaker_failures=1, retries=2
        ) as r,
        httpx.AsyncClient(base_url=r.url, headers=AUTH, timeout=30) as h,
    ):
        for i in range(4):
            resp = await h.post("/v1/responses", json={"model": "m", "input": "hi"})
            assert resp.status_code == 404 and resp.content == b'{"detail":"Not Found"}'
            # Sent once, to one replica: not retried elsewhere.
            assert len(a.seen) + len(b.seen) == 2 * i + 1
            resp = await h.post("/v1/rerank", json={"model": "m", "query": "q", "documents": []})
            assert resp.status_code == 501 and resp.content == _body(llama_501)
            assert len(a.seen) + len(b.seen) == 2 * i + 2
        # One failure would have opened a breaker: none is open, nothing counted as failed.
        breakers = {e: s["breaker"] for e, s in r.router.statistics()["endpoints"].items()}
        assert breakers == {f"m@{a.port}": "closed", f"m@{b.port}": "closed"}
        text = r.metrics_text()
        assert sample(text, "llmgw_router_upstream_failures_total", model="m") is None
        assert sample(text, "llmgw_router_retries_total", model="m") in (None, 0.0)
        await counted(r, 4.0, model="m", status="404")
        await counted(r, 4.0, model="m", status="501")


# Anthropic's stream as llama.cpp sends it, with "é" split across two chunks.
MESSAGE_EVENTS = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":'
    b'"message","role":"assistant","content":[],"model":"m","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":3,"output_tokens":0}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"caf\xc3',
    b'\xa9"}}\n\n',
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
    b'"stop_sequence":null},"usage":{"output_tokens":1}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]
RESPONSE_EVENTS = [
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1",'
    b'"object":"response","status":"in_progress"}}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"item_id":"msg_1","delta":"na\xc3',
    b'\xafve"}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1",'
    b'"object":"response","status":"completed","output":[]}}\n\n',
]


@SERVERS
async def test_messages_and_responses_streams_pass_through_byte_for_byte(server: str) -> None:
    script = {
        "/v1/messages": _sse_reply(MESSAGE_EVENTS),
        "/v1/responses": _sse_reply(RESPONSE_EVENTS),
    }
    async with (
        scripted(script) as (e,),
        serve_router([e.endpoint("m")], server=server) as r,
        httpx.AsyncClient(base_url=r.url, timeout=30) as h,
    ):
        for path, events, headers in (
            ("/v1/messages", MESSAGE_EVENTS, {"x-api-key": SECRET_A}),
            ("/v1/responses", RESPONSE_EVENTS, AUTH),
        ):
            request = {"model": "m", "stream": True, "max_tokens": 4, "messages": [], "input": "x"}
            async with h.stream("POST", path, json=request, headers=headers) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"] == "text/event-stream"
                got = b"".join([chunk async for chunk in resp.aiter_raw()])
            assert got == b"".join(events)
            assert json.loads(e.seen[-1].body) == request
        # And through the SDK, which parses those events.
        c = anthropic.Anthropic(base_url=r.url, api_key=SECRET_A, max_retries=0, timeout=30)
        with c:
            events = await trio.to_thread.run_sync(
                lambda: list(
                    c.messages.create(
                        model="m",
                        max_tokens=4,
                        messages=[{"role": "user", "content": "hi"}],
                        stream=True,
                    )
                )
            )
        deltas = [ev.delta.text for ev in events if ev.type == "content_block_delta"]
        assert deltas == ["café"]
        assert events[-1].type == "message_stop"
        await counted(r, 3.0, model="m", status="200")


@SERVERS
async def test_a_stream_cut_midway_ends_with_an_error_event_in_the_routes_shape(
    server: str,
) -> None:
    begun = MESSAGE_EVENTS[:2]
    script = {
        "/v1/messages": [*_sse_reply(begun)[:-1], CUT],
        "/v1/responses": [*_sse_reply(RESPONSE_EVENTS[:1])[:-1], CUT],
    }
    async with (
        scripted(script) as (e,),
        serve_router([e.endpoint("m")], server=server, retries=0) as r,
        httpx.AsyncClient(base_url=r.url, headers=AUTH, timeout=30) as h,
    ):

        async def read(path: str) -> bytes:
            got: list[bytes] = []
            request = {"model": "m", "stream": True, "messages": [], "input": "x"}
            async with h.stream("POST", path, json=request) as resp:
                assert resp.status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):  # cut: never taken for complete
                    async for chunk in resp.aiter_raw():
                        got.append(chunk)
            return b"".join(got)

        got = await read("/v1/messages")
        assert got.startswith(b"".join(begun))
        name, data = got[len(b"".join(begun)) :].split(b"\n", 1)
        assert name == b"event: error" and data.endswith(b"\n\n")
        error = json.loads(data.removeprefix(b"data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert error["error"]["message"].startswith("the model's replica failed mid-response")
        # Counted, with why it was not continued (only chat and completions are).
        cuts = "llmgw_router_stream_cuts_total"
        labels = {"model": "m", "outcome": "error", "reason": "route"}
        assert sample(r.metrics_text(), cuts, api="anthropic", **labels) == 1
        got = await read("/v1/responses")
        tail = got[len(RESPONSE_EVENTS[0]) :]
        assert got.startswith(RESPONSE_EVENTS[0]) and tail.startswith(b"data: {")
        assert json.loads(tail.removeprefix(b"data: "))["error"]["type"] == "upstream_error"
        assert sample(r.metrics_text(), cuts, api="openai", **labels) == 1
        # The anthropic SDK raises on that event, with its body.
        c = anthropic.Anthropic(base_url=r.url, api_key=SECRET_A, max_retries=0, timeout=30)

        def stream() -> anthropic.APIStatusError:
            with c:
                try:
                    list(
                        c.messages.create(
                            model="m",
                            max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}],
                            stream=True,
                        )
                    )
                except anthropic.APIStatusError as exc:
                    return exc
            raise AssertionError("the broken stream raised nothing")

        exc = await trio.to_thread.run_sync(stream)
        assert isinstance(exc.body, dict) and exc.body["error"]["type"] == "api_error"


async def test_messages_share_admission_and_retries_with_chat() -> None:
    from llmgw.core._admission import Band

    answer = b'{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"m"}'
    held = {"/v1/messages": [HOLD, *_json_reply(200, answer)]}
    failing = {"/v1/messages": _json_reply(503, b'{"error":"overloaded"}')}
    async with (
        scripted(held, failing) as (good, bad),
        serve_router(
            [good.endpoint("m"), bad.endpoint("m")],
            concurrency=1,
            queue_limit=0,
            bands=[Band("interactive", 0, 5.0)],
            breaker_failures=100,
        ) as r,
        httpx.AsyncClient(base_url=r.url, headers={"x-api-key": SECRET_A}, timeout=30) as h,
    ):
        request = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        async with trio.open_nursery() as nursery:
            first: list[httpx.Response] = []

            async def send() -> None:
                first.append(await h.post("/v1/messages", json=request))

            nursery.start_soon(send)
            with trio.fail_after(10):
                while not good.seen:
                    await trio.sleep(0.01)
            # The one slot is taken: the next is refused, in Anthropic's terms.
            c = anthropic.Anthropic(base_url=r.url, api_key=SECRET_A, max_retries=0, timeout=30)
            with c, pytest.raises(anthropic.RateLimitError) as refused:
                await trio.to_thread.run_sync(lambda: c.messages.create(**request))
            assert refused.value.body["type"] == "error"
            assert refused.value.body["error"]["type"] == "rate_limit_error"
            assert "over capacity" in refused.value.body["error"]["message"]
            assert int(refused.value.response.headers["retry-after"]) >= 1
            good.release.set()
        # The 503 replica was tried first or not at all; either way the answer is the good one's.
        assert first[0].status_code == 200 and first[0].content == answer
        assert len(good.seen) == 1
        failures = sample(r.metrics_text(), "llmgw_router_upstream_failures_total", model="m")
        assert (failures or 0.0) == len(bad.seen)
        # And many more: every one answered 200, the failing replica's 503s retried.
        for _ in range(6):
            resp = await h.post("/v1/messages", json=request)
            assert resp.status_code == 200 and resp.content == answer
        assert len(bad.seen) >= 1, "the seeded choice never tried the failing replica"
        text = r.metrics_text()
        assert sample(text, "llmgw_router_upstream_failures_total", model="m") == len(bad.seen)
        assert sample(text, "llmgw_router_retries_total", model="m") == len(bad.seen)


@SERVERS
async def test_messages_errors_take_anthropic_shape(server: str) -> None:
    async with (
        scripted({}) as (e,),
        serve_router([e.endpoint("m")], server=server) as r,
    ):

        def client(key: str) -> anthropic.Anthropic:
            return anthropic.Anthropic(base_url=r.url, api_key=key, max_retries=0, timeout=30)

        def create(key: str, model: str = "m", **kw: Any) -> Any:
            with client(key) as c:
                return c.messages.create(
                    model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}], **kw
                )

        async def raised(fn: Callable[[], Any]) -> anthropic.APIStatusError:
            def run() -> anthropic.APIStatusError:
                try:
                    fn()
                except anthropic.APIStatusError as exc:
                    return exc
                raise AssertionError("no error raised")

            return await trio.to_thread.run_sync(run)

        bad = await raised(lambda: create("llmgw-not-a-key"))
        assert isinstance(bad, anthropic.AuthenticationError) and bad.status_code == 401
        assert bad.body == {
            "type": "error",
            "error": {
                "type": "authentication_error",
                "message": "the API key is not valid (unknown or revoked)",
            },
        }
        unknown = await raised(lambda: create(SECRET_A, model="ghost"))
        assert isinstance(unknown, anthropic.NotFoundError)
        assert unknown.body["error"] == {
            "type": "not_found_error",
            "message": "the model 'ghost' does not exist (see GET /v1/models)",
        }
        denied = await raised(lambda: create(SECRET_LIMITED, model="m"))
        assert isinstance(denied, anthropic.PermissionDeniedError)
        assert denied.body["error"]["type"] == "permission_error"
        # The engine never saw any of them.
        assert e.seen == []
        async with httpx.AsyncClient(base_url=r.url, timeout=30) as h:
            keyless = await h.post("/v1/messages", json={"model": "m", "max_tokens": 4})
            assert keyless.status_code == 401
            assert keyless.json()["error"] == {
                "type": "authentication_error",
                "message": "an API key is needed: Authorization: Bearer <key> (or x-api-key: <key>)",
            }
            missing = await h.post(
                "/v1/messages", json={"model": "m", "max_tokens": 4}, headers=AUTH
            )
            assert missing.json() == {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "messages: required"},
            }
            wrong_method = await h.get("/v1/messages", headers=AUTH)
            assert wrong_method.status_code == 405
            assert wrong_method.json()["type"] == "error"
            assert wrong_method.json()["error"]["type"] == "invalid_request_error"
            # Other routes keep OpenAI's shape.
            openai_shape = await h.post("/v1/responses", json={"model": "ghost"}, headers=AUTH)
            assert openai_shape.status_code == 404
            assert openai_shape.json()["error"]["code"] == "model_not_found"


# --- a real llama-server -----------------------------------------------------------------


@pytest.fixture
def llama_server(tiny_model: Path, tmp_path: Path) -> Iterator[int]:
    binary = llama_server_binary()
    port = free_port()
    log = tmp_path / "llama-server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                *(binary, "-m", str(tiny_model), "-a", "tiny", "--host", "127.0.0.1"),
                *("--port", str(port), "-c", "512", "-t", "1", "-np", "2", "--jinja", "--metrics"),
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "LLAMA_ARG_THREADS": "1"},
        )
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited: {log.read_text(errors='replace')}")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("llama-server", ready, timeout=60, interval=0.05)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _llama(port: int) -> Endpoint:
    return Endpoint(f"tiny@{port}", "tiny", "llama-server", "127.0.0.1", port, None)


async def test_responses_and_messages_through_the_sdks_to_a_real_llama_server(
    llama_server: int,
) -> None:
    async with serve_router([_llama(llama_server)]) as r:
        oc = openai.OpenAI(base_url=r.base_url, api_key=SECRET_A, max_retries=0, timeout=60)
        ac = anthropic.Anthropic(base_url=r.url, api_key=SECRET_A, max_retries=0, timeout=60)
        with oc, ac:
            whole = await trio.to_thread.run_sync(
                lambda: oc.responses.create(model="tiny", input="hello", max_output_tokens=5)
            )
            assert whole.status == "completed"
            assert whole.usage is not None and whole.usage.output_tokens == 5
            assert whole.output[0].type == "message"

            def stream_response() -> list[Any]:
                return list(
                    # Greedy, so every run streams the same tokens: one fresh-clone run
                    # (under load, sampled tokens) saw llama.cpp's stream open with
                    # response.completed, which no rerun reproduced; kinds are printed.
                    oc.responses.create(
                        model="tiny",
                        input="hello",
                        max_output_tokens=4,
                        stream=True,
                        temperature=0,
                    )
                )

            events = await trio.to_thread.run_sync(stream_response)
            kinds = [e.type for e in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
            # The tiny model's tokens are random bytes: llama.cpp holds back a token
            # that ends inside a UTF-8 character, so 4 tokens may come as fewer deltas.
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert 1 <= len(deltas) <= 4
            assert events[-1].response.output[0].content[0].text == "".join(deltas)
            assert events[-1].response.usage.output_tokens == 4

            message = await trio.to_thread.run_sync(
                lambda: ac.messages.create(
                    model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hello"}]
                )
            )
            assert message.type == "message" and message.role == "assistant"
            assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
            assert message.content[0].type == "text"

            def stream_message() -> list[Any]:
                return list(
                    ac.messages.create(
                        model="tiny",
                        max_tokens=4,
                        messages=[{"role": "user", "content": "hello"}],
                        stream=True,
                    )
                )

            events = await trio.to_thread.run_sync(stream_message)
            kinds = [e.type for e in events]
            # llama.cpp leaves out message_start when the first token ends inside a
            # UTF-8 character (seen straight from llama-server too, 1 time in 12).
            assert kinds[0] in ("message_start", "content_block_start")
            assert kinds[-1] == "message_stop"
            assert kinds.count("content_block_delta") >= 1
            delta = next(e for e in events if e.type == "message_delta")
            assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 4

            tally = await trio.to_thread.run_sync(
                lambda: ac.messages.count_tokens(
                    model="tiny", messages=[{"role": "user", "content": "hello"}]
                )
            )
            assert tally.input_tokens > 0

        async with httpx.AsyncClient(base_url=r.url, headers=AUTH, timeout=60) as h:
            tokens = (await h.post("/tokenize", json={"model": "tiny", "content": "hi"})).json()
            assert tokens["tokens"] and all(isinstance(t, int) for t in tokens["tokens"])
            text = await h.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]})
            assert text.status_code == 200 and "content" in text.json()
            # Not served by this one (no score route in llama.cpp): its own 404, passed on.
            score = await h.post("/v1/score", json={"model": "tiny", "text_1": "a", "text_2": "b"})
            assert score.status_code == 404 and score.json()["error"]["type"] == "not_found_error"
        await counted(r, 7.0, model="tiny", status="200")
        # Tokens counted in each API's words: 5 + 4 generated by Responses, 5 + 4 by Messages.
        metrics = r.metrics_text()
        assert sample(metrics, "llmgw_router_completion_tokens_total", model="tiny") == 18.0
        prompt = sample(metrics, "llmgw_router_prompt_tokens_total", model="tiny")
        assert prompt is not None and prompt > 0
        await counted(r, 1.0, model="tiny", status="404")
        failures = sample(r.metrics_text(), "llmgw_router_upstream_failures_total", model="tiny")
        assert failures is None
