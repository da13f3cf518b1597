"""bench/autoscale.py runs (its quick day) and prints every figure of issue 25 with its
goal and verdict, so the benchmark cannot rot."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO


def test_autoscale_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "autoscale.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "autoscale.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert re.search(r"best fixed count in hindsight: \d+ replicas, [\d.]+ GPU-hours", text)
    result = json.loads(out.read_text())
    assert [run["start_s"] for run in result["runs"]] == [10.0, 60.0, 120.0]
    for run in result["runs"]:
        start = f"{run['start_s']:g}"
        assert f"start time {start} s:" in text
        minutes = run["share_ok"] * 100
        assert (
            f"minutes with TTFT p90 <= 2 s: {minutes:.1f}% of {run['minutes']} (goal >= 95%)"
            in text
        )
        assert f"GPU-hours: {run['gpu_hours']:.2f} against {result['fixed_gpu_hours']:.2f}" in text
        assert f"{run['gpu_ratio']:.2f}x (goal <= 1.15x)" in text
        assert (
            f"refused (503/429): {run['refused_inside']} inside spikes, "
            f"{run['refused_outside']} outside (goal 0 outside)"
        ) in text
        assert f"scale events: {run['raises'] + run['lowerings']} ({run['raises']} raises" in text
        # A simulated day scales: up in the morning and for the spikes, down after them.
        assert run["raises"] > 0 and run["lowerings"] > 0
        assert run["gpu_hours"] > 0 and 0 < run["share_ok"] <= 1
    # Each goal's verdict is printed, and the unmet ones are named at the end.
    unmet = [
        f"{name} at {run['start_s']:g} s"
        for run in result["runs"]
        for name, ok in run["met"].items()
        if not ok
    ]
    assert text.count(": met") + text.count(": NOT met") == 9
    assert f"goals not met: {', '.join(unmet) if unmet else 'none'}" in text
    # A longer start time never serves the spikes better: more refused inside them.
    inside = [run["refused_inside"] for run in result["runs"]]
    assert inside == sorted(inside)
