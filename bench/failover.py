"""Failover: two real `llmgw-cp` on one PostgreSQL, a fleet of simulated agents, a steady
stream of requests to both routers, and the lease made to change hands with everything
placed and serving, three ways (`--switches`):

- sigstop: the leader's process group is stopped (a machine that hangs);
- kill9: the leader is killed;
- store: PostgreSQL is stopped for `--outage` s (10), which deposes the leader; the
  standby is held (SIGSTOP) while the store comes back, so that the deposed leader wins
  the lease back: the case whose agents used to stay away from it for 20 s.

Measured for each switch and fleet size (default 3 and 100 agents), from the switch
(from the store's return for `store`):

- takeover: until the new leader's log says "leader: elected" (its own timestamp);
- agents moved: until the last agent's registration with the new leader at its
  epoch was answered;
- routable: until the new leader's admin API shows every replica ready and a
  chat request through its router is answered (by the one fake engine every
  replica's report points at);
- failed requests: the stream (tests/helpers.py BalancedLoad) is a client behind a
  load balancer over both routers: each request first to one router in turn with a
  2 s read and 1 s connect timeout; no answer (refused, reset, timed out) sends it to
  the other router once, and passes the silent one over for 3 s. A request failed when
  the router that answered it answered anything but a 200 completion (an HTTP error is
  not retried), or when neither answered. It runs from before the switch until
  `--stream-after` s after every replica is routable again;
- engines restarted: startShard/stopShard calls the agents received after the
  switch (each would be an engine started or stopped); stale refusals: commands
  from the old epoch they refused.

Goals (issues 15 and 24): routable under lease_s + 5 s, 0 failed requests, no engine
restarted.

The defaults: lease_s 3, heartbeat_interval_s 1, reconcile_settle_s 20. Agents
notice the silent leader before the standby has taken over, and the standby still
names it: as llmgw-agent, they do not dial a control plane whose session they lost
in the last 20 s, unless the refusal names it at a newer epoch than that session's
(elected again), and ask the standby again after a backoff.

The simulated agents are bench/fleet.py's (real mutual TLS, a client certificate
each, asyncio + pycapnp directly) with what failover needs of llmgw-agent: they dial
the control planes in the order listed (`--order`), follow a refusal's "standby;
leader is H:P" to that address next (unless its session was just lost at the epoch
the refusal names or a newer one), answer `startShard` with a ready shard (so the
first leader places every replica on them), report their shards again when they
register elsewhere, refuse a command from an epoch older than the newest seen, and
give up on a silent control plane after llmgw-agent's own bounds: a heartbeat after
max(2 x interval, 1 s), a dial after 10 s, a registration after 30 s, then back off
0.5 s doubling to 5 s (with jitter) once every address has failed.

Run: `.venv/bin/python bench/failover.py [--agents 3,100] [--lease 3] [--switches
sigstop,kill9,store]`. Loopback only; it needs PostgreSQL's initdb/pg_ctl (Debian:
postgresql), starts one per switch and fleet size, and kills every process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent

# llmgw-agent's bounds (llmgw/agent/_session.py, llmgw/rpc/_thread.py, llmgw/config.py).
DIAL_S = 10.0
REGISTER_S = 30.0
BACKOFF_INITIAL_S, BACKOFF_MAX_S = 0.5, 5.0
LOST_RECENTLY_S = 20.0  # llmgw/agent/_session.py: not dialled again this soon after a lost session


# --- the simulated agents (one client process holds many) -------------------------


def worker_main(spec_path: Path) -> int:
    import asyncio
    import random
    import ssl

    import capnp

    from llmgw import model
    from llmgw.rpc import _codec, _tls
    from llmgw.rpc._schema import schema
    from llmgw.rpc._wire import decode_error as _decode_error
    from llmgw.rpc._wire import encode_error as _encode_error

    spec = json.loads(spec_path.read_text())
    pki = Path(spec["pki"])
    nodes: list[str] = spec["nodes"]
    addresses = [tuple(a.rsplit(":", 1)) for a in spec["addresses"]]
    engine_port = int(spec["engine_port"])
    engine_pid = int(spec["engine_pid"])
    inventory: model.Inventory = pickle.loads(Path(spec["inventory"]).read_bytes())
    contexts = {
        node: _tls.client_context(
            pki / "ca.crt", pki / f"agent-{node}.crt", pki / f"agent-{node}.key"
        )
        for node in nodes
    }

    def say(**event: Any) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    class Node:
        def __init__(self, name: str) -> None:
            self.name = name
            self.newest_epoch = 0
            self.shards: dict[str, model.ShardReport] = {}
            self.phase = "dial"  # what the current session is doing, for the report
            self.registered = False  # the current session got as far as a registration
            self.session_epoch = 0  # the epoch the current (or last) session registered at

        def fence(self, epoch: int) -> None:
            if epoch < self.newest_epoch:
                say(event="stale", node=self.name, epoch=epoch, t=time.monotonic())
                from llmgw.errors import StaleEpoch

                raise capnp.KjException(
                    _encode_error(
                        StaleEpoch(
                            f"command from epoch {epoch} refused: epoch "
                            f"{self.newest_epoch} has been seen"
                        )
                    )
                )
            self.newest_epoch = epoch

    class Agent(schema.Agent.Server):  # type: ignore[misc]
        """startShard answers a ready shard on the fake engine; the rest as noted."""

        def __init__(self, node: Node) -> None:
            self.node = node

        async def startShard_context(self, context: Any) -> None:
            self.node.fence(int(context.params.epoch))
            s = _codec.decode(model.ShardSpec, context.params.spec)
            report = model.ShardReport(
                shard_id=s.shard_id,
                model=s.model,
                engine=s.engine,
                state="ready",
                port=engine_port,
                pids=(engine_pid,),
                profile_fingerprint=s.profile_fingerprint,
                replica_id=s.replica_id,
                model_name=s.model_name,
                rank=s.rank,
                ranks=s.ranks,
                gpus=s.gpus,
                source=s.source,
            )
            self.node.shards[s.shard_id] = report
            say(event="start", node=self.node.name, shard=s.shard_id, t=time.monotonic())
            _codec.encode(report, context.results.init("shard"))

        async def stopShard_context(self, context: Any) -> None:
            self.node.fence(int(context.params.epoch))
            self.node.shards.pop(str(context.params.shardId), None)
            say(event="stop", node=self.node.name, t=time.monotonic())

        async def declareEngines_context(self, context: Any) -> None:
            self.node.fence(int(context.params.epoch))

        async def inventory_context(self, context: Any) -> None:
            _codec.encode(inventory, context.results.init("inventory"))

    stopping: asyncio.Event
    kept: list[Any] = []

    async def one_session(node: Node, host: str, port: int) -> tuple[str, int | None] | None:
        """Register and heartbeat until the control plane fails; a refusal's leader and the
        lease's epoch it names (None when it names none)."""
        node.phase = "dial"
        stream = await asyncio.wait_for(
            capnp.AsyncIoStream.create_connection(
                host,
                int(port),
                ssl=contexts[node.name],
                server_hostname=host,
                ssl_handshake_timeout=DIAL_S,
            ),
            DIAL_S,
        )
        client = capnp.TwoPartyClient(stream)
        try:
            registry = client.bootstrap().cast_as(schema.Registry)
            request = registry.register_request()
            hello = model.Hello(
                node_id=node.name,
                agent_version="bench",
                inventory=inventory,
                shards=tuple(node.shards.values()),
            )
            _codec.encode(hello, request.hello)
            request.agent = Agent(node)
            node.phase = "register"
            try:
                response = await asyncio.wait_for(request.send(), REGISTER_S)
            except capnp.KjException as exc:
                decoded = _decode_error(str(exc))
                if decoded is not None and decoded[0] == "registration-refused":
                    say(event="refused", node=node.name, at=f"{host}:{port}", why=decoded[1])
                    extra = decoded[2]
                    if not extra.get("leader"):
                        return None
                    raw = str(extra.get("epoch") or "")
                    return extra["leader"], int(raw) if raw.isdigit() else None
                raise
            epoch = int(response.settings.epoch)
            node.newest_epoch = max(node.newest_epoch, epoch)
            node.session_epoch = epoch
            node.registered = True
            interval = float(response.settings.heartbeatIntervalS)
            session = response.session
            say(
                event="registered",
                node=node.name,
                at=f"{host}:{port}",
                epoch=epoch,
                t=time.monotonic(),
            )
            for report in node.shards.values():  # as llmgw-agent reports a change
                r = session.shardStatus_request()
                _codec.encode(report, r.shard)
                await asyncio.wait_for(r.send(), max(2 * interval, 1.0))
            seq = 0
            node.phase = "heartbeat"
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), interval)
                    return None
                seq += 1
                r = session.heartbeat_request()
                _codec.encode(model.Heartbeat(seq=seq, usage=inventory.usage), r.beat)
                await asyncio.wait_for(r.send(), max(2 * interval, 1.0))
            return None
        finally:
            # Never destroyed while the loop runs: closing or collecting a capnp stream
            # with calls just cancelled on it crashed pycapnp here (a segfault). A dead
            # session's objects are few; they go when the process exits.
            kept.append((stream, client))

    async def agent(name: str) -> None:
        node = Node(name)
        attempt = 0
        # As llmgw-agent's AgentSession: when a session with each address was lost, and
        # the epoch it was registered at.
        lost_at: dict[tuple[str, ...], tuple[float, int]] = {}

        def recently_lost(address: tuple[str, ...]) -> bool:
            at = lost_at.get(address, (-LOST_RECENTLY_S, 0))[0]
            return time.monotonic() - at < LOST_RECENTLY_S

        while not stopping.is_set():
            queue = [a for a in addresses if not recently_lost(a)] or list(addresses)
            tried: set[tuple[str, ...]] = set()
            while queue and not stopping.is_set():
                address = queue.pop(0)
                if address in tried:
                    continue
                tried.add(address)
                try:
                    node.registered = False
                    refusal = await one_session(node, *address)
                    attempt = 0
                    if refusal:
                        leader, epoch = refusal
                        named = tuple(leader.rsplit(":", 1))
                        lost = lost_at.get(named)
                        if lost is not None and epoch is not None and epoch > lost[1]:
                            del lost_at[named]  # elected again since: dialled at once
                        if not recently_lost(named):
                            queue.insert(0, named)
                except (OSError, TimeoutError, ssl.SSLError, capnp.KjException) as exc:
                    if node.registered:  # a session that was up and failed
                        lost_at[address] = (time.monotonic(), node.session_epoch)
                    say(
                        event="failed",
                        node=name,
                        at=":".join(address),
                        why=f"{node.phase}: {type(exc).__name__} {str(exc)[:100]}".strip(),
                    )
            if stopping.is_set():
                return
            delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(attempt, 30))
            attempt += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay * random.uniform(0.5, 1.0))

    async def amain() -> None:
        nonlocal stopping
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        async with capnp.kj_loop():
            say(event="ready", pid=os.getpid())
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.startswith("go"):
                return
            tasks = [asyncio.ensure_future(agent(n)) for n in nodes]
            await loop.run_in_executor(None, sys.stdin.readline)  # "stop" or EOF
            stopping.set()
            await asyncio.wait(tasks, timeout=5)
            for task in tasks:
                task.cancel()
            say(event="done")

    asyncio.run(amain())
    return 0


# --- the driver ---------------------------------------------------------------------


class Procs:
    """Every process of one run; `close()` ends them all, whatever state they are in."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []

    def spawn(self, argv: list[str], log: Path, *, pipes: bool = False) -> subprocess.Popen[bytes]:
        logf = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.logs.append(logf)
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else logf,
            stderr=logf if pipes else subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for logf in self.logs:
            logf.close()


class Events:
    """The JSON lines the client processes write, gathered as they come. Read with
    os.read from the raw pipes: a buffered readline can hold lines select() never
    reports again."""

    def __init__(self, workers: list[subprocess.Popen[bytes]]) -> None:
        self.fds = {w.stdout.fileno(): b"" for w in workers if w.stdout is not None}
        self.seen: list[dict[str, Any]] = []

    def pump(self, timeout: float) -> None:
        ready, _, _ = select.select(list(self.fds), [], [], max(0.0, timeout))
        for fd in ready:
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # the client exited: nothing more from it
                del self.fds[fd]
                continue
            *lines, self.fds[fd] = (self.fds[fd] + chunk).split(b"\n")
            self.seen.extend(json.loads(line) for line in lines if line.strip())

    def until(self, what: str, check: Any, deadline: float) -> Any:
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"failover bench: {what}: not in time")
            self.pump(0.05)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("event") == kind]


def server_config(
    work: Path, name: str, pki: Path, dsn: str, ports: dict[str, int], args: argparse.Namespace
) -> Path:
    body = {
        "state_dir": str(work / name),
        "rpc_listen": f"127.0.0.1:{ports['rpc']}",
        "advertise": f"127.0.0.1:{ports['rpc']}",
        "admin_listen": f"127.0.0.1:{ports['admin']}",
        "router_listen": f"127.0.0.1:{ports['router']}",
        "store": dsn,
        "lease_s": args.lease,
        "heartbeat_interval_s": args.heartbeat,
        "reconcile_interval_s": 0.5,
        "reconcile_settle_s": args.settle,
        "tls": {
            "ca": str(pki / "ca.crt"),
            "cert": str(pki / "server.crt"),
            "key": str(pki / "server.key"),
        },
        "models": [
            {
                "name": "sim",
                "source": str(work.parent / "models" / "sim.gguf"),
                "replicas": args.replicas_per_agent * args.current_n,
                "profiles": [{"engine": "llama-server", "gpus_per_node": 0}],
            }
        ],
    }
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(body, indent=1))  # JSON is YAML
    return path


def make_inventory(root: Path) -> tuple[Path, Path]:
    """A CPU node with llama-server (the fake) and the model file, as discovery reads it."""
    from llmgw.agent import discovery
    from llmgw.testing import fake_engine

    bin_dir = root / "bin"
    engine = fake_engine.install(bin_dir, "llama-server")
    models = root / "models"
    models.mkdir(exist_ok=True)
    (models / "sim.gguf").write_bytes(b"GGUF" + b"\0" * 4092)
    inventory = discovery.collect_inventory(
        runner=discovery.SubprocessRunner(env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}),
        nvml=None,
        hostname="sim-node",
        model_dirs=[str(models)],
        engine_paths={"llama-server": str(engine)},
    )
    path = root / "inventory.pickle"
    path.write_bytes(pickle.dumps(inventory))
    return path, engine


def get(url: str, key: str) -> Any:
    import httpx

    r = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=5)
    r.raise_for_status()
    return r.json()


def log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_one(n: int, args: argparse.Namespace, root: Path, inventory: Path) -> dict[str, Any]:
    import httpx

    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    # The tests' own: initdb as `nobody` on loopback; the balanced request stream.
    from helpers import BalancedLoad, postgres_instance

    from llmgw.ctl import _cert
    from llmgw.testing.cluster import free_port

    args.current_n = n
    work = root / f"{args.current_switch}-n{n}"
    work.mkdir()
    pki = root / "pki"
    nodes = [f"sim{i:04d}" for i in range(n)]
    for node in nodes:
        if not (pki / f"agent-{node}.crt").exists():
            _cert.issue_agent(pki, node)
    procs = Procs()
    result: dict[str, Any] = {"agents": n, "lease_s": args.lease, "switch": args.current_switch}
    deadline = time.monotonic() + args.timeout
    with postgres_instance(create_user=True) as pg, contextlib.ExitStack() as stack:
        dsn = pg.dsn
        assert dsn is not None
        stack.callback(procs.close)
        engine_port = free_port()
        engine = procs.spawn(
            [
                sys.executable,
                "-m",
                "llmgw.testing.fake_engine",
                "--fake-engine",
                "llama-server",
                "-m",
                str(root / "models" / "sim.gguf"),
                "--host",
                "127.0.0.1",
                "--port",
                str(engine_port),
                "-a",
                "sim",
            ],
            work / "engine.log",
        )
        cps: dict[str, dict[str, Any]] = {}
        for name in ("cp1", "cp2"):
            ports = {"rpc": free_port(), "admin": free_port(), "router": free_port()}
            config = server_config(work, name, pki, dsn, ports, args)
            cps[name] = {"ports": ports, "log": work / f"{name}.log", "config": config}
        for name in ("cp1", "cp2"):  # cp1 first: it leads
            cp = cps[name]
            cp["proc"] = procs.spawn(
                [
                    sys.executable,
                    "-m",
                    "llmgw.cp",
                    "--config",
                    str(cp["config"]),
                    "--log-level",
                    "info",
                ],
                cp["log"],
            )
            admin = f"http://127.0.0.1:{cp['ports']['admin']}"
            cp["admin"] = admin
            while True:
                if cp["proc"].poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{cp['log'].read_text()[-3000:]}")
                with contextlib.suppress(Exception):
                    if httpx.get(admin + "/healthz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not answer /healthz")
                time.sleep(0.2)
            cp["key"] = (work / name / "admin.key").read_text().strip()
            want = "leader" if name == "cp1" else "standby"
            while get(admin + "/api/v1/leader", cp["key"])["role"] != want:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} is not {want}")
                time.sleep(0.1)
        cp1, cp2 = cps["cp1"], cps["cp2"]
        epoch1 = get(cp1["admin"] + "/api/v1/leader", cp1["key"])["epoch"]
        made = subprocess.run(
            [sys.executable, "-m", "llmgw", "ctl", "keys", "create", "--tenant", "bench", "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
            env={**os.environ, "LLMGW_ADMIN_URL": cp1["admin"], "LLMGW_ADMIN_KEY": cp1["key"]},
        )
        api_key = json.loads(made.stdout)["secret"]
        rpc = {name: f"127.0.0.1:{cps[name]['ports']['rpc']}" for name in cps}
        order = (
            [rpc["cp2"], rpc["cp1"]] if args.order == "standby-first" else [rpc["cp1"], rpc["cp2"]]
        )
        clients = max(1, min(args.clients, n))
        workers = []
        for c in range(clients):
            spec = work / f"client{c}.json"
            spec.write_text(
                json.dumps(
                    {
                        "pki": str(pki),
                        "nodes": nodes[c::clients],
                        "addresses": order,
                        "engine_port": engine_port,
                        "engine_pid": engine.pid,
                        "inventory": str(inventory),
                    }
                )
            )
            workers.append(
                procs.spawn(
                    [sys.executable, str(HERE), "--worker", str(spec)],
                    work / f"client{c}.log",
                    pipes=True,
                )
            )
        events = Events(workers)
        events.until("clients ready", lambda: len(events.of("ready")) == clients, deadline)
        for w in workers:
            assert w.stdin is not None
            w.stdin.write(b"go\n")
            w.stdin.flush()

        def registered_with(address: str, epoch: int) -> set[str]:
            return {
                e["node"]
                for e in events.of("registered")
                if e["at"] == address and e["epoch"] == epoch
            }

        events.until(
            "all registered with cp1",
            lambda: registered_with(rpc["cp1"], epoch1) == set(nodes),
            deadline,
        )
        want_replicas = args.replicas_per_agent * n

        def routable(cp: dict[str, Any]) -> bool:
            rows = get(cp["admin"] + "/api/v1/replicas", cp["key"])["replicas"]
            if (
                sum(1 for r in rows if r["model"] == "sim" and r["state"] == "ready")
                < want_replicas
            ):
                return False
            r = httpx.post(
                f"http://127.0.0.1:{cp['ports']['router']}/v1/chat/completions",
                headers={"Authorization": f"Bearer {api_key}"},
                json={
                    "model": "sim",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                timeout=10,
            )
            return r.status_code == 200

        def answers(cp: dict[str, Any]) -> bool:
            r = httpx.post(
                f"http://127.0.0.1:{cp['ports']['router']}/v1/chat/completions",
                headers={"Authorization": f"Bearer {api_key}"},
                json={"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2},
                timeout=10,
            )  # fmt: skip
            return r.status_code == 200

        def poll(what: str, check: Any) -> float:
            """Seconds from the SIGSTOP until `check` holds (pumping agents' events)."""
            while True:
                with contextlib.suppress(Exception):
                    if check():
                        return time.monotonic() - frozen
                if time.monotonic() > deadline:
                    raise TimeoutError(f"failover bench, {n} agents: {what} not in time")
                events.pump(0.1)

        frozen = time.monotonic()  # placeholder until the SIGSTOP below
        poll("every replica routable through cp1", lambda: routable(cp1))
        result["placed_replicas"] = want_replicas

        # Both routers answer before the switch (the standby by the published list); then a
        # steady stream goes to both, as a client behind a load balancer sends it.
        poll("the standby's router answering", lambda: answers(cp2))
        load = BalancedLoad(
            [(name, f"http://127.0.0.1:{cps[name]['ports']['router']}/v1") for name in cps],
            api_key,
            model="sim",
            clients=args.load_clients,
        ).start()
        stack.callback(load.close)
        switch = args.current_switch
        frozen_wall, frozen = time.time(), time.monotonic()
        since_wall, since = frozen_wall, frozen  # what the times below count from
        if switch == "sigstop":  # the leader hangs
            os.killpg(cp1["proc"].pid, signal.SIGSTOP)
            new = cp2
        elif switch == "kill9":  # the leader dies
            os.killpg(cp1["proc"].pid, signal.SIGKILL)
            new = cp2
        else:  # the store goes away; the deposed leader wins the lease back
            pg.stop()
            while not re.search(r"leader: deposed at epoch", cp1["log"].read_text()):
                if time.monotonic() > deadline:
                    raise TimeoutError("failover bench: cp1 not deposed by the store outage")
                events.pump(0.1)
            while time.monotonic() < frozen + args.outage:
                events.pump(0.1)
            # The standby is held while the store returns, so the deposed leader takes the
            # lease (either may; this is the case whose agents used to stay away 20 s).
            os.killpg(cp2["proc"].pid, signal.SIGSTOP)
            try:
                pg.start()
                since_wall, since = time.time(), time.monotonic()  # from the store's return
                poll(
                    "cp1 elected again",
                    lambda: get(cp1["admin"] + "/api/v1/leader", cp1["key"])["role"] == "leader",
                )
            finally:
                os.killpg(cp2["proc"].pid, signal.SIGCONT)
            new = cp1
        poll(
            "the new leader leading",
            lambda: get(new["admin"] + "/api/v1/leader", new["key"])["role"] == "leader",
        )
        view = get(new["admin"] + "/api/v1/leader", new["key"])
        epoch2 = view["epoch"]
        elected = [
            line
            for line in new["log"].read_text().splitlines()
            if re.search(rf"leader: elected, epoch {epoch2}\b", line)
        ]
        result["takeover_s"] = log_time(elected[-1]) - since_wall if elected else None
        new_rpc = rpc["cp1" if new is cp1 else "cp2"]
        events.until(
            "all registered with the new leader",
            lambda: registered_with(new_rpc, epoch2) == set(nodes),
            deadline,
        )
        result["agents_moved_s"] = (
            max(
                e["t"]
                for e in events.of("registered")
                if e["at"] == new_rpc and e["epoch"] == epoch2
            )
            - since
        )
        result["routable_s"] = (
            poll("every replica routable through it", lambda: routable(new)) + frozen - since
        )
        steady_until = time.monotonic() + args.stream_after
        while time.monotonic() < steady_until:
            events.pump(0.1)
        load.close()
        result["requests"] = load.ok + len(load.failed)
        result["requests_moved"] = load.moved
        result["failed_requests"] = load.failed

        result["old_leader_standby_s"] = None  # None: it still said leader when we gave up
        if switch == "sigstop":  # the old leader wakes
            thawed = time.monotonic()
            os.killpg(cp1["proc"].pid, signal.SIGCONT)
            while time.monotonic() < thawed + 4 * args.lease:
                if get(cp1["admin"] + "/api/v1/leader", cp1["key"])["role"] == "standby":
                    result["old_leader_standby_s"] = time.monotonic() - thawed
                    break
                events.pump(0.1)
        settle_until = time.monotonic() + 2 * args.lease  # a few of its intervals awake
        while time.monotonic() < settle_until:
            events.pump(0.1)
        for w in workers:
            assert w.stdin is not None
            w.stdin.write(b"stop\n")
            w.stdin.flush()
        events.until("clients done", lambda: len(events.of("done")) == clients, deadline)
        after = [e for e in events.of("start") + events.of("stop") if e["t"] >= frozen]
        result["epochs"] = (epoch1, epoch2)
        result["commands_after_sigstop"] = len(after)
        result["stale_refused"] = len(events.of("stale"))
        result["refusals_followed"] = len(events.of("refused"))
        kinds: dict[str, int] = {}
        names = {address: name for name, address in rpc.items()}
        for e in events.of("failed"):  # a dial, a registration or a heartbeat
            why = f"{names.get(e['at'], e['at'])}: {e['why'][:60]}"
            kinds[why] = kinds.get(why, 0) + 1
        result["dial_failures"] = kinds
    return result


SWITCHES = {  # what the times count from
    "sigstop": "the SIGSTOP of the leader",
    "kill9": "the kill -9 of the leader",
    "store": "the store's return",
}


def show(r: dict[str, Any]) -> bool:
    goal = r["lease_s"] + 5.0
    switch = r["switch"]
    failed = r["failed_requests"]
    ok = (
        r["routable_s"] < goal
        and r["commands_after_sigstop"] == 0
        and not failed
        and (switch != "sigstop" or r["old_leader_standby_s"] is not None)
    )
    takeover = "?" if r["takeover_s"] is None else f"{r['takeover_s']:.1f} s"
    after = SWITCHES[switch]
    print(
        f"{switch}: {r['agents']} agents, lease_s {r['lease_s']:g} "
        f"(epoch {r['epochs'][0]} -> {r['epochs'][1]}):"
    )
    rows = [
        ("takeover", f"{takeover} after {after} (the new leader's log)"),
        ("agents moved", f"{r['agents_moved_s']:.1f} s"),
        ("every replica routable", f"{r['routable_s']:.1f} s ({r['placed_replicas']} replicas)"),
        (
            "failed requests",
            f"{len(failed)} of {r['requests']} (goal 0; {r['requests_moved']} answered by "
            "the other router after no answer)",
        ),
        (
            "engines restarted",
            f"{r['commands_after_sigstop']} (start/stop commands after the switch)",
        ),
        ("stale refusals", f"{r['stale_refused']} commands from the old epoch refused"),
        ("standby refusals", f"{r['refusals_followed']} registrations sent to the leader"),
    ]
    if switch == "sigstop":
        rows.append(
            (
                "old leader",
                f"a standby {r['old_leader_standby_s']:.1f} s after its SIGCONT"
                if r["old_leader_standby_s"] is not None
                else f"still says leader {4 * r['lease_s']:g} s after its SIGCONT (NOT fenced)",
            )
        )
    rows.append(
        (
            "goal",
            f"{'met' if ok else 'NOT met'} (routable < {goal:g} s, 0 failed requests, "
            "no engine restarted)",
        )
    )
    for name, value in rows:
        print(f"  {name:>22}: {value}")
    for line in failed[:5]:
        print(f"  {'failed':>22}: {line[:150]}")
    for why, count in r["dial_failures"].items():
        print(f"  {'sessions failed':>22}: {count} x {why}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="3,100", help="fleet sizes, comma-separated")
    parser.add_argument("--lease", type=float, default=3.0, help="lease_s")
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=1.0,
        help="heartbeat_interval_s (1: agents notice the silent leader before the takeover "
        "and are refused by the standby until it has taken over)",
    )
    parser.add_argument("--replicas-per-agent", type=int, default=1)
    parser.add_argument(
        "--order",
        choices=["leader-first", "standby-first"],
        default="leader-first",
        help="the agents' control plane list: the leader's address first, or the standby's",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="reconcile_settle_s: above 2 x heartbeat + 10 s (docs/operations.md)",
    )
    parser.add_argument(
        "--switches",
        default="sigstop,kill9,store",
        help="which switches, comma-separated: sigstop (the leader hangs), kill9 (it dies), "
        "store (PostgreSQL stopped for --outage s; the deposed leader wins the lease back)",
    )
    parser.add_argument("--outage", type=float, default=10.0, help="the store outage, s")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument(
        "--load-clients", type=int, default=2, help="threads sending the request stream"
    )
    parser.add_argument(
        "--stream-after",
        type=float,
        default=3.0,
        help="the stream goes on this long after every replica is routable again, s",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="per fleet size, s")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    sizes = [int(x) for x in args.agents.split(",") if x]
    switches = [x for x in args.switches.split(",") if x]
    unknown = sorted(set(switches) - SWITCHES.keys())
    if unknown:
        parser.error(f"--switches: {', '.join(unknown)}: expected some of {', '.join(SWITCHES)}")
    # SIGTERM unwinds like Ctrl-C: every process and the PostgreSQL are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from llmgw.ctl import _cert

    results = []
    met = True
    with tempfile.TemporaryDirectory(prefix="llmgw-failover-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)
        pki = root / "pki"
        _cert.init_ca(pki)
        _cert.issue_server(pki, ["127.0.0.1"])
        inventory, _engine = make_inventory(root)
        print(
            f"{os.cpu_count()} CPUs; agents list the {args.order.replace('-', ' ')}; "
            f"heartbeat_interval_s {args.heartbeat:g}, reconcile_settle_s {args.settle:g}"
        )
        for switch in switches:
            args.current_switch = switch
            for n in sizes:
                r = run_one(n, args, root, inventory)
                met = show(r) and met
                results.append(r)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"goal {'met at every size and switch' if met else 'NOT met at some size or switch'}")
    return 0  # a measurement: the figures say whether the goal is met


if __name__ == "__main__":
    sys.exit(main())
