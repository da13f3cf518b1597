"""The `Registry` and `NodeSession` capabilities: each one's trio handle beside its
capnp server, and the servant Protocols the control plane implements.

The control plane serves `Registry` as its bootstrap (`_RegistryImpl`, one per
connection, over a `RegistryServant`); an agent's `register` passes its
`Agent` (llmgw/rpc/_agent.py) and gets a `NodeSession` back (`_SessionImpl`,
over the `SessionServant` that `register` returned). The agent holds a
`RegistryHandle` and then a `SessionHandle`.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import trio

from llmgw import model
from llmgw.rpc import _codec
from llmgw.rpc._agent import AgentHandle, AgentImpl, AgentServant
from llmgw.rpc._schema import schema
from llmgw.rpc._thread import Bridge, Conn, Handle


@attrs.frozen
class PeerInfo:
    """Who is on the other end of an inbound connection."""

    conn_id: int
    address: str
    common_name: str | None
    closed: trio.Event = attrs.field(eq=False, repr=False)


class SessionServant(Protocol):
    async def heartbeat(self, beat: model.Heartbeat) -> None: ...
    async def shard_status(self, shard: model.ShardReport) -> None: ...
    async def progress(self, progress: model.Progress) -> None: ...


class RegistryServant(Protocol):
    async def register(
        self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle
    ) -> tuple[SessionServant, model.Settings]: ...


# --- Registry ---------------------------------------------------------------------------


class RegistryHandle(Handle):
    """The agent's hold on a control plane's bootstrap `Registry`."""

    async def register(
        self,
        hello: model.Hello,
        agent: AgentServant,
        conn_id: int,
        *,
        deadline: float | None = 30.0,
    ) -> tuple[SessionHandle, model.Settings]:
        bridge = self._bridge

        async def register() -> tuple[int, model.Settings]:
            registry = bridge.cap(self._cap_id, "register")
            conn = bridge.conns.get(conn_id)
            request = registry.register_request()
            _codec.encode(hello, request.hello)
            request.agent = AgentImpl(bridge, agent, conn)
            response = await request.send()
            settings = _codec.decode(model.Settings, response.settings)
            return bridge.keep(response.session, conn), settings

        session_id, settings = await bridge.run(register, what="register", deadline=deadline)
        return SessionHandle(bridge, session_id), settings


class RegistryImpl(schema.Registry.Server):  # type: ignore[misc]
    """The control plane's bootstrap on one inbound connection (capnp thread)."""

    def __init__(
        self, bridge: Bridge, conn: Conn, peer: PeerInfo, servant: RegistryServant
    ) -> None:
        self._bridge = bridge
        self._conn = conn
        self._peer = peer
        self._servant = servant

    async def register_context(self, context: Any) -> None:
        bridge = self._bridge
        hello = _codec.decode(model.Hello, context.params.hello)
        agent = AgentHandle(bridge, bridge.keep(context.params.agent, self._conn))
        session, settings = await bridge.answer(self._servant.register, self._peer, hello, agent)
        context.results.session = _SessionImpl(bridge, session)
        _codec.encode(settings, context.results.init("settings"))


# --- NodeSession ------------------------------------------------------------------------


class SessionHandle(Handle):
    """The agent's hold on its `NodeSession`; `deadline` bounds each call (seconds)."""

    async def heartbeat(self, beat: model.Heartbeat, *, deadline: float | None = None) -> None:
        bridge = self._bridge

        async def heartbeat() -> None:
            request = bridge.cap(self._cap_id, "heartbeat").heartbeat_request()
            _codec.encode(beat, request.beat)
            await request.send()

        await bridge.run(heartbeat, what="heartbeat", deadline=deadline)

    async def shard_status(
        self, shard: model.ShardReport, *, deadline: float | None = None
    ) -> None:
        bridge = self._bridge

        async def shard_status() -> None:
            request = bridge.cap(self._cap_id, "shardStatus").shardStatus_request()
            _codec.encode(shard, request.shard)
            await request.send()

        await bridge.run(shard_status, what="shardStatus", deadline=deadline)

    async def progress(self, progress: model.Progress, *, deadline: float | None = None) -> None:
        bridge = self._bridge

        async def progress_() -> None:
            request = bridge.cap(self._cap_id, "progress").progress_request()
            _codec.encode(progress, request.progress)
            await request.send()

        await bridge.run(progress_, what="progress", deadline=deadline)


class _SessionImpl(schema.NodeSession.Server):  # type: ignore[misc]
    def __init__(self, bridge: Bridge, servant: SessionServant) -> None:
        self._bridge = bridge
        self._servant = servant

    async def heartbeat_context(self, context: Any) -> None:
        beat = _codec.decode(model.Heartbeat, context.params.beat)
        await self._bridge.answer(self._servant.heartbeat, beat)

    async def shardStatus_context(self, context: Any) -> None:
        shard = _codec.decode(model.ShardReport, context.params.shard)
        await self._bridge.answer(self._servant.shard_status, shard)

    async def progress_context(self, context: Any) -> None:
        progress = _codec.decode(model.Progress, context.params.progress)
        await self._bridge.answer(self._servant.progress, progress)
