"""Usage: the meter (sums, batches, a failing sink), and streams metered through a real
router: recorded llama-server and vLLM streams reach a client that asked for no usage
as the engine sent them, and are counted (the byte-level rewrite: test_metering.py)."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import hypercorn.config
import hypercorn.trio
import pytest
import trio
from helpers import FIXTURES
from hypothesis import given
from hypothesis import strategies as st

from llmgw.keys import UsageRow
from llmgw.router._types import Endpoint
from llmgw.router._usage import UsageMeter
from llmgw.testing.cluster import free_port
from router.conftest import SECRET_A, SECRET_B, sample, serve_router

ASKED = (FIXTURES / "llama-server-chat-stream-include-usage.sse").read_bytes()
NOT_ASKED = (FIXTURES / "llama-server-chat-stream-no-usage.sse").read_bytes()
VLLM_ASKED = (FIXTURES / "vllm-chat-stream-include-usage.sse").read_bytes()
VLLM_NOT_ASKED = (FIXTURES / "vllm-chat-stream-no-usage.sse").read_bytes()
HOUR = 3600


class Sink:
    def __init__(self, fail: int = 0) -> None:
        self.batches: list[list[UsageRow]] = []
        self.fail = fail  # calls to fail before succeeding

    async def add_usage(self, rows: Iterable[UsageRow]) -> None:
        await trio.lowlevel.checkpoint()
        if self.fail:
            self.fail -= 1
            raise OSError("the store is down")
        self.batches.append(list(rows))


def totals(rows: Iterable[UsageRow]) -> dict[tuple[int, str, str, str], tuple[int, int, int]]:
    out: dict[tuple[int, str, str, str], tuple[int, int, int]] = {}
    for r in rows:
        key = (r.hour, r.tenant, r.key_id, r.model)
        n, p, c = out.get(key, (0, 0, 0))
        out[key] = (n + r.requests, p + r.prompt_tokens, c + r.completion_tokens)
    return out


# --- the meter ------------------------------------------------------------------------


def test_the_meter_sums_per_hour_tenant_key_and_model() -> None:
    meter = UsageMeter()
    t0 = 1_800_000_000.0  # 3600 * 500000
    meter.add(t0 + 5, "acme", "key-1", "chat", 10, 3)
    meter.add(t0 + 3599, "acme", "key-1", "chat", 7, 2)
    meter.add(t0 + 3600, "acme", "key-1", "chat", 1, 1)  # the next hour
    meter.add(t0 + 10, "acme", "key-2", "chat", 4, None)  # no completion figure: 0
    meter.add(t0 + 10, "beta", "key-3", "embed", None, None)  # an error answer: a request
    assert meter.pending() == [
        UsageRow(int(t0), "acme", "key-1", "chat", 2, 17, 5),
        UsageRow(int(t0), "acme", "key-2", "chat", 1, 4, 0),
        UsageRow(int(t0), "beta", "key-3", "embed", 1, 0, 0),
        UsageRow(int(t0) + HOUR, "acme", "key-1", "chat", 1, 1, 1),
    ]


async def test_the_meter_flushes_in_batches_and_empties() -> None:
    meter = UsageMeter(batch_rows=2)
    for i in range(5):
        meter.add(0.0, "acme", f"key-{i}", "chat", i, 2 * i)
    sink = Sink()
    assert await meter.flush(sink) == 5
    assert [len(b) for b in sink.batches] == [2, 2, 1]
    assert totals(r for b in sink.batches for r in b) == {
        (0, "acme", f"key-{i}", "chat"): (1, i, 2 * i) for i in range(5)
    }
    assert meter.pending() == []
    assert await meter.flush(sink) == 0 and len(sink.batches) == 3  # nothing: no call


async def test_a_failed_flush_keeps_its_rows_and_adds_what_came_meanwhile() -> None:
    meter = UsageMeter(batch_rows=2)
    for i in range(3):
        meter.add(0.0, "acme", f"key-{i}", "chat", 10, 1)
    sink = Sink(fail=1)
    with pytest.raises(OSError, match="the store is down"):
        await meter.flush(sink)
    assert sink.batches == [] and meter.statistics()["failures"] == 1
    meter.add(0.0, "acme", "key-0", "chat", 5, 5)  # while the store was down
    assert await meter.flush(sink) == 3
    assert totals(r for b in sink.batches for r in b) == {
        (0, "acme", "key-0", "chat"): (2, 15, 6),
        (0, "acme", "key-1", "chat"): (1, 10, 1),
        (0, "acme", "key-2", "chat"): (1, 10, 1),
    }


async def test_a_store_that_stays_out_is_a_warning_the_first_time_then_once_a_minute() -> None:
    """With a flush a second (usage_flush_s 1), a warning per failure would be 60 a minute."""
    meter = UsageMeter()
    meter.add(0.0, "acme", "key-0", "chat", 1, 1)
    sink = Sink(fail=130)
    said = []
    for _ in range(130):
        with pytest.raises(OSError):
            await meter.flush(sink)
        said.append(meter.worth_saying())
    assert [i + 1 for i, s in enumerate(said) if s] == [1, 60, 120]
    assert await meter.flush(sink) == 1 and meter.failing == 0
    sink.fail = 1
    meter.add(0.0, "acme", "key-0", "chat", 1, 1)
    with pytest.raises(OSError):
        await meter.flush(sink)
    assert meter.worth_saying()  # a new outage is said at once


async def test_a_flush_failing_midway_resends_only_what_was_not_taken() -> None:
    meter = UsageMeter(batch_rows=1)
    meter.add(0.0, "acme", "key-0", "chat", 1, 1)
    meter.add(0.0, "acme", "key-1", "chat", 2, 2)

    class SecondFails(Sink):
        async def add_usage(self, rows: Iterable[UsageRow]) -> None:
            if len(self.batches) == 1 and not getattr(self, "failed", False):
                self.failed = True
                raise OSError("lost the connection")
            await super().add_usage(rows)

    sink = SecondFails()
    with pytest.raises(OSError):
        await meter.flush(sink)
    assert meter.pending() == [UsageRow(0, "acme", "key-1", "chat", 1, 2, 2)]
    await meter.flush(sink)
    assert totals(r for b in sink.batches for r in b) == {
        (0, "acme", "key-0", "chat"): (1, 1, 1),
        (0, "acme", "key-1", "chat"): (1, 2, 2),
    }


def test_the_meter_is_bounded_and_counts_what_it_drops() -> None:
    meter = UsageMeter(max_rows=3)
    for i in range(5):
        meter.add(0.0, "acme", f"key-{i}", "chat", 1, 1)
    assert meter.add(0.0, "acme", "key-0", "chat", 1, 1)  # an existing row still adds
    assert len(meter.pending()) == 3
    assert meter.statistics()["dropped"] == 2


@given(
    st.lists(
        st.tuples(
            st.floats(0, 10 * HOUR, allow_nan=False),
            st.sampled_from(["a", "b"]),
            st.sampled_from(["k1", "k2"]),
            st.sampled_from(["m1", "m2"]),
            st.integers(0, 10_000) | st.none(),
            st.integers(0, 10_000) | st.none(),
        ),
        max_size=50,
    )
)
def test_the_meter_loses_and_invents_nothing(adds: list[Any]) -> None:
    meter = UsageMeter()
    for a in adds:
        meter.add(*a)
    rows = meter.pending()
    assert sum(r.requests for r in rows) == len(adds)
    assert sum(r.prompt_tokens for r in rows) == sum(a[4] or 0 for a in adds)
    assert sum(r.completion_tokens for r in rows) == sum(a[5] or 0 for a in adds)
    assert all(r.hour % HOUR == 0 for r in rows)


def events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e]


# --- through the router ----------------------------------------------------------------


class Replay:
    """An engine that answers every streamed chat with a recorded stream: the one with
    the usage event when the request asks for it, else the one without."""

    def __init__(self, asked: bytes, not_asked: bytes) -> None:
        self.recordings = {True: asked, False: not_asked}
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        self.bodies.append(body)
        asked = (json.loads(body).get("stream_options") or {}).get("include_usage") is True
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for event in events(self.recordings[asked]):  # an event per write, as engines do
            await send({"type": "http.response.body", "body": event + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@asynccontextmanager
async def replay_engine(asked: bytes, not_asked: bytes) -> AsyncIterator[tuple[Replay, int]]:
    app = Replay(asked, not_asked)
    port = free_port()
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.graceful_timeout = 0.2
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(hypercorn.trio.serve, app, config))
        yield app, port
        nursery.cancel_scope.cancel()


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        **extra,
    }


async def metered(
    engine_name: str, asked: bytes, not_asked: bytes, want: tuple[int, int]
) -> tuple[Replay, httpx.Response, httpx.Response, float | None]:
    """A client that asks for no usage and one that does, through a router to a replay
    of `engine_name`'s recordings; both counted as `want` (prompt, completion)."""
    async with replay_engine(asked, not_asked) as (engine, port):
        endpoint = Endpoint("tiny@replay", "tiny", engine_name, "127.0.0.1", port, None)
        async with (
            serve_router([endpoint], run=False) as r,
            httpx.AsyncClient(timeout=30) as h,
        ):
            url = r.base_url + "/chat/completions"
            body = json.dumps(chat(), separators=(",", ":")).encode()
            plain = await h.post(
                url,
                headers={"Authorization": f"Bearer {SECRET_A}", "content-type": "application/json"},
                content=body,
            )
            # What the unasked answer alone taught the model's estimates (its length).
            with trio.fail_after(10):
                while not r.router.meter.pending():
                    await trio.sleep(0.01)
            learned = r.router.fleet.models()["tiny"].estimates.output_tokens
            asking = await h.post(
                url,
                headers={"Authorization": f"Bearer {SECRET_B}"},
                json=chat(stream_options={"include_usage": True}),
            )
            # Both answers are counted (once each has ended).
            with trio.fail_after(10):
                while sum(x.requests for x in r.router.meter.pending()) < 2:
                    await trio.sleep(0.01)
            rows = r.router.meter.pending()
            assert [(x.tenant, x.requests, x.prompt_tokens, x.completion_tokens) for x in rows] == [
                ("tenant-a", 1, *want),
                ("tenant-b", 1, *want),
            ]
            text = r.metrics_text()
            assert (
                sample(text, "llmgw_tenant_tokens_total", tenant="tenant-a", kind="prompt")
                == (want[0])
            )
            assert (
                sample(text, "llmgw_tenant_tokens_total", tenant="tenant-a", kind="completion")
                == want[1]
            )
            assert sample(text, "llmgw_tenant_requests_total", tenant="tenant-b") == 1
            return engine, plain, asking, learned


async def test_llama_server_is_not_asked_and_its_stream_reaches_the_client_as_sent() -> None:
    engine, plain, asking, learned = await metered("llama-server", ASKED, NOT_ASKED, (25, 3))
    assert learned == 3.0
    # The engine got the client's own bytes (nothing asked on its behalf)...
    assert engine.bodies[0] == json.dumps(chat(), separators=(",", ":")).encode()
    assert [json.loads(b).get("stream_options") for b in engine.bodies] == [
        None,
        {"include_usage": True},
    ]
    # ...so the client that asked for nothing gets the engine's bytes, `timings` and
    # all, and is counted from them (cache_n + prompt_n, predicted_n); the client that
    # asked gets its usage event as the engine sent it.
    assert plain.status_code == 200 and plain.content == NOT_ASKED
    assert b'"timings":{"cache_n":0,"prompt_n":25' in plain.content
    assert asking.status_code == 200 and asking.content == ASKED


async def test_vllm_is_asked_and_exactly_what_asking_added_is_taken_out() -> None:
    engine, plain, asking, learned = await metered("vllm", VLLM_ASKED, VLLM_NOT_ASKED, (20, 6))
    assert learned == 6.0
    # vLLM says its tokens only when asked: the router asked for the client...
    assert [json.loads(b)["stream_options"] for b in engine.bodies] == [{"include_usage": True}] * 2
    # ...and the client gets the bytes vLLM sends unasked: no usage event, and none of
    # the `"usage":null` members asking put into every chunk.
    assert plain.status_code == 200 and plain.content == VLLM_NOT_ASKED
    assert b'"usage"' not in plain.content
    assert asking.status_code == 200 and asking.content == VLLM_ASKED


# --- the router's flush ----------------------------------------------------------------


async def test_the_router_flushes_on_its_interval_retries_a_failure_and_flushes_at_exit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from llmgw.router._keys import StaticKeys
    from llmgw.router._router import Router, RouterConfig
    from llmgw.router._types import StaticEndpoints

    sink = Sink(fail=1)
    router = Router(
        RouterConfig(usage_flush_s=5.0), StaticEndpoints([]), StaticKeys([]), usage=sink
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        router.meter.add(0.0, "acme", "key-1", "chat", 10, 2)
        await trio.sleep(5.5)  # the first flush fails: the row is kept
        assert sink.batches == [] and router.meter.statistics()["failures"] == 1
        router.meter.add(0.0, "acme", "key-1", "chat", 1, 1)
        await trio.sleep(5.0)  # the next one sends both
        assert sink.batches == [[UsageRow(0, "acme", "key-1", "chat", 2, 11, 3)]]
        router.meter.add(0.0, "beta", "key-2", "chat", 7, 7)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()  # stopping: flushed once more, before the interval
    assert sink.batches[-1] == [UsageRow(0, "beta", "key-2", "chat", 1, 7, 7)]
    assert router.meter.pending() == []
