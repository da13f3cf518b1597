"""The agent's session loop against real control-plane listeners on loopback."""

from __future__ import annotations

import random
from pathlib import Path

import trio

from llmgw import model
from llmgw.agent._session import AgentSession, Backoff
from llmgw.ctl import _cert
from llmgw.errors import RegistrationRefused
from llmgw.rpc import STANDBY_PREFIX, AgentHandle, CapnpThread, PeerInfo, _tls
from llmgw.testing.cluster import free_port


class Session:
    async def heartbeat(self, beat: model.Heartbeat) -> None:
        pass

    async def shard_status(self, shard: model.ShardReport) -> None:
        pass

    async def progress(self, progress: model.Progress) -> None:
        pass


class Standby:
    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.refused = 0

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.refused += 1
        agent.release()
        raise RegistrationRefused(f"{STANDBY_PREFIX}{self.leader}")


class Leader:
    def __init__(self) -> None:
        self.registered: list[str] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.registered.append(hello.node_id)
        return Session(), model.Settings(heartbeat_interval_s=60, epoch=1)


async def test_a_standby_refusal_moves_on_to_the_leader_at_once(tmp_path: Path) -> None:
    _cert.init_ca(tmp_path)
    _cert.issue_server(tmp_path, ["127.0.0.1"])
    _cert.issue_agent(tmp_path, "n1")
    server_tls = _tls.server_context(
        tmp_path / "ca.crt", tmp_path / "server.crt", tmp_path / "server.key"
    )
    client_tls = _tls.client_context(
        tmp_path / "ca.crt", tmp_path / "agent-n1.crt", tmp_path / "agent-n1.key"
    )
    leader = Leader()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        leader_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, leader)
        standby = Standby(f"127.0.0.1:{leader_port}")
        standby_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, standby)
        dead = free_port()

        async def inventory() -> model.Inventory:
            return model.Inventory(host=model.Host("n1"))

        async def heartbeat(seq: int) -> model.Heartbeat:
            return model.Heartbeat(seq=seq)

        # The standby is listed first; the leader is not listed at all, only named
        # in the refusal; a huge backoff proves no backoff happened on the way.
        session = AgentSession(
            node_id="n1",
            addresses=[("127.0.0.1", standby_port), ("127.0.0.1", dead)],
            tls=client_tls,
            servant=object(),
            hello_inventory=inventory,
            heartbeat=heartbeat,
            backoff=Backoff(initial_s=600, max_s=600),
            rng=random.Random(0),
        )
        nursery.start_soon(session.run, bridge)
        with trio.fail_after(10):
            await session.connected.wait()
        assert standby.refused == 1
        assert leader.registered == ["n1"]
        assert session.registered_with == f"127.0.0.1:{leader_port}"
        nursery.cancel_scope.cancel()
