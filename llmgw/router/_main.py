"""Router-only mode: the router alone, in front of a static list of endpoints.

    llmgw-router --config router.yaml          serve (workers: N > 1: N processes, supervised)
    llmgw-router keys --db keys.db create --tenant acme [--model M ...] [--band B] [--max-band B]
    llmgw-router keys --db keys.db list
    llmgw-router keys --db keys.db revoke KEY_ID

router.yaml:

    listen: 0.0.0.0:8080
    metrics_listen: 127.0.0.1:9090        # optional: Prometheus /metrics
    endpoints:
      - {model: chat, engine: vllm, url: "http://10.0.0.5:8000", slots: 256}
    keys:                                 # and/or keys_db: /var/lib/llmgw/keys.db
      - {key: "llmgw-...", tenant: acme, models: [chat], default_band: interactive}
    # and any RouterConfig field: retries, idle_timeout_s, bands, queue_limit, ...
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import hypercorn.config
import trio
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

from llmgw import config
from llmgw._process import run_service, setup_logging
from llmgw.errors import ConfigError, LlmgwError
from llmgw.keys import ApiKey
from llmgw.router import _hypercorn as _hc
from llmgw.router import _request_id, _server
from llmgw.router._keys import CachedKeys, KeyStore, StaticKeys, StoreKeys
from llmgw.router._router import Router, RouterConfig
from llmgw.router._share import serve_relay, share_via_relay
from llmgw.router._types import Endpoint, StaticEndpoints
from llmgw.store import open_sqlite_file
from llmgw.web.asgi import App, Receive, Scope, Send, lifespan
from llmgw.web.limits import ListenerLimits

log = logging.getLogger("llmgw.router")

ENGINES = ("vllm", "sglang", "llama-server")
DEFAULT_LISTEN = config.HostPort("0.0.0.0:8080")


@attrs.define(kw_only=True, frozen=True)
class EndpointDecl:
    model: str
    engine: str
    url: str
    slots: int | None = None
    id: str | None = None


@attrs.define(kw_only=True, frozen=True)
class KeyDecl:
    key: str
    tenant: str
    models: list[str] | None = None
    default_band: str = "interactive"
    max_band: str | None = None
    name: str = ""
    id: str | None = None


@attrs.define(kw_only=True, frozen=True)
class RouterFile:
    listen: config.HostPort = DEFAULT_LISTEN
    metrics_listen: config.HostPort | None = None
    endpoints: list[EndpointDecl] = attrs.field(factory=list)
    keys: list[KeyDecl] = attrs.field(factory=list)
    keys_db: Path | None = None
    # A file holding the admin key: requests with it may ask `x-llmgw-explain: 1`.
    admin_key_file: Path | None = None
    log_level: str | None = None
    # "lean": llmgw's own HTTP/1.1 server (see _server.py; about twice the requests per
    # core); "hypercorn": the ASGI server the control plane's other listeners use.
    server: str = "lean"


def load(path: Path) -> tuple[RouterFile, RouterConfig, list[Endpoint]]:
    """Read router.yaml; a ConfigError lists every problem with its path."""
    return parse(config.read_yaml(path), str(path))


def parse(data: Any, source: str) -> tuple[RouterFile, RouterConfig, list[Endpoint]]:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    router_fields = {a.name for a in attrs.fields(RouterConfig)}
    own = {k: v for k, v in data.items() if k not in router_fields}
    rest = {k: v for k, v in data.items() if k in router_fields}
    problems: list[str] = []
    file_cfg: RouterFile | None = None
    router_cfg: RouterConfig | None = None
    try:
        file_cfg = config.structure(own, RouterFile, source)
    except ConfigError as exc:
        problems.extend(str(exc).splitlines())
    try:
        router_cfg = config.structure(rest, RouterConfig, source)
    except ConfigError as exc:
        problems.extend(str(exc).splitlines())
    endpoints: list[Endpoint] = []
    if file_cfg is not None:
        seen: set[str] = set()
        for i, decl in enumerate(file_cfg.endpoints):
            where = f"{source}: endpoints[{i}]"
            if decl.engine not in ENGINES:
                problems.append(
                    f"{where}.engine: {decl.engine!r} is not one of {', '.join(ENGINES)}"
                )
            url = urlsplit(decl.url)
            try:
                port = url.port
            except ValueError:
                port = None
            if url.scheme != "http" or not url.hostname or port is None:
                problems.append(
                    f"{where}.url: expected http://HOST:PORT (the engine's own address), "
                    f"got {decl.url!r}"
                )
                continue
            eid = decl.id or f"{decl.model}@{url.hostname}:{port}"
            if eid in seen:
                problems.append(f"{where}: endpoint {eid} is listed twice")
            seen.add(eid)
            endpoints.append(Endpoint(eid, decl.model, decl.engine, url.hostname, port, decl.slots))
        if file_cfg.server not in ("lean", "hypercorn"):
            problems.append(f"{source}: server: {file_cfg.server!r} is not lean or hypercorn")
        if router_cfg is not None and router_cfg.workers > 1:
            if file_cfg.server != "lean":
                problems.append(
                    f"{source}: workers: {router_cfg.workers} needs server: lean (the "
                    f"workers share the port with SO_REUSEPORT), got server: {file_cfg.server!r}"
                )
            if file_cfg.metrics_listen is not None:
                _, mport = config.split_host_port(file_cfg.metrics_listen)
                if mport and mport + router_cfg.workers - 1 > 65535:
                    problems.append(
                        f"{source}: metrics_listen: worker i serves its metrics on port "
                        f"{mport}+i, and {mport}+{router_cfg.workers - 1} is above 65535"
                    )
        if not file_cfg.keys and file_cfg.keys_db is None:
            problems.append(f"{source}: keys or keys_db: the router needs API keys to admit anyone")
        if router_cfg is not None:
            bands = {b.name for b in router_cfg.bands}
            for i, k in enumerate(file_cfg.keys):
                for field, value in (("default_band", k.default_band), ("max_band", k.max_band)):
                    if value is not None and value not in bands:
                        problems.append(
                            f"{source}: keys[{i}].{field}: no band {value!r} "
                            f"(the bands are {', '.join(sorted(bands))})"
                        )
    if problems:
        raise ConfigError("\n".join(problems))
    assert file_cfg is not None and router_cfg is not None
    return file_cfg, router_cfg, endpoints


def static_keys(decls: list[KeyDecl]) -> StaticKeys:
    return StaticKeys(
        (
            d.key,
            ApiKey(
                key_id=d.id or f"static-{i}",
                tenant=d.tenant,
                models=None if d.models is None else frozenset(d.models),
                default_band=d.default_band,
                max_band=d.max_band or d.default_band,
                created_at=0.0,
                name=d.name,
            ),
        )
        for i, d in enumerate(decls)
    )


class _ChainedKeys:
    """Keys from the file first, then the database."""

    def __init__(self, first: StaticKeys, then: KeyStore) -> None:
        self._first = first
        self._then = then

    async def create(self, **kw: Any) -> tuple[ApiKey, str]:
        return await self._then.create(**kw)

    async def list(self) -> list[ApiKey]:
        return [*(await self._first.list()), *(await self._then.list())]

    async def revoke(self, key_id: str) -> bool:
        return await self._then.revoke(key_id)

    async def lookup(self, secret: str) -> ApiKey | None:
        return self._first.lookup_now(secret) or await self._then.lookup(secret)


@asynccontextmanager
async def open_keys_db(path: Path) -> AsyncIterator[StoreKeys]:
    """The keys in a keys database: the store (llmgw/store) on that one SQLite file,
    opened and migrated (a key file of an older router is migrated in), then closed."""
    db = await open_sqlite_file(path)
    try:
        yield StoreKeys(db)
    finally:
        with trio.CancelScope(shield=True):
            await db.aclose()


def metrics_app(router: Router) -> App:
    """`GET /metrics` (Prometheus text) and `GET /healthz`; rendered on the event loop."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        rid = _request_id.new().encode()
        common = [(_request_id.HEADER, rid), (_request_id.OWN_HEADER, rid)]
        if scope["method"] not in ("GET", "HEAD"):  # (HEAD: the server sends the head only)
            body, ctype, status = b"only GET and HEAD are served here\n", "text/plain", 405
            common.append((b"allow", b"GET, HEAD"))
        elif scope["path"] == "/metrics":
            body, ctype = generate_latest(router.metrics_registry), CONTENT_TYPE_LATEST
            status = 200
        elif scope["path"] == "/healthz":
            body, ctype, status = b'{"status":"ok"}', "application/json", 200
        else:
            body, ctype, status = b"not found\n", "text/plain", 404
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype.encode()),
                    (b"content-length", b"%d" % len(body)),
                    *common,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def listener_limits(cfg: RouterConfig) -> ListenerLimits:
    """The client-side bounds of the router's listener, from the router's config."""
    return ListenerLimits(
        head_timeout_s=cfg.client_head_timeout_s,
        body_timeout_s=cfg.client_body_timeout_s,
        send_timeout_s=cfg.idle_timeout_s,
        keepalive_s=cfg.client_keepalive_s,
        max_head_bytes=cfg.max_head_bytes,
        # An early answer (413) waits for this much more of the body at most.
        discard_bytes=max(cfg.max_body_bytes, 64 << 20),
    )


def _hypercorn(bind: str, cfg: RouterConfig) -> hypercorn.config.Config:
    # keep_alive_timeout (75 s by default) is longer than common client pools keep
    # idle connections.
    return _hc.config(bind, listener_limits(cfg))


async def serve(
    file_cfg: RouterFile,
    router_cfg: RouterConfig,
    endpoints: list[Endpoint],
    *,
    worker: int = 0,
    port: int | None = None,
    relay: Path | None = None,
    task_status: trio.TaskStatus[Router] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the router; with `router_cfg.workers` > 1, as worker `worker` of them, on
    `port` (the supervisor's, shared with SO_REUSEPORT) and metrics on metrics_listen's
    port + `worker`, telling the others what its prefix index learns through the
    supervisor's `relay` socket (llmgw/router/_share.py). A worker stops when its
    supervisor is gone."""
    admin_key = None
    if file_cfg.admin_key_file is not None:
        try:
            admin_key = file_cfg.admin_key_file.read_text().strip() or None
        except OSError as exc:
            where = file_cfg.admin_key_file
            raise ConfigError(f"admin_key_file: {where}: {exc.strerror or exc}") from None
        if admin_key is None:
            raise ConfigError(f"admin_key_file: {file_cfg.admin_key_file} is empty")
    async with AsyncExitStack() as stack:
        keys: KeyStore = static_keys(file_cfg.keys)
        if file_cfg.keys_db is not None:
            stored = await stack.enter_async_context(open_keys_db(file_cfg.keys_db))
            keys = _ChainedKeys(static_keys(file_cfg.keys), stored) if file_cfg.keys else stored
        router = Router(
            router_cfg,
            StaticEndpoints(endpoints),
            CachedKeys(keys, router_cfg.key_cache_ttl_s),
            worker=worker,
            admin_key=admin_key,
        )
        workers = router_cfg.workers
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(router.run)
                limits = listener_limits(router_cfg)
                if file_cfg.server == "hypercorn":
                    await nursery.start(
                        partial(_hc.serve, send_timeout_s=limits.send_timeout_s),
                        _hc.guard(router.app, limits),
                        _hypercorn(file_cfg.listen, router_cfg),
                    )
                else:
                    host, listen_port = config.split_host_port(file_cfg.listen)
                    listen_port = await nursery.start(
                        partial(_server.serve, limits=limits, reuse_port=workers > 1),
                        router.app,
                        host,
                        listen_port if port is None else port,
                    )
                metrics_at = ""
                if file_cfg.metrics_listen:
                    host, mport = config.split_host_port(file_cfg.metrics_listen)
                    mport = await nursery.start(
                        _server.serve, metrics_app(router), host, mport + worker if mport else 0
                    )
                    metrics_at = f"; metrics on http://{host}:{mport}/metrics"
                if workers > 1:
                    nursery.start_soon(_exit_with_parent, os.getppid(), nursery.cancel_scope)
                if relay is not None:
                    nursery.start_soon(share_via_relay, router.fleet, relay, worker)
                log.info(
                    "router listening on http://%s for %d endpoints of %d models%s%s",
                    file_cfg.listen if port is None else f"{host}:{port}",
                    len(endpoints),
                    len({e.model for e in endpoints}),
                    metrics_at,
                    f" (worker {worker} of {workers}, pid {os.getpid()})" if workers > 1 else "",
                )
                task_status.started(router)
        finally:
            router.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["keys"]:
        return keys_main(args[1:])
    parser = argparse.ArgumentParser(prog="llmgw-router", description="the llmgw router, alone")
    parser.add_argument(
        "--config",
        type=Path,
        default=Path(os.environ.get("LLMGW_ROUTER_CONFIG", "/etc/llmgw/router.yaml")),
        help="router.yaml (default: $LLMGW_ROUTER_CONFIG or /etc/llmgw/router.yaml)",
    )
    parser.add_argument("--log-level", default=None)
    # Set by the supervisor for the worker processes it starts (workers: N > 1).
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--relay", type=Path, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(args)
    try:
        file_cfg, router_cfg, endpoints = load(ns.config)
        if ns.worker is not None and not 0 <= ns.worker < router_cfg.workers:
            raise ConfigError(
                f"{ns.config}: workers: {router_cfg.workers}, but this is worker {ns.worker} "
                f"(the file changed under a running router?)"
            )
    except ConfigError as exc:
        setup_logging(ns.log_level)
        print(f"llmgw-router: {exc}", file=sys.stderr)
        return 2
    setup_logging(ns.log_level or file_cfg.log_level)
    # As llmgw-cp: a counter's `_created` series is one more series per label set that
    # no dashboard reads (docs/metrics.md).
    disable_created_metrics()  # type: ignore[no-untyped-call]
    if router_cfg.workers > 1 and ns.worker is None:
        return run_service(
            "llmgw-router", lambda: supervise(ns.config, file_cfg, router_cfg, ns.log_level)
        )
    name = "llmgw-router" if ns.worker is None else f"llmgw-router worker {ns.worker}"
    return run_service(
        name,
        lambda: serve(
            file_cfg, router_cfg, endpoints, worker=ns.worker or 0, port=ns.port, relay=ns.relay
        ),
    )


# --- workers -------------------------------------------------------------------------------

# A worker that dies sooner than this after its start is restarted after a pause
# (no hot loop on a crash at startup); one stopped by SIGTERM gets this long to exit.
_QUICK_DEATH_S = 5.0
_RESTART_PAUSE_S = 1.0
_STOP_GRACE_S = 5.0


def _hold_port(source: str, host: str, port: int) -> socket.socket:
    """Bind (never listen) host:port with SO_REUSEPORT: a busy port fails here, once, and
    port 0 becomes one port for every worker. Not listening, it takes no connections."""
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"{source}: listen: cannot bind {host}:{port}: {exc.strerror or exc} "
            f"(another process there without SO_REUSEPORT?)"
        ) from None
    return sock


async def supervise(
    path: Path,
    file_cfg: RouterFile,
    router_cfg: RouterConfig,
    log_level: str | None,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `router_cfg.workers` worker processes of this router on one port until
    cancelled (SIGTERM to each, then SIGKILL after `_STOP_GRACE_S`); restart any that
    dies. A worker's configuration error (exit 2) stops them all (the file is broken).
    With prefix sharing (the prefix policy and `prefix_sharing`), relay what each
    worker's prefix index learns to the others (llmgw/router/_share.py) over a Unix
    socket in a directory of the supervisor's own (mode 0700)."""
    host, port = config.split_host_port(file_cfg.listen)
    holder = _hold_port(str(path), host, port)
    port = int(holder.getsockname()[1])
    workers = router_cfg.workers
    sharing = router_cfg.prefix_sharing and router_cfg.policy == "prefix"
    relay_dir = Path(tempfile.mkdtemp(prefix="llmgw-router-")) if sharing else None
    try:
        async with trio.open_nursery() as nursery:
            relay = None
            if relay_dir is not None:
                relay = relay_dir / "relay.sock"
                await nursery.start(serve_relay, relay, workers)
            for i in range(workers):
                argv = [sys.executable, "-m", "llmgw.router", "--config", str(path)]
                argv += ["--worker", str(i), "--port", str(port)]
                if relay is not None:
                    argv += ["--relay", str(relay)]
                if log_level:
                    argv += ["--log-level", log_level]
                nursery.start_soon(keep_worker, i, argv)
            log.info(
                "router: %d workers on http://%s:%d (pid %d supervises)%s",
                workers,
                host,
                port,
                os.getpid(),
                f"; prefix relay on {relay}" if relay is not None else "",
            )
            task_status.started(port)
    finally:
        holder.close()
        if relay_dir is not None:
            shutil.rmtree(relay_dir, ignore_errors=True)


async def keep_worker(index: int, argv: list[str]) -> None:
    """Run router worker `index` (`argv`) until cancelled, restarting it whenever it ends.

    Cancelled: SIGTERM, then SIGKILL after `_STOP_GRACE_S` (5 s). A worker that exits 2
    (its configuration is wrong) raises ConfigError instead of a restart; one that dies
    within `_QUICK_DEATH_S` (5 s) of starting is restarted after `_RESTART_PAUSE_S` (1 s).
    The control plane keeps its router workers (llmgw/cp/_workers.py) with it too.
    """
    while True:
        started = trio.current_time()
        proc = await trio.lowlevel.open_process(argv)
        log.info("router worker %d started (pid %d)", index, proc.pid)
        try:
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                with trio.CancelScope(shield=True):
                    proc.send_signal(signal.SIGTERM)
                    with trio.move_on_after(_STOP_GRACE_S):
                        await proc.wait()
                    if proc.returncode is None:
                        log.warning("router worker %d (pid %d) killed", index, proc.pid)
                        proc.kill()
                        await proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        if code == 2:
            raise ConfigError(f"router worker {index} (pid {proc.pid}): {how}, see its log")
        lived = trio.current_time() - started
        log.warning(
            "router worker %d (pid %d) ended after %.1f s (%s); restarting",
            index,
            proc.pid,
            lived,
            how,
        )
        if lived < _QUICK_DEATH_S:
            await trio.sleep(_RESTART_PAUSE_S)


async def _exit_with_parent(parent: int, scope: trio.CancelScope) -> None:
    """Stop this worker when its supervisor is gone (killed without stopping us)."""
    while True:
        await trio.sleep(1.0)
        if os.getppid() != parent:
            break
    log.warning("router worker: supervisor %d is gone, stopping", parent)
    scope.cancel()


def keys_main(argv: list[str]) -> int:
    """Manage the keys in a router-only keys database (the control plane has `llmgw ctl keys`)."""
    parser = argparse.ArgumentParser(prog="llmgw-router keys")
    parser.add_argument("--db", type=Path, required=True, help="the keys database (keys_db)")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="create a key; its secret is shown once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--model", action="append", dest="models", help="repeat; default: all")
    create.add_argument("--band", default="interactive", help="default priority band")
    create.add_argument("--max-band", default=None, help="highest band it may ask for")
    create.add_argument("--name", default="")
    sub.add_parser("list", help="list keys (never their secrets)")
    revoke = sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    ns = parser.parse_args(argv)

    async def run() -> int:
        async with open_keys_db(ns.db) as store:
            return await command(store)

    async def command(store: StoreKeys) -> int:
        if ns.command == "create":
            key, secret = await store.create(
                tenant=ns.tenant,
                models=ns.models,
                default_band=ns.band,
                max_band=ns.max_band,
                name=ns.name,
            )
            print(f"{key.key_id}\t{secret}")
            print("the secret is shown only now; keep it safe", file=sys.stderr)
            return 0
        if ns.command == "list":
            for k in await store.list():
                models = ",".join(sorted(k.models)) if k.models is not None else "*"
                state = "revoked" if k.revoked else "active"
                print(f"{k.key_id}\t{k.tenant}\t{models}\t{k.default_band}\t{k.max_band}\t{state}")
            return 0
        if await store.revoke(ns.key_id):
            print(f"revoked {ns.key_id}")
            return 0
        print(f"no key {ns.key_id}", file=sys.stderr)
        return 1

    try:
        return trio.run(run)
    except LlmgwError as exc:
        print(f"llmgw-router keys: {exc}", file=sys.stderr)
        return 1
