"""Errors as data: every code crosses a real capnp connection as its own kind.

And deadlines: a peer that accepts a call and never answers costs its caller
the call's deadline, then `DeadlineExceeded`, with the call cancelled on the
far side.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from helpers import NullSession
from hypothesis import given
from hypothesis import strategies as st

from llmgw import errors, model
from llmgw.agent._servant import AgentServant as RealAgentServant
from llmgw.ctl import _cert
from llmgw.errors import (
    DeadlineExceeded,
    Disconnected,
    LlmgwError,
    NotImplementedRemotely,
    ParseError,
    RegistrationRefused,
    RemoteError,
    StaleEpoch,
)
from llmgw.rpc import AgentHandle, CapnpThread, Deadlines, PeerInfo, _tls, _wire

HOST = model.Inventory(host=model.Host(hostname="h"))
SPEC = model.ShardSpec(
    shard_id="s1",
    model="m",
    engine="llama.cpp",
    processes=(model.ProcessSpec(name="engine", argv=("true",)),),
)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    _cert.init_ca(tmp_path)
    _cert.issue_server(tmp_path, ["127.0.0.1"])
    _cert.issue_agent(tmp_path, "n1")
    return tmp_path


def server_tls(pki: Path):
    return _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")


def client_tls(pki: Path):
    return _tls.client_context(pki / "ca.crt", pki / "agent-n1.crt", pki / "agent-n1.key")


class Registry:
    def __init__(self, refuse: BaseException | None = None) -> None:
        self.refuse = refuse
        self.agents: list[AgentHandle] = []
        self.registered = trio.Event()

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        if self.refuse is not None:
            agent.release()
            raise self.refuse
        self.agents.append(agent)
        self.registered.set()
        return NullSession(), model.Settings(heartbeat_interval_s=60, epoch=1)


class Raising:
    """An agent servant whose every call raises `self.error`, or never answers."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.cancelled = 0
        self.entered = trio.Event()
        self.stop_takes_s = 0.0

    async def inventory(self) -> model.Inventory:
        if self.error is None:
            return HOST
        raise self.error

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.entered.set()
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled += 1

    async def stop_shard(self, epoch: int, shard_id: str, grace_s: float) -> None:
        await trio.sleep(self.stop_takes_s)


class FromTheFuture(LlmgwError):
    code = "from-the-future"


def one_of_each() -> list[LlmgwError]:
    made: list[LlmgwError] = []
    for code, kind in errors.CODES.items():
        if kind is ParseError:
            made.append(ParseError("nvidia-smi -q", "no GPU section"))
        elif kind is RegistrationRefused:
            made.append(RegistrationRefused("standby", leader="10.0.0.1:7070", epoch=3))
        else:
            made.append(kind(f"a {code} error"))
    return made


def test_every_error_kind_has_its_own_code() -> None:
    kinds = [
        obj for obj in vars(errors).values() if inspect.isclass(obj) and issubclass(obj, LlmgwError)
    ]
    assert sorted(k.code for k in kinds) == sorted(errors.CODES)
    assert all(errors.CODES[k.code] is k for k in kinds)


@given(st.sampled_from(sorted(errors.CODES)), st.text(), st.text())
def test_envelope_round_trip_of_any_text(code: str, message: str, leader: str) -> None:
    # The envelope survives text KJ puts around it and any message, the marker included.
    kind = errors.CODES[code]
    exc = (
        ParseError(message, leader)
        if kind is ParseError
        else RegistrationRefused(message, leader=leader or None)
        if kind is RegistrationRefused
        else kind(message)
    )
    text = "remote exception: " + _wire.encode_error(exc) + " (capnp/rpc.c++:123)"
    back = _wire.map_remote_error(Exception(text), "call")
    assert type(back) is kind
    if kind is ParseError:
        assert (back.source, back.problem) == (message, leader)
    else:
        assert str(back) == f"call: {message}"
    if kind is RegistrationRefused:
        assert back.leader == (leader or None)


@given(st.none() | st.integers(0, 2**62))
def test_a_refusal_carries_the_leaders_epoch(epoch: int | None) -> None:
    exc = RegistrationRefused("standby; leader is h:1", leader="h:1", epoch=epoch)
    back = _wire.map_remote_error(Exception(_wire.encode_error(exc)), "register")
    assert isinstance(back, RegistrationRefused)
    assert (back.leader, back.epoch) == ("h:1", epoch)


def test_unknown_code_and_foreign_text_are_remote_errors() -> None:
    text = _wire.WIRE_MARK + json.dumps({"code": "nope", "message": "m", "extra": {}})
    back = _wire.map_remote_error(Exception(text), "logs")
    assert type(back) is RemoteError
    assert str(back) == "logs: m"
    # No envelope (an old peer, capnp itself): the text as it is, never parsed for kinds.
    back = _wire.map_remote_error(
        Exception("refused: not implemented; standby; leader is x:1"), "logs"
    )
    assert type(back) is RemoteError
    assert str(back) == "logs: refused: not implemented; standby; leader is x:1"


async def test_every_code_round_trips_through_a_real_connection(pki: Path) -> None:
    registry = Registry()
    servant = Raising()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect("127.0.0.1", port, client_tls(pki), agent=servant) as conn:
            await conn.register(model.Hello(node_id="n1", agent_version="t", inventory=HOST))
            agent = registry.agents[0]
            for sent in one_of_each():
                servant.error = sent
                with pytest.raises(LlmgwError) as info:
                    await agent.inventory()
                got = info.value
                assert type(got) is type(sent), (sent.code, got)
                if isinstance(sent, ParseError):
                    assert isinstance(got, ParseError)
                    assert (got.source, got.problem) == (sent.source, sent.problem)
                else:
                    assert str(got) == f"inventory: {sent}"
                if isinstance(sent, RegistrationRefused):
                    assert isinstance(got, RegistrationRefused)
                    assert got.leader == "10.0.0.1:7070"
            # A code this side does not know: RemoteError with the peer's message.
            servant.error = FromTheFuture("made by a newer agent")
            with pytest.raises(RemoteError) as unknown:
                await agent.inventory()
            assert type(unknown.value) is RemoteError
            assert str(unknown.value) == "inventory: made by a newer agent"
            # Not one of ours at all: a bug over there, named as such.
            servant.error = KeyError("gpu0")
            with pytest.raises(
                RemoteError, match=r"^inventory: internal error in KeyError: 'gpu0'$"
            ):
                await agent.inventory()
            # A method the servant lacks.
            with pytest.raises(NotImplementedRemotely) as missing:
                await agent.call_unimplemented("logSources")
            assert (
                str(missing.value) == "logSources: log_sources is not supported by this agent yet"
            )
            # The retired ordinal (it was `drain`): refused in words, not with a traceback.
            with pytest.raises(NotImplementedRemotely) as retired:
                await agent.call_unimplemented("obsoleteDrain")
            assert str(retired.value) == (
                "obsoleteDrain: drain is retired: the control plane drains a node itself "
                "(a replacement first, then stopShard with a grace)"
            )
            # And still answering after all that.
            servant.error = None
            assert await agent.inventory() == HOST
        nursery.cancel_scope.cancel()


def capnp_reachable(root: object) -> list[str]:
    """capnp types reachable from what trio received: through attrs fields, containers,
    handles, an exception's args, context, cause and its traceback frames' locals. Not
    through the bridge, which holds the capnp side by design (touched on its thread)."""
    from llmgw.rpc._thread import Bridge, Handle

    found: list[str] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, Bridge):
            continue
        seen.add(id(obj))
        if (type(obj).__module__ or "").startswith("capnp"):
            found.append(type(obj).__qualname__)
        elif attrs.has(type(obj)):
            stack.extend(getattr(obj, f.name) for f in attrs.fields(type(obj)))
        elif isinstance(obj, (tuple, list, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend([*obj.keys(), *obj.values()])
        elif isinstance(obj, Handle):
            stack.extend(vars(obj).values())
        elif isinstance(obj, BaseException):
            stack.extend([*obj.args, *vars(obj).values(), obj.__context__, obj.__cause__])
            tb = obj.__traceback__
            while tb is not None:
                stack.extend(tb.tb_frame.f_locals.values())
                tb = tb.tb_next
    return found


async def test_no_capnp_object_reaches_trio_in_a_value_or_an_error(pki: Path) -> None:
    registry = Registry()
    servant = Raising()
    deadlines = Deadlines(default_s=0.3)
    got: list[object] = []
    async with CapnpThread.open(deadlines=deadlines) as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect("127.0.0.1", port, client_tls(pki), agent=servant) as conn:
            session, settings = await conn.register(
                model.Hello(node_id="n1", agent_version="t", inventory=HOST)
            )
            got += [session, settings, conn, registry.agents[0]]
            agent = registry.agents[0]
            got.append(await agent.inventory())
            for sent in [*one_of_each(), KeyError("gpu0")]:
                servant.error = sent
                with pytest.raises(LlmgwError) as info:
                    await agent.inventory()
                got.append(info.value)
            with pytest.raises(NotImplementedRemotely) as missing:
                await agent.call_unimplemented("logSources")
            got.append(missing.value)
            with pytest.raises(DeadlineExceeded) as late:
                await agent.start_shard(1, SPEC)
            got.append(late.value)
        # The connection is gone: the capability broke, and says so in our words.
        with pytest.raises(Disconnected) as gone:
            await agent.inventory()
        got.append(gone.value)
        nursery.cancel_scope.cancel()
    assert len(got) == 5 + len(one_of_each()) + 1 + 3
    assert [capnp_reachable(g) for g in got] == [[] for _ in got]


def test_the_capnp_walk_sees_a_capnp_object() -> None:
    # Else the test above proves nothing.
    from llmgw.rpc._schema import schema

    message = schema.Heartbeat.new_message()
    error = RemoteError("x")
    error.__context__ = Exception(message)
    assert capnp_reachable(model.Settings(heartbeat_interval_s=1, epoch=1)) == []
    assert capnp_reachable([error]) == ["_DynamicStructBuilder"]


async def test_a_standby_refusal_carries_the_leader_as_a_field(pki: Path) -> None:
    registry = Registry(RegistrationRefused("standby; the leader answers", leader="[::1]:7070"))
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect("127.0.0.1", port, client_tls(pki), agent=Raising()) as conn:
            with pytest.raises(RegistrationRefused) as info:
                await conn.register(model.Hello(node_id="n1", agent_version="t", inventory=HOST))
        assert info.value.leader == "[::1]:7070"
        assert str(info.value) == "register: standby; the leader answers"
        nursery.cancel_scope.cancel()


async def test_stale_epoch_reaches_the_control_plane_as_its_own_kind(pki: Path) -> None:
    # The agent's real servant: its fence refuses before touching node or supervisor.
    servant = RealAgentServant(None, None)  # type: ignore[arg-type]
    servant.newest_epoch = 5
    registry = Registry()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect("127.0.0.1", port, client_tls(pki), agent=servant) as conn:
            await conn.register(model.Hello(node_id="n1", agent_version="t", inventory=HOST))
            agent = registry.agents[0]
            with pytest.raises(StaleEpoch) as info:
                await agent.start_shard(4, SPEC)
            assert not isinstance(info.value, RegistrationRefused)
            assert str(info.value) == (
                "startShard: command from epoch 4 refused: epoch 5 has been seen, so it came "
                "from a control plane that is no longer the leader"
            )
            with pytest.raises(StaleEpoch, match=r"^stopShard: command from epoch 3 refused"):
                await agent.stop_shard(3, "s1", 1.0)
        nursery.cancel_scope.cancel()


# --- deadlines -------------------------------------------------------------------------


def test_deadlines_per_call_and_their_bounds() -> None:
    d = Deadlines()
    assert d.of("startShard") == 10.0
    assert d.of("engineCheck") == 90.0
    assert d.of("stopShard", extra_s=30.0) == 40.0
    assert Deadlines(default_s=3, per_call={"startShard": 20}).of("logs") == 3
    assert Deadlines(default_s=3, per_call={"startShard": 20}).of("startShard") == 20
    with pytest.raises(
        ValueError, match=r"no agent call named startshard; known: declareEngines, engineCheck, "
    ):
        Deadlines(per_call={"startshard": 1})
    with pytest.raises(ValueError, match=r"deadline of logs: 0 s; use more than 0"):
        Deadlines(per_call={"logs": 0})
    with pytest.raises(ValueError, match=r"default deadline -1 s"):
        Deadlines(default_s=-1)


async def test_an_agent_that_never_answers_costs_the_deadline_and_no_more(pki: Path) -> None:
    registry = Registry()
    servant = Raising()
    deadlines = Deadlines(default_s=0.3)
    async with CapnpThread.open(deadlines=deadlines) as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        async with bridge.connect("127.0.0.1", port, client_tls(pki), agent=servant) as conn:
            await conn.register(model.Hello(node_id="n1", agent_version="t", inventory=HOST))
            agent = registry.agents[0]
            start = trio.current_time()
            with pytest.raises(DeadlineExceeded) as info:
                await agent.start_shard(1, SPEC)
            took = trio.current_time() - start
            assert str(info.value) == "did not answer startShard in 0.3 s"
            assert 0.3 <= took < 2.0
            # The call was cancelled on the agent, not left running there.
            assert servant.entered.is_set()
            with trio.fail_after(5):
                while servant.cancelled < 1:
                    await trio.sleep(0.01)
            # stopShard's deadline is its grace plus the default: 0.5 s of work in a 0.8 s bound.
            servant.stop_takes_s = 0.5
            await agent.stop_shard(1, "s1", 0.5)
            servant.stop_takes_s = 10.0
            with pytest.raises(DeadlineExceeded, match=r"^did not answer stopShard in 0\.8 s$"):
                await agent.stop_shard(1, "s1", 0.5)
            # The connection is fine: the next call answers.
            assert await agent.inventory() == HOST
        assert bridge.calls_in_flight == 0
        nursery.cancel_scope.cancel()


AGENT_SCRIPT = textwrap.dedent(
    """
    import sys, trio
    from pathlib import Path
    from llmgw import model
    from llmgw.rpc import CapnpThread, _tls

    class Agent:
        async def inventory(self):
            return model.Inventory(host=model.Host(hostname="stopped"))

    async def main(port, pki):
        d = Path(pki)
        tls = _tls.client_context(d / "ca.crt", d / "agent-n1.crt", d / "agent-n1.key")
        async with CapnpThread.open() as bridge:
            async with bridge.connect("127.0.0.1", port, tls, agent=Agent()) as conn:
                hello = model.Hello(node_id="n1", agent_version="t",
                                    inventory=model.Inventory(host=model.Host(hostname="h")))
                await conn.register(hello)
                print("registered", flush=True)
                await trio.sleep_forever()

    trio.run(main, int(sys.argv[1]), sys.argv[2])
    """
)


async def test_a_sigstopped_agent_costs_the_deadline(pki: Path) -> None:
    """The connection stays up, the kernel keeps acking, nothing answers: the deadline ends it."""
    registry = Registry()
    async with (
        CapnpThread.open(deadlines=Deadlines(per_call={"inventory": 0.5})) as bridge,
        trio.open_nursery() as nursery,
    ):
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls(pki), registry)
        proc: Any = await trio.lowlevel.open_process(
            [sys.executable, "-c", AGENT_SCRIPT, str(port), str(pki)],
            stdout=subprocess.DEVNULL,
        )
        try:
            with trio.fail_after(20):
                await registry.registered.wait()
            agent = registry.agents[0]
            assert (await agent.inventory()).host.hostname == "stopped"
            os.kill(proc.pid, signal.SIGSTOP)
            start = trio.current_time()
            with pytest.raises(DeadlineExceeded) as info:
                await agent.inventory()
            assert str(info.value) == "did not answer inventory in 0.5 s"
            assert trio.current_time() - start < 3.0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
        nursery.cancel_scope.cancel()
