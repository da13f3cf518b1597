"""Metrics of the fleet's tenant budgets in this router process (llmgw/router/_leases.py):
read at scrape time from `BudgetView.budget_statistics()`, so a scrape changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@attrs.frozen
class BudgetStatistics:
    store_ok: bool | None  # None: no lease has come back or failed yet
    leases: int  # store calls answered
    lease_failures: int  # store calls failed
    waited: int  # requests that waited for a lease on its way
    fallback_admitted: int  # requests admitted on the router's own while the store was out
    credited: int  # requests admitted on credit (a window's first, before its lease)


class BudgetView(Protocol):
    def budget_statistics(self) -> BudgetStatistics | None:
        """None: this router keeps per-process buckets (no store: router-only mode)."""
        ...


class BudgetCollector(Collector):
    def __init__(self, view: BudgetView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        stats = self._view.budget_statistics()
        ok = GaugeMetricFamily(
            "llmgw_router_tenant_budget_store_ok",
            "1 while tenants' budgets are leased from the store, 0 while this router admits "
            "its own part of every limit (the store is out of reach)",
        )
        leases = CounterMetricFamily(
            "llmgw_router_tenant_budget_leases",
            "Store calls leasing and giving back tenants' budgets, by outcome",
            labels=["outcome"],
        )
        waited = CounterMetricFamily(
            "llmgw_router_tenant_budget_waits",
            "Requests that found this router's lease used up and waited for the next one",
        )
        fallback = CounterMetricFamily(
            "llmgw_router_tenant_budget_fallback_admitted",
            "Requests admitted by this router on its own while the store was out of reach",
        )
        credited = CounterMetricFamily(
            "llmgw_router_tenant_budget_credited",
            "Requests admitted on credit: a window's first at this router, before its lease",
        )
        if stats is not None:
            if stats.store_ok is not None:
                ok.add_metric([], 1.0 if stats.store_ok else 0.0)
            leases.add_metric(["answered"], stats.leases)
            leases.add_metric(["failed"], stats.lease_failures)
            waited.add_metric([], stats.waited)
            fallback.add_metric([], stats.fallback_admitted)
            credited.add_metric([], stats.credited)
        yield from (ok, leases, waited, fallback, credited)
