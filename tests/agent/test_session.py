"""The agent's session loop against real control-plane listeners on loopback."""

from __future__ import annotations

import os
import random
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import trio
from helpers import NullSession, loopback_pki

from llmgw import config, model
from llmgw.agent import discovery
from llmgw.agent._node import Node
from llmgw.agent._session import AgentSession, Backoff
from llmgw.errors import PeerError, RegistrationRefused
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo
from llmgw.testing import fake_nvidia_smi
from llmgw.testing.cluster import free_port


async def n1_inventory() -> model.Inventory:
    return model.Inventory(host=model.Host("n1"))


async def bare_heartbeat(seq: int) -> model.Heartbeat:
    return model.Heartbeat(seq=seq)


class Standby:
    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.refused = 0

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.refused += 1
        agent.release()
        raise RegistrationRefused(f"standby; leader is {self.leader}", leader=self.leader)


class Leader:
    def __init__(self) -> None:
        self.registered: list[str] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.registered.append(hello.node_id)
        return NullSession(), model.Settings(heartbeat_interval_s=60, epoch=1)


async def test_a_standby_refusal_moves_on_to_the_leader_at_once(tmp_path: Path) -> None:
    server_tls, client_tls = loopback_pki(tmp_path, "n1")
    leader = Leader()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        leader_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, leader)
        standby = Standby(f"127.0.0.1:{leader_port}")
        standby_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, standby)
        dead = free_port()

        # The standby is listed first; the leader is not listed at all, only named
        # in the refusal; a huge backoff proves no backoff happened on the way.
        session = AgentSession(
            node_id="n1",
            addresses=[("127.0.0.1", standby_port), ("127.0.0.1", dead)],
            tls=client_tls,
            servant=object(),
            hello_inventory=n1_inventory,
            heartbeat=bare_heartbeat,
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


class FrozenAfterOne:
    """A leader that takes one registration, then stops answering (as under SIGSTOP):
    its session's heartbeats fail and a new registration would hang."""

    def __init__(self) -> None:
        self.calls = 0

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.calls += 1
        if self.calls > 1:
            await trio.sleep_forever()
        return DroppingSession(), model.Settings(heartbeat_interval_s=0.05, epoch=1)


class TakesOverAfter(Leader):
    """A standby that names the old leader `refusals` times, then leads."""

    def __init__(self, old_leader: str, refusals: int) -> None:
        super().__init__()
        self.old_leader, self.refusals = old_leader, refusals

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        if self.refusals > 0:
            self.refusals -= 1
            agent.release()
            raise RegistrationRefused(
                f"standby; leader is {self.old_leader}", leader=self.old_leader
            )
        return await super().register(peer, hello, agent)


async def test_a_standby_naming_the_leader_just_lost_is_asked_again_not_followed(
    tmp_path: Path,
) -> None:
    """The failover's race: the agent notices the leader's silence before the standby's
    lease has lapsed, so the standby still names the old leader. Following it would
    cost a dial to a process that never answers; the agent asks the standby again
    after its backoff, and registers there once it has taken over."""
    server_tls, client_tls = loopback_pki(tmp_path, "n1")
    old = FrozenAfterOne()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        old_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, old)
        new = TakesOverAfter(f"127.0.0.1:{old_port}", refusals=3)
        new_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, new)

        session = AgentSession(
            node_id="n1",
            addresses=[("127.0.0.1", old_port), ("127.0.0.1", new_port)],
            tls=client_tls,
            servant=object(),
            hello_inventory=n1_inventory,
            heartbeat=bare_heartbeat,
            backoff=Backoff(initial_s=0.05, max_s=0.05),
            rng=random.Random(0),
        )
        nursery.start_soon(session.run, bridge)
        # The standby records the registration before its answer reaches the agent:
        # wait for the agent's side, which is set only once the answer is in.
        with trio.fail_after(10):  # a dial back to the frozen leader would hang 30 s
            while session.registered_with != f"127.0.0.1:{new_port}":
                await trio.sleep(0.01)
        assert new.registered == ["n1"]
        assert old.calls == 1  # registered once; never dialled again after its session failed
        assert new.refusals == 0
        nursery.cancel_scope.cancel()


# --- discovery once per agent process ------------------------------------------------


def tls_pair(tmp_path: Path, node: str):
    server_tls, client_tls = loopback_pki(tmp_path, node)
    return server_tls, client_tls


class CountingRunner:
    """The real runner, with a fake nvidia-smi first on PATH; records every command."""

    def __init__(self, bin_dir: Path, block_topo: threading.Event | None = None) -> None:
        fake_nvidia_smi.install(bin_dir)
        env = dict(os.environ)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["LLMGW_FAKE_GPUS"] = "2xh100-80g"
        self._real = discovery.SubprocessRunner(env=env)
        self._block_topo = block_topo
        self.commands: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> discovery.RunResult:
        self.commands.append(tuple(argv))
        if self._block_topo is not None and tuple(argv[1:]) == ("topo", "-m"):
            self._block_topo.wait(30)  # a driver call that hangs
        return self._real(argv, timeout)

    def count(self, *args: str) -> int:
        return sum(1 for c in self.commands if c[0] == "nvidia-smi" and c[1:] == args)

    def count_prefix(self, prefix: str) -> int:
        return sum(1 for c in self.commands if len(c) > 1 and c[1].startswith(prefix))


def agent_config(tmp_path: Path) -> config.AgentConfig:
    return config.AgentConfig(
        node_id="n1",
        servers=[config.HostPort("127.0.0.1:1")],
        tls=config.TlsFiles(ca=tmp_path / "ca.crt", cert=tmp_path / "c", key=tmp_path / "k"),
        state_dir=tmp_path,
        model_dirs=[tmp_path / "models"],
        weights_dir=tmp_path / "weights",
        sglang_python=sys.executable,  # `import sglang` fails here: still a probe run
    )


class Dropping:
    """A control plane that takes every registration and then drops the session."""

    def __init__(self) -> None:
        self.hellos: list[model.Hello] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.hellos.append(hello)
        return DroppingSession(), model.Settings(heartbeat_interval_s=0.05, epoch=1)


class DroppingSession(NullSession):
    async def heartbeat(self, beat: model.Heartbeat) -> None:
        raise PeerError("this control plane is going away")


def session_for(node: Node, port: int, client_tls) -> AgentSession:
    return AgentSession(
        node_id="n1",
        addresses=[("127.0.0.1", port)],
        tls=client_tls,
        servant=object(),
        hello_inventory=node.hello_inventory,
        heartbeat=node.heartbeat,
        backoff=Backoff(initial_s=0.01, max_s=0.01),
        rng=random.Random(0),
    )


async def test_reconnects_register_with_one_discovery_and_a_fresh_usage_sample_each(
    tmp_path: Path,
) -> None:
    server_tls, client_tls = tls_pair(tmp_path, "n1")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "w.safetensors").write_bytes(b"x" * 10)
    runner = CountingRunner(tmp_path / "bin")
    node = Node(agent_config(tmp_path), runner=runner, nvml=None)
    cp = Dropping()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, cp)
        session = session_for(node, port, client_tls)
        nursery.start_soon(session.run, bridge)
        with trio.fail_after(60):  # the agent's count: set once each answer is in
            while session.registrations < 4:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert len(cp.hellos) >= 4
    # The hardware, the engines and the weights were probed once, for all of them ...
    assert node.statistics()["hardware_probes"] == 1
    assert node.statistics()["software_probes"] == 1
    assert runner.count("topo", "-m") == 1
    assert runner.count() == 1  # the bare table: driver and CUDA versions
    assert sum(1 for c in runner.commands if c[1:] == ("-c", "import sglang")) == 1
    # ... and every registration carried the whole inventory and a usage sample
    # of its own (two GPU queries for discovery, the cards and their MIG mode, then
    # one per registration).
    assert runner.count_prefix("--query-gpu=") == 2 + node.statistics()["hellos"]
    assert runner.count_prefix("--query-gpu=uuid,mig.mode.current") == 1
    for hello in cp.hellos[:4]:
        inv = hello.inventory
        assert inv.gpus is not None
        assert [g.name for g in inv.gpus] == ["NVIDIA H100 80GB HBM3"] * 2
        assert inv.topology is not None and inv.topology.nvlinks
        assert inv.host.driver_version == "550.54.15"
        assert inv.weights is not None and [f.size_bytes for f in inv.weights.files] == [10]
        assert inv.engines is not None
        assert inv.usage.memory_total_bytes is not None
        assert [g.memory_used_mib for g in inv.usage.gpus] == [0, 0]
        assert [g.ecc_uncorrected for g in inv.usage.gpus] == [0, 0]


async def test_a_discovery_probe_that_hangs_is_a_warning_then_arrives_by_the_next_hello(
    tmp_path: Path,
) -> None:
    (tmp_path / "models").mkdir()
    release = threading.Event()
    runner = CountingRunner(tmp_path / "bin", block_topo=release)
    node = Node(agent_config(tmp_path), runner=runner, nvml=None)
    node.discovery_timeout_s = 0.5
    try:
        with trio.fail_after(15):  # the usage sample and the engine probe still run
            first = await node.hello_inventory()
        # The hardware probe hangs on `topo -m`: registered without it, unknown not empty.
        assert first.gpus is None
        assert first.warnings == (
            "discovery: the hardware probe (GPUs, topology, RDMA, storage) did not finish "
            "within 0.5 s (discovery_timeout_s); registered without it, it is sent at the "
            "next registration once it finishes",
        )
        # Its usage sample, taken for this registration, does not need topology.
        assert len(first.usage.gpus) == 2
    finally:
        release.set()
    with trio.fail_after(15):
        while node.statistics()["hardware_probes"] == 0:
            await trio.sleep(0.05)
    second = await node.hello_inventory()
    assert second.gpus is not None and len(second.gpus) == 2
    assert second.topology is not None
    assert second.warnings == ()
    assert node.statistics()["hardware_probes"] == 1
    # The heartbeat tells the control plane the warning is gone.
    beat = await node.heartbeat(1)
    assert beat.warnings is None  # already sent with the second hello


class Recording(NullSession):
    def __init__(self) -> None:
        self.progress_seen: list[model.Progress] = []
        self.arrived = trio.Event()

    async def progress(self, progress: model.Progress) -> None:
        self.progress_seen.append(progress)
        self.arrived.set()


class WithMirror:
    def __init__(self) -> None:
        self.session = Recording()

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        settings = model.Settings(heartbeat_interval_s=60, epoch=1, mirror_port=8082)
        return self.session, settings


async def test_progress_is_pushed_by_source_while_connected_and_dropped_before(
    tmp_path: Path,
) -> None:
    server_tls, client_tls = tls_pair(tmp_path, "n1")
    cp = WithMirror()
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, cp)
        session = AgentSession(
            node_id="n1",
            addresses=[("127.0.0.1", port)],
            tls=client_tls,
            servant=object(),
            hello_inventory=n1_inventory,
            heartbeat=bare_heartbeat,
        )
        # Not connected: progress is not state, nothing keeps it for later.
        session.notify_progress(model.Progress("mirror:/early/", 1, 10))
        nursery.start_soon(session.run, bridge)
        with trio.fail_after(20):
            await session.connected.wait()
        # Where it dialled and what it was told: `mirror:` sources resolve against it.
        assert session.control_plane is not None
        host, dialled, settings = session.control_plane
        assert (host, dialled, settings.mirror_port) == ("127.0.0.1", port, 8082)
        session.notify_progress(model.Progress("mirror:/tiny/", 5, None))
        with trio.fail_after(20):
            await cp.session.arrived.wait()
            while session.progress_sent != 1:  # the call answered on the agent's side
                await trio.sleep(0.01)
        assert cp.session.progress_seen == [model.Progress("mirror:/tiny/", 5, None)]
        nursery.cancel_scope.cancel()
