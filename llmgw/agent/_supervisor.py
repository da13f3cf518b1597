"""The supervisor: runs shards, and never loses or orphans an engine.

A shard is a trio task; each of its processes is watched by a task inside it.
Every process runs in its own process group (its own session), with its
output going to files in the shard's state directory, not to pipes: an engine
must outlive a `kill -9` of the agent, and a pipe to a dead agent would kill
it on its next write (`_processes`).

The full spec, the pids and their start times are written to the state
directory before anything else happens (`_runfile`), so a restarted agent
adopts every live engine it can identify (pid, start time and command line
all matching), health-checks the adopted ones, and kills an engine it cannot
describe (`_adopt`).

A shard's state moves only through the table in llmgw.core (`_shard`): a
ready shard stays health-checked (`_health`), and one whose checks fail
`health.failures` times in a row is reported unhealthy, with those failures
as its reason; an event the table refuses is logged as a bug and leaves the
shard where it was (`Supervisor._apply` says why it does not raise). The
last few failed shards' directories (logs included) are kept under
`<state_dir>/failed/` (`_failed`) so that `logs` can still say what happened
(`_shard_logs`).

Before a new shard's first process, its source is made ready (`_sources`: a
local path checked, a URL or `mirror:` source fetched) inside the shard's task:
the shard stays `starting` meanwhile, `stop` cancels the fetch with it, and a
source that cannot be made ready fails it with that one line. Its LoRA
adapters' sources are made ready with it. Every argv element equal to a source
(or starting with one and ":") is then the local path; run.json records that
argv, so adoption after a restart matches it and fetches nothing.

`relaunch` starts a running shard again with other adapters (`_relaunch` says
how; `replace` is its step that stops the old processes and starts the new).

This module holds the coordination: which task runs what, in which order a
shard starts, fails and stops, and what is reported.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from llmgw import model
from llmgw.agent import _adopt, _health, _processes, _procfs, _relaunch, _runfile, _shard_logs
from llmgw.agent._failed import FAILED_KEPT, FailedShards, read_kept

# HealthPolicy is the supervisor's to configure: callers import it from here.
from llmgw.agent._health import HealthPolicy as HealthPolicy
from llmgw.agent._shard import ProcRecord, Shard, ShardError
from llmgw.agent._shard_logs import TAIL_LINES
from llmgw.agent._sources import SourceError, Sources
from llmgw.core import (
    RUNNING_SHARD_STATES,
    HealthRun,
    InvalidShardTransition,
    ShardEvent,
    next_shard_state,
)
from llmgw.errors import NotFound, UsageError
from llmgw.model import ShardState

log = logging.getLogger("llmgw.agent.supervisor")

_SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Supervisor:
    def __init__(
        self,
        state_dir: Path,
        *,
        on_change: Callable[[model.ShardReport], None] = lambda report: None,
        engine_paths: Mapping[str, str] | None = None,
        grace_s: float = 10.0,
        health: HealthPolicy = _health.DEFAULT_POLICY,
        failed_kept: int = FAILED_KEPT,
        node_id: str | None = None,
        proc: Path = _procfs.PROC,
        sources: Sources | None = None,
        path_of: Callable[[str], str | None] = lambda engine: None,
    ) -> None:
        self.state_dir = state_dir
        self.shards_dir = state_dir / "shards"
        self._failed = FailedShards(state_dir / "failed", failed_kept)
        self._on_change = on_change
        self.grace_s = grace_s
        self.health = health
        self.node_id = node_id
        self._proc = proc
        # Makes each new shard's source ready before its first process; None: the argv
        # goes as written (a source is then the engine's business).
        self._sources = sources
        self._owner = str(state_dir.resolve())
        self._launcher = _processes.Launcher(
            owner=self._owner, proc=proc, engine_paths=engine_paths or {}, path_of=path_of
        )
        self._shards: dict[str, Shard] = {}
        self._nursery: trio.Nursery | None = None
        self._illegal_transitions = 0  # events the table refused (see `_apply`): bugs

    def __repr__(self) -> str:
        states = {s.spec.shard_id: s.state.value for s in self._shards.values()}
        return f"<Supervisor {self.state_dir} {states}>"

    def statistics(self) -> dict[str, int]:
        """Shards per state, how many failed shards' directories are kept, and how
        many events the state table refused (each one a bug, logged)."""
        counts: dict[str, int] = {}
        for shard in self._shards.values():
            counts[shard.state.value] = counts.get(shard.state.value, 0) + 1
        counts["failed_kept"] = len(self._failed.kept())
        counts["illegal_transitions"] = self._illegal_transitions
        return counts

    # lifecycle ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt what a previous agent left running, then supervise until cancelled.

        Cancelling this leaves every engine running: only `stop` ends a shard.
        """
        self.shards_dir.mkdir(parents=True, exist_ok=True)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._recover()
            task_status.started()
            await trio.sleep_forever()

    def reports(self) -> tuple[model.ShardReport, ...]:
        return tuple(s.report() for s in self._shards.values())

    def pids(self) -> set[int]:
        return {p.pid for s in self._shards.values() for p in s.procs}

    def held_sources(self) -> tuple[str, ...]:
        """The sources (model and adapters) of every shard held that is not stopped, and
        of the specs being relaunched into: reclaim leaves them."""
        specs = [s.spec for s in self._shards.values() if s.state is not ShardState.STOPPED]
        specs += [s.pending for s in self._shards.values() if s.pending is not None]
        return tuple(
            text
            for spec in specs
            for text in ((spec.source,) if spec.source is not None else ()) + spec.adapter_sources
        )

    async def prepare(self, spec: model.ShardSpec) -> dict[str, str]:
        """The spec's sources made ready here (`Sources.prepare`); {} without Sources
        (the argv then goes as written: a source is the engine's business)."""
        return await self._sources.prepare(spec) if self._sources is not None else {}

    def shard_pids(self) -> dict[str, set[int]]:
        return {
            shard_id: {p.pid for p in s.procs}
            for shard_id, s in self._shards.items()
            if s.state in RUNNING_SHARD_STATES
        }

    def _apply(self, shard: Shard, event: ShardEvent, reason: str | None = None) -> None:
        """Move `shard` along the table; the reason is kept while nothing says otherwise.

        A pair that is not in the table is logged as the bug it is, counted, and
        the shard stays where it was. Raising would end this shard's task with an
        error that is not a ShardError, which ends `run` and with it every shard's
        watchers and health checks on the node: the agent goes, the control plane
        finds the node unreachable, then lost, and replaces every replica on it,
        for one shard's bookkeeping. Staying put keeps the engine supervised: a
        process exit and a stop are in the table from every running state, so
        the shard still fails or stops as it should.
        """
        try:
            state = next_shard_state(shard.state, event)
        except InvalidShardTransition as exc:
            log.error(
                "shard %s: %s (a bug in the supervisor); it stays %s",
                shard.spec.shard_id,
                exc,
                shard.state.value,
            )
            self._illegal_transitions += 1
            return
        if event is ShardEvent.CHECK_FAILED:
            reason = shard.reason
        elif event is ShardEvent.HEALTH_LOST:
            reason = shard.health.reason()
        if state is ShardState.FAILED:
            shard.failed_at = time.time()
        self._set(shard, state, reason)

    def _set(self, shard: Shard, state: ShardState, reason: str | None = None) -> None:
        if shard.state == state and shard.reason == reason:
            return
        level = logging.WARNING if state is ShardState.UNHEALTHY else logging.INFO
        log.log(
            level,
            "shard %s: %s -> %s%s",
            shard.spec.shard_id,
            shard.state.value,
            state.value,
            f" ({reason.splitlines()[0]})" if reason else "",
        )
        shard.state, shard.reason = state, reason
        if state is not ShardState.STOPPED:
            _runfile.save_run(shard)
        self._on_change(shard.report())

    # start ---------------------------------------------------------------------------

    async def start(self, spec: model.ShardSpec) -> model.ShardReport:
        if not _SHARD_ID.match(spec.shard_id):
            raise UsageError(f"shard id {spec.shard_id!r}: use letters, digits, '.', '_', '-'")
        if not spec.processes or spec.processes[-1].role != "engine":
            raise UsageError(f"shard {spec.shard_id}: the last process must be the engine")
        existing = self._shards.get(spec.shard_id)
        if existing is not None and existing.state in RUNNING_SHARD_STATES:
            if existing.spec == spec:
                return existing.report()  # a retried command: already running
            raise UsageError(
                f"shard {spec.shard_id} is already {existing.state.value} with another spec"
            )
        if existing is not None:
            await self._forget(existing)
        assert self._nursery is not None, "Supervisor.run is not running"
        shard_dir = self.shards_dir / spec.shard_id
        shard_dir.mkdir(parents=True, exist_ok=True)
        # The spec is on disk before the first process exists: a crash right
        # after spawning still leaves a describable engine.
        _runfile.write_spec(shard_dir, spec)
        shard = Shard(spec=spec, dir=shard_dir, health=HealthRun(self.health.failures))
        self._shards[spec.shard_id] = shard
        _runfile.save_run(shard)
        self._on_change(shard.report())
        self._nursery.start_soon(self._supervise, shard, True)
        return shard.report()

    # relaunch ------------------------------------------------------------------------

    async def relaunch(
        self, spec: model.ShardSpec, grace_s: float | None = None
    ) -> model.ShardReport:
        """Start the running shard `spec.shard_id` again from `spec`, which differs from
        its spec only in its adapters (llmgw/agent/_relaunch.py says how and when)."""
        return await _relaunch.relaunch(self, spec, self.grace_s if grace_s is None else grace_s)

    def shard_of(self, shard_id: str) -> Shard | None:
        return self._shards.get(shard_id)

    async def replace(
        self, shard: Shard, spec: model.ShardSpec, local: dict[str, str], grace_s: float
    ) -> bool:
        """Stop `shard`'s processes (its watchers first: this exit is no failure) and
        start it again from `spec`, whose sources are ready at `local`. False when a
        stop came first, or the engine failed first: the shard is then left to those.
        Shielded: once its processes are signalled, the shard is restarted or stopped,
        never left without a task watching it."""
        assert self._nursery is not None, "Supervisor.run is not running"
        with trio.CancelScope(shield=True):
            shard.replacing = True
            if shard.scope is not None:
                shard.scope.cancel()
            await _processes.terminate(shard, grace_s, self._proc)
            with trio.move_on_after(10):
                await shard.done.wait()
        if shard.stopping or shard.state not in RUNNING_SHARD_STATES:
            return False
        # No checkpoint from here on: a stop now finds the shard starting again.
        _runfile.write_spec(shard.dir, spec)
        shard.spec, shard.procs, shard.local_paths, shard.prepared = spec, [], local, True
        shard.health = HealthRun(self.health.failures)
        shard.done, shard.scope, shard.replacing = trio.Event(), None, False
        was = shard.state
        self._apply(shard, ShardEvent.RELAUNCHED)
        if was is ShardState.STARTING:  # `_set` saves and reports a change only
            _runfile.save_run(shard)
            self._on_change(shard.report())
        self._nursery.start_soon(self._supervise, shard, True)
        return True

    # supervise -----------------------------------------------------------------------

    async def _supervise(self, shard: Shard, launch: bool) -> None:
        done = shard.done  # this run's: a relaunch gives the shard a new one for the next
        try:
            async with trio.open_nursery() as nursery:
                shard.scope = nursery.cancel_scope
                if shard.stopping:
                    nursery.cancel_scope.cancel()
                if launch:
                    # Watch each process as soon as it exists, while later ones start.
                    nursery.start_soon(self._launch_and_watch, shard, nursery)
                else:
                    for record in shard.procs:
                        nursery.start_soon(self._watch, shard, record, nursery)
                    nursery.start_soon(_health.watch, shard, self.health, self._apply)
        except ShardError as exc:
            await self._fail(shard, _shard_logs.with_last_lines(shard, str(exc)))
        except BaseExceptionGroup as group:
            errors = [e for e in group.exceptions if isinstance(e, ShardError)]
            if not errors or len(errors) != len(group.exceptions):
                raise
            await self._fail(shard, _shard_logs.with_last_lines(shard, str(errors[0])))
        finally:
            done.set()

    async def _launch_and_watch(self, shard: Shard, nursery: trio.Nursery) -> None:
        if not shard.prepared:  # a relaunch made them ready before the old engine stopped
            try:
                shard.local_paths = await self.prepare(shard.spec)
            except SourceError as exc:
                raise ShardError(str(exc)) from None
            shard.prepared = True
        for spec in shard.spec.processes:
            if shard.stopping:
                return
            record = await self._launcher.spawn(shard, spec)
            nursery.start_soon(self._watch, shard, record, nursery)
            if spec.wait_port is not None:
                await _processes.wait_port(spec)
        self._apply(shard, ShardEvent.LAUNCHED)
        nursery.start_soon(_health.watch, shard, self.health, self._apply)

    async def _watch(self, shard: Shard, record: ProcRecord, nursery: trio.Nursery) -> None:
        # Neither a child nor an adopted process has an event to wait on that
        # survives our restart; 0.2 s of polling is cheap and uniform.
        while record.poll(self._proc):  # noqa: ASYNC110
            await trio.sleep(0.2)
        code = record.exit_code
        if shard.stopping or shard.replacing:
            return
        how = f"exited with code {code}" if code is not None else "is gone"
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        reason = f"{record.name} (pid {record.pid}) {how}"
        nursery.cancel_scope.cancel()
        await self._fail(shard, _shard_logs.with_last_lines(shard, reason, record.name))

    async def _fail(self, shard: Shard, reason: str) -> None:
        # Two processes dying together both land here: the first one's reason stands.
        if shard.stopping or shard.replacing or shard.failing:
            return  # a stop, a relaunch or the first of two dying processes has it in hand
        if shard.state not in RUNNING_SHARD_STATES:
            return
        shard.failing = True
        with trio.CancelScope(shield=True):
            await _processes.terminate(shard, self.grace_s, self._proc)
        if not shard.stopping:
            self._apply(shard, ShardEvent.EXITED, reason)

    # stop ----------------------------------------------------------------------------

    def _where(self) -> str:
        return f"node {self.node_id}" if self.node_id else "this node"

    async def stop(self, shard_id: str, grace_s: float | None = None) -> model.ShardReport:
        shard = self._shards.get(shard_id)
        if shard is None:
            raise NotFound(f"no shard {shard_id!r} on {self._where()}")
        shard.stopping = True
        if shard.relaunch is not None:
            shard.relaunch.cancel()  # a stop wins over a relaunch making its sources ready
        with trio.CancelScope(shield=True):
            await _processes.terminate(
                shard, self.grace_s if grace_s is None else grace_s, self._proc
            )
            if shard.scope is not None:
                shard.scope.cancel()
            with trio.move_on_after(10):
                await shard.done.wait()
        if shard.state is not ShardState.STOPPED:
            failed = shard.state is ShardState.FAILED
            self._apply(shard, ShardEvent.STOP)
            await self._forget(shard, keep=failed)
        return shard.report()

    async def _forget(self, shard: Shard, keep: bool | None = None) -> None:
        """Drop the shard; a failed one's directory goes to failed/ (the newest few stay)."""
        if self._shards.get(shard.spec.shard_id) is shard:
            del self._shards[shard.spec.shard_id]
        if keep is None:
            keep = shard.state is ShardState.FAILED
        if keep and shard.dir.exists():
            self._failed.keep(shard)
        else:
            shutil.rmtree(shard.dir, ignore_errors=True)

    # logs ----------------------------------------------------------------------------

    def tail(self, shard_id: str, lines: int = TAIL_LINES) -> list[model.LogLine]:
        """The last lines of each process's output; a failed shard's first line says so."""
        shard = self._shards.get(shard_id)
        if shard is not None:
            processes, where = shard.spec.processes, shard.dir
            failed = (shard.failed_at, shard.reason) if shard.state is ShardState.FAILED else None
        else:
            kept = self._failed.kept_for(shard_id)
            if kept is None:
                raise NotFound(
                    f"no shard {shard_id} on {self._where()} "
                    "(never started here, or its logs were reclaimed)"
                )
            processes, where, failed = read_kept(kept)
        return _shard_logs.tail_shard(shard_id, processes, where, failed, lines)

    def log_sources(self) -> list[str]:
        """Each shard process's outputs here, as `logs` names them: SHARD/PROCESS/STREAM."""
        return [
            f"{shard_id}/{spec.name}/{stream}"
            for shard_id, shard in sorted(self._shards.items())
            for spec in shard.spec.processes
            for stream in _shard_logs.STREAMS
        ]

    def log_files(self, source: str) -> list[tuple[str, Path]]:
        """(LogLine.source, file) for a shard id (all its processes) or SHARD/PROCESS/STREAM."""
        shard_id, _, rest = source.partition("/")
        shard = self._shards.get(shard_id)
        if shard is None:
            raise NotFound(
                f"no shard {shard_id} on {self._where()} "
                "(`llmgw ctl logs NODE --sources` lists its log sources)"
            )
        files = _shard_logs.files(shard.dir, shard.spec.processes)
        if not rest:
            return files
        chosen = [f for f in files if f[0] == rest]
        if not chosen:
            known = ", ".join(f"{shard_id}/{label}" for label, _ in files)
            raise NotFound(f"no log source {source!r} on {self._where()}; known: {known}")
        return chosen

    def tail_files(self, files: list[tuple[str, Path]], lines: int) -> list[model.LogLine]:
        return _shard_logs.tail_files(files, lines)

    def has_shard(self, shard_id: str) -> bool:
        return shard_id in self._shards

    # recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Adopt every engine that can be identified; kill the ones nothing describes."""
        described: set[str] = set()
        for shard_dir in sorted(p for p in self.shards_dir.iterdir() if p.is_dir()):
            shard = _adopt.load(shard_dir, failures=self.health.failures, proc=self._proc)
            if shard is None:
                continue
            described.add(shard.spec.shard_id)
            self._shards[shard.spec.shard_id] = shard
            assert self._nursery is not None
            if shard.state is ShardState.FAILED:
                continue
            self._nursery.start_soon(self._supervise, shard, False)
        # Processes llmgw started for this agent whose shard nobody can describe.
        _adopt.kill_undescribed(self._owner, self._proc, described)
