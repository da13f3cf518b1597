"""The router's view of the fleet: the serving rank of every ready replica.

Recomputed when read after the registry or the catalog changed; the router
re-reads it only when `version` moves. Engines keep serving while their agent
restarts, so a replica on an unreachable node stays routable (the router's
breaker judges the engine itself); one on a lost node does not.

A replica on a draining node stays routable until its replacement is ready;
then the reconciler names it retiring (`retiring()`), it leaves this list, and
the router sends it nothing new while its last requests finish. Leaving it
out from the start of the drain would make a model whose only replica is
there unservable for as long as the replacement takes to load.

Every served name of a catalog model with `autoscale: {min: 0}` has a hold
(`holds()`, llmgw/router/_holds.py): at zero replicas, a request for it waits
for the first replica the autoscaler starts, within the model's `hold_max` and
`hold_s`, instead of a 503 at once. The holds travel with the list: published
for a standby's router, and in the view a router worker is sent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

import attrs
import trio

from llmgw import core, model
from llmgw.cp._fleet._catalog import Catalog
from llmgw.cp._fleet._handover import Handover
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.errors import LlmgwError
from llmgw.router import (
    AdapterRoute,
    Endpoint,
    EndpointSource,
    Hold,
    adapters_of,
    decode_adapters,
    decode_holds,
    decode_traffic,
    encode_adapters,
    encode_holds,
    encode_traffic,
    holds_of,
)

log = logging.getLogger("llmgw.cp.endpoints")


def endpoint_id(replica_id: str | None, node_id: str) -> str:
    """The router's id for a replica's serving rank (it keys in-flight counts on it)."""
    return f"{replica_id}@{node_id}"


def replica_of(endpoint: str) -> str:
    """The replica id in an `endpoint_id` (node ids hold no `@`)."""
    return endpoint.rpartition("@")[0]


class AdapterBook(Protocol):
    """What the adapter manager tells the view (llmgw/cp/_fleet/_adapters.py)."""

    def held(self, replica_id: str | None, shard: model.ShardReport) -> tuple[str, ...]: ...
    def out(self) -> Collection[str]: ...
    def loading(self, adapter: str) -> tuple[str, ...]: ...


class _NoAdapters:
    def held(self, replica_id: str | None, shard: model.ShardReport) -> tuple[str, ...]:
        return tuple(shard.adapters)

    def out(self) -> Collection[str]:
        return frozenset()

    def loading(self, adapter: str) -> tuple[str, ...]:
        return ()


# A request for an adapter no replica holds waits this long, and this many per adapter
# per router, for the control plane to load it (llmgw/router/_holds.py), then 503.
ADAPTER_HOLD_MAX = 1000
ADAPTER_WAIT_S = 120.0


class FleetEndpoints:
    def __init__(
        self,
        registry: NodeRegistry,
        catalog: Callable[[], Catalog],
        retiring: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self._registry = registry
        self._catalog = catalog
        self._retiring = retiring  # replica ids the router must send nothing new
        self.book: AdapterBook = _NoAdapters()  # the adapter manager, set by the assembly
        self._version = 0
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self._traffic: dict[str, core.TrafficSplit] = {}
        self._holds: dict[str, Hold] = {}
        self._adapters: dict[str, AdapterRoute] = {}
        self._stale = True

    def __repr__(self) -> str:
        sizes = {m: len(e) for m, e in self.snapshot().items()}
        return f"<FleetEndpoints v{self.version} {sizes}>"

    @property
    def version(self) -> int:
        if self._stale:
            self._recompute()
        return self._version

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        if self._stale:
            self._recompute()
        return self._snapshot

    def traffic(self) -> Mapping[str, core.TrafficSplit]:
        if self._stale:
            self._recompute()
        return self._traffic

    def holds(self) -> Mapping[str, Hold]:
        """A hold for every served name of a model the autoscaler may take to zero."""
        if self._stale:
            self._recompute()
        return self._holds

    def adapters(self) -> Mapping[str, AdapterRoute]:
        """Each catalog adapter's route (its base's first served name, scale, tenants)."""
        if self._stale:
            self._recompute()
        return self._adapters

    def refresh(self) -> None:
        """Something changed: recompute when the list is next read.

        Called on every registration and shard report; recomputing there walked
        the whole fleet per event, O(N^2) over a register storm of N agents.
        """
        self._stale = True

    def _recompute(self) -> None:
        self._stale = False
        catalog = self._catalog()
        served: dict[str, list[Endpoint]] = {name: [] for m in catalog.models for name in m.names}
        adapters = {a.name: a for a in catalog.adapters if catalog.model(a.base) is not None}
        served.update((name, []) for name in adapters)
        retiring = set(self._retiring()) | set(self.book.out())
        for rec in self._registry.records():
            if rec.liveness.state is core.NodeState.LOST:
                continue
            for s in rec.shards:
                m = catalog.model(s.model_name) if s.model_name else None
                if m is None or s.rank != 0 or s.state != model.ShardState.READY or s.port is None:
                    continue
                if s.replica_id is not None and s.replica_id in retiring:
                    continue
                held = self.book.held(s.replica_id, s)
                names = [*m.names]
                names += [a for a in held if a in adapters and adapters[a].base == m.name]
                for name in names:
                    served[name].append(
                        Endpoint(
                            endpoint_id=endpoint_id(s.replica_id, rec.node_id),
                            model=name,
                            engine=s.engine,
                            host=rec.host,
                            port=s.port,
                            adapters=held,
                        )
                    )
        snapshot = {
            name: tuple(sorted(eps, key=lambda e: e.endpoint_id)) for name, eps in served.items()
        }
        traffic = {t.name: _served_now(t, catalog) for t in catalog.traffic}
        holds = _holds(catalog)
        holds.update((name, Hold(ADAPTER_HOLD_MAX, ADAPTER_WAIT_S)) for name in adapters)
        routes = {
            a.name: AdapterRoute(
                base=catalog.model(a.base).names[0],  # type: ignore[union-attr]  # kept above
                scale=a.scale,
                tenants=None if a.tenants is None else tuple(a.tenants),
                loading=self.book.loading(a.name),
            )
            for a in adapters.values()
        }
        if (snapshot, traffic, holds, routes) != (
            self._snapshot,
            self._traffic,
            self._holds,
            self._adapters,
        ):
            self._snapshot = snapshot
            self._traffic = traffic
            self._holds = holds
            self._adapters = routes
            self._version += 1


def _holds(catalog: Catalog) -> dict[str, Hold]:
    out: dict[str, Hold] = {}
    for m in catalog.models:
        if m.autoscale is not None and m.autoscale.min == 0:
            policy = m.autoscale.policy()
            try:
                hold = Hold(policy.hold_max, policy.hold_s)
            except ValueError as exc:  # the catalog refuses these; never the whole list
                log.warning("model %s: no hold at zero replicas: %s", m.name, exc)
                continue
            out.update((name, hold) for name in m.names)
    return out


def _served_now(split: core.TrafficSplit, catalog: Catalog) -> core.TrafficSplit:
    """The split with each version under the served name its model runs now (an undone
    model runs its pinned entry, whose served names may differ from server.yaml's)."""
    versions = []
    for v in split.versions:
        m = catalog.model(v.model)
        versions.append(attrs.evolve(v, served=m.names[0]) if m is not None else v)
    return attrs.evolve(split, versions=tuple(versions))


# --- the standby's view: the leader's list, through the store --------------------------
#
# The leader publishes its list (`EndpointPublisher`) when it changes, at most every
# `PUBLISH_EVERY_S`; a standby's router reads it back every `READ_EVERY_S`
# (`PublishedEndpoints`). `RoleEndpoints` is what the router in either role is given:
# the fleet's own list while this control plane leads, the published one otherwise.

PUBLISH_EVERY_S = 0.5  # at most twice a second
READ_EVERY_S = 1.0
PUBLISHED_MAX_BYTES = 16 << 20  # a list larger than this is nobody's fleet


def encode_endpoints(
    snapshot: Mapping[str, tuple[Endpoint, ...]],
    traffic: Mapping[str, core.TrafficSplit] | None = None,
    holds: Mapping[str, Hold] | None = None,
    adapters: Mapping[str, AdapterRoute] | None = None,
) -> str:
    """The list as published: {"models": {name: [endpoint, ...]}, "traffic": {...},
    "holds": {...}, "adapters": {...}} (sorted, stable; the splits, holds and adapters
    in `llmgw.router`'s `encode_traffic`, `encode_holds` and `encode_adapters` forms)."""
    return json.dumps(
        {
            "models": {
                name: [
                    {
                        "endpoint_id": e.endpoint_id,
                        "engine": e.engine,
                        "host": e.host,
                        "port": e.port,
                        "slots": e.slots,
                        "adapters": list(e.adapters),
                    }
                    for e in eps
                ]
                for name, eps in sorted(snapshot.items())
            },
            "traffic": encode_traffic(traffic or {}),
            "holds": encode_holds(holds or {}),
            "adapters": encode_adapters(adapters or {}),
        },
        sort_keys=True,
    )


def decode_published(
    text: str,
) -> tuple[dict[str, tuple[Endpoint, ...]], dict[str, core.TrafficSplit], dict[str, Hold]]:
    """The published list, splits and holds back (a leader from before the splits or
    the holds published none); raises ValueError naming what is wrong."""
    models = decode_endpoints(text)
    data = json.loads(text)
    return models, decode_traffic(data.get("traffic")), decode_holds(data.get("holds"))


def decode_published_adapters(text: str) -> dict[str, AdapterRoute]:
    """The published adapters back (a leader from before adapters published none)."""
    data = json.loads(text)
    return decode_adapters(data.get("adapters") if isinstance(data, dict) else None)


def decode_endpoints(text: str) -> dict[str, tuple[Endpoint, ...]]:
    """The published list back; raises ValueError naming what is wrong. The store is
    shared with other machines: nothing in it is trusted to be well formed."""
    if len(text) > PUBLISHED_MAX_BYTES:
        raise ValueError(f"the published endpoint list is {len(text)} bytes, over the limit")
    data = json.loads(text)
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise ValueError('expected {"models": {name: [endpoints]}}')
    out: dict[str, tuple[Endpoint, ...]] = {}
    for name, eps in models.items():
        if not isinstance(name, str) or not isinstance(eps, list):
            raise ValueError(f"model {str(name)[:60]!r}: expected a list of endpoints")
        parsed = []
        for e in eps:
            if not isinstance(e, dict):
                raise ValueError(f"model {name!r}: an endpoint is not an object")
            eid, engine, host, port = (
                e.get("endpoint_id"),
                e.get("engine"),
                e.get("host"),
                e.get("port"),
            )
            slots = e.get("slots")
            if not (isinstance(eid, str) and isinstance(engine, str) and isinstance(host, str)):
                raise ValueError(f"model {name!r}: endpoint_id, engine and host must be strings")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"model {name!r}: endpoint {eid!r}: port {port!r} is not a port")
            if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int)):
                raise ValueError(f"model {name!r}: endpoint {eid!r}: slots {slots!r}")
            held = e.get("adapters") or []
            if not isinstance(held, list) or not all(isinstance(a, str) for a in held):
                raise ValueError(f"model {name!r}: endpoint {eid!r}: adapters {held!r:.80}")
            parsed.append(Endpoint(eid, name, engine, host, port, slots, tuple(held)))
        out[name] = tuple(parsed)
    return out


class EndpointStore(Protocol):
    async def publish_endpoints(self, epoch: int, body_json: str) -> bool: ...
    async def published_endpoints(self) -> tuple[int, str, float] | None: ...


class EndpointPublisher:
    """The leader's side: publish the fleet's list when it (or the epoch) changed."""

    def __init__(
        self,
        store: EndpointStore,
        source: EndpointSource,
        acting: Callable[[], bool],
        epoch: Callable[[], int],
        *,
        every_s: float = PUBLISH_EVERY_S,
    ) -> None:
        self._store = store
        self._source = source
        self._acting = acting
        self._epoch = epoch
        self.every_s = every_s
        self._published: tuple[int, int] | None = None  # (epoch, version) last written
        self.published = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.every_s)
            if not self._acting():
                self._published = None  # a new term publishes anew
                continue
            mark = (self._epoch(), self._source.version)
            if mark == self._published:
                continue
            try:
                src = self._source
                ok = await self._store.publish_endpoints(
                    mark[0],
                    encode_endpoints(
                        src.snapshot(), src.traffic(), holds_of(src), adapters_of(src)
                    ),
                )
            except LlmgwError as exc:
                log.warning("publishing the endpoint list failed (retried): %s", exc)
                continue
            if ok:
                self._published = mark
                self.published += 1
            else:
                log.warning(
                    "publishing the endpoint list at epoch %d refused: not the lease's epoch",
                    mark[0],
                )


class PublishedEndpoints:
    """The standby's side: the list the leader last published, read every second."""

    def __init__(self, store: EndpointStore, *, every_s: float = READ_EVERY_S) -> None:
        self._store = store
        self.every_s = every_s
        self._version = 0
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self._traffic: dict[str, core.TrafficSplit] = {}
        self._holds: dict[str, Hold] = {}
        self._adapters: dict[str, AdapterRoute] = {}
        self._seen: tuple[int, str] | None = None
        self.reading = True  # False while this control plane leads: nothing to read

    @property
    def version(self) -> int:
        return self._version

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        return self._snapshot

    def traffic(self) -> Mapping[str, core.TrafficSplit]:
        return self._traffic

    def holds(self) -> Mapping[str, Hold]:
        return self._holds

    def adapters(self) -> Mapping[str, AdapterRoute]:
        return self._adapters

    def adopt(
        self,
        snapshot: Mapping[str, tuple[Endpoint, ...]],
        traffic: Mapping[str, core.TrafficSplit] | None = None,
        holds: Mapping[str, Hold] | None = None,
    ) -> None:
        """Start from this list (what this control plane routed to as the leader) until
        the store answers with the leader's: a leader deposed because the store is
        down keeps routing to the engines it knew, instead of to nothing."""
        self._set(dict(snapshot), dict(traffic or {}), dict(holds or {}))
        self._seen = None  # the next read replaces it, whatever it holds

    async def read_once(self) -> None:
        got = await self._store.published_endpoints()
        if got is None:
            return
        epoch, body, _at = got
        if (epoch, body) == self._seen:
            return
        self._seen = (epoch, body)
        adapters = decode_published_adapters(body)
        if adapters != self._adapters:
            self._adapters = adapters
            self._version += 1
        self._set(*decode_published(body))

    def _set(
        self,
        snapshot: dict[str, tuple[Endpoint, ...]],
        traffic: dict[str, core.TrafficSplit],
        holds: dict[str, Hold],
    ) -> None:
        if (snapshot, traffic, holds) != (self._snapshot, self._traffic, self._holds):
            self._snapshot, self._traffic, self._holds = snapshot, traffic, holds
            self._version += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if self.reading:
                try:
                    await self.read_once()
                except (LlmgwError, ValueError) as exc:
                    log.warning(
                        "reading the leader's endpoint list failed (kept the last): %s", exc
                    )
            await trio.sleep(self.every_s)


def _now() -> float:
    """trio's clock; outside a trio run (a synchronous caller, a test), the monotonic one."""
    try:
        return trio.current_time()
    except RuntimeError:
        return time.monotonic()


class RoleEndpoints:
    """The router's source in either role: the fleet's own list while leading, the
    leader's published list otherwise. `version` moves whenever the chosen list or the
    choice does, so the router re-reads on a failover.

    On an election the published list is not dropped at once: the own view is empty
    until the agents re-register, so the list is handed over endpoint by endpoint
    (llmgw/cp/_fleet/_handover.py) and the router never passes through an empty view.
    `registered` names the nodes registered with this leader, `unhealthy` the endpoints
    whose engine the router's readings found silent; `handover_s` bounds the handover."""

    def __init__(
        self,
        fleet: EndpointSource,
        published: PublishedEndpoints,
        leading: Callable[[], bool],
        *,
        registered: Callable[[], Collection[str]] = frozenset,
        unhealthy: Callable[[], Collection[str]] = frozenset,
        handover_s: float = 60.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._fleet = fleet
        self._published = published
        self._leading = leading
        self._registered = registered
        self._unhealthy = unhealthy
        self.handover_s = handover_s
        self._clock = clock or _now
        self._mark: tuple[bool, int, int, int] | None = None
        self._version = 0
        self._was_leading: bool | None = None
        self.handover: Handover | None = None  # while the new term's view fills
        self.handovers = 0
        # The fleet's list as last read while leading: the published list starts from it
        # on a deposition (PublishedEndpoints.adopt).
        self._last_fleet: Mapping[str, tuple[Endpoint, ...]] | None = None
        self._last_traffic: Mapping[str, core.TrafficSplit] | None = None
        self._last_holds: Mapping[str, Hold] | None = None

    def _current(self) -> EndpointSource:
        leading = self._leading()
        if leading and self._was_leading is False and any(self._published.snapshot().values()):
            self.handover = Handover(
                self._fleet,
                self._published.snapshot(),
                registered=self._registered,
                unhealthy=self._unhealthy,
                started_at=self._clock(),
                limit_s=self.handover_s,
            )
            self.handovers += 1
        self._was_leading = leading
        if not leading:
            self.handover = None
        elif self.handover is not None:
            self.handover.update(self._clock())
            if self.handover.over:
                self.handover = None
        src: EndpointSource = (self.handover or self._fleet) if leading else self._published
        if leading:
            self._last_fleet = src.snapshot()
            self._last_traffic = src.traffic()
            self._last_holds = holds_of(self._fleet)
        elif self._last_fleet is not None:
            self._published.adopt(self._last_fleet, self._last_traffic, self._last_holds)
            self._last_fleet = self._last_traffic = self._last_holds = None
        self._published.reading = not leading
        # While leading, the holds are the fleet's own (its catalog), handover or not.
        mark = (
            leading,
            self.handovers if self.handover is not None else 0,
            src.version,
            self._fleet.version if leading else 0,
        )
        if mark != self._mark:
            self._mark = mark
            self._version += 1
        return src

    @property
    def version(self) -> int:
        self._current()
        return self._version

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        return self._current().snapshot()

    def traffic(self) -> Mapping[str, core.TrafficSplit]:
        return self._current().traffic()

    def holds(self) -> Mapping[str, Hold]:
        """The fleet's (its catalog's) while leading, the published ones otherwise."""
        src = self._current()
        return holds_of(self._fleet if src is not self._published else src)

    def adapters(self) -> Mapping[str, AdapterRoute]:
        """The fleet's (its catalog's) while leading, the published ones otherwise."""
        src = self._current()
        return adapters_of(self._fleet if src is not self._published else src)
