"""LoRA adapters on a real agent: fetched before launch and put in the engine's argv,
a running shard relaunched with other adapters, `fetchAdapter`'s single flight, and
the relaunched engine adopted by a restarted agent.

The control plane's side is this test: it serves `Registry` on loopback with mutual
TLS and holds the `AgentHandle` a real `llmgw-agent` process registers with, as the
control plane does; the weights mirror is the real one, behind a proxy that counts
GETs. The engine is the fake llama-server: what it was started with is read from
/proc/PID/cmdline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from helpers import CountingProxy, loopback_pki

from llmgw import model
from llmgw.agent._supervisor import Supervisor
from llmgw.core import cache_name
from llmgw.cp._weights._mirror import serve_mirror
from llmgw.errors import NotFound, UsageError
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo
from llmgw.testing import fake_engine
from llmgw.testing.cluster import free_port

NODE = "node-a"
TIMEOUT = 60


class Session:
    """The control plane's `NodeSession` servant: keeps every shard report."""

    def __init__(self) -> None:
        self.reports: list[model.ShardReport] = []

    async def heartbeat(self, beat: model.Heartbeat) -> None:
        pass

    async def shard_status(self, shard: model.ShardReport) -> None:
        self.reports.append(shard)

    async def progress(self, progress: model.Progress) -> None:
        pass


class Registry:
    def __init__(self, mirror_port: int) -> None:
        self.mirror_port = mirror_port
        self.session = Session()
        self.hellos: list[model.Hello] = []
        self.agents: list[AgentHandle] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.hellos.append(hello)
        self.agents.append(agent)
        settings = model.Settings(
            heartbeat_interval_s=1, epoch=1, mirror_port=self.mirror_port, mirror_tls=False
        )
        return self.session, settings


class Rig:
    def __init__(self, tmp: Path, registry: Registry, proxy: CountingProxy, rpc_port: int):
        self.tmp = tmp
        self.registry = registry
        self.proxy = proxy
        self.weights = tmp / "weights"
        self.config = tmp / "agent.yaml"
        self.config.write_text(
            json.dumps(
                {
                    "node_id": NODE,
                    "servers": [f"127.0.0.1:{rpc_port}"],
                    "tls": {
                        "ca": str(tmp / "ca.crt"),
                        "cert": str(tmp / f"agent-{NODE}.crt"),
                        "key": str(tmp / f"agent-{NODE}.key"),
                    },
                    "state_dir": str(tmp / "state"),
                    "weights_dir": str(self.weights),
                    "engine_paths": {
                        "llama-server": str(fake_engine.install(tmp / "bin", "llama-server"))
                    },
                    "health_interval_s": 0.2,
                    "stop_grace_s": 5,
                    "reconnect_max_s": 1,
                }
            )
        )
        self.agent: subprocess.Popen[bytes] | None = None

    def start_agent(self) -> None:
        log = open(self.tmp / "agent.log", "ab")  # noqa: SIM115 - the agent's, closed by it
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "llmgw.agent", "run", "--config", str(self.config)],
            stdout=log,
            stderr=log,
        )
        log.close()

    async def registered(self, count: int) -> AgentHandle:
        with trio.fail_after(TIMEOUT):
            while len(self.registry.agents) < count:
                assert self.agent is not None and self.agent.poll() is None, self.agent_log()
                await trio.sleep(0.05)
        return self.registry.agents[count - 1]

    def agent_log(self) -> str:
        return (self.tmp / "agent.log").read_text()[-4000:]

    async def report(self, shard_id: str, state: str, after: int = 0) -> model.ShardReport:
        """The first report of `state` among the reports from index `after` on (a failed
        one, unless that was asked for, ends the test with its reason)."""
        with trio.fail_after(TIMEOUT):
            while True:
                for r in self.registry.session.reports[after:]:
                    if r.shard_id == shard_id and r.state == state:
                        return r
                    assert r.state != "failed", (r.reason, self.agent_log())
                await trio.sleep(0.05)

    def local(self, source: str, name: str) -> str:
        return str(self.weights / cache_name(source) / name)

    def stop_agent(self) -> None:
        assert self.agent is not None
        self.agent.send_signal(signal.SIGTERM)
        self.agent.wait(20)


@contextlib.asynccontextmanager
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    server_tls, _ = loopback_pki(tmp_path, NODE)
    root = tmp_path / "mirror"
    (root / "loras" / "c").mkdir(parents=True)
    for name in ("a", "b"):
        (root / "loras" / f"{name}.gguf").write_bytes(name.encode() * 1000)
    (root / "loras" / "slow.gguf").write_bytes(os.urandom(2 << 20))
    (root / "loras" / "c" / "adapter_model.safetensors").write_bytes(os.urandom(1 << 20))
    (root / "loras" / "c" / "adapter_config.json").write_text('{"r": 8}')
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        mirror = await nursery.start(partial(serve_mirror, root, "127.0.0.1", 0))
        proxy = CountingProxy(mirror)
        registry = Registry(await proxy.start(nursery))
        rpc = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, registry)
        r = Rig(tmp_path, registry, proxy, rpc)
        r.start_agent()
        try:
            yield r
        finally:
            if r.agent is not None and r.agent.poll() is None:
                r.stop_agent()
            with contextlib.suppress(ProcessLookupError):
                for pid in {p for rep in registry.session.reports for p in rep.pids}:
                    os.killpg(pid, signal.SIGKILL)
            nursery.cancel_scope.cancel()


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def shard_spec(tmp: Path, port: int, adapters: dict[str, str]) -> model.ShardSpec:
    base = tmp / "base.gguf"
    base.write_bytes(b"GGUF")
    argv = ["llama-server", "-m", str(base), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-a", "tiny", "--cache-ram", "0"]
    for source in adapters.values():
        argv += ["--lora-scaled", f"{source}:0"]
    return model.ShardSpec(
        shard_id="tiny-0",
        model=str(base),
        engine="llama-server",
        processes=(model.ProcessSpec(name="engine", argv=tuple(argv)),),
        served_names=("tiny",),
        port=port,
        replica_id="r-1",
        model_name="tiny",
        source=str(base),
        adapters=tuple(adapters),
        adapter_sources=tuple(adapters.values()),
    )


def loras(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--lora-scaled"]


@pytest.mark.slow(seconds=5)
async def test_adapters_fetched_before_launch_relaunched_and_adopted(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        agent = await r.registered(1)
        port = free_port()
        own = tmp_path / "own-lora.gguf"
        own.write_bytes(b"lora")
        first = shard_spec(tmp_path, port, {"own": str(own), "a": "mirror:/loras/a.gguf"})
        started = await agent.start_shard(1, first)
        assert started.adapters == ("own", "a")
        ready = await r.report("tiny-0", "ready")
        (old_pid,) = ready.pids
        assert ready.adapters == ("own", "a") and ready.port == port
        # The mirror's adapter was fetched before launch and stands in the argv as a local
        # path with its scale; the local one is checked and passed as written.
        a_local = r.local("mirror:/loras/a.gguf", "a.gguf")
        assert loras(cmdline(old_pid)) == [f"{own}:0", f"{a_local}:0"]
        assert Path(a_local).read_bytes() == b"a" * 1000
        assert r.proxy.gets() == ["/loras/a.gguf"]

        # Anything but the adapters differs: refused naming the field; nothing moves.
        with pytest.raises(UsageError) as refused:
            await agent.relaunch_shard(1, attrs.evolve(first, port=port + 1), 5)
        assert str(refused.value) == (
            f"relaunchShard: relaunch tiny-0 on node {NODE}: a relaunch changes only adapters "
            f"and adapter_sources, and this one changes port {port} -> {port + 1} "
            "(start a new shard for that)"
        )
        with pytest.raises(NotFound, match="relaunch: no shard 'other-0' on node node-a"):
            await agent.relaunch_shard(1, attrs.evolve(first, shard_id="other-0"), 5)
        # An adapter that cannot be fetched: the error names it, the old engine serves on.
        absent = shard_spec(tmp_path, port, {"a": "mirror:/loras/a.gguf", "x": "mirror:/x.gguf"})
        with pytest.raises(UsageError) as unfetched:
            await agent.relaunch_shard(1, absent, 5)
        assert "adapter source mirror:/x.gguf: http://" in str(unfetched.value)
        assert "404" in str(unfetched.value)
        assert str(unfetched.value).endswith("it goes on with its adapters as they were")
        assert alive(old_pid) and r.registry.session.reports[-1].state == "ready"

        # A second adapter: the same shard, port and replica, a new engine with a new argv.
        second = shard_spec(
            tmp_path,
            port,
            {"own": str(own), "a": "mirror:/loras/a.gguf", "b": "mirror:/loras/b.gguf"},
        )
        seen = len(r.registry.session.reports)
        answer = await agent.relaunch_shard(1, second, 5)
        assert (answer.shard_id, answer.state, answer.port) == ("tiny-0", "starting", port)
        assert answer.adapters == ("own", "a", "b")
        again = await r.report("tiny-0", "ready", seen)
        (new_pid,) = again.pids
        assert new_pid != old_pid and not alive(old_pid)
        assert (again.port, again.replica_id, again.adapters) == (port, "r-1", ("own", "a", "b"))
        b_local = r.local("mirror:/loras/b.gguf", "b.gguf")
        assert loras(cmdline(new_pid)) == [f"{own}:0", f"{a_local}:0", f"{b_local}:0"]
        # What the control plane heard: ready, then starting again, loading, ready; the
        # old engine's exit was no failure.
        states = [x.state for x in r.registry.session.reports[seen - 1 :]]
        assert states == ["ready", "starting", "loading", "ready"]
        seqs = [x.seq for x in r.registry.session.reports if x.shard_id == "tiny-0"]
        assert seqs == sorted(seqs)
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        # a.gguf was not fetched again: only b was (and x, which the mirror lacks).
        assert r.proxy.gets() == ["/loras/a.gguf", "/x.gguf", "/loras/b.gguf"]
        # Reclaim leaves what the running shard's spec names: its adapters too.
        entry = str(Path(b_local).parent)
        kept = await agent.reclaim(1, (entry,), False)
        assert kept.removed == () and [x.reason for x in kept.refused] == [
            "still wanted by the catalog"
        ]
        assert Path(b_local).exists()
        # The same spec again (a retried command): the shard as it is, no restart.
        assert (await agent.relaunch_shard(1, second, 5)).pids == (new_pid,)

        # An agent restart adopts the relaunched engine, with its adapters.
        r.stop_agent()
        assert alive(new_pid)
        r.start_agent()
        await r.registered(2)
        (hello,) = [h.shards for h in r.registry.hellos[1:]]
        assert [(s.shard_id, s.pids, s.adapters, s.port) for s in hello] == [
            ("tiny-0", (new_pid,), ("own", "a", "b"), port)
        ]
        if hello[0].state != "ready":  # adopted loading: ready once a check passes
            assert hello[0].state == "loading"
            await r.report("tiny-0", "ready", seen)
        spec_json = json.loads((tmp_path / "state" / "shards" / "tiny-0" / "spec.json").read_text())
        assert spec_json["adapters"] == ["own", "a", "b"]
        assert spec_json["adapter_sources"] == [
            str(own),
            "mirror:/loras/a.gguf",
            "mirror:/loras/b.gguf",
        ]
        # The adopted shard relaunches too: its sources (the model's, every adapter's) are
        # made ready again, from the cache, since adoption only matched the argv.
        restarted = r.registry.agents[1]
        seen = len(r.registry.session.reports)
        await restarted.relaunch_shard(1, first, 5)
        back = await r.report("tiny-0", "ready", seen)
        (last_pid,) = back.pids
        assert last_pid != new_pid and not alive(new_pid)
        assert loras(cmdline(last_pid)) == [f"{own}:0", f"{a_local}:0"]
        assert back.adapters == ("own", "a")
        assert r.proxy.gets() == ["/loras/a.gguf", "/x.gguf", "/loras/b.gguf"]
        await restarted.stop_shard(1, "tiny-0", 5)
        assert not alive(last_pid)


@pytest.mark.slow(seconds=5)
async def test_fetch_adapter_single_flight_and_a_stop_during_a_relaunch_wins(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path) as r:
        agent = await r.registered(1)
        r.proxy.delay_s = 0.01  # 16 KiB per 10 ms: the version takes about a second
        paths: list[str] = []
        asked: list[float] = []
        answered: list[float] = []

        async def fetch() -> None:
            asked.append(trio.current_time())
            paths.append(await agent.fetch_adapter(1, "mirror:/loras/c/", "vllm"))
            answered.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(fetch)
        directory = str(r.weights / cache_name("mirror:/loras/c/"))
        assert paths == [directory] * 20
        assert max(asked) < min(answered)  # all twenty were waiting at once
        # One download for twenty callers: the manifest and each file asked for once.
        assert sorted(r.proxy.gets()) == [
            "/loras/c/",
            "/loras/c/adapter_config.json",
            "/loras/c/adapter_model.safetensors",
        ]
        assert sorted(os.listdir(directory)) == [
            ".llmgw-complete",
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        with pytest.raises(UsageError) as missing:
            await agent.fetch_adapter(1, "mirror:/loras/none.gguf", "vllm")
        assert str(missing.value).startswith(
            "fetchAdapter: adapter source mirror:/loras/none.gguf: http://"
        )
        with pytest.raises(UsageError, match="unknown engine 'tgi'"):
            await agent.fetch_adapter(1, "mirror:/loras/a.gguf", "tgi")

        # A relaunch fetching a slow adapter: a second one is refused while it runs, and
        # a stopShard meanwhile wins (the relaunch answers that the shard was stopped).
        port = free_port()
        first = shard_spec(tmp_path, port, {"a": "mirror:/loras/a.gguf"})
        await agent.start_shard(1, first)
        (pid,) = (await r.report("tiny-0", "ready")).pids
        slow = shard_spec(
            tmp_path, port, {"a": "mirror:/loras/a.gguf", "s": "mirror:/loras/slow.gguf"}
        )
        outcome: list[BaseException] = []

        async def relaunch() -> None:
            try:
                await agent.relaunch_shard(1, slow, 5)
            except UsageError as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(relaunch)
            with trio.fail_after(TIMEOUT):
                while "/loras/slow.gguf" not in r.proxy.gets():
                    await trio.sleep(0.02)
            with pytest.raises(UsageError, match="a relaunch of it is under way"):
                await agent.relaunch_shard(1, slow, 5)
            assert alive(pid)  # the old engine serves while the adapter is fetched
            await agent.stop_shard(1, "tiny-0", 5)
        (stopped,) = outcome
        assert isinstance(stopped, NotFound)
        assert str(stopped) == (
            f"relaunchShard: relaunch tiny-0 on node {NODE}: the shard was stopped meanwhile"
        )
        assert not alive(pid)
        with trio.fail_after(TIMEOUT):  # the stop's own report may come after its answer
            while r.registry.session.reports[-1].state != "stopped":
                await trio.sleep(0.02)
        # Nothing was started after the stop.
        assert [x.state for x in r.registry.session.reports].count("starting") == 1

        # An adapter that cannot be fetched fails a new shard before launch, naming it.
        seen = len(r.registry.session.reports)
        await agent.start_shard(1, shard_spec(tmp_path, port, {"n": "mirror:/loras/none.gguf"}))
        failed = await r.report("tiny-0", "failed", seen)
        assert failed.pids == () and failed.reason is not None
        assert failed.reason.startswith("adapter source mirror:/loras/none.gguf: http://")
        assert failed.reason.splitlines()[0].endswith(
            "HTTP 404 Not Found: not found: /loras/none.gguf: no such file or directory"
        )


# The agent's supervisor in process: a stop while the old engine is being stopped for a
# relaunch (it ignores SIGTERM, so that takes the grace) wins too.
IGNORES_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(3600)"
)


async def test_a_stop_while_the_old_engine_stops_for_a_relaunch_wins(tmp_path: Path) -> None:
    lora = tmp_path / "lora.gguf"
    lora.write_bytes(b"lora")
    spec = model.ShardSpec(
        shard_id="s",
        model="m",
        engine="llama-server",
        processes=(model.ProcessSpec(name="engine", argv=(sys.executable, "-c", IGNORES_TERM)),),
        serves_http=False,
    )
    reports: list[model.ShardReport] = []
    async with trio.open_nursery() as nursery:
        sup = Supervisor(tmp_path / "state", grace_s=2, node_id=NODE, on_change=reports.append)
        await nursery.start(sup.run)
        await sup.start(spec)
        with trio.fail_after(TIMEOUT):
            while not reports or reports[-1].state != "ready":
                await trio.sleep(0.02)
        (pid,) = reports[-1].pids
        outcome: list[NotFound] = []

        async def relaunch() -> None:
            new = attrs.evolve(spec, adapters=("a",), adapter_sources=(str(lora),))
            with pytest.raises(NotFound) as info:
                await sup.relaunch(new, 30)  # the engine would hold it the whole grace
            outcome.append(info.value)

        nursery.start_soon(relaunch)
        shard = sup.shard_of("s")
        assert shard is not None
        with trio.fail_after(TIMEOUT):
            while not shard.replacing:
                await trio.sleep(0.01)
        with trio.fail_after(10):  # the stop's grace, not the relaunch's 30 s
            stopped = await sup.stop("s", 0.5)
            while not outcome:
                await trio.sleep(0.02)
        assert stopped.state == "stopped" and not alive(pid)
        assert str(outcome[0]) == f"relaunch s on node {NODE}: the shard was stopped meanwhile"
        assert sup.reports() == () and [r.state for r in reports] == [
            "starting",
            "loading",
            "ready",
            "stopped",
        ]
        nursery.cancel_scope.cancel()
