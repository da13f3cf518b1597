"""A tenant's rpm holds fleet-wide: two control planes on one PostgreSQL, two router
workers each, one tenant at 600 requests a minute, sent 900 a minute spread over both
control planes' ports and (a new connection per request: the kernel picks the worker
per connection) their four workers. Over two whole wall-clock minutes (the limiter's
windows), each minute's 200s are 600 +- 5 %; before budgets were leased from the store,
each control plane admitted the whole limit (all 900 here).

The same fleet shows the autoscaler's signals summed over every router (issue 25):
`tiny` autoscales between 1 and 1 (the count holds), and while the load runs the
leader's sample sums four routers, the standby's two workers among them, and the
requests in flight there.

Cheap for what it shows: fake engines (llmgw/testing/fake_engine.py) answer at once,
a refused request is a 429 the router writes itself, and the setup overlaps the wait
for the first whole minute.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import postgres_server

from llmgw.testing import fake_engine
from llmgw.testing.cluster import ControlPlane, LocalCluster, wait_for

RPM = 600
SEND_PER_S = 15.0  # 900 a minute: half as much again as the limit
TOLERANCE = 0.05
_WORKER = re.compile(r"(\d+); pid=(\d+)")

TINY = {
    "name": "tiny",
    "source": "llmgw-test/tiny",  # a hub id: the fake engine reads no weights
    "autoscale": {"min": 1, "max": 1},
    "profiles": [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 30}],
}


@pytest.fixture
def pg() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


def answers_through(cp: ControlPlane, key: str) -> bool:
    r = httpx.post(
        cp.router_url + "/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        timeout=10,
    )
    return r.status_code == 200


async def post(host: str, port: int, key: str) -> tuple[int, dict[str, str], bytes]:
    """One chat request on a new connection (`Connection: close`): status, headers, body.
    By hand, so 15 a second cost the sender little on a shared two-core machine."""
    body = b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"max_tokens":1}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(head + body)
            data = bytearray()
            while chunk := await stream.receive_some(65536):
                data += chunk
    raw_head, _, rest = bytes(data).partition(b"\r\n\r\n")
    status_line, *lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return int(status_line.split()[1]), headers, rest


async def send_all(
    ports: list[int], key: str, start: float, end: float, refusals: list[tuple[str, int]]
) -> list[tuple[float, int, str | None]]:
    """Requests from `start` until wall-clock `end`, SEND_PER_S a second, taking the
    routers' ports in turn, each on a new connection; (sent at, status, "port/worker") for
    each, and (message, Retry-After) of each 429 into `refusals`."""
    results: list[tuple[float, int, str | None]] = []

    async def one(port: int, sent: float) -> None:
        status, headers, body = await post("127.0.0.1", port, key)
        if status == 429:
            message = json.loads(body.decode())["error"]["message"]
            refusals.append((message, int(headers["retry-after"])))
        m = _WORKER.match(headers.get("x-llmgw-worker", ""))
        results.append((sent, status, f"{port}/{m[1]}" if m else None))

    async with trio.open_nursery() as nursery:
        i = 0
        while True:
            at = start + i / SEND_PER_S
            if at >= end:
                break
            await trio.sleep(max(0.0, at - time.time()))
            nursery.start_soon(one, ports[i % len(ports)], time.time())
            i += 1
    return results


@pytest.mark.slow(seconds=150)
def test_two_control_planes_with_two_workers_each_hold_one_tenants_rpm(
    pg: str, cluster: LocalCluster, tmp_path: Path
) -> None:
    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.server_extra.update(store=pg, lease_s=3.0)
    cluster.router_extra = {"workers": 2}
    cluster.models = [TINY]
    cp1 = cluster.first
    cp2 = cluster.add_control_plane("cp2")
    cluster.setup(["cpu-1"])
    cluster.write_agent_config("cpu-1", engine_paths={"llama-server": str(llama)})
    cluster.start_cp()
    wait_for("cp1 leading", lambda: cp1.leader()["role"] == "leader", 20)
    cluster.ctl("tenants", "create", "team-a", "--rpm", str(RPM))
    key = cluster.api_key("team-a")
    cluster.start_cp("cp2")
    cluster.start_agent("cpu-1", env={"LLMGW_FAKE_LOAD_DELAY": "0.2", "LLMGW_FAKE_SLOTS": "64"})
    for cp in (cp1, cp2):
        wait_for(
            f"an answer through {cp.name}'s router", lambda cp=cp: answers_through(cp, key), 60
        )

    # Two whole windows; sending starts now, so the minute before the first fills up too
    # (its end, too early to count, shows nothing carries over from it).
    first = math.ceil(time.time() / 60) * 60
    refusals: list[tuple[str, int]] = []
    loads: list[dict[str, Any]] = []
    done = threading.Event()

    def sample_leader() -> None:  # what the leader's autoscaler sums, once a second
        while not done.wait(1.0):
            load = cp1.api_get("/api/v1/autoscale/tiny")["load"]
            if load is not None:
                loads.append(load)

    sampler = threading.Thread(target=sample_leader)
    sampler.start()
    try:
        results = trio.run(
            send_all, [cp1.router_port, cp2.router_port], key, time.time(), first + 120, refusals
        )
    finally:
        done.set()
        sampler.join(30)

    statuses = Counter(status for _, status, _ in results)
    assert set(statuses) <= {200, 429}, statuses
    per_window = [
        sum(1 for sent, status, _ in results if status == 200 and w <= sent < w + 60)
        for w in (first, first + 60)
    ]
    sent_per_window = [
        sum(1 for sent, _, _ in results if w <= sent < w + 60) for w in (first, first + 60)
    ]
    served_by = Counter(who for _, status, who in results if status == 200)
    print(f"200s per minute {per_window} of {sent_per_window} sent; by worker {dict(served_by)}")
    assert all(s >= RPM * 1.4 for s in sent_per_window), sent_per_window  # well above the limit
    for n in per_window:
        assert RPM * (1 - TOLERANCE) <= n <= RPM * (1 + TOLERANCE), per_window
    # Every worker of both control planes admitted its part.
    assert len(served_by) == 4 and None not in served_by, served_by
    # The 429s say why, and when the next window starts (or, while a lease is on its way
    # to that worker, a second).
    # The leader's signal summed every router: both of its own and both of the standby's.
    # (Their figures are gauges read once a second of requests that take milliseconds
    # here: that they are summed right is tests/cp/test_autoscaler.py's.)
    assert loads and max(x["routers"] for x in loads) == 4, loads[-3:]
    assert refusals, "no 429 was answered"
    for message, retry_after in refusals:
        assert message.startswith("tenant team-a: over its 600 requests per minute; retry in")
        assert 1 <= retry_after <= 60, refusals
