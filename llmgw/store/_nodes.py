"""What the control plane remembers about nodes: operators' overrides and the nodes it knew.

An override (cordon, drain, forget, with a reason) is one row a node, written
on the store's clock; a known node is one row a node with its address and when
it was last seen, so a restarted control plane knows whom to wait for.
"""

from __future__ import annotations

from llmgw.errors import UsageError
from llmgw.store._runner import Runner
from llmgw.store._values import OVERRIDE_KINDS, KnownNode, NodeOverride

UPSERT_OVERRIDE = (
    "INSERT INTO node_overrides (node_id, kind, reason, at) VALUES (?, ?, ?, {at})"
    " ON CONFLICT (node_id) DO UPDATE SET kind = excluded.kind,"
    " reason = excluded.reason, at = excluded.at"
)
UPSERT_KNOWN = (
    "INSERT INTO known_nodes (node_id, address, last_seen) VALUES (?, ?, {at})"
    " ON CONFLICT (node_id) DO UPDATE SET address = excluded.address,"
    " last_seen = excluded.last_seen"
)


class NodeStore:
    """The `node_overrides` and `known_nodes` tables."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def set_override(self, node_id: str, kind: str, reason: str) -> None:
        if kind not in OVERRIDE_KINDS:
            raise UsageError(
                f"node override {kind!r} is not one of {', '.join(sorted(OVERRIDE_KINDS))}"
            )
        await self._run.q(UPSERT_OVERRIDE.format(at=self._run.now_sql), (node_id, kind, reason))

    async def clear_override(self, node_id: str) -> bool:
        rows = await self._run.q(
            "DELETE FROM node_overrides WHERE node_id = ? RETURNING node_id", (node_id,)
        )
        return bool(rows)

    async def overrides(self) -> list[NodeOverride]:
        rows = await self._run.q(
            "SELECT node_id, kind, reason, at FROM node_overrides ORDER BY node_id"
        )
        return [NodeOverride(str(n), str(k), str(r), float(a)) for n, k, r, a in rows]

    async def remember_node(self, node_id: str, address: str) -> None:
        await self._run.q(UPSERT_KNOWN.format(at=self._run.now_sql), (node_id, address))

    async def known_nodes(self) -> list[KnownNode]:
        rows = await self._run.q(
            "SELECT node_id, address, last_seen FROM known_nodes ORDER BY node_id"
        )
        return [KnownNode(str(n), str(a), float(s)) for n, a, s in rows]

    async def forget_node(self, node_id: str) -> bool:
        rows = await self._run.q(
            "DELETE FROM known_nodes WHERE node_id = ? RETURNING node_id", (node_id,)
        )
        return bool(rows)
