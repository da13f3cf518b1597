"""What the router routes to: endpoints, and where their list comes from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from llmgw.core import TrafficSplit


@attrs.frozen
class Endpoint:
    """One replica's serving address, as the router sees it.

    `endpoint_id` is stable for the replica's life (the router keys its
    in-flight counts, breaker and scraped load on it); `model` is the served
    name clients ask for; `slots` is how many requests the engine runs at
    once, when known (None: unknown).
    """

    endpoint_id: str
    model: str
    engine: str  # "vllm" | "sglang" | "llama-server"
    host: str
    port: int
    slots: int | None = None

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class EndpointSource(Protocol):
    """The router's view of the fleet.

    `snapshot()` maps each served name the catalog knows to its ready
    endpoints; a known model with no ready replica maps to an empty tuple (the
    router answers 503 for it, and 404 for a name that is absent). `version`
    changes whenever the snapshot (or the traffic) would; the router re-reads only
    then, so `snapshot()` may be as costly as it likes.

    `traffic()` maps each split name (server.yaml `traffic:`) to its versions, each
    listed in the snapshot under its served name (llmgw/core/_traffic.py).
    """

    @property
    def version(self) -> int: ...

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]: ...

    def traffic(self) -> Mapping[str, TrafficSplit]: ...


class StaticEndpoints:
    """A fixed list of endpoints (router-only mode); `replace` swaps it at run time."""

    def __init__(
        self,
        endpoints: Iterable[Endpoint] = (),
        models: Iterable[str] = (),
        traffic: Iterable[TrafficSplit] = (),
    ) -> None:
        self._version = 0
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self._traffic: dict[str, TrafficSplit] = {}
        self.replace(endpoints, models, traffic)

    def __repr__(self) -> str:
        sizes = {m: len(e) for m, e in self._snapshot.items()}
        return f"<StaticEndpoints v{self._version} {sizes}>"

    @property
    def version(self) -> int:
        return self._version

    def snapshot(self) -> Mapping[str, tuple[Endpoint, ...]]:
        return self._snapshot

    def traffic(self) -> Mapping[str, TrafficSplit]:
        return self._traffic

    def replace(
        self,
        endpoints: Iterable[Endpoint],
        models: Iterable[str] = (),
        traffic: Iterable[TrafficSplit] = (),
    ) -> None:
        """Swap the list; `models` names served names to keep known with no endpoint,
        `traffic` the splits over them."""
        snap: dict[str, list[Endpoint]] = {m: [] for m in models}
        seen: set[str] = set()
        for ep in endpoints:
            if ep.endpoint_id in seen:
                raise ValueError(f"endpoint id {ep.endpoint_id!r} is given twice")
            seen.add(ep.endpoint_id)
            snap.setdefault(ep.model, []).append(ep)
        self._snapshot = {m: tuple(eps) for m, eps in snap.items()}
        self._traffic = {t.name: t for t in traffic}
        self._version += 1
