"""Wedged engines: an endpoint that holds requests and sends nothing, as a pure decision.

An engine can stop producing tokens while its `/health` still answers 200 (a
CUDA hang looks exactly like this). The router sees it first-hand: every
request it has in flight there stops receiving bytes. `wedged` decides, for
the endpoints of one model at one moment, which to quarantine:

- the endpoint has requests in flight, and none of them has received a byte
  for its threshold: `wedge_after_s`, raised for a request still waiting for
  its first byte whose prefill is estimated to take long (`expected_first_byte_s`
  times `prefill_margin`), never past `max_wait_s`;
- and another endpoint of the model received a byte after this one went
  silent (the model's engines can make progress now: a router that was
  itself frozen, or a prompt every engine chokes on, quarantines nothing);
  so a model with one endpoint is never quarantined here (the agent's
  one-token probe and `first_byte_timeout_s` cover it);
- and it is not quarantined already.

Silence is counted from the newest of: the earliest send still in flight (an
idle engine owes nothing), and the newest sign of progress from the endpoint:
a byte of any request, ended or not (a byte for one is the engine alive for
all), or the engine's generation token counter seen to move on its /metrics
(`progress_at`: a non-streamed answer sends nothing until it is done, and
the counter of vLLM and SGLang moves as it generates). A request sent a
moment ago to an engine that hangs resets nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class InFlight:
    """One request in flight to an endpoint, as the router sees it."""

    started_at: float  # when it was sent
    last_byte_at: float | None  # the newest byte from the engine; None: none yet
    expected_first_byte_s: float | None = None  # its prefill, estimated; None: unknown


@attrs.frozen
class EndpointActivity:
    endpoint_id: str
    in_flight: tuple[InFlight, ...]
    # The newest other sign of progress: a byte of a request that has ended, the engine's
    # own generation counter seen to move (its /metrics); None: none yet.
    progress_at: float | None
    quarantined: bool = False


@attrs.frozen
class WedgeConfig:
    wedge_after_s: float = 10.0
    prefill_margin: float = 2.0  # an estimated prefill is waited for this many times over
    max_wait_s: float = 600.0  # no threshold past this (the router's first_byte_timeout_s)


@attrs.frozen
class Wedged:
    """An endpoint to quarantine, and the figures its reason gives."""

    endpoint_id: str
    requests: int  # in flight, none of them sending
    waiting_first_byte: int  # of those, the ones nothing has come back for yet
    silent_s: float  # since the newest byte (or the first send, when none came)
    threshold_s: float

    def reason(self, health: str | None = None) -> str:
        """`wedged: 3 requests, no bytes for 10 s, /health 200` (what ctl and events show).

        `health`: what a `/health` check said then ("/health 200", "/health timed out
        after 1 s"); None: not checked, and the reason says nothing about it.
        """
        plural = "" if self.requests == 1 else "s"
        text = f"wedged: {self.requests} request{plural}, no bytes for {self.silent_s:.0f} s"
        return text if health is None else f"{text}, {health}"


def threshold(flights: Sequence[InFlight], config: WedgeConfig) -> float:
    """How long the endpoint may send nothing: `wedge_after_s`, raised for the longest
    estimated prefill of a request still waiting for its first byte, at most `max_wait_s`
    (and never below `wedge_after_s`)."""
    longest = max(
        (
            f.expected_first_byte_s * config.prefill_margin
            for f in flights
            if f.last_byte_at is None and f.expected_first_byte_s is not None
        ),
        default=0.0,
    )
    return max(config.wedge_after_s, min(longest, config.max_wait_s))


def latest_byte(endpoint: EndpointActivity) -> float | None:
    """The newest sign of progress of the endpoint: a byte, whether its request has ended
    or not, or its generation counter seen to move."""
    seen = [f.last_byte_at for f in endpoint.in_flight if f.last_byte_at is not None]
    if endpoint.progress_at is not None:
        seen.append(endpoint.progress_at)
    return max(seen) if seen else None


def silent_since(endpoint: EndpointActivity) -> float | None:
    """Since when the endpoint has owed its requests a byte and sent none: the newest of
    the earliest send still in flight and its newest byte (any request's: a byte for one
    is the engine alive for all); None: nothing in flight."""
    if not endpoint.in_flight:
        return None
    owed = min(f.started_at for f in endpoint.in_flight)
    seen = latest_byte(endpoint)
    return owed if seen is None else max(owed, seen)


def wedged(
    endpoints: Sequence[EndpointActivity], now: float, config: WedgeConfig
) -> tuple[Wedged, ...]:
    """The endpoints of one model to quarantine now (the module says when); in the order
    given."""
    out = []
    for ep in endpoints:
        if ep.quarantined or not ep.in_flight:
            continue
        since = silent_since(ep)
        assert since is not None
        limit = threshold(ep.in_flight, config)
        if now - since < limit:
            continue
        progress = any(
            (seen := latest_byte(other)) is not None and seen > since
            for other in endpoints
            if other.endpoint_id != ep.endpoint_id and not other.quarantined
        )
        if not progress:
            continue
        out.append(
            Wedged(
                endpoint_id=ep.endpoint_id,
                requests=len(ep.in_flight),
                waiting_first_byte=sum(1 for f in ep.in_flight if f.last_byte_at is None),
                silent_s=now - since,
                threshold_s=limit,
            )
        )
    return tuple(out)
