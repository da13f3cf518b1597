"""The attempt loop: send an admitted request to an endpoint, retry elsewhere, relay.

Each attempt chooses an endpoint not yet tried (`Fleet.choose`), takes its
share of that endpoint's load (`Sent`), sends the request and passes the
answer on: status, headers and body chunks as they arrive. What each phase's
outcome tells the endpoint's breaker, and whether another endpoint is tried,
is the pure table in llmgw/core/_attempt.py (`ATTEMPT_VERDICTS`); this module
does the I/O and follows it. A retry happens only while nothing has reached
the client. An answer the engine reported figures for teaches the endpoint's
prefix index and the model's estimates (`learn`).

Each attempt is a `Flight` in its endpoint's state (llmgw/router/_flight.py),
which the wedge watch reads (llmgw/router/_wedge.py); its waits on the engine
with nothing sent to the client (the head, a whole answer's body) may be
cancelled by the watch when the endpoint is quarantined, and the attempt is
then retried elsewhere like a failed head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from llmgw.core import (
    ATTEMPT_VERDICTS,
    AttemptOutcome,
    AttemptPhase,
    Breaker,
    BreakerEvent,
    Match,
    head_outcome,
    learn,
    learn_pace,
)
from llmgw.router import _surface
from llmgw.router._fleet import Fleet, Model
from llmgw.router._flight import Flight
from llmgw.router._metrics import RouterMetrics
from llmgw.router._record import Ask, Record
from llmgw.router._scraper import EndpointState
from llmgw.router._surface import HttpError
from llmgw.router._upstream import (
    ConnectFailed,
    Response,
    Timeouts,
    UpstreamError,
    UpstreamTimeout,
)
from llmgw.web.asgi import Send

log = logging.getLogger("llmgw.router")

# Response headers that describe one hop's connection, not the message.
_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"date",
        b"server",
    }
)

_TELL: dict[BreakerEvent, Callable[[Breaker, float], None]] = {
    BreakerEvent.SUCCESS: Breaker.success,
    BreakerEvent.FAILURE: Breaker.failure,
    BreakerEvent.CANCEL: Breaker.cancel,
    BreakerEvent.BROKEN: Breaker.broken,
    BreakerEvent.COMPLETE: Breaker.complete,
}

_HEAD, _WHOLE, _STREAM = AttemptPhase.HEAD, AttemptPhase.WHOLE_BODY, AttemptPhase.STREAM
_FAILED, _SUCCEEDED = AttemptOutcome.FAILED, AttemptOutcome.SUCCEEDED


def _tell(breaker: Breaker, phase: AttemptPhase, outcome: AttemptOutcome) -> bool:
    """Tell the breaker what the table says for this outcome; whether to retry."""
    verdict = ATTEMPT_VERDICTS[phase, outcome]
    if verdict.breaker is not None:
        _TELL[verdict.breaker](breaker, trio.current_time())
    return verdict.retry


class Sent:
    """One attempt's share of an endpoint's own load and of its index's in-flight
    prefills, each taken back exactly once."""

    __slots__ = ("blocks", "decode", "flight", "guessed_tokens", "match", "prefill", "state")

    def __init__(
        self,
        state: EndpointState,
        prefill: float,
        decode: float,
        match: Match,
        guessed: float,
        blocks: tuple[int, ...],
        now: float,
        expected_first_byte_s: float | None = None,
    ) -> None:
        self.state = state
        self.prefill = prefill
        self.decode = decode
        self.match = match
        self.guessed_tokens = guessed
        self.blocks: tuple[int, ...] | None = blocks  # None once ended
        state.in_flight += 1
        self.flight = Flight(now, expected_first_byte_s)
        state.flights.add(self.flight)
        state.pending_prefill += prefill
        state.pending_decode += decode
        if blocks:
            state.index.record(blocks, now)  # predict-on-route: siblings follow
            state.index.begin(blocks)

    def answering(self) -> None:
        """The answer has begun: the prompt is processed, and the engine holds it."""
        if self.prefill < 0:
            return
        self.state.pending_prefill = max(0.0, self.state.pending_prefill - self.prefill)
        self.prefill = -1.0  # taken back
        if self.blocks:
            self.state.index.computed(self.blocks, trio.current_time())

    def done(self) -> None:
        if self.prefill >= 0:  # ended before its answer began
            self.state.pending_prefill = max(0.0, self.state.pending_prefill - self.prefill)
            self.prefill = -1.0
        if self.blocks:
            self.state.index.end(self.blocks)
        self.blocks = None
        self.state.pending_decode = max(0.0, self.state.pending_decode - self.decode)
        self.decode = 0.0
        self.state.in_flight -= 1
        self.state.ended(self.flight)


def _upstream_error(model: str, exc: UpstreamError) -> HttpError:
    if isinstance(exc, ConnectFailed):
        return _surface.upstream_error(model, "connect", exc)
    if isinstance(exc, UpstreamTimeout):
        return _surface.upstream_error(model, "timeout", exc)
    return _surface.upstream_error(model, "failed", exc)


class Attempts:
    """The attempt loop, for every request of one router."""

    def __init__(
        self, fleet: Fleet, metrics: RouterMetrics, *, retries: int, timeouts: Timeouts
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._retries = retries
        self._timeouts = timeouts
        self._block_bytes = fleet.config.prefix_block_bytes

    def __repr__(self) -> str:
        return f"<Attempts retries={self._retries}>"

    async def run(self, model: Model, ask: Ask, send: Send, record: Record) -> None:
        """Answer the admitted request; raises the HttpError to answer when no attempt did."""
        tried: set[str] = set()
        last: HttpError | None = None
        start = trio.current_time()
        prompt = ask.prompt
        fleet, metrics = self._fleet, self._metrics
        for attempt in range(self._retries + 1):
            now = trio.current_time()
            estimate = model.estimate(prompt)
            picked = fleet.choose(model, now, ask.affinity, tried, prompt, estimate)
            if picked is None:
                break
            state, match, spilled = picked
            if attempt:
                metrics.retried(model.name)
            eid = state.endpoint.endpoint_id
            tried.add(eid)
            breaker = state.breaker
            if not breaker.allow(now):
                continue  # lost the half-open probe to another request since choosing
            final = attempt == self._retries
            per_block = model.estimates.tokens_per_block(self._block_bytes)
            cached = min(estimate.prompt_tokens, match.credit * per_block)
            sent = Sent(
                state,
                estimate.prompt_tokens - cached,
                estimate.output_tokens,
                match,
                match.blocks * per_block,
                # A spill is not the prompt's new home: recorded there, one overflow
                # would move it (and every engine would end up holding every prompt).
                prompt.blocks if prompt is not None and not spilled else (),
                now,
                model.estimates.first_byte_s(
                    estimate.prompt_tokens - cached, estimate.output_tokens, not ask.stream
                ),
            )
            told = False  # whether the breaker has had the head's verdict
            try:
                try:
                    with sent.flight.cancellable() as waiting:
                        resp = await state.pool.request(
                            b"POST",
                            ask.path.encode(),
                            ask.body,
                            headers=((b"content-type", ask.content_type),),
                            timeouts=self._timeouts,
                        )
                except UpstreamError as exc:
                    _tell(breaker, _HEAD, _FAILED)  # a retry, whatever reached us
                    told = True
                    last = self._failed(model.name, eid, exc)
                    continue
                if waiting.cancelled_caught:  # quarantined as wedged: a failed head
                    _tell(breaker, _HEAD, _FAILED)
                    told = True
                    last = self._wedged(model.name, state)
                    continue
                sent.flight.response = resp
                try:
                    outcome = head_outcome(resp.status)
                    retry = _tell(breaker, _HEAD, outcome)
                    told = True
                    if outcome is _FAILED:
                        metrics.upstream_failure(model.name, eid, "status")
                    if retry:
                        # An answer in hand is dropped only for another endpoint to try.
                        again = fleet.choose(
                            model, trio.current_time(), ask.affinity, tried, prompt
                        )
                        if not final and again is not None:
                            log.info("%s answered %d; trying another endpoint", eid, resp.status)
                            resp.close()
                            continue
                    failed, report = await self._relay(resp, ask, send, record, start, sent)
                finally:
                    resp.close()
                if failed is None:
                    if report is not None:
                        self._learned(model, ask, sent, report)
                    if not ask.stream:  # the pace of whole answers (the wedge watch's)
                        took = trio.current_time() - sent.flight.started_at
                        model.estimates = learn_pace(
                            model.estimates, took, record.completion_tokens
                        )
                    return
                last = failed  # a whole answer broke before any of it was sent: try another
            finally:
                sent.done()
                if not told:
                    _tell(breaker, _HEAD, AttemptOutcome.CANCELLED)
        if last is not None:
            raise last
        raise _surface.no_replica(model.name, reachable=bool(model.endpoints))

    def _learned(self, model: Model, ask: Ask, sent: Sent, report: _surface.CacheReport) -> None:
        """The engine's word on the answer: it corrects the index and the estimates."""
        if report.cached_tokens is not None:
            index = sent.state.index
            outcome = index.observe(sent.match, sent.guessed_tokens, report.cached_tokens)
            self._metrics.prompt_cache(
                model.name, sent.state.endpoint.endpoint_id, report.cached_tokens, outcome
            )
        prompt = ask.prompt
        model.estimates = learn(
            model.estimates, None if prompt is None else len(prompt.text), report
        )

    def _wedged(self, model: str, state: EndpointState) -> HttpError:
        eid = state.endpoint.endpoint_id
        self._metrics.upstream_failure(model, eid, "wedged")
        q = state.quarantine
        why = q.reason if q is not None else "wedged"
        log.info("request to %s cancelled, its endpoint quarantined (%s)", eid, why)
        return _surface.upstream_error(model, "timeout", f"{eid} quarantined: {why}")

    def _failed(self, model: str, eid: str, exc: UpstreamError) -> HttpError:
        self._metrics.upstream_failure(model, eid, exc.phase)
        log.info("request to %s failed (%s): %s", eid, exc.phase, exc)
        return _upstream_error(model, exc)

    async def _relay(
        self,
        resp: Response,
        ask: Ask,
        send: Send,
        record: Record,
        start: float,
        sent: Sent,
    ) -> tuple[HttpError | None, _surface.CacheReport | None]:
        """Pass the answer on. Returns the error to retry with when it broke before any
        byte was sent, and the engine's report on the answer, when it gave one.

        How the body went is the breaker's too (`broken` or `complete`), counted
        apart from the head's verdict: an engine that answers and then hangs.
        """
        state = sent.state
        breaker = state.breaker
        model = record.model
        metrics = self._metrics
        report: _surface.CacheReport | None = None
        headers = [(k, v) for k, v in resp.headers if k not in _HOP_HEADERS]
        record.status = resp.status
        if not ask.stream or resp.header(b"content-length") is not None:
            # A whole answer (the engine has finished before sending its head): one write.
            try:
                with sent.flight.cancellable() as waiting:
                    data = await resp.read()
            except UpstreamError as exc:
                _tell(breaker, _WHOLE, _FAILED)  # a retry: nothing has reached the client
                return self._failed(model, state.endpoint.endpoint_id, exc), None
            if waiting.cancelled_caught:  # quarantined as wedged: nothing sent, a retry
                _tell(breaker, _WHOLE, _FAILED)
                return self._wedged(model, state), None
            _tell(breaker, _WHOLE, _SUCCEEDED)
            sent.answering()
            if resp.status == 200:
                report = _surface.cache_report(data)
                if report is not None:
                    metrics.tokens(model, report.prompt_tokens, report.completion_tokens)
                    record.prompt_tokens = report.prompt_tokens
                    record.completion_tokens = report.completion_tokens
            record.responded = True
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            record.complete = True
            await send({"type": "http.response.body", "body": data})
            return None, report
        record.responded = True
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        first = True
        tally = _surface.StreamUsage()
        strip = _surface.UsageStrip() if ask.strip_usage else None
        while True:
            try:
                chunk = await resp.next_chunk()
            except UpstreamError as exc:
                # Too late to retry or to change the status (the table: no retry here):
                # tell an SSE client in its own terms, then cut the connection so no
                # client takes it for complete.
                record.status = 502 if not isinstance(exc, UpstreamTimeout) else 504
                _tell(breaker, _STREAM, _FAILED)
                metrics.upstream_failure(model, state.endpoint.endpoint_id, exc.phase)
                log.warning("%s: stream broken mid-response: %s", model, exc)
                event = _surface.broken_stream(
                    record.errors, exc, status=record.status, code=exc.phase
                )
                await send({"type": "http.response.body", "body": event, "more_body": True})
                return None, report  # returning mid-body makes the server close the connection
            if chunk is None:
                break
            if first:
                first = False
                record.ttft = trio.current_time() - start
                sent.answering()
            seen = chunk
            if strip is not None:  # whole events only; the usage-only one taken out
                chunk, removed = strip.feed(chunk)
                seen = chunk + removed if removed else chunk
            if b'"usage"' in seen:
                prompt, completion = tally.add(seen)
                metrics.tokens(model, prompt, completion)
                record.prompt_tokens = tally.prompt
                record.completion_tokens = tally.completion
                report = _surface.cache_report(seen) or report
            elif b'"timings"' in seen:
                report = _surface.cache_report(seen) or report
            if resp.done:
                _tell(breaker, _STREAM, _SUCCEEDED)
                record.complete = True
                if strip is not None:
                    chunk += strip.end()
                await send({"type": "http.response.body", "body": chunk})
                return None, report
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        _tell(breaker, _STREAM, _SUCCEEDED)
        record.complete = True
        rest = strip.end() if strip is not None else b""
        await send({"type": "http.response.body", "body": rest})
        return None, report
