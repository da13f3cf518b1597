"""The attempt loop: send an admitted request to an endpoint, retry elsewhere, relay.

Each attempt chooses an endpoint not yet tried (`Fleet.choose`), takes its
share of that endpoint's load (`Sent`), sends the request and passes the
answer on: status, headers and body chunks as they arrive. What each phase's
outcome tells the endpoint's breaker, and whether another endpoint is tried,
is the pure table in llmgw/core/_attempt.py (`ATTEMPT_VERDICTS`); this module
does the I/O and follows it. A retry happens only while nothing has reached
the client; after that, a stream the request allows it for is continued on
another endpoint instead (`Join`, llmgw/router/_continue.py). An answer the
engine reported figures for teaches the endpoint's prefix index and the
model's estimates (`learn`).

Each attempt is a `Flight` in its endpoint's state (llmgw/router/_flight.py),
which the wedge watch reads (llmgw/router/_wedge.py); its waits on the engine
with nothing sent to the client (the head, a whole answer's body) may be
cancelled by the watch when the endpoint is quarantined, and the attempt is
then retried elsewhere like a failed head.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from llmgw.core import (
    ATTEMPT_VERDICTS,
    CONTINUATION_REFUSALS,
    AttemptOutcome,
    AttemptPhase,
    Breaker,
    BreakerEvent,
    ContinuationRefusal,
    Match,
    Outbox,
    head_outcome,
    learn,
    learn_pace,
    stream_metering,
)
from llmgw.router import _surface, _tokens
from llmgw.router._adapters import engine_body
from llmgw.router._continue import Join
from llmgw.router._fleet import Fleet, Model
from llmgw.router._flight import Flight
from llmgw.router._load import LoadCounters, ModelCounts
from llmgw.router._metering import UsageStrip
from llmgw.router._metrics import RouterMetrics
from llmgw.router._record import Ask, Record
from llmgw.router._scraper import EndpointState
from llmgw.router._surface import HttpError
from llmgw.router._types import Endpoint
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

    __slots__ = (
        "blocks",
        "counts",
        "decode",
        "flight",
        "guessed_tokens",
        "match",
        "outbox",
        "prefill",
        "state",
        "told",
    )

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
        outbox: Outbox | None = None,
        counts: ModelCounts | None = None,
    ) -> None:
        """`outbox`: where the other router workers learn what this index records;
        `counts`: the model's load signals (its uncached tokens, llmgw/router/_load.py)."""
        self.state = state
        self.outbox = outbox
        self.counts = counts
        self.prefill = prefill
        self.decode = decode
        self.match = match
        self.guessed_tokens = guessed
        self.blocks: tuple[int, ...] | None = blocks  # None once ended
        state.in_flight += 1
        self.flight = Flight(now, expected_first_byte_s)
        state.flights.add(self.flight)
        state.pending_prefill += prefill
        if counts is not None:
            counts.uncached += prefill
        state.pending_decode += decode
        if blocks:
            state.index.record(blocks, now)  # predict-on-route: siblings follow
            state.index.begin(blocks)
        # The other workers hear of every attempt: its chain where the index records
        # one, its load where not (a spill, no prompt); `done` tells its end.
        self.told: tuple[int, ...] | None = blocks if outbox is not None else None
        if outbox is not None:
            outbox.sent(state.endpoint.endpoint_id, blocks)

    def answering(self) -> None:
        """The answer has begun: the prompt is processed, and the engine holds it."""
        if self.prefill < 0:
            return
        self._prefilled()
        if self.blocks:
            self.state.index.computed(self.blocks, trio.current_time())

    def done(self) -> None:
        if self.prefill >= 0:  # ended before its answer began
            self._prefilled()
        if self.blocks:
            self.state.index.end(self.blocks)
        self.blocks = None
        if self.outbox is not None and self.told is not None:
            self.outbox.ended(self.state.endpoint.endpoint_id, self.told)
            self.told = None
        self.state.pending_decode = max(0.0, self.state.pending_decode - self.decode)
        self.decode = 0.0
        self.state.in_flight -= 1
        self.state.ended(self.flight)

    def _prefilled(self) -> None:
        """The prompt is no longer the engine's to compute: its estimate taken back."""
        self.state.pending_prefill = max(0.0, self.state.pending_prefill - self.prefill)
        if self.counts is not None:
            self.counts.uncached = max(0.0, self.counts.uncached - self.prefill)
        self.prefill = -1.0  # taken back


def _route_refusal(ask: Ask) -> ContinuationRefusal:
    """Why a stream with no `Join` is not continued."""
    plan = ask.resume
    return plan.refusal if plan is not None and plan.refusal is not None else _NOT_RESUMABLE


_NOT_RESUMABLE = ContinuationRefusal.ROUTE


def _upstream_error(model: str, exc: UpstreamError) -> HttpError:
    if isinstance(exc, ConnectFailed):
        return _surface.upstream_error(model, "connect", exc)
    if isinstance(exc, UpstreamTimeout):
        return _surface.upstream_error(model, "timeout", exc)
    return _surface.upstream_error(model, "failed", exc)


def _for_engine(endpoint: Endpoint, body: bytes, model: Model, ask: Ask) -> bytes:
    """The body in the engine's form for LoRA adapters (llmgw/router/_adapters.py)."""
    route = model.adapter
    if ask.content_type != _surface.JSON_CONTENT_TYPE or endpoint.engine == "vllm":
        return body
    if not endpoint.adapters and route is None:
        return body
    if route is None:
        return engine_body(endpoint, body, None, 1.0)
    return engine_body(endpoint, body, model.name, route.scale)


class Attempts:
    """The attempt loop, for every request of one router."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: RouterMetrics,
        *,
        retries: int,
        timeouts: Timeouts,
        load: LoadCounters | None = None,
    ) -> None:
        """`load`: where first bytes, no-replica refusals and uncached tokens count
        (llmgw/router/_load.py)."""
        self._fleet = fleet
        self._metrics = metrics
        self._load = load or LoadCounters()
        self._retries = retries
        self._timeouts = timeouts
        self._block_bytes = fleet.config.prefix_block_bytes

    def __repr__(self) -> str:
        return f"<Attempts retries={self._retries}>"

    async def run(self, model: Model, ask: Ask, send: Send, record: Record) -> None:
        """Answer the admitted request; raises the HttpError to answer when no attempt did."""
        tried: set[str] = set()
        last: HttpError | None = None
        join: Join | None = None  # a stream cut after its head went out, being continued
        # Why the last endpoint tried did not continue it: (metric reason, words).
        refused: tuple[str, str] | None = None
        body = ask.body
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
            if attempt and join is None:
                metrics.retried(model.name)
            eid = state.endpoint.endpoint_id
            tried.add(eid)
            engine = state.endpoint.engine
            strip: UsageStrip | None = None
            if join is not None:
                asked = join.body(engine)
                if not isinstance(asked, bytes):  # this engine cannot continue it; another may
                    refused = (asked.value, CONTINUATION_REFUSALS[asked])
                    continue
                body = asked
                if ask.usage_body is not None:  # the continuation asks (llmgw/router/_router.py)
                    strip = UsageStrip(nulls=stream_metering(engine, ask.path).nulls)
            elif ask.usage_body is not None:
                metering = stream_metering(engine, ask.path)
                if metering.ask:  # an engine that says its tokens only when asked
                    body, strip = ask.usage_body, UsageStrip(nulls=metering.nulls)
                else:  # the stream as the client asked for it, read as it passes
                    body = ask.body
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
                fleet.outbox,
                self._load.of(model.name),
            )
            self._load.of(model.name).last_used = time.time()  # LRU of adapters
            told = False  # whether the breaker has had the head's verdict
            try:
                try:
                    with sent.flight.cancellable() as waiting:
                        resp = await state.pool.request(
                            b"POST",
                            ask.path.encode(),
                            _for_engine(state.endpoint, body, model, ask),
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
                    if join is not None and (
                        resp.status != 200 or resp.header(b"content-length") is not None
                    ):
                        # Its own answer (a 4xx, a whole body) cannot join a stream begun.
                        log.info("%s did not stream a continuation: %d", eid, resp.status)
                        refused = ("status", f"{eid} answered {resp.status}")
                        continue
                    failed, report, cut = await self._relay(
                        resp, ask, send, record, start, sent, join, strip
                    )
                finally:
                    resp.close()
                if cut is not None:
                    join, refused = cut, None  # continued on the next endpoint chosen
                    continue
                if failed is None:
                    if join is not None:
                        metrics.stream_cut(model.name, record.errors, None)
                    elif report is not None:  # (a continuation's report is on another prompt)
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
        if join is not None:
            # The head is out: the client learns in its stream that no endpoint finished.
            why = "no other endpoint could continue it" + (f": {refused[1]}" if refused else "")
            reason = refused[0] if refused else "no_replica"
            await self._cut(model.name, record, send, why, code=join.broke, reason=reason)
            return
        if last is not None:
            raise last
        self._load.rejected(model.name)
        raise _surface.no_replica(model.name, reachable=bool(model.endpoints))

    async def _cut(
        self, model: str, record: Record, send: Send, detail: object, *, code: str, reason: str
    ) -> None:
        """End a stream that broke and is not continued: the final error event in the
        route's shape, counted; returning mid-body makes the server cut the connection,
        so no client takes the stream for complete."""
        self._metrics.stream_cut(model, record.errors, reason)
        event = _surface.broken_stream(record.errors, detail, status=record.status, code=code)
        await send({"type": "http.response.body", "body": event, "more_body": True})

    def _learned(self, model: Model, ask: Ask, sent: Sent, report: _tokens.CacheReport) -> None:
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
        join: Join | None = None,
        strip: UsageStrip | None = None,
    ) -> tuple[HttpError | None, _tokens.CacheReport | None, Join | None]:
        """Pass the answer on. Returns the error to retry with when it broke before any
        byte was sent, the engine's report on the answer, when it gave one, and the
        `Join` to continue with when a stream broke and may be continued elsewhere.

        With `join`, this answer continues a stream already begun: the head is not
        sent again, and the chunks are spliced into the client's stream. With
        `strip`, the usage event was asked for on the client's behalf: what asking
        added is taken out (llmgw/router/_metering.py). Without, the engine's bytes
        pass as they came, read for `usage` or llama-server's `timings`.

        How the body went is the breaker's too (`broken` or `complete`), counted
        apart from the head's verdict: an engine that answers and then hangs.
        """
        state = sent.state
        breaker = state.breaker
        model = record.model
        metrics = self._metrics
        report: _tokens.CacheReport | None = None
        headers = [(k, v) for k, v in resp.headers if k not in _HOP_HEADERS]
        record.status = resp.status
        if not ask.stream or resp.header(b"content-length") is not None:
            # A whole answer (the engine has finished before sending its head): one write.
            try:
                with sent.flight.cancellable() as waiting:
                    data = await resp.read()
            except UpstreamError as exc:
                _tell(breaker, _WHOLE, _FAILED)  # a retry: nothing has reached the client
                return self._failed(model, state.endpoint.endpoint_id, exc), None, None
            if waiting.cancelled_caught:  # quarantined as wedged: nothing sent, a retry
                _tell(breaker, _WHOLE, _FAILED)
                return self._wedged(model, state), None, None
            _tell(breaker, _WHOLE, _SUCCEEDED)
            sent.answering()
            if resp.status == 200:
                report = _tokens.cache_report(data)
                if report is not None:
                    metrics.tokens(model, report.prompt_tokens, report.completion_tokens)
                    record.prompt_tokens = report.prompt_tokens
                    record.completion_tokens = report.completion_tokens
            record.responded = True
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            record.complete = True
            await send({"type": "http.response.body", "body": data})
            return None, report, None
        if join is None:
            record.responded = True
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            plan = ask.resume
            if plan is not None and plan.refusal is None:
                join = Join(plan)  # watched from the first byte, in case it is cut
        else:
            join.begin()
        first = True
        tally = join.tally if join is not None else _tokens.StreamUsage()
        while True:
            try:
                chunk = await resp.next_chunk()
            except UpstreamError as exc:
                # Too late to retry or to change the status (the table: no retry here).
                # Continued elsewhere where the request allows it; otherwise the client
                # is told in its own terms and the connection cut.
                record.status = 502 if not isinstance(exc, UpstreamTimeout) else 504
                resume = ATTEMPT_VERDICTS[_STREAM, _FAILED].resume
                _tell(breaker, _STREAM, _FAILED)
                metrics.upstream_failure(model, state.endpoint.endpoint_id, exc.phase)
                log.warning("%s: stream broken mid-response: %s", model, exc)
                refusal = join.refusal() if join is not None else _route_refusal(ask)
                if resume and join is not None and refusal is None:
                    log.info("%s: continuing the stream after %d tokens", model, join.tokens)
                    join.broke = exc.phase
                    return None, report, join
                await self._cut(
                    model,
                    record,
                    send,
                    exc,
                    code=exc.phase,
                    reason=refusal.value if refusal is not None else "no_replica",
                )
                return None, report, None
            if chunk is None:
                break
            if first:
                first = False
                if record.ttft is None:  # a continued stream's first chunk is not the answer's
                    now = trio.current_time()
                    record.ttft = now - start
                    if record.arrived is not None:
                        self._load.first_byte(model, now - record.arrived)
                sent.answering()
            if join is not None:
                chunk = join.feed(chunk)  # whole events, a continued one made the first's
            seen = chunk
            if strip is not None:  # whole events only; what asking added taken out
                chunk, removed = strip.feed(chunk)
                seen = chunk + removed if removed else chunk
            if b'"usage"' in seen or b'"timings"' in seen:
                prompt, completion = tally.add(seen)
                metrics.tokens(model, prompt, completion)
                record.prompt_tokens = tally.prompt
                record.completion_tokens = tally.completion
                report = _tokens.cache_report(seen) or report
            if resp.done:
                _tell(breaker, _STREAM, _SUCCEEDED)
                record.complete = True
                if join is not None:
                    chunk += join.rest()
                if strip is not None:
                    chunk += strip.end()
                await send({"type": "http.response.body", "body": chunk})
                return None, report, None
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        _tell(breaker, _STREAM, _SUCCEEDED)
        record.complete = True
        rest = join.rest() if join is not None else b""
        if strip is not None:
            rest = (strip.feed(rest)[0] if rest else b"") + strip.end()
        await send({"type": "http.response.body", "body": rest})
        return None, report, None
