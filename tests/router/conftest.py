"""Router tests: fake engines as real processes, the router on hypercorn in the test's trio loop."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from llmgw.keys import ApiKey
from llmgw.router._keys import StaticKeys
from llmgw.router._router import Router, RouterConfig
from llmgw.router._types import Endpoint, StaticEndpoints
from llmgw.testing.cluster import free_port, wait_for

SECRET_A = "llmgw-test-key-tenant-a"
SECRET_B = "llmgw-test-key-tenant-b"
SECRET_LIMITED = "llmgw-test-key-limited"


@attrs.define
class FakeEngine:
    name: str  # the served name
    engine: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(f"http://127.0.0.1:{self.port}/fake/stats", timeout=5).json())

    def endpoint(self, endpoint_id: str | None = None, slots: int | None = None) -> Endpoint:
        return Endpoint(
            endpoint_id or f"{self.name}@{self.port}",
            self.name,
            self.engine,
            "127.0.0.1",
            self.port,
            slots,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _command(engine: str, name: str, port: int, extra: Sequence[str]) -> list[str]:
    base = [sys.executable, "-m", "llmgw.testing.fake_engine", "--fake-engine", engine]
    # The flags llmgw's plans pass too: metrics, and the cached-token report.
    if engine == "vllm":
        args = ["serve", name, "--served-model-name", name, "--enable-prompt-tokens-details"]
    elif engine == "sglang":
        args = ["--model-path", name, "--served-model-name", name]
        args += ["--enable-metrics", "--enable-cache-report"]
    else:
        args = ["-m", name, "-a", name, "--metrics", "--embeddings"]
    return [*base, *args, "--host", "127.0.0.1", "--port", str(port), *extra]


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[Callable[..., FakeEngine]]:
    started: list[FakeEngine] = []

    def start(
        name: str = "chat",
        engine: str = "vllm",
        env: Mapping[str, str] | None = None,
        extra: Sequence[str] = (),
    ) -> FakeEngine:
        port = free_port()
        log = tmp_path / f"engine-{name}-{port}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                _command(engine, name, port, extra),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=full_env,
            )
        fe = FakeEngine(name, engine, port, proc, log)
        started.append(fe)
        wait_for(
            f"fake {engine} on {port}",
            lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200,
            timeout=20,
            interval=0.05,
        )
        return fe

    yield start
    for fe in started:
        if fe.proc.poll() is None:
            fe.proc.send_signal(signal.SIGTERM)
            try:
                fe.proc.wait(5)
            except subprocess.TimeoutExpired:
                fe.proc.kill()
                fe.proc.wait(5)


def make_keys(models_b: frozenset[str] | None = None) -> StaticKeys:
    return StaticKeys(
        [
            (SECRET_A, ApiKey("key-a", "tenant-a", None, "interactive", "interactive", 0.0)),
            (SECRET_B, ApiKey("key-b", "tenant-b", models_b, "interactive", "interactive", 0.0)),
            (
                SECRET_LIMITED,
                ApiKey("key-limited", "tenant-c", frozenset({"chat"}), "batch", "batch", 0.0),
            ),
        ]
    )


@attrs.define
class RunningRouter:
    router: Router
    url: str
    source: StaticEndpoints

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.router.metrics_registry).decode()


@asynccontextmanager
async def serve_router(
    endpoints: Sequence[Endpoint],
    *,
    models: Sequence[str] = (),
    keys: Any = None,
    run: bool = True,
    seed: int = 1,
    server: str = "lean",
    admin_key: str | None = None,
    budget: Any = None,
    **config: Any,
) -> AsyncIterator[RunningRouter]:
    """The router in this trio loop, on llmgw's lean server or on hypercorn; `budget`:
    where tenants' budgets are leased from (None: per-process buckets)."""
    import random

    from llmgw.router import _hypercorn, _main, _server, listener_limits

    source = StaticEndpoints(endpoints, models)
    router = Router(
        RouterConfig(**config),
        source,
        keys or make_keys(),
        rng=random.Random(seed),
        admin_key=admin_key,
        budget=budget,
    )
    async with trio.open_nursery() as nursery:
        if run:
            await nursery.start(router.run)
        limits = listener_limits(router.config)
        if server == "hypercorn":  # as router-only mode runs it (llmgw/router/_main.py)
            port = free_port()
            hc = _main._hypercorn(f"127.0.0.1:{port}", router.config)
            hc.graceful_timeout = 0.5
            await nursery.start(
                functools.partial(_hypercorn.serve, send_timeout_s=limits.send_timeout_s),
                _hypercorn.guard(router.app, limits),
                hc,
            )
        else:
            port = await nursery.start(
                functools.partial(_server.serve, limits=limits), router.app, "127.0.0.1", 0
            )
        try:
            yield RunningRouter(router, f"http://127.0.0.1:{port}", source)
        finally:
            nursery.cancel_scope.cancel()
            router.close()


SERVERS = pytest.mark.parametrize("server", ["lean", "hypercorn"])


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from Prometheus text, or None when it is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
