"""Router workers inside the control plane (`router.workers: N` in server.yaml).

The control plane keeps worker 0 in its own process, as with one worker, and
starts N-1 worker processes (`python -m llmgw.cp._worker`), each listening on
router_listen with SO_REUSEPORT, so the kernel spreads connections between
them; each admits its `share()` of the model limits (tenants' limits are leased from
the store by each worker: llmgw/router/_budgets.py). They talk to the control plane
over one Unix socket in state_dir (`router.sock`, mode 0600), one connection per
worker, JSON lines both ways:

    worker -> cp   {"hello": i, "pid": P}                           once
    cp -> worker   {"router": {...}, "store": WHERE, "admin_key": PATH}  once (server.yaml)
    cp -> worker   {"version": V, "endpoints": {model: [[id, model, engine, host, port, slots,
                                                   [adapter held, ...]]]},
                    "traffic": {split: {versions, keys}},  (llmgw.router.encode_traffic)
                    "holds": {model: {"max": n, "s": seconds}},  (llmgw.router.encode_holds)
                    "adapters": {name: {"base", ...}}}  (llmgw.router.encode_adapters)
                   at once, then whenever the fleet view's version moves (checked every 50 ms)
    worker -> cp   {"version": V, "in_flight": {endpoint id: n},    every 200 ms, and at once
                    "quarantined": {endpoint id: reason},           after applying a new view
                    "load": {model: RouterLoad.as_json()}}          (absent ids: 0, none)
    both ways      {"learned": [[endpoint id, sent, delta, [block hash, ...]], ...]}
                   what a worker's prefix index learned, every 50 ms when there is any;
                   the control plane relays each worker's to every other worker and applies
                   it to its own router (worker 0), whose facts it sends to all
                   (llmgw/router/_share.py, llmgw/core/_prefix_share.py)

A persistent connection rather than HTTP polling: the view reaches a worker
within about 100 ms of a change with no request per poll, and the connection
itself is the liveness signal both ways: a worker whose control plane is gone
(even killed) reads EOF and exits; a worker that is gone drops its report.

`in_flight(endpoint id)` (what a drain waits on) sums the control plane's own
count with every worker's last report, and is None (unknown: the drain waits
for drain_timeout_s, as it does without a router) while any worker has not
reported within `STALE_S`, or its report is for an older view than the one the
control plane lists now: only a worker that has applied the view without a
retiring replica can say it will send it nothing new.

`loads_by_router()` is each router's load per served model (llmgw/core/_load.py
RouterLoad: the autoscaler's signals), the control plane's own as "w0" and each
worker's as "w{i}-{pid}" (a restarted worker is a new router: its counters start
from zero again); a worker not heard from within `STALE_S` is left out. Counters
are per router, never summed here: the reader differences each router's readings
(`core.grown`). A load that does not parse is dropped, with a warning naming the
worker. A model with a hold (llmgw/router/_holds.py) is held by each worker, its
`share()` of `hold_max` each, as by the control plane's own router.

`quarantined()` is every worker's endpoints quarantined as wedged (llmgw/router/_wedge.py)
with the control plane's own: a wedge one worker saw is the replica's, and the reconciler
replaces it (a report older than `STALE_S` is dropped: that worker says nothing).

Worker i serves its own `/metrics` on the admin listener's port + i (worker 0's are
the admin listener's own); a worker that cannot bind there routes without metrics.
Workers open the store themselves; their key cache (key_cache_ttl_s) bounds how
long a revoked key is still admitted there, as in the control plane.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import trio

from llmgw import config
from llmgw._process import run_service, setup_logging
from llmgw.core import Learned, Outbox, RouterLoad, TrafficSplit
from llmgw.cp._admin import read_admin_key
from llmgw.router import (
    AdapterRoute,
    Endpoint,
    EndpointSource,
    Hold,
    Lines,
    LineSender,
    Relay,
    Router,
    RouterConfig,
    StoreKeys,
    adapters_of,
    decode_adapters,
    decode_holds,
    decode_traffic,
    encode_adapters,
    encode_holds,
    encode_traffic,
    hear,
    holds_of,
    keep_worker,
    learned_line,
    listener_limits,
    metrics_app,
    parse_learned,
    private_unix_listener,
    send_line,
    serve_http,
    tell,
)
from llmgw.store import open_store

log = logging.getLogger("llmgw.cp.workers")

SOCKET_NAME = "router.sock"
STALE_S = 1.0  # a worker not heard from for this long: in-flight counts unknown
_PUSH_EVERY_S = 0.05  # views checked, and learned facts relayed, this often
_REPORT_EVERY_S = 0.2


_Lines = Lines  # the channel's line reader (llmgw/router/_share.py)
_send = send_line


def _encode(source: EndpointSource) -> dict[str, Any]:
    snap = source.snapshot()
    return {
        "version": source.version,
        "endpoints": {
            name: [
                [e.endpoint_id, e.model, e.engine, e.host, e.port, e.slots, list(e.adapters)]
                for e in eps
            ]
            for name, eps in snap.items()
        },
        "traffic": encode_traffic(source.traffic()),
        "holds": encode_holds(holds_of(source)),
        "adapters": encode_adapters(adapters_of(source)),
    }


class _Report:
    def __init__(
        self,
        version: int,
        counts: Mapping[str, int],
        at: float,
        wedged: Mapping[str, str] | None = None,
        loads: Mapping[str, RouterLoad] | None = None,
        router: str = "",
    ) -> None:
        self.version, self.counts, self.at = version, counts, at
        self.wedged = wedged or {}  # endpoint id -> why the worker quarantined it
        self.loads = loads or {}  # served name -> the worker's load (the autoscaler's)
        self.router = router  # "w{i}-{pid}": a restarted worker is another router


def _loads(index: int, value: object, warned: list[bool]) -> dict[str, RouterLoad]:
    """A report's "load", each model's validated: a bad one is dropped (the first time
    on a connection with a warning naming the worker, then quietly)."""
    if value is None:
        return {}
    out: dict[str, RouterLoad] = {}
    bad: list[str] = []
    if not isinstance(value, dict):
        bad.append(f"load is not an object: {value!r:.80}")
        value = {}
    for name, raw in value.items():
        try:
            out[str(name)] = RouterLoad.from_json(raw)
        except ValueError as exc:
            bad.append(f"{str(name)[:60]!r}: {exc}")
    if bad:
        (log.debug if warned[0] else log.warning)(
            "router worker %d: dropped a bad load in its report (%s)", index, "; ".join(bad)
        )
        warned[0] = True
    return out


def loads_by_router(local: Router, hub: WorkerHub | None) -> dict[str, dict[str, RouterLoad]]:
    """Each router's load per served model: the control plane's own ("w0") and, with
    workers, each worker's that reported within `STALE_S` ("w{i}-{pid}")."""
    out = {"w0": local.loads()}
    if hub is not None:
        out.update(hub.loads())
    return out


class WorkerHub:
    """The control plane's end: serves the channel, keeps the workers' reports."""

    def __init__(
        self,
        source: EndpointSource,
        workers: int,
        router_section: Mapping[str, Any],
        store: str | Path,
        admin_key_path: Path,
        metrics_at: tuple[str, int] | None = None,
        local: Router | None = None,
    ) -> None:
        """`store`: where the control plane's store is (`open_store`'s argument): each
        worker opens it to read keys. `metrics_at`: the admin listener's host and port;
        worker i serves its own `/metrics` on that port + i. `local`: the control plane's
        own router (worker 0), which shares what its prefix index learns with the workers
        (llmgw/router/_share.py) through this hub, the relay."""
        self._source = source
        self.workers = workers
        self._local = local
        self.relay = Relay()
        # The admin key's file: a worker explains decisions to it too.
        self._setup: dict[str, Any] = {
            "router": dict(router_section),
            "store": str(store),
            "admin_key": str(admin_key_path),
        }
        if metrics_at is not None:
            self._setup["metrics"] = list(metrics_at)
        self._reports: dict[int, _Report] = {}

    def in_flight(self, endpoint_id: str) -> int | None:
        """The workers' (1..N-1) requests in flight to the endpoint; None: unknown."""
        now = time.monotonic()
        version = self._source.version
        total = 0
        for i in range(1, self.workers):
            r = self._reports.get(i)
            if r is None or now - r.at > STALE_S or r.version != version:
                return None
            total += r.counts.get(endpoint_id, 0)
        return total

    def loads(self) -> dict[str, dict[str, RouterLoad]]:
        """The workers' (1..N-1) loads by router id ("w{i}-{pid}"), from reports made
        within `STALE_S` (`loads_by_router` adds the control plane's own)."""
        now = time.monotonic()
        return {r.router: dict(r.loads) for r in self._reports.values() if now - r.at <= STALE_S}

    def quarantined(self) -> dict[str, str]:
        """The workers' (1..N-1) endpoints quarantined as wedged, and why."""
        now = time.monotonic()
        out: dict[str, str] = {}
        for r in self._reports.values():
            if now - r.at <= STALE_S:
                out.update(r.wedged)
        return out

    async def serve(
        self, path: Path, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        sock = await private_unix_listener(path)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    trio.serve_listeners, self._connection, [trio.SocketListener(sock)]
                )
                if self._local is not None:
                    nursery.start_soon(self._tell_local, self._local)
                task_status.started()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def _connection(self, stream: trio.SocketStream) -> None:
        index: int | None = None
        try:
            lines = _Lines(stream)
            hello = await lines.next()
            index = int(hello["hello"])
            if not 1 <= index < self.workers:
                log.warning("router worker channel: no worker %s (of %d)", index, self.workers)
                return
            pid = int(hello["pid"])
            await _send(stream, self._setup)
            log.info("router worker %d (pid %d) connected", index, pid)
            box = self.relay.join(index)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._push, stream, box, nursery.cancel_scope)
                    await self._receive(index, lines, f"w{index}-{pid}")
                    nursery.cancel_scope.cancel()
            finally:
                self.relay.leave(index, box)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("router worker %s: bad hello on the channel: %s", index, exc)
        finally:
            if index is not None:
                self._reports.pop(index, None)
                log.info("router worker %d disconnected", index)
            await stream.aclose()

    async def _receive(self, index: int, lines: _Lines, router: str | None = None) -> None:
        """The worker's reports, until it closes the channel (or breaks it); `router`:
        its router id in `loads()` (default "w{index}")."""
        router = router or f"w{index}"
        warned = [False]
        try:
            while True:
                msg = await lines.next()
                if "learned" in msg:
                    self._learned(index, parse_learned(msg))
                    continue
                counts = {str(k): int(v) for k, v in msg["in_flight"].items()}
                wedged = {str(k): str(v) for k, v in msg.get("quarantined", {}).items()}
                loads = _loads(index, msg.get("load"), warned)
                self._reports[index] = _Report(
                    int(msg["version"]), counts, time.monotonic(), wedged, loads, router
                )
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("router worker %d: bad report on the channel: %s", index, exc)

    def _learned(self, source: int, facts: list[Learned]) -> None:
        """Worker `source`'s index learned `facts`: the others are to hear them."""
        self.relay.publish(source, facts)
        if self._local is not None:
            self._local.fleet.learned(facts, trio.current_time())

    async def _tell_local(self, router: Router) -> None:
        """What worker 0's (this process's) index learns, to the relay."""
        box = router.fleet.outbox
        if box is None:
            return
        while True:
            await trio.sleep(_PUSH_EVERY_S)
            router.fleet.expire_remote(trio.current_time())
            if len(box):
                self.relay.publish(0, box.take())

    async def _push(self, stream: trio.SocketStream, box: Outbox, scope: trio.CancelScope) -> None:
        """The fleet view whenever its version moves, and what the other workers learned
        (`box`, this worker's outbox at the relay): the channel's only writer."""
        sent: int | None = None
        try:
            while True:
                if self._source.version != sent:
                    view = _encode(self._source)
                    await _send(stream, view)
                    sent = view["version"]
                if len(box):
                    await _send(stream, learned_line(box.take()))
                await trio.sleep(_PUSH_EVERY_S)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()


async def supervise(
    workers: int,
    socket_path: Path,
    host: str,
    port: int,
    log_level: str | None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep workers 1..N-1 running (restart a dead one); cancel to stop them (SIGTERM,
    then SIGKILL after 5 s)."""
    async with trio.open_nursery() as nursery:
        for i in range(1, workers):
            argv = [sys.executable, "-m", "llmgw.cp._worker", "--socket", str(socket_path)]
            argv += ["--worker", str(i), "--host", host, "--port", str(port)]
            if log_level:
                argv += ["--log-level", log_level]
            nursery.start_soon(keep_worker, i, argv)
        task_status.started()


# --- the worker's end ----------------------------------------------------------------------


class RemoteEndpoints:
    """The control plane's fleet view, as last received."""

    def __init__(self) -> None:
        self._version = -1
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self._traffic: dict[str, TrafficSplit] = {}
        self._holds: dict[str, Hold] = {}
        self._adapters: dict[str, AdapterRoute] = {}

    @property
    def version(self) -> int:
        return self._version

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        return self._snapshot

    def traffic(self) -> Mapping[str, TrafficSplit]:
        return self._traffic

    def holds(self) -> Mapping[str, Hold]:
        return self._holds

    def adapters(self) -> Mapping[str, AdapterRoute]:
        return self._adapters

    def apply(self, view: Mapping[str, Any]) -> None:
        self._snapshot = {
            name: tuple(
                Endpoint(
                    str(a),
                    str(b),
                    str(c),
                    str(d),
                    int(e),
                    None if f is None else int(f),
                    tuple(str(x) for x in rest[0]) if rest else (),
                )
                for a, b, c, d, e, f, *rest in eps
            )
            for name, eps in view["endpoints"].items()
        }
        self._traffic = decode_traffic(view.get("traffic"))
        self._holds = decode_holds(view.get("holds"))
        self._adapters = decode_adapters(view.get("adapters"))
        self._version = int(view["version"])


async def run_worker(
    socket_path: Path,
    index: int,
    host_port: tuple[str, int],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One worker: until the channel closes (the control plane is gone or stopping)."""
    stream = await trio.open_unix_socket(str(socket_path))
    async with stream:
        lines = _Lines(stream)
        send = LineSender(stream)  # the reporter, the view loop and `tell` all write
        await send({"hello": index, "pid": os.getpid()})
        setup = await lines.next()
        router_cfg = config.structure(setup["router"], RouterConfig, "server.yaml", at="router")
        source = RemoteEndpoints()
        source.apply(await lines.next())
        store = await open_store(setup["store"])
        keys = StoreKeys(store)
        admin_key = read_admin_key(Path(setup["admin_key"])) if "admin_key" in setup else None
        router = Router(
            router_cfg,
            source,
            keys,
            worker=index,
            admin_key=admin_key,
            usage=store,
            budget=store,
        )
        seen: set[str] = set()

        async def report() -> None:
            listed = {e.endpoint_id for eps in source.snapshot().values() for e in eps}
            seen.update(listed)
            counts = {eid: n for eid in seen if (n := router.in_flight(eid)) > 0}
            seen.intersection_update(listed | counts.keys())  # gone and idle: never again
            msg: dict[str, Any] = {"version": source.version, "in_flight": counts}
            msg["load"] = {name: load.as_json() for name, load in router.loads().items()}
            wedged = router.fleet.quarantined()
            if wedged:
                msg["quarantined"] = wedged
            await send(msg)

        async def reporter(scope: trio.CancelScope) -> None:
            try:
                while True:
                    await report()
                    await trio.sleep(_REPORT_EVERY_S)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                log.warning("router worker %d: the control plane is gone, stopping", index)
                scope.cancel()

        async def teller(scope: trio.CancelScope) -> None:
            try:
                await tell(router.fleet, send)  # what the index learns, to the others
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(router.run)
                host, port = host_port
                await nursery.start(
                    partial(serve_http, limits=listener_limits(router_cfg), reuse_port=True),
                    router.app,
                    host,
                    port,
                )
                nursery.start_soon(reporter, nursery.cancel_scope)
                nursery.start_soon(teller, nursery.cancel_scope)
                metrics_note = ""
                if setup.get("metrics"):
                    mhost, mport = str(setup["metrics"][0]), int(setup["metrics"][1]) + index
                    try:
                        if mport > 65535:
                            raise OSError(f"port {mport} is above 65535")
                        mport = await nursery.start(serve_http, metrics_app(router), mhost, mport)
                        metrics_note = f"; metrics on http://{mhost}:{mport}/metrics"
                    except OSError as exc:  # routing matters more than this worker's metrics
                        log.warning(
                            "router worker %d: no metrics: cannot listen on %s:%d (admin "
                            "listener's port + %d): %s",
                            index,
                            mhost,
                            mport,
                            index,
                            exc.strerror or exc,
                        )
                log.info(
                    "router worker %d of %d (pid %d) on http://%s:%d%s",
                    index,
                    router_cfg.workers,
                    os.getpid(),
                    host,
                    port,
                    metrics_note,
                )
                task_status.started()
                try:
                    while True:
                        msg = await lines.next()
                        if "learned" in msg:  # what the other workers' indexes learned
                            hear(router.fleet, msg)
                            continue
                        source.apply(msg)
                        router.refresh()
                        await report()
                except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                    log.warning("router worker %d: the control plane is gone, stopping", index)
                nursery.cancel_scope.cancel()
        finally:
            router.close()
            with trio.CancelScope(shield=True):
                await store.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw-cp router worker")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--log-level", default=None)
    ns = parser.parse_args(argv)
    setup_logging(ns.log_level)
    return run_service(
        f"llmgw-cp router worker {ns.worker}",
        lambda: run_worker(ns.socket, ns.worker, (ns.host, ns.port)),
    )
