"""No request fails while the lease changes hands (issue 24).

Real processes on loopback: a PostgreSQL started for the test, two llmgw-cp sharing it,
two llmgw-agent listing both (in opposite orders), each running the fake llama-server
(llmgw/testing/fake_engine.py: the engine is not what is tried here, its pid is). A
steady stream of chat requests goes to both routers while one of three switches
happens:

- `sigstop`: the leader's process group is stopped (a machine that hangs);
- `kill9`: the leader is killed;
- `store_outage`: PostgreSQL is stopped for 10 s, which deposes the leader (its renewal
  fails); when it is started again the deposed leader wins the lease back. The standby
  is held (SIGSTOP) for the moment the store returns, so that it is the deposed leader
  that takes the lease: the case where agents used to stay away from it for 20 s.

What "failed" means. The stream is a client behind a load balancer over the two
routers, and does what such a balancer does with a backend that does not answer: each
request goes first to one router (alternately), with a 1 s connect and 2 s read
timeout (tests/helpers.py BalancedLoad); a connection refused, a reset or a timeout
sends it to the other router, once, and the silent router is passed over for 3 s (a
balancer's passive check). A request fails when the router that answered it answered anything but a 200 with a
completion (a 503 `no_ready_replica` included: it is not retried elsewhere), or when
neither answered within the timeouts. A router that is stopped or dead cannot answer
at all: its requests are the balancer's to move, and they count as failed only when
the other router fails them too. docs/operations.md "Two control planes" says the
same for operators.

Asserted in each case: 0 failed requests; 0 engine restarts (the same shards with the
same pids on the new leader, the pids alive, no shard start or state change in any
agent's log after the switch); the stream kept going (answers through the switch).
For the store outage also: the agents registered with the re-elected leader less than
LOST_RECENTLY_S (20 s) after it dropped their sessions, which the old rule forbade.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import BalancedLoad, Postgres, alive, postgres_instance, tiny_catalog

from llmgw.agent._session import LOST_RECENTLY_S
from llmgw.testing import fake_engine
from llmgw.testing.cluster import ControlPlane, LocalCluster, wait_for

LEASE_S = 3.0
SETTLE_S = 20.0
NODES = ("a1", "a2")
OUTAGE_S = 10.0
STREAM_AFTER_S = 4.0  # the stream runs on this long once everything has moved


@pytest.fixture
def pg() -> Iterator[Postgres]:
    with postgres_instance(create_user=True) as pg:
        yield pg


def log_time(line: str) -> float:
    from datetime import datetime

    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def lines_after(text: str, since: float, pattern: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line[:4].isdigit() and log_time(line) >= since - 0.001 and re.search(pattern, line)
    ]


def leader(cp: ControlPlane) -> dict[str, Any] | None:
    try:
        view = cp.leader()
    except (httpx.HTTPError, AssertionError):
        return None
    return view if view["role"] == "leader" else None


def shards(cp: ControlPlane) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """shard id -> (node, state, pids), as `cp` knows them: its `GET /api/v1/nodes` (what
    `ctl nodes --json` prints), read over HTTP because it is polled (a ctl process per
    poll is ~0.4 s of CPU on the suite's two cores)."""
    nodes = cp.api_get("/api/v1/nodes")["nodes"]
    return {
        s["shard_id"]: (n["node_id"], s["state"], tuple(s["pids"]))
        for n in nodes
        for s in n["shards"]
    }


def two_ready(cp: ControlPlane) -> dict[str, tuple[str, str, tuple[int, ...]]] | None:
    """`shards(cp)` once both of tiny's shards are ready there."""
    got = shards(cp)
    return got if sum(state == "ready" for _, state, _ in got.values()) == 2 else None


def answers(cp: ControlPlane, key: str) -> bool:
    """One chat completion through `cp`'s router comes back 200."""
    try:
        r = httpx.post(
            f"{cp.router_url}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            timeout=5.0,
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def registered(cluster: LocalCluster, cp: ControlPlane, epoch: int, since: float) -> bool:
    pattern = rf"registered with {re.escape(cp.rpc)} .*epoch {epoch}\)"
    return all(lines_after(cluster.agents[n].output(), since, pattern) for n in NODES)


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("switch", ["sigstop", "kill9", "store_outage"])
def test_no_request_fails_while_the_lease_moves(
    switch: str, pg: Postgres, cluster: LocalCluster, tmp_path: Path
) -> None:
    assert pg.dsn is not None
    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.server_extra.update(store=pg.dsn, lease_s=LEASE_S)
    cluster.settle_s = SETTLE_S
    cluster.models = tiny_catalog(2)
    cp1 = cluster.first
    cp2 = cluster.add_control_plane("cp2")
    cluster.setup(NODES)
    cluster.write_agent_config(
        "a1", servers=[cp1.rpc, cp2.rpc], engine_paths={"llama-server": str(llama)}
    )
    cluster.write_agent_config(
        "a2", servers=[cp2.rpc, cp1.rpc], engine_paths={"llama-server": str(llama)}
    )
    cluster.start_cp()
    epoch1 = wait_for("cp1 leading", lambda: (v := leader(cp1)) and v["epoch"], 20)
    key = cluster.api_key("team-a")
    cluster.start_cp("cp2")
    wait_for("cp2 standing by", lambda: cp2.leader()["role"] == "standby", 20)
    for node in NODES:
        cluster.start_agent(node)
    before = wait_for(
        "two ready shards on cp1",
        lambda: two_ready(cp1),
        60,
    )
    pids = [p for _, _, ps in before.values() for p in ps]
    assert pids and all(alive(p) for p in pids), before
    # The standby routes by the list the leader publishes (read every second) once its
    # router has found those engines healthy: the stream starts when both routers answer.
    for cp in (cp1, cp2):
        wait_for(f"{cp.name}'s router answering", lambda cp=cp: answers(cp, key), 30)

    stream = BalancedLoad([(cp.name, cp.router_url) for cp in (cp1, cp2)], key)
    stream.start()
    try:
        # Both routers answer before the switch (the standby from the published list).
        wait_for("answers through both routers", lambda: stream.snapshot()[0] >= 20, 30)
        assert stream.failed == [], stream.failed
        assert cp1.proc is not None and cp2.proc is not None
        switched_at = time.time()
        if switch == "sigstop":
            cp1.proc.freeze()
            new, old = cp2, cp1
        elif switch == "kill9":
            cp1.proc.kill9()
            new, old = cp2, cp1
        else:
            pg.stop()
            wait_for(
                "cp1 deposed by the outage",
                lambda: lines_after(cp1.log.read_text(), switched_at, r"leader: deposed at epoch"),
                3 * LEASE_S,
            )
            time.sleep(max(0.0, switched_at + OUTAGE_S - time.time()))
            # The standby is held while the store returns: the deposed leader takes the lease.
            cp2.proc.freeze()
            try:
                pg.start()
                wait_for("cp1 elected again", lambda: leader(cp1), 15)
            finally:
                cp2.proc.thaw()
            new, old = cp1, cp2
        took = wait_for(f"{new.name} leading", lambda: leader(new), 30)
        epoch2 = took["epoch"]
        assert isinstance(epoch2, int) and epoch2 > epoch1, (epoch1, took)
        elected = lines_after(
            new.log.read_text(), switched_at, rf"leader: elected, epoch {epoch2}\b"
        )
        assert len(elected) == 1, elected
        wait_for(
            f"both agents registered with {new.name} at epoch {epoch2}",
            lambda: registered(cluster, new, epoch2, switched_at),
            45,
        )
        answered = stream.snapshot()[0]
        time.sleep(STREAM_AFTER_S)
        assert stream.snapshot()[0] > answered, "the stream stopped"
    finally:
        stream.close()
        if switch == "sigstop":
            cp1.proc.thaw()  # type: ignore[union-attr]

    # No engine restarted: the same shards with the same processes, as the new leader sees.
    after = wait_for(
        "two ready shards on the new leader",
        lambda: two_ready(new),
        30,
    )
    assert after == before
    assert all(alive(p) for p in pids)
    started = [
        line
        for n in NODES
        for line in lines_after(
            cluster.agents[n].output(), switched_at, r"shard \S+: (\w+ -> \w+|started )"
        )
    ]
    assert started == [], started
    new_log = new.log.read_text()
    assert "probably the one cut off" not in new_log
    if switch == "store_outage":
        # The agents came back to the re-elected leader within LOST_RECENTLY_S of losing it:
        # a standby's refusal named it at the new epoch (llmgw/agent/_session.py).
        deposed = lines_after(new_log, switched_at, r"leader: deposed at epoch")
        back = max(
            log_time(
                lines_after(
                    cluster.agents[n].output(),
                    switched_at,
                    rf"registered with {re.escape(new.rpc)} .*epoch {epoch2}\)",
                )[0]
            )
            for n in NODES
        )
        assert back - log_time(deposed[0]) < LOST_RECENTLY_S, (deposed, back)
    takeover_s = log_time(elected[0]) - switched_at
    handover = lines_after(new_log, switched_at, r"endpoints: handover over after")
    print(
        f"{switch}: {stream.ok} answered ({stream.moved} by the other router after no answer), "
        f"{len(stream.failed)} failed; {new.name} elected {takeover_s:.1f} s after the switch; "
        f"{handover[-1].split('endpoints: ')[-1] if handover else 'no handover logged'}; "
        f"old leader {old.name}"
    )
    assert stream.failed == [], stream.failed
