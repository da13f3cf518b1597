from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

# Helpers live in tests/helpers.py; these names stay importable from conftest
# for the tests that still do `from conftest import alive`.
from helpers import FIXTURES, IN_CI, REPO, alive, llama_server_binary, require
from hypothesis import HealthCheck, settings

from llmgw.testing.cluster import LocalCluster

__all__ = ["FIXTURES", "IN_CI", "REPO", "alive", "llama_server_binary", "require"]

# The machines that run this suite are shared (2 cores, other jobs beside it):
# a property that takes 300 ms once is not a failure. `--hypothesis-profile`
# or HYPOTHESIS_PROFILE picks another.
settings.register_profile("shared", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "shared"))


def _worker_ports() -> None:
    """Each pytest-xdist worker (`gw0`, `gw1`, ...) gets its own ports, set here before any
    test runs so its subprocesses inherit them: 2,000 for servers the tests start
    (llmgw.testing.cluster.free_port) and 800 for the engines its control planes place
    (server.yaml `engine_ports`), all below the kernel's ephemeral range. Without them
    two workers' reconcilers would pick the same engine port from 8100-8999."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = 10_000 + (index % 8) * 2_800
    os.environ["LLMGW_TEST_PORTS"] = f"{base}-{base + 1_999}"
    os.environ["LLMGW_TEST_ENGINE_PORTS"] = f"{base + 2_000}-{base + 2_799}"


_worker_ports()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with the most `slow` time (real fleets, releases) run first: `make test`
    hands whole files to its workers (`--dist loadfile`), so a long file picked up last
    would leave the other workers idle at the end. A slow test counts 10 s unless its
    marker says more (`@pytest.mark.slow(seconds=150)`: a test that takes minutes). The
    sort is stable: a file's tests stay together and in their order, and every worker
    collects the same order."""
    slow: Counter[Path] = Counter()
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            slow[item.path] += int(marker.kwargs.get("seconds", 10))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmgw.testing import tiny_gguf

    return tiny_gguf.write(tmp_path_factory.mktemp("models") / "tiny.gguf")
