"""A shard as the supervisor holds it: its spec, its processes' records, its state.

`ProcRecord` is one process as run.json records it (pid, start time, argv) and
says whether it still runs; `Shard` is the supervisor's bookkeeping for one
shard, and `Shard.report` is what the node says about it.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import trio

from llmgw import model
from llmgw.agent import _procfs
from llmgw.core import HealthRun
from llmgw.errors import LlmgwError
from llmgw.model import ShardState


class ShardError(LlmgwError):
    """A shard could not be started or stopped; the message says why."""


@attrs.define
class ProcRecord:
    name: str
    role: str
    argv: list[str]
    pid: int
    start_time: int
    own: bool = False  # our child (False: adopted from an earlier agent)
    exit_code: int | None = None

    def poll(self, proc: Path) -> bool:
        """Is it still running? Reaps our own child and records its exit code."""
        if self.exit_code is not None:
            return False
        if self.own:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.own = False  # reaped elsewhere; fall back to /proc
            else:
                if pid == 0:
                    return True
                self.exit_code = os.waitstatus_to_exitcode(status)
                return False
        return _procfs.check(self.pid, self.start_time, self.argv, proc) is _procfs.Liveness.ALIVE


@attrs.define(eq=False)
class Shard:
    spec: model.ShardSpec
    dir: Path
    health: HealthRun
    state: ShardState = ShardState.STARTING
    reason: str | None = None
    procs: list[ProcRecord] = attrs.field(factory=list)
    stopping: bool = False
    failing: bool = False
    adopted: bool = False
    failed_at: float | None = None  # unix time
    done: trio.Event = attrs.field(factory=trio.Event)
    scope: trio.CancelScope | None = None
    # What stands for each source of the spec in the argv (fetched here), once prepared.
    local_paths: dict[str, str] = attrs.field(factory=dict)
    prepared: bool = False
    replacing: bool = False  # its processes are being stopped for a relaunch: not a failure
    relaunch: trio.CancelScope | None = None  # a relaunch making its sources ready (stop ends it)
    pending: model.ShardSpec | None = None  # the spec a relaunch under way starts it from
    reports: int = 0  # how many reports were made: each one's seq

    def report(self) -> model.ShardReport:
        """What the shard is now, numbered: a later report has a higher `seq`."""
        self.reports += 1
        return model.ShardReport(
            shard_id=self.spec.shard_id,
            model=self.spec.model,
            engine=self.spec.engine,
            state=self.state.value,
            port=self.spec.port,
            pids=tuple(p.pid for p in self.procs),
            reason=self.reason,
            profile_fingerprint=self.spec.profile_fingerprint,
            replica_id=self.spec.replica_id,
            model_name=self.spec.model_name,
            rank=self.spec.rank,
            ranks=self.spec.ranks,
            gpus=self.spec.gpus,
            source=self.spec.source,
            seq=self.reports,
            adapters=self.spec.adapters,
            gpu_memory_mib=self.spec.gpu_memory_mib,
        )
