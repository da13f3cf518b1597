"""The fleet in the admin API: the node list, what an operator does to a node (cordon,
drain, forget), and the commands sent to a connected agent (start or stop a shard, check
its engines)."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import trio

from llmgw import config, engines
from llmgw.cp._admin._common import NODES_PER_SLICE, audit, connected
from llmgw.cp._admin._http import HttpError, Route, expect, route
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._shards import manual_shard, ports_taken
from llmgw.errors import LlmgwError, PeerError
from llmgw.store import Store

log = logging.getLogger("llmgw.cp.admin")

MAX_GRACE_S = 3600.0  # as stop_grace_s in agent.yaml and server.yaml
ENGINES = ("vllm", "sglang", "llama-server")


class Fleet:
    """`/api/v1/nodes...` and `/api/v1/engine-check`; overrides are saved, and audited
    when a store is kept, before the API answers."""

    def __init__(self, registry: NodeRegistry, store: Store | None) -> None:
        self._registry = registry
        self._store = store
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/nodes", self.nodes),
            route("POST", "/api/v1/nodes/{node}/shards", self.shard_start),
            route("DELETE", "/api/v1/nodes/{node}/shards/{shard}", self.shard_stop),
            route("POST", "/api/v1/engine-check", self.engine_check),
            route("POST", "/api/v1/nodes/{node}/cordon", self.cordon),
            route("DELETE", "/api/v1/nodes/{node}/cordon", self.uncordon),
            route("POST", "/api/v1/nodes/{node}/drain", self.drain),
            route("DELETE", "/api/v1/nodes/{node}", self.forget),
        )

    async def nodes(self, **_: Any) -> tuple[int, Any]:
        views = self._registry.views()
        # Rendering costs ~0.15 ms a node (cattrs, then json): in one piece, at
        # 5,000 nodes it held the trio thread, and every heartbeat queued behind
        # it, for over a second (bench/fleet.py). A worker thread does not help:
        # json.dumps holds the GIL throughout. So render in slices, letting the
        # heartbeats in between; the bytes are what json.dumps would write.
        parts = []
        for start in range(0, len(views), NODES_PER_SLICE):
            parts += [
                json.dumps(config.unstructure(v)) for v in views[start : start + NODES_PER_SLICE]
            ]
            await trio.lowlevel.checkpoint()
        return 200, ('{"nodes": [' + ", ".join(parts) + "]}").encode()

    async def shard_start(self, node: str, body: Any, **_: Any) -> tuple[int, Any]:
        rec, agent = connected(self._registry, node)
        request = expect(
            body,
            {"engine": str, "model": str},
            {"port": int, "args": list, "gpus": int, "served_name": str},
        )
        spec = manual_shard(
            rec,
            ports_taken(self._registry.records()).get(rec.host, set()),
            engine=request["engine"],
            model_ref=request["model"],
            port=request.get("port"),
            args=[str(a) for a in request.get("args", [])],
            gpus=request.get("gpus"),
            served_name=request.get("served_name"),
        )
        report = await agent.start_shard(self._registry.epoch, spec)
        self._registry.note_shard(node, report)
        log.info("shard %s started on %s by an operator: %s", spec.shard_id, node, spec.model)
        return 201, {"shard": config.unstructure(report), "spec": config.unstructure(spec)}

    async def shard_stop(
        self, node: str, shard: str, query: dict[str, str], **_: Any
    ) -> tuple[int, Any]:
        _rec, agent = connected(self._registry, node)
        try:
            grace = float(query.get("grace", "0"))
        except ValueError:
            grace = math.nan
        if not 0 <= grace <= MAX_GRACE_S:  # NaN too
            raise HttpError(
                400, f"grace: expected seconds from 0 to {MAX_GRACE_S:g}, got {query['grace']!r}"
            )
        await agent.stop_shard(self._registry.epoch, shard, grace)
        self._registry.forget_shard(node, shard)
        log.info("shard %s on %s stopped by an operator", shard, node)
        return 200, {"stopped": shard}

    async def engine_check(self, body: Any, **_: Any) -> tuple[int, Any]:
        request = expect(body or {}, {}, {"node": str, "engine": str})
        names = [request["engine"]] if request.get("engine") else list(ENGINES)
        for name in names:
            if name not in ENGINES:
                raise HttpError(400, f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
        if request.get("node"):
            targets = [connected(self._registry, request["node"])]
        else:
            targets = [(r, r.agent) for r in self._registry.records() if r.agent is not None]
        results = []
        for rec, agent in targets:
            for name in names:
                try:
                    check = await agent.engine_check(name, engines.widest_command(name))
                    results.append({"node": rec.node_id, **config.unstructure(check)})
                except PeerError as exc:
                    results.append({"node": rec.node_id, "engine": name, "error": str(exc)})
        return 200, {"checks": results}

    async def cordon(self, node: str, body: Any, **_: Any) -> tuple[int, Any]:
        request = expect(body or {}, {}, {"reason": str})
        if self._registry.record(node) is None:
            raise HttpError(404, f"no node {node!r} has registered")
        self._registry.cordon(node, request.get("reason"))
        await self._saved(node, "cordoned")
        await audit(self._store, "cordon", f"{node}: {self._registry.cordoned[node]}")
        return 200, {"cordoned": node}

    async def uncordon(self, node: str, **_: Any) -> tuple[int, Any]:
        lifted = self._registry.uncordon(node)
        if not lifted:
            raise HttpError(404, f"node {node!r} is neither cordoned nor draining")
        await self._saved(node, "uncordoned")
        await audit(self._store, "uncordon", f"{node}: lifted {', '.join(lifted)}")
        return 200, {"uncordoned": node, "lifted": lifted}

    async def drain(self, node: str, body: Any, **_: Any) -> tuple[int, Any]:
        request = expect(body or {}, {}, {"reason": str})
        if self._registry.record(node) is None:
            raise HttpError(404, f"no node {node!r} has registered")
        self._registry.drain(node, request.get("reason"))  # its listeners wake the reconciler
        await self._saved(node, "draining")
        await audit(self._store, "drain", f"{node}: {self._registry.draining[node]}")
        return 200, {"draining": node}

    async def forget(self, node: str, **_: Any) -> tuple[int, Any]:
        rec = self._registry.record(node)
        if rec is not None and rec.agent is not None:
            raise HttpError(
                409,
                f"node {node} is connected ({rec.liveness.state.value}): a connected node "
                "cannot be forgotten; stop its agent first (drain it to move its replicas)",
            )
        was = self._registry.forget(node)  # NotFound (404) when it is not known at all
        await self._saved(node, "forgotten")
        await audit(self._store, "forget", f"{node}: it was {was}")
        return 200, {"forgotten": node, "was": was}

    async def _saved(self, node: str, what: str) -> None:
        """The operator's override is in the store before the API answers."""
        try:
            await self._registry.flush()
        except LlmgwError as exc:
            raise HttpError(
                503,
                f"node {node} is {what} on this control plane but not yet saved in the store "
                f"({exc}); it is retried, and lost if this control plane restarts first",
            ) from None
