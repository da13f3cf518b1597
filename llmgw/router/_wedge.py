"""Wedged engines, watched: the router's side of llmgw/core/_wedge.py.

Every attempt in flight is a `Flight` in its endpoint's state: when it was
sent, the response once its head came (whose `last_byte_at` the HTTP client
moves with every read), and, while the attempt waits on the engine with
nothing sent to the client yet, the cancel scope around that wait.

`WedgeWatch.run` ticks every `TICK_S`: per model, it turns the endpoints'
flights into `core.EndpointActivity` values, asks `core.wedged`, and for each
endpoint to quarantine:

1. marks it quarantined (`Fleet.choose` leaves it out from then on);
2. cancels its attempts still waiting with nothing sent to the client: each
   is retried elsewhere by the attempt loop (a retry, counted as a failed
   attempt in phase `wedged`); attempts whose head reached the client are
   left alone (too late to retry; `idle_timeout_s` bounds them);
3. asks the engine's `/health` once (bounded by `HEALTH_TIMEOUT_S`) so the
   reason says what a health check sees there: `wedged: 3 requests, no bytes
   for 10 s, /health 200`.

The quarantined endpoints and their reasons are `Fleet.quarantined()`, which the
control plane reads beside the in-flight counts (llmgw/cp/_workers.py) to
replace the replica. A quarantine ends when the endpoint sends a byte again
(a request still on it was answered after all), when it leaves the endpoint
list (the control plane replaced it), or after `wedge_quarantine_s` (a router
with a fixed list tries it again; still wedged, it is quarantined again
`wedge_after_s` later).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

from llmgw.core import EndpointActivity, WedgeConfig, wedged
from llmgw.router._fleet import Fleet
from llmgw.router._flight import Quarantine
from llmgw.router._scraper import EndpointState
from llmgw.router._upstream import UpstreamError, UpstreamTimeout

log = logging.getLogger("llmgw.router.wedge")

TICK_S = 0.5
HEALTH_TIMEOUT_S = 1.0


def activity(state: EndpointState) -> EndpointActivity:
    return EndpointActivity(
        state.endpoint.endpoint_id,
        tuple(f.activity() for f in state.flights),
        state.progress_at,
        quarantined=state.quarantine is not None,
    )


async def health_said(state: EndpointState) -> str:
    """What the engine's `/health` answers now, for a wedge's reason, in a few words."""
    try:
        status, _ = await state.scrape_pool.get(b"/health", HEALTH_TIMEOUT_S)
    except (UpstreamTimeout, trio.TooSlowError):
        return f"/health timed out after {HEALTH_TIMEOUT_S:g} s"
    except UpstreamError as exc:
        return f"/health failed ({exc.phase})"
    return f"/health {status}"


class WedgeWatch:
    """The periodic check; see the module. `groups()` gives, per model, its endpoints'
    states; `health(state)` asks one engine's /health and says what it answered;
    `quarantined(model, endpoint id)` counts a quarantine."""

    def __init__(
        self,
        config: WedgeConfig,
        quarantine_s: float,
        groups: Callable[[], Mapping[str, Sequence[EndpointState]]],
        health: Callable[[EndpointState], Awaitable[str]],
        counted: Callable[[str, str], None],
    ) -> None:
        self.config = config
        self.quarantine_s = quarantine_s
        self._groups = groups
        self._health = health
        self._counted = counted

    def __repr__(self) -> str:
        return f"<WedgeWatch after {self.config.wedge_after_s:g} s>"

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(TICK_S)
                self.check(trio.current_time(), nursery)

    def check(self, now: float, nursery: trio.Nursery) -> list[str]:
        """One tick: lift what is over, quarantine what is wedged; the endpoint ids
        quarantined now."""
        out = []
        seen: set[int] = set()
        for model, states in self._groups().items():
            for s in states:
                self._maybe_lift(s, now)
            views = [activity(s) for s in states]
            by_id = {v.endpoint_id: s for v, s in zip(views, states, strict=True)}
            for w in wedged(views, now, self.config):
                state = by_id[w.endpoint_id]
                if id(state) in seen:
                    continue
                seen.add(id(state))
                reason = w.reason()
                state.quarantine = Quarantine(now, reason)
                cancelled = sum(1 for f in list(state.flights) if f.cancel())
                log.warning(
                    "%s (%s): %s (waited %g s); quarantined, %d waiting request(s) sent elsewhere",
                    w.endpoint_id,
                    model,
                    reason,
                    w.threshold_s,
                    cancelled,
                )
                self._counted(model, w.endpoint_id)
                nursery.start_soon(self._add_health, state, w.reason)
                out.append(w.endpoint_id)
        return out

    def _maybe_lift(self, state: EndpointState, now: float) -> None:
        q: Quarantine | None = state.quarantine
        if q is None:
            return
        eid = state.endpoint.endpoint_id
        seen = [f.last_byte_at() for f in state.flights]
        seen.append(state.byte_at)
        # A counter that moved between two scrapes counts only when both came after the
        # quarantine began: tokens generated just before the wedge, read by the first
        # scrape after it, are no sign that it works again.
        moved = state.generated_moved
        if moved is not None and moved[0] is not None and moved[0] >= q.at:
            seen.append(moved[1])
        latest = max((t for t in seen if t is not None), default=None)
        if latest is not None and latest > q.at:
            log.warning("%s sends bytes again: quarantine lifted (%s)", eid, q.reason)
            state.quarantine = None
        elif now - q.at >= self.quarantine_s:
            log.warning(
                "%s: quarantined for %g s (%s); trying it again", eid, self.quarantine_s, q.reason
            )
            state.quarantine = None

    async def _add_health(self, state: EndpointState, reason: Callable[[str | None], str]) -> None:
        said = await self._health(state)
        q: Quarantine | None = state.quarantine
        if q is not None:
            state.quarantine = Quarantine(q.at, reason(said), checked=True)


def watch_fleet(fleet: Fleet, counted: Callable[[str, str], None]) -> WedgeWatch:
    """The watch over `fleet`'s models, as its router's config says (`wedge_after_s`,
    `wedge_quarantine_s`, `first_byte_timeout_s` the longest threshold)."""
    cfg = fleet.config
    return WedgeWatch(
        WedgeConfig(wedge_after_s=cfg.wedge_after_s, max_wait_s=cfg.first_byte_timeout_s),
        cfg.wedge_quarantine_s,
        lambda: {name: m.endpoints for name, m in fleet.models().items()},
        health_said,
        counted,
    )
