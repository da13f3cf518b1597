"""What happened, read back through the admin API: the event log, a node's last hour,
the logs of a node and of its shards, and the audit log of what operators did."""

from __future__ import annotations

import time
from typing import Any

from llmgw import config
from llmgw.cp._admin._common import connected, need_store
from llmgw.cp._admin._http import HttpError, Route, route
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._observe import _node_logs
from llmgw.cp._observe._events import Event
from llmgw.errors import DeadlineExceeded, NotFound
from llmgw.store import AuditEntry, Store

EVENTS_LIMIT = 1000
AUDIT_LIMIT = 1000


class Logs:
    """`/api/v1/events`, `/api/v1/audit`, and a node's `history`, `logs`, `log-sources`
    and shard logs. Reading changes nothing."""

    def __init__(self, registry: NodeRegistry, store: Store | None) -> None:
        self._registry = registry
        self._store = store
        self.routes: tuple[Route, ...] = (
            route("GET", "/api/v1/events", self.events),
            route("GET", "/api/v1/nodes/{node}/history", self.history),
            route("GET", "/api/v1/nodes/{node}/logs", self.node_logs),
            route("GET", "/api/v1/nodes/{node}/log-sources", self.log_sources),
            route("GET", "/api/v1/nodes/{node}/shards/{shard}/logs", self.shard_logs),
            route("GET", "/api/v1/audit", self.audit_list),
        )

    async def events(self, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        raw = query.get("limit", "50")
        if not _node_logs.whole(raw) or not 1 <= int(raw) <= EVENTS_LIMIT:
            raise HttpError(400, f"limit: expected a whole number from 1 to {EVENTS_LIMIT}, "
                                 f"got {raw!r}")  # fmt: skip
        found = self._registry.events.events(
            replica_id=query.get("replica") or None,
            node_id=query.get("node") or None,
            limit=int(raw),
        )
        return 200, {"events": [_event_json(e) for e in found]}

    async def history(self, node: str, **_: Any) -> tuple[int, Any]:
        """The node's last hour (llmgw/cp/_observe/_history.py); null where nothing was reported."""
        history = self._registry.history
        if history is None:
            raise HttpError(404, "this control plane keeps no node history")
        view = history.view(node)
        if view is None:
            raise HttpError(404, f"no node {node!r} has a history here: it has not registered")
        return 200, view

    async def node_logs(self, node: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        """The tail of a log source on the node (default: the agent's own); `follow=1`
        streams what comes after it (llmgw/cp/_observe/_node_logs.py)."""
        _rec, agent = connected(self._registry, node)
        source, lines = query.get("source") or "agent", _node_logs.lines_of(query)
        try:
            if query.get("follow") in ("1", "true"):
                return 200, await _node_logs.Follow.open(node, agent, source, lines)
            tail = await agent.logs(source, lines)
        except DeadlineExceeded:
            raise HttpError(504, _node_logs.silent(node, agent.deadline_of("logs"))) from None
        return 200, {"source": source, "lines": [config.unstructure(line) for line in tail]}

    async def log_sources(self, node: str, **_: Any) -> tuple[int, Any]:
        _rec, agent = connected(self._registry, node)
        try:
            return 200, {"sources": await agent.log_sources()}
        except DeadlineExceeded:
            raise HttpError(504, _node_logs.silent(node, agent.deadline_of("logSources"))) from None

    async def shard_logs(
        self, node: str, shard: str, query: dict[str, str], **_: Any
    ) -> tuple[int, Any]:
        _rec, agent = connected(self._registry, node)
        lines = _node_logs.lines_of(query, default=40)
        try:
            tail = await agent.logs(shard, lines)
        except NotFound:
            raise HttpError(404, self._gone(node, shard)) from None
        except DeadlineExceeded:
            raise HttpError(504, _node_logs.silent(node, agent.deadline_of("logs"))) from None
        return 200, {"lines": [config.unstructure(line) for line in tail]}

    def _gone(self, node: str, shard: str) -> str:
        """One line: the shard is not there, and what became of it if that is known."""
        seen = [e for e in self._registry.events.events(node_id=node, limit=EVENTS_LIMIT)
                if e.shard_id == shard]  # fmt: skip
        if not seen:
            return (f"node {node} has no shard {shard!r} (it never ran there, or it is gone "
                    "and its logs with it); `llmgw ctl nodes --json` lists its shards")  # fmt: skip
        last = seen[-1]
        ago = max(0.0, time.time() - last.at)
        return (f"shard {shard} is gone from node {node}; {ago:.0f} s ago: {last.message} "
                f"(`llmgw ctl events --node {node}` has more)")  # fmt: skip

    async def audit_list(self, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        store = need_store(self._store)
        raw = query.get("limit", "100")
        if not _node_logs.whole(raw) or not 1 <= int(raw) <= AUDIT_LIMIT:
            raise HttpError(400, f"limit: expected a whole number from 1 to {AUDIT_LIMIT}, "
                                 f"got {raw!r}")  # fmt: skip
        return 200, {"entries": [_audit_json(e) for e in await store.recent_audit(int(raw))]}


def _event_json(event: Event) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "at": event.at,
        "kind": event.kind,
        "message": event.message,
        "node_id": event.node_id,
        "replica_id": event.replica_id,
        "model_name": event.model_name,
        "shard_id": event.shard_id,
        "lines": list(event.lines),
    }


def _audit_json(entry: AuditEntry) -> dict[str, Any]:
    return {"seq": entry.seq, "at": entry.at, "actor": entry.actor, "action": entry.action,
            "detail": entry.detail}  # fmt: skip
