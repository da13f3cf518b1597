"""The routers' load signals and holds over the router workers (llmgw/cp/_workers.py):
the control plane's hub and router in this trio loop, a real worker process (`python -m
llmgw.cp._worker`, as `router.workers: 2` starts it) on the same port with SO_REUSEPORT,
fake engines behind them; and stand-in workers for what a real one never sends."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from router.conftest import FakeEngine
from router.conftest import start_engine as start_engine  # the fixture: fake engines

from llmgw.core import RouterLoad
from llmgw.cp._admin import ensure_admin_key
from llmgw.cp._workers import STALE_S, WorkerHub, loads_by_router, supervise
from llmgw.router import (
    Hold,
    Lines,
    Router,
    RouterConfig,
    StaticEndpoints,
    StaticKeys,
    StoreKeys,
    send_line,
    serve_http,
)
from llmgw.store import open_store
from llmgw.testing.cluster import free_port

_WORKER = re.compile(r"^(\d+); pid=(\d+)$")


def worker_of(resp: httpx.Response) -> tuple[int, int]:
    match = _WORKER.match(resp.headers["x-llmgw-worker"])
    assert match, resp.headers["x-llmgw-worker"]
    return int(match[1]), int(match[2])


async def until(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    with trio.fail_after(timeout):
        while not (got := check()):
            await trio.sleep(0.02)
    return got


def body(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "x" * 200}], "stream": stream}


async def test_loads_of_both_routers_and_holds_reach_the_worker(
    tmp_path: Path, start_engine: Callable[..., FakeEngine]
) -> None:
    chat = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "100", "LLMGW_FAKE_TOKEN_DELAY": "0.1"})
    cold = start_engine("cold", env={"LLMGW_FAKE_TOKENS": "2"})
    store = await open_store(tmp_path / "state")
    _, secret = await store.create_key(tenant="t")
    auth = {"Authorization": f"Bearer {secret}"}
    key_path, _ = ensure_admin_key(tmp_path / "state")
    hold = Hold(40, 60.0)  # 20 a router: more than this test sends to either
    source = StaticEndpoints([chat.endpoint()], ["chat", "cold"], holds={"cold": hold})
    section = {"workers": 2, "scrape_interval_s": 0.5}
    local = Router(RouterConfig(**section), source, StoreKeys(store), worker=0)
    hub = WorkerHub(source, 2, section, tmp_path / "state", key_path, local=local)
    sock, port = tmp_path / "router.sock", free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        async with (
            trio.open_nursery() as nursery,
            # No keep-alive: each request on a new connection, whose worker the kernel picks.
            httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as h,
        ):
            await nursery.start(local.run)
            await nursery.start(partial(serve_http, reuse_port=True), local.app, "127.0.0.1", port)
            await nursery.start(hub.serve, sock)
            await nursery.start(supervise, 2, sock, "127.0.0.1", port, None)
            await until(lambda: hub.loads())  # worker 1 reports
            # Every model the view lists, from both routers, zeros included.
            ((w1, theirs),) = hub.loads().items()
            assert theirs == {"chat": RouterLoad(), "cold": RouterLoad()}
            assert re.fullmatch(r"w1-\d+", w1) and w1 != f"w1-{os.getpid()}"

            # A stream in flight on each router.
            streaming: dict[int, int] = {}

            async def stream() -> None:
                async with h.stream("POST", url, headers=auth, json=body("chat", True)) as resp:
                    assert resp.status_code == 200
                    index, pid = worker_of(resp)
                    if index in streaming:
                        return  # that router has one already: leave
                    streaming[index] = pid
                    await resp.aread()

            async with trio.open_nursery() as streams:
                for _ in range(40):
                    streams.start_soon(stream)
                    await trio.sleep(0.1)
                    if len(streaming) == 2:
                        break
                assert sorted(streaming) == [0, 1], streaming
                assert streaming[0] == os.getpid()  # worker 0 is this process's router

                def both() -> dict[str, dict[str, RouterLoad]] | None:
                    loads = loads_by_router(local, hub)
                    chats = [one["chat"] for one in loads.values()]
                    ok = len(loads) == 2 and all(c.in_flight == 1 and sum(c.ttft) for c in chats)
                    return loads if ok else None

                loads = await until(both)
                assert loads.keys() == {"w0", f"w1-{streaming[1]}"}
                for one in loads.values():
                    assert one["cold"] == RouterLoad()
                streams.cancel_scope.cancel()

            # Holds reach the worker: requests for `cold` (no replica yet) are held by
            # both routers until its replica is listed, then answered.
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await h.post(url, headers=auth, json=body("cold", False)))

            def held() -> dict[str, int]:
                return {r: one["cold"].queued for r, one in loads_by_router(local, hub).items()}

            async with trio.open_nursery() as asking:
                for sent in range(1, 17):
                    asking.start_soon(ask)
                    await until(lambda sent=sent: sum(held().values()) == sent)
                    if all(held().values()):
                        break
                assert all(held().values()) and len(held()) == 2, held()
                assert answers == []
                source.replace(
                    [chat.endpoint(), cold.endpoint()], ["chat", "cold"], holds={"cold": hold}
                )
            assert len(answers) == sent
            assert [a.status_code for a in answers] == [200] * sent
            assert {worker_of(a)[0] for a in answers} == {0, 1}
            assert cold.stats()["completed"] == sent
            nursery.cancel_scope.cancel()
    finally:
        local.close()
        await store.aclose()


class StandIn:
    """A worker's end of the channel: hello, then lines."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.lines = Lines(stream)

    @classmethod
    async def connect(cls, path: Path, index: int, pid: int) -> StandIn:
        worker = cls(await trio.open_unix_socket(str(path)))
        await send_line(worker.stream, {"hello": index, "pid": pid})
        assert "router" in await worker.lines.next()  # the setup
        view = await worker.lines.next()
        assert view["holds"] == {"cold": {"max": 8, "s": 30.0}}  # the holds, in the view
        return worker


async def test_a_bad_load_is_dropped_naming_the_worker_and_a_silent_one_goes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = StaticEndpoints([], ["chat", "cold"], holds={"cold": Hold(8, 30.0)})
    local = Router(RouterConfig(workers=3), source, StaticKeys([]), worker=0)
    hub = WorkerHub(source, 3, {}, "/nonexistent", tmp_path / "admin.key", local=local)
    sock = tmp_path / "router.sock"
    good = RouterLoad(queued=2, in_flight=1, uncached_tokens=50, rejected=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.serve, sock)
        one = await StandIn.connect(sock, 1, 111)
        two = await StandIn.connect(sock, 2, 222)
        caplog.set_level(logging.WARNING, "llmgw.cp.workers")
        await send_line(
            one.stream,
            {"version": 1, "in_flight": {}, "load": {"chat": good.as_json(), "cold": [1, 2]}},
        )
        await send_line(two.stream, {"version": 1, "in_flight": {}, "load": "nonsense"})
        loads = await until(lambda: len(hub.loads()) == 2 and hub.loads())
        # The bad model's load is dropped, the good one kept; the hub goes on.
        assert loads == {"w1-111": {"chat": good}, "w2-222": {}}
        warned = [r.getMessage() for r in caplog.records]
        assert any("router worker 1: dropped a bad load" in m and "'cold'" in m for m in warned)
        assert any("router worker 2: dropped a bad load" in m for m in warned)
        assert loads_by_router(local, hub)["w0"] == {"chat": RouterLoad(), "cold": RouterLoad()}
        # Worker 1 keeps reporting, worker 2 falls silent: past STALE_S it is left out.
        with trio.move_on_after(STALE_S + 0.5):
            while True:
                await send_line(one.stream, {"version": 1, "in_flight": {}, "load": {}})
                await trio.sleep(0.1)
        assert hub.loads() == {"w1-111": {}}
        await one.stream.aclose()
        await two.stream.aclose()
        nursery.cancel_scope.cancel()
    local.close()
