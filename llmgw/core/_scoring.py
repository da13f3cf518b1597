"""Choosing an endpoint for a request, from scraped engine load and the router's own counts.

Pure: endpoints' figures, a clock value and a `random.Random` in, an endpoint
id out.

Score (lower is better; `score()` is public for metrics and debugging)

    score = in_flight_weight x in_flight
          + waiting_weight   x waiting          (or unknown_penalty when unknown)
          + running_weight   x running          (or unknown_penalty when unknown)
          + kv_weight        x kv               (or unknown_penalty when unknown)
          + kv_full_penalty                     (when kv >= kv_full)

    `in_flight` is the router's own count of requests it has sent there and
    not yet seen finish: always current, so it is never unknown, and it keeps
    one router from piling onto an endpoint between two scrapes.

    `kv` is the KV-cache use (0..1). When the engine gives none but gives its
    slot count (llama.cpp), running / slots stands in for it: each slot owns a
    fixed share of the cache.

    Absent is not zero. A figure is unknown when the engine did not report it
    or when the scrape is stale: older than `stale_after_intervals` x
    `scrape_interval_s` (or never made). Reading an unknown figure as 0 would
    make an endpoint whose scrapes stopped (often because it is overloaded)
    look idle, and every request would go there; instead each unknown figure
    adds `unknown_penalty`. With the defaults an endpoint with no fresh
    figures scores 12 plus its in-flight count: it still beats an endpoint
    known to have a long queue, but loses to any idle or moderately busy one.
    A figure that is negative or not finite counts as unknown too.

Choice
    Among the endpoints that are healthy and whose breaker allows a request,
    the lowest score wins; scores within `_TIE_TOLERANCE` of the best are a
    tie, broken with the injected `rng` (so a fleet of idle endpoints shares
    the load instead of one taking it all). None when nothing is eligible.

Session affinity
    With an `affinity` key (a header a client sends to keep its
    conversation's prefix cache warm), the endpoint is picked by rendezvous
    hashing: the eligible endpoint with the highest hash of (key, endpoint
    id). Endpoints coming and going move only the keys that hashed to them.
    The affinity endpoint yields to the normal choice when it is overloaded:
    its engine has requests waiting (or that figure is unknown) AND its score
    is more than `affinity_overload_margin` worse than the best eligible
    score. A warm cache is worth a little queueing, not an unbounded amount.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

import attrs

_TIE_TOLERANCE = 1e-9


@attrs.frozen
class EndpointLoad:
    endpoint_id: str
    healthy: bool
    allowed: bool  # the endpoint's breaker would allow a request (Breaker.would_allow)
    in_flight: int  # the router's own count: never stale
    waiting: float | None
    running: float | None
    kv_usage: float | None  # 0..1
    scraped_at: float | None  # clock value of the scrape the three figures above come from
    slots: int | None  # parallel sequences the engine serves (llama.cpp's slots)

    @property
    def eligible(self) -> bool:
        return self.healthy and self.allowed


def _weight(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number, 0 or more, got {value}")


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number, got {value}")


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (0 < value <= 1):
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


@attrs.frozen
class ScoringConfig:
    scrape_interval_s: float = attrs.field(default=1.0, validator=_positive)
    stale_after_intervals: float = attrs.field(default=3.0, validator=_positive)
    in_flight_weight: float = attrs.field(default=1.0, validator=_weight)
    waiting_weight: float = attrs.field(default=2.0, validator=_weight)
    running_weight: float = attrs.field(default=1.0, validator=_weight)
    kv_weight: float = attrs.field(default=4.0, validator=_weight)
    # At or above this KV use the engine queues or preempts new work.
    kv_full: float = attrs.field(default=0.95, validator=_fraction)
    kv_full_penalty: float = attrs.field(default=8.0, validator=_weight)
    unknown_penalty: float = attrs.field(default=4.0, validator=_weight)
    affinity_overload_margin: float = attrs.field(default=8.0, validator=_weight)

    @property
    def stale_after_s(self) -> float:
        return self.scrape_interval_s * self.stale_after_intervals


def _known(value: float | None) -> float | None:
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return value


def fresh(e: EndpointLoad, now: float, config: ScoringConfig) -> bool:
    """Are the endpoint's scraped figures recent enough to believe?"""
    return e.scraped_at is not None and now - e.scraped_at <= config.stale_after_s


def score(e: EndpointLoad, now: float, config: ScoringConfig) -> float:
    """The endpoint's cost for one more request; lower is better (see the module doc)."""
    is_fresh = fresh(e, now, config)
    waiting = _known(e.waiting) if is_fresh else None
    running = _known(e.running) if is_fresh else None
    kv = _known(e.kv_usage) if is_fresh else None
    if kv is None and running is not None and e.slots is not None and e.slots > 0:
        kv = running / e.slots
    total = config.in_flight_weight * max(0, e.in_flight)
    total += config.unknown_penalty if waiting is None else config.waiting_weight * waiting
    total += config.unknown_penalty if running is None else config.running_weight * running
    if kv is None:
        total += config.unknown_penalty
    else:
        kv = min(kv, 1.0)
        total += config.kv_weight * kv
        if kv >= config.kv_full:
            total += config.kv_full_penalty
    return total


def rendezvous_weight(key: str, endpoint_id: str) -> int:
    """The key's weight for an endpoint; stable across processes and runs (no `hash()`)."""
    # surrogatepass: a key is outside input, and a lone surrogate must not raise here.
    raw = (
        key.encode("utf-8", "surrogatepass")
        + b"\x00"
        + endpoint_id.encode("utf-8", "surrogatepass")
    )
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity_target(endpoints: Sequence[EndpointLoad], key: str) -> str | None:
    """The eligible endpoint `key` maps to by rendezvous hashing, overload aside."""
    eligible = [e.endpoint_id for e in endpoints if e.eligible]
    if not eligible:
        return None
    return max(eligible, key=lambda eid: (rendezvous_weight(key, eid), eid))


def choose(
    endpoints: Sequence[EndpointLoad],
    now: float,
    rng: random.Random,
    config: ScoringConfig = ScoringConfig(),  # frozen, so one shared default is safe
    affinity: str | None = None,
) -> str | None:
    """The endpoint to send a request to, or None when no endpoint is eligible."""
    scored = sorted(
        ((score(e, now, config), e) for e in endpoints if e.eligible),
        key=lambda se: se[1].endpoint_id,
    )
    if not scored:
        return None
    best = min(s for s, _ in scored)
    if affinity is not None:
        target = affinity_target(endpoints, affinity)
        for s, e in scored:
            if e.endpoint_id == target:
                waiting = _known(e.waiting) if fresh(e, now, config) else None
                may_queue = waiting is None or waiting > 0
                if not (may_queue and s - best > config.affinity_overload_margin):
                    return target
                break
    tied = [e.endpoint_id for s, e in scored if s - best <= _TIE_TOLERANCE]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
