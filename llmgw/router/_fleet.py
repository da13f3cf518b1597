"""The router's view of the fleet: served models, their endpoints, their queues.

`Fleet` follows the endpoint source (`refresh`: new endpoints, gone ones, moved
ones, each model's concurrency limit), holds each model's admission and the
requests waiting in its queue, and chooses an endpoint for an attempt from
what it knows of their load (llmgw/core/_scoring.py decides; this module
gathers the figures). Reading it never changes it: `statistics()` is a frozen
snapshot (`FleetStatistics`), which the metrics collector and the admin pages
read, so a scrape cannot refresh the view or move a request.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import trio

from llmgw.core import (
    NO_MATCH,
    Admission,
    AdmissionConfig,
    Band,
    Breaker,
    BreakerConfig,
    BreakerState,
    EndpointLoad,
    Estimates,
    Learned,
    Match,
    Outbox,
    PrefixIndex,
    Queued,
    RemotePending,
    RequestEstimate,
    ScoringConfig,
    TrafficSplit,
    decide,
    merge,
)
from llmgw.router._adapters import AdapterRoute, adapters_of
from llmgw.router._config import RouterConfig
from llmgw.router._record import Prompt
from llmgw.router._scraper import EndpointState
from llmgw.router._tenants import share
from llmgw.router._types import Endpoint, EndpointSource, Hold, holds_of

log = logging.getLogger("llmgw.router")

# A worker's untold facts (llmgw/core/_prefix_share.py) are bounded by this many block
# hashes (about 20 bytes each on the wire): 8 chains of 8,192 blocks, 2 MiB of prompts.
SHARE_MAX_BLOCKS = 65536


class Model:
    """One served name: its endpoints, its admission, and what its answers taught
    (`estimates`, llmgw/core/_estimates.py)."""

    __slots__ = ("adapter", "admission", "endpoints", "estimates", "name", "rotation")

    def __init__(self, name: str, admission: Admission) -> None:
        self.name = name
        self.admission = admission
        self.endpoints: tuple[EndpointState, ...] = ()
        self.estimates = Estimates()
        self.rotation = 0
        # A LoRA adapter's route (its base, scale, tenants); None: a model of its own.
        self.adapter: AdapterRoute | None = None

    def __repr__(self) -> str:
        return f"<Model {self.name} {len(self.endpoints)} endpoints {self.estimates!r}>"

    def estimate(self, prompt: Prompt | None) -> RequestEstimate:
        if prompt is None:
            return self.estimates.request(None)
        return self.estimates.request(len(prompt.text), prompt.max_tokens)


class _Waiter:
    __slots__ = ("admitted", "event", "retry_after_s")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.admitted = False
        self.retry_after_s: float | None = None


# --- the snapshot ----------------------------------------------------------------------


@attrs.frozen
class EndpointStatistics:
    endpoint_id: str
    healthy: bool
    in_flight: int
    running: float | None
    waiting: float | None
    kv_usage: float | None
    scraped_at: float | None
    pending_prefill: float
    pending_decode: float
    prefix_blocks: int
    prefix_half_life_s: float
    breaker: BreakerState
    pool: Mapping[str, int]
    quarantined: str | None = None  # why it is quarantined as wedged; None: it is not


@attrs.frozen
class ModelStatistics:
    name: str
    admission: Mapping[str, Any]  # Admission.statistics()
    endpoints: tuple[str, ...]  # endpoint ids, keys of FleetStatistics.endpoints


@attrs.frozen
class FleetStatistics:
    """The fleet view at one moment. Equal snapshots: an unchanged view (`taken_at`,
    the trio clock then or None outside trio, is not compared)."""

    models: Mapping[str, ModelStatistics]  # the models the source lists
    endpoints: Mapping[str, EndpointStatistics]
    waiting: int  # requests waiting in a queue
    stale_after_s: float  # a reading older than this is unknown to the scorer
    taken_at: float | None = attrs.field(default=None, eq=False)
    # Prefix facts shared with the other workers (llmgw/core/_prefix_share.py), ever:
    # "told" (sent), "heard" (theirs applied here), "dropped" (over the outbox's bound).
    # None: this router shares nothing (one worker, or sharing off).
    prefix_shared: Mapping[str, int] | None = None

    def as_json(self) -> dict[str, Any]:
        """The snapshot as JSON (`Router.statistics()`): the breaker state by name."""
        return {
            "models": {
                name: {"admission": dict(m.admission), "endpoints": list(m.endpoints)}
                for name, m in self.models.items()
            },
            "endpoints": {
                eid: {
                    "healthy": e.healthy,
                    "in_flight": e.in_flight,
                    "running": e.running,
                    "waiting": e.waiting,
                    "kv_usage": e.kv_usage,
                    "scraped_at": e.scraped_at,
                    "pending_prefill": e.pending_prefill,
                    "pending_decode": e.pending_decode,
                    "prefix_blocks": e.prefix_blocks,
                    "prefix_half_life_s": e.prefix_half_life_s,
                    "breaker": e.breaker.value,
                    "pool": dict(e.pool),
                    "quarantined": e.quarantined,
                }
                for eid, e in self.endpoints.items()
            },
            "waiting": self.waiting,
            "prefix_shared": None if self.prefix_shared is None else dict(self.prefix_shared),
        }


def _in_trio() -> bool:
    try:
        trio.current_time()
    except RuntimeError:
        return False
    return True


def _moved(old: Endpoint, new: Endpoint) -> bool:
    return (old.host, old.port, old.engine) != (new.host, new.port, new.engine)


class Fleet:
    """The models and endpoints the source lists, kept current; see the module."""

    def __init__(
        self,
        config: RouterConfig,
        source: EndpointSource,
        *,
        worker: int = 0,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.worker = worker
        self._source = source
        self._rng = rng or random.Random()
        self.scoring = ScoringConfig(
            policy=config.policy,  # type: ignore[arg-type]  # checked by RouterConfig
            scrape_interval_s=config.scrape_interval_s,
            stale_after_intervals=config.stale_after_intervals,
            epsilon=config.load_bound_epsilon,
        )
        self._breaker_config = BreakerConfig(
            failure_threshold=config.breaker_failures, open_s=config.breaker_open_s
        )
        self._models: dict[str, Model] = {}  # every name ever listed (their admission stays)
        self._known: dict[str, Model] = {}  # what the source lists now
        self._traffic: dict[str, TrafficSplit] = {}  # split name -> its versions
        self._holds: dict[str, Hold] = {}  # served name -> how it waits at zero replicas
        self._adapters: dict[str, AdapterRoute] = {}  # adapter name -> its route
        self._refreshed = trio.Event()  # set (and replaced) by each `refresh`
        self._states: dict[str, EndpointState] = {}
        # Endpoints that left the source's list with requests still on them: their
        # counts stay readable (`in_flight`) until the last one ends (a drain waits on it).
        self._leaving: dict[str, list[EndpointState]] = {}
        self._seen_version: int | None = None
        self._waiters: dict[str, _Waiter] = {}
        # What this worker's indexes learn, for the other workers (llmgw/core/_prefix_share.py);
        # None: nothing to tell (one worker, sharing off, or no prefix policy).
        self.outbox: Outbox | None = (
            Outbox(SHARE_MAX_BLOCKS)
            if config.workers > 1 and config.prefix_sharing and config.policy == "prefix"
            else None
        )
        self.remote = RemotePending()  # what the others' facts began in these indexes
        self.learned_facts = 0  # the others' facts applied here, ever
        self.refresh()

    def __repr__(self) -> str:
        return (
            f"<Fleet {len(self._known)} models, {len(self._states)} endpoints, "
            f"{len(self._waiters)} waiting>"
        )

    # --- views ---------------------------------------------------------------------------

    def models(self) -> dict[str, Model]:
        """The models the source lists, re-read first when it changed."""
        self.maybe_refresh()
        return self._known

    def listed(self) -> Mapping[str, Model]:
        """The models the source listed when last read (reads only, unlike `models`)."""
        return self._known

    def endpoint_states(self) -> dict[str, EndpointState]:
        return self._states

    def holds(self) -> dict[str, Hold]:
        """How requests for a model with no endpoint wait for one (llmgw/router/_holds.py),
        as the source said when last read."""
        return self._holds

    def adapters(self) -> dict[str, AdapterRoute]:
        """The LoRA adapters the source lists (llmgw/router/_adapters.py), as last read."""
        return self._adapters

    async def refreshed(self) -> None:
        """Wait for the next `refresh` (the view re-read: an endpoint may have come)."""
        await self._refreshed.wait()

    def traffic(self) -> dict[str, TrafficSplit]:
        """The splits the source lists now (llmgw/core/_traffic.py), re-read first when it
        changed."""
        self.maybe_refresh()
        return self._traffic

    def serving(self, names: Iterable[str] | None = None) -> set[str]:
        """The served names (of `names`; None: all) with an endpoint that answers its
        metrics: what a split may draw (a version still loading, or all down, takes none
        of the split's share) and what /v1/models lists."""
        known = self._known
        models = (known[n] for n in names if n in known) if names is not None else known.values()
        return {m.name for m in models if any(s.healthy for s in m.endpoints)}

    def draw(self) -> float:
        """A uniform number in [0, 1) for a split's draw (the fleet's seeded generator)."""
        return self._rng.random()

    def in_flight(self, endpoint_id: str) -> int:
        """Requests being proxied to this endpoint now, whether or not it is still listed.

        Reads the source first, so a caller that has just taken the endpoint out of
        the list and then sees 0 knows nothing is, or will be, sent there.
        """
        self.maybe_refresh()
        listed = self._states.get(endpoint_id)
        gone = self._leaving.get(endpoint_id, ())
        return (listed.in_flight if listed is not None else 0) + sum(s.in_flight for s in gone)

    def quarantined(self) -> dict[str, str]:
        """The listed endpoints quarantined as wedged, and why (llmgw/router/_wedge.py),
        once the reason is whole (their /health asked, within a second)."""
        return {
            eid: s.quarantine.reason
            for eid, s in self._states.items()
            if s.quarantine is not None and s.quarantine.checked
        }

    def statistics(self) -> FleetStatistics:
        """A frozen snapshot; reads only (the source is not re-read)."""
        return FleetStatistics(
            models={
                name: ModelStatistics(
                    name,
                    m.admission.statistics(),
                    tuple(s.endpoint.endpoint_id for s in m.endpoints),
                )
                for name, m in self._known.items()
            },
            endpoints={
                eid: EndpointStatistics(
                    endpoint_id=eid,
                    healthy=s.healthy,
                    in_flight=s.in_flight,
                    running=s.running,
                    waiting=s.waiting,
                    kv_usage=s.kv_usage,
                    scraped_at=s.scraped_at,
                    pending_prefill=s.pending_prefill,
                    pending_decode=s.pending_decode,
                    prefix_blocks=len(s.index),
                    prefix_half_life_s=s.index.half_life_s,
                    breaker=s.breaker.state,
                    pool=s.pool.statistics(),
                    quarantined=s.quarantine.reason if s.quarantine is not None else None,
                )
                for eid, s in self._states.items()
            },
            waiting=len(self._waiters),
            stale_after_s=self.scoring.stale_after_s,
            taken_at=trio.current_time() if _in_trio() else None,
            prefix_shared=None
            if self.outbox is None
            else {
                "told": self.outbox.taken,
                "heard": self.learned_facts,
                "dropped": self.outbox.dropped,
            },
        )

    # --- what the other workers' indexes learned ------------------------------------------

    def learned(self, facts: Iterable[Learned], now: float) -> int:
        """Apply the other workers' facts to the indexes (llmgw/core/_prefix_share.py
        `merge`); how many applied. Their requests never ended are ended after a while."""
        self.remote.expire(now)
        n = merge({eid: s.index for eid, s in self._states.items()}, self.remote, facts, now)
        self.learned_facts += n
        self._remote_counts()
        return n

    def expire_remote(self, now: float) -> None:
        """The other workers' requests not heard to end for too long: taken as ended."""
        if self.remote.expire(now):
            self._remote_counts()

    def _remote_counts(self) -> None:
        for eid, state in self._states.items():
            state.remote_in_flight = self.remote.in_flight(eid)

    # --- following the source ------------------------------------------------------------

    def maybe_refresh(self) -> None:
        if self._source.version != self._seen_version:
            self.refresh()

    def refresh(self) -> None:
        """Re-read the endpoint source: new endpoints, gone ones, concurrency limits."""
        self._seen_version = self._source.version
        snapshot = self._source.snapshot()
        now = trio.current_time() if _in_trio() else 0.0
        config = self.config
        states: dict[str, EndpointState] = {}
        known: dict[str, Model] = {}
        for name, eps in snapshot.items():
            model = self._models.get(name)
            if model is None:
                model = self._models[name] = Model(name, self._new_admission(name))
            model_states = []
            for ep in eps:
                state = self._states.get(ep.endpoint_id) or states.get(ep.endpoint_id)
                if state is None or _moved(state.endpoint, ep):
                    if state is not None:
                        state.close()
                        if state.in_flight > 0:
                            self._leaving.setdefault(ep.endpoint_id, []).append(state)
                    state = EndpointState(
                        ep,
                        Breaker(self._breaker_config, name=ep.endpoint_id),
                        keepalive_s=config.upstream_keepalive_s,
                        index=PrefixIndex(
                            config.prefix_blocks_per_endpoint, config.prefix_half_life_s
                        ),
                    )
                elif state.endpoint != ep:
                    state.endpoint = ep
                    if ep.slots is not None:
                        state.slots = ep.slots
                states[ep.endpoint_id] = state
                model_states.append(state)
            model.endpoints = tuple(model_states)
            known[name] = model
        for eid, state in self._states.items():
            if eid not in states:
                state.close()
                if state.in_flight > 0:
                    self._leaving.setdefault(eid, []).append(state)
        self._leaving = {
            eid: busy
            for eid, gone in self._leaving.items()
            if (busy := [s for s in gone if s.in_flight > 0])
        }
        for name, model in self._models.items():
            if name not in known:
                model.endpoints = ()
            self.wake(model.admission.set_concurrency(self._concurrency(model), now))
        self._states = states
        self._known = known
        self._traffic = dict(self._source.traffic())
        self._holds = dict(holds_of(self._source))
        self._adapters = dict(adapters_of(self._source))
        for name, model in self._models.items():
            model.adapter = self._adapters.get(name)
        log.debug("endpoints now: %s", {n: len(m.endpoints) for n, m in known.items()})
        self._refreshed.set()  # held requests look again (llmgw/router/_holds.py)
        self._refreshed = trio.Event()

    def slots_changed(self, state: EndpointState) -> None:
        """The engine reported how many requests it runs at once: admission follows."""
        now = trio.current_time()
        for model in self._known.values():
            if state in model.endpoints:
                self.wake(model.admission.set_concurrency(self._concurrency(model), now))

    def _concurrency(self, model: Model) -> int:
        if not model.endpoints:
            return 0
        if self.config.concurrency is not None:
            total = self.config.concurrency
        else:
            total = sum(s.slots or self.config.slots_per_endpoint for s in model.endpoints)
        return share(total, self.worker, self.config.workers)

    def _new_admission(self, name: str) -> Admission:
        cfg = AdmissionConfig(
            concurrency=0,
            queue_limit=share(self.config.queue_limit, self.worker, self.config.workers),
            bands=tuple(self.config.bands),
        )
        return Admission(cfg, name=name)

    def close(self) -> None:
        for state in self._states.values():
            state.close()

    # --- the queue -----------------------------------------------------------------------

    async def wait(self, model: Model, req_id: str, band: Band, queued: Queued) -> float | None:
        """Wait in the model's queue until admitted (None) or timed out: then the seconds
        after which to retry."""
        waiter = self._waiters[req_id] = _Waiter()
        try:
            with trio.move_on_at(queued.deadline):
                await waiter.event.wait()
            if not waiter.admitted and waiter.retry_after_s is None:
                for rid, retry_after in model.admission.expire(trio.current_time()):
                    other = self._waiters.pop(rid, None)
                    if other is not None:
                        other.retry_after_s = retry_after
                        other.event.set()
                if waiter.retry_after_s is None and not waiter.admitted:
                    # Not expired by the admission's clock (rounding): the timeout is ours.
                    waiter.retry_after_s = model.admission.retry_after(band.name)
        finally:
            self._waiters.pop(req_id, None)
        if waiter.admitted:
            return None
        return waiter.retry_after_s or 1.0

    def wake(self, admitted: tuple[str, ...]) -> None:
        for rid in admitted:
            waiter = self._waiters.pop(rid, None)
            if waiter is not None:
                waiter.admitted = True
                waiter.event.set()

    # --- choosing an endpoint ------------------------------------------------------------

    def loads(
        self,
        candidates: list[EndpointState],
        model: Model,
        prompt: Prompt | None,
        now: float,
        estimate: RequestEstimate | None = None,
    ) -> tuple[list[EndpointLoad], list[Match]]:
        """The scorer's figures for each candidate, and its prefix index's match.

        The other workers' requests in flight there (`remote_in_flight`, from their
        prefix facts) count as this router's own in the bound's count, and in the cost
        as a request like this one each (what the cost charges a scraped `external`
        one; their pending tokens are theirs to know). They are in `own_at_scrape`
        too, so a later reading does not count them again as external."""
        blocks = prompt.blocks if prompt is not None else ()
        per_block = model.estimates.tokens_per_block(self.config.prefix_block_bytes)
        matches = [s.index.match(blocks, now) if blocks else NO_MATCH for s in candidates]
        like = estimate or model.estimate(prompt)
        loads = [
            EndpointLoad(
                endpoint_id=s.endpoint.endpoint_id,
                healthy=s.healthy,
                allowed=s.breaker.would_allow(now),
                in_flight=s.in_flight + s.remote_in_flight,
                waiting=s.waiting,
                running=s.running,
                kv_usage=s.kv_usage,
                scraped_at=s.scraped_at,
                own_at_scrape=s.own_at_scrape,
                pending_prefill=s.pending_prefill + s.remote_in_flight * like.prompt_tokens,
                pending_decode=s.pending_decode + s.remote_in_flight * like.output_tokens,
                cached_tokens=m.credit * per_block,
            )
            for s, m in zip(candidates, matches, strict=True)
        ]
        return loads, matches

    def choose(
        self,
        model: Model,
        now: float,
        affinity: str | None,
        tried: set[str],
        prompt: Prompt | None = None,
        estimate: RequestEstimate | None = None,
    ) -> tuple[EndpointState, Match, bool] | None:
        """The endpoint, its index's match, and whether the bound spilled it there."""
        candidates = [
            s
            for s in model.endpoints
            if s.endpoint.endpoint_id not in tried and s.quarantine is None  # wedged: out
        ]
        if not candidates:
            return None
        if len(candidates) == 1:
            only = candidates[0]
            if not (only.healthy and only.breaker.would_allow(now)):
                return None
            blocks = prompt.blocks if prompt is not None else ()
            return only, (only.index.match(blocks, now) if blocks else NO_MATCH), False
        estimate = estimate or model.estimate(prompt)
        loads, matches = self.loads(candidates, model, prompt, now, estimate)
        chosen, spilled = decide(
            loads,
            estimate,
            now,
            self._rng,
            self.scoring,
            affinity,
            rotation=model.rotation,
        )
        if chosen is None:
            return None
        model.rotation += 1
        for state, match in zip(candidates, matches, strict=True):
            if state.endpoint.endpoint_id == chosen:
                return state, match, spilled
        return None
