"""Connections beyond the pending-handshake cap wait in the kernel's accept queue.

The agents' listener (llmgw/rpc/_gate.py) holds at most `max_pending`
unauthenticated connections. When every one of them is in its TLS handshake, a
newcomer used to be closed at once with a reset, and in a register storm of
10,000 agents that meant resets, backoff and retries (38 s, and refused agents).
Now the listener stops accepting until a slot frees, and the newcomer, left in
the kernel's queue, is taken then and registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from helpers import NullSession, until

from llmgw import model
from llmgw.ctl import _cert
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo, _gate, _tls

HELLO = model.Hello(
    node_id="n1", agent_version="t", inventory=model.Inventory(host=model.Host("n1"))
)
TIMEOUT_S = 4.0  # generous: the holding is checked before it passes, on a shared machine


class Registry:
    def __init__(self) -> None:
        self.registered: list[str] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.registered.append(hello.node_id)
        return NullSession(), model.Settings(heartbeat_interval_s=60, epoch=1)


class Agent:
    async def inventory(self) -> model.Inventory:
        return HELLO.inventory


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    _cert.init_ca(d)
    _cert.issue_server(d, ["127.0.0.1"])
    _cert.issue_agent(d, "n1")
    return d


@contextlib.asynccontextmanager
async def closing_all(socks: list[socket.socket]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for s in socks:
            s.close()


def client_hello() -> bytes:
    """The first flight of a TLS client: after it, the server waits in its handshake."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    hello = outgoing.read()
    assert hello[:1] == b"\x16"
    return hello


def stalled_handshake(port: int) -> socket.socket:
    """A connection that opens a TLS handshake and never finishes it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(client_hello())
    return s


async def test_a_connection_beyond_the_cap_waits_and_then_registers(pki: Path) -> None:
    registry = Registry()
    server = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")
    tls = _tls.client_context(pki / "ca.crt", pki / "agent-n1.crt", pki / "agent-n1.key")
    limits = _gate.HandshakeLimits(timeout_s=TIMEOUT_S, max_pending=2)
    stalled: list[socket.socket] = []
    async with (
        closing_all(stalled),
        CapnpThread.open(handshake=limits) as bridge,
        trio.open_nursery() as nursery,
    ):
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server, registry)
        stats = bridge.statistics
        stalled.extend(stalled_handshake(port) for _ in range(2))
        await until("both handshakes pending", lambda: stats()["handshake_pending_tls"] == 2)
        filled_at = time.monotonic()

        registered_at: list[float] = []

        async def agent() -> None:
            async with bridge.connect("127.0.0.1", port, tls, agent=Agent()) as conn:
                await conn.register(HELLO)
            registered_at.append(time.monotonic())

        nursery.start_soon(agent)
        # The newcomer is not accepted while both slots hold a handshake...
        await until("the listener holding", lambda: stats()["handshake_holding"] == 1)
        now = stats()
        assert now["handshake_accepted"] == 2
        assert now["handshake_held_full"] == 1
        assert registry.registered == []
        # ...and is taken when they time out, then registers: waited, never reset.
        await until("n1 registered", lambda: registry.registered == ["n1"])
        await until("the agent's side done", lambda: registered_at)
        assert registered_at[0] - filled_at >= TIMEOUT_S * 0.9
        # The other stalled one may time out a moment after the agent got in.
        await until("both timed out", lambda: stats().get("handshake_timed_out_tls") == 2)
        now = stats()
        assert now["handshake_accepted"] == 3
        assert now["handshake_authenticated"] == 1
        assert now["handshake_holding"] == 0
        assert "handshake_refused_full" not in now
        nursery.cancel_scope.cancel()


async def test_a_silent_connection_still_makes_room_for_a_newcomer(pki: Path) -> None:
    """Holding is only for handshakes under way: a silent pending connection is evicted
    for the newcomer at once, as before (it costs an attacker nothing to hold)."""
    registry = Registry()
    server = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")
    tls = _tls.client_context(pki / "ca.crt", pki / "agent-n1.crt", pki / "agent-n1.key")
    limits = _gate.HandshakeLimits(timeout_s=30.0, max_pending=2)
    held: list[socket.socket] = []
    async with (
        closing_all(held),
        CapnpThread.open(handshake=limits) as bridge,
        trio.open_nursery() as nursery,
    ):
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server, registry)
        stats = bridge.statistics
        held += [stalled_handshake(port), socket.create_connection(("127.0.0.1", port))]
        await until("two pending", lambda: stats()["handshake_pending"] == 2)
        start = time.monotonic()
        async with bridge.connect("127.0.0.1", port, tls, agent=Agent()) as conn:
            await conn.register(HELLO)
        assert time.monotonic() - start < 10  # not the 30 s handshake deadline
        assert registry.registered == ["n1"]
        now = stats()
        assert now["handshake_evicted_silent"] == 1
        assert "handshake_held_full" not in now
        nursery.cancel_scope.cancel()


def test_a_client_hello_not_yet_read_is_not_taken_for_silence(pki: Path) -> None:
    """Under load a pending connection's ClientHello may have arrived before its reader
    ran; when a newcomer needs its slot, it goes on to its handshake, not to a reset."""
    server = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")

    async def main() -> None:
        listener = _gate.listening_socket("127.0.0.1", 0, 16)
        limits = _gate.HandshakeLimits(timeout_s=30.0, max_pending=1)
        gate = _gate.HandshakeGate(listener, server, asyncio.Protocol, limits)
        port = gate.port
        socks: list[socket.socket] = []
        try:
            socks.append(socket.create_connection(("127.0.0.1", port)))
            while gate.statistics()["pending"] < 1:
                await asyncio.sleep(0.01)
            assert gate.statistics()["pending_silent"] == 1
            # Its ClientHello arrives and a newcomer connects, before the loop runs again.
            socks[0].sendall(client_hello())
            socks.append(socket.create_connection(("127.0.0.1", port)))
            time.sleep(0.2)  # both in the kernel: the hello in the socket, the newcomer queued
            gate._on_accept()  # the listener's turn comes first
            stats = gate.statistics()
            assert stats.get("evicted_silent", 0) == 0
            assert stats["pending_tls"] == 1  # gone on to its handshake
            assert stats["holding"] == 1 and stats["accepted"] == 1  # the newcomer waits
            # When that handshake ends (here: dropped), the newcomer is taken.
            gate._drop(next(iter(gate._pending)))
            assert gate.statistics()["holding"] == 0
            while gate.statistics()["accepted"] < 2:
                await asyncio.sleep(0.01)
            assert gate.statistics()["pending_silent"] == 1
        finally:
            gate.close()
            for s in socks:
                s.close()

    asyncio.run(main())


def test_a_connection_its_agent_gave_up_on_gets_no_handshake(pki: Path) -> None:
    """A ClientHello that waited in the accept queue past the agent's own connect timeout
    (the agent closed): no handshake is attempted for it."""
    server = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")

    async def main() -> None:
        listener = _gate.listening_socket("127.0.0.1", 0, 16)
        gate = _gate.HandshakeGate(listener, server, asyncio.Protocol)
        try:
            # Before the loop runs again: connected, hello sent, closed (the agent gave up).
            s = socket.create_connection(("127.0.0.1", gate.port))
            s.sendall(client_hello())
            s.close()
            time.sleep(0.2)
            for _ in range(200):
                if gate.statistics().get("abandoned"):
                    break
                await asyncio.sleep(0.01)
            stats = gate.statistics()
            assert stats["abandoned"] == 1
            assert stats["pending"] == 0
            assert "refused_tls" not in stats and "authenticated" not in stats
        finally:
            gate.close()

    asyncio.run(main())
