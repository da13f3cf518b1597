"""Weights in the admin API: what each node holds and what the catalog wants of it, and
collecting what is reclaimable (the agent removes only what none of its shards uses)."""

from __future__ import annotations

import logging
from typing import Any

import trio

from llmgw import model
from llmgw.cp._admin._http import HttpError, Route, expect, route
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._registry import NodeRecord, NodeRegistry
from llmgw.cp._weights import _holdings
from llmgw.errors import LlmgwError, StaleEpoch

log = logging.getLogger("llmgw.cp.admin")

COLLECT_MAX_PATHS = 10_000


class Weights:
    """`GET /api/v1/weights` and `POST /api/v1/weights/collect`. Without a catalog every
    cache entry is unwanted here."""

    def __init__(self, registry: NodeRegistry, catalog: CatalogFile | None) -> None:
        self._registry = registry
        self._catalog = catalog
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/weights", self.weights),
            route("POST", "/api/v1/weights/collect", self.weights_collect),
        )

    def _catalog_sources(self) -> list[tuple[str, str]]:
        """(who wants it, source) for every catalog model and adapter (`NAME (adapter of
        BASE)`); none when this control plane runs no catalog (then every cache entry is
        unwanted, and the agents still keep what their shards use)."""
        if self._catalog is None:
            return []
        return self._catalog.catalog.weight_sources()

    def _node_weights(
        self, only: str | None = None
    ) -> list[tuple[NodeRecord, _holdings.NodeWeights]]:
        pairs = self._catalog_sources()
        return [
            (rec, _holdings.node_weights(rec.node_id, rec.inventory.weights, pairs))
            for rec in self._registry.records()
            if only is None or rec.node_id == only
        ]

    async def weights(self, **_: Any) -> tuple[int, Any]:
        nodes = []
        pairs = self._catalog_sources()
        for rec in self._registry.records():
            w = _holdings.node_weights(rec.node_id, rec.inventory.weights, pairs)
            nodes.append(
                {
                    "node": rec.node_id,
                    "state": rec.liveness.state.value,
                    "connected": rec.agent is not None,
                    "reported": w.reported,
                    "weights_dir": w.weights_dir,
                    "held": [_held_json(h) for h in w.held],
                    # null: not reported (an agent older than the list).
                    "unfinished": (
                        None if w.unfinished is None else [_held_json(h) for h in w.unfinished]
                    ),
                    "reclaimable": [
                        {"path": r.path, "size_bytes": r.size_bytes} for r in w.reclaimable
                    ],
                    # Unknown, not 0, until the node has reported its weights directory.
                    "reclaimable_bytes": (
                        sum(r.size_bytes for r in w.reclaimable) if w.reported else None
                    ),
                }
            )
            await trio.lowlevel.checkpoint()  # a large fleet: let the heartbeats in
        return 200, {"nodes": nodes}

    async def weights_collect(self, body: Any, **_: Any) -> tuple[int, Any]:
        request = expect(
            {} if body is None else body, {}, {"dry_run": bool, "node": str, "paths": list}
        )
        dry_run = bool(request.get("dry_run", False))
        node = request.get("node")
        paths = request.get("paths")
        if paths is not None:
            if node is None:
                raise HttpError(400, "paths: only with node (each node's paths are its own); "
                                     "add \"node\": \"<node id>\"")  # fmt: skip
            bad = [p for p in paths if not isinstance(p, str) or not p or len(p) > 4096]
            if bad or len(paths) > COLLECT_MAX_PATHS:
                shown = f"{str(bad[0])[:80]!r}" if bad else f"{len(paths)} paths"
                raise HttpError(400, f"paths: expected at most {COLLECT_MAX_PATHS} non-empty "
                                     f"strings of at most 4096 characters, "
                                     f"got {shown}")  # fmt: skip
        known = self._node_weights(node)
        if node is not None and not known:
            raise HttpError(404, f"no node {node!r} has registered")
        pairs = self._catalog_sources()
        asks: list[tuple[NodeRecord, tuple[str, ...], int | None, list[dict[str, str]]]] = []
        for rec, w in known:
            if paths is None:
                asks.append((rec, tuple(r.path for r in w.reclaimable),
                             sum(r.size_bytes for r in w.reclaimable), []))  # fmt: skip
                continue
            sizes = {h.path: h.size_bytes for h in w.held}
            got = [sizes.get(p) for p in paths]
            total = None if None in got else sum(s or 0 for s in got)
            # What the catalog wants is refused here: the agent knows only its own shards.
            ours = []
            for p in paths:
                wants = _holdings.catalog_wants(p, w.weights_dir, pairs)
                if wants:
                    what = "adapter" if all(" (adapter of " in w for w in wants) else "model"
                    detail = (f"{p}: {_holdings.WANTED} ({', '.join(wants)}); remove the "
                              f"{what} from the catalog first")  # fmt: skip
                    ours.append({"path": p, "reason": _holdings.WANTED, "detail": detail})
            asks.append((rec, tuple(paths), total, ours))
        results: dict[str, dict[str, Any]] = {}

        async def ask(
            rec: NodeRecord,
            asked: tuple[str, ...],
            asked_bytes: int | None,
            ours: list[dict[str, str]],
        ) -> None:
            row: dict[str, Any] = {
                "node": rec.node_id, "asked": list(asked), "asked_bytes": asked_bytes,
                "removed": [], "freed_bytes": 0, "refused": ours, "error": None,
            }  # fmt: skip
            results[rec.node_id] = row
            refused_here = {r["path"] for r in ours}
            asked = tuple(p for p in asked if p not in refused_here)
            if not asked:
                return
            agent = rec.agent
            if agent is None:
                row["error"] = f"node {rec.node_id} is {rec.liveness.state.value}: not connected"
                return
            try:
                # The bridge bounds the call with its per-call deadline.
                done: model.Reclaimed = await agent.reclaim(self._registry.epoch, asked, dry_run)
            except StaleEpoch as exc:  # another control plane leads: counted, and step down
                self._registry.stale_epoch(rec.node_id, exc)
                row["error"] = str(exc)
                return
            except LlmgwError as exc:
                row["error"] = str(exc)
                return
            row["removed"] = list(done.removed)
            row["freed_bytes"] = done.freed_bytes
            row["refused"] = ours + [
                {"path": r.path, "reason": r.reason, "detail": r.detail} for r in done.refused
            ]
            log.info("reclaim on %s%s: asked %d, removed %d (%d bytes), refused %d",
                     rec.node_id, " (dry run)" if dry_run else "", len(asked),
                     len(done.removed), done.freed_bytes, len(done.refused))  # fmt: skip

        async with trio.open_nursery() as nursery:
            for rec, asked, asked_bytes, ours in asks:
                nursery.start_soon(ask, rec, asked, asked_bytes, ours)
        return 200, {"dry_run": dry_run, "nodes": [results[a[0].node_id] for a in asks]}


def _held_json(h: _holdings.Held) -> dict[str, Any]:
    return {"path": h.path, "kind": h.kind, "size_bytes": h.size_bytes, "files": h.files,
            "wanted_by": list(h.wanted_by)}  # fmt: skip
