"""One bad catalog entry never starves the fleet, through real processes: llmgw-cp with
its router, a real agent, the fake llama-server. Ten models whose source the agent
refuses (a local path the node does not have: the shard fails at once) and one good
model: the good one is ready within its usual time and serves, and each broken model
is started a few times, each wait twice the one before, not dozens of times a second
(before the backoff: 1,823 starts in 40 s, and the good model timed out).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import start_tiny_fleet, tiny_catalog

from llmgw.testing.cluster import LocalCluster, wait_for

BROKEN = [f"broken-{i}" for i in range(10)]
WATCH_S = 30.0


def replicas(cluster: LocalCluster) -> list[dict[str, Any]]:
    """`GET /api/v1/replicas`, which `ctl replicas --json` prints as is: read over HTTP
    because it is polled (a ctl process per poll, two per check below, is ~0.4 s of CPU
    each on the suite's two cores); `ctl replicas` is read where its table is checked."""
    return list(cluster.first.api_get("/api/v1/replicas")["replicas"])


@pytest.mark.slow(seconds=30)
def test_ten_broken_models_back_off_and_the_good_one_is_served(tmp_path: Path) -> None:
    broken = [
        {
            "name": name,
            "source": f"/nonexistent/{name}.gguf",
            "replicas": 1,
            "profiles": [{"engine": "llama-server", "gpus_per_node": 0}],
        }
        for name in BROKEN
    ]
    cluster = LocalCluster(tmp_path / "fleet")
    started = time.monotonic()
    try:
        start_tiny_fleet(cluster, tmp_path, ["cpu-1"], engine_env={},
                         models=[*broken, *tiny_catalog(1)])  # fmt: skip
        assert cluster.cp is not None

        # The good model: ready within its usual time (its startup timeout is 30 s),
        # once, and it answers through the router.
        def good_ready() -> bool:
            return any(r["model"] == "tiny" and r["state"] == "ready" for r in replicas(cluster))

        wait_for("tiny ready", good_ready, 30)
        key = cluster.api_key()
        answer = httpx.post(
            cluster.router_url + "/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                  "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text

        # Watch the broken ones for a while: each is started a few times, not hundreds.
        wait_for("every broken model failed twice", lambda: all(
            r["state"] == "backoff" and r["failures"] >= 2
            for r in replicas(cluster) if r["model"] in BROKEN and r["replica"] is None
        ) and len([r for r in replicas(cluster) if r["state"] == "backoff"]) == 10, 30)  # fmt: skip
        time.sleep(WATCH_S - min(WATCH_S, time.monotonic() - started))
        log = cluster.cp.output()
        watched = time.monotonic() - started
        starts = {
            name: len(re.findall(rf"starting replica {name}-[0-9a-f]+ of {name} on", log))
            for name in [*BROKEN, "tiny"]
        }
        # In `watched` s (30 to 40 here): at once, at once again, then 5, 10 and 20 s on.
        assert all(2 <= starts[name] <= 6 for name in BROKEN), (watched, starts)
        assert starts["tiny"] == 1, starts

        # `ctl replicas` says why each waits, in the operator's words.
        table = cluster.ctl("replicas").stdout
        for name in BROKEN:
            (row,) = [line for line in table.splitlines() if line.split()[:1] == [name]
                      and " backoff " in line]  # fmt: skip
            assert re.search(r"(next try in \d+ s|trying again) after \d+ failures: ", row), row
            assert f"/nonexistent/{name}.gguf" in row, row
        assert cluster.nodes()["cpu-1"]["state"] == "ready"
        still = [r for r in replicas(cluster) if r["model"] == "tiny"]
        assert [r["state"] for r in still] == ["ready"], still
    finally:
        cluster.stop_all()
