"""bench/fleet.py runs end to end on a tiny fleet, so the benchmark cannot rot."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


@pytest.mark.slow
def test_fleet_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "fleet.py"),
            "--agents",
            "20",
            "--clients",
            "2",
            "--interval",
            "0.5",
            "--warmup",
            "0.5",
            "--window",
            "1.5",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = json.loads(out.read_text())
    # Every agent registered, and the control plane saw every one ready.
    assert result["agents"] == 20
    assert result["states_after_storm"] == {"ready": 20}
    assert 0 < result["storm_s"] < 60
    # Heartbeats flowed at about the configured rate: 20 agents x 1.5 s / 0.5 s = 60.
    assert result["beats_expected"] == 60
    assert result["beats_in_window"] >= 30
    assert result["sessions_lost"] == 0
    assert 0 < result["heartbeat_p50_ms"] <= result["heartbeat_p99_ms"] < 5000
    # The readings came from the control plane's /proc entries, not defaults.
    assert result["cp_rss_mib"] > 20
    assert math.isfinite(result["rss_per_agent_kib"])
    # /proc counts CPU in 10 ms ticks: a 1.5 s window of 60 heartbeats may read 0 ticks.
    assert result["cp_cpu_s"] > 0 and 0 <= result["cp_cpu_pct"] < 400
    assert result["nodes_get_s"] > 0 and result["nodes_get_mib"] > 0
    assert "20 agents (heartbeat every 0.5 s):" in done.stdout
    assert "register storm" in done.stdout
    # Each heartbeat carried what an 8-GPU node sends (sampled by the agent's own code
    # over the recorded H100/H200 outputs in tests/data/, moved on every beat).
    shape = result["heartbeat_shape"]
    assert shape["gpus"] == 8
    assert shape["gpus_with_memory_and_utilisation"] == 8
    assert shape["host_figures"] == [
        "cpu_util_pct", "load1", "load15", "load5", "memory_available_bytes"
    ]  # fmt: skip
    assert shape["bytes"] > 1000
    # The four goals, each with its figure and a verdict.
    goals = {g["goal"]: g for g in result["goals"]}
    assert list(goals) == [
        "control plane CPU", "memory per agent", "heartbeat p99", "register storm"
    ]  # fmt: skip
    assert goals["register storm"]["value"] == result["storm_s"]
    assert goals["register storm"]["met"] is (result["storm_s"] < 30)
    assert goals["memory per agent"]["bound"] == 100
    assert all(isinstance(g["met"], bool) for g in goals.values())
    assert "(the goals are for 10,000 agents; this is 20)" in done.stdout
    assert re.search(r"heartbeat p99: [\d.]+ ms \(goal < 50\): (met|NOT met)", done.stdout)
