"""Telling the connected agents of a new engine declaration (server.yaml's `engines:`).

The registry holds the declaration in force and puts it in every registration's
Settings; when it changes, every agent connected now is told at once, each in a
task of its own bounded by the RPC deadline (the bridge's), so that one slow or
failed node delays and fails only itself: it converges at its next
registration. Going from a declaration to none sends an empty one: nothing is
declared any more. An agent that refuses the epoch as stale is the registry's
to hear of (`stale_epoch`): someone else leads.
"""

from __future__ import annotations

import logging
from typing import Protocol

from llmgw import model
from llmgw.cp._fleet import _engines
from llmgw.errors import StaleEpoch
from llmgw.rpc import AgentHandle

log = logging.getLogger("llmgw.cp.registry")  # the registry's component


class Refusals(Protocol):
    def stale_epoch(self, node_id: str, exc: StaleEpoch) -> None: ...


def to_send(
    old: model.EngineDecls | None, new: model.EngineDecls | None
) -> model.EngineDecls | None:
    """What going from `old` to `new` tells the agents; None: nothing changed."""
    if (old.fingerprint if old is not None else None) == (
        new.fingerprint if new is not None else None
    ):
        return None
    return new if new is not None else _engines.declare(())


async def declare(
    agent: AgentHandle, node_id: str, epoch: int, decls: model.EngineDecls, registry: Refusals
) -> bool:
    """Tell one agent; whether it took the declaration. Its failure is logged, not raised."""
    try:
        await agent.declare_engines(epoch, decls)
    except StaleEpoch as exc:
        registry.stale_epoch(node_id, exc)
        return False
    except Exception as exc:  # that node's failure only: it converges at its next registration
        log.warning(
            "node %s: declaring engines %s failed: %s", node_id, decls.fingerprint[:12], exc
        )
        return False
    log.info("node %s: engines %s declared", node_id, decls.fingerprint[:12])
    return True
