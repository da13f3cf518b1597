"""Autoscaling in the admin API: each autoscaled model's count, the rule and the signal
that set it, and the operator's pause (hold a count) and resume
(llmgw/cp/_fleet/_autoscaler.py; the decision is llmgw/core/_autoscale.py). A pause is
written to the store (every control plane of it, and the next leader, hold it) and
audited before the API answers."""

from __future__ import annotations

import time
from typing import Any

from llmgw.cp._admin._common import audit, need_store
from llmgw.cp._admin._http import HttpError, Route, expect, route
from llmgw.cp._fleet._autoscaler import Autoscaler, ModelScale
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.store import Store


def scale_json(s: ModelScale, ready: int | None = None) -> dict[str, Any]:
    d, sample = s.decision, s.sample
    return {
        "model": s.name,
        "min": s.policy.min,
        "max": s.policy.max,
        "desired": s.desired,
        "ready": ready,
        "rule": d.rule if d is not None else None,  # None: no decision made here yet
        "signal": d.signal if d is not None else None,
        "reason": d.reason if d is not None else None,
        "decided": d.desired if d is not None else None,  # what it would be, paused or not
        # the decision that last changed the count here: what set it (null: none yet)
        "set_by": (
            {"rule": s.changed[0].rule, "reason": s.changed[0].reason, "at": s.changed[1]}
            if s.changed is not None
            else None
        ),
        "paused": (
            {"replicas": s.paused[0], "by": s.paused[1], "at": s.paused[2]}
            if s.paused is not None
            else None
        ),
        "load": (
            {
                "queued": sample.queued,
                "in_flight": sample.in_flight,
                "uncached_tokens": sample.uncached_tokens,
                "ttft_p90_s": sample.ttft_p90_s,
                "rejected": sample.rejected,
                "routers": s.routers,  # every router of every control plane it sums
            }
            if sample is not None
            else None
        ),
        "targets": {
            "requests_per_replica": s.policy.requests_per_replica,
            "ttft_p90_s": s.policy.ttft_p90_s,
        },
    }


class AutoscaleRoutes:
    """`/api/v1/autoscale` and `/api/v1/autoscale/{model}[/pause|/resume]`."""

    def __init__(
        self, autoscaler: Autoscaler | None, catalog: CatalogFile | None, store: Store | None
    ) -> None:
        self._autoscaler = autoscaler
        self._catalog = catalog
        self._store = store
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/autoscale", self.list),
            route("GET", "/api/v1/autoscale/{model}", self.one),
            route("POST", "/api/v1/autoscale/{model}/pause", self.pause),
            route("POST", "/api/v1/autoscale/{model}/resume", self.resume),
        )

    def _need(self) -> Autoscaler:
        if self._autoscaler is None or self._catalog is None:
            raise HttpError(404, "this control plane runs no catalog")
        return self._autoscaler

    def _scale(self, model: str) -> ModelScale:
        autoscaler = self._need()
        assert self._catalog is not None
        if self._catalog.catalog.model(model) is None:
            raise HttpError(404, f"no model {model!r} in the catalog")
        found = next((s for s in autoscaler.scales() if s.name == model), None)
        if found is None:
            raise HttpError(409, f"{model} has a fixed count (replicas:); it is not autoscaled")
        return found

    async def list(self, **_: Any) -> tuple[int, Any]:
        return 200, {"models": [scale_json(s) for s in self._need().scales()]}

    async def one(self, model: str, **_: Any) -> tuple[int, Any]:
        return 200, scale_json(self._scale(model))

    async def pause(self, model: str, body: Any = None, **_: Any) -> tuple[int, Any]:
        s = self._scale(model)
        store = need_store(self._store)
        request = expect(body if body is not None else {}, {}, {"replicas": int})
        count = request.get("replicas", s.desired)
        if not s.policy.min <= count <= s.policy.max:
            raise HttpError(
                400,
                f"replicas: {count} is outside {model}'s autoscale range "
                f"[{s.policy.min}, {s.policy.max}]",
            )
        await store.pause_autoscale(model, count, "admin", time.time())
        await audit(self._store, "autoscale-pause", f"{model} at {count}")
        self._need().paused_changed(await store.autoscale_paused())
        return 200, scale_json(self._scale(model))

    async def resume(self, model: str, **_: Any) -> tuple[int, Any]:
        self._scale(model)
        store = need_store(self._store)
        if not await store.resume_autoscale(model):
            raise HttpError(409, f"{model}'s autoscaler is not paused")
        await audit(self._store, "autoscale-resume", model)
        self._need().paused_changed(await store.autoscale_paused())
        return 200, scale_json(self._scale(model))
