"""bench/packing.py runs (a small fleet) and prints its figures with their goals, so the
benchmark cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO


def test_packing_bench_small() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "packing.py"), "--nodes", "200", "--replicas", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    whole = re.search(r"whole cards: (\d+) cards used, 0 refused", text)
    shared = re.search(r"shared: +(\d+) cards used, 0 refused, 0 cards over-committed", text)
    assert whole is not None and shared is not None, text
    assert 0 < int(shared[1]) < int(whole[1])
    ratio = int(shared[1]) / int(whole[1])
    assert f"cards used, shared against whole: {ratio:.1%} (goal <= 60%: met)" in text
    assert re.search(r"\(\d+ on MIG instances\)", text) and "(0 on MIG" not in text
    assert re.search(
        r"place 100 shared replicas: [\d.]+ ms, of which the first [\d.]+ ms \(it indexes"
        r" every card for shares\); the other 99: [\d.]+ ms \(\d+ us each\)",
        text,
    )
    assert re.search(
        r"goal < 200 ms for 1,000 on 5,000 nodes, the index of shares included: ", text
    )
    assert re.search(
        r"one-card shares held to one rack \(10 nodes\) by a node_selector: [\d.]+ ms \(0 refused\)",
        text,
    )
