"""Two control planes on one PostgreSQL: the standby takes over from a leader that hangs.

Real processes on loopback: a PostgreSQL started for the test, two llmgw-cp sharing it
(`store:`) and the PKI, three llmgw-agent listing both, and a model whose two replicas
run on real llama-server (a tiny GGUF): the point is that the engines the first leader
placed keep serving through the failover, which only a real engine shows.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import alive, llama_server_binary, postgres_server

from llmgw.testing.cluster import ControlPlane, LocalCluster, wait_for

LEASE_S = 3.0
# The standby tries for the lease every lease_s / 3: once the lease has run out it is
# taken at the next try ("lease + one retry"); the slack is for the query itself and a
# shared two-core machine.
TAKEOVER_BOUND_S = LEASE_S + LEASE_S / 3 + 1.5
SETTLE_S = 20.0
# An agent notices a frozen control plane when its next heartbeat (every 1 s) goes
# unanswered for twice the interval: within 3 s, before the takeover. The standby then
# still names the frozen leader; the agent does not go back to it (its session was just
# lost: llmgw/agent/_session.py LOST_RECENTLY_S) but asks the standby again after its
# backoff (reconnect_max_s: 1 s here), so it registers within a backoff of the takeover.
# Slack: 3 s on a shared machine. Following the standby back to the frozen leader would
# cost a 10 s dial and fail this bound.
AGENT_MOVE_BOUND_S = max(3 * 1.0, TAKEOVER_BOUND_S) + 1.0 + 3.0
NODES = ("a1", "a2", "a3")


@pytest.fixture
def pg() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


def log_time(line: str) -> float:
    """The wall-clock time a log line was written ("2026-12-01 18:22:21,854 INFO ...")."""
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def lines_after(text: str, since: float, pattern: str) -> list[str]:
    """The log lines matching `pattern` written at or after wall-clock `since`."""
    out = []
    for line in text.splitlines():
        if re.search(pattern, line) and line[:4].isdigit() and log_time(line) >= since - 0.001:
            out.append(line)
    return out


def chat(cp: ControlPlane, key: str) -> dict[str, Any]:
    response = httpx.post(
        cp.router_url + "/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200, (
        f"{cp.name}'s router: {response.status_code} {response.text}"
    )
    return dict(response.json())


def metric(cp: ControlPlane, name: str) -> float:
    """One sample of the admin listener's /metrics (the sum over its labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(cp.admin_url + "/metrics", timeout=10).text
    found = [
        s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == name
    ]
    assert found, f"no {name} on {cp.name}'s /metrics"
    return float(sum(found))


def shards(cp: ControlPlane) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """shard id -> (node, state, pids), as `cp` knows them."""
    nodes = json.loads(cp.ctl("nodes", "--json").stdout)["nodes"]
    return {
        s["shard_id"]: (n["node_id"], s["state"], tuple(s["pids"]))
        for n in nodes
        for s in n["shards"]
    }


def ready_replicas(cp: ControlPlane) -> dict[str, list[str]] | None:
    """replica id -> nodes, once both replicas of `tiny` are ready on `cp`. Polled, so read
    over HTTP (what `ctl replicas --json` prints as is): a ctl process per poll is ~0.4 s
    of CPU on the suite's two cores. `shards` reads through the ctl."""
    rows = cp.api_get("/api/v1/replicas")["replicas"]
    ready = {
        r["replica"]: r["nodes"] for r in rows if r["model"] == "tiny" and r["state"] == "ready"
    }
    return ready if len(ready) == 2 else None


@pytest.mark.slow(seconds=40)
def test_the_standby_takes_over_and_the_old_leader_is_fenced(
    pg: str, cluster: LocalCluster, tiny_model: Path
) -> None:
    """What is counted, precisely:

    - takeover: from the SIGSTOP of the leader's process group (llmgw-cp and its router
      workers) to the standby's own log line "leader: elected, epoch N" (its timestamp),
      bounded by lease + one try (lease_s / 3) + 1.5 s of slack;
    - agents moved: from the SIGSTOP to each agent's log line "registered with CP2 ...
      epoch E2", bounded by AGENT_MOVE_BOUND_S (how it is made up is said there);
    - fencing, after the SIGCONT: (a) `refused` = the agents' log lines "refused a
      command from epoch E1" after the SIGCONT, and the old leader's own count of the
      same, `llmgw_cp_commands_refused_stale_total` on its /metrics: the two must agree;
      (b) `accepted` = every shard state change or start any agent logged from the
      SIGSTOP to the end of the test. The test asserts accepted == 0, every agent's
      `<state_dir>/epoch` says the new epoch, and the old leader's admin API refuses a
      command ("standby; leader is ..."). The old leader holds no agent session when it
      wakes (the agents left it during the stop) and acts on nothing once its lease has
      run out by its own clock, so `refused` is 0 in practice: printed, not required to
      be positive (an agent refusing an older epoch is tests/agent/test_epoch_kept.py).
    """
    binary = llama_server_binary()
    cluster.server_extra.update(store=pg, lease_s=LEASE_S)
    # The new leader adopts what agents report once every known node is back, or after
    # the settle: the settle must outlast the last agent's arrival, or the new leader
    # replaces that agent's replicas (docs/operations.md says so).
    cluster.settle_s = SETTLE_S
    cluster.models = [
        {
            "name": "tiny",
            "source": str(tiny_model),
            "replicas": 2,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "engine_args": ["--ctx-size", "256", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cp1 = cluster.first
    cp2 = cluster.add_control_plane("cp2")
    cluster.setup(NODES)
    for node in NODES:
        # a1 dials the standby first: it must be refused and sent to the leader.
        order = [cp2.rpc, cp1.rpc] if node == "a1" else [cp1.rpc, cp2.rpc]
        cluster.write_agent_config(node, servers=order, engine_paths={"llama-server": binary})

    cluster.start_cp()
    first = wait_for("cp1 leading", lambda: (v := cp1.leader())["role"] == "leader" and v, 20)
    epoch1 = first["epoch"]
    assert isinstance(epoch1, int) and first["leader"]["rpc"] == cp1.rpc
    key = cluster.api_key("team-a")  # in the shared store: both routers know it
    cluster.start_cp("cp2")
    standby = wait_for(
        "cp2 standing by",
        lambda: (v := cp2.leader())["role"] == "standby" and v["leader"] and v,
        20,
    )
    assert standby["leader"] == {"rpc": cp1.rpc, "admin": cp1.admin}, standby
    assert standby["me"]["rpc"] == cp2.rpc

    for node in NODES:
        cluster.start_agent(node)
    cluster.wait_states({n: "ready" for n in NODES}, timeout=60)
    # "... refused registration: register: standby; leader is H:P" (the call prefixes it)
    refusal = (
        rf"control plane {re.escape(cp2.rpc)} refused registration: .*"
        rf"standby; leader is {re.escape(cp1.rpc)}$"
    )
    assert re.search(refusal, cluster.agents["a1"].output(), re.M), cluster.agents["a1"].output()
    for node in NODES:
        # The control plane holds a node ready once it has answered the registration;
        # the agent logs it once the answer is back: a moment later, on a loaded machine.
        registered = rf"registered with {re.escape(cp1.rpc)} .*epoch {epoch1}\)"
        wait_for(
            f"{node} logs its registration with cp1",
            lambda node=node, pattern=registered: re.search(pattern, cluster.agents[node].output()),
            20,
        )
    replicas = wait_for("two ready replicas on cp1", lambda: ready_replicas(cp1), 180)
    before = shards(cp1)
    assert len(before) == 2 and all(state == "ready" for _, state, _ in before.values()), before
    assert all(alive(p) for _, _, pids in before.values() for p in pids)
    # The standby's router serves too (it routes from the fleet the leader knows).
    answered = wait_for("an answer through the standby's router", lambda: chat(cp2, key), 30)
    assert answered["choices"][0]["message"]["role"] == "assistant"
    assert chat(cp1, key)["usage"]["completion_tokens"] == 4

    # The leader hangs.
    assert cluster.cp is not None
    frozen_at = time.time()
    cluster.cp.freeze()
    took_over = wait_for("cp2 leading", lambda: (v := cp2.leader())["role"] == "leader" and v, 30)
    epoch2 = took_over["epoch"]
    assert isinstance(epoch2, int) and epoch2 > epoch1, (epoch1, took_over)
    assert took_over["leader"]["rpc"] == cp2.rpc
    elected = lines_after(cp2.log.read_text(), frozen_at, rf"leader: elected, epoch {epoch2}\b")
    assert len(elected) == 1, elected
    takeover_s = log_time(elected[0]) - frozen_at
    assert takeover_s <= TAKEOVER_BOUND_S, f"took over {takeover_s:.1f} s after the SIGSTOP"

    def moved() -> dict[str, float] | None:
        """node -> when it registered with cp2 at the new epoch (its log's time)."""
        when = {}
        for node in NODES:
            found = lines_after(
                cluster.agents[node].output(),
                frozen_at,
                rf"registered with {re.escape(cp2.rpc)} .*epoch {epoch2}\)",
            )
            if not found:
                return None
            when[node] = log_time(found[0]) - frozen_at
        return when

    moved_s = wait_for("every agent registered with cp2", moved, 60)
    assert max(moved_s.values()) <= AGENT_MOVE_BOUND_S, moved_s
    cluster_states = json.loads(cp2.ctl("nodes", "--json").stdout)["nodes"]
    assert {n["node_id"]: n["state"] for n in cluster_states} == {n: "ready" for n in NODES}
    # No engine restarted: the same shards, the same processes, on the same nodes.
    after = wait_for("two ready replicas on cp2", lambda: ready_replicas(cp2), 60)
    assert after == replicas
    assert shards(cp2) == before
    assert all(alive(p) for _, _, pids in before.values() for p in pids)
    assert chat(cp2, key)["usage"]["completion_tokens"] == 4
    ready_s = time.time() - frozen_at

    # The old leader wakes: it finds it lost the lease, and is fenced.
    thawed_at = time.time()
    cluster.cp.thaw()
    old = wait_for(
        "cp1 a standby naming cp2",
        lambda: (v := cp1.leader())["role"] == "standby" and v["leader"] and v,
        30,
    )
    assert old["leader"] == {"rpc": cp2.rpc, "admin": cp2.admin}, old
    assert old["epoch"] is None or old["epoch"] >= epoch2, old
    cp1_log = cp1.log.read_text()
    assert lines_after(cp1_log, thawed_at, rf"leader: deposed at epoch {epoch1}: ")
    # Asked to act, it refuses and names the leader.
    refused_admin = cp1.ctl("cordon", "a2", check=False)
    assert refused_admin.returncode == 1, refused_admin
    said = refused_admin.stderr + refused_admin.stdout
    assert f"standby; leader is {cp2.rpc} (admin {cp2.admin})" in said, said
    refused_by_agents = sum(
        len(
            lines_after(
                cluster.agents[n].output(), thawed_at, rf"refused a command from epoch {epoch1}\b"
            )
        )
        for n in NODES
    )
    refused_stale = metric(cp1, "llmgw_cp_commands_refused_stale_total")
    accepted = [
        line
        for n in NODES
        for line in lines_after(
            cluster.agents[n].output(), frozen_at, r"shard \S+: (\w+ -> \w+|started )"
        )
    ]
    assert accepted == [], accepted
    # Both ends count the same refusals: what the agents refused, the old leader was told.
    assert refused_stale == refused_by_agents, (refused_stale, refused_by_agents)
    for node in NODES:
        assert (cluster.root / node / "epoch").read_text().strip() == str(epoch2)
    assert shards(cp2) == before
    print(
        f"failover: takeover {takeover_s:.1f} s (bound {TAKEOVER_BOUND_S:.1f} s), agents moved "
        + ", ".join(f"{n} {s:.1f} s" for n, s in sorted(moved_s.items()))
        + f", replicas ready and answering {ready_s:.1f} s after the SIGSTOP; "
        f"old epoch {epoch1} -> {epoch2}; old leader's commands after the takeover: "
        f"{refused_by_agents} refused by agents, {refused_stale} refusals it counted, "
        f"0 accepted"
    )
