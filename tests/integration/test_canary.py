"""A canary through real processes (issue 23): llmgw-cp with two router workers, an agent,
and one fake llama-server per version. The split is server.yaml's `traffic:`; changing its weights or
a key's pin is an edit of the file, which the control plane reloads with nothing
restarted: the same control plane, the same engine processes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ready_shards, start_tiny_fleet

from llmgw.testing.cluster import LocalCluster, wait_for

CPU = [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 30}]
MODELS = [
    {"name": "qwen-v1", "source": "llmgw-test/v1", "profiles": CPU},
    {"name": "qwen-v2", "source": "llmgw-test/v2", "profiles": CPU},
]


def send(
    cluster: LocalCluster, secret: str, n: int, workers: set[str] | None = None
) -> Counter[tuple[int, str, str]]:
    """n requests for `qwen`, each on a connection of its own (so the kernel spreads them
    over the router workers): (status, the answer's model, its x-llmgw-version) counted;
    the workers that answered are added to `workers`."""
    got: Counter[tuple[int, str, str]] = Counter()
    for _ in range(n):
        r = httpx.post(
            cluster.router_url + "/chat/completions",
            headers={"Authorization": f"Bearer {secret}"},
            json={"model": "qwen", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2},
            timeout=30,
        )  # fmt: skip
        # An error's message in place of the model: a failure says what it was.
        said = r.json().get("model") if r.status_code == 200 else r.text
        got[(r.status_code, said or "", r.headers.get("x-llmgw-version", ""))] += 1
        if workers is not None:
            workers.add(r.headers.get("x-llmgw-worker", "?").split(";")[0])
    return got


def routed_to(cluster: LocalCluster, secret: str, version: str, n: int = 1) -> bool:
    """n requests in a row went to `version`; else raises with what they got (wait_for
    shows it)."""
    got = send(cluster, secret, n)
    if got != {(200, version, version): n}:
        raise AssertionError(f"wanted {version}, got {dict(got)}")
    return True


def split_now(cluster: LocalCluster) -> dict[str, Any]:
    """The traffic split as the status has it: `GET /api/v1/status`, which `ctl status
    --json` prints as is, read over HTTP because it is polled (a ctl process per poll is
    ~0.4 s of CPU on the suite's two cores); `ctl status`'s table is checked below."""
    status = cluster.first.api_get("/api/v1/status")
    return {
        v["model"]: (v["weight"], v["share"], v["ready"], v["keys"])
        for t in status["traffic"]
        for v in t["versions"]
    }


@pytest.mark.slow(seconds=20)
def test_weights_and_pins_change_by_editing_server_yaml_with_nothing_restarted(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    traffic = {"qwen": {"split": {"qwen-v1": 100, "qwen-v2": 0}}}
    start_tiny_fleet(
        cluster, tmp_path, ["cpu-1"], engine_env={"LLMGW_FAKE_LOAD_DELAY": "0.2"},
        models=MODELS, traffic=traffic, router={"workers": 2},
    )  # fmt: skip
    wait_for(
        "both versions ready",
        lambda: split_now(cluster) == {"qwen-v1": (100, 1.0, 1, []), "qwen-v2": (0, 0.0, 1, [])},
        60,
    )
    made = json.loads(cluster.ctl("keys", "create", "--tenant", "qa", "--json").stdout)
    qa_key, qa_secret = made["key"]["key_id"], made["secret"]
    user = cluster.api_key("users")
    wait_for("the router to route qwen", lambda: routed_to(cluster, user, "qwen-v1"), 20)
    assert cluster.cp is not None
    cp_pid = cluster.cp.pid
    engines = sorted(s["pids"][0] for _, s in ready_shards(cluster))
    assert len(engines) == 2

    workers: set[str] = set()
    assert send(cluster, user, 30, workers) == {(200, "qwen-v1", "qwen-v1"): 30}
    assert workers == {"0", "1"}

    # The canary takes everything but the QA key, pinned to the old version: one edit.
    cluster.server_extra["traffic"] = {
        "qwen": {"split": {"qwen-v1": 0, "qwen-v2": 100}, "keys": {qa_key: "qwen-v1"}}
    }
    cluster.write_server_config()
    wait_for(
        "the new split in the status",
        lambda: (
            split_now(cluster) == {"qwen-v1": (0, 0.0, 1, [qa_key]), "qwen-v2": (100, 1.0, 1, [])}
        ),
        20,
    )
    wait_for(
        "the routers to draw the new split", lambda: routed_to(cluster, user, "qwen-v2", 10), 10
    )
    workers = set()
    assert send(cluster, user, 30, workers) == {(200, "qwen-v2", "qwen-v2"): 30}
    assert send(cluster, qa_secret, 30, workers) == {(200, "qwen-v1", "qwen-v1"): 30}
    assert workers == {"0", "1"}  # the control plane's router and its worker process alike

    table = cluster.ctl("status").stdout
    assert "SPLIT  VERSION  WEIGHT  SHARE  READY  PINNED KEYS" in table
    assert f"qwen   qwen-v1  0       0 %    1      {qa_key}" in table
    assert "       qwen-v2  100     100 %  1      -" in table

    # A bad edit is refused whole, naming the path; the running split stays.
    cluster.server_extra["traffic"] = {"qwen": {"split": {"qwen-v3": 1}}}
    cluster.write_server_config()
    cp = cluster.cp
    refusal = (
        "traffic.qwen.split.qwen-v3: no model 'qwen-v3' in the catalog (models: qwen-v1, qwen-v2)"
    )
    wait_for("the refusal in the control plane's log", lambda: refusal in cp.output(), 20)
    assert send(cluster, user, 10) == {(200, "qwen-v2", "qwen-v2"): 10}

    # Nothing restarted: the same control plane and the same engine processes.
    assert cp.pid == cp_pid and cp.alive()
    assert sorted(s["pids"][0] for _, s in ready_shards(cluster)) == engines
