"""A control plane and agents as real processes on loopback, for tests and the demo.

Everything lives under one directory: the PKI made by `llmgw ctl cert`, one
YAML file per process, state directories and logs. Processes are started with
the same Python that runs this module, so a virtualenv's console scripts are
not needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from llmgw.ctl import init_ca, issue_agent, issue_server

__all__ = ["ControlPlane", "LocalCluster", "Proc", "free_port", "wait_for"]

# Test runs in parallel (pytest-xdist) give each worker its own blocks of ports, below
# the kernel's ephemeral range (32768-60999 on Linux) so that no worker's client socket
# takes a port another worker has picked for a server: tests/conftest.py sets
# LLMGW_TEST_PORTS ("first-last", for free_port) and LLMGW_TEST_ENGINE_PORTS (the
# engines' range a LocalCluster writes into server.yaml `engine_ports`).
_next_port: int | None = None
_STRIDE = 37  # prime to every block size the tests use (2,000): the walk meets every port


def _env_range(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    first, _, last = value.partition("-")
    return int(first), int(last)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now: from LLMGW_TEST_PORTS when set, else whatever the
    kernel picks. The block is walked from a random start per process (so a test's
    subprocess rarely walks the same ports as its parent) in strides of _STRIDE, never
    to the next port: a control plane's router workers take the admin port + 1, + 2..."""
    global _next_port
    block = _env_range("LLMGW_TEST_PORTS")
    if block is None:
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    first, last = block
    size = last - first + 1
    if _next_port is None:
        _next_port = first + int.from_bytes(os.urandom(2), "big") % size
    for _ in range(size):
        port, _next_port = _next_port, first + (_next_port + _STRIDE - first) % size
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} in LLMGW_TEST_PORTS {first}-{last}")


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except Exception as exc:  # the thing being waited for may not be up yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s (last: {last!r})")
        time.sleep(interval)


class Proc:
    def __init__(self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self._logf: IO[bytes] = open(log, "ab")  # noqa: SIM115 - lives as long as the process
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )

    def __repr__(self) -> str:
        return f"<Proc {self.name} pid={self.pid} rc={self.popen.poll()}>"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        self._logf.close()

    def terminate(self, timeout: float = 5.0) -> tuple[int, float]:
        """SIGTERM; returns (exit code, seconds taken). Kills it if it overstays `timeout`."""
        start = time.monotonic()
        self.popen.send_signal(signal.SIGTERM)
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            rc = -9
        self._logf.close()
        return rc, time.monotonic() - start

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def freeze(self) -> None:
        """SIGSTOP its whole process group (llmgw-cp and its router workers), as a machine
        that hangs: sockets stay open, nothing answers."""
        os.killpg(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)


class ControlPlane:
    """One llmgw-cp of a LocalCluster: its ports, state directory, server.yaml, log and
    process. Every control plane of a cluster shares the PKI, the catalog and
    `server_extra` (so `store:` and `lease_s`); each advertises its own RPC address."""

    def __init__(self, cluster: LocalCluster, name: str, *, config: Path | None = None) -> None:
        self.cluster = cluster
        self.name = name
        self.rpc_port = free_port(cluster.rpc_host)
        self.admin_port = free_port()
        self.router_port = free_port()
        self.state_dir = cluster.root / name
        self.config = config or cluster.root / f"server-{name}.yaml"
        self.log = cluster.root / f"{name}.log"
        self.proc: Proc | None = None

    def __repr__(self) -> str:
        return f"<ControlPlane {self.name} rpc={self.rpc} proc={self.proc!r}>"

    @property
    def rpc(self) -> str:
        """The address agents dial, as it advertises it."""
        return f"{self.cluster.rpc_host}:{self.rpc_port}"

    @property
    def admin(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}/v1"

    @property
    def admin_key(self) -> str:
        return (self.state_dir / "admin.key").read_text().strip()

    def api_get(self, path: str) -> dict[str, Any]:
        """`GET path` of its admin API with its admin key: the JSON answer."""
        import httpx

        response = httpx.get(
            self.admin_url + path,
            headers={"Authorization": f"Bearer {self.admin_key}"},
            timeout=30,
        )
        response.raise_for_status()
        return dict(response.json())

    def leader(self) -> dict[str, Any]:
        """Its `GET /api/v1/leader`."""
        return self.api_get("/api/v1/leader")

    def healthy(self) -> bool:
        import httpx

        return httpx.get(self.admin_url + "/healthz", timeout=2).status_code == 200

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`llmgw ctl` against this control plane's admin API, with its admin key."""
        return self.cluster.ctl(*args, check=check, admin=(self.admin_url, self.admin_key))


class LocalCluster:
    def __init__(
        self,
        root: Path,
        *,
        heartbeat_interval_s: float = 1.0,
        rpc_host: str = "127.0.0.1",
        settle_s: float = 3.0,
        server_names: Sequence[str] = ("127.0.0.1", "localhost"),
    ) -> None:
        self.root = root
        self.pki = root / "pki"
        self.rpc_host = rpc_host
        self.server_names = list(server_names)
        # The first control plane keeps the single-CP names (server.yaml, cp/, cp.log,
        # `cp`, `rpc_port`, ...); `add_control_plane` adds more beside it.
        self.first = ControlPlane(self, "cp", config=root / "server.yaml")
        self.more: dict[str, ControlPlane] = {}
        self.router_extra: dict[str, Any] = {}
        self.server_extra: dict[str, Any] = {}  # more server.yaml keys, as they are
        # server.yaml `engine_ports`; None: the control plane's default.
        self.engine_ports = _env_range("LLMGW_TEST_ENGINE_PORTS")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.settle_s = settle_s
        self.models: list[dict[str, Any]] = []
        # The weights mirror's directory (served over TLS on mirror_port); None: no mirror.
        self.mirror_dir: Path | None = None
        self.mirror_port = free_port()
        self.agents: dict[str, Proc] = {}
        self.env = dict(os.environ)
        self.env.pop("LLMGW_AGENT_CONFIG", None)
        self.env["PYTHONUNBUFFERED"] = "1"

    @property
    def cp(self) -> Proc | None:
        return self.first.proc

    @cp.setter
    def cp(self, proc: Proc | None) -> None:
        self.first.proc = proc

    @property
    def rpc_port(self) -> int:
        return self.first.rpc_port

    @rpc_port.setter
    def rpc_port(self, port: int) -> None:
        self.first.rpc_port = port

    @property
    def admin_port(self) -> int:
        return self.first.admin_port

    @admin_port.setter
    def admin_port(self, port: int) -> None:
        self.first.admin_port = port

    @property
    def router_port(self) -> int:
        return self.first.router_port

    @router_port.setter
    def router_port(self, port: int) -> None:
        self.first.router_port = port

    @property
    def admin_url(self) -> str:
        return self.first.admin_url

    @property
    def router_url(self) -> str:
        return self.first.router_url

    @property
    def control_planes(self) -> list[ControlPlane]:
        """The first control plane, then those added, in order."""
        return [self.first, *self.more.values()]

    def add_control_plane(self, name: str) -> ControlPlane:
        """Another llmgw-cp sharing the PKI, the catalog and `server_extra` (put the shared
        `store:` there), with its own state directory, ports and advertised RPC address.
        Agents configured after this list every control plane's address, first one first."""
        if name in self.more or name == self.first.name or name in ("pki", "bin"):
            raise ValueError(f"control plane name {name!r} is taken; pick another")
        cp = self.more[name] = ControlPlane(self, name)
        return cp

    def api_key(self, tenant: str = "test") -> str:
        """A new router API key (its secret), from the first control plane: what `llmgw ctl
        keys create --tenant TENANT` asks its admin API for, asked over HTTP (most tests
        make one; a ctl process is ~0.4 s of CPU on a loaded two-core machine). The ctl's
        own `keys create` is tested in tests/ctl."""
        import httpx

        response = httpx.post(
            self.first.admin_url + "/api/v1/keys",
            headers={"Authorization": f"Bearer {self.admin_key}"},
            json={"tenant": tenant, "default_band": "interactive", "name": ""},
            timeout=30,
        )
        if response.status_code != 201:
            raise AssertionError(
                f"POST /api/v1/keys for tenant {tenant}: {response.status_code} {response.text}"
            )
        return str(response.json()["secret"])

    @property
    def admin_key(self) -> str:
        return self.first.admin_key

    def setup(self, nodes: Sequence[str]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.pki / "ca.crt").exists():
            init_ca(self.pki)
            issue_server(self.pki, self.server_names)
        for node in nodes:
            if not (self.pki / f"agent-{node}.crt").exists():
                issue_agent(self.pki, node)
        self.write_server_config()
        for node in nodes:
            self.write_agent_config(node)

    def write_server_config(self, models: list[dict[str, Any]] | None = None) -> Path:
        """server.yaml (and each added control plane's); `models` replaces the catalog (the
        running control planes reload it). Returns the first control plane's file."""
        if models is not None:
            self.models = models
        for cp in self.more.values():
            self._write_cp_config(cp)
        return self._write_cp_config(self.first)

    def _write_cp_config(self, cp: ControlPlane) -> Path:
        # With one control plane its file stays as it always was: no `advertise`.
        advertise = {"advertise": cp.rpc} if self.more else {}
        return self._write(
            cp.config.name,
            {
                "state_dir": str(cp.state_dir),
                "rpc_listen": f"{self.rpc_host}:{cp.rpc_port}",
                "admin_listen": cp.admin,
                "router_listen": f"127.0.0.1:{cp.router_port}",
                **advertise,
                "router": self.router_extra,
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "reconcile_interval_s": 0.5,
                "reconcile_settle_s": self.settle_s,
                "stop_grace_s": 5.0,
                **({"engine_ports": list(self.engine_ports)} if self.engine_ports else {}),
                "tls": {
                    "ca": str(self.pki / "ca.crt"),
                    "cert": str(self.pki / "server.crt"),
                    "key": str(self.pki / "server.key"),
                },
                "models": self.models,
                **(
                    {
                        "mirror": {
                            "dir": str(self.mirror_dir),
                            "listen": f"127.0.0.1:{self.mirror_port}",
                        }
                    }
                    if self.mirror_dir is not None
                    else {}
                ),
                **self.server_extra,
            },
        )

    def write_agent_config(
        self,
        node: str,
        *,
        cert_node: str | None = None,
        servers: Sequence[str] | None = None,
        **extra: Any,
    ) -> Path:
        """`servers`: the control planes it dials, in order (default: every one, first first)."""
        cert_node = cert_node or node
        body = {
            "node_id": node,
            "servers": list(servers)
            if servers is not None
            else [cp.rpc for cp in self.control_planes],
            "state_dir": str(self.root / node),
            "weights_dir": str(self.root / f"{node}-weights"),
            "reconnect_max_s": 1.0,
            "tls": {
                "ca": str(self.pki / "ca.crt"),
                "cert": str(self.pki / f"agent-{cert_node}.crt"),
                "key": str(self.pki / f"agent-{cert_node}.key"),
            },
            **extra,
        }
        return self._write(f"{node}.yaml", body)

    def _write(self, name: str, body: Mapping[str, Any]) -> Path:
        path = self.root / name
        # JSON is YAML: no dumper needed for a config file we generate. Written
        # whole and renamed, as an operator's editor would: a reload never
        # sees half a file.
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        tmp.replace(path)
        return path

    def start_cp(self, name: str | None = None) -> Proc:
        """Start the first control plane, or the one added as `name`; waits for /healthz."""
        cp = self.first if name is None else self.more[name]
        proc = cp.proc = Proc(
            "llmgw-cp" if name is None else f"llmgw-cp {name}",
            [sys.executable, "-m", "llmgw.cp", "--config", str(cp.config)],
            cp.log,
            self.env,
        )

        def up() -> bool:
            if not proc.alive():
                return True  # said below, at once: waiting longer will not help
            return cp.healthy()

        wait_for(f"the admin API of {cp.name}", up, 20)
        if not proc.alive():
            raise AssertionError(f"{proc!r} exited at start:\n{proc.output()[-3000:]}")
        return proc

    def start_agent(self, node: str, *, env: Mapping[str, str] | None = None) -> Proc:
        proc = Proc(
            node,
            [sys.executable, "-m", "llmgw.agent", "--config", str(self.root / f"{node}.yaml")],
            self.root / f"{node}.log",
            {**self.env, **(env or {})},
        )
        self.agents[node] = proc
        return proc

    def start_fleet(
        self, nodes: Sequence[str], engine_paths: Mapping[str, str], timeout: float = 60
    ) -> None:
        """Set up, start the control plane and one agent per node (each running the
        engines in `engine_paths`), and wait until every node is ready."""
        self.setup(nodes)
        for node in nodes:
            self.write_agent_config(node, engine_paths=dict(engine_paths))
        self.start_cp()
        for node in nodes:
            self.start_agent(node)
        self.wait_states({n: "ready" for n in nodes}, timeout=timeout)

    def _healthz(self) -> bool:
        return self.first.healthy()

    def ctl(
        self, *args: str, check: bool = True, admin: tuple[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`llmgw ctl` against the first control plane, or `admin` (its URL, its key)."""
        url, key = admin or (self.admin_url, self.admin_key)
        env = {**self.env, "LLMGW_ADMIN_URL": url, "LLMGW_ADMIN_KEY": key}
        done = subprocess.run(
            [sys.executable, "-m", "llmgw", "ctl", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"llmgw ctl {' '.join(args)}: rc={done.returncode}\n{done.stderr}")
        return done

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The first control plane's nodes: `GET /api/v1/nodes`, which `ctl nodes --json`
        prints as is. Read over HTTP, not by a ctl process: tests poll this every 0.2 s,
        and a Python process per poll loaded the two-core machine it was measuring (and
        took longer than the 1 s between heartbeats a test compares two reads across)."""
        return {n["node_id"]: n for n in self.first.api_get("/api/v1/nodes")["nodes"]}

    def states(self) -> dict[str, str]:
        return {k: v["state"] for k, v in self.nodes().items()}

    def wait_states(self, want: Mapping[str, str], timeout: float) -> dict[str, str]:
        def check() -> dict[str, str] | None:
            states = self.states()
            return states if all(states.get(k) == v for k, v in want.items()) else None

        return dict(wait_for(f"nodes {dict(want)}", check, timeout))

    def stop_all(self) -> None:
        cps = [cp.proc for cp in self.control_planes if cp.proc is not None]
        for proc in [*self.agents.values(), *cps]:
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    proc.thaw()  # a frozen one would never see its SIGTERM
                proc.terminate()
        self.kill_engines()

    def kill_engines(self) -> list[int]:
        """Engines outlive their agents by design; a test's must not outlive the test."""
        from llmgw.agent import OWNER_ENV, process_environ

        killed = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            owner = process_environ(int(entry.name)).get(OWNER_ENV, "")
            if owner.startswith(str(self.root.resolve())):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
        return killed
