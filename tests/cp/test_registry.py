"""The node registry with trio's MockClock: generations, and liveness of a silent agent."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import register

from llmgw import core, model
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.errors import RegistrationRefused

POLICY = core.LivenessPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, lost_after_s=10.0)


def usage(load1: float) -> model.Usage:
    return model.Usage(load1=load1)


def view(registry: NodeRegistry, node_id: str) -> model.NodeView:
    return next(v for v in registry.views() if v.node_id == node_id)


async def test_an_old_sessions_heartbeat_and_connection_loss_are_ignored(
    autojump_clock: Any,
) -> None:
    registry = NodeRegistry(POLICY)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        first_agent, first_peer, first = await register(registry, "a")
        gen1 = view(registry, "a").generation
        second_agent, second_peer, second = await register(registry, "a")
        gen2 = view(registry, "a").generation
        assert gen1 is not None and gen2 is not None and gen2 > gen1
        # The new registration released the old session's capability, not the new one's.
        assert (first_agent.released, second_agent.released) == (1, 0)

        await second.heartbeat(model.Heartbeat(seq=1, usage=usage(2.0)))
        await first.heartbeat(model.Heartbeat(seq=9, usage=usage(7.0)))  # stale: ignored
        rec = registry.record("a")
        assert rec is not None and rec.inventory.usage.load1 == 2.0

        # The old connection closing does not make the node unreachable ...
        first_peer.closed.set()
        await trio.sleep(0.5)
        assert view(registry, "a").state == "ready"
        assert second_agent.released == 0
        # ... the current one does.
        second_peer.closed.set()
        await trio.sleep(0.5)
        v = view(registry, "a")
        assert (v.state, v.state_reason, v.generation) == ("unreachable", "connection lost", gen2)
        assert second_agent.released == 1
        nursery.cancel_scope.cancel()


async def test_a_silent_but_connected_agent_becomes_unreachable_then_lost(
    autojump_clock: Any,
) -> None:
    registry = NodeRegistry(POLICY)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _agent, peer, session = await register(registry, "quiet")
        t0 = trio.current_time()
        await session.heartbeat(model.Heartbeat(seq=1))

        async def until(state: str) -> float:
            while view(registry, "quiet").state != state:
                await trio.sleep(0.1)
            return trio.current_time() - t0

        # Connected all along (peer.closed never set) but saying nothing: 3 missed
        # heartbeats of 1 s, seen at the next 1 s tick.
        gone = await until("unreachable")
        assert 3.0 < gone <= 4.5, gone
        assert view(registry, "quiet").state_reason.startswith("missed 3 heartbeats")
        assert not peer.closed.is_set()
        lost = await until("lost")
        assert 10.0 <= lost - gone <= 11.5, (gone, lost)
        assert "unreachable for 10 s (missed 3 heartbeats" in view(registry, "quiet").state_reason
        # A heartbeat on the still-open session brings it back.
        await session.heartbeat(model.Heartbeat(seq=2))
        v = view(registry, "quiet")
        assert (v.state, v.state_reason) == ("ready", "heartbeats resumed")
        nursery.cancel_scope.cancel()


async def test_heartbeats_in_time_keep_it_ready(autojump_clock: Any) -> None:
    registry = NodeRegistry(POLICY)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _agent, _peer, session = await register(registry, "busy")
        for seq in range(1, 30):
            await trio.sleep(1.0)
            await session.heartbeat(model.Heartbeat(seq=seq))
            assert view(registry, "busy").state == "ready", seq
        nursery.cancel_scope.cancel()


async def test_a_certificate_for_another_node_is_refused_and_released() -> None:
    registry = NodeRegistry(POLICY)
    from helpers import FakeAgent

    from llmgw.rpc import PeerInfo

    agent = FakeAgent("b")
    peer = PeerInfo(1, "10.0.0.9:5000", "a", trio.Event())
    hello = model.Hello("b", "test", model.Inventory(model.Host("b")))
    with pytest.raises(RegistrationRefused) as info:
        await registry.register(peer, hello, agent)  # type: ignore[arg-type]
    assert "certificate is for node 'a'" in str(info.value)
    assert "`llmgw ctl cert agent b`" in str(info.value)
    assert agent.released == 1 and registry.views() == []
