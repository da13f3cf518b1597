"""The RPC boundary: real TLS over loopback, both ends in this process."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import trio

from llmgw import model
from llmgw.ctl import _cert
from llmgw.errors import Disconnected, NotImplementedRemotely, RegistrationRefused
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo, _tls


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    _cert.init_ca(tmp_path)
    _cert.issue_server(tmp_path, ["127.0.0.1", "localhost"])
    for node in ("node-a", "node-b"):
        _cert.issue_agent(tmp_path, node)
    return tmp_path


def server_tls(pki: Path):
    return _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")


def client_tls(pki: Path, node: str):
    return _tls.client_context(pki / "ca.crt", pki / f"agent-{node}.crt", pki / f"agent-{node}.key")


class Session:
    def __init__(self) -> None:
        self.beats: list[model.Heartbeat] = []
        self.progress_seen: list[model.Progress] = []

    async def heartbeat(self, beat: model.Heartbeat) -> None:
        self.beats.append(beat)

    async def shard_status(self, shard: model.ShardReport) -> None:
        pass

    async def progress(self, progress: model.Progress) -> None:
        self.progress_seen.append(progress)


class Registry:
    def __init__(self) -> None:
        self.peers: list[PeerInfo] = []
        self.hellos: list[model.Hello] = []
        self.agents: list[AgentHandle] = []
        self.session = Session()
        self.slow_cancelled = 0

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        if hello.node_id == "slow":
            self.peers.append(peer)
            try:
                await trio.sleep_forever()
            finally:
                self.slow_cancelled += 1
        if peer.common_name != hello.node_id:
            raise RegistrationRefused(f"refused: cert {peer.common_name} claims {hello.node_id}")
        self.peers.append(peer)
        self.hellos.append(hello)
        self.agents.append(agent)
        return self.session, SETTINGS


SETTINGS = model.Settings(heartbeat_interval_s=2.5, epoch=7, mirror_port=8082, mirror_tls=True)


class Agent:
    def __init__(self, inv: model.Inventory) -> None:
        self.inv = inv
        self.reclaims: list[tuple[int, tuple[str, ...], bool]] = []

    async def inventory(self) -> model.Inventory:
        await trio.sleep(0.01)
        return self.inv

    async def reclaim(self, epoch: int, paths: tuple[str, ...], dry_run: bool) -> model.Reclaimed:
        self.reclaims.append((epoch, paths, dry_run))
        return model.Reclaimed(
            removed=paths[:1],
            freed_bytes=0 if dry_run else 123,
            refused=tuple(model.Refusal(p, "not a cache name", f"{p}: no") for p in paths[1:]),
        )


FULL = model.Inventory(
    host=model.Host(hostname="h", os_like=("debian",), cpu_count=4, cpu_flags=("avx2",)),
    usage=model.Usage(memory_total_bytes=10, memory_available_bytes=0, load1=0.0),
    gpus=(
        model.Gpu(
            index=0,
            uuid="GPU-1",
            name="NVIDIA H100",
            gpu_class="h100-79g",
            memory_total_mib=81559,
            utilization_pct=None,
            numa_node=0,
        ),
    ),
    topology=model.Topology(nvlinks=(model.NvLink(0, 1, 18),)),
    fabrics=(model.Fabric("ib-a", ("mlx5_0",), 400.0, "ib0"), model.Fabric("roce", (), None)),
    engines=model.Engines(found=()),
    warnings=("w",),
)


async def test_register_heartbeat_and_call_back(pki: Path) -> None:
    registry = Registry()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect(
            "127.0.0.1", port, client_tls(pki, "node-a"), agent=Agent(FULL)
        ) as conn:
            hello = model.Hello(node_id="node-a", agent_version="t", inventory=FULL)
            session, settings = await conn.register(hello)
            assert settings == SETTINGS
            # Absent stays absent, zero stays zero, empty stays empty, across the wire.
            assert registry.hellos == [hello]
            assert registry.peers[0].common_name == "node-a"
            await session.heartbeat(model.Heartbeat(seq=3, usage=model.Usage(load1=1.5)))
            assert registry.session.beats == [model.Heartbeat(seq=3, usage=model.Usage(load1=1.5))]
            # The control plane calls back into the agent over the same connection.
            assert await registry.agents[0].inventory() == FULL
            with pytest.raises(NotImplementedRemotely, match=r"^logSources: log_sources is not"):
                await registry.agents[0].call_unimplemented("logSources")
            # Progress is keyed by source; reclaim carries what was removed and refused.
            progress = model.Progress(source="mirror:/tiny/", done_bytes=5, total_bytes=None)
            await session.progress(progress)
            assert registry.session.progress_seen == [progress]
            got = await registry.agents[0].reclaim(9, ("/w/src-a", "/w/mine"), False)
            assert got == model.Reclaimed(
                removed=("/w/src-a",),
                freed_bytes=123,
                refused=(model.Refusal("/w/mine", "not a cache name", "/w/mine: no"),),
            )
        # The agent closed: the server side learns it, and its capabilities break.
        with trio.fail_after(5):
            await registry.peers[0].closed.wait()
        with pytest.raises(Disconnected):
            await registry.agents[0].inventory()
        nursery.cancel_scope.cancel()


async def test_cn_mismatch_refused_with_both_names(pki: Path) -> None:
    registry = Registry()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect(
            "127.0.0.1", port, client_tls(pki, "node-a"), agent=Agent(FULL)
        ) as conn:
            hello = model.Hello(node_id="node-b", agent_version="t", inventory=FULL)
            with pytest.raises(RegistrationRefused, match=r"node-a.*node-b"):
                await conn.register(hello)
        nursery.cancel_scope.cancel()


async def test_cancel_propagates_and_dropped_connection_fails_pending_calls(pki: Path) -> None:
    registry = Registry()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect(
            "127.0.0.1", port, client_tls(pki, "node-a"), agent=Agent(FULL)
        ) as conn:
            slow = model.Hello(node_id="slow", agent_version="t", inventory=FULL)
            # Cancelling the trio caller cancels the call, down to the servant on the far side.
            with trio.move_on_after(0.3) as scope:
                await conn.register(slow)
            assert scope.cancelled_caught
            with trio.fail_after(5):
                while registry.slow_cancelled < 1:
                    await trio.sleep(0.01)
            # A pending call fails promptly when the other side drops the connection,
            # and the servant's task is cancelled.
            failures: list[BaseException] = []

            async def pending() -> None:
                try:
                    await conn.register(slow)
                except Disconnected as exc:
                    failures.append(exc)

            async with trio.open_nursery() as n:
                n.start_soon(pending)
                with trio.fail_after(5):
                    while len(registry.peers) < 2:
                        await trio.sleep(0.01)
                with trio.fail_after(5):
                    await bridge.close_connection(registry.peers[-1].conn_id)
            assert len(failures) == 1
            with trio.fail_after(5):
                await conn.closed.wait()
                while registry.slow_cancelled < 2:
                    await trio.sleep(0.01)
        assert bridge.calls_in_flight == 0
        nursery.cancel_scope.cancel()


async def test_thousand_connections_and_capabilities_with_gc(pki: Path) -> None:
    """Handles collected on the trio thread never destroy capnp objects there."""
    registry = Registry()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        tls = client_tls(pki, "node-a")
        hello = model.Hello(
            node_id="node-a",
            agent_version="t",
            inventory=model.Inventory(host=model.Host(hostname="h")),
        )
        for i in range(1000):
            async with bridge.connect("127.0.0.1", port, tls, agent=Agent(FULL)) as conn:
                session, _ = await conn.register(hello)
                if i % 3 == 0:
                    await session.heartbeat(model.Heartbeat(seq=i))
                del session
            if i % 50 == 0:
                registry.agents.clear()
                registry.peers.clear()
                gc.collect()
        registry.agents.clear()
        gc.collect()
        with trio.fail_after(10):
            while bridge.statistics()["connections"] or bridge.statistics()["capabilities"] > 1:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
