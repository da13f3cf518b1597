"""Adoption after an agent restart: every engine that can be identified, and no other.

A process is adopted only when its pid, its start time and its command line
all match what run.json recorded. A shard whose processes are partly gone is
failed (what is left of it killed, only processes proven ours) with the
reason and last output; one whose spec cannot be read has its live processes
killed and its directory removed, and a process marked as started for this
agent whose shard nothing describes is killed too: a process holding GPUs
that nobody can describe is worse than none.
"""

from __future__ import annotations

import logging
import shutil
import signal
import time
from collections.abc import Set
from pathlib import Path

from llmgw.agent import _procfs, _runfile, _shard_logs
from llmgw.agent._processes import signal_group
from llmgw.agent._shard import Shard
from llmgw.core import HealthRun
from llmgw.errors import LlmgwError
from llmgw.model import ShardState

# Part of the supervisor, as operators know it.
log = logging.getLogger("llmgw.agent.supervisor")


def load(shard_dir: Path, *, failures: int, proc: Path) -> Shard | None:
    """The shard `shard_dir` describes, adopted (loading) or failed; None when nothing
    can describe it (its live processes are killed, its directory removed)."""
    run = _runfile.read_run(shard_dir)
    records = _runfile.records(run)
    try:
        spec = _runfile.read_spec(shard_dir)
    except (OSError, ValueError, LlmgwError) as exc:
        # Nothing can describe these processes: a process holding GPUs that
        # nobody can describe is worse than none.
        for record in records:
            status = _procfs.check(record.pid, record.start_time, record.argv, proc)
            if status is _procfs.Liveness.ALIVE:
                log.warning(
                    "killing %s (pid %d) of shard %s: its spec is unreadable (%s)",
                    record.name,
                    record.pid,
                    shard_dir.name,
                    exc,
                )
                signal_group(record.pid, signal.SIGKILL)
        shutil.rmtree(shard_dir, ignore_errors=True)
        return None
    shard = Shard(spec=spec, dir=shard_dir, health=HealthRun(failures), procs=records, adopted=True)
    recorded = run.get("state")
    if recorded == ShardState.FAILED.value:
        # Failed before the agent went away: its processes were stopped then.
        shard.state, shard.reason = ShardState.FAILED, run.get("reason")
        stamp = run.get("failed_at")
        shard.failed_at = float(stamp) if isinstance(stamp, (int, float)) else None
        for r in records:
            if _procfs.check(r.pid, r.start_time, r.argv, proc) is _procfs.Liveness.ALIVE:
                signal_group(r.pid, signal.SIGKILL)
        return shard
    statuses = {r.name: _procfs.check(r.pid, r.start_time, r.argv, proc) for r in records}
    dead = [r for r in records if statuses[r.name] is not _procfs.Liveness.ALIVE]
    if not records or dead or len(records) < len(spec.processes):
        # Part of the shard is gone: it cannot serve. Stop what is left of it
        # (only processes proven ours), and report it failed with why.
        why = []
        for r in dead:
            if statuses[r.name] is _procfs.Liveness.REUSED:
                why.append(
                    f"{r.name} (pid {r.pid}) is gone; the pid now belongs to another process"
                )
            else:
                why.append(f"{r.name} (pid {r.pid}) is gone")
        if len(records) < len(spec.processes):
            why.append("the agent stopped before every process had started")
        last = [
            line
            for r in dead
            for line in _shard_logs.last_lines(shard, r.name, _shard_logs.LAST_LINES)
        ]
        reason = "; ".join(why) + ("; last output:\n" + "\n".join(last) if last else "")
        for r in records:
            if statuses[r.name] is _procfs.Liveness.ALIVE:
                signal_group(r.pid, signal.SIGKILL)
        shard.state, shard.reason = ShardState.FAILED, reason
        shard.failed_at = time.time()
        _runfile.save_run(shard)
        log.warning("shard %s: not adopted: %s", spec.shard_id, reason.splitlines()[0])
        return shard
    # Not ready until a health check says so; the state on disk stays as it
    # was until then. One that was ready is serving, not loading: its failed
    # checks count from the first.
    shard.state = ShardState.LOADING
    shard.reason = None
    shard.health.counting = recorded in (ShardState.READY.value, ShardState.UNHEALTHY.value)
    log.info(
        "shard %s: adopted %s (pids %s), %s before; health-checking it",
        spec.shard_id,
        spec.engine,
        ",".join(str(r.pid) for r in records),
        recorded or "state unknown",
    )
    return shard


def kill_undescribed(owner: str, proc: Path, described: Set[str]) -> None:
    """Kill the process groups llmgw started for this agent whose shard nobody describes."""
    for pid, shard_id in _procfs.marked(owner, proc):
        if shard_id not in described:
            log.warning(
                "killing process group %d: it was started for shard %s, which has no spec",
                pid,
                shard_id,
            )
            signal_group(pid, signal.SIGKILL)
