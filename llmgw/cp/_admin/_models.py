"""Models in the admin API: the catalog, its replicas and their state, a model's status
with where its weights are held, and the two explanations: where the placer would put a
model now, and where the router would send a request."""

from __future__ import annotations

import time
from typing import Any, Protocol

import trio

from llmgw import config, core
from llmgw.cp._admin._autoscale import scale_json
from llmgw.cp._admin._common import NODES_PER_SLICE
from llmgw.cp._admin._http import HttpError, Route, expect, route
from llmgw.cp._fleet._autoscaler import Autoscaler
from llmgw.cp._fleet._catalog import Catalog
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._placing import Unplaced
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.cp._fleet._registry import FetchProgress, NodeRegistry
from llmgw.cp._observe._events import Failure
from llmgw.cp._weights import _holdings
from llmgw.router import HttpError as RouterHttpError


class Explainer(Protocol):
    """The router, as `POST /api/v1/route` needs it (llmgw/router `Router.explain`)."""

    def explain(self, model: str, path: str, request: dict[str, Any]) -> dict[str, Any]: ...


class Models:
    """`/api/v1/models`, `replicas`, `status`, `place` and `route`. Without a catalog
    (reconciler and catalog file) or a router, the routes that need one answer 404."""

    def __init__(
        self,
        registry: NodeRegistry,
        reconciler: Reconciler | None,
        catalog: CatalogFile | None,
        router: Explainer | None,
        autoscaler: Autoscaler | None = None,
    ) -> None:
        self._registry = registry
        self._autoscaler = autoscaler
        self._reconciler = reconciler
        self._catalog = catalog
        self._router = router
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/models", self.models),
            route("GET", "/api/v1/replicas", self.replicas),
            route("GET", "/api/v1/status", self.status),
            route("POST", "/api/v1/place", self.place),
            route("POST", "/api/v1/route", self.explain_route),
        )

    def _need_catalog(self) -> tuple[Reconciler, CatalogFile]:
        if self._reconciler is None or self._catalog is None:
            raise HttpError(404, "this control plane runs no catalog")
        return self._reconciler, self._catalog

    async def models(self, **_: Any) -> tuple[int, Any]:
        _rec, catalog = self._need_catalog()
        return 200, {"models": [config.unstructure(m) for m in catalog.catalog.models]}

    def replica_rows(self) -> list[dict[str, Any]]:
        reconciler, _cat = self._need_catalog()
        now = trio.current_time()
        wall = time.time()
        rows: list[dict[str, Any]] = []
        events = self._registry.events
        views = reconciler.replicas()
        present = [v.replica_id for v in views]
        sources: dict[str, str] | None = None
        for v in views:
            since = wall - (now - v.first_seen)
            # Its own last failure, else why its predecessor went: the reason
            # outlives the replica it was about.
            failure = events.last_failure(v.replica_id) or events.predecessor_failure(
                v.model_name, started=v.first_seen, present=present
            )
            rows.append(
                {
                    "model": v.model_name,
                    "replica": v.replica_id,
                    "state": v.state,
                    "nodes": list(v.nodes),
                    "since": since,
                    "stale": v.stale,
                    "reason": v.reason,
                    "last_failure": _failure_json(failure),
                }
            )
            if v.state == "starting":
                if sources is None:
                    sources = {m.name: m.source for m in _cat.catalog.models}
                rows[-1]["progress"] = self._fetching(v.nodes, sources.get(v.model_name))
        for u in reconciler.unplaced():
            failure = events.predecessor_failure(u.model_name, started=None, present=present)
            rows.append(
                {
                    "model": u.model_name,
                    "replica": None,
                    "state": "unplaced",
                    "nodes": [],
                    "since": None,
                    "stale": False,
                    "reason": "\n".join(u.reasons),
                    "last_failure": _failure_json(failure),
                }
            )
        for name, b in sorted(reconciler.backoffs().items()):
            failure = events.predecessor_failure(name, started=None, present=present)
            rows.append(
                {
                    "model": name,
                    "replica": None,
                    "state": "backoff",
                    "nodes": [],
                    "since": wall - (now - b.last_at),  # its last failure
                    "stale": False,
                    "reason": b.describe(now, reconciler.backoff.policy),
                    "failures": b.failures,
                    "next_try_in_s": max(0.0, b.next_try_at(reconciler.backoff.policy) - now),
                    "last_failure": _failure_json(failure),
                }
            )
        return rows

    def _fetching(self, nodes: tuple[str, ...], source: str | None) -> dict[str, Any] | None:
        """The download a starting replica waits on: its first node's that has one."""
        if source is None:
            return None
        for node in nodes:
            found = self._registry.progress(node).get(source)
            if found is not None:
                return {"node": node, **progress_json(found)}
        return None

    async def replicas(self, **_: Any) -> tuple[int, Any]:
        return 200, {"replicas": self.replica_rows()}

    async def status(self, **_: Any) -> tuple[int, Any]:
        reconciler, catalog = self._need_catalog()
        rows = self.replica_rows()
        scales = {s.name: s for s in self._autoscaler.scales()} if self._autoscaler else {}
        out = []
        for m in catalog.catalog.models:
            mine = [r for r in rows if r["model"] == m.name]
            failure = self._registry.events.predecessor_failure(m.name, started=None, present=())
            ready = sum(r["state"] == "ready" for r in mine)
            scale = scales.get(m.name)
            out.append(
                {
                    "model": m.name,
                    "desired": reconciler.count(m),
                    # min, max, and the rule and signal that set `desired`; None: fixed count
                    "autoscale": scale_json(scale, ready) if scale is not None else None,
                    "priority": m.priority,
                    "ready": ready,
                    "starting": sum(r["state"] == "starting" for r in mine),
                    "unplaced": any(r["state"] == "unplaced" for r in mine),
                    # a full fleet: who holds the room, and whether it may be taken
                    "no_room": reconciler.priorities.why(m.name),
                    "last_failure": _failure_json(failure),
                }
            )
        inventories = {r.node_id: r.inventory for r in self._registry.records()}
        pairs = [(m.name, m.source) for m in catalog.catalog.models]
        holds = {}
        for i, (node_id, inv) in enumerate(inventories.items()):
            holds[node_id] = _holdings.node_holds(node_id, inv, pairs)
            if i % NODES_PER_SLICE == NODES_PER_SLICE - 1:
                await trio.lowlevel.checkpoint()  # a large fleet: let the heartbeats in
        fabrics = [
            {
                "fabric": f.fabric,
                "nodes": list(f.nodes),
                "models": [
                    {"model": h.model, "bytes": h.size_bytes, "nodes": list(h.nodes)}
                    for h in f.models
                ],
            }
            for f in _holdings.fabric_holdings(inventories, pairs, holds)
        ]
        # passes, settling, holding...: a test waits for a pass instead of sleeping.
        return 200, {
            "models": out,
            "traffic": traffic_json(catalog.catalog, {m["model"]: m["ready"] for m in out}),
            "fabrics": fabrics,
            "reconciler": reconciler.statistics(),
        }

    async def place(self, body: Any, **_: Any) -> tuple[int, Any]:
        reconciler, catalog = self._need_catalog()
        request = expect(body, {"model": str}, {})
        m = catalog.catalog.model(request["model"])
        if m is None:
            known = ", ".join(x.name for x in catalog.catalog.models) or "none"
            raise HttpError(404, f"no model {request['model']!r} in the catalog (known: {known})")
        found = reconciler.try_place(m)
        if isinstance(found, Unplaced):
            return 200, {"model": m.name, "placed": False, "reasons": list(found.reasons)}
        profile, where = found
        ranks = [
            {"rank": r.rank, "node": r.node_id, "gpus": list(r.gpu_indexes),
             "fabric_adapters": list(r.fabric_adapters)}
            for r in where.ranks
        ]  # fmt: skip
        return 200, {"model": m.name, "placed": True, "engine": profile.engine, "ranks": ranks,
                     "fabric": where.fabric}  # fmt: skip

    async def explain_route(self, body: Any, **_: Any) -> tuple[int, Any]:
        """Which endpoint the router would send a request to now, and why."""
        if self._router is None:
            raise HttpError(404, "this control plane runs no router (router_listen is null)")
        asked = expect(body, {"model": str, "request": dict}, {"path": str})
        path = asked.get("path", "/v1/chat/completions")
        try:
            return 200, self._router.explain(asked["model"], path, asked["request"])
        except RouterHttpError as exc:
            raise HttpError(exc.status, str(exc)) from None


def traffic_json(catalog: Catalog, ready: dict[str, int]) -> list[dict[str, Any]]:
    """Each split (server.yaml `traffic:`): its versions' weights, ready replicas, and
    share of the drawn requests now (a version with none ready takes none; the router
    draws the same way, llmgw/core/_traffic.py), and the keys pinned to each."""
    out = []
    for split in catalog.traffic:
        serving = {v.served for v in split.versions if ready.get(v.model, 0) > 0}
        shares = core.shares(split, serving)
        out.append(
            {
                "name": split.name,
                "versions": [
                    {
                        "model": v.model,
                        "served": v.served,
                        "weight": v.weight,
                        "share": shares[v.model],
                        "ready": ready.get(v.model, 0),
                        "keys": [k for k, m in split.keys if m == v.model],
                    }
                    for v in split.versions
                ],
            }
        )
    return out


def progress_json(p: FetchProgress) -> dict[str, Any]:
    """A fetch's progress for the API: unknown stays null, an eta only with a length and
    a rate."""
    return {
        "source": p.source,
        "done_bytes": p.done_bytes,
        "total_bytes": p.total_bytes,
        "rate_bytes_per_s": p.rate_bytes_per_s,
        "eta_s": p.eta_s,
        "at": p.at_wall,
    }


def _failure_json(failure: Failure | None) -> dict[str, Any] | None:
    if failure is None:
        return None
    return {
        "at": failure.at,
        "kind": failure.kind,
        "reason": failure.reason,
        "lines": list(failure.lines),
        "node_id": failure.node_id,
        "shard_id": failure.shard_id,
        "replica_id": failure.replica_id,
        "model_name": failure.model_name,
    }
