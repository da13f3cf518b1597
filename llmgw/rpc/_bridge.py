"""The RPC boundary: pycapnp on its own thread, bridged to trio.

pycapnp 2.x runs only on an asyncio loop with KJ attached (`capnp.kj_loop()`),
and a capnp object destroyed on a thread without that loop aborts the
process. So every capnp object lives on one dedicated thread (`CapnpThread`),
and the rule is: **no capnp object crosses into trio code**.

- Calls from trio run as coroutines on the capnp thread
  (`run_coroutine_threadsafe`); their results are converted to attrs values
  there, and errors are rebuilt as llmgw errors *outside* the `except` block,
  so neither a KjException nor a traceback frame holding a capnp reader
  reaches trio.
- Capabilities stay in a table on the capnp thread; trio holds handles (an
  integer id and the bridge). A handle released from trio, or collected
  there, schedules its removal on the capnp thread.
- Calls into trio (the servants behind Registry, NodeSession, Agent) are
  scheduled with `TrioToken.run_sync_soon` into a nursery the bridge owns and
  answered through an asyncio future; cancelling either side cancels the
  other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import ssl
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import attrs
import capnp
import trio

from llmgw import errors, model
from llmgw.errors import (
    DeadlineExceeded,
    Disconnected,
    LlmgwError,
    NotImplementedRemotely,
    PeerError,
    RemoteError,
    TlsRefused,
)
from llmgw.rpc import _codec, _gate, _tls

log = logging.getLogger("llmgw.rpc")

T = TypeVar("T")

_SCHEMA_PATH = Path(__file__).with_name("llmgw.capnp")
schema: Any = capnp.load(str(_SCHEMA_PATH))


# --- Deadlines ----------------------------------------------------------------------

# The control plane's calls on an agent, by their schema names.
AGENT_CALLS = frozenset(
    {
        "inventory",
        "startShard",
        "stopShard",
        "drain",
        "logs",
        "reclaim",
        "engineCheck",
        "declareEngines",
        "logSources",
    }
)
_DEFAULT_PER_CALL: Mapping[str, float] = {
    # A full discovery (NVML or nvidia-smi, topology, engine probes) on the agent.
    "inventory": 30.0,
    # Runs the engine's --help, which the agent bounds at 60 s (SGLang imports torch).
    "engineCheck": 90.0,
    # Describes the weights directory (up to 200,000 entries) and deletes whole entries.
    "reclaim": 120.0,
}


def _per_call(value: Mapping[str, float]) -> dict[str, float]:
    merged = {**_DEFAULT_PER_CALL, **value}
    unknown = sorted(set(merged) - AGENT_CALLS)
    if unknown:
        raise ValueError(
            f"no agent call named {', '.join(unknown)}; known: {', '.join(sorted(AGENT_CALLS))}"
        )
    for name, seconds in merged.items():
        if not 0 < seconds <= 3600:
            raise ValueError(f"deadline of {name}: {seconds!r} s; use more than 0, at most 3600")
    return merged


@attrs.frozen
class Deadlines:
    """How long the control plane waits for an agent to answer, per call (seconds).

    On expiry the call is cancelled (down to the agent's servant) and raises
    `DeadlineExceeded("did not answer CALL in N s")`. `startShard` answers as
    soon as the spec is on disk and the first process is scheduled (loading the
    engine happens after), so it keeps the default. `stopShard` waits on the
    agent for the engine to exit, up to the grace it is given: its deadline is
    that grace plus `default_s`. Log streams (a `LogSink` being fed) have none.
    """

    default_s: float = attrs.field(default=10.0)
    per_call: Mapping[str, float] = attrs.field(factory=dict, converter=_per_call)

    @default_s.validator
    def _check_default(self, _: object, value: float) -> None:
        if not 0 < value <= 3600:
            raise ValueError(f"default deadline {value!r} s; use more than 0, at most 3600")

    def of(self, call: str, extra_s: float = 0.0) -> float:
        return self.per_call.get(call, self.default_s) + max(0.0, extra_s)


# --- Servants: what trio code implements -------------------------------------


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


class AgentServant(Protocol):
    """What an agent answers. Methods it lacks answer "not implemented"."""

    async def inventory(self) -> model.Inventory: ...


# --- Errors ---------------------------------------------------------------------

# An error crosses the wire as the text of a capnp exception (pycapnp carries
# nothing else): this marker, then JSON {"code", "message", "extra"}. Encoded
# here (`_encode_error`) and decoded here (`_map_kj`) through the one table in
# llmgw.errors; the text around it (KJ adds "remote exception: ") is not read.
_WIRE_MARK = "llmgw-error/1 "


def _encode_error(exc: BaseException) -> str:
    code, message, extra = errors.to_wire(exc)
    return _WIRE_MARK + json.dumps({"code": code, "message": message, "extra": extra})


def _decode_error(text: str) -> tuple[str, str, dict[str, str]] | None:
    at = text.find(_WIRE_MARK)
    if at < 0:
        return None
    try:
        data, _ = json.JSONDecoder().raw_decode(text, at + len(_WIRE_MARK))
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    code, message, extra = data.get("code"), data.get("message"), data.get("extra") or {}
    if not isinstance(code, str) or not isinstance(message, str) or not isinstance(extra, dict):
        return None
    return code, message, {str(k): str(v) for k, v in extra.items()}


def _map_kj(exc: BaseException, what: str) -> LlmgwError:
    """Turn a capnp exception into ours; keeps only its text."""
    text = str(getattr(exc, "description", None) or exc)
    wire = _decode_error(text)
    if wire is not None:
        code, message, extra = wire
        return errors.from_wire(code, f"{what}: {message}", extra)
    kind = getattr(exc, "type", None)
    if kind == "DISCONNECTED":
        return Disconnected(f"{what}: connection lost ({text})")
    if kind == "UNIMPLEMENTED":  # capnp's own: the peer's schema lacks the method
        return NotImplementedRemotely(f"{what}: {text}")
    return RemoteError(f"{what}: {text}")


# --- The capnp thread ------------------------------------------------------------


class _Outcome:
    __slots__ = ("error", "value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error


class CapnpThread:
    """One thread running asyncio + KJ; every capnp object lives there."""

    def __init__(
        self,
        *,
        deadlines: Deadlines | None = None,
        handshake: _gate.HandshakeLimits | None = None,
    ) -> None:
        self.deadlines = deadlines or Deadlines()
        self.handshake = handshake or _gate.HandshakeLimits()
        self._gates: list[_gate.HandshakeGate] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._failure: BaseException | None = None
        self._ids = itertools.count(1)
        # capnp side only:
        self._caps: dict[int, Any] = {}
        self._conns: dict[int, _Conn] = {}
        # Outbound connections: their shim and what was dialled, to explain a refusal.
        self._dial_info: dict[int, tuple[_Shim, tuple[Any, ...]]] = {}
        self.calls_in_flight = 0

    def __repr__(self) -> str:
        return (
            f"<CapnpThread caps={len(self._caps)} conns={len(self._conns)} "
            f"in_flight={self.calls_in_flight}>"
        )

    def statistics(self) -> dict[str, int]:
        stats = {
            "capabilities": len(self._caps),
            "connections": len(self._conns),
            "calls_in_flight": self.calls_in_flight,
        }
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
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._thread = threading.Thread(target=self._main, name="capnp", daemon=True)
            self._thread.start()
            await trio.to_thread.run_sync(self._ready.wait, abandon_on_cancel=True)
            if self._failure is not None:
                raise RuntimeError("the capnp thread failed to start") from self._failure
            try:
                yield self
            finally:
                with trio.CancelScope(shield=True):
                    self._shutdown()
                    await trio.to_thread.run_sync(self._thread.join, 10.0)
                nursery.cancel_scope.cancel()

    # thread side -------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._amain())
        except BaseException as exc:  # surfaced to open() or logged
            self._failure = exc
            log.exception("capnp thread ended with an error")
        finally:
            self._ready.set()

    async def _amain(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with capnp.kj_loop():
            self._ready.set()
            await self._stop.wait()
            for gate in self._gates:
                gate.close()
            self._gates.clear()
            for conn in list(self._conns.values()):
                conn.close()
            self._caps.clear()
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
            await asyncio.sleep(0)

    def _shutdown(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop.set)

    # trio -> capnp -------------------------------------------------------------

    async def run(
        self,
        fn: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        what: str | None = None,
        deadline: float | None = None,
    ) -> T:
        """Run `fn(*args)` on the capnp thread and return its (plain) result.

        `fn` must return plain values. Cancelling the trio caller cancels the
        coroutine, and with it the capnp call it awaits. With a `deadline`
        (seconds), a call not answered by then is cancelled the same way and
        raises `DeadlineExceeded("did not answer WHAT in N s")`; `what` names
        the call (default: `fn`'s name).
        """
        what = what or getattr(fn, "__name__", "call").lstrip("_")
        loop = self._loop
        if loop is None or loop.is_closed():
            raise Disconnected("the RPC thread has stopped")
        cfut = asyncio.run_coroutine_threadsafe(self._guard(fn, args, what), loop)
        done = trio.Event()
        token = self._token
        assert token is not None

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        cfut.add_done_callback(wake)
        try:
            with trio.move_on_after(deadline if deadline is not None else float("inf")):
                await done.wait()
        except trio.Cancelled:
            cfut.cancel()
            raise
        if not done.is_set():
            cfut.cancel()
            raise DeadlineExceeded(f"did not answer {what} in {deadline:g} s")
        outcome: _Outcome = cfut.result()
        if outcome.error is not None:
            raise outcome.error
        return outcome.value  # type: ignore[no-any-return]

    async def _guard(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], what: str
    ) -> _Outcome:
        # Build our error outside the except block: the capnp exception, and
        # the frames its traceback holds, must die on this thread.
        self.calls_in_flight += 1
        error: LlmgwError | None = None
        try:
            return _Outcome(value=await fn(*args))
        except LlmgwError as exc:
            # Ours, but raised here: its context and frames may hold capnp objects.
            exc.__context__ = exc.__cause__ = None
            error = exc.with_traceback(None)
        except capnp.KjException as exc:
            error = _map_kj(exc, what)
        except (ConnectionError, OSError) as exc:
            error = Disconnected(f"{what}: {exc}")
        except Exception as exc:
            log.exception("unexpected error in %s on the capnp thread", what)
            error = PeerError(f"{what}: {type(exc).__name__}: {exc}")
        finally:
            self.calls_in_flight -= 1
        return _Outcome(error=error)

    # capnp -> trio ---------------------------------------------------------------

    async def to_trio(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """From the capnp thread: run `fn(*args)` as a trio task and await it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_Outcome] = loop.create_future()
        box: dict[str, Any] = {"scope": None, "cancel": False}

        def deliver(outcome: _Outcome) -> None:
            if not fut.done():
                fut.set_result(outcome)

        async def runner() -> None:
            outcome = _Outcome(error=Disconnected("cancelled"))
            try:
                with trio.CancelScope() as scope:
                    box["scope"] = scope
                    if box["cancel"]:
                        scope.cancel()
                    try:
                        outcome = _Outcome(value=await fn(*args))
                    except Exception as exc:
                        outcome = _Outcome(error=exc)
            finally:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(deliver, outcome)

        def spawn() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(runner)

        def cancel() -> None:
            box["cancel"] = True
            if box["scope"] is not None:
                box["scope"].cancel()

        assert self._token is not None
        self._token.run_sync_soon(spawn)
        try:
            outcome = await fut
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(cancel)
            raise
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def notify(self, event: trio.Event) -> None:
        """From the capnp thread: set a trio event."""
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(event.set)

    # capability table (capnp side) ---------------------------------------------------

    def _keep(self, cap: Any, conn: _Conn | None) -> int:
        cap_id = next(self._ids)
        self._caps[cap_id] = cap
        if conn is not None:
            conn.caps.add(cap_id)
        return cap_id

    def _cap(self, cap_id: int, what: str) -> Any:
        try:
            return self._caps[cap_id]
        except KeyError:
            raise Disconnected(f"{what}: capability released or its connection closed") from None

    def release(self, cap_id: int) -> None:
        """Drop a capability; callable from any thread, idempotent."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._caps.pop, cap_id, None)

    # connections ---------------------------------------------------------------------

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
        conn = _Conn(next(self._ids), client, stream, closed, self)
        self._dial_info[conn.conn_id] = (shim, (host, port, tls, cert_path, node))
        self._conns[conn.conn_id] = conn
        conn.watch(client.on_disconnect())
        registry = client.bootstrap().cast_as(schema.Registry)
        return conn.conn_id, self._keep(registry, conn)

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
            conn = self._conns.get(conn_id)
            if conn is not None:
                conn.close()
            self._dial_info.pop(conn_id, None)

        with contextlib.suppress(Disconnected):
            await self.run(close)

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
                    gate = self._caps.pop(server_id, None)
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
        return self._keep(gate, None), gate.port

    async def _accept(self, stream: Any, transport: Any, servant: RegistryServant) -> None:
        peername = transport.get_extra_info("peername") if transport is not None else None
        peercert = transport.get_extra_info("peercert") if transport is not None else None
        address = _tls.format_peer(peername)
        closed = trio.Event()
        conn = _Conn(next(self._ids), None, stream, closed, self)
        peer = PeerInfo(conn.conn_id, address, _tls.peer_common_name(peercert), closed)
        server = capnp.TwoPartyServer(stream, bootstrap=_RegistryImpl(self, conn, peer, servant))
        conn.rpc = server
        self._conns[conn.conn_id] = conn
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


class _Conn:
    """One connection, capnp side: its RPC system, stream and capabilities."""

    def __init__(
        self, conn_id: int, rpc: Any, stream: Any, closed: trio.Event, bridge: CapnpThread
    ) -> None:
        self.conn_id = conn_id
        self.rpc = rpc
        self.stream = stream
        self.closed = closed
        self.bridge = bridge
        self.caps: set[int] = set()
        self.watcher: asyncio.Task[None] | None = None
        self.done = False

    def watch(self, on_disconnect: Awaitable[Any]) -> None:
        async def wait() -> None:
            with contextlib.suppress(Exception):
                await on_disconnect
            self.close()

        self.watcher = asyncio.ensure_future(wait())

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        self.bridge._conns.pop(self.conn_id, None)
        for cap_id in self.caps:
            self.bridge._caps.pop(cap_id, None)
        self.caps.clear()
        if self.watcher is not None and self.watcher is not asyncio.current_task():
            self.watcher.cancel()
        with contextlib.suppress(Exception):
            self.stream.close()
        self.bridge.notify(self.closed)


# --- Handles: what trio code holds ------------------------------------------------------


class _Handle:
    def __init__(self, bridge: CapnpThread, cap_id: int) -> None:
        self._bridge = bridge
        self._cap_id = cap_id
        self._released = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cap={self._cap_id}{' released' if self._released else ''}>"

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._bridge.release(self._cap_id)

    def __del__(self) -> None:
        # Collected on the trio thread: the capnp object itself is dropped on its own thread.
        with contextlib.suppress(Exception):
            self.release()


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


class RegistryHandle(_Handle):
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
            registry = bridge._cap(self._cap_id, "register")
            conn = bridge._conns.get(conn_id)
            request = registry.register_request()
            _codec.encode(hello, request.hello)
            request.agent = _AgentImpl(bridge, agent, conn)
            response = await request.send()
            settings = _codec.decode(model.Settings, response.settings)
            return bridge._keep(response.session, conn), settings

        session_id, settings = await bridge.run(register, what="register", deadline=deadline)
        return SessionHandle(bridge, session_id), settings


class SessionHandle(_Handle):
    """The agent's hold on its `NodeSession`; `deadline` bounds each call (seconds)."""

    async def heartbeat(self, beat: model.Heartbeat, *, deadline: float | None = None) -> None:
        bridge = self._bridge

        async def heartbeat() -> None:
            request = bridge._cap(self._cap_id, "heartbeat").heartbeat_request()
            _codec.encode(beat, request.beat)
            await request.send()

        await bridge.run(heartbeat, what="heartbeat", deadline=deadline)

    async def shard_status(
        self, shard: model.ShardReport, *, deadline: float | None = None
    ) -> None:
        bridge = self._bridge

        async def shard_status() -> None:
            request = bridge._cap(self._cap_id, "shardStatus").shardStatus_request()
            _codec.encode(shard, request.shard)
            await request.send()

        await bridge.run(shard_status, what="shardStatus", deadline=deadline)

    async def progress(self, progress: model.Progress, *, deadline: float | None = None) -> None:
        bridge = self._bridge

        async def progress_() -> None:
            request = bridge._cap(self._cap_id, "progress").progress_request()
            _codec.encode(progress, request.progress)
            await request.send()

        await bridge.run(progress_, what="progress", deadline=deadline)


class _SinkInbox:
    """The trio end of a `LogSink` the control plane serves: what arrives goes into a
    channel (None: a keepalive); a closed reader makes the agent's next push fail."""

    def __init__(self, send: trio.MemorySendChannel[model.LogLine | None]) -> None:
        self._send = send

    async def line(self, line: model.LogLine) -> None:
        await self._send.send(line)

    async def alive(self) -> None:
        await self._send.send(None)

    async def done(self) -> None:
        self._send.close()


class LogStream:
    """What a followed source pushes, line by line; None is a keepalive. Ends when the
    agent says the source ended; raises `DeadlineExceeded` after `silence_s` of nothing."""

    def __init__(
        self, receive: trio.MemoryReceiveChannel[model.LogLine | None], silence_s: float
    ) -> None:
        self._receive = receive
        self.silence_s = silence_s

    def __aiter__(self) -> LogStream:
        return self

    async def __anext__(self) -> model.LogLine | None:
        with trio.move_on_after(self.silence_s):
            try:
                return await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise StopAsyncIteration from None
        raise DeadlineExceeded(f"the agent did not answer in {self.silence_s:g} s")


class LogSinkHandle(_Handle):
    """The agent's hold on a control plane's `LogSink` (a follower pushes into it)."""

    async def line(self, line: model.LogLine, *, deadline: float) -> None:
        bridge = self._bridge

        async def line_() -> None:
            request = bridge._cap(self._cap_id, "line").line_request()
            _codec.encode(line, request.line)
            await request.send()

        await bridge.run(line_, what="line", deadline=deadline)

    async def alive(self, *, deadline: float) -> None:
        bridge = self._bridge

        async def alive() -> None:
            await bridge._cap(self._cap_id, "alive").alive()

        await bridge.run(alive, what="alive", deadline=deadline)

    async def done(self, *, deadline: float) -> None:
        bridge = self._bridge

        async def done() -> None:
            await bridge._cap(self._cap_id, "done").done()

        await bridge.run(done, what="done", deadline=deadline)


class AgentHandle(_Handle):
    """The control plane's hold on one agent's `Agent` capability.

    Every call has a deadline from the bridge's `Deadlines` (default 10 s):
    an agent that accepts a call and never answers (SIGSTOP, a partition
    without RST) costs its caller that long, then `DeadlineExceeded`.
    """

    async def _call(
        self, what: str, fn: Callable[[], Coroutine[Any, Any, T]], extra_s: float = 0.0
    ) -> T:
        bridge = self._bridge
        return await bridge.run(fn, what=what, deadline=bridge.deadlines.of(what, extra_s))

    async def inventory(self) -> model.Inventory:
        bridge = self._bridge

        async def inventory() -> model.Inventory:
            response = await bridge._cap(self._cap_id, "inventory").inventory()
            result: model.Inventory = _codec.decode(model.Inventory, response.inventory)
            return result

        return await self._call("inventory", inventory)

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        bridge = self._bridge

        async def start_shard() -> model.ShardReport:
            request = bridge._cap(self._cap_id, "startShard").startShard_request()
            request.epoch = epoch
            _codec.encode(spec, request.init("spec"))
            response = await request.send()
            report: model.ShardReport = _codec.decode(model.ShardReport, response.shard)
            return report

        return await self._call("startShard", start_shard)

    async def stop_shard(self, epoch: int, shard_id: str, grace_s: float) -> None:
        bridge = self._bridge

        async def stop_shard() -> None:
            cap = bridge._cap(self._cap_id, "stopShard")
            await cap.stopShard(epoch, shard_id, grace_s)

        # The agent waits up to the grace for the engine to exit, then kills it.
        await self._call("stopShard", stop_shard, extra_s=grace_s)

    async def logs(self, shard_id: str, lines: int) -> list[model.LogLine]:
        bridge = self._bridge

        async def logs() -> list[model.LogLine]:
            request = bridge._cap(self._cap_id, "logs").logs_request()
            request.shardId = shard_id
            request.lines = lines
            response = await request.send()
            return [_codec.decode(model.LogLine, line) for line in response.tail]

        return await self._call("logs", logs)

    async def log_sources(self) -> list[str]:
        bridge = self._bridge

        async def log_sources() -> list[str]:
            response = await bridge._cap(self._cap_id, "logSources").logSources()
            return [str(s) for s in response.sources]

        return await self._call("logSources", log_sources)

    @contextlib.asynccontextmanager
    async def follow_logs(
        self, source: str, lines: int, *, silence_s: float | None = None
    ) -> AsyncIterator[tuple[list[model.LogLine], LogStream]]:
        """`logs` with follow: the tail (under the `logs` deadline), then a `LogStream`
        of what the agent pushes after it, until this context exits (the sink then
        refuses, and the agent's follower ends). The stream raises `DeadlineExceeded`
        after `silence_s` (default: the `logs` deadline) with neither a line nor a
        keepalive: the agent sends one every 2 s while it is there."""
        bridge = self._bridge
        send, receive = trio.open_memory_channel[model.LogLine | None](256)
        inbox = _SinkInbox(send)

        async def logs() -> tuple[list[model.LogLine], bool]:
            request = bridge._cap(self._cap_id, "logs").logs_request()
            request.shardId = source
            request.lines = lines
            request.follow = True
            request.sink = _LogSinkImpl(bridge, inbox)
            response = await request.send()
            tail = [_codec.decode(model.LogLine, line) for line in response.tail]
            return tail, bool(response.following)

        with receive:
            try:
                tail, following = await self._call("logs", logs)
            except BaseException:
                send.close()
                raise
            if not following:  # an agent older than following
                send.close()
            # Never shorter than a few keepalives (the agent sends one every 2 s).
            silence = silence_s if silence_s is not None else max(5.0, bridge.deadlines.of("logs"))
            yield tail, LogStream(receive, silence)

    def deadline_of(self, call: str) -> float:
        return self._bridge.deadlines.of(call)

    async def reclaim(self, epoch: int, paths: tuple[str, ...], dry_run: bool) -> model.Reclaimed:
        bridge = self._bridge

        async def reclaim() -> model.Reclaimed:
            request = bridge._cap(self._cap_id, "reclaim").reclaim_request()
            request.epoch = epoch
            request.paths = list(paths)
            request.dryRun = dry_run
            response = await request.send()
            result: model.Reclaimed = _codec.decode(model.Reclaimed, response.result)
            return result

        return await self._call("reclaim", reclaim)

    async def declare_engines(self, epoch: int, engines: model.EngineDecls) -> None:
        bridge = self._bridge

        async def declare_engines() -> None:
            request = bridge._cap(self._cap_id, "declareEngines").declareEngines_request()
            request.epoch = epoch
            _codec.encode(engines, request.init("engines"))
            await request.send()

        await self._call("declareEngines", declare_engines)

    async def engine_check(self, engine: str, argv: tuple[str, ...]) -> model.FlagCheck:
        bridge = self._bridge

        async def engine_check() -> model.FlagCheck:
            request = bridge._cap(self._cap_id, "engineCheck").engineCheck_request()
            request.engine = engine
            request.argv = list(argv)
            response = await request.send()
            check: model.FlagCheck = _codec.decode(model.FlagCheck, response.check)
            return check

        return await self._call("engineCheck", engine_check)

    async def call_unimplemented(self, method: str) -> None:
        """Call a declared method with empty arguments (tests the "not implemented" path)."""
        bridge = self._bridge

        async def call() -> None:
            request = getattr(bridge._cap(self._cap_id, method), f"{method}_request")()
            await request.send()

        await self._call(method, call)


# --- capnp server implementations (capnp thread) ---------------------------------------
#
# A servant's exception leaves as `_encode_error(exc)`: its code, message and
# extra fields. The KjException is raised outside the `except` block so the
# trio-side exception (and its frames) is not chained onto it.


class _RegistryImpl(schema.Registry.Server):  # type: ignore[misc]
    def __init__(
        self, bridge: CapnpThread, conn: _Conn, peer: PeerInfo, servant: RegistryServant
    ) -> None:
        self._bridge = bridge
        self._conn = conn
        self._peer = peer
        self._servant = servant

    async def register_context(self, context: Any) -> None:
        bridge = self._bridge
        hello = _codec.decode(model.Hello, context.params.hello)
        agent = AgentHandle(bridge, bridge._keep(context.params.agent, self._conn))
        try:
            session, settings = await bridge.to_trio(
                self._servant.register, self._peer, hello, agent
            )
        except Exception as exc:
            message = _encode_error(exc)
        else:
            context.results.session = _SessionImpl(bridge, session)
            _codec.encode(settings, context.results.init("settings"))
            return
        raise capnp.KjException(message)


class _SessionImpl(schema.NodeSession.Server):  # type: ignore[misc]
    def __init__(self, bridge: CapnpThread, servant: SessionServant) -> None:
        self._bridge = bridge
        self._servant = servant

    async def heartbeat_context(self, context: Any) -> None:
        beat = _codec.decode(model.Heartbeat, context.params.beat)
        await self._call(self._servant.heartbeat, beat)

    async def shardStatus_context(self, context: Any) -> None:
        shard = _codec.decode(model.ShardReport, context.params.shard)
        await self._call(self._servant.shard_status, shard)

    async def progress_context(self, context: Any) -> None:
        progress = _codec.decode(model.Progress, context.params.progress)
        await self._call(self._servant.progress, progress)

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        message = None
        try:
            return await self._bridge.to_trio(fn, *args)
        except Exception as exc:
            message = _encode_error(exc)
        raise capnp.KjException(message)


class _LogSinkImpl(schema.LogSink.Server):  # type: ignore[misc]
    def __init__(self, bridge: CapnpThread, inbox: _SinkInbox) -> None:
        self._bridge = bridge
        self._inbox = inbox

    async def line_context(self, context: Any) -> None:
        line = _codec.decode(model.LogLine, context.params.line)
        await self._call(self._inbox.line, line)

    async def alive_context(self, context: Any) -> None:
        await self._call(self._inbox.alive)

    async def done_context(self, context: Any) -> None:
        await self._call(self._inbox.done)

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        message = None
        try:
            await self._bridge.to_trio(fn, *args)
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            message = _encode_error(Disconnected("the reader of these logs went away"))
        except Exception as exc:
            message = _encode_error(exc)
        raise capnp.KjException(message)


class _AgentImpl(schema.Agent.Server):  # type: ignore[misc]
    def __init__(
        self, bridge: CapnpThread, servant: AgentServant, conn: _Conn | None = None
    ) -> None:
        self._bridge = bridge
        self._servant = servant
        self._conn = conn

    async def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self._servant, name, None)
        if fn is None:
            raise capnp.KjException(
                _encode_error(NotImplementedRemotely(f"{name} is not supported by this agent yet"))
            )
        message = None
        try:
            return await self._bridge.to_trio(fn, *args)
        except Exception as exc:
            message = _encode_error(exc)
        raise capnp.KjException(message)

    async def inventory_context(self, context: Any) -> None:
        inventory = await self._call("inventory")
        _codec.encode(inventory, context.results.init("inventory"))

    async def startShard_context(self, context: Any) -> None:
        spec = _codec.decode(model.ShardSpec, context.params.spec)
        report = await self._call("start_shard", context.params.epoch, spec)
        _codec.encode(report, context.results.init("shard"))

    async def stopShard_context(self, context: Any) -> None:
        params = context.params
        await self._call("stop_shard", params.epoch, params.shardId, params.graceS)

    async def drain_context(self, context: Any) -> None:
        await self._call("drain")

    async def logs_context(self, context: Any) -> None:
        params = context.params
        if params.follow:
            bridge = self._bridge
            sink = LogSinkHandle(bridge, bridge._keep(params.sink, self._conn))
            try:
                lines = await self._call("logs", params.shardId, params.lines, True, sink)
            except BaseException:
                sink.release()
                raise
            context.results.following = True
        else:
            lines = await self._call("logs", params.shardId, params.lines)
        tail = context.results.init("tail", len(lines))
        for i, line in enumerate(lines):
            _codec.encode(line, tail[i])

    async def logSources_context(self, context: Any) -> None:
        sources = await self._call("log_sources")
        context.results.sources = list(sources)

    async def reclaim_context(self, context: Any) -> None:
        params = context.params
        result = await self._call("reclaim", params.epoch, tuple(params.paths), params.dryRun)
        _codec.encode(result, context.results.init("result"))

    async def declareEngines_context(self, context: Any) -> None:
        engines = _codec.decode(model.EngineDecls, context.params.engines)
        await self._call("declare_engines", context.params.epoch, engines)

    async def engineCheck_context(self, context: Any) -> None:
        argv = tuple(context.params.argv)
        check = await self._call("engine_check", context.params.engine, argv)
        _codec.encode(check, context.results.init("check"))
