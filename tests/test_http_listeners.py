"""Every HTTP listener holds its edge: the router on either server, the admin API and
pages on hypercorn, and the weights mirror, each as a process of its own on loopback.

- 1,000 idle connections that the client closes give their fds back at once, well
  before the keep-alive timer (hypercorn 0.18 held each until its timer ended:
  llmgw/router/_hypercorn.py), and a second 1,000 leave the RSS where the first did.
- A peer's misbehaviour leaves no traceback in the process's log.
- `Transfer-Encoding: gzip, chunked` is 501 (a coding the server does not apply,
  RFC 9112 §6.1) and a lowercase method is 400 (methods are case-sensitive, RFC 9110
  §9.1), on every listener alike.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import trio

from llmgw.testing.cluster import free_port

CONNECTIONS = 1000
# Longer than opening 1,000 connections takes on a loaded machine (or the first ones
# idle out before the last is open), and than RELEASE_S, so that a listener holding
# closed connections until its keep-alive timer fails the fd check. Released at once,
# they cost the test nothing.
KEEPALIVE_S = 30.0
RELEASE_S = 10.0
RSS_SLACK = 6 << 20  # allocator noise; a held connection costs ~18 KiB, 1,000 ~18 MiB

# The admin listener and the mirror as llmgw-cp starts them (llmgw/cp/_main.py), alone.
_RUNNER = """
import sys, trio
from functools import partial
from pathlib import Path

kind, root, keepalive = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])

async def main():
    async with trio.open_nursery() as nursery:
        if kind == "admin":
            from llmgw import core
            from llmgw.cp._admin import AdminApp
            from llmgw.cp._assembly import admin_http_config
            from llmgw.cp._pages import api_client, make_pages
            from llmgw.cp._fleet._registry import NodeRegistry
            from llmgw.router import serve_hypercorn

            admin = AdminApp(NodeRegistry(core.LivenessPolicy()), "admin-key")
            admin.pages = make_pages(api_client(admin, "admin-key"), "admin-key", mirror_dir=root)
            hc = admin_http_config("127.0.0.1:0")
            hc.keep_alive_timeout = keepalive
            binds = await nursery.start(serve_hypercorn, admin, hc)
            port = int(binds[0].rsplit(":", 1)[1])
        else:
            import attrs
            from llmgw.cp._weights._mirror import MIRROR_LIMITS, serve_mirror

            limits = attrs.evolve(MIRROR_LIMITS, keepalive_s=keepalive)
            port = await nursery.start(partial(serve_mirror, root, "127.0.0.1", 0, limits=limits))
        print("port", port, flush=True)

import logging
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
trio.run(main)
"""


class Listener:
    def __init__(
        self, proc: subprocess.Popen[bytes], port: int, log: Path, max_connections: int
    ) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.max_connections = max_connections
        self.ps = psutil.Process(proc.pid)

    def fds(self) -> int:
        return self.ps.num_fds()

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _wait_for_port(proc: subprocess.Popen[bytes], log: Path, port: int | None) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the listener exited: {log.read_text(errors='replace')}")
        if port is None:
            found = re.search(r"^port (\d+)$", log.read_text(errors="replace"), re.M)
            if found:
                port = int(found.group(1))
        if port is not None:
            try:
                with __import__("socket").create_connection(("127.0.0.1", port), timeout=1):
                    return port
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"the listener did not listen: {log.read_text(errors='replace')}")


@pytest.fixture(params=["router-lean", "router-hypercorn", "admin", "mirror"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    kind: str = request.param
    log = tmp_path / "listener.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    port: int | None = None
    if kind.startswith("router"):
        port = free_port()
        config = tmp_path / "router.yaml"
        config.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f"server: {kind.removeprefix('router-')}\n"
            f"client_keepalive_s: {KEEPALIVE_S}\n"
            "endpoints: []\n"
            "keys: [{key: llmgw-test-key-listeners, tenant: t}]\n"
        )
        argv = [sys.executable, "-m", "llmgw.router", "--config", str(config)]
    else:
        root = tmp_path / "mirror"
        (root / "tiny").mkdir(parents=True)
        (root / "tiny" / "a.gguf").write_bytes(b"x" * 100)
        argv = [sys.executable, "-c", _RUNNER, kind, str(root), str(KEEPALIVE_S)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        cap = 256 if kind == "mirror" else CONNECTIONS  # MIRROR_LIMITS.max_connections
        yield Listener(proc, _wait_for_port(proc, log, port), log, cap)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _idle_round(listener: Listener, base_fds: int) -> None:
    """Open CONNECTIONS idle connections, wait until the server holds them, close them."""
    streams = []
    try:
        for _ in range(CONNECTIONS):
            streams.append(await trio.open_tcp_stream("127.0.0.1", listener.port))
        # A connection the server never accepted proves nothing (the mirror closes those
        # beyond its max_connections at once, and holds that many).
        held = base_fds + min(CONNECTIONS, listener.max_connections)
        seen = await _settle(listener.fds, lambda n: n >= held, 20)
        assert seen >= held, f"the server holds {seen - base_fds} of {CONNECTIONS} connections"
    finally:
        for s in streams:
            s.socket.close()


async def _settle(measure: Callable[[], int], target: Callable[[int], bool], within: float) -> int:
    """Poll `measure` until `target` holds of it, or `within` seconds pass; the last value."""
    deadline = trio.current_time() + within
    value = measure()
    while not target(value) and trio.current_time() < deadline:
        await trio.sleep(0.05)
        value = measure()
    return value


async def _exchange(port: int, data: bytes) -> bytes:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    reply = b""
    with trio.move_on_after(10):
        try:
            await s.send_all(data)
            while chunk := await s.receive_some(65536):
                reply += chunk
        except trio.BrokenResourceError:
            pass
    await s.aclose()
    return reply


async def test_closed_idle_connections_give_their_fds_and_memory_back(listener: Listener) -> None:
    # The lowest count over a moment: the readiness probe's socket may still be open.
    base_fds = listener.fds()
    for _ in range(6):
        await trio.sleep(0.05)
        base_fds = min(base_fds, listener.fds())
    await _idle_round(listener, base_fds)
    fds = await _settle(listener.fds, lambda n: n <= base_fds, RELEASE_S)
    assert fds == base_fds, f"{fds - base_fds} fds still held {RELEASE_S:g} s after the close"
    # The first round's high-water mark is the allocator's; a second must not add to it.
    first = listener.rss()
    await _idle_round(listener, base_fds)
    fds = await _settle(listener.fds, lambda n: n <= base_fds, RELEASE_S)
    assert fds == base_fds
    rss = await _settle(listener.rss, lambda r: r <= first + RSS_SLACK, RELEASE_S)
    assert rss <= first + RSS_SLACK, f"RSS grew {(rss - first) >> 10} KiB in a second round"
    assert "Traceback" not in listener.output()


_TE = b"transfer-encoding: gzip, chunked\r\n"
_LOWER = b"get / HTTP/1.1\r\nhost: x\r\n\r\n"


async def test_a_coding_it_does_not_apply_is_501_and_a_lowercase_method_400(
    listener: Listener,
) -> None:
    gzip_chunked = b"POST / HTTP/1.1\r\nhost: x\r\n" + _TE + b"\r\n2\r\n{}\r\n0\r\n\r\n"
    if listener.max_connections < CONNECTIONS:  # the mirror: it knows GET and HEAD only
        gzip_chunked = gzip_chunked.replace(b"POST", b"GET")
    reply = await _exchange(listener.port, gzip_chunked)
    assert reply.startswith(b"HTTP/1.1 501 "), reply[:200]
    assert re.findall(rb"HTTP/1\.1 \d{3} ", reply) == [b"HTTP/1.1 501 "]  # and closed
    reply = await _exchange(listener.port, _LOWER)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert re.findall(rb"HTTP/1\.1 \d{3} ", reply) == [b"HTTP/1.1 400 "]
    # The control: the same request in capitals is served (any answer but a refusal).
    capitals = _LOWER.replace(b"get", b"GET").replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    reply = await _exchange(listener.port, capitals)
    assert reply[:12] not in (b"HTTP/1.1 400", b"HTTP/1.1 501"), reply[:200]
    assert "Traceback" not in listener.output()
