"""The network: dial a control plane, listen for agents, accept them.

`CapnpThread` is the bridge (llmgw/rpc/_thread.py) with its connections:
`connect` dials (the agent's side, yielding a `ClientConnection` whose
`registry` is the bootstrap) and `serve` listens (the control plane's side,
behind the handshake gate of llmgw/rpc/_gate.py, bootstrapping a
`RegistryImpl` per connection). `_Shim` sits between asyncio's TLS transport
and pycapnp's stream on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import capnp
import trio

from llmgw import model
from llmgw.errors import Disconnected, LlmgwError, TlsRefused
from llmgw.rpc import _gate, _tls
from llmgw.rpc._agent import AgentServant
from llmgw.rpc._registry import (
    PeerInfo,
    RegistryHandle,
    RegistryImpl,
    RegistryServant,
    SessionHandle,
)
from llmgw.rpc._schema import schema
from llmgw.rpc._thread import Bridge, Conn
from llmgw.rpc._wire import Deadlines

log = logging.getLogger("llmgw.rpc")


class CapnpThread(Bridge):
    """The capnp thread (`Bridge`: asyncio + KJ, where every capnp object lives) with
    its connections: what the control plane and the agent open (`CapnpThread.open`)."""

    def __init__(
        self,
        *,
        deadlines: Deadlines | None = None,
        handshake: _gate.HandshakeLimits | None = None,
    ) -> None:
        super().__init__(deadlines=deadlines)
        self.handshake = handshake or _gate.HandshakeLimits()
        self._gates: list[_gate.HandshakeGate] = []
        # Outbound connections: their shim and what was dialled, to explain a refusal.
        self._dial_info: dict[int, tuple[_Shim, tuple[Any, ...]]] = {}

    def statistics(self) -> dict[str, int]:
        stats = super().statistics()
        # Read from trio while the capnp thread changes them: a snapshot, good enough to watch.
        for gate in list(self._gates):
            for key, value in gate.statistics().items():
                stats[f"handshake_{key}"] = stats.get(f"handshake_{key}", 0) + value
        return stats

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        *,
        deadlines: Deadlines | None = None,
        handshake: _gate.HandshakeLimits | None = None,
    ) -> AsyncIterator[CapnpThread]:
        """Start the thread; `deadlines` bound calls on agents, `handshake` the agents' listener."""
        self = cls(deadlines=deadlines, handshake=handshake)
        async with self.running():
            yield self

    async def close_all(self) -> None:
        for gate in self._gates:
            gate.close()
        self._gates.clear()
        await super().close_all()
        self._dial_info.clear()
        # A TLS close waits for the peer's close_notify: give that a moment,
        # then abort what is left, so no transport outlives this loop.
        closing = [asyncio.ensure_future(shim.lost_event.wait()) for shim in _Shim.live]
        if closing:
            await asyncio.wait(closing, timeout=1.0)
        for task in closing:
            task.cancel()
        for shim in list(_Shim.live):
            shim.abort()

    # dial --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def connect(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext,
        *,
        agent: AgentServant | None = None,
        timeout: float = 10.0,
        cert_path: Path | None = None,
        node: str | None = None,
    ) -> AsyncIterator[ClientConnection]:
        """Dial a control plane; yields a connection whose `registry` is the bootstrap.

        `cert_path` (this side's certificate) and `node` (its node id) are only
        named in the sentence that explains a TLS refusal.
        """
        closed = trio.Event()
        conn_id, registry_id = await self.run(
            self._dial, host, port, tls, timeout, closed, cert_path, node
        )
        conn = ClientConnection(
            self, conn_id, f"{host}:{port}", RegistryHandle(self, registry_id), closed
        )
        conn._agent_servant = agent
        try:
            yield conn
        finally:
            conn.registry.release()
            with trio.CancelScope(shield=True):
                await self.close_connection(conn_id)

    async def _dial(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext,
        timeout: float,
        closed: trio.Event,
        cert_path: Path | None,
        node: str | None,
    ) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        streams: list[Any] = []
        shim = _Shim(lambda stream, _: streams.append(stream))
        failure: ssl.SSLError | None = None
        try:
            await asyncio.wait_for(
                _gate.open_tls(
                    lambda factory: loop.create_connection(factory, host, port),
                    shim,
                    tls,
                    server_side=False,
                    server_hostname=host,
                    timeout=timeout,
                ),
                timeout,
            )
        except ssl.SSLError as exc:
            failure = exc
        except TimeoutError:
            raise Disconnected(f"no answer within {timeout:g} s") from None
        except ConnectionRefusedError:
            raise Disconnected(
                "connection refused (is llmgw-cp running and listening there?)"
            ) from None
        except (ConnectionResetError, ConnectionAbortedError):
            # The control plane closed at once: its log says why (a full listener, ...).
            raise TlsRefused(
                _tls.describe_tls_failure(
                    ConnectionResetError(), host, port, cert_path=cert_path, node=node
                )
            ) from None
        except OSError as exc:
            raise Disconnected(f"cannot connect: {exc.strerror or exc}") from None
        if failure is not None:
            # Say which names the certificate does hold: one more, unverified, look at it.
            presented = await loop.run_in_executor(
                None, functools.partial(_tls.fetch_server_certificate, host, port, timeout=3.0)
            )
            message = _tls.describe_tls_failure(
                failure, host, port, server_cert=presented, cert_path=cert_path, node=node
            )
            raise TlsRefused(message)
        stream = streams[0]
        client = capnp.TwoPartyClient(stream)
        conn = Conn(next(self.ids), client, stream, closed, self)
        self._dial_info[conn.conn_id] = (shim, (host, port, tls, cert_path, node))
        self.conns[conn.conn_id] = conn
        conn.watch(client.on_disconnect())
        registry = client.bootstrap().cast_as(schema.Registry)
        return conn.conn_id, self.keep(registry, conn)

    async def tls_refusal(self, conn_id: int) -> str | None:
        """Why the control plane dropped this connection, if a TLS refusal is why.

        With TLS 1.3 the control plane refuses a client certificate after the
        agent's side of the handshake is done: the agent learns it from an
        alert on its next read, or, when it had already written, perhaps only
        from the reset after that alert. In that case one more handshake,
        which writes nothing, reads the alert (`_tls.probe_refusal`).
        """

        async def explain() -> str | None:
            entry = self._dial_info.get(conn_id)
            if entry is None:
                return None
            shim, (host, port, tls, cert_path, node) = entry
            lost = shim.lost
            if not isinstance(lost, ssl.SSLError):
                if not isinstance(lost, ConnectionError):
                    return None  # closed cleanly: not a TLS refusal
                lost = await asyncio.get_running_loop().run_in_executor(
                    None, functools.partial(_tls.probe_refusal, host, port, tls, timeout=3.0)
                )
                if lost is None:
                    return None
            return _tls.describe_tls_failure(lost, host, port, cert_path=cert_path, node=node)

        try:
            return await self.run(explain)
        except Disconnected:
            return None

    async def close_connection(self, conn_id: int) -> None:
        async def close() -> None:
            conn = self.conns.get(conn_id)
            if conn is not None:
                conn.close()
            self._dial_info.pop(conn_id, None)

        with contextlib.suppress(Disconnected):
            await self.run(close)

    # listen and accept ----------------------------------------------------------------

    async def serve(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext,
        servant: RegistryServant,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen for agents until cancelled; reports the bound port when listening.

        Unauthenticated connections are bounded by `self.handshake` (see
        llmgw.rpc._gate): a deadline, a cap, and no TLS buffers for a peer
        that has not begun a TLS handshake.
        """
        server_id, bound = await self.run(self._listen, host, port, tls, servant)
        try:
            task_status.started(bound)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):

                async def stop() -> None:
                    gate = self.drop(server_id)
                    if gate is not None:
                        gate.close()
                        with contextlib.suppress(ValueError):
                            self._gates.remove(gate)

                with contextlib.suppress(Disconnected):
                    await self.run(stop)

    async def _listen(
        self, host: str, port: int, tls: ssl.SSLContext, servant: RegistryServant
    ) -> tuple[int, int]:
        def protocol_factory() -> asyncio.BaseProtocol:
            # Built for a connection that began a TLS handshake; the capnp side
            # of it only once that handshake succeeded.
            return _Shim(lambda stream, transport: self._accept(stream, transport, servant))

        _gate.raise_open_files_limit()
        try:
            sock = _gate.listening_socket(host, port, self.handshake.backlog)
        except OSError as exc:
            raise LlmgwError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        gate = _gate.HandshakeGate(sock, tls, protocol_factory, self.handshake)
        self._gates.append(gate)
        return self.keep(gate, None), gate.port

    async def _accept(self, stream: Any, transport: Any, servant: RegistryServant) -> None:
        peername = transport.get_extra_info("peername") if transport is not None else None
        peercert = transport.get_extra_info("peercert") if transport is not None else None
        address = _tls.format_peer(peername)
        closed = trio.Event()
        conn = Conn(next(self.ids), None, stream, closed, self)
        peer = PeerInfo(conn.conn_id, address, _tls.peer_common_name(peercert), closed)
        server = capnp.TwoPartyServer(stream, bootstrap=RegistryImpl(self, conn, peer, servant))
        conn.rpc = server
        self.conns[conn.conn_id] = conn
        try:
            await server.on_disconnect()
        except Exception as exc:  # a reset ends here too
            log.debug("connection %s from %s ended: %s", conn.conn_id, address, exc)
        finally:
            conn.close()


class _Shim(asyncio.BufferedProtocol):
    """Between asyncio's TLS transport and pycapnp's protocol.

    pycapnp's protocol (and the C++ stream behind it) is made only once the
    TLS handshake has succeeded, so a refused or silent peer costs none of it;
    and the exception that ended the connection is kept (`lost`), so a TLS
    alert received after the handshake can be named.
    """

    # Every connected one, to close what is left when the thread stops.
    live: weakref.WeakSet[_Shim] = weakref.WeakSet()

    def __init__(self, on_stream: Callable[[Any, asyncio.BaseTransport], Any]) -> None:
        self._on_stream = on_stream
        self._inner: Any = None
        self._transport: asyncio.BaseTransport | None = None
        self.closed = False
        self.lost_event = asyncio.Event()
        self.lost: BaseException | None = None

    def abort(self) -> None:
        if not self.closed and isinstance(self._transport, asyncio.Transport):
            self._transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        _Shim.live.add(self)
        on_stream = self._on_stream
        self._inner = capnp.AsyncIoStream._connect(lambda stream: on_stream(stream, transport))
        self._inner.connection_made(transport)

    def get_buffer(self, sizehint: int) -> Any:
        return self._inner.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._inner.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received()
        return result

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc
        self.closed = True
        self.lost_event.set()
        _Shim.live.discard(self)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class ClientConnection:
    """An agent's connection to a control plane (trio side)."""

    def __init__(
        self,
        bridge: CapnpThread,
        conn_id: int,
        address: str,
        registry: RegistryHandle,
        closed: trio.Event,
    ) -> None:
        self.bridge = bridge
        self.conn_id = conn_id
        self.address = address
        self.registry = registry
        self.closed = closed
        self._agent_servant: AgentServant | None = None

    def __repr__(self) -> str:
        return f"<ClientConnection {self.address} closed={self.closed.is_set()}>"

    async def register(
        self, hello: model.Hello, *, deadline: float | None = 30.0
    ) -> tuple[SessionHandle, model.Settings]:
        """Register; a connection the control plane dropped at TLS raises `TlsRefused`."""
        if self._agent_servant is None:
            raise LlmgwError("connect(agent=...) is needed to register")
        try:
            return await self.registry.register(
                hello, self._agent_servant, self.conn_id, deadline=deadline
            )
        except Disconnected:
            refusal = await self.bridge.tls_refusal(self.conn_id)
            if refusal is None:
                raise
        raise TlsRefused(refusal)
