"""The `Agent` and `LogSink` capabilities: each one's trio handle beside its capnp server.

- `Agent`: the agent serves it (`AgentImpl`, over its `AgentServant`); the
  control plane holds an `AgentHandle`. Every call is a row of the call table
  (llmgw/rpc/_wire.py, which says how to add one).
- `LogSink`: the control plane serves one per followed log (`_LogSinkImpl`,
  feeding a `LogStream`); the agent's follower holds a `LogSinkHandle`.

Handle methods run their inner coroutine on the capnp thread (`Bridge.run`)
and return attrs values; `*_context` methods run there and reach trio through
`Bridge.answer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol, TypeVar

import capnp
import trio

from llmgw import model
from llmgw.errors import DeadlineExceeded, Disconnected, NotImplementedRemotely
from llmgw.rpc import _codec
from llmgw.rpc._schema import schema
from llmgw.rpc._thread import Bridge, Conn, Handle
from llmgw.rpc._wire import AGENT_CALL_BY_WIRE, encode_error

T = TypeVar("T")


class AgentServant(Protocol):
    """What an agent answers. Methods it lacks answer "not implemented"."""

    async def inventory(self) -> model.Inventory: ...


# --- Agent: the control plane's handle --------------------------------------------------


class AgentHandle(Handle):
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
            response = await bridge.cap(self._cap_id, "inventory").inventory()
            result: model.Inventory = _codec.decode(model.Inventory, response.inventory)
            return result

        return await self._call("inventory", inventory)

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        bridge = self._bridge

        async def start_shard() -> model.ShardReport:
            request = bridge.cap(self._cap_id, "startShard").startShard_request()
            request.epoch = epoch
            _codec.encode(spec, request.init("spec"))
            response = await request.send()
            report: model.ShardReport = _codec.decode(model.ShardReport, response.shard)
            return report

        return await self._call("startShard", start_shard)

    async def stop_shard(self, epoch: int, shard_id: str, grace_s: float) -> None:
        bridge = self._bridge

        async def stop_shard() -> None:
            cap = bridge.cap(self._cap_id, "stopShard")
            await cap.stopShard(epoch, shard_id, grace_s)

        # The agent waits up to the grace for the engine to exit, then kills it.
        await self._call("stopShard", stop_shard, extra_s=grace_s)

    async def relaunch_shard(
        self, epoch: int, spec: model.ShardSpec, grace_s: float
    ) -> model.ShardReport:
        """Start the running shard `spec.shard_id` again from `spec` (other adapters,
        nothing else): its sources made ready, then stopped with `grace_s`, then
        started. Answers the shard starting again; shardStatus then says the rest."""
        bridge = self._bridge

        async def relaunch_shard() -> model.ShardReport:
            request = bridge.cap(self._cap_id, "relaunchShard").relaunchShard_request()
            request.epoch = epoch
            _codec.encode(spec, request.init("spec"))
            request.graceS = grace_s
            response = await request.send()
            report: model.ShardReport = _codec.decode(model.ShardReport, response.shard)
            return report

        # The agent waits up to the grace for the old engine to exit, after the fetch.
        return await self._call("relaunchShard", relaunch_shard, extra_s=grace_s)

    async def fetch_adapter(self, epoch: int, source: str, engine: str) -> str:
        """`source` made ready on the node (single flight); the local path for `engine`."""
        bridge = self._bridge

        async def fetch_adapter() -> str:
            request = bridge.cap(self._cap_id, "fetchAdapter").fetchAdapter_request()
            request.epoch = epoch
            request.source = source
            request.engine = engine
            response = await request.send()
            return str(response.path)

        return await self._call("fetchAdapter", fetch_adapter)

    async def logs(self, shard_id: str, lines: int) -> list[model.LogLine]:
        bridge = self._bridge

        async def logs() -> list[model.LogLine]:
            request = bridge.cap(self._cap_id, "logs").logs_request()
            request.shardId = shard_id
            request.lines = lines
            response = await request.send()
            return [_codec.decode(model.LogLine, line) for line in response.tail]

        return await self._call("logs", logs)

    async def log_sources(self) -> list[str]:
        bridge = self._bridge

        async def log_sources() -> list[str]:
            response = await bridge.cap(self._cap_id, "logSources").logSources()
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
            request = bridge.cap(self._cap_id, "logs").logs_request()
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
            request = bridge.cap(self._cap_id, "reclaim").reclaim_request()
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
            request = bridge.cap(self._cap_id, "declareEngines").declareEngines_request()
            request.epoch = epoch
            _codec.encode(engines, request.init("engines"))
            await request.send()

        await self._call("declareEngines", declare_engines)

    async def engine_check(self, engine: str, argv: tuple[str, ...]) -> model.FlagCheck:
        bridge = self._bridge

        async def engine_check() -> model.FlagCheck:
            request = bridge.cap(self._cap_id, "engineCheck").engineCheck_request()
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
            request = getattr(bridge.cap(self._cap_id, method), f"{method}_request")()
            await request.send()

        await self._call(method, call)


# --- Agent: the agent's server (capnp thread) -------------------------------------------


class AgentImpl(schema.Agent.Server):  # type: ignore[misc]
    def __init__(self, bridge: Bridge, servant: AgentServant, conn: Conn | None = None) -> None:
        self._bridge = bridge
        self._servant = servant
        self._conn = conn

    async def _call(self, wire: str, *args: Any) -> Any:
        name = AGENT_CALL_BY_WIRE[wire].servant
        fn = getattr(self._servant, name, None)
        if fn is None:
            raise capnp.KjException(
                encode_error(NotImplementedRemotely(f"{name} is not supported by this agent yet"))
            )
        return await self._bridge.answer(fn, *args)

    async def inventory_context(self, context: Any) -> None:
        inventory = await self._call("inventory")
        _codec.encode(inventory, context.results.init("inventory"))

    async def startShard_context(self, context: Any) -> None:
        spec = _codec.decode(model.ShardSpec, context.params.spec)
        report = await self._call("startShard", context.params.epoch, spec)
        _codec.encode(report, context.results.init("shard"))

    async def stopShard_context(self, context: Any) -> None:
        params = context.params
        await self._call("stopShard", params.epoch, params.shardId, params.graceS)

    async def relaunchShard_context(self, context: Any) -> None:
        params = context.params
        spec = _codec.decode(model.ShardSpec, params.spec)
        report = await self._call("relaunchShard", params.epoch, spec, params.graceS)
        _codec.encode(report, context.results.init("shard"))

    async def fetchAdapter_context(self, context: Any) -> None:
        params = context.params
        path = await self._call("fetchAdapter", params.epoch, params.source, params.engine)
        context.results.path = path

    async def logs_context(self, context: Any) -> None:
        params = context.params
        if params.follow:
            bridge = self._bridge
            sink = LogSinkHandle(bridge, bridge.keep(params.sink, self._conn))
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
        sources = await self._call("logSources")
        context.results.sources = list(sources)

    async def reclaim_context(self, context: Any) -> None:
        params = context.params
        result = await self._call("reclaim", params.epoch, tuple(params.paths), params.dryRun)
        _codec.encode(result, context.results.init("result"))

    async def declareEngines_context(self, context: Any) -> None:
        engines = _codec.decode(model.EngineDecls, context.params.engines)
        await self._call("declareEngines", context.params.epoch, engines)

    async def engineCheck_context(self, context: Any) -> None:
        argv = tuple(context.params.argv)
        check = await self._call("engineCheck", context.params.engine, argv)
        _codec.encode(check, context.results.init("check"))

    async def obsoleteDrain_context(self, context: Any) -> None:
        # Retired (llmgw/rpc/_wire.py). Without a method here pycapnp would answer with
        # an AttributeError's traceback as the message: say it in our words instead.
        raise capnp.KjException(
            encode_error(
                NotImplementedRemotely(
                    "drain is retired: the control plane drains a node itself "
                    "(a replacement first, then stopShard with a grace)"
                )
            )
        )


# --- LogSink: the agent's handle ---------------------------------------------------------


class LogSinkHandle(Handle):
    """The agent's hold on a control plane's `LogSink` (a follower pushes into it)."""

    async def line(self, line: model.LogLine, *, deadline: float) -> None:
        bridge = self._bridge

        async def line_() -> None:
            request = bridge.cap(self._cap_id, "line").line_request()
            _codec.encode(line, request.line)
            await request.send()

        await bridge.run(line_, what="line", deadline=deadline)

    async def alive(self, *, deadline: float) -> None:
        bridge = self._bridge

        async def alive() -> None:
            await bridge.cap(self._cap_id, "alive").alive()

        await bridge.run(alive, what="alive", deadline=deadline)

    async def done(self, *, deadline: float) -> None:
        bridge = self._bridge

        async def done() -> None:
            await bridge.cap(self._cap_id, "done").done()

        await bridge.run(done, what="done", deadline=deadline)


# --- LogSink: the control plane's server and what trio reads from it --------------------


class _SinkInbox:
    """The trio end of a `LogSink` the control plane serves: what arrives goes into a
    channel (None: a keepalive); a closed reader makes the agent's next push fail."""

    def __init__(self, send: trio.MemorySendChannel[model.LogLine | None]) -> None:
        self._send = send

    async def line(self, line: model.LogLine) -> None:
        await self._push(line)

    async def alive(self) -> None:
        await self._push(None)

    async def done(self) -> None:
        self._send.close()

    async def _push(self, item: model.LogLine | None) -> None:
        try:
            await self._send.send(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise Disconnected("the reader of these logs went away") from None


class _LogSinkImpl(schema.LogSink.Server):  # type: ignore[misc]
    def __init__(self, bridge: Bridge, inbox: _SinkInbox) -> None:
        self._bridge = bridge
        self._inbox = inbox

    async def line_context(self, context: Any) -> None:
        line = _codec.decode(model.LogLine, context.params.line)
        await self._bridge.answer(self._inbox.line, line)

    async def alive_context(self, context: Any) -> None:
        await self._bridge.answer(self._inbox.alive)

    async def done_context(self, context: Any) -> None:
        await self._bridge.answer(self._inbox.done)


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
