"""The supervisor: runs shards, and never loses or orphans an engine.

A shard is a trio task; each of its processes is watched by a task inside it.
Every process runs in its own process group (its own session), with its
output going to files in the shard's state directory, not to pipes: an engine
must outlive a `kill -9` of the agent, and a pipe to a dead agent would kill
it on its next write.

The full spec, the pids and their start times are written to the state
directory before anything else happens, so a restarted agent adopts every
live engine it can identify (pid, start time and command line all matching),
health-checks the adopted ones, and kills an engine it cannot describe.

A shard's state moves only through the table in llmgw.core (`_shard`): a
ready shard stays health-checked, and one whose checks fail `health.failures`
times in a row is reported unhealthy, with those failures as its reason; an
event the table refuses is logged as a bug and leaves the shard where it was
(`Supervisor._apply` says why it does not raise). The last few
failed shards' directories (logs included) are kept under
`<state_dir>/failed/` so that `logs` can still say what happened.

Before a new shard's first process, its source is made ready (`_sources`: a
local path checked, a URL or `mirror:` source fetched) inside the shard's task:
the shard stays `starting` meanwhile, `stop` cancels the fetch with it, and a
source that cannot be made ready fails it with that one line. Every argv
element equal to the source is then the local path; run.json records that
argv, so adoption after a restart matches it and fetches nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from llmgw import config, model
from llmgw.agent import _procfs
from llmgw.agent._sources import SourceError, Sources
from llmgw.core import (
    RUNNING_SHARD_STATES,
    HealthRun,
    InvalidShardTransition,
    ShardEvent,
    next_shard_state,
)
from llmgw.errors import LlmgwError, NotFound, UsageError
from llmgw.model import ShardState

log = logging.getLogger("llmgw.agent.supervisor")

TAIL_LINES = 40
LOG_LIMIT_BYTES = 64 << 20  # an engine's log is cut back to its tail beyond this
_SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FAILED_KEPT = 5  # failed shards whose directories are kept, newest first
LAST_LINES = 10  # output lines a failure's reason carries
# Each engine's program as its adapter writes argv[0]: the one the installer's path replaces.
_PROGRAMS = {"vllm": "vllm", "llama-server": "llama-server", "sglang": "python3"}


class ShardError(LlmgwError):
    """A shard could not be started or stopped; the message says why."""


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be a positive number, got {value}")


@attrs.frozen
class HealthPolicy:
    """How a shard's health is watched.

    `poll_s` while it loads (how soon it is seen ready), `interval_s` once it
    has been ready, each check bounded by `timeout_s`; `failures` checks in a
    row that fail make a ready shard unhealthy.
    """

    interval_s: float = attrs.field(default=5.0, validator=_positive)
    poll_s: float = attrs.field(default=1.0, validator=_positive)
    timeout_s: float = attrs.field(default=5.0, validator=_positive)
    failures: int = attrs.field(default=3, validator=_positive)


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
    local_source: str | None = None  # what stands for spec.source in the argv (fetched here)

    def report(self) -> model.ShardReport:
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
        )


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.warning("cannot signal process group %d: %s", pid, exc)


class Supervisor:
    def __init__(
        self,
        state_dir: Path,
        *,
        on_change: Callable[[model.ShardReport], None] = lambda report: None,
        engine_paths: Mapping[str, str] | None = None,
        grace_s: float = 10.0,
        health: HealthPolicy = HealthPolicy(),
        failed_kept: int = FAILED_KEPT,
        node_id: str | None = None,
        proc: Path = _procfs.PROC,
        sources: Sources | None = None,
        path_of: Callable[[str], str | None] = lambda engine: None,
    ) -> None:
        self.state_dir = state_dir
        # The engine installer's: what it installed and proved, by engine name.
        self._path_of = path_of
        self.shards_dir = state_dir / "shards"
        self.failed_dir = state_dir / "failed"
        self._on_change = on_change
        self._engine_paths = dict(engine_paths or {})
        self.grace_s = grace_s
        self.health = health
        self.failed_kept = failed_kept
        self.node_id = node_id
        self._proc = proc
        # Makes each new shard's source ready before its first process; None: the argv
        # goes as written (a source is then the engine's business).
        self._sources = sources
        self._owner = str(state_dir.resolve())
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
        counts["failed_kept"] = len(self._kept())
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
        """The sources of every shard held that is not stopped (reclaim leaves them)."""
        return tuple(
            s.spec.source
            for s in self._shards.values()
            if s.spec.source is not None and s.state is not ShardState.STOPPED
        )

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
            self._save_run(shard)
        self._on_change(shard.report())

    def _save_run(self, shard: Shard) -> None:
        if not shard.dir.exists():
            return
        _write_json(
            shard.dir / "run.json",
            {
                "state": shard.state.value,
                "reason": shard.reason,
                "failed_at": shard.failed_at,
                "procs": [
                    {
                        "name": p.name,
                        "role": p.role,
                        "argv": p.argv,
                        "pid": p.pid,
                        "start_time": p.start_time,
                    }
                    for p in shard.procs
                ],
            },
        )

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
        _write_json(shard_dir / "spec.json", config.unstructure(spec))
        shard = Shard(spec=spec, dir=shard_dir, health=HealthRun(self.health.failures))
        self._shards[spec.shard_id] = shard
        self._save_run(shard)
        self._on_change(shard.report())
        self._nursery.start_soon(self._supervise, shard, True)
        return shard.report()

    def _env(self, spec: model.ShardSpec, proc: model.ProcessSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update({v.name: v.value for v in proc.env})
        env[_procfs.SHARD_ENV] = spec.shard_id
        env[_procfs.OWNER_ENV] = self._owner
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _resolve(self, argv: Sequence[str], engine: str | None = None) -> list[str]:
        """argv[0] as agent.yaml's engine_paths name it (the operator's word wins), else
        the engine the installer installed for this shard's engine, else as written."""
        argv = list(argv)
        if argv and argv[0] in self._engine_paths:
            argv[0] = self._engine_paths[argv[0]]
        elif argv and engine is not None and argv[0] == _PROGRAMS.get(engine):
            installed = self._path_of(engine)
            if installed is not None:
                argv[0] = installed
        return argv

    async def _spawn(self, shard: Shard, spec: model.ProcessSpec) -> ProcRecord:
        argv = self._resolve(spec.argv, shard.spec.engine)
        source, local = shard.spec.source, shard.local_source
        if source is not None and local is not None:
            argv = [local if a == source else a for a in argv]
        out = shard.dir / f"{spec.name}.stdout.log"
        err = shard.dir / f"{spec.name}.stderr.log"
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        # posix_spawn, not subprocess: a Popen object complains when it is
        # collected while its process runs, and outliving the agent is the point.
        # setsid: its own session and process group, signalled as a whole.
        # Files, not pipes: a pipe to a dead agent would kill the engine.
        try:
            pid = os.posix_spawnp(  # noqa: ASYNC221 - returns once the exec happened
                argv[0],
                argv,
                self._env(shard.spec, spec),
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 1, str(out), flags, 0o644),
                    (os.POSIX_SPAWN_OPEN, 2, str(err), flags, 0o644),
                ],
                setsid=True,
            )
        except FileNotFoundError:
            raise ShardError(
                f"{spec.name}: executable {argv[0]!r} not found"
                + ("" if "/" in argv[0] else " on PATH (set engine_paths in agent.yaml)")
            ) from None
        except PermissionError:
            raise ShardError(f"{spec.name}: {argv[0]!r} is not executable") from None
        started = _procfs.start_time(pid, self._proc)
        record = ProcRecord(spec.name, spec.role, argv, pid, started or 0, own=True)
        shard.procs.append(record)
        self._save_run(shard)
        log.info("shard %s: started %s (pid %d)", shard.spec.shard_id, spec.name, pid)
        return record

    async def _wait_port(self, shard: Shard, spec: model.ProcessSpec) -> None:
        assert spec.wait_port is not None
        host = spec.wait_host or "127.0.0.1"
        with trio.move_on_after(spec.wait_timeout_s):
            while True:
                try:
                    stream = await trio.open_tcp_stream(host, spec.wait_port)
                except OSError:
                    await trio.sleep(0.2)
                    continue
                await stream.aclose()
                return
        raise ShardError(
            f"{spec.name} did not open {host}:{spec.wait_port} within {spec.wait_timeout_s:g} s"
        )

    # supervise -----------------------------------------------------------------------

    async def _supervise(self, shard: Shard, launch: bool) -> None:
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
                    nursery.start_soon(self._health, shard)
        except ShardError as exc:
            await self._fail(shard, self._with_last_lines(shard, str(exc)))
        except BaseExceptionGroup as group:
            errors = [e for e in group.exceptions if isinstance(e, ShardError)]
            if not errors or len(errors) != len(group.exceptions):
                raise
            await self._fail(shard, self._with_last_lines(shard, str(errors[0])))
        finally:
            shard.done.set()

    async def _launch_and_watch(self, shard: Shard, nursery: trio.Nursery) -> None:
        if self._sources is not None:
            try:
                shard.local_source = await self._sources.prepare(shard.spec)
            except SourceError as exc:
                raise ShardError(str(exc)) from None
        for spec in shard.spec.processes:
            if shard.stopping:
                return
            record = await self._spawn(shard, spec)
            nursery.start_soon(self._watch, shard, record, nursery)
            if spec.wait_port is not None:
                await self._wait_port(shard, spec)
        self._apply(shard, ShardEvent.LAUNCHED)
        nursery.start_soon(self._health, shard)

    async def _watch(self, shard: Shard, record: ProcRecord, nursery: trio.Nursery) -> None:
        # Neither a child nor an adopted process has an event to wait on that
        # survives our restart; 0.2 s of polling is cheap and uniform.
        while record.poll(self._proc):  # noqa: ASYNC110
            await trio.sleep(0.2)
        code = record.exit_code
        if shard.stopping:
            return
        how = f"exited with code {code}" if code is not None else "is gone"
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        reason = f"{record.name} (pid {record.pid}) {how}"
        nursery.cancel_scope.cancel()
        await self._fail(shard, self._with_last_lines(shard, reason, record.name))

    def _last_lines(self, shard: Shard, name: str, lines: int) -> list[str]:
        out: list[str] = []
        for source in ("stderr", "stdout"):
            path = shard.dir / f"{name}.{source}.log"
            out += [f"[{source}] {line}" for line in _tail(path, lines)]
        return out[-lines:]

    def _with_last_lines(self, shard: Shard, reason: str, name: str | None = None) -> str:
        """The reason, and the last output of `name` (default: the last process started)."""
        if name is None:
            if not shard.procs:
                return reason
            name = shard.procs[-1].name
        last = self._last_lines(shard, name, LAST_LINES)
        return reason + ("; last output:\n" + "\n".join(last) if last else "")

    async def _health(self, shard: Shard) -> None:
        spec = shard.spec
        if not spec.serves_http or spec.port is None:
            # A rank that serves no HTTP is judged by staying alive.
            await trio.sleep(2.0)
            self._apply(shard, ShardEvent.HEALTHY)
            return
        base = f"http://127.0.0.1:{spec.port}"
        names = set(spec.served_names) | {spec.model}
        policy = self.health
        async with httpx.AsyncClient(base_url=base, timeout=policy.timeout_s) as client:
            while True:
                failure: str | None = f"timed out after {policy.timeout_s:g} s"
                with trio.move_on_after(policy.timeout_s):
                    failure = await self._check(client, spec, names)
                event = shard.health.observe(failure)
                if failure is not None and event is not ShardEvent.CHECK_FAILED:
                    log.debug("shard %s: health check failed: %s", spec.shard_id, failure)
                self._apply(shard, event)
                self._cut_logs(shard)
                loading = shard.state is ShardState.LOADING
                poll = min(policy.poll_s, policy.interval_s)
                await trio.sleep(poll if loading else policy.interval_s)

    async def _check(
        self, client: httpx.AsyncClient, spec: model.ShardSpec, names: set[str]
    ) -> str | None:
        """One health check: None when it passed, else what went wrong, in a few words."""
        try:
            health = await client.get(spec.health_path)
            if health.status_code != 200:
                return f"{spec.health_path} answered {health.status_code}"
            listed = await client.get(spec.models_path)
            ids = {m.get("id") for m in listed.json().get("data", [])}
        except httpx.TimeoutException:
            return f"timed out after {self.health.timeout_s:g} s"
        except httpx.ConnectError as exc:
            text = str(exc)
            return f"cannot connect to port {spec.port}" + (
                " (connection refused)" if "refused" in text.lower() else f" ({text})"
            )
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        except (ValueError, AttributeError):
            return f"{spec.models_path} did not answer an OpenAI model list"
        if not ids & names:
            return f"{spec.models_path} lists none of {sorted(names)}"
        return None

    def _cut_logs(self, shard: Shard) -> None:
        for path in shard.dir.glob("*.log"):
            try:
                if path.stat().st_size > LOG_LIMIT_BYTES:
                    keep = "\n".join(_tail(path, 200)) + "\n"
                    # O_APPEND writers carry on at the new end after a truncate.
                    with open(path, "r+") as f:
                        f.truncate(0)
                        f.write(f"[llmgw: log cut back to its last lines]\n{keep}")
            except OSError:
                pass

    async def _fail(self, shard: Shard, reason: str) -> None:
        # Two processes dying together both land here: the first one's reason stands.
        if shard.stopping or shard.failing or shard.state not in RUNNING_SHARD_STATES:
            return
        shard.failing = True
        with trio.CancelScope(shield=True):
            await self._terminate(shard, self.grace_s)
        if not shard.stopping:
            self._apply(shard, ShardEvent.EXITED, reason)

    async def _terminate(self, shard: Shard, grace_s: float) -> None:
        """SIGTERM every group, SIGKILL what is left after the grace; nothing stays behind."""
        live = [p for p in shard.procs if self._alive(p)]
        for record in reversed(live):
            _signal_group(record.pid, signal.SIGTERM)
        with trio.move_on_after(grace_s):
            while any(self._alive(p) for p in live):  # noqa: ASYNC110 - /proc has no event
                await trio.sleep(0.1)
        for record in live:
            if self._alive(record):
                log.warning(
                    "shard %s: %s (pid %d) ignored SIGTERM for %g s; killing it",
                    shard.spec.shard_id,
                    record.name,
                    record.pid,
                    grace_s,
                )
            # The group may hold children even when the leader has exited.
            _signal_group(record.pid, signal.SIGKILL)
        with trio.move_on_after(5):
            while any(self._alive(p) for p in live):  # noqa: ASYNC110 - reaps our children
                await trio.sleep(0.05)

    def _alive(self, record: ProcRecord) -> bool:
        return record.poll(self._proc)

    # stop ----------------------------------------------------------------------------

    def _where(self) -> str:
        return f"node {self.node_id}" if self.node_id else "this node"

    async def stop(self, shard_id: str, grace_s: float | None = None) -> model.ShardReport:
        shard = self._shards.get(shard_id)
        if shard is None:
            raise NotFound(f"no shard {shard_id!r} on {self._where()}")
        shard.stopping = True
        with trio.CancelScope(shield=True):
            await self._terminate(shard, self.grace_s if grace_s is None else grace_s)
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
            self._keep_failed(shard)
        else:
            shutil.rmtree(shard.dir, ignore_errors=True)

    # failed shards kept --------------------------------------------------------------

    def _keep_failed(self, shard: Shard) -> None:
        failed_at = shard.failed_at if shard.failed_at is not None else time.time()
        dest = self.failed_dir / f"{shard.spec.shard_id}@{int(failed_at * 1000)}"
        try:
            self.failed_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(shard.dir, dest)
        except OSError as exc:
            log.warning("shard %s: cannot keep its logs (%s)", shard.spec.shard_id, exc)
            shutil.rmtree(shard.dir, ignore_errors=True)
            return
        for old in self._kept()[self.failed_kept :]:
            shutil.rmtree(old, ignore_errors=True)

    def _kept(self) -> list[Path]:
        """Kept failed shards' directories, newest first."""
        try:
            entries = [p for p in self.failed_dir.iterdir() if p.is_dir() and "@" in p.name]
        except OSError:
            return []

        def when(p: Path) -> int:
            stamp = p.name.rpartition("@")[2]
            return int(stamp) if stamp.isascii() and stamp.isdigit() else 0

        return sorted(entries, key=when, reverse=True)

    def _kept_for(self, shard_id: str) -> Path | None:
        for path in self._kept():
            if path.name.rpartition("@")[0] == shard_id:
                return path
        return None

    # logs ----------------------------------------------------------------------------

    def tail(self, shard_id: str, lines: int = TAIL_LINES) -> list[model.LogLine]:
        """The last lines of each process's output; a failed shard's first line says so."""
        shard = self._shards.get(shard_id)
        if shard is not None:
            processes, where = shard.spec.processes, shard.dir
            failed = (shard.failed_at, shard.reason) if shard.state is ShardState.FAILED else None
        else:
            kept = self._kept_for(shard_id)
            if kept is None:
                raise NotFound(
                    f"no shard {shard_id} on {self._where()} "
                    "(never started here, or its logs were reclaimed)"
                )
            processes, where, failed = _read_kept(kept)
        out = []
        if failed is not None:
            failed_at, reason = failed
            when = (
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(failed_at))
                if failed_at is not None
                else "an unknown time"
            )
            # The output lines follow below anyway.
            first = (reason or "no reason recorded").splitlines()[0].removesuffix("; last output:")
            out.append(model.LogLine("llmgw", f"shard {shard_id} failed at {when}: {first}"))
        for spec in processes:
            for source in ("stdout", "stderr"):
                for line in _tail(where / f"{spec.name}.{source}.log", lines):
                    out.append(model.LogLine(f"{spec.name}/{source}", line))
        return out

    def log_sources(self) -> list[str]:
        """Each shard process's outputs here, as `logs` names them: SHARD/PROCESS/STREAM."""
        return [
            f"{shard_id}/{spec.name}/{stream}"
            for shard_id, shard in sorted(self._shards.items())
            for spec in shard.spec.processes
            for stream in ("stdout", "stderr")
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
        files = [
            (f"{spec.name}/{stream}", shard.dir / f"{spec.name}.{stream}.log")
            for spec in shard.spec.processes
            for stream in ("stdout", "stderr")
        ]
        if not rest:
            return files
        chosen = [f for f in files if f[0] == rest]
        if not chosen:
            known = ", ".join(f"{shard_id}/{label}" for label, _ in files)
            raise NotFound(f"no log source {source!r} on {self._where()}; known: {known}")
        return chosen

    def tail_files(self, files: list[tuple[str, Path]], lines: int) -> list[model.LogLine]:
        return [model.LogLine(label, line) for label, path in files for line in _tail(path, lines)]

    def has_shard(self, shard_id: str) -> bool:
        return shard_id in self._shards

    # recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Adopt every engine that can be identified; kill the ones nothing describes."""
        described: set[str] = set()
        for shard_dir in sorted(p for p in self.shards_dir.iterdir() if p.is_dir()):
            shard = self._load(shard_dir)
            if shard is None:
                continue
            described.add(shard.spec.shard_id)
            self._shards[shard.spec.shard_id] = shard
            assert self._nursery is not None
            if shard.state is ShardState.FAILED:
                continue
            self._nursery.start_soon(self._supervise, shard, False)
        # Processes llmgw started for this agent whose shard nobody can describe.
        for pid, shard_id in _procfs.marked(self._owner, self._proc):
            if shard_id not in described:
                log.warning(
                    "killing process group %d: it was started for shard %s, which has no spec",
                    pid,
                    shard_id,
                )
                _signal_group(pid, signal.SIGKILL)

    def _load(self, shard_dir: Path) -> Shard | None:
        run_path = shard_dir / "run.json"
        try:
            run = json.loads(run_path.read_text())
        except (OSError, ValueError):
            run = {"procs": []}
        records = [
            ProcRecord(p["name"], p["role"], list(p["argv"]), int(p["pid"]), int(p["start_time"]))
            for p in run.get("procs", [])
        ]
        try:
            spec = config.structure(
                json.loads((shard_dir / "spec.json").read_text()),
                model.ShardSpec,
                str(shard_dir / "spec.json"),
            )
        except (OSError, ValueError, LlmgwError) as exc:
            # Nothing can describe these processes: a process holding GPUs that
            # nobody can describe is worse than none.
            for record in records:
                status = _procfs.check(record.pid, record.start_time, record.argv, self._proc)
                if status is _procfs.Liveness.ALIVE:
                    log.warning(
                        "killing %s (pid %d) of shard %s: its spec is unreadable (%s)",
                        record.name,
                        record.pid,
                        shard_dir.name,
                        exc,
                    )
                    _signal_group(record.pid, signal.SIGKILL)
            shutil.rmtree(shard_dir, ignore_errors=True)
            return None
        shard = Shard(
            spec=spec,
            dir=shard_dir,
            health=HealthRun(self.health.failures),
            procs=records,
            adopted=True,
        )
        recorded = run.get("state")
        if recorded == ShardState.FAILED.value:
            # Failed before the agent went away: its processes were stopped then.
            shard.state, shard.reason = ShardState.FAILED, run.get("reason")
            stamp = run.get("failed_at")
            shard.failed_at = float(stamp) if isinstance(stamp, (int, float)) else None
            for r in records:
                if _procfs.check(r.pid, r.start_time, r.argv, self._proc) is _procfs.Liveness.ALIVE:
                    _signal_group(r.pid, signal.SIGKILL)
            return shard
        statuses = {r.name: _procfs.check(r.pid, r.start_time, r.argv, self._proc) for r in records}
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
            last = [line for r in dead for line in self._last_lines(shard, r.name, LAST_LINES)]
            reason = "; ".join(why) + ("; last output:\n" + "\n".join(last) if last else "")
            for r in records:
                if statuses[r.name] is _procfs.Liveness.ALIVE:
                    _signal_group(r.pid, signal.SIGKILL)
            shard.state, shard.reason = ShardState.FAILED, reason
            shard.failed_at = time.time()
            self._save_run(shard)
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


def _read_kept(
    path: Path,
) -> tuple[tuple[model.ProcessSpec, ...], Path, tuple[float | None, str | None]]:
    """What a kept failed shard's directory says: its processes, where, and when and why."""
    try:
        run = json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        run = {}
    try:
        spec = config.structure(
            json.loads((path / "spec.json").read_text()), model.ShardSpec, str(path / "spec.json")
        )
        processes = spec.processes
    except (OSError, ValueError, LlmgwError):
        names = sorted({p.name.rsplit(".", 2)[0] for p in path.glob("*.log")})
        processes = tuple(model.ProcessSpec(name=n, argv=(n,)) for n in names)
    stamp = run.get("failed_at")
    failed_at = float(stamp) if isinstance(stamp, (int, float)) else None
    if failed_at is None:
        tail = path.name.rpartition("@")[2]
        failed_at = int(tail) / 1000 if tail.isdigit() else None
    reason = run.get("reason")
    return processes, path, (failed_at, reason if isinstance(reason, str) else None)
