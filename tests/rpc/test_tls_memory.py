"""What a connected agent's TLS costs the control plane, in Python memory.

asyncio's TLS protocol allocates a receive buffer per connection (256 KiB in
asyncio, 32 KiB in llmgw's TlsProtocol before), a third of the 100 KiB an
agent may cost at 10,000 agents. TlsProtocol now shares one per thread, and
keeps only the subject of the peer's parsed certificate. Measured with
tracemalloc over real registrations through the real listener and dialler.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest
import trio
from helpers import NullSession

from llmgw import model
from llmgw.ctl import _cert
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo, _gate, _tls

AGENTS = 30


class Registry:
    def __init__(self) -> None:
        self.peers: list[str | None] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.peers.append(peer.common_name)
        return NullSession(), model.Settings(heartbeat_interval_s=60, epoch=1)


class Agent:
    async def inventory(self) -> model.Inventory:
        return model.Inventory(host=model.Host("n"))


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    _cert.init_ca(d)
    _cert.issue_server(d, ["127.0.0.1"])
    for i in range(AGENTS):
        _cert.issue_agent(d, f"n{i}")
    return d


async def test_connected_agents_share_one_tls_receive_buffer(pki: Path) -> None:
    registry = Registry()
    server = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")
    contexts = [
        _tls.client_context(pki / "ca.crt", pki / f"agent-n{i}.crt", pki / f"agent-n{i}.key")
        for i in range(AGENTS)
    ]
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server, registry)
        # One first, so what any connection costs once (the shared buffer) is in the baseline.
        connected = trio.Semaphore(0)
        release = trio.Event()

        async def agent(i: int) -> None:
            hello = model.Hello(
                node_id=f"n{i}", agent_version="t", inventory=model.Inventory(model.Host("n"))
            )
            async with bridge.connect("127.0.0.1", port, contexts[i], agent=Agent()) as conn:
                session, _ = await conn.register(hello)
                connected.release()
                await release.wait()
                session.release()

        nursery.start_soon(agent, 0)
        await connected.acquire()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for i in range(1, AGENTS):
                nursery.start_soon(agent, i)
            with trio.fail_after(60):
                for _ in range(1, AGENTS):
                    await connected.acquire()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert sorted(registry.peers) == sorted(f"n{i}" for i in range(AGENTS))

        protocols = [o for o in gc.get_objects() if isinstance(o, _gate.TlsProtocol)]
        # Both ends of every connection live in this process (the test dials itself).
        assert len(protocols) >= 2 * AGENTS
        assert len({id(p._ssl_buffer_view.obj) for p in protocols}) == 1
        served = [p for p in protocols if p._server_side]
        assert all(set(p._extra["peercert"]) == {"subject"} for p in served)

        # asyncio's TLS protocol module, per connection end: no receive buffer (it was
        # 32 KiB), only the protocol's own objects.
        sslproto = sum(
            d.size_diff
            for d in after.compare_to(before, "filename")
            if d.traceback[0].filename.endswith("asyncio/sslproto.py")
        )
        per_end = sslproto / (2 * (AGENTS - 1))
        assert per_end < 4096, f"{per_end:.0f} bytes per connection end in asyncio/sslproto.py"
        release.set()
        nursery.cancel_scope.cancel()
