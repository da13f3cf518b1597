"""`router.workers: 2` inside llmgw-cp, through real processes: the control plane (worker 0),
its worker process (worker 1), agents and fake engines placed by the catalog.

Requests reach both workers' pids and are answered; the replica that became ready
after the workers started is routable from both; a dead worker is restarted; a drain
waits for a request in flight on the worker process (the in-flight counts are summed
over the channel), and that request completes whole; SIGTERM of the control plane
leaves no worker behind, and a worker whose control plane was killed exits by itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from helpers import alive, ready_shards, start_tiny_fleet

from llmgw.testing.cluster import LocalCluster, wait_for

TOKENS = 100  # streamed at 0.1 s each: in flight for about 10 s
_WORKER = re.compile(r"^(\d+); pid=(\d+)$")


def start_fleet(cluster: LocalCluster, tmp_path: Path, nodes: list[str], **server: Any) -> None:
    env = {
        "LLMGW_FAKE_LOAD_DELAY": "0.5",
        "LLMGW_FAKE_TOKENS": str(TOKENS),
        "LLMGW_FAKE_TOKEN_DELAY": "0.1",
    }
    router = {"workers": 2, "key_cache_ttl_s": 1.0}
    start_tiny_fleet(cluster, tmp_path, nodes, engine_env=env, router=router, **server)


def worker_of(response: httpx.Response) -> tuple[int, int]:
    match = _WORKER.match(response.headers["x-llmgw-worker"])
    assert match, response.headers["x-llmgw-worker"]
    return int(match[1]), int(match[2])


def chat(cluster: LocalCluster, key: str) -> httpx.Response:
    # A new connection each time: the kernel picks the worker per connection.
    with httpx.Client(timeout=30) as client:
        return client.post(
            cluster.router_url + "/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )


def pids_by_worker(cluster: LocalCluster, key: str, tries: int = 200) -> dict[int, int]:
    """Requests until both workers answered 200; worker index -> its pid."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        r = chat(cluster, key)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        index, pid = worker_of(r)
        seen[index] = pid
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered in {tries} requests")


def test_requests_reach_both_workers_a_dead_one_restarts_sigterm_stops_all(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    start_fleet(cluster, tmp_path, ["n1"])
    assert cluster.cp is not None
    key = cluster.api_key()
    # The replica became ready after both workers had started: each routes to it.
    wait_for("the replica ready", lambda: ready_shards(cluster), 30)
    wait_for("a 200 through the router", lambda: chat(cluster, key).status_code == 200, 15)
    pids = pids_by_worker(cluster, key)
    assert pids[0] == cluster.cp.pid  # worker 0 is the control plane itself
    assert pids[1] != cluster.cp.pid and alive(pids[1])

    # Worker 1's own metrics, on the admin listener's port + 1, count what it served.
    logged = re.search(
        r"router worker 1 of 2 .* metrics on (http://\S+/metrics)", cluster.cp.output()
    )
    assert logged, cluster.cp.output()[-3000:]
    assert logged[1] == f"http://127.0.0.1:{cluster.admin_port + 1}/metrics"
    scraped = httpx.get(logged[1], timeout=5).text
    served = re.search(
        r'^llmgw_router_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', scraped, re.M
    )
    assert served and float(served[1]) >= 1, scraped[:3000]

    # A worker that dies is restarted (a new pid answers as worker 1).
    os.kill(pids[1], signal.SIGKILL)
    again = wait_for(
        "worker 1 restarted",
        lambda: (p := pids_by_worker(cluster, key))[1] != pids[1] and p,
        20,
        interval=0.1,
    )
    assert again[0] == cluster.cp.pid and alive(again[1])

    # A key revoked in the control plane is refused by both workers within the key
    # cache's TTL (1 s here): worker 1 reads the store itself.
    other = json.loads(cluster.ctl("keys", "create", "--tenant", "t2", "--json").stdout)
    assert pids_by_worker(cluster, other["secret"]).keys() == {0, 1}
    cluster.ctl("keys", "revoke", other["key"]["key_id"])
    time.sleep(1.05)  # the TTL is the bound under test: past it, no worker may admit it
    refused: set[int] = set()
    for _ in range(200):
        r = chat(cluster, other["secret"])
        assert r.status_code == 401, (r.status_code, r.headers.get("x-llmgw-worker"))
        refused.add(worker_of(r)[0])
        if refused == {0, 1}:
            break
    assert refused == {0, 1}

    rc, took = cluster.cp.terminate(timeout=15)
    assert rc == 0, cluster.cp.output()[-2000:]
    assert took < 10, f"llmgw-cp took {took:.1f} s to stop"
    wait_for("no router worker left", lambda: not alive(again[1]), 5, interval=0.05)
    assert not (cluster.root / "cp" / "router.sock").exists()


class Stream(threading.Thread):
    """A streamed chat completion on a connection served by worker 1; keeps the body."""

    def __init__(self, cluster: LocalCluster, key: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.key = cluster, key
        self.first_chunk = threading.Event()
        self.status: int | None = None
        self.body = b""
        self.done_at: float | None = None
        self.error: BaseException | None = None
        self.worker_pid = 0

    def run(self) -> None:
        request = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": TOKENS,
            "stream": True,
        }
        try:
            for _ in range(100):
                with (
                    httpx.Client(timeout=60) as client,
                    client.stream(
                        "POST",
                        self.cluster.router_url + "/chat/completions",
                        json=request,
                        headers={"Authorization": f"Bearer {self.key}"},
                    ) as r,
                ):
                    index, self.worker_pid = worker_of(r)
                    if index != 1:
                        continue  # worker 0 (in the control plane): try another connection
                    self.status = r.status_code
                    for chunk in r.iter_bytes():
                        self.body += chunk
                        self.first_chunk.set()
                    self.done_at = time.monotonic()
                    return
            raise AssertionError("no connection reached worker 1 in 100 tries")
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc
            self.first_chunk.set()


def test_drain_waits_for_a_request_in_flight_on_the_other_worker(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    start_fleet(cluster, tmp_path, ["n1", "n2"], drain_timeout_s=60)
    ((old_node, old),) = wait_for("the replica ready", lambda: ready_shards(cluster), 30)
    new_node = "n2" if old_node == "n1" else "n1"
    key = cluster.api_key()
    wait_for("a 200 through the router", lambda: chat(cluster, key).status_code == 200, 15)

    stream = Stream(cluster, key)
    stream.start()
    assert stream.first_chunk.wait(30), "no first chunk through worker 1"
    assert stream.error is None, stream.error
    cluster.ctl("drain", old_node)

    def retiring() -> bool:
        out = json.loads(cluster.ctl("replicas", "--json").stdout)["replicas"]
        states = {r["replica"]: r["state"] for r in out}
        return states.get(old["replica_id"]) == "retiring" and "ready" in states.values()

    wait_for("the old replica retiring behind a ready replacement", retiring, 20)
    assert stream.done_at is None, "the stream ended before the replacement was ready"
    # The old engine is kept while worker 1 still streams from it (the control plane's
    # own count is 0: without the workers' reports it would stop it now).
    assert all(alive(p) for p in old["pids"]), "the old engine stopped mid-request"
    # New requests go to the replacement, from both workers.
    ((_, new),) = [(n, s) for n, s in ready_shards(cluster) if n == new_node]
    pids_by_worker(cluster, key)

    stream.join(30)
    assert stream.error is None, stream.error
    assert stream.status == 200
    events = [e for e in stream.body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    text = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in (json.loads(e[6:]) for e in events[:-1])
        if c.get("choices")
    )
    assert text.split() == [f"tok{i}" for i in range(TOKENS)]
    assert stream.done_at is not None
    # Then, and well before the 60 s drain timeout, the old engine stops.
    wait_for("the old engine stopped", lambda: not any(alive(p) for p in old["pids"]), 15)
    assert time.monotonic() - stream.done_at < 15
    assert new["replica_id"] != old["replica_id"]

    # A control plane killed outright (no chance to stop its workers): the worker sees
    # its channel close and exits by itself.
    assert cluster.cp is not None and alive(stream.worker_pid)
    cluster.cp.kill9()
    wait_for("the orphaned worker gone", lambda: not alive(stream.worker_pid), 5, interval=0.05)


def test_in_flight_is_summed_only_from_fresh_reports_of_the_view_listed_now() -> None:
    from llmgw.cp._workers import WorkerHub, _Report
    from llmgw.router import StaticEndpoints

    source = StaticEndpoints()
    hub = WorkerHub(source, 3, {}, Path("/nonexistent"), Path("/nonexistent/admin.key"))
    assert hub.in_flight("e") is None  # nobody has reported: unknown, not 0
    now = time.monotonic()
    hub._reports[1] = _Report(source.version, {"e": 2}, now)
    assert hub.in_flight("e") is None  # worker 2 has not reported
    hub._reports[2] = _Report(source.version, {"e": 1, "f": 4}, now)
    assert hub.in_flight("e") == 3
    assert hub.in_flight("g") == 0  # absent from fresh reports: none there
    hub._reports[2] = _Report(source.version, {}, now - 5.0)
    assert hub.in_flight("e") is None  # worker 2 not heard from for 5 s
    hub._reports[2] = _Report(source.version, {}, now)
    source.replace([])  # a new view: a report about the older one says nothing of it
    assert hub.in_flight("e") is None
    hub._reports[1] = _Report(source.version, {}, now)
    hub._reports[2] = _Report(source.version, {}, now)
    assert hub.in_flight("e") == 0


async def test_quarantines_come_from_fresh_worker_reports_over_the_channel() -> None:
    """A wedge one worker saw is the replica's (llmgw/router/_wedge.py): its report line
    carries it, and a report older than STALE_S says nothing any more."""
    import json

    import trio.testing

    from llmgw.cp._workers import WorkerHub, _Lines
    from llmgw.router import StaticEndpoints

    source = StaticEndpoints()
    hub = WorkerHub(source, 3, {}, Path("/nonexistent"), Path("/nonexistent/admin.key"))
    assert hub.quarantined() == {}
    send, receive = trio.testing.memory_stream_one_way_pair()
    why = "wedged: 3 requests, no bytes for 10 s, /health 200"
    lines = [
        {"version": source.version, "in_flight": {"r1@n1": 3}, "quarantined": {"r1@n1": why}},
        {"version": source.version, "in_flight": {}},  # an older worker: no key at all
    ]
    await send.send_all(json.dumps(lines[0]).encode() + b"\n")
    await send.send_all(json.dumps(lines[1]).encode() + b"\n")
    await send.aclose()
    await hub._receive(1, _Lines(receive))  # reads to EOF
    assert hub.quarantined() == {}  # the last line said none
    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(json.dumps(lines[0]).encode() + b"\n")
    await send.aclose()
    await hub._receive(2, _Lines(receive))
    assert hub.quarantined() == {"r1@n1": why}
    assert hub.in_flight("r1@n1") == 3
    hub._reports[2].at -= 5.0  # worker 2 not heard from for 5 s
    assert hub.quarantined() == {}
