"""Each endpoint's load, read from its engine's `/metrics` (and llama.cpp's `/slots`).

Every `interval_s` every endpoint is read at once, each reading bounded by
`timeout_s`. A reading carries the clock value it was taken at; the scorer
treats one older than a few intervals as unknown, never as idle. An endpoint
that misses `unhealthy_after` readings in a row (refused, timed out, 5xx) is
marked unhealthy and gets no requests until a reading succeeds again; both
changes are logged with the endpoint and the reason. A reading that times out
while the endpoint sends bytes to requests (one within the span those misses
would take) is not a miss: the engine is busy, not gone (a llama-server answers
/metrics from the loop that generates, so a burst on a fresh replica made it
"unhealthy" and its model answered 503 while it served).

llama.cpp has no KV gauge; its `/slots` is read for their number, not as one:
the busy share of its slots is a second, staler copy of `running`, and the
router counts its own requests there as they start and end (reading "both
slots busy" as a full cache would repeat the bug llmgw/core/_scoring.py
describes). Their number becomes the
endpoint's `slots` unless the endpoint declares its own, and `on_slots` is
called when it changes, so admission's concurrency follows the engine (a
2-slot llama-server gets 2 requests at a time, the rest queue or get 429).

An engine that answers but publishes no metrics (SGLang without
`--enable-metrics` is 404, llama-server without `--metrics` is 501) is alive:
its load stays unknown and it stays healthy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

import trio

from llmgw import engines
from llmgw.core import Breaker, PrefixIndex
from llmgw.router._flight import Flight, Quarantine
from llmgw.router._types import Endpoint
from llmgw.router._upstream import Pool, UpstreamError

log = logging.getLogger("llmgw.router.scraper")


class EndpointState:
    """What the router knows about one endpoint: its pools, breaker, own counts, scraped
    load and prefix index."""

    __slots__ = (
        "breaker",
        "byte_at",
        "endpoint",
        "flights",
        "generated",
        "generated_moved",
        "healthy",
        "in_flight",
        "index",
        "kv_usage",
        "last_error",
        "misses",
        "no_metrics_logged",
        "own_at_scrape",
        "pending_decode",
        "pending_prefill",
        "pool",
        "progress_at",
        "quarantine",
        "remote_in_flight",
        "running",
        "scrape_pool",
        "scraped_at",
        "slots",
        "waiting",
    )

    def __init__(
        self,
        endpoint: Endpoint,
        breaker: Breaker,
        keepalive_s: float = 4.0,
        index: PrefixIndex | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.index = index if index is not None else PrefixIndex(8192, 300.0)
        self.pool = Pool(endpoint.host, endpoint.port, keepalive_s=keepalive_s)
        self.scrape_pool = Pool(endpoint.host, endpoint.port, keepalive_s=keepalive_s, max_idle=1)
        self.breaker = breaker
        self.in_flight = 0
        # The router's own load here (llmgw/core/_scoring.py): estimated uncached prompt
        # tokens of requests not yet answering, expected output tokens of those in flight.
        self.pending_prefill = 0.0
        self.pending_decode = 0.0
        # The other router workers' requests in flight here, as their prefix facts said
        # (llmgw/core/_prefix_share.py; 0 with one worker): counted as this router's own.
        self.remote_in_flight = 0
        # in_flight (+ remote_in_flight) when the last reading was taken
        self.own_at_scrape: int | None = None
        self.running: float | None = None
        self.waiting: float | None = None
        self.kv_usage: float | None = None
        self.scraped_at: float | None = None
        self.slots: int | None = endpoint.slots
        self.healthy = True
        self.misses = 0
        self.last_error: str | None = None
        self.no_metrics_logged = False
        # The wedge watch's (llmgw/router/_wedge.py): attempts in flight; the newest sign
        # of progress (a byte of an attempt that ended, the engine's generation counter
        # seen to move: `generated`, its last reading); the quarantine (None: none;
        # choose leaves it out). What lifts a quarantine must have happened after it
        # began, so the watch reads the two kinds apart: `byte_at`, the newest byte of
        # an ended attempt (exact), and `generated_moved`, the span (previous scrape,
        # this scrape) in which the counter moved (the tokens may be from any time in it).
        self.flights: set[Flight] = set()
        self.progress_at: float | None = None
        self.byte_at: float | None = None
        self.generated: float | None = None
        self.generated_moved: tuple[float | None, float] | None = None
        self.quarantine: Quarantine | None = None

    def __repr__(self) -> str:
        e = self.endpoint
        return (
            f"<EndpointState {e.endpoint_id} {e.model} {e.authority} "
            f"{'healthy' if self.healthy else 'unhealthy'} in_flight={self.in_flight} "
            f"running={self.running} waiting={self.waiting} kv={self.kv_usage} "
            f"pending_prefill={self.pending_prefill:g} pending_decode={self.pending_decode:g} "
            f"breaker={self.breaker.state.value} {self.index!r}"
            f"{' quarantined: ' + self.quarantine.reason if self.quarantine else ''}>"
        )

    def ended(self, flight: Flight) -> None:
        """An attempt here has ended: its newest byte is the endpoint's progress, if newer."""
        self.flights.discard(flight)
        seen = flight.last_byte_at()
        if seen is not None and (self.byte_at is None or seen > self.byte_at):
            self.byte_at = seen
        if seen is not None and (self.progress_at is None or seen > self.progress_at):
            self.progress_at = seen

    def close(self) -> None:
        self.pool.close()
        self.scrape_pool.close()


class Scraper:
    def __init__(
        self,
        states: Callable[[], Iterable[EndpointState]],
        *,
        interval_s: float = 1.0,
        timeout_s: float | None = None,
        unhealthy_after: int = 3,
        on_slots: Callable[[EndpointState], None] | None = None,
    ) -> None:
        self._states = states
        self._on_slots = on_slots
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else interval_s
        self.unhealthy_after = unhealthy_after
        self.rounds = 0

    def __repr__(self) -> str:
        return f"<Scraper every {self.interval_s:g} s, {self.rounds} rounds>"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        next_at = trio.current_time()
        while True:
            async with trio.open_nursery() as nursery:
                for state in list(self._states()):
                    nursery.start_soon(self.scrape, state)
            self.rounds += 1
            next_at = max(next_at + self.interval_s, trio.current_time())
            await trio.sleep_until(next_at)

    async def scrape(self, state: EndpointState) -> None:
        """One reading of one endpoint; never raises for the endpoint's faults."""
        e = state.endpoint
        try:
            names = engines.metric_names(e.engine)
        except Exception:
            names = None
        # Our own requests the reading counts (the other workers' we know of too): the more
        # of the two ends, so that a request of ours ending mid-reading is not taken for
        # someone else's.
        own = state.in_flight + state.remote_in_flight
        try:
            with trio.fail_after(self.timeout_s):
                status, body = await state.scrape_pool.get(b"/metrics", self.timeout_s)
                own = max(own, state.in_flight + state.remote_in_flight)
                running = waiting = kv = generated = None
                if status == 200 and names is not None:
                    load = engines.parse_load(body.decode("utf-8", "replace"), names)
                    running, waiting, kv = load.running, load.waiting, load.kv_usage
                    generated = load.generated
                elif status >= 500 and status != 501:
                    raise _Miss(f"GET /metrics answered {status}")
                elif not state.no_metrics_logged:
                    state.no_metrics_logged = True
                    log.warning(
                        "endpoint %s (%s at %s): GET /metrics answered %d; its load is unknown "
                        "(is the engine's metrics flag on?)",
                        e.endpoint_id,
                        e.engine,
                        e.authority,
                        status,
                    )
                if names is not None and names.kv_from_slots:
                    status, body = await state.scrape_pool.get(b"/slots", self.timeout_s)
                    if status == 200:
                        try:
                            slots = json.loads(body)
                        except ValueError:
                            slots = None
                        if (
                            isinstance(slots, list)
                            and slots
                            and state.endpoint.slots is None
                            and state.slots != len(slots)
                        ):
                            state.slots = len(slots)
                            log.info(
                                "endpoint %s (%s at %s) runs %d requests at once (its /slots)",
                                e.endpoint_id,
                                e.engine,
                                e.authority,
                                len(slots),
                            )
                            if self._on_slots is not None:
                                self._on_slots(state)
        except (UpstreamError, trio.TooSlowError, OSError, _Miss) as exc:
            slow = isinstance(exc, trio.TooSlowError)
            if slow and self._answering(state):
                # Busy, not gone: a llama-server answers /metrics from the loop that
                # generates, so a burst delays the reading while its answers flow.
                log.debug("endpoint %s: reading timed out while it answers", e.endpoint_id)
                return
            self._miss(state, f"no answer within {self.timeout_s:g} s" if slow else str(exc))
            return
        now = trio.current_time()
        state.running, state.waiting, state.kv_usage = running, waiting, kv
        if generated is not None:  # its token count moved: it makes progress
            if state.generated is not None and generated > state.generated:
                state.progress_at = now
                state.generated_moved = (state.scraped_at, now)
            state.generated = generated
        state.own_at_scrape = own
        state.scraped_at = now
        state.misses = 0
        state.last_error = None
        if not state.healthy:
            state.healthy = True
            # Unreachable for a while: likely restarted, its prompt cache empty.
            state.index.forget()
            log.info("endpoint %s (%s) answers again: healthy", e.endpoint_id, e.authority)

    def _answering(self, state: EndpointState) -> bool:
        """Bytes came from the endpoint to a request within the span in which the misses
        that make it unhealthy would be counted."""
        seen = [f.last_byte_at() for f in state.flights] + [state.byte_at]
        newest = max((t for t in seen if t is not None), default=None)
        span = self.unhealthy_after * max(self.interval_s, self.timeout_s)
        return newest is not None and trio.current_time() - newest <= span

    def _miss(self, state: EndpointState, reason: str) -> None:
        e = state.endpoint
        state.misses += 1
        state.last_error = reason
        if state.healthy and state.misses >= self.unhealthy_after:
            state.healthy = False
            log.warning(
                "endpoint %s (%s at %s) unhealthy after %d failed readings in a row: %s",
                e.endpoint_id,
                e.model,
                e.authority,
                state.misses,
                reason,
            )
        else:
            log.debug(
                "endpoint %s: reading failed (%d in a row): %s", e.endpoint_id, state.misses, reason
            )


class _Miss(Exception):
    pass
