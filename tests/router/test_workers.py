"""`workers: N` in router-only mode: N real processes on one SO_REUSEPORT port.

The supervisor (llmgw-router) starts the workers, restarts one that dies and stops
them all on SIGTERM; each worker admits its share of the limits and names itself
in `x-llmgw-worker`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from helpers import start_router

from llmgw.errors import ConfigError
from llmgw.router._main import parse
from llmgw.router._router import share
from llmgw.testing.cluster import free_port, wait_for
from router.conftest import FakeEngine, sample

KEY = "llmgw-workers-test-key"
_WORKER = re.compile(r"^(\d+); pid=(\d+)$")


def test_share_splits_a_limit_and_never_to_zero() -> None:
    assert [share(4, i, 2) for i in range(2)] == [2, 2]
    assert [share(5, i, 2) for i in range(2)] == [3, 2]  # the remainder to the first
    assert [share(7, i, 3) for i in range(3)] == [3, 2, 2]
    assert [share(1, i, 3) for i in range(3)] == [1, 1, 1]  # never 0 for a limit ≥ 1
    assert [share(0, i, 2) for i in range(2)] == [0, 0]  # no queue stays no queue
    assert share(64, 0, 1) == 64
    for total in range(0, 40):
        for n in range(1, 9):
            parts = [share(total, i, n) for i in range(n)]
            assert sum(parts) == total or (total < n and parts == [1] * n)


def test_workers_config_errors() -> None:
    base = {"endpoints": [], "keys": [{"key": "k", "tenant": "t"}]}
    with pytest.raises(ConfigError) as err:
        parse({**base, "workers": 2, "server": "hypercorn"}, "router.yaml")
    assert "router.yaml: workers: 2 needs server: lean" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({**base, "workers": 65}, "router.yaml")
    assert "workers" in str(err.value) and "65" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({**base, "workers": 2, "metrics_listen": "127.0.0.1:65535"}, "router.yaml")
    assert "65535+1 is above 65535" in str(err.value)
    _, cfg, _ = parse({**base, "workers": 2}, "router.yaml")
    assert cfg.workers == 2


def _two_free_ports() -> int:
    for _ in range(50):
        port = free_port()
        if port < 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def _worker_of(response: httpx.Response) -> tuple[int, int]:
    match = _WORKER.match(response.headers["x-llmgw-worker"])
    assert match, response.headers["x-llmgw-worker"]
    return int(match[1]), int(match[2])


def _chat(port: int, model: str) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (port, KEY.encode(), len(body), body)
    )


def test_two_workers_spread_divide_restart_and_stop(
    tmp_path: Path, start_engine: Callable[..., FakeEngine]
) -> None:
    """About 8 s: two workers serve, each admits 2 of concurrency 4, a killed one comes
    back while the other serves, SIGTERM stops the lot."""
    fast = start_engine("fast", env={"LLMGW_FAKE_TOKENS": "1"})
    slow = start_engine("slow", env={"LLMGW_FAKE_FIRST_TOKEN_DELAY": "60"})
    port, mport = free_port(), _two_free_ports()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f"metrics_listen: 127.0.0.1:{mport}\n"
        "endpoints:\n"
        f"  - {{model: fast, engine: vllm, url: 'http://127.0.0.1:{fast.port}'}}\n"
        f"  - {{model: slow, engine: vllm, url: 'http://127.0.0.1:{slow.port}'}}\n"
        f"keys:\n  - {{key: {KEY}, tenant: t0}}\n"
        "workers: 2\nconcurrency: 4\nqueue_limit: 0\nscrape_interval_s: 0.5\n"
    )
    log = tmp_path / "router.log"
    proc = start_router(cfg, log)

    def listening() -> dict[int, int]:
        """worker index -> pid of its latest 'listening' line."""
        found = re.findall(
            r"router listening on .* \(worker (\d) of 2, pid (\d+)\)", log.read_text()
        )
        return {int(i): int(pid) for i, pid in found}

    held: list[socket.socket] = []
    rc: int | None = None
    try:
        pids = wait_for("both workers", lambda: (w := listening()) and len(w) == 2 and w, 20, 0.05)
        assert pids[0] != pids[1] and proc.pid not in pids.values()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        auth = {"authorization": f"Bearer {KEY}"}
        request = {"model": "fast", "messages": [{"role": "user", "content": "hi"}]}

        def spread(until: Callable[[dict[int, int]], bool]) -> dict[int, int]:
            seen: dict[int, int] = {}
            for _ in range(60):  # a new connection each time: the kernel picks the worker
                r = httpx.post(url, json=request, headers=auth, timeout=10)
                assert r.status_code == 200, r.text
                index, pid = _worker_of(r)
                seen[index] = pid
                if until(seen):
                    return seen
            raise AssertionError(f"60 connections reached only workers {seen}")

        assert spread(lambda seen: len(seen) == 2) == pids

        # Admission divided: concurrency 4 is 2 per worker, no queue. Hold requests
        # on the slow engine until each worker has refused one: then exactly 2 are
        # admitted on each, 4 in all.
        def admitted(worker: int) -> float | None:
            text = httpx.get(f"http://127.0.0.1:{mport + worker}/metrics", timeout=5).text
            return sample(text, "llmgw_router_admitted_requests", model="slow")

        for w in (0, 1):
            text = httpx.get(f"http://127.0.0.1:{mport + w}/metrics", timeout=5).text
            assert sample(text, "llmgw_router_concurrency_limit", model="slow") == 2.0
        refused: set[int] = set()
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(_chat(port, "slow"))
            before = len(held)
            # Either the answer (a 429) comes, or the request shows as admitted.
            s.setblocking(False)

            def outcome(s: socket.socket = s, before: int = before) -> str | None:
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    data = None
                if data:
                    return data.decode(errors="replace")
                total = sum(admitted(w) or 0.0 for w in (0, 1))
                return "admitted" if total > before else None

            got = wait_for("an answer or an admission", outcome, timeout=10, interval=0.02)
            if got == "admitted":
                held.append(s)
                continue
            s.close()
            assert got.startswith("HTTP/1.1 429"), got
            head = got.split("\r\n\r\n", 1)[0].lower()
            match = re.search(r"x-llmgw-worker: (\d+); pid=(\d+)", head)
            assert match, head
            refused.add(int(match[1]))
            if refused == {0, 1}:
                break
        assert refused == {0, 1}
        assert len(held) == 4
        assert [admitted(0), admitted(1)] == [2.0, 2.0]
        for s in held:
            s.close()
        held.clear()

        # A killed worker is restarted; the other serves meanwhile.
        os.kill(pids[1], signal.SIGKILL)
        wait_for(
            "the supervisor to see worker 1 die",
            lambda: f"router worker 1 (pid {pids[1]}) ended" in log.read_text(),
            10,
            0.02,
        )
        for _ in range(5):
            r = httpx.post(url, json=request, headers=auth, timeout=10)
            assert r.status_code == 200, r.text
        new = wait_for(
            "worker 1 back", lambda: (w := listening()).get(1) != pids[1] and w, 20, 0.05
        )
        assert new[0] == pids[0] and new[1] != pids[1]
        assert spread(lambda seen: seen.get(1) == new[1])[1] == new[1]
        text = log.read_text()
        assert "(signal SIGKILL); restarting" in text
        assert f"router worker 1 started (pid {new[1]})" in text
        pids = new
    finally:
        for s in held:
            s.close()
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    assert rc == 0, log.read_text()
    assert time.monotonic() - start < 6
    for pid in pids.values():  # the workers are gone too (reaped by the supervisor)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_control_plane_refuses_workers_without_router_listen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Inside llmgw-cp the workers serve router_listen (tests/cp/test_cp_workers.py): none
    to serve, workers > 1 is refused."""
    from llmgw.cp._main import main as cp_main

    server = tmp_path / "server.yaml"
    server.write_text(
        f"state_dir: {tmp_path / 'state'}\n"
        "tls: {ca: /nonexistent/ca.crt, cert: /nonexistent/s.crt, key: /nonexistent/s.key}\n"
        "router_listen: null\n"
        "router:\n  workers: 2\n"
    )
    assert cp_main(["--config", str(server)]) == 2
    assert (
        "router.workers: 2, but router_listen is null: workers serve router_listen"
        in capsys.readouterr().err
    )
    server.write_text(
        f"state_dir: {tmp_path / ('s' * 110)}\n"
        "tls: {ca: /nonexistent/ca.crt, cert: /nonexistent/s.crt, key: /nonexistent/s.key}\n"
        "router:\n  workers: 2\n"
    )
    assert cp_main(["--config", str(server)]) == 2
    assert "is longer than a Unix socket path may be (107 bytes)" in capsys.readouterr().err
