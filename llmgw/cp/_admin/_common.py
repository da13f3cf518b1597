"""What more than one admin resource needs: a connected node's agent, the store (or a 404
saying there is none), an audit line, and how many nodes to render between checkpoints."""

from __future__ import annotations

from llmgw.cp._admin._http import HttpError
from llmgw.cp._fleet._registry import NodeRecord, NodeRegistry
from llmgw.rpc import AgentHandle
from llmgw.store import Store

NODES_PER_SLICE = 100  # ~15 ms of rendering between checkpoints


def connected(registry: NodeRegistry, node: str) -> tuple[NodeRecord, AgentHandle]:
    rec = registry.record(node)
    if rec is None:
        raise HttpError(404, f"no node {node!r} has registered")
    if rec.agent is None:
        raise HttpError(409, f"node {node} is {rec.liveness.state.value}: not connected")
    return rec, rec.agent


def need_store(store: Store | None) -> Store:
    if store is None:
        raise HttpError(404, "this control plane keeps no store")
    return store


async def audit(store: Store | None, action: str, detail: str) -> None:
    """What an operator did, in the audit log; nothing when no store is kept here."""
    if store is not None:
        await store.audit("admin", action, detail)
