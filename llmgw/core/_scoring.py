"""Choosing an endpoint for a request: expected cost, under a bound on load.

Pure: endpoints' figures, the request's estimate, a clock value and a
`random.Random` in, an endpoint id out (`choose`), or the whole reasoning
(`explain`, which computes every figure with the same functions).

Load the router counts itself
    At dispatch the router adds the request's uncached prompt tokens to the
    endpoint's `pending_prefill` (taken off when the answer starts) and its
    expected output tokens to `pending_decode` (taken off when it ends), and
    counts it `in_flight`. These are current to the moment, so they carry the
    load; a scrape adds only what the router did not send itself.

    That is the fix for the old score, which counted a request the engine
    reported running 3 times and one the router had sent since the last
    reading once: an engine that had just finished still looked busy until the
    next reading, and the next request piled onto the other engine. Measured on
    two real llama-servers it left one idle while the other held two requests
    34-44 % of the time, and lost to round robin on every workload.

Scraped figures
    `external` = what the engine reports queued and running, less the router's
    own in-flight count when that reading was taken (`own_at_scrape`): other
    routers' and workers' requests, or clients that bypass the router. Absent
    is not zero: when the reading is stale (older than `stale_after_intervals`
    x `scrape_interval_s`), missing, negative or not finite, `external` is
    unknown, and the cost adds `unknown_penalty` requests' worth of work. An
    endpoint whose scrapes fail is never preferred for reading zero. A KV
    cache the engine reports at `kv_full` or more adds `kv_full_penalty`
    requests' worth (the engine would queue or preempt).

Cost (in prompt-token equivalents; lower is better)

    cost = uncached + queued
    uncached = prompt_tokens - cached_tokens          this request's prefill there
    queued   = pending_prefill + decode_cost x pending_decode
             + external x unit                        (or unknown_penalty x unit)
             + kv_full_penalty x unit                 (when kv >= kv_full)

    `unit` is this request's own work (prompt_tokens + decode_cost x
    output_tokens), standing in for a typical request of the model;
    `decode_cost` is how many prompt tokens one output token costs (the router
    learns it from llama.cpp's timings; 4 until then: unknown is a default,
    never 0). `cached_tokens` is the prefix index's credit for this request on
    that endpoint (llmgw/core/_prefix.py); with the `least-load` policy it is 0
    everywhere. Every term is work the engine must do before this request is
    done, in one unit: the model's learned prefill rate (ms a prompt token,
    llmgw/core/_estimates.py) would turn each into seconds, and the same rate
    on both sides of a comparison changes no choice, so the scorer never needs
    it (and a model whose engines report no timings is priced alike).

Spill by cost, not by count
    A request goes where it costs least. So a prompt cached on a busier endpoint
    stays there exactly while that endpoint's queued work plus the little it has
    left to prefill is below another's queued work plus the whole prefill it
    would do: a cache hit behind a short queue wins, and the request spills
    only when waiting costs more than computing the prompt again. That also
    bounds what a hot prefix can pile on: the cached endpoint's queue exceeds
    the least loaded one's by at most the prompt's cached tokens.

    The count bound this replaces (ceil((1 + 0.25) x (total + 1) / n)) moved
    about 60 % of decisions on bench/routing.py's capped workload (2 engines,
    3 in flight) off the engine holding the prompt, and each such spill
    evicted a cached prompt there; llmgw reached 0.79x of a client-side
    oracle that sends each system prompt to one fixed engine.

    A spill (`decide`'s flag) is a request sent away from the prompt's home:
    some eligible endpoint is credited with at least half of the prompt
    (`_HOME_SHARE`, the share the index counts a report as a hit) and the
    chosen one with less. The router does not record a spill's prompt where it
    went, so one overflow does not move the home.

The hot-spot bound (consistent hashing with bounded loads, kept wide)
    The cost rests on estimates (output tokens, decode cost); a count does not.
    So no endpoint takes a new request while that would put its request count
    (`in_flight` + known `external`) over ceil((1 + epsilon) x (total + 1) / n),
    n the eligible endpoints, with a wide epsilon (1.0 by default: at most
    twice the mean, plus one). It is a guard against a real hot spot when the
    estimates are wrong, not the spill rule: with 2 endpoints and epsilon >= 1
    it never binds (the cap is at least total + 1), and there the cost alone
    decides. Some endpoint always fits (the least loaded one), so the bound
    never refuses a request.

Choice
    Eligible: healthy and allowed by its breaker. Among the eligible endpoints
    within the bound the lowest cost wins; costs within `_TIE` (relative) are a
    tie broken with `rng`. `round-robin` takes the eligible endpoints in turn
    (`rotation`), bound aside: the baseline the others are measured against.

Session affinity
    With an `affinity` key (a header a client sends to keep its conversation
    on one replica), the endpoint is picked by rendezvous hashing: the eligible
    endpoint with the highest hash of (key, endpoint id), so endpoints coming
    and going move only the keys that hashed to them. It is taken while it is
    within the bound; past the bound the normal choice decides.
"""

from __future__ import annotations

import hashlib
import math
import operator
import random
from collections.abc import Sequence
from typing import Literal

import attrs

Policy = Literal["prefix", "least-load", "round-robin"]
POLICIES: tuple[Policy, ...] = ("prefix", "least-load", "round-robin")
_TIE = 1e-9
# An endpoint credited with at least this share of the prompt is its home (a spill is a
# request sent elsewhere); the same share the prefix index counts a report as a hit.
_HOME_SHARE = 0.5
_ID = operator.attrgetter("endpoint_id")


@attrs.frozen
class EndpointLoad:
    endpoint_id: str
    healthy: bool
    allowed: bool  # the endpoint's breaker would allow a request (Breaker.would_allow)
    in_flight: int  # the router's own count: never stale
    waiting: float | None
    running: float | None
    kv_usage: float | None  # 0..1
    scraped_at: float | None  # clock value of the reading the three figures above come from
    own_at_scrape: int | None = None  # the router's in_flight there when that reading was taken
    pending_prefill: float = 0.0  # own: uncached prompt tokens of requests not yet answering
    pending_decode: float = 0.0  # own: expected output tokens of requests in flight
    cached_tokens: float = 0.0  # the prefix index's credit for this request here

    @property
    def eligible(self) -> bool:
        return self.healthy and self.allowed


@attrs.frozen
class RequestEstimate:
    """What a request will cost an engine, as far as the router can tell before sending."""

    prompt_tokens: float
    output_tokens: float
    decode_cost: float = 4.0  # prompt tokens' worth of work per output token

    @property
    def unit(self) -> float:
        return max(1.0, self.prompt_tokens + self.decode_cost * self.output_tokens)


UNKNOWN_REQUEST = RequestEstimate(prompt_tokens=0.0, output_tokens=1.0)


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number, 0 or more, got {value}")


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number, got {value}")


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (0 < value <= 1):
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


def _policy(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in POLICIES:
        raise ValueError(f"{attribute.name} must be one of {', '.join(POLICIES)}, got {value!r}")


@attrs.frozen
class ScoringConfig:
    policy: Policy = attrs.field(default="prefix", validator=_policy)
    scrape_interval_s: float = attrs.field(default=1.0, validator=_positive)
    stale_after_intervals: float = attrs.field(default=3.0, validator=_positive)
    epsilon: float = attrs.field(default=1.0, validator=_non_negative)
    # At or above this KV use the engine queues or preempts new work.
    kv_full: float = attrs.field(default=0.95, validator=_fraction)
    kv_full_penalty: float = attrs.field(default=1.0, validator=_non_negative)
    unknown_penalty: float = attrs.field(default=1.0, validator=_non_negative)

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


def external(e: EndpointLoad, now: float, config: ScoringConfig) -> float | None:
    """Requests the engine holds that this router did not send; None when unknown."""
    return _external(e) if fresh(e, now, config) else None


def _external(e: EndpointLoad) -> float | None:
    running = _known(e.running)
    waiting = _known(e.waiting)
    if running is None and waiting is None:
        return None
    seen = (running or 0.0) + (waiting or 0.0)
    return max(0.0, seen - max(0, e.own_at_scrape or 0))


def load(e: EndpointLoad, now: float, config: ScoringConfig) -> float:
    """The endpoint's request count, for the bound: own plus known external."""
    return max(0, e.in_flight) + (external(e, now, config) or 0.0)


def cost(e: EndpointLoad, request: RequestEstimate, now: float, config: ScoringConfig) -> float:
    """The expected cost of sending `request` there: uncached + queued (the module doc)."""
    return uncached(e, request, config) + queued(e, request, now, config)


def uncached(e: EndpointLoad, request: RequestEstimate, config: ScoringConfig) -> float:
    """The prompt tokens the endpoint would prefill for `request` (all of them with a
    policy that counts no prefix)."""
    return request.prompt_tokens - _cached(e, request, config)


def queued(e: EndpointLoad, request: RequestEstimate, now: float, config: ScoringConfig) -> float:
    """The work queued there before `request` would be done, in prompt-token equivalents:
    the router's own pending prefill and decode, others' requests, a full KV cache."""
    return _queued(e, request, external(e, now, config), fresh(e, now, config), config)


def _cost(
    e: EndpointLoad,
    request: RequestEstimate,
    ext: float | None,
    is_fresh: bool,
    config: ScoringConfig,
) -> float:
    return (
        request.prompt_tokens
        - _cached(e, request, config)
        + _queued(e, request, ext, is_fresh, config)
    )


def _queued(
    e: EndpointLoad,
    request: RequestEstimate,
    ext: float | None,
    is_fresh: bool,
    config: ScoringConfig,
) -> float:
    unit = request.unit
    total = max(0.0, e.pending_prefill) + request.decode_cost * max(0.0, e.pending_decode)
    total += (config.unknown_penalty if ext is None else ext) * unit
    if is_fresh:
        kv = _known(e.kv_usage)
        if kv is not None and kv >= config.kv_full:
            total += config.kv_full_penalty * unit
    return total


def _cached(e: EndpointLoad, request: RequestEstimate, config: ScoringConfig) -> float:
    if config.policy != "prefix":
        return 0.0
    return min(request.prompt_tokens, max(0.0, e.cached_tokens))


def capacity(loads: Sequence[float], epsilon: float) -> int:
    """The most requests one endpoint may hold once the next one is placed."""
    return _capacity(sum(loads), len(loads), epsilon) if loads else 0


def _capacity(total: float, n: int, epsilon: float) -> int:
    # round() first: a float sum of whole counts must not ceil 2.0000000001 to 3.
    return math.ceil(round((1 + epsilon) * (total + 1) / n, 9))


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
    """The eligible endpoint `key` maps to by rendezvous hashing, the bound aside."""
    eligible = [e.endpoint_id for e in endpoints if e.eligible]
    if not eligible:
        return None
    return max(eligible, key=lambda eid: (rendezvous_weight(key, eid), eid))


def choose(
    endpoints: Sequence[EndpointLoad],
    request: RequestEstimate,
    now: float,
    rng: random.Random,
    config: ScoringConfig = ScoringConfig(),  # frozen, so one shared default is safe
    affinity: str | None = None,
    rotation: int = 0,
) -> str | None:
    """The endpoint to send a request to, or None when no endpoint is eligible."""
    return decide(endpoints, request, now, rng, config, affinity, rotation)[0]


def decide(
    endpoints: Sequence[EndpointLoad],
    request: RequestEstimate,
    now: float,
    rng: random.Random,
    config: ScoringConfig = ScoringConfig(),
    affinity: str | None = None,
    rotation: int = 0,
) -> tuple[str | None, bool]:
    """`choose`, and whether the request was sent away from the endpoint that holds its
    prompt (a spill: the router then leaves the prompt's home where it was)."""
    # On every request's path: one pass for the figures, one for the costs, and the
    # same helpers `cost` and `load` use (explain shows what this computes).
    eligible = [e for e in endpoints if e.healthy and e.allowed]
    if not eligible:
        return None, False
    if len(eligible) > 1:
        eligible.sort(key=_ID)
    if config.policy == "round-robin":
        return eligible[rotation % len(eligible)].endpoint_id, False
    rows = []
    total = 0.0
    for e in eligible:
        is_fresh = fresh(e, now, config)
        ext = _external(e) if is_fresh else None
        n = max(0, e.in_flight) + (ext or 0.0)
        total += n
        rows.append((e, n, ext, is_fresh))
    cap = _capacity(total, len(rows), config.epsilon)
    within = [r for r in rows if r[1] + 1 <= cap] or rows
    if affinity is not None:
        target = affinity_target(eligible, affinity)
        for r in within:
            if r[0].endpoint_id == target:
                return target, False
    best = math.inf
    tied: list[str] = []
    for e, _, ext, is_fresh in within:
        c = _cost(e, request, ext, is_fresh, config)
        if c < best - _TIE * max(1.0, abs(c)):
            best = c
            tied = [e.endpoint_id]
        elif c - best <= _TIE * max(1.0, abs(best)):
            tied.append(e.endpoint_id)
    chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
    return chosen, _spilled(rows, chosen, request, config)


def _spilled(
    rows: Sequence[tuple[EndpointLoad, float, float | None, bool]],
    chosen: str,
    request: RequestEstimate,
    config: ScoringConfig,
) -> bool:
    """Whether `chosen` is away from the prompt's home (see the module doc)."""
    home = request.prompt_tokens * _HOME_SHARE
    if home <= 0:
        return False
    best = max(_cached(e, request, config) for e, *_ in rows)
    if best < home:
        return False
    mine = next(_cached(e, request, config) for e, *_ in rows if e.endpoint_id == chosen)
    return mine < home


@attrs.frozen
class Candidate:
    """One endpoint's figures in a decision, for `x-llmgw-explain` and `ctl route`."""

    endpoint_id: str
    healthy: bool
    allowed: bool
    within_bound: bool
    load: float
    in_flight: int
    cached_tokens: float
    uncached_tokens: float
    pending_prefill: float
    pending_decode: float
    queued: float | None  # work queued there, prompt-token equivalents; None: not eligible
    external: float | None
    running: float | None
    waiting: float | None
    kv_usage: float | None
    scrape_age_s: float | None
    cost: float | None  # None: not eligible


@attrs.frozen
class Decision:
    policy: Policy
    chosen: str | None
    reason: str
    capacity: int
    average_load: float | None
    epsilon: float
    request: RequestEstimate
    candidates: tuple[Candidate, ...]


def explain(
    endpoints: Sequence[EndpointLoad],
    request: RequestEstimate,
    now: float,
    rng: random.Random,
    config: ScoringConfig = ScoringConfig(),
    affinity: str | None = None,
    rotation: int = 0,
) -> Decision:
    """`choose`, with every candidate's figures and the reason for the winner."""
    chosen, spilled = decide(endpoints, request, now, rng, config, affinity, rotation)
    eligible = [e for e in endpoints if e.eligible]
    loads = {e.endpoint_id: load(e, now, config) for e in eligible}
    cap = capacity(list(loads.values()), config.epsilon)
    rows = []
    for e in sorted(endpoints, key=lambda e: e.endpoint_id):
        cached = _cached(e, request, config)
        is_fresh = fresh(e, now, config)
        rows.append(
            Candidate(
                endpoint_id=e.endpoint_id,
                healthy=e.healthy,
                allowed=e.allowed,
                within_bound=e.eligible and loads[e.endpoint_id] + 1 <= cap,
                load=load(e, now, config),
                in_flight=e.in_flight,
                cached_tokens=cached,
                uncached_tokens=request.prompt_tokens - cached,
                pending_prefill=e.pending_prefill,
                pending_decode=e.pending_decode,
                queued=queued(e, request, now, config) if e.eligible else None,
                external=external(e, now, config),
                running=_known(e.running) if is_fresh else None,
                waiting=_known(e.waiting) if is_fresh else None,
                kv_usage=_known(e.kv_usage) if is_fresh else None,
                scrape_age_s=None if e.scraped_at is None else max(0.0, now - e.scraped_at),
                cost=cost(e, request, now, config) if e.eligible else None,
            )
        )
    return Decision(
        policy=config.policy,
        chosen=chosen,
        reason=_reason(config, chosen, affinity, eligible, loads, cap, len(endpoints))
        + (_away(rows, chosen, request) if spilled and chosen is not None else ""),
        capacity=cap,
        average_load=(sum(loads.values()) / len(loads)) if loads else None,
        epsilon=config.epsilon,
        request=request,
        candidates=tuple(rows),
    )


def _reason(
    config: ScoringConfig,
    chosen: str | None,
    affinity: str | None,
    eligible: Sequence[EndpointLoad],
    loads: dict[str, float],
    cap: int,
    listed: int,
) -> str:
    if chosen is None:
        if listed == 0:
            return "no endpoint serves this model now"
        return "no endpoint is eligible (all unhealthy or their circuits open)"
    if config.policy == "round-robin":
        return "round robin: the next eligible endpoint in turn"
    over = sorted(eid for eid, n in loads.items() if n + 1 > cap)
    most = f"{cap} request" + ("s" if cap != 1 else "")
    bound = (
        f"; over the bound of {most}: {', '.join(over)}"
        if over
        else f"; all within the bound of {most}"
    )
    if affinity is not None and chosen == affinity_target(eligible, affinity):
        return "session affinity: the key's rendezvous endpoint, within the bound" + bound
    what = "uncached prefill plus queued work" if config.policy == "prefix" else "queued work"
    return f"lowest expected cost ({what})" + bound


def _away(rows: Sequence[Candidate], chosen: str, request: RequestEstimate) -> str:
    """Why a spill left the prompt's home: its queue against the prefill here."""
    home = max(
        (c for c in rows if c.cost is not None),
        key=lambda c: (c.cached_tokens, c.endpoint_id),
    )
    here = next(c for c in rows if c.endpoint_id == chosen)
    if home.within_bound:
        return (
            f"; sent away from {home.endpoint_id}, which holds the prompt: its queued work "
            f"({home.queued:.0f} tokens) costs more than {chosen}'s "
            f"({here.queued:.0f}) plus the {here.uncached_tokens:.0f}-token prefill here"
        )
    return f"; sent away from {home.endpoint_id}, which holds the prompt, by the bound"
