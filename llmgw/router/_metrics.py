"""The router's Prometheus metrics.

Counters and histograms are updated per request through cached children (a
`labels()` call per update would cost more than the rest of the bookkeeping).
Gauges of state (queue depth, in-flight counts, breaker states, the scoring
inputs) are read from the fleet's frozen snapshot (`Fleet.statistics()`, through
the `FleetView` Protocol) when Prometheus scrapes, so a request pays nothing for
them and a scrape changes nothing: it neither re-reads the endpoint source nor
moves a request. A figure that is unknown (an engine that does not report it,
or a reading older than the scorer believes) is left out, never exported as 0.

Names: `llmgw_router_` prefix, base units (seconds, ratios), `_total` counters.
The `model` label is only ever a served name the router knows (or empty), so a
client cannot grow the label set by asking for made-up models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.core import BreakerState
from llmgw.router._budget_metrics import BudgetCollector, BudgetView

if TYPE_CHECKING:
    from llmgw.router._fleet import FleetStatistics
    from llmgw.router._record import Record


class FleetView(Protocol):
    """What the gauges read at scrape time: a frozen snapshot (reading changes nothing)."""

    def statistics(self) -> FleetStatistics: ...


LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        fleet: FleetView,
        budgets: BudgetView | None = None,
        *,
        held: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """`budgets`: the router's tenant budgets (their gauges and counters); `held`:
        the requests held at zero replicas by model (llmgw/router/_holds.py), read at
        scrape time."""
        self.registry = registry
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered, by served model, HTTP status and priority band "
            "(499: the client left first)",
            ["model", "status", "band"],
            registry=registry,
        )
        self.duration = Histogram(
            "llmgw_router_request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "llmgw_router_time_to_first_token_seconds",
            "Streamed requests: time from leaving the queue to the first body chunk",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.cached_tokens = Counter(
            "llmgw_router_prompt_cached_tokens",
            "Prompt tokens the engine reported it served from its prefix cache "
            "(only where it reports them)",
            ["model"],
            registry=registry,
        )
        self.guesses = Counter(
            "llmgw_router_prefix_guesses",
            "The prefix index's guesses checked against the engine's report: hit (the "
            "engine had at least half of what was guessed), miss, none (nothing guessed)",
            ["model", "endpoint", "outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "llmgw_router_prompt_tokens",
            "Prompt tokens, where the engine reported usage",
            ["model"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "llmgw_router_completion_tokens",
            "Generated tokens, where the engine reported usage",
            ["model"],
            registry=registry,
        )
        self.wait = Histogram(
            "llmgw_router_queue_wait_seconds",
            "Time requests spent in the admission queue (0 when admitted at once)",
            ["model", "band"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.refusals = Counter(
            "llmgw_router_admission_refused",
            "Requests refused by admission (429): queue_full or queue_timeout",
            ["model", "band", "reason"],
            registry=registry,
        )
        self.retries = Counter(
            "llmgw_router_retries",
            "Requests sent again to another endpoint before anything reached the client",
            ["model"],
            registry=registry,
        )
        self.failures = Counter(
            "llmgw_router_upstream_failures",
            "Failed attempts at an endpoint, by phase: connect; protocol (not HTTP, or closed "
            "before the head); first_byte (no head in time); status (a 5xx answer); idle "
            "(nothing for idle_timeout_s after the head); mid_body (cut or not HTTP after it)",
            ["model", "endpoint", "phase"],
            registry=registry,
        )
        self.traffic = Counter(
            "llmgw_router_traffic_requests",
            "Requests for a traffic split's name, by the version (catalog model) that got "
            "them and how: split (drawn by weight), header (X-LLMGW-Version), key (the key's pin)",
            ["split", "version", "how"],
            registry=registry,
        )
        self.stream_cuts = Counter(
            "llmgw_router_stream_cuts",
            "Streams whose engine broke after their head reached the client, by the "
            "route's API (openai, anthropic): continued (another endpoint finished the "
            "answer) or error (the client got the final error event; reason: why it was "
            "not continued)",
            ["model", "api", "outcome", "reason"],
            registry=registry,
        )
        self.quarantines = Counter(
            "llmgw_router_quarantines",
            "Endpoints quarantined as wedged: requests in flight and no byte for "
            "wedge_after_s while another endpoint of the model made progress",
            ["model", "endpoint"],
            registry=registry,
        )
        self.tenant_requests = Counter(
            "llmgw_tenant_requests",
            "Inference requests its limits let through, by tenant, however they ended",
            ["tenant"],
            registry=registry,
        )
        self.tenant_tokens = Counter(
            "llmgw_tenant_tokens",
            "Tokens the engines reported for the tenant's answers: prompt or completion",
            ["tenant", "kind"],
            registry=registry,
        )
        self.tenant_refusals = Counter(
            "llmgw_tenant_refused",
            "Requests refused by their tenant's limits: rpm or tpm (429), band (403)",
            ["tenant", "reason"],
            registry=registry,
        )
        self.hold_refusals = Counter(
            "llmgw_router_hold_refused",
            "Requests for a model at zero replicas that its hold answered 503: full (hold_max "
            "already held) or timeout (held hold_s with no replica ready)",
            ["model", "reason"],
            registry=registry,
        )
        self.adapter_requests = Counter(
            "llmgw_router_adapter_requests",
            "Requests for a LoRA adapter by whether a replica held it when they came (yes) "
            "or they waited for a load (no)",
            ["model", "loaded"],
            registry=registry,
        )
        registry.register(_StateCollector(fleet))
        if held is not None:
            registry.register(_HeldCollector(held))
        if budgets is not None:
            registry.register(BudgetCollector(budgets))
        self._tenant: dict[str, tuple[Any, Any, Any]] = {}
        self._req: dict[tuple[str, int, str], Any] = {}
        self._dur: dict[str, Any] = {}
        self._ttft: dict[str, Any] = {}
        self._wait: dict[tuple[str, str], Any] = {}

    def finished(self, record: Record, seconds: float) -> None:
        """A request has ended: its record, read once."""
        model = record.model
        key = (model, record.status, record.band)
        child = self._req.get(key)
        if child is None:
            child = self._req[key] = self.requests.labels(model, str(record.status), record.band)
        child.inc()
        if not model:
            return
        dur = self._dur.get(model)
        if dur is None:
            dur = self._dur[model] = self.duration.labels(model)
        dur.observe(seconds)
        if record.ttft is not None:
            ttft = self._ttft.get(model)
            if ttft is None:
                ttft = self._ttft[model] = self.ttft.labels(model)
            ttft.observe(record.ttft)

    def queue_wait(self, model: str, band: str, seconds: float) -> None:
        key = (model, band)
        child = self._wait.get(key)
        if child is None:
            child = self._wait[key] = self.wait.labels(model, band)
        child.observe(max(0.0, seconds))

    def refused(self, model: str, band: str, reason: str) -> None:
        self.refusals.labels(model, band, reason).inc()

    def adapter_request(self, model: str, loaded: bool) -> None:
        self.adapter_requests.labels(model, "yes" if loaded else "no").inc()

    def hold_refused(self, model: str, reason: str) -> None:
        self.hold_refusals.labels(model, reason).inc()

    def traffic_routed(self, split: str, version: str, how: str) -> None:
        """A request for `split` goes to `version` (names from server.yaml only)."""
        self.traffic.labels(split, version, how).inc()

    def retried(self, model: str) -> None:
        self.retries.labels(model).inc()

    def quarantined(self, model: str, endpoint: str) -> None:
        self.quarantines.labels(model, endpoint).inc()

    def upstream_failure(self, model: str, endpoint: str, phase: str) -> None:
        self.failures.labels(model, endpoint, phase).inc()

    def stream_cut(self, model: str, api: str, reason: str | None) -> None:
        """A stream broke after its head was sent: continued (`reason` None) or not."""
        outcome = "continued" if reason is None else "error"
        self.stream_cuts.labels(model, api, outcome, reason or "").inc()

    def prompt_cache(self, model: str, endpoint: str, cached: int, outcome: str | None) -> None:
        """An engine reported how much of a prompt it had cached; `outcome`: how the
        prefix index's guess fared ("hit", "miss"; None: it guessed nothing)."""
        self.cached_tokens.labels(model).inc(cached)
        self.guesses.labels(model, endpoint, outcome or "none").inc()

    def tenant_finished(self, tenant: str, prompt: int | None, completion: int | None) -> None:
        children = self._tenant.get(tenant)
        if children is None:
            children = self._tenant[tenant] = (
                self.tenant_requests.labels(tenant),
                self.tenant_tokens.labels(tenant, "prompt"),
                self.tenant_tokens.labels(tenant, "completion"),
            )
        children[0].inc()
        if prompt:
            children[1].inc(prompt)
        if completion:
            children[2].inc(completion)

    def tenant_refused(self, tenant: str, reason: str) -> None:
        self.tenant_refusals.labels(tenant, reason).inc()

    def tokens(self, model: str, prompt: int | None, completion: int | None) -> None:
        if prompt is not None:
            self.prompt_tokens.labels(model).inc(prompt)
        if completion is not None:
            self.completion_tokens.labels(model).inc(completion)


class _HeldCollector(Collector):
    """The requests held at zero replicas, read at scrape time."""

    def __init__(self, held: Callable[[], Mapping[str, int]]) -> None:
        self._held = held

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "llmgw_router_held",
            "Requests held for a model at zero replicas until its first is ready (every "
            "model with a hold; llmgw/router/_holds.py)",
            labels=["model"],
        )
        for model, n in sorted(self._held().items()):
            family.add_metric([model], n)
        yield family


def _per_endpoint(name: str, documentation: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=["model", "endpoint"])


class _StateCollector(Collector):
    """Gauges read from the fleet's snapshot at scrape time."""

    def __init__(self, fleet: FleetView) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        snapshot = self._fleet.statistics()
        # None when scraped from a thread: no clock, so no freshness to judge.
        now = snapshot.taken_at
        depth = GaugeMetricFamily(
            "llmgw_router_queue_depth", "Requests waiting for admission", labels=["model", "band"]
        )
        in_flight = GaugeMetricFamily(
            "llmgw_router_admitted_requests",
            "Requests admitted and not finished, per model",
            labels=["model"],
        )
        limit = GaugeMetricFamily(
            "llmgw_router_concurrency_limit",
            "Admission's concurrency limit per model",
            labels=["model"],
        )
        ep_in_flight = _per_endpoint(
            "llmgw_router_endpoint_in_flight_requests",
            "Requests this router has sent to the endpoint and not seen finish",
        )
        healthy = _per_endpoint(
            "llmgw_router_endpoint_healthy",
            "1 while the endpoint's metrics answer (it gets requests), 0 after repeated misses",
        )
        breaker = GaugeMetricFamily(
            "llmgw_router_endpoint_breaker_state",
            "The endpoint's circuit breaker: 1 for its current state",
            labels=["model", "endpoint", "state"],
        )
        running = _per_endpoint(
            "llmgw_router_endpoint_running_requests",
            "Requests the engine reports running (left out when unknown or stale)",
        )
        waiting = _per_endpoint(
            "llmgw_router_endpoint_waiting_requests",
            "Requests the engine reports waiting (left out when unknown or stale)",
        )
        kv = _per_endpoint(
            "llmgw_router_endpoint_kv_cache_usage_ratio",
            "KV-cache use the engine reports, 0..1 (left out when unknown or stale)",
        )
        age = _per_endpoint(
            "llmgw_router_endpoint_scrape_age_seconds",
            "Seconds since the endpoint's load was last read (left out before the first read)",
        )
        pending_prefill = _per_endpoint(
            "llmgw_router_endpoint_pending_prefill_tokens",
            "Estimated uncached prompt tokens of requests the router sent and the "
            "engine has not begun to answer",
        )
        pending_decode = _per_endpoint(
            "llmgw_router_endpoint_pending_decode_tokens",
            "Expected output tokens of requests the router has in flight there",
        )
        blocks = _per_endpoint(
            "llmgw_router_prefix_index_blocks",
            "Prompt blocks the router's prefix index holds for the endpoint",
        )
        half_life = _per_endpoint(
            "llmgw_router_prefix_half_life_seconds",
            "Half-life of the prefix index's credit for the endpoint, learned from its "
            "engine's cache reports (starts at prefix_half_life_s)",
        )
        endpoints = snapshot.endpoints
        for name, model in snapshot.models.items():
            stats = model.admission
            for band, n in stats["queued"].items():
                depth.add_metric([name, band], n)
            in_flight.add_metric([name], stats["in_flight"])
            limit.add_metric([name], stats["concurrency"])
            for eid in model.endpoints:
                s = endpoints[eid]
                labels = [name, eid]
                ep_in_flight.add_metric(labels, s.in_flight)
                pending_prefill.add_metric(labels, s.pending_prefill)
                pending_decode.add_metric(labels, s.pending_decode)
                blocks.add_metric(labels, s.prefix_blocks)
                half_life.add_metric(labels, s.prefix_half_life_s)
                healthy.add_metric(labels, 1.0 if s.healthy else 0.0)
                for st in BreakerState:
                    breaker.add_metric([*labels, st.value], 1.0 if s.breaker is st else 0.0)
                if s.scraped_at is None or now is None:
                    continue
                age.add_metric(labels, max(0.0, now - s.scraped_at))
                if now - s.scraped_at > snapshot.stale_after_s:
                    continue  # the scorer counts it as unknown; so do we
                for family, value in ((running, s.running), (waiting, s.waiting), (kv, s.kv_usage)):
                    if value is not None:
                        family.add_metric(labels, value)
        yield from (depth, in_flight, limit, ep_in_flight, healthy, breaker, running, waiting, kv)
        yield from (pending_prefill, pending_decode, blocks, half_life)
        yield age
        shared = CounterMetricFamily(
            "llmgw_router_prefix_shared_facts",
            "Prefix-index facts shared with the other router workers: told (sent), heard "
            "(theirs applied here), dropped (over the outbox's bound); none with one worker",
            labels=["outcome"],
        )
        for outcome, n in (snapshot.prefix_shared or {}).items():
            shared.add_metric([outcome], n)
        yield shared
