"""The control plane assembled: every part built from constructor arguments, then
started in a documented order (`run`).

`assemble` builds the parts in an order that lets each be given what it needs
when it is built; `run` starts them: the registry, the reconciler, leadership
(before the RPC listener, so a control plane alone on its store leads before the
first agent dials), the endpoint publisher and reader, the catalog's watch, the
sizes, then the listeners: RPC, admin, the router's. No attribute is set on a
built part from outside it; where two parts need each other a small object made
first is handed to both (the wake-ups of llmgw/cp/_fleet/_wake.py, Leadership's
callbacks), or a closure that is called only once all is built.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import attrs
import hypercorn.config
import prometheus_client
import trio

from llmgw import config, core
from llmgw.cp._admin import AdminApp, ensure_admin_key, read_admin_key
from llmgw.cp._fleet import _engines
from llmgw.cp._fleet._adapter_metrics import AdapterCollector
from llmgw.cp._fleet._adapters import AdapterManager
from llmgw.cp._fleet._autoscaler import Autoscaler
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._endpoints import (
    EndpointPublisher,
    FleetEndpoints,
    PublishedEndpoints,
    RoleEndpoints,
    endpoint_id,
    replica_of,
)
from llmgw.cp._fleet._fleet_metrics import FleetCollector
from llmgw.cp._fleet._leader import Holder, LeaderCollector, Leadership, advertised
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._retiring import Retiring
from llmgw.cp._fleet._rollouts import Rollouts
from llmgw.cp._fleet._wake import Wakeup
from llmgw.cp._legacy import import_legacy
from llmgw.cp._observe._event_keeper import EventKeeper
from llmgw.cp._observe._history import History
from llmgw.cp._pages import Sessions, api_client, make_pages
from llmgw.cp._weights._mirror import ManifestCache, serve_mirror
from llmgw.cp._weights._sizes import SourceSizes
from llmgw.cp._workers import SOCKET_NAME, WorkerHub, loads_by_router, supervise
from llmgw.errors import LlmgwError
from llmgw.router import (
    Router,
    RouterConfig,
    StoreKeys,
    listener_limits,
    serve_http,
    serve_hypercorn,
)
from llmgw.rpc import (
    CapnpThread,
    Deadlines,
    HandshakeLimits,
    check_certificates,
    server_tls_context,
)
from llmgw.store import SqlStore, store_location

log = logging.getLogger("llmgw.cp")


async def run(
    cfg: config.ServerConfig,
    catalog: CatalogFile,
    store: SqlStore,
    router_cfg: RouterConfig | None = None,
    *,
    log_level: str | None = None,
    hashes: ManifestCache | None = None,
    lease_store: SqlStore | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The control plane's parts, built (`assemble`) and started in this order."""
    log.info("store: %s", store.where)
    check_certificates(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
    tls = server_tls_context(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
    key_path, created = ensure_admin_key(cfg.state_dir)
    if created:
        log.info("created the first admin key in %s (keep it safe)", key_path)
    await import_legacy(cfg.state_dir, store)  # the files an older llmgw-cp kept, once
    hashes = hashes or ManifestCache()
    rpc_host, rpc_port = config.split_host_port(cfg.rpc_listen)
    deadlines = Deadlines(default_s=cfg.rpc_deadline_s)
    handshake = HandshakeLimits(
        timeout_s=cfg.rpc_handshake_timeout_s, max_pending=cfg.rpc_max_pending_handshakes
    )
    async with (
        CapnpThread.open(deadlines=deadlines, handshake=handshake) as bridge,
        trio.open_nursery() as nursery,
    ):
        mirror_port = None
        if cfg.mirror.dir is not None:
            # Before the registry is built: every registration's Settings name its port.
            mirror_port = await _start_mirror(nursery, cfg, cfg.mirror.dir, hashes)
        cp = await assemble(
            cfg,
            catalog,
            store,
            router_cfg,
            key_path=key_path,
            lease_store=lease_store,
            close_connection=bridge.close_connection,
            mirror_port=mirror_port,
        )
        await nursery.start(cp.registry.run)
        # Off every request path: events and page sessions go to the store from here.
        await nursery.start(cp.events.run)
        nursery.start_soon(cp.sessions.writer)
        await nursery.start(cp.reconciler.run)
        await nursery.start(cp.autoscaler.run)
        await nursery.start(cp.adapters.run)
        # Before the RPC listener: alone on its store, this control plane leads before
        # the first agent dials, so none is refused at start.
        await nursery.start(cp.leadership.run)
        nursery.start_soon(cp.publisher.run)
        nursery.start_soon(cp.published.run)
        nursery.start_soon(catalog.watch, cp.catalog_changed, cp.registry.declare_engines)
        await nursery.start(cp.sizes.run)
        rpc_bound = await nursery.start(bridge.serve, rpc_host, rpc_port, tls, cp.registry)
        await nursery.start(serve_hypercorn, cp.admin, admin_http_config(cfg.admin_listen))
        await nursery.start(cp.router.run)
        if cfg.router_listen is not None:
            # The lean HTTP/1.1 server, not hypercorn: profiled, hypercorn was
            # 45% of the router's CPU (llmgw/router/_server.py says more).
            host, port = config.split_host_port(cfg.router_listen)
            limits = listener_limits(cp.router.config)
            bound = await nursery.start(
                partial(serve_http, limits=limits, reuse_port=cp.hub is not None),
                cp.router.app,
                host,
                port,
            )
            if cp.hub is not None:
                sock = cfg.state_dir / SOCKET_NAME
                await nursery.start(cp.hub.serve, sock)
                await nursery.start(supervise, cp.workers, sock, host, bound, log_level)
            log.info(
                "router: OpenAI API on http://%s:%d/v1%s",
                host,
                bound,
                f" ({cp.workers} workers, this is 0)" if cp.hub is not None else "",
            )
        log.info(
            "control plane ready: agents on %s:%d, admin API on http://%s; %s, epoch %s;"
            " advertised as %s",
            rpc_host,
            rpc_bound,
            cfg.admin_listen,
            cp.leadership.view().role,
            cp.leadership.epoch,
            cp.leadership.me.describe(),
        )
        task_status.started()


@attrs.frozen
class ControlPlane:
    """The parts `run` starts, built by `assemble`."""

    registry: NodeRegistry
    reconciler: Reconciler
    autoscaler: Autoscaler
    adapters: AdapterManager
    leadership: Leadership
    sizes: SourceSizes
    publisher: EndpointPublisher
    published: PublishedEndpoints
    router: Router
    hub: WorkerHub | None
    workers: int
    admin: AdminApp
    events: EventKeeper  # the event log's writer to the store, and its reader
    sessions: Sessions  # the admin pages' logins, kept in the store
    catalog_changed: Callable[[], None]  # what a catalog reload that changed it pokes


async def assemble(
    cfg: config.ServerConfig,
    catalog: CatalogFile,
    store: SqlStore,
    router_cfg: RouterConfig | None,
    *,
    key_path: Path,
    lease_store: SqlStore | None,
    close_connection: Callable[[int], Awaitable[None]],
    mirror_port: int | None,
) -> ControlPlane:
    """Every part, each given what it needs when it is built, in an order that lets
    it: the retiring replicas (which the reconciler notes and the endpoint list
    reads) and the router come before the reconciler, which asks the router what is
    in flight. Where two parts truly need each other, a small object is made first
    and handed to both: the two wake-ups (llmgw/cp/_fleet/_wake.py) that the registry, the
    sizes and the catalog poke; and Leadership, which the registry acts under and
    whose election and deposition reach the registry (and the reconciler) through
    the callbacks below, called only from its `run`, once all is built."""
    plan_again = Wakeup()  # the reconciler waits on it
    endpoints_stale = Wakeup()  # the endpoint list recomputes when next read

    async def elected(epoch: int) -> None:
        await registry.load_state(store)  # the other control plane may have changed them
        await rollouts.load(store)  # and rolled models: this one continues
        events.reload()  # and recorded what happened: read behind, never waited for
        history.took_over()  # the nodes' hour so far is the other's: the page says so
        registry.lead(epoch)
        reconciler.elected()  # the settle counts from now

    def deposed(why: str) -> None:
        registry.step_down(why)

    def learned_leader(holder: Holder | None) -> None:
        # With the lease's epoch: an agent that lost this leader at an older epoch (it was
        # deposed and elected again) dials it at once (llmgw/agent/_session.py).
        registry.set_leader(holder.rpc if holder is not None else None, leadership.epoch)

    leadership = Leadership(
        lease_store or store,
        advertised(cfg),
        cfg.lease_s,
        elected,
        deposed,
        on_leader=learned_leader,
    )

    def queue_depth(node: str, replica: str) -> tuple[float | None, float | None] | None:
        """The engine's running and waiting requests as the router last scraped them."""
        state = router.endpoint_states().get(endpoint_id(replica, node))
        if state is None or state.scraped_at is None:
            return None
        if trio.current_time() - state.scraped_at > router.score_config().stale_after_s:
            return None  # the scorer counts it as unknown; so does the history
        return state.running, state.waiting

    # Each node's last hour, one sample a heartbeat; the queue figures come from the
    # router, built below (asked only once a heartbeat arrives, after all is built).
    history = History(queue=queue_depth)
    # A standby until the lease is taken (llmgw/cp/_fleet/_leader.py): it refuses registrations.
    registry = NodeRegistry(
        policy(cfg),
        forget_after_s=cfg.forget_after_s,
        leading=False,
        lease=leadership,
        listeners=(plan_again.poke, endpoints_stale.poke),
        close_connection=close_connection,
        mirror_port=mirror_port,
        mirror_tls=cfg.mirror.tls if mirror_port is not None else False,
        engines=catalog.engines,  # before the RPC listener: every registration has it
        history=history,
    )
    await registry.load_state(store)  # overrides, and the known nodes a restart waits for
    # The event log as the store keeps it (what happened before this start, or before a
    # failover: llmgw/cp/_observe/_event_keeper.py); read now, and again when elected.
    events = EventKeeper(registry.events, store, keep=cfg.events_kept)
    try:
        await events.load()
    except LlmgwError as exc:
        log.warning("events: cannot read them from the store (read again behind): %s", exc)
        events.reload()
    rollouts = Rollouts()  # the endpoint list names what it pins, the reconciler rolls
    await rollouts.load(store)
    log.info("engines: %s", _engines.describe(catalog.engines))
    # Each fetched source's size, for placement's disk check: measured by a task of
    # its own (llmgw/cp/_weights/_sizes.py), never inside a pass; a size that changes
    # pokes the reconciler.
    sizes = SourceSizes(
        lambda: [m.source for m in catalog.catalog.models],
        cfg.mirror.dir,
        on_change=plan_again.poke,
    )
    retiring = Retiring(on_change=endpoints_stale.poke)
    endpoints = FleetEndpoints(
        registry, lambda: rollouts.catalog(catalog.catalog), retiring.replicas
    )
    endpoints_stale.on_poke(endpoints.refresh)
    # The router in either role: the fleet's list while leading, else the leader's, as it
    # published it in the store (llmgw/cp/_fleet/_endpoints.py).
    published = PublishedEndpoints(store)
    # On an election the router keeps the published list, endpoint by endpoint, until the
    # agents have re-registered (llmgw/cp/_fleet/_handover.py); the engines' health is the
    # router's own readings (built below, asked only once a request is routed).
    routed = RoleEndpoints(
        endpoints,
        published,
        registry.acting,
        registered=lambda: [r.node_id for r in registry.records()],
        unhealthy=lambda: [e for e, s in router.endpoint_states().items() if not s.healthy],
        handover_s=cfg.lost_after_s,
    )
    # What this leader routes by, the handover included: publishing its own view, empty
    # right after an election, sent the standby's router to nothing.
    publisher = EndpointPublisher(store, routed, registry.acting, lambda: registry.epoch)
    keys = StoreKeys(store)
    admin_key = read_admin_key(key_path)
    router = Router(
        router_cfg or RouterConfig(), routed, keys, admin_key=admin_key, usage=store, budget=store
    )
    workers = router.config.workers if cfg.router_listen is not None else 1
    # Workers 1..N-1 run in processes of their own (llmgw/cp/_workers.py); this one is 0.
    # Each opens the store itself (SQLite in WAL mode, or PostgreSQL) to read keys.
    hub = (
        WorkerHub(
            routed,
            workers,
            cfg.router,
            store_location(cfg.store, cfg.state_dir, "server.yaml"),
            key_path,
            config.split_host_port(cfg.admin_listen),
            local=router,
        )
        if workers > 1
        else None
    )

    def endpoint_in_flight(eid: str) -> int | None:
        mine = router.in_flight(eid)  # first: it re-reads the view the workers must match
        if hub is None:
            return mine
        theirs = hub.in_flight(eid)
        return None if theirs is None else mine + theirs

    def in_flight(replica: str, node: str) -> int | None:
        return endpoint_in_flight(endpoint_id(replica, node))

    def wedged() -> dict[str, str]:
        """Replica id -> why a router here (this process or a worker) quarantined it."""
        seen = router.fleet.quarantined()
        if hub is not None:
            seen.update(hub.quarantined())
        return {replica_of(eid): reason for eid, reason in seen.items()}

    # Every control plane writes its routers' load; the leader decides
    # (llmgw/cp/_fleet/_autoscaler.py). The reconciler asks it each model's count.
    autoscaler = Autoscaler(
        lambda: catalog.catalog, partial(loads_by_router, router, hub), store,
        leadership.me.rpc, registry.acting,
        registry.events, poke=plan_again.poke,
    )  # fmt: skip
    reconciler = Reconciler(
        registry,
        lambda: catalog.catalog,
        interval_s=cfg.reconcile_interval_s,
        settle_s=cfg.reconcile_settle_s,
        stop_grace_s=cfg.stop_grace_s,
        drain_timeout_s=cfg.drain_timeout_s,
        unhealthy_replace_s=cfg.unhealthy_replace_s,
        engine_ports=cfg.engine_ports,
        sizes=sizes,
        wake=plan_again,
        retiring=retiring,
        rollouts=rollouts,
        # Without router_listen no requests pass here: in flight is unknown.
        in_flight=in_flight if cfg.router_listen is not None else None,
        wedged=wedged if cfg.router_listen is not None else None,
        count=autoscaler.count,
        queued=autoscaler.queued,
        lower=autoscaler.lower,
    )
    autoscaler.live = reconciler.live
    # Which replica holds which LoRA adapter (llmgw/cp/_fleet/_adapters.py): the leader
    # loads one where requests wait for it; the router's view reads what each holds.
    adapters = AdapterManager(
        lambda: catalog.catalog,
        registry,
        acting=registry.acting,
        demand=autoscaler.demand,
        in_flight=endpoint_in_flight,
        refresh=endpoints_stale.poke,
        events=registry.events,
        stop_grace_s=cfg.stop_grace_s,
        drain_s=cfg.drain_timeout_s,
    )
    endpoints.book = adapters

    def catalog_changed() -> None:
        plan_again.poke()
        sizes.poke()
        endpoints_stale.poke()

    # Fleet metrics (issue 14) beside the router's, computed at each scrape; no `_created`.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    router.metrics_registry.register(
        FleetCollector(
            registry,
            reconciler=reconciler,
            catalog=lambda: catalog.catalog,
            scales=autoscaler.scales,
        )
    )
    router.metrics_registry.register(AdapterCollector(adapters.status))
    router.metrics_registry.register(
        LeaderCollector(leadership, lambda: registry.commands_refused_stale)
    )
    mirror_dir = cfg.mirror.dir
    sessions = Sessions(store)  # a login here holds on every control plane of the store
    admin = AdminApp(
        registry,
        admin_key,
        reconciler=reconciler,
        autoscaler=autoscaler,
        adapters=adapters,
        catalog=catalog,
        keys=router.keys,
        metrics=router.metrics_registry,
        router=router if cfg.router_listen is not None else None,
        store=store,
        bands={b.name: b.rank for b in router.config.bands},
        leadership=leadership,
        pages=lambda app: make_pages(
            api_client(app, admin_key), admin_key, mirror_dir=mirror_dir, sessions=sessions
        ),
    )
    return ControlPlane(
        registry=registry,
        reconciler=reconciler,
        autoscaler=autoscaler,
        adapters=adapters,
        leadership=leadership,
        sizes=sizes,
        publisher=publisher,
        published=published,
        router=router,
        hub=hub,
        workers=workers,
        admin=admin,
        events=events,
        sessions=sessions,
        catalog_changed=catalog_changed,
    )


def admin_http_config(listen: str) -> hypercorn.config.Config:
    """hypercorn's settings for the admin listener (pages, JSON API, /metrics)."""
    hc = hypercorn.config.Config()
    hc.bind = [listen]
    hc.accesslog = None
    hc.graceful_timeout = 1.0
    # keep_alive_timeout stays hypercorn's 5 s: a browser or ctl reconnects cheaply.
    return hc


async def _start_mirror(
    nursery: trio.Nursery, cfg: config.ServerConfig, root: Path, hashes: ManifestCache
) -> int:
    """The weights mirror on its own listener: bytes only, nothing administrative; its port."""
    host, port = config.split_host_port(cfg.mirror.listen)
    # The RPC listener's certificate and key, in a context of its own (the RPC one lives
    # in the capnp thread); it asks for a client certificate from the same CA, as the RPC
    # listener does: the agents hold one.
    ctx = server_tls_context(cfg.tls.ca, cfg.tls.cert, cfg.tls.key) if cfg.mirror.tls else None
    bound = await nursery.start(
        partial(serve_mirror, root, host, port, ssl_context=ctx, cache=hashes)
    )
    shown = f"[{host}]" if ":" in host else host
    log.info(
        "weights mirror on %s://%s:%d/ serving %s",
        "https" if ctx is not None else "http",
        shown,
        bound,
        root,
    )
    return int(bound)


def policy(cfg: config.ServerConfig) -> core.LivenessPolicy:
    return core.LivenessPolicy(
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        missed_heartbeats=cfg.missed_heartbeats,
        lost_after_s=cfg.lost_after_s,
    )
