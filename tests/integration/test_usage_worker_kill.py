"""A router worker killed with SIGKILL loses at most about a second of usage (issue 24).

Real processes on loopback: llmgw-cp with `router.workers: 2` (the control plane is
worker 0, worker 1 a process of its own), one agent, the fake llama-server. Requests
go through the router on new connections (the kernel spreads them over both workers;
each answer names its worker); then worker 1 is killed with SIGKILL, with no chance to
flush. Each worker writes its own usage every `usage_flush_s` (default 1 s), so `ctl
usage` must count every request except, at most, worker 1's of its last second
before the kill (plus SLACK_S for a shared two-core machine). With the former
default of 10 s, worker 1's usage of the whole run would be gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
from helpers import alive, ready_shards, start_tiny_fleet

from llmgw.testing.cluster import LocalCluster, wait_for

FLUSH_S = 1.0  # router.usage_flush_s's default: the test uses it, it sets nothing
SLACK_S = 0.5  # the write itself and a loaded machine's scheduling
RUN_S = 6.0
_WORKER = re.compile(r"^(\d+); pid=(\d+)$")


def totals(cluster: LocalCluster) -> dict[str, int]:
    out = cluster.ctl("usage", "--tenant", "team-a", "--since", "24h", "--json").stdout
    return dict(json.loads(out)["totals"])


def test_a_worker_killed_with_sigkill_loses_at_most_its_last_second_of_usage(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    env = {"LLMGW_FAKE_TOKENS": "3", "LLMGW_FAKE_TOKEN_DELAY": "0", "LLMGW_FAKE_SLOTS": "4"}
    start_tiny_fleet(cluster, tmp_path, ["n1"], engine_env=env, router={"workers": 2})
    assert cluster.cp is not None
    key = cluster.api_key("team-a")
    wait_for("the replica ready", lambda: ready_shards(cluster), 30)

    # (answered at, worker, pid, prompt tokens, completion tokens), one per request
    done: list[tuple[float, int, int, int, int]] = []
    failed: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            # A new connection each time: the kernel picks the worker per connection.
            with httpx.Client(timeout=30) as c:
                r = c.post(
                    cluster.router_url + "/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 3,
                    },
                    headers={"Authorization": f"Bearer {key}"},
                )
            at = time.time()
            with lock:
                if r.status_code != 200:
                    failed.append(f"{r.status_code} {r.text[:200]}")
                    continue
                m = _WORKER.match(r.headers["x-llmgw-worker"])
                assert m, r.headers
                u = r.json()["usage"]
                done.append((at, int(m[1]), int(m[2]), u["prompt_tokens"], u["completion_tokens"]))

    # Until both workers answered, then RUN_S more: worker 1 serves throughout.
    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for("both workers answering", lambda: {w for _, w, *_ in done} == {0, 1}, 30)
        time.sleep(RUN_S)  # the load's length, not a wait for anything
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failed == [], failed[:5]
    w1_pid = [pid for _, w, pid, *_ in done if w == 1][-1]
    assert w1_pid != cluster.cp.pid and alive(w1_pid)
    os.kill(w1_pid, signal.SIGKILL)
    killed_at = time.time()

    total = len(done)
    w1 = [d for d in done if d[1] == 1]
    recent = [d for d in w1 if d[0] >= killed_at - FLUSH_S - SLACK_S]
    must = [d for d in done if d not in recent]  # counted whatever the kill's timing
    want = {
        "requests": len(must),
        "prompt_tokens": sum(d[3] for d in must),
        "completion_tokens": sum(d[4] for d in must),
    }

    def counted() -> dict[str, int] | None:
        got = totals(cluster)
        return got if all(got.get(k, 0) >= v for k, v in want.items()) else None

    got = wait_for("the usage of all but worker 1's last second", counted, 20)
    assert got["requests"] <= total, (got, total)
    lost = total - got["requests"]
    print(
        f"usage after SIGKILL of worker 1: {total} requests answered ({len(w1)} by worker 1 "
        f"over {done[-1][0] - done[0][0]:.1f} s), {got['requests']} counted, {lost} lost; "
        f"worker 1 answered {len(recent)} in its last {FLUSH_S + SLACK_S:g} s"
    )
    # Meaningful: most of worker 1's requests came before its last second, so a flush
    # every 10 s (the former default) would have lost more than this bound allows.
    assert len(w1) > 2 * len(recent), (len(w1), len(recent))
