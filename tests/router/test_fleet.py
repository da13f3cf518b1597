"""The fleet view: reading it changes nothing, and the metrics read only its snapshot."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest
from prometheus_client import generate_latest

from llmgw.router._fleet import FleetStatistics
from llmgw.router._router import Router, RouterConfig
from llmgw.router._types import Endpoint, StaticEndpoints
from router.conftest import make_keys, sample

ROUTER = Path(__file__).resolve().parents[2] / "llmgw" / "router"


def _endpoint(eid: str, port: int) -> Endpoint:
    return Endpoint(eid, "chat", "vllm", "127.0.0.1", port)


async def test_a_metrics_scrape_does_not_change_the_fleet_view() -> None:
    """Before, the state gauges read `router.models()`, which re-read the endpoint source:
    a scrape could add and drop endpoints and change admission limits (waking queued
    requests). Now they read the snapshot, and the view moves only when the router does."""
    source = StaticEndpoints([_endpoint("a", 1)])
    router = Router(RouterConfig(), source, make_keys())
    try:
        before = router.fleet.statistics()
        assert isinstance(before, FleetStatistics)
        assert list(before.endpoints) == ["a"]
        source.replace([_endpoint("a", 1), _endpoint("b", 2)])  # the source moves on
        text = generate_latest(router.metrics_registry).decode()
        after = router.fleet.statistics()
        assert after == before  # nothing re-read, nothing woken, nothing counted
        assert sample(text, "llmgw_router_endpoint_in_flight_requests", endpoint="a") == 0.0
        assert sample(text, "llmgw_router_endpoint_in_flight_requests", endpoint="b") is None
        assert sample(text, "llmgw_router_concurrency_limit", model="chat") == 64.0
        # The request path does re-read it: the view then has both endpoints, and the
        # next scrape says so.
        assert {s.endpoint.endpoint_id for s in router.models()["chat"].endpoints} == {"a", "b"}
        moved = router.fleet.statistics()
        assert moved != before and list(moved.endpoints) == ["a", "b"]
        text = generate_latest(router.metrics_registry).decode()
        assert sample(text, "llmgw_router_concurrency_limit", model="chat") == 128.0
        assert router.fleet.statistics() == moved
    finally:
        router.close()


def test_the_snapshot_is_frozen() -> None:
    router = Router(RouterConfig(), StaticEndpoints([_endpoint("a", 1)]), make_keys())
    try:
        snap = router.fleet.statistics()
        assert snap.taken_at is None  # outside trio: no clock, so no ages are exported
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            snap.waiting = 1  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            snap.endpoints["a"].in_flight = 1  # type: ignore[misc]
        # Router.statistics() is the same snapshot as JSON, with the router's own counts.
        stats = router.statistics()
        assert stats["endpoints"]["a"]["breaker"] == "closed"
        assert stats["models"]["chat"]["endpoints"] == ["a"]
        assert {"keys", "tenants", "usage", "waiting"} <= set(stats)
    finally:
        router.close()


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_metrics_do_not_import_the_router() -> None:
    """The import circle _metrics <-> _router is gone: the collector depends on the
    FleetView Protocol and the snapshot's type, the request metrics on the Record."""
    assert "llmgw.router._router" not in _imports(ROUTER / "_metrics.py")
    for name in ("_fleet.py", "_attempt.py", "_record.py", "_explain.py", "_config.py"):
        assert "llmgw.router._router" not in _imports(ROUTER / name), name


def test_the_router_uses_core_through_its_public_names() -> None:
    for name in ("_router.py", "_fleet.py", "_attempt.py", "_explain.py", "_config.py"):
        private = {m for m in _imports(ROUTER / name) if m.startswith("llmgw.core.")}
        assert private == set(), name
