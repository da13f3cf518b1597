"""The endpoint list a newly elected leader routes by while its own fleet view fills.

A standby routes from the list the leader published (llmgw/cp/_fleet/_endpoints.py).
Its own fleet view is empty when it takes the lease: the agents have not yet
re-registered with it, and each one's registration is what puts its replicas in the
view. Switching to that view at once answered 503 `no_ready_replica` for seconds at
every takeover; so the new leader merges, endpoint by endpoint:

- an endpoint in its own view is routed as its own view says (it replaces the
  published one with the same id: the agent's report is newer);
- a published endpoint not in its own view stays while its node has not registered
  with this leader and its engine answers the router's health readings: it is the
  engine the old leader routed to, still serving;
- once a node has registered, its report is the truth about it: a published endpoint
  of that node the report does not hold (stopped, not ready) leaves the list.

The handover is over once no published endpoint is left waiting on its node
(`handing_over`); the shell ends it too after a bound in time (the old leader would
have stopped routing to an agent-less node's engines once it was lost).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, TypeVar


class HasEndpointId(Protocol):
    @property
    def endpoint_id(self) -> str: ...


E = TypeVar("E", bound=HasEndpointId)


def handover_endpoints(
    own: Mapping[str, Sequence[E]],
    published: Mapping[str, Sequence[E]],
    *,
    node_of: Callable[[str], str],
    registered: Collection[str],
    unhealthy: Collection[str],
) -> dict[str, tuple[E, ...]]:
    """The list to route by: `own` (model -> endpoints) merged with `published`.

    `node_of`: an endpoint id's node; `registered`: the nodes that registered with this
    leader; `unhealthy`: endpoint ids whose engine does not answer. Every model of
    either list is kept (an empty tuple where none is left), each model's endpoints
    sorted by id."""
    out: dict[str, tuple[E, ...]] = {}
    for name in sorted(own.keys() | published.keys()):
        mine = {e.endpoint_id: e for e in own.get(name, ())}
        merged = dict(mine)
        for e in published.get(name, ()):
            eid = e.endpoint_id
            if eid in merged or eid in unhealthy or node_of(eid) in registered:
                continue
            merged[eid] = e
        out[name] = tuple(merged[eid] for eid in sorted(merged))
    return out


def handing_over(
    published: Mapping[str, Sequence[HasEndpointId]],
    *,
    node_of: Callable[[str], str],
    registered: Collection[str],
    unhealthy: Collection[str],
) -> bool:
    """Whether a published endpoint still waits on its node (so the merge still matters)."""
    return any(
        e.endpoint_id not in unhealthy and node_of(e.endpoint_id) not in registered
        for eps in published.values()
        for e in eps
    )
