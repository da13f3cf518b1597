from __future__ import annotations

import os
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
settings.register_profile(
    "shared", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "shared"))


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
