"""Traffic splits: which version (catalog model) answers a request for a split name.

server.yaml's `traffic:` names a split (`qwen`) and gives each version its weight
(`{qwen-v1: 90, qwen-v2: 10}`). Per request the router asks `route`: a version
the request pins (the `X-LLMGW-Version` header, else its key's pin in the split),
else one drawn by weight with a uniform number `u` in [0, 1) the caller supplies,
so the choice is a function of its inputs (tested with hypothesis).

The draw is over the versions that have a ready replica now (`available`): a
canary still loading, or one whose replicas all failed, does not turn its share
of requests into 503s; the other versions take it. When no version is
available the draw is over all of them (and the router answers 503 for the one
drawn, naming it). A pinned request goes to its version whatever the weights
say, weight 0 included (a version only pins reach: a dark launch).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection

import attrs

__all__ = ["TrafficChoice", "TrafficPinError", "TrafficSplit", "TrafficVersion", "route", "shares"]


@attrs.frozen
class TrafficVersion:
    """One version of a split: a catalog model, the served name its replicas are listed
    under (the name the router routes and counts by), and its weight."""

    model: str
    served: str
    weight: int


@attrs.frozen
class TrafficSplit:
    name: str  # what clients ask for
    versions: tuple[TrafficVersion, ...]  # at least one, weights summing to more than 0
    keys: tuple[tuple[str, str], ...] = ()  # (API key id, version's model), sorted

    def version(self, asked: str) -> TrafficVersion | None:
        """The version a pin names: its catalog model's name or its served name."""
        for v in self.versions:
            if asked in (v.model, v.served):
                return v
        return None

    def key_pin(self, key_id: str) -> str | None:
        for kid, model in self.keys:
            if kid == key_id:
                return model
        return None


@attrs.frozen
class TrafficChoice:
    version: TrafficVersion
    how: str  # "split" (drawn by weight), "header" or "key" (pinned)


@attrs.frozen
class TrafficPinError:
    """A header pin that names no version of the split: the client's mistake."""

    split: str
    asked: str

    def message(self, versions: tuple[TrafficVersion, ...]) -> str:
        known = ", ".join(v.model for v in versions)
        return f"{self.asked!r} is not a version of {self.split!r} (its versions: {known})"


def _draw(versions: tuple[TrafficVersion, ...], u: float) -> TrafficVersion:
    """The version `u` in [0, 1) falls on, each owning a stretch as wide as its weight."""
    weighted = [v for v in versions if v.weight > 0]  # one at least: the catalog checks
    bounds = list(itertools.accumulate(v.weight for v in weighted))
    u = min(max(u, 0.0), 1.0)
    at = bisect.bisect_right(bounds, u * bounds[-1])
    return weighted[min(at, len(weighted) - 1)]


def _drawable(split: TrafficSplit, available: Collection[str]) -> tuple[TrafficVersion, ...]:
    """The versions with a ready replica and a weight; all of them when none has both."""
    ready = tuple(v for v in split.versions if v.served in available and v.weight > 0)
    return ready or split.versions


def route(
    split: TrafficSplit,
    *,
    u: float,
    available: Collection[str],
    header: str | None = None,
    key_id: str | None = None,
) -> TrafficChoice | TrafficPinError:
    """The version for one request. `available`: the served names with a ready replica;
    `header`: the `X-LLMGW-Version` value (a version's model or served name); `key_id`:
    the caller's API key, pinned when the split names it. The header wins over the key:
    the client could as well ask for the version's served name."""
    if header:
        found = split.version(header)
        if found is None:
            return TrafficPinError(split.name, header)
        return TrafficChoice(found, "header")
    if key_id is not None:
        pinned = split.key_pin(key_id)
        found = split.version(pinned) if pinned is not None else None
        if found is not None:
            return TrafficChoice(found, "key")
    return TrafficChoice(_draw(_drawable(split, available), u), "split")


def shares(split: TrafficSplit, available: Collection[str]) -> dict[str, float]:
    """Each version's share of the drawn (unpinned) requests now, by its model: its
    weight over the weights of the versions that can be drawn (0 for the others)."""
    drawable = _drawable(split, available)
    total = sum(v.weight for v in drawable)
    out = {v.model: 0.0 for v in split.versions}
    for v in drawable:
        out[v.model] = v.weight / total
    return out
