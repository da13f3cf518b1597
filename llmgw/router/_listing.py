"""`GET /v1/models` and `GET /v1/models/{model}`: what a key may ask for and can get now.

A served name is listed while one of its endpoints answers its metrics, or while
it has a hold (llmgw/router/_holds.py: at zero replicas, a request for it starts
one and is answered); a traffic split's name (llmgw/core/_traffic.py) while one of
its versions is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from llmgw.core import TrafficSplit
from llmgw.keys import ApiKey
from llmgw.router._adapters import AdapterRoute
from llmgw.router._fleet import Model
from llmgw.router._types import Hold

__all__ = ["is_listed", "listed", "model_entry", "parent"]


class _Fleet(Protocol):
    def models(self) -> dict[str, Model]: ...
    def traffic(self) -> dict[str, TrafficSplit]: ...
    def serving(self, names: Iterable[str] | None = None) -> set[str]: ...
    def holds(self) -> dict[str, Hold]: ...
    def adapters(self) -> dict[str, AdapterRoute]: ...


def model_entry(name: str, parent: str | None = None) -> dict[str, Any]:
    """A model's entry; an adapter's names its base as `parent` (as vLLM lists one)."""
    entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
    if parent is not None:
        entry["parent"] = parent
    return entry


def parent(fleet: _Fleet, name: str) -> str | None:
    route = fleet.adapters().get(name)
    return None if route is None else route.base


def _names(fleet: _Fleet) -> set[str]:
    serving = fleet.serving() | (fleet.holds().keys() & fleet.models().keys())
    splits = {
        name for name, t in fleet.traffic().items() if any(v.served in serving for v in t.versions)
    }
    return serving | splits


def listed(fleet: _Fleet, key: ApiKey) -> list[dict[str, Any]]:
    """The models `GET /v1/models` lists for `key`, sorted."""
    return [
        model_entry(name, parent(fleet, name))
        for name in sorted(_names(fleet))
        if key.may_use(name) and _allowed(fleet, key, name)
    ]


def _allowed(fleet: _Fleet, key: ApiKey, name: str) -> bool:
    """An adapter is listed only for the tenants it allows (they alone may use it)."""
    route = fleet.adapters().get(name)
    return route is None or route.allows(key.tenant)


def is_listed(fleet: _Fleet, key: ApiKey, name: str) -> bool:
    return key.may_use(name) and _allowed(fleet, key, name) and name in _names(fleet)
