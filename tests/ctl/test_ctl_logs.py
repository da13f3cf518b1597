"""`llmgw ctl logs` with real processes: the agent's own log, a shard followed, a frozen agent."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 30

# An "engine" that prints a line a second, stamped with when it printed it.
TICKER = """#!{python}
import sys, time
print("ticker starting", flush=True)
n = 0
while True:
    n += 1
    print(f"tick {{n}} at {{time.time():.3f}}", flush=True)
    time.sleep(1)
"""


class Follower:
    """`llmgw ctl logs ... -f` running, each stdout line with when it arrived."""

    def __init__(self, cluster: LocalCluster, *args: str) -> None:
        env = {**cluster.env, "LLMGW_ADMIN_URL": cluster.admin_url}
        env["LLMGW_ADMIN_KEY"] = cluster.admin_key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "ctl", "logs", *args, "-f"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.time(), line.rstrip("\n")))

    def next_line(self, timeout: float = TIMEOUT) -> tuple[float, str]:
        return self.lines.get(timeout=timeout)

    def until(self, want: str, timeout: float = TIMEOUT) -> str:
        end = time.monotonic() + timeout
        while True:
            _, line = self.next_line(max(0.1, end - time.monotonic()))
            if want in line:
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def node(cluster: LocalCluster, tmp_path: Path) -> Iterator[LocalCluster]:
    ticker = tmp_path / "bin" / "ticker"
    ticker.parent.mkdir()
    ticker.write_text(TICKER.format(python=sys.executable))
    ticker.chmod(0o755)
    cluster.setup(["cpu-1"])
    cluster.write_agent_config("cpu-1", engine_paths={"llama-server": str(ticker)})
    cluster.start_cp()
    # DEBUG: the agent's log says when a follower ends, and why.
    agent = cluster.start_agent("cpu-1", env={"LLMGW_LOG_LEVEL": "DEBUG"})
    cluster.wait_states({"cpu-1": "ready"}, TIMEOUT)
    try:
        yield cluster
    finally:
        # A frozen agent takes no SIGTERM: thaw it so the cluster can stop it.
        if agent.alive():
            os.kill(agent.pid, signal.SIGCONT)


@pytest.mark.slow
def test_logs_reads_the_agents_own_log_and_follows_a_shard_within_2_s(
    node: LocalCluster,
) -> None:
    cluster = node
    own = cluster.ctl("logs", "cpu-1").stdout.splitlines()
    # The agent's log as written: timestamp, level, logger, message.
    registered = [line for line in own if "registered with 127.0.0.1:" in line]
    assert len(registered) == 1, own
    assert " INFO llmgw.agent" in registered[0]
    assert "agent cpu-1 starting; control planes:" in cluster.ctl("logs", "cpu-1").stdout
    assert len(cluster.ctl("logs", "cpu-1", "-n", "1").stdout.splitlines()) == 1

    shard = cluster.ctl("shard", "start", "cpu-1", "--engine", "llama-server", "--model", "/m/t")
    shard_id = shard.stdout.split()[0]
    source = f"{shard_id}/engine/stdout"
    sources = cluster.ctl("logs", "cpu-1", "--sources").stdout.splitlines()
    assert sources == ["agent", source, f"{shard_id}/engine/stderr"]
    wait_for("the ticker's first tick", lambda: "tick 1 at" in cluster.ctl(
        "logs", "cpu-1", "--source", source).stdout, TIMEOUT)  # fmt: skip

    follow = Follower(cluster, "cpu-1", "--source", source, "-n", "1")
    try:
        _, first = follow.next_line()
        assert first.startswith("tick "), first  # the tail: the last line
        stamped = []
        while len(stamped) < 4:
            arrived, line = follow.next_line()
            word, n, at, printed = line.split()
            assert (word, at) == ("tick", "at"), line
            stamped.append((int(n), arrived - float(printed)))
        numbers = [n for n, _ in stamped]
        assert numbers == list(range(numbers[0], numbers[0] + 4)), stamped
        assert numbers[0] == int(first.split()[1]) + 1, (first, stamped)  # nothing lost
        assert all(0 <= lag < 2.0 for _, lag in stamped), stamped
    finally:
        follow.stop()
    # The reader went away: the agent's follower notices at its next push and ends.
    ended = f"following {source} ended: line: the reader of these logs went away"
    wait_for("the follower's end", lambda: ended in (cluster.root / "cpu-1.log").read_text(), 5)

    # Unknown sources are named, with where to find the known ones.
    unknown = cluster.ctl("logs", "cpu-1", "--source", f"{shard_id}/ray/stdout", check=False)
    assert unknown.returncode == 1
    assert f"no log source '{shard_id}/ray/stdout' on node cpu-1; known: {source}, " in (
        unknown.stderr
    )

    # The shard stopped: a follow of it ends, saying so, rc 0.
    follow = Follower(cluster, "cpu-1", "--source", source)
    try:
        follow.until("tick ")
        cluster.ctl("shard", "stop", "cpu-1", shard_id)
        assert follow.proc.wait(TIMEOUT) == 0
        assert follow.proc.stderr is not None
        assert "ended (it is gone)" in follow.proc.stderr.read()
    finally:
        follow.stop()


@pytest.mark.slow
def test_a_frozen_agent_ends_logs_and_a_follow_with_no_answer_in_10_s(
    node: LocalCluster,
) -> None:
    cluster = node
    agent = cluster.agents["cpu-1"]
    follow = Follower(cluster, "cpu-1")
    try:
        follow.until("registered with")
        os.kill(agent.pid, signal.SIGSTOP)
        started = time.monotonic()
        tail = cluster.ctl("logs", "cpu-1", check=False)
        took = time.monotonic() - started
        assert tail.returncode == 1, tail
        assert "node cpu-1: the agent did not answer in 10 s" in tail.stderr, tail.stderr
        assert len(tail.stderr.strip().splitlines()) == 1 and "Traceback" not in tail.stderr
        assert 9 <= took < 15, took
        # The follow that was running ends too, with the same words, not a hang.
        assert follow.proc.wait(TIMEOUT) == 1
        assert follow.proc.stderr is not None
        said = follow.proc.stderr.read()
        assert "node cpu-1: the agent did not answer in 10 s" in said, said
        assert time.monotonic() - started < 20
    finally:
        follow.stop()
        os.kill(agent.pid, signal.SIGCONT)
