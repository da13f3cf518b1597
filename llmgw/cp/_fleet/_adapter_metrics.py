"""The LoRA adapters' metrics, computed at each scrape from the adapter manager
(llmgw/cp/_fleet/_adapters.py). The counters are the leader's since it was elected
(a standby's stay 0; a new leader starts from 0, which Prometheus reads as a reset)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.cp._fleet._adapters import AdapterStatus


class AdapterCollector(Collector):
    def __init__(self, status: Callable[[], Sequence[AdapterStatus]]) -> None:
        self._status = status

    def describe(self) -> Iterable[Metric]:
        return ()  # computed at scrape time

    def collect(self) -> Iterator[Metric]:
        rows = self._status()
        held = GaugeMetricFamily(
            "llmgw_adapter_replicas",
            "Replicas of its base that hold the LoRA adapter now",
            labels=["adapter", "base"],
        )
        loading = GaugeMetricFamily(
            "llmgw_adapter_loading",
            "1 while a load of the adapter is in flight",
            labels=["adapter"],
        )
        loads = CounterMetricFamily(
            "llmgw_adapter_loads", "Loads of the adapter done by this leader", labels=["adapter"]
        )
        evictions = CounterMetricFamily(
            "llmgw_adapter_evictions",
            "Times this leader evicted the adapter for another",
            labels=["adapter"],
        )
        failures = CounterMetricFamily(
            "llmgw_adapter_load_failures",
            "Loads of the adapter that failed under this leader",
            labels=["adapter"],
        )
        for s in rows:
            held.add_metric([s.name, s.base], len(s.held_by))
            loading.add_metric([s.name], 1 if s.loading_on else 0)
            loads.add_metric([s.name], s.counts.loads)
            evictions.add_metric([s.name], s.counts.evictions)
            failures.add_metric([s.name], s.counts.failures)
        yield from (held, loading, loads, evictions, failures)
