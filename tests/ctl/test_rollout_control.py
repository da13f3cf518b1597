"""`llmgw ctl rollout pause|resume` through real llmgw-cp and agents, with fake engines.

The fake llama-server takes 3 s to load, so a rollout of two replicas (surge one,
none unavailable) is caught between its steps: paused once its first new replica
is starting, it starts nothing more and retires no old replica, for as many passes
as the test waits; resumed, it runs to the end. A model that is not being rolled
out cannot be paused, and ctl says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import start_tiny_fleet, tiny_catalog

from llmgw.testing.cluster import LocalCluster, wait_for


def catalog(timeout_s: int) -> list[dict[str, Any]]:
    models = tiny_catalog(2)
    models[0]["profiles"][0]["startup_timeout_s"] = timeout_s  # another fingerprint
    return models


def rollout(cluster: LocalCluster) -> dict[str, Any]:
    return dict(cluster.first.api_get("/api/v1/rollouts/tiny"))


def by_version(cluster: LocalCluster, to: list[str]) -> tuple[set[str], set[str]]:
    """(new replica ids, old replica ids) of `tiny`, by the fingerprint they run."""
    new, old = set(), set()
    for n in cluster.first.api_get("/api/v1/nodes")["nodes"]:
        for s in n["shards"]:
            if s.get("model_name") == "tiny" and s["state"] not in ("stopped", "failed"):
                (new if s["profile_fingerprint"] in to else old).add(s["replica_id"])
    return new, old


def passes(cluster: LocalCluster) -> int:
    return int(cluster.first.api_get("/api/v1/status")["reconciler"]["passes"])


@pytest.mark.slow
def test_pause_holds_a_rollout_between_its_steps_and_resume_finishes_it(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    start_tiny_fleet(
        cluster, tmp_path, ["a1", "a2"], engine_env={"LLMGW_FAKE_LOAD_DELAY": "3.0"},
        models=catalog(30),
    )  # fmt: skip
    wait_for("v1 settled", lambda: rollout(cluster)["settled"], 60)
    refused = cluster.ctl("rollout", "pause", "tiny", check=False)
    assert refused.returncode != 0
    assert "tiny is not being rolled out" in refused.stderr, refused.stderr

    cluster.write_server_config(catalog(31))
    wait_for("rolling", lambda: rollout(cluster)["phase"] == "rolling", 30)
    paused = json.loads(cluster.ctl("rollout", "pause", "tiny", "--json").stdout)
    assert paused["paused"] is True
    wait_for("the pause in the plan", lambda: rollout(cluster)["phase"] == "paused", 30)
    new, old = by_version(cluster, rollout(cluster)["to"])
    assert (len(new), len(old)) == (1, 2), (new, old)  # the surge of one, nothing retired

    # Held: the new replica gets ready (3 s), and still nothing more starts or retires.
    held_from = passes(cluster)
    wait_for("ten passes while paused", lambda: passes(cluster) >= held_from + 10, 60)
    assert by_version(cluster, rollout(cluster)["to"]) == (new, old)
    text = cluster.ctl("rollout", "status", "tiny").stdout
    assert "rollout paused" in text and "paused by an operator" in text, text

    resumed = json.loads(cluster.ctl("rollout", "resume", "tiny", "--json").stdout)
    assert resumed["paused"] is False
    wait_for("done after the resume", lambda: rollout(cluster)["phase"] == "done", 60)
    done_new, done_old = by_version(cluster, rollout(cluster)["to"])
    assert len(done_new) == 2 and new < done_new and not done_old, (done_new, done_old)
    audit = cluster.ctl("audit").stdout
    assert "rollout-pause" in audit and "rollout-resume" in audit, audit
