"""Issue 9's edges with real processes: an agent that never answers, a partition that
heals, a control plane restarted under agents that come back slowly.

Engine starts and stops are counted from outside the system: every engine is
launched through a wrapper that appends its pid and owner to a file before it
execs the fake engine, so a start shows however briefly it lived, and a stop
is a launched pid no longer alive. The control plane's own view is used only
to wait (node states, the reconciler's pass counter), never as the evidence.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import alive

from llmgw.testing import fake_engine
from llmgw.testing.cluster import LocalCluster, wait_for

TINY = {
    "name": "tiny",
    "source": "llmgw-test/tiny",  # a hub id: the fake engine reads no weights
    "replicas": 0,
    "profiles": [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 30}],
}


class Launches:
    """The engines launched under `root`: a wrapper logs each before it execs."""

    def __init__(self, root: Path) -> None:
        real = fake_engine.install(root / "real-bin", "llama-server")
        self.log = root / "launches.log"
        self.log.touch()
        self.wrapper = root / "bin" / "llama-server"
        self.wrapper.parent.mkdir(parents=True, exist_ok=True)
        # Probes (--version, --help) are not starts.
        self.wrapper.write_text(
            "#!/bin/sh\n"
            'case " $* " in *" --help"*|*" --version"*) ;; '
            f'*) echo "$$ $LLMGW_AGENT_STATE" >> {shlex.quote(str(self.log))} ;; esac\n'
            f'exec {shlex.quote(str(real))} "$@"\n'
        )
        self.wrapper.chmod(0o755)

    def rows(self) -> list[tuple[int, str]]:
        out = []
        for line in self.log.read_text().splitlines():
            pid, _, owner = line.partition(" ")
            out.append((int(pid), Path(owner).name))
        return out

    def by_node(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, node in self.rows():
            counts[node] = counts.get(node, 0) + 1
        return counts

    def stopped(self) -> list[int]:
        return [pid for pid, _ in self.rows() if not alive(pid)]


def reconciler(cluster: LocalCluster) -> dict[str, int]:
    """`ctl status --json`'s reconciler statistics, read over HTTP (`GET /api/v1/status`,
    which ctl prints as is): a ctl process per read takes seconds on a loaded machine,
    longer than the margins the settle tests compare against."""
    stats: dict[str, int] = cluster.first.api_get("/api/v1/status")["reconciler"]
    return stats


def wait_quiet_passes(cluster: LocalCluster, passes: int = 2, timeout: float = 30) -> None:
    """Until the reconciler is free to act (settled, the guard let go) and has then
    made `passes` more passes: whatever it was going to do, it has done."""

    def free() -> dict[str, int] | None:
        s = reconciler(cluster)
        return s if not s["settling"] and not s["holding"] else None

    stats = wait_for("the reconciler free to act", free, timeout)
    wait_for(
        f"{passes} more reconciler passes",
        lambda: reconciler(cluster)["passes"] >= stats["passes"] + passes,
        timeout,
    )


def fleet(cluster: LocalCluster, tmp_path: Path, nodes: list[str], **server: Any) -> Launches:
    launches = Launches(tmp_path)
    cluster.server_extra.update(server)
    cluster.setup(nodes)
    for node in nodes:
        cluster.write_agent_config(node, engine_paths={"llama-server": str(launches.wrapper)})
    cluster.start_cp()
    for node in nodes:
        cluster.start_agent(node, env={"LLMGW_FAKE_LOAD_DELAY": "0.2"})
    cluster.wait_states(dict.fromkeys(nodes, "ready"), timeout=30)
    return launches


def serve(cluster: LocalCluster, replicas: int) -> None:
    cluster.write_server_config([{**TINY, "replicas": replicas}])
    assert cluster.cp is not None
    cluster.cp.popen.send_signal(signal.SIGHUP)  # reload now, not at the next poll


def replicas(cluster: LocalCluster) -> list[dict[str, Any]]:
    """`GET /api/v1/replicas`, which `ctl replicas --json` prints as is: read over HTTP
    because it is polled (a ctl process per poll is ~0.4 s of CPU on the suite's two
    cores); `ctl replicas` itself is read where its table is what is checked."""
    return list(cluster.first.api_get("/api/v1/replicas")["replicas"])


def ready_replicas(cluster: LocalCluster) -> int:
    rows = replicas(cluster)
    return sum(r["state"] == "ready" for r in rows)


def stop(cluster: LocalCluster, *nodes: str) -> None:
    for node in nodes:
        os.kill(cluster.agents[node].pid, signal.SIGSTOP)


def cont(cluster: LocalCluster, *nodes: str) -> None:
    for node in nodes:
        os.kill(cluster.agents[node].pid, signal.SIGCONT)


@pytest.mark.slow(seconds=20)
def test_an_agent_that_never_answers_holds_up_only_its_own_start(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    nodes = ["a", "b", "c"]
    launches = fleet(cluster, tmp_path, nodes)
    wait_quiet_passes(cluster)
    stop(cluster, "a")  # accepts the call (the kernel does), never answers
    try:
        asked = time.monotonic()
        serve(cluster, 3)  # CPU replicas spread: one on each node, a's among them

        # The others start at once, not after a's call ends.
        wait_for("engines launched on b and c", lambda: launches.by_node() == {"b": 1, "c": 1}, 8)
        assert time.monotonic() - asked < 8
        assert cluster.cp is not None
        assert "did not answer startShard" not in cluster.cp.output()

        # The stuck call ends at its deadline, with that reason, in the log and in
        # `ctl replicas`.
        def failed_row() -> dict[str, Any] | None:
            rows = replicas(cluster)
            return next((r for r in rows if r["state"] == "failed"), None)

        row = wait_for("a's start failed", failed_row, 20)
        took = time.monotonic() - asked
        assert 10 <= took < 16, took
        assert row["nodes"] == ["a"]
        assert row["reason"] == "node a did not answer startShard in 10 s"
        assert "node a did not answer startShard in 10 s" in cluster.cp.output()
        table = cluster.ctl("replicas").stdout
        assert "did not answer startShard in 10 s" in table
        # a is left out of placement until heard from again: the replacement runs on b or c.
        wait_for("3 ready replicas", lambda: ready_replicas(cluster) == 3, 20)
        assert "a" not in launches.by_node()
    finally:
        cont(cluster, "a")


@pytest.mark.slow(seconds=25)
def test_a_partition_that_heals_starts_and_stops_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.heartbeat_interval_s = 0.5
    nodes = ["n1", "n2", "n3", "n4"]
    launches = fleet(cluster, tmp_path, nodes, missed_heartbeats=2, lost_after_s=2.0)
    serve(cluster, 4)
    wait_for("4 ready replicas", lambda: ready_replicas(cluster) == 4, 30)
    assert launches.by_node() == dict.fromkeys(nodes, 1)
    wait_quiet_passes(cluster)
    away = ["n2", "n3", "n4"]

    for round_, gap in (("together", 0.0), ("1 s apart", 1.0)):
        stop(cluster, *away)
        try:
            cluster.wait_states(dict.fromkeys(away, "lost"), timeout=20)
            held = reconciler(cluster)
            assert held["holding"] == 1, (round_, held)
        finally:
            for node in away:
                cont(cluster, node)
                time.sleep(gap)  # the scenario's own timing
        cluster.wait_states(dict.fromkeys(nodes, "ready"), timeout=20)
        wait_quiet_passes(cluster)
        assert launches.by_node() == dict.fromkeys(nodes, 1), round_
        assert launches.stopped() == [], round_
    assert ready_replicas(cluster) == 4


@pytest.mark.slow(seconds=25)
def test_a_restart_waits_for_agents_that_come_back_slowly(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.settle_s = 4.0
    nodes = ["s1", "s2", "s3", "s4"]
    launches = fleet(cluster, tmp_path, nodes)
    serve(cluster, 4)
    wait_for("4 ready replicas", lambda: ready_replicas(cluster) == 4, 30)
    store = cluster.root / "cp" / "store.sqlite3"  # the store's known nodes (SQLite, WAL)

    def known() -> list[str]:
        with contextlib.closing(sqlite3.connect(store)) as db:
            return [r[0] for r in db.execute("SELECT node_id FROM known_nodes ORDER BY node_id")]

    wait_for("known nodes kept", lambda: known() == nodes, 10)
    assert launches.by_node() == dict.fromkeys(nodes, 1)

    stop(cluster, *nodes)  # across the restart: each comes back only when continued
    try:
        assert cluster.cp is not None
        cluster.cp.kill9()
        started = time.monotonic()
        cluster.start_cp()
        # One every 3 s (less than the 4 s settle), the last after 12 s: well past
        # a fixed settle window of 4 s, or of 10 s.
        for i, node in enumerate(nodes, start=1):
            time.sleep(max(0.0, started + 3 * i - time.monotonic()))
            assert reconciler(cluster)["settling"] == 1, node
            cont(cluster, node)
    finally:
        cont(cluster, *nodes)
    cluster.wait_states(dict.fromkeys(nodes, "ready"), timeout=20)
    wait_quiet_passes(cluster)
    assert time.monotonic() - started > 12
    assert launches.by_node() == dict.fromkeys(nodes, 1)
    assert launches.stopped() == []
    assert ready_replicas(cluster) == 4
