"""The leader's LoRA adapter manager: which replica of a base model holds which adapter.

What a replica holds
    A llama-server replica holds the adapters its engine was launched with (the shard
    spec's `adapters`, echoed in every report: the fleet says, also after a control
    plane restart). A vLLM or SGLang replica holds what this manager loaded through the
    engine's runtime API (`engines.adapter_api`), and on first sight (a new leader,
    a replica it did not load) what the engine's own listing says
    (`engines.listed_adapters` of its `/v1/models`).

When an adapter is loaded
    Every `tick_s` the leader reads the adapters' demand (`demand(names)`: the routers'
    `RouterLoad` for the adapter's name, queued and in flight, summed over every router
    of every control plane). A request for an adapter no replica holds waits in its
    router (the adapter's hold, llmgw/router/_holds.py), and that is the demand: the
    pure plan (llmgw/core/_adapters.py `plan_adapter`) picks the replica that loads it
    (under the load bound, a free slot before an eviction, then the replica whose
    adapters draw the least, then the least loaded; the least recently used adapter
    with no request in flight as the victim) or joins a load in flight. What an
    adapter draws is its requests, in flight and waiting, averaged over about
    `DRAW_S` (split evenly over the replicas that hold it): so the popular adapters
    spread over the replicas instead of piling onto the one that loaded first. One
    load at a time per replica, and of an adapter per base: twenty waiting requests
    cause one load. The routers' in-flight count of an adapter is over all
    its replicas, so an adapter with a request in flight anywhere is evicted nowhere.

How a load is done
    vLLM/SGLang: the victim leaves the router's view first (nothing new is sent to it),
    then the engine unloads it; the agent fetches the adapter next to the weights
    (`fetchAdapter`: single flight, whole or nothing) and the engine loads it.
    llama-server cannot load an adapter at run time: the replica leaves the router's
    view, its requests in flight end (up to `drain_s`; a replica still busy then is not
    relaunched and the load fails, so no request is cut), and the agent relaunches its
    engine with the new list (`relaunchShard`, same port and cards); it is back in the
    view when it reports ready. The base is served by its other replicas meanwhile.

Nothing here is stored: the counts (`loads`, `evictions`, `failures`) are this leader's
since it was elected, and what replicas hold is re-read from the fleet.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs
import httpx
import trio

from llmgw import core, engines, model
from llmgw.cp._fleet._catalog import Catalog, CatalogModel, Profile
from llmgw.cp._fleet._endpoints import endpoint_id
from llmgw.cp._fleet._launch import relaunch_spec
from llmgw.cp._fleet._node_record import NodeRecord
from llmgw.errors import LlmgwError

log = logging.getLogger("llmgw.cp.adapters")

DRAW_S = 30.0  # the time constant of an adapter's average draw
LEARN_EVERY_S = 5.0  # an engine whose listing said nothing is asked again after this
ADAPTER_LOADED = "adapter_loaded"  # the event kinds
ADAPTER_EVICTED = "adapter_evicted"
ADAPTER_LOAD_FAILED = "adapter_load_failed"


class Registry(Protocol):
    @property
    def epoch(self) -> int: ...
    def records(self) -> list[NodeRecord]: ...
    def record(self, node_id: str) -> NodeRecord | None: ...
    def agent(self, node_id: str) -> Any: ...
    def note_shard(self, node_id: str, shard: model.ShardReport) -> None: ...


class EventSink(Protocol):
    def record(self, kind: str, message: str, *, model_name: str | None = None) -> object: ...


@attrs.frozen
class Replica:
    """A ready replica of a base model that takes adapters, as the manager sees it."""

    replica_id: str
    node_id: str
    model_name: str
    engine: str
    endpoint_id: str
    max_adapters: int
    shard: model.ShardReport


@attrs.define
class AdapterCounts:
    """One adapter's history under this leader (for `ctl adapters` and the metrics)."""

    loads: int = 0
    evictions: int = 0
    failures: int = 0
    last_error: str | None = None
    last_used: float | None = None  # wall clock; None: not used since this leader began


@attrs.frozen
class AdapterStatus:
    """What `ctl adapters` shows of one catalog adapter."""

    name: str
    base: str
    source: str
    held_by: tuple[tuple[str, str], ...]  # (replica id, node id)
    loading_on: tuple[str, ...]
    queued: int | None  # requests waiting in the routers; None: no reading
    in_flight: int | None
    counts: AdapterCounts
    draw: float | None = None  # queued + in flight, averaged (DRAW_S); None: not read yet


class AdapterManager:
    def __init__(
        self,
        catalog: Callable[[], Catalog],
        registry: Registry,
        *,
        acting: Callable[[], bool],
        demand: Callable[[Iterable[str]], Mapping[str, core.RouterLoad]],
        in_flight: Callable[[str], int | None],
        refresh: Callable[[], None],
        events: EventSink,
        tick_s: float = 0.25,
        drain_s: float = 60.0,
        stop_grace_s: float = 30.0,
        http_timeout_s: float = 120.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._catalog = catalog
        self._registry = registry
        self._acting = acting
        self._demand = demand
        self._in_flight = in_flight  # endpoint id -> requests in flight (None: unknown)
        self._refresh = refresh  # the router's view must be recomputed
        self._events = events
        self.tick_s = tick_s
        self.drain_s = drain_s
        self.stop_grace_s = stop_grace_s
        self._http_timeout_s = http_timeout_s
        self._wall = wall
        self._runtime: dict[str, tuple[str, ...]] = {}  # replica id -> held (vLLM/SGLang)
        self._loading: dict[str, str] = {}  # replica id -> the adapter it loads now
        self._jobs: dict[str, Replica] = {}  # replica id -> the replica as its load began
        self._asked: dict[str, float] = {}  # replica id -> when its engine's listing was read
        self._out: set[str] = set()  # replica ids out of the router's view (relaunching)
        self._hidden: dict[str, set[str]] = {}  # replica id -> adapters being evicted
        # adapter -> wall clock of its last request (the routers'), or of its last load
        self._last_used: dict[str, float] = {}
        # adapter -> its requests (in flight and waiting) averaged over about DRAW_S
        self._draw: dict[str, float] = {}
        self._drawn_at: float | None = None
        self.counts: dict[str, AdapterCounts] = {}
        self._nursery: trio.Nursery | None = None

    def __repr__(self) -> str:
        return f"<AdapterManager loading={self._loading} out={sorted(self._out)}>"

    # --- what the router's view reads ----------------------------------------------------

    def held(self, replica_id: str | None, shard: model.ShardReport) -> tuple[str, ...]:
        """What the replica holds, as the router may send it requests for (an adapter
        being evicted is not)."""
        if replica_id is None:
            return ()
        if shard.engine == "llama-server":  # out of the view whole while it changes
            return tuple(shard.adapters)
        return self._remaining(replica_id, shard)

    def _remaining(self, replica_id: str, shard: model.ShardReport) -> tuple[str, ...]:
        """What the replica holds less what is being evicted from it."""
        held = shard.adapters if shard.engine == "llama-server" else self._runtime.get(replica_id)
        hidden = self._hidden.get(replica_id, set())
        return tuple(a for a in held or () if a not in hidden)

    def out(self) -> frozenset[str]:
        """Replicas the router must send nothing new (a llama-server being relaunched)."""
        return frozenset(self._out)

    def loading(self, adapter: str) -> tuple[str, ...]:
        return tuple(sorted(r for r, a in self._loading.items() if a == adapter))

    # --- what ctl and the metrics read ---------------------------------------------------

    def status(self) -> list[AdapterStatus]:
        catalog = self._catalog()
        replicas = {r.replica_id: r for m in catalog.models for r in self._replicas(catalog, m)}
        out = []
        demand = self._demand(a.name for a in catalog.adapters)
        for a in catalog.adapters:
            held = tuple(
                (r.replica_id, r.node_id)
                for r in replicas.values()
                if r.model_name == a.base and a.name in self.held(r.replica_id, r.shard)
            )
            d = demand.get(a.name)
            out.append(
                AdapterStatus(
                    a.name,
                    a.base,
                    a.source,
                    held,
                    self.loading(a.name),
                    None if d is None else d.queued,
                    None if d is None else d.in_flight,
                    self.counts.get(a.name) or AdapterCounts(),
                    self._draw.get(a.name),
                )
            )
        return out

    # --- the loop --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                if self._acting() and self._catalog().adapters:
                    try:
                        await self._learn()
                        self.step(self._wall())
                    except Exception:  # one bad pass must not end the manager
                        log.exception("adapter manager pass failed")
                await trio.sleep(self.tick_s)

    def _replicas(self, catalog: Catalog, m: CatalogModel) -> list[Replica]:
        out = []
        for rec in self._registry.records():
            if rec.liveness.state is core.NodeState.LOST:
                continue
            for s in rec.shards:
                if s.model_name != m.name or s.rank != 0 or s.replica_id is None:
                    continue
                if s.state != model.ShardState.READY or s.port is None:
                    continue
                profile = _profile(catalog, m, s.profile_fingerprint)
                if profile is None or not profile.max_adapters:
                    continue
                eid = endpoint_id(s.replica_id, rec.node_id)
                replica = Replica(
                    s.replica_id, rec.node_id, m.name, s.engine, eid, profile.max_adapters, s
                )
                out.append(replica)
        return out

    async def _learn(self) -> None:
        """A vLLM/SGLang replica not seen before: what its engine lists."""
        catalog = self._catalog()
        bases = {a.base for a in catalog.adapters}
        for m in catalog.models:
            if m.name not in bases:
                continue
            for r in self._replicas(catalog, m):
                if r.engine == "llama-server" or r.replica_id in self._runtime:
                    continue
                if r.replica_id in self._loading:
                    continue
                now = self._wall()
                if now - self._asked.get(r.replica_id, -math.inf) < LEARN_EVERY_S:
                    continue
                self._asked[r.replica_id] = now
                rec = self._registry.record(r.node_id)
                if rec is None or r.shard.port is None:
                    continue
                listed = await self._listed(rec.host, r.shard.port, r.engine)
                if listed is not None:
                    self._runtime[r.replica_id] = listed
                    self._refresh()

    async def _listed(self, host: str, port: int, engine: str) -> tuple[str, ...] | None:
        url = f"http://{_host(host)}:{port}/v1/models"
        try:
            with trio.fail_after(5):
                async with httpx.AsyncClient(timeout=5) as client:
                    resp = await client.get(url)
            if resp.status_code != 200:
                return None
            return engines.listed_adapters(engine, resp.json())
        except (httpx.HTTPError, ValueError, trio.TooSlowError) as exc:
            log.debug("reading %s: %s", url, exc)
            return None

    def step(self, now: float) -> None:
        """Plan a load for every adapter with requests waiting and none loading. `now`:
        the wall clock (the routers' last uses are wall clock)."""
        catalog = self._catalog()
        adapters = catalog.adapters
        demand = self._demand(a.name for a in adapters)
        self._average(demand, now)
        for name, d in demand.items():
            used = d.last_used
            if d.queued or d.in_flight:
                used = max(used or now, now)
            if used is not None and used > self._last_used.get(name, -math.inf):
                self._last_used[name] = used
                self.counts.setdefault(name, AdapterCounts()).last_used = used
        for a in adapters:
            if a.name not in demand or not demand[a.name].queued:
                continue
            m = catalog.model(a.base)
            if m is None:
                continue
            # A replica loading something counts with its slots as they will be (a
            # llama-server being relaunched is not ready meanwhile): a plan that picks
            # it waits for that load, rather than evicting elsewhere.
            replicas = {r.replica_id: r for r in self._replicas(catalog, m)}
            replicas |= {rid: r for rid, r in self._jobs.items() if r.model_name == m.name}
            copies = Counter(
                name for r in replicas.values() for name in self._remaining(r.replica_id, r.shard)
            )
            views = [self._view(r, demand, copies, now) for r in replicas.values()]
            plan = core.plan_adapter(a.name, views, now, base=m.name)
            if plan.action != "load" or plan.replica_id is None:
                continue
            if plan.replica_id in self._loading:
                continue
            r = replicas[plan.replica_id]
            if plan.holders and engines.adapter_api(r.engine) is None:
                continue  # a second copy would cost a relaunch: the holders serve it
            log.info("adapter %s: %s", a.name, plan.reason)
            self._loading[r.replica_id] = a.name
            self._jobs[r.replica_id] = r
            if plan.evict is not None:
                self._hidden.setdefault(r.replica_id, set()).add(plan.evict)
            if r.engine == "llama-server":
                self._out.add(r.replica_id)
            self._refresh()
            assert self._nursery is not None
            self._nursery.start_soon(self._load, r, a.name, a.source, plan.evict)

    def _average(self, demand: Mapping[str, core.RouterLoad], now: float) -> None:
        """Move each adapter's average draw toward its requests now (in flight and
        waiting; an adapter no router reports draws 0). The first reading is taken
        whole, so a cold start has figures at once."""
        dt = 0.0 if self._drawn_at is None else max(0.0, now - self._drawn_at)
        self._drawn_at = now
        weight = 1.0 - math.exp(-dt / DRAW_S)
        for a in self._catalog().adapters:
            d = demand.get(a.name)
            sample = 0.0 if d is None else float(d.in_flight + d.queued)
            before = self._draw.get(a.name)
            self._draw[a.name] = sample if before is None else before + weight * (sample - before)

    def draw(self, adapter: str) -> float | None:
        """The adapter's average requests, in flight and waiting; None: not read yet."""
        return self._draw.get(adapter)

    def _view(
        self,
        r: Replica,
        demand: Mapping[str, core.RouterLoad],
        copies: Mapping[str, int],
        now: float,
    ) -> core.ReplicaAdapters:
        held = self._remaining(r.replica_id, r.shard)
        loading = self._loading.get(r.replica_id)
        draws = [self._draw.get(n, 0.0) / max(1, copies.get(n, 1)) for n in held if n != loading]
        if loading is not None:
            draws.append(self._draw.get(loading, 0.0))
        views = []
        for name in held:
            d = demand.get(name)
            views.append(
                core.HeldAdapter(
                    name,
                    self._last_used.get(name, now - 1e6),
                    0 if d is None else d.in_flight,
                )
            )
        return core.ReplicaAdapters(
            r.replica_id,
            r.max_adapters,
            [h for h in views if h.name != loading],
            () if loading is None or loading in held else (loading,),
            float(self._in_flight(r.endpoint_id) or 0),
            sum(draws),
        )

    async def _load(self, r: Replica, adapter: str, source: str, evict: str | None) -> None:
        counts = self.counts.setdefault(adapter, AdapterCounts())
        try:
            if r.engine == "llama-server":
                await self._relaunch(r, adapter, source, evict)
            else:
                await self._runtime_load(r, adapter, source, evict)
        except (LlmgwError, httpx.HTTPError, trio.TooSlowError, ValueError) as exc:
            counts.failures += 1
            counts.last_error = f"on {r.replica_id}: {exc}"
            message = f"{adapter}: loading it on {r.replica_id} failed: {exc}"
            log.warning("adapter %s", message)
            self._events.record(ADAPTER_LOAD_FAILED, message, model_name=r.model_name)
        else:
            counts.loads += 1
            self._last_used[adapter] = max(self._last_used.get(adapter, 0.0), self._wall())
            if evict is not None:
                self.counts.setdefault(evict, AdapterCounts()).evictions += 1
                message = f"{evict}: evicted from {r.replica_id} for {adapter}"
                self._events.record(ADAPTER_EVICTED, message, model_name=r.model_name)
            message = f"{adapter}: loaded on {r.replica_id} (node {r.node_id})"
            log.info("adapter %s", message)
            self._events.record(ADAPTER_LOADED, message, model_name=r.model_name)
        finally:
            self._loading.pop(r.replica_id, None)
            self._jobs.pop(r.replica_id, None)
            self._out.discard(r.replica_id)
            self._hidden.pop(r.replica_id, None)
            self._refresh()

    async def _runtime_load(self, r: Replica, adapter: str, source: str, evict: str | None) -> None:
        api = engines.adapter_api(r.engine)
        agent = self._registry.agent(r.node_id)
        rec = self._registry.record(r.node_id)
        if api is None or agent is None or rec is None or r.shard.port is None:
            raise LlmgwError(f"node {r.node_id} is not connected")
        base = f"http://{_host(rec.host)}:{r.shard.port}"
        held = list(self._runtime.get(r.replica_id, ()))
        async with httpx.AsyncClient(base_url=base, timeout=self._http_timeout_s) as client:
            if evict is not None:
                await self._settle(r, evict)
                await _call(client, api.unload(evict))
                held = [a for a in held if a != evict]
                self._runtime[r.replica_id] = tuple(held)
            path = await agent.fetch_adapter(self._registry.epoch, source, r.engine)
            await _call(client, api.load(adapter, path))
        self._runtime[r.replica_id] = (*held, adapter)

    async def _settle(self, r: Replica, evict: str) -> None:
        """The routers have the view without `evict` on `r` and nothing of it is in
        flight (bounded by `drain_s`; past it the eviction goes on: the plan saw none in
        flight, and an engine answers a request for an unloaded adapter with an error
        the router retries elsewhere)."""
        with trio.move_on_after(self.drain_s):
            while True:
                d = self._demand((evict,)).get(evict)
                if self._in_flight(r.endpoint_id) is not None and (d is None or not d.in_flight):
                    return
                await trio.sleep(0.05)

    async def _relaunch(self, r: Replica, adapter: str, source: str, evict: str | None) -> None:
        catalog = self._catalog()
        m = catalog.model(r.model_name)
        profile = None if m is None else _profile(catalog, m, r.shard.profile_fingerprint)
        rec = self._registry.record(r.node_id)
        agent = self._registry.agent(r.node_id)
        if m is None or profile is None or rec is None or agent is None:
            raise LlmgwError(f"replica {r.replica_id} is gone or changed")
        held = [a for a in r.shard.adapters if a != evict] + [adapter]
        sources = {a.name: a.source for a in catalog.adapters}
        missing = [a for a in held if a not in sources]
        if missing:
            raise LlmgwError(f"{', '.join(missing)} left the catalog")
        spec = relaunch_spec(
            catalog, m, profile, r.shard, rec, tuple((a, sources[a]) for a in held)
        )
        # Out of the router's view (set by `step`): wait for its requests to end.
        drained = False
        with trio.move_on_after(self.drain_s):
            while not drained:
                drained = self._in_flight(r.endpoint_id) == 0
                if not drained:
                    await trio.sleep(0.05)
        if not drained:
            raise LlmgwError(
                f"{r.replica_id} still had requests in flight after {self.drain_s:g} s; "
                "not relaunched (nothing is cut)"
            )
        report = await agent.relaunch_shard(self._registry.epoch, spec, self.stop_grace_s)
        self._registry.note_shard(r.node_id, report)
        with trio.fail_after(profile.startup_timeout_s):
            while True:
                now = self._registry.record(r.node_id)
                shard = next(
                    (s for s in (now.shards if now else ()) if s.shard_id == spec.shard_id), None
                )
                if shard is None:
                    raise LlmgwError(f"{spec.shard_id} is gone from {r.node_id}")
                if shard.state == model.ShardState.FAILED:
                    raise LlmgwError(f"{spec.shard_id} failed after its relaunch: {shard.reason}")
                if shard.state == model.ShardState.READY and shard.adapters == tuple(held):
                    return
                await trio.sleep(0.05)


def _profile(catalog: Catalog, m: CatalogModel, fingerprint: str | None) -> Profile | None:
    """The profile a shard was started from (None: not the catalog's now)."""
    return next((p for p in m.profiles if catalog.fingerprint(m, p) == fingerprint), None)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _call(client: httpx.AsyncClient, call: engines.HttpCall) -> None:
    resp = await client.request(call.method, call.path, json=call.json)
    if resp.status_code >= 300:
        raise LlmgwError(
            f"{call.method} {call.path} answered {resp.status_code}: {resp.text[:300]}"
        )
