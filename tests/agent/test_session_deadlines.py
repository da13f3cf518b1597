"""The agent's calls on its control plane are bounded: a silent control plane costs a reconnect.

A control plane that keeps the connection and stops answering (SIGSTOP, a
partition without RST) used to leave the agent waiting; and a timed-out
heartbeat inside the session's nursery escaped as an exception group that
the reconnect loop did not catch.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import trio
from helpers import loopback_pki

from llmgw import model
from llmgw.agent._session import AgentSession, Backoff
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo


class HangingSession:
    def __init__(self, hang: bool) -> None:
        self.hang = hang
        self.beats = 0

    async def heartbeat(self, beat: model.Heartbeat) -> None:
        self.beats += 1
        if self.hang:
            await trio.sleep_forever()

    async def shard_status(self, shard: model.ShardReport) -> None:
        pass

    async def progress(self, progress: model.Progress) -> None:
        pass


class Registry:
    """The first session's heartbeats never answer; the second's do."""

    def __init__(self) -> None:
        self.sessions: list[HangingSession] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        session = HangingSession(hang=not self.sessions)
        self.sessions.append(session)
        return session, model.Settings(heartbeat_interval_s=0.2, epoch=1)


async def test_a_heartbeat_that_is_never_answered_makes_the_agent_reconnect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent.session")
    server_tls, client_tls = loopback_pki(tmp_path, "n1")
    registry = Registry()

    async def inventory() -> model.Inventory:
        return model.Inventory(host=model.Host("n1"))

    async def heartbeat(seq: int) -> model.Heartbeat:
        return model.Heartbeat(seq=seq)

    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, registry)
        session = AgentSession(
            node_id="n1",
            addresses=[("127.0.0.1", port)],
            tls=client_tls,
            servant=object(),
            hello_inventory=inventory,
            heartbeat=heartbeat,
            backoff=Backoff(initial_s=0.05, max_s=0.05),
            rng=random.Random(0),
        )
        nursery.start_soon(session.run, bridge)
        start = trio.current_time()
        with trio.fail_after(15):
            while len(registry.sessions) < 2 or registry.sessions[1].beats < 1:
                await trio.sleep(0.05)
        # One beat hung for its deadline (2 x 0.2 s, at least 1 s), then a new session beats.
        assert registry.sessions[0].beats == 1
        assert trio.current_time() - start < 5
        assert session.registrations == 2
        nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert f"control plane 127.0.0.1:{port}: did not answer heartbeat in 1 s" in messages
