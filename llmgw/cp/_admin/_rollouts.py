"""Rollouts in the admin API: how far each changed model is, and the operator's pause,
resume and undo (llmgw/cp/_fleet/_rollouts.py keeps them; the rule is llmgw/core/_rollout.py).
Each command is written to the store and audited before the API answers."""

from __future__ import annotations

from typing import Any

from llmgw import config
from llmgw.cp._admin._common import audit
from llmgw.cp._admin._http import HttpError, Route, route
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.errors import UsageError
from llmgw.store import Store


class RolloutRoutes:
    """`/api/v1/rollouts` and `/api/v1/rollouts/{model}[/pause|/resume|/undo]`."""

    def __init__(
        self, reconciler: Reconciler | None, catalog: CatalogFile | None, store: Store | None
    ) -> None:
        self._reconciler = reconciler
        self._catalog = catalog
        self._store = store
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/rollouts", self.list),
            route("GET", "/api/v1/rollouts/{model}", self.one),
            route("POST", "/api/v1/rollouts/{model}/pause", self.pause),
            route("POST", "/api/v1/rollouts/{model}/resume", self.resume),
            route("POST", "/api/v1/rollouts/{model}/undo", self.undo),
        )

    def _need(self) -> tuple[Reconciler, CatalogFile]:
        if self._reconciler is None or self._catalog is None:
            raise HttpError(404, "this control plane runs no catalog")
        return self._reconciler, self._catalog

    def row(self, name: str) -> dict[str, Any]:
        reconciler, catalog = self._need()
        m = catalog.catalog.model(name)
        if m is None:
            raise HttpError(404, f"no model {name!r} in the catalog")
        running_catalog = reconciler.rollouts.catalog(catalog.catalog)
        running = running_catalog.model(name) or m
        mine = [v for v in reconciler.replicas() if v.model_name == name]
        mr = reconciler.rollouts.status(name)
        rec = mr.record if mr is not None else None
        return {
            "model": name,
            "phase": rec.phase if rec is not None else None,  # None: never rolled here
            "status": rec.status if rec is not None else None,
            "to": list(rec.to) if rec is not None else None,
            "previous": list(rec.previous) if rec is not None else None,
            "started_at": rec.started_at if rec is not None else None,
            "finished_at": rec.finished_at if rec is not None else None,
            "paused": rec.paused if rec is not None else False,
            "failures": rec.failures if rec is not None else 0,
            "undone": bool(mr is not None and mr.pin is not None),
            # what the fleet is rolled to now, and what server.yaml says
            "fingerprints": list(running_catalog.fingerprints(running)),
            "file_fingerprints": list(catalog.catalog.fingerprints(m)),
            "settled": list(mr.settled.fingerprints) if mr and mr.settled else None,
            "policy": config.unstructure(m.rollout),
            "replicas": {
                "old": sum(1 for v in mine if v.stale),
                "new": sum(1 for v in mine if not v.stale),
                "new_ready": sum(1 for v in mine if not v.stale and v.state == "ready"),
                "wanted": reconciler.count(m),
            },
        }

    async def list(self, **_: Any) -> tuple[int, Any]:
        _rec, catalog = self._need()
        return 200, {"rollouts": [self.row(m.name) for m in catalog.catalog.models]}

    async def one(self, model: str, **_: Any) -> tuple[int, Any]:
        return 200, self.row(model)

    async def _done(self, model: str, action: str) -> tuple[int, Any]:
        reconciler, _cat = self._need()
        await reconciler.rollouts.flush()
        reconciler.poke()
        await audit(self._store, f"rollout-{action}", model)
        return 200, self.row(model)

    async def pause(self, model: str, **_: Any) -> tuple[int, Any]:
        self.row(model)  # 404 for an unknown model
        try:
            self._need()[0].rollouts.pause(model)
        except UsageError as exc:
            raise HttpError(409, str(exc)) from None
        return await self._done(model, "pause")

    async def resume(self, model: str, **_: Any) -> tuple[int, Any]:
        self.row(model)
        try:
            self._need()[0].rollouts.resume(model)
        except UsageError as exc:
            raise HttpError(409, str(exc)) from None
        return await self._done(model, "resume")

    async def undo(self, model: str, **_: Any) -> tuple[int, Any]:
        self.row(model)
        reconciler, catalog = self._need()
        try:
            reconciler.rollouts.undo(model, catalog.catalog)
        except UsageError as exc:
            raise HttpError(409, str(exc)) from None
        return await self._done(model, "undo")
