"""What the router routes to: endpoints, and where their list comes from."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from llmgw.core import TrafficSplit
from llmgw.router._adapters import AdapterRoute


def _strings(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


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
    # The LoRA adapters this replica holds, in its engine's order (llmgw/router/_adapters.py).
    adapters: tuple[str, ...] = attrs.field(default=(), converter=_strings)

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _hold_max(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"a hold's max must be a number of requests, 1 or more, not {value!r}")


def _hold_s(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"a hold's s must be a number of seconds above 0, not {value!r}")


@attrs.frozen
class Hold:
    """How requests for a model with no ready replica wait for one (its replicas are
    scaled to zero and the first is starting): at most `max` held at once over the
    router's workers (each its `share()`), each at most `s` seconds; past either bound,
    503 with Retry-After at once (llmgw/router/_holds.py)."""

    max: int = attrs.field(validator=_hold_max)
    s: float = attrs.field(validator=_hold_s)


def holds_of(source: object) -> Mapping[str, Hold]:
    """The source's holds by served name (`holds()` is optional: none without it)."""
    holds = getattr(source, "holds", None)
    return holds() if holds is not None else {}


def encode_holds(holds: Mapping[str, Hold]) -> dict[str, dict[str, float]]:
    """The holds as JSON: {served name: {"max": n, "s": seconds}} (sorted)."""
    return {name: {"max": h.max, "s": h.s} for name, h in sorted(holds.items())}


def decode_holds(value: object) -> dict[str, Hold]:
    """`encode_holds`' value back (None, from a sender before holds: none); raises
    ValueError naming what is wrong (the store is shared: nothing in it is trusted)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f'holds: expected {{name: {{"max": n, "s": seconds}}}}, not {value!r:.80}')
    out: dict[str, Hold] = {}
    for name, hold in value.items():
        if not isinstance(name, str) or not isinstance(hold, dict) or set(hold) != {"max", "s"}:
            raise ValueError(f'holds: {str(name)[:60]!r}: expected {{"max": n, "s": seconds}}')
        try:
            out[name] = Hold(hold["max"], hold["s"])
        except ValueError as exc:
            raise ValueError(f"holds: {name[:60]!r}: {exc}") from None
    return out


class EndpointSource(Protocol):
    """The router's view of the fleet.

    `snapshot()` maps each served name the catalog knows to its ready
    endpoints; a known model with no ready replica maps to an empty tuple (the
    router answers 503 for it, and 404 for a name that is absent). `version`
    changes whenever the snapshot (or the traffic) would; the router re-reads only
    then, so `snapshot()` may be as costly as it likes.

    `traffic()` maps each split name (server.yaml `traffic:`) to its versions, each
    listed in the snapshot under its served name (llmgw/core/_traffic.py).

    Optionally, `holds()` maps served names to a `Hold`: a request for one with no
    endpoint waits for its first instead of a 503 at once (read with `holds_of`;
    `version` moves when they change too), and `adapters()` maps LoRA adapter names
    (listed in the snapshot under their own name) to an `AdapterRoute` (read with
    `adapters_of`, llmgw/router/_adapters.py).
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
        holds: Mapping[str, Hold] | None = None,
        adapters: Mapping[str, AdapterRoute] | None = None,
    ) -> None:
        self._version = 0
        self._snapshot: dict[str, tuple[Endpoint, ...]] = {}
        self._traffic: dict[str, TrafficSplit] = {}
        self._holds: dict[str, Hold] = {}
        self._adapters: dict[str, AdapterRoute] = {}
        self.replace(endpoints, models, traffic, holds, adapters)

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

    def holds(self) -> Mapping[str, Hold]:
        return self._holds

    def adapters(self) -> Mapping[str, AdapterRoute]:
        return self._adapters

    def replace(
        self,
        endpoints: Iterable[Endpoint],
        models: Iterable[str] = (),
        traffic: Iterable[TrafficSplit] = (),
        holds: Mapping[str, Hold] | None = None,
        adapters: Mapping[str, AdapterRoute] | None = None,
    ) -> None:
        """Swap the list; `models` names served names to keep known with no endpoint,
        `traffic` the splits over them, `holds` how requests for one with no endpoint
        wait (none: 503 at once), `adapters` the LoRA adapters among the names."""
        snap: dict[str, list[Endpoint]] = {m: [] for m in models}
        seen: dict[str, Endpoint] = {}
        for ep in endpoints:
            # One replica may serve several names (served names, the adapters it holds):
            # the same id under another name, at the same address.
            other = seen.get(ep.endpoint_id)
            if other is not None and (
                other.model == ep.model or (other.host, other.port) != (ep.host, ep.port)
            ):
                raise ValueError(f"endpoint id {ep.endpoint_id!r} is given twice")
            seen[ep.endpoint_id] = ep
            snap.setdefault(ep.model, []).append(ep)
        self._snapshot = {m: tuple(eps) for m, eps in snap.items()}
        self._traffic = {t.name: t for t in traffic}
        self._holds = dict(holds or {})
        self._adapters = dict(adapters or {})
        self._version += 1
