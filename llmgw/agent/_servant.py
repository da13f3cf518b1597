"""What the agent answers on its `Agent` capability."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import trio

from llmgw import engines, model
from llmgw.agent import _logs, _reclaim
from llmgw.agent._node import Node
from llmgw.agent._sources import SourceError, Sources
from llmgw.agent._supervisor import Supervisor
from llmgw.errors import ConfigError, LlmgwError, StaleEpoch, UsageError

log = logging.getLogger("llmgw.agent")


class LogSink(Protocol):
    """Where a follower pushes (llmgw.rpc `LogSinkHandle`); each call bounded by `deadline`."""

    async def line(self, line: model.LogLine, *, deadline: float) -> None: ...
    async def alive(self, *, deadline: float) -> None: ...
    async def done(self, *, deadline: float) -> None: ...
    def release(self) -> None: ...


class AgentServant:
    def __init__(
        self,
        node: Node,
        supervisor: Supervisor,
        *,
        engine_paths: dict[str, str] | None = None,
        in_flight: Callable[[], frozenset[str]] = frozenset,
        declare: Callable[[model.EngineDecls], None] = lambda decls: None,
        path_of: Callable[[str], str | None] = lambda engine: None,
        memory: _logs.MemoryLog | None = None,
        epoch_path: Path | None = None,
        sources: Sources | None = None,
    ) -> None:
        self._sources = sources  # fetchAdapter's: the supervisor's, shared single flight
        self._memory = memory  # the agent's own last lines (source "agent")
        self._followers: trio.Nursery | None = None  # set by run()
        self._node = node
        self._supervisor = supervisor
        self._in_flight = in_flight  # cache names being fetched: reclaim leaves them
        self._engine_paths = dict(engine_paths or {})  # as the supervisor resolves them
        self._declare = declare  # the engine installer's
        self._path_of = path_of  # what the installer installed and proved, by engine
        # The newest leader epoch seen, kept in the state dir (`epoch_path`) so that a
        # restarted agent still refuses a deposed leader's commands.
        self._epoch_path = epoch_path
        self.newest_epoch = read_epoch(epoch_path) if epoch_path is not None else 0

    def saw_epoch(self, epoch: int) -> None:
        """A leader's epoch (its registration's Settings, or a command's): kept if newer."""
        if epoch > self.newest_epoch:
            self.newest_epoch = epoch
            if self._epoch_path is not None:
                write_epoch(self._epoch_path, epoch)

    def _fence(self, epoch: int) -> None:
        if epoch < self.newest_epoch:
            log.warning("refused a command from epoch %d: epoch %d seen", epoch, self.newest_epoch)
            # Travels as its own code ("stale-epoch"): the control plane learns
            # it is no longer the leader, not that a registration was refused.
            raise StaleEpoch(
                f"command from epoch {epoch} refused: epoch {self.newest_epoch} has been "
                "seen, so it came from a control plane that is no longer the leader"
            )
        self.saw_epoch(epoch)

    async def inventory(self) -> model.Inventory:
        return await trio.to_thread.run_sync(self._node.collect_inventory)

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self._fence(epoch)
        return await self._supervisor.start(spec)

    async def stop_shard(self, epoch: int, shard_id: str, grace_s: float) -> None:
        self._fence(epoch)
        await self._supervisor.stop(shard_id, grace_s if grace_s > 0 else None)

    async def relaunch_shard(
        self, epoch: int, spec: model.ShardSpec, grace_s: float
    ) -> model.ShardReport:
        """The running shard started again with other adapters (llmgw/agent/_relaunch.py)."""
        self._fence(epoch)
        return await self._supervisor.relaunch(spec, grace_s if grace_s > 0 else None)

    async def fetch_adapter(self, epoch: int, source: str, engine: str) -> str:
        """An adapter's source made ready here as a shard's is (single flight, whole or
        nothing, in the weights directory and its reports); its local path: the file,
        a version's directory (llama-server: its first .gguf), or for a local path or
        a hub id the text itself, which the engine reads as written."""
        self._fence(epoch)
        if engine not in engines.ENGINES:
            raise UsageError(
                f"fetch adapter {source}: unknown engine {engine!r}; "
                f"known: {', '.join(engines.ENGINES)}"
            )
        if self._sources is None:
            raise UsageError(f"adapter source {source}: this agent fetches nothing")
        try:
            path = await self._sources.ready(source, engine, what="adapter source")
        except SourceError as exc:
            raise UsageError(str(exc)) from None
        return source if path is None else path

    async def reclaim(self, epoch: int, paths: Sequence[str], dry_run: bool) -> model.Reclaimed:
        """Delete what `may_delete` allows of `paths` in the weights directory, decided
        again here from the disk as it is; refuse the rest (see `_reclaim`)."""
        self._fence(epoch)
        weights_dir = self._node.cfg.weights_dir if self._node.cfg is not None else None
        if weights_dir is None:
            raise UsageError("reclaim: this agent has no configuration, so no weights_dir")
        # Taken now, in the trio thread: what the shards and fetches want at this moment.
        sources = self._supervisor.held_sources()
        in_flight = self._in_flight()
        done = await trio.to_thread.run_sync(
            functools.partial(
                _reclaim.reclaim,
                weights_dir,
                tuple(paths),
                sources=sources,
                in_flight=in_flight,
                dry_run=dry_run,
            )
        )
        if done.removed and not dry_run:
            await self._node.rescan_weights()
        return done

    async def declare_engines(self, epoch: int, decls: model.EngineDecls) -> None:
        """The control plane's engine declaration changed: converge on it (the same
        fingerprint again is a no-op)."""
        self._fence(epoch)
        self._declare(decls)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Holds the followers `logs(follow=True)` starts; they end when this is cancelled."""
        async with trio.open_nursery() as nursery:
            self._followers = nursery
            task_status.started()
            await trio.sleep_forever()

    async def log_sources(self) -> list[str]:
        return [_logs.AGENT_SOURCE, *self._supervisor.log_sources()]

    async def logs(
        self, source: str, lines: int, follow: bool = False, sink: LogSink | None = None
    ) -> list[model.LogLine]:
        """The last `lines` lines of a source (see `log_sources`); with `follow`, the
        lines that come after are pushed into `sink` by a follower (see `_follow`)."""
        lines = max(1, min(lines, _logs.MEMORY_LINES))
        if source == _logs.AGENT_SOURCE:
            if self._memory is None:
                raise UsageError("this agent keeps no log of its own in memory")
            memory = self._memory
            position, texts = memory.tail(lines)
            tail = [model.LogLine(_logs.AGENT_SOURCE, text) for text in texts]

            def read_memory() -> list[model.LogLine]:
                nonlocal position
                position, texts = memory.since(position)
                return [model.LogLine(_logs.AGENT_SOURCE, text) for text in texts]

            read, alive = read_memory, lambda: True
        elif "/" not in source and not follow:
            # A whole shard, failed and kept ones too, as `shard logs` reads it.
            return self._supervisor.tail(source, lines)
        else:
            files = self._supervisor.log_files(source)
            # Followers first, at the files' ends now: no line falls between tail and follow.
            followers = [(label, _logs.FileFollower(path)) for label, path in files]
            whole = "/" not in source
            tail = (
                self._supervisor.tail(source, lines)
                if whole
                else self._supervisor.tail_files(files, lines)
            )

            def read_files() -> list[model.LogLine]:
                return [model.LogLine(label, t) for label, f in followers for t in f.read()]

            shard_id = source.partition("/")[0]
            read, alive = read_files, lambda: self._supervisor.has_shard(shard_id)
        if follow:
            if sink is None or self._followers is None:
                raise UsageError(f"logs {source}: this agent cannot follow (no sink, not running)")
            self._followers.start_soon(self._follow, source, sink, read, alive)
        return tail

    async def _follow(
        self,
        source: str,
        sink: LogSink,
        read: Callable[[], list[model.LogLine]],
        alive: Callable[[], bool],
    ) -> None:
        """Push what `read` finds every POLL_S; `alive()` after KEEPALIVE_S of nothing.
        Ends when a push fails or takes PUSH_DEADLINE_S (the reader went away, or its
        control plane stopped answering), or with `done()` once the source is gone."""
        deadline = _logs.PUSH_DEADLINE_S
        quiet_since = trio.current_time()
        try:
            while True:
                await trio.sleep(_logs.POLL_S)
                ending = not alive()
                lines = read()
                for line in lines:
                    await sink.line(line, deadline=deadline)
                now = trio.current_time()
                if ending:
                    await sink.done(deadline=deadline)
                    return
                if lines:
                    quiet_since = now
                elif now - quiet_since >= _logs.KEEPALIVE_S:
                    await sink.alive(deadline=deadline)
                    quiet_since = now
        except LlmgwError as exc:
            log.debug("following %s ended: %s", source, exc)
        finally:
            sink.release()

    async def engine_check(self, engine: str, argv: Sequence[str]) -> model.FlagCheck:
        return await trio.to_thread.run_sync(self._engine_check, engine, tuple(argv))

    def _engine_check(self, engine: str, argv: tuple[str, ...]) -> model.FlagCheck:
        if engine not in engines.ENGINES:
            raise UsageError(f"unknown engine {engine!r}; known: {', '.join(engines.ENGINES)}")
        commands = engines.help_commands(engine)
        path = None
        help_text = ""
        for command in commands:
            exe = (
                self._engine_paths.get(command[0])
                or self._path_of(engine)
                or shutil.which(command[0])
            )
            if exe is None:
                continue
            path = exe
            try:
                done = subprocess.run(
                    [exe, *command[1:]], capture_output=True, text=True, timeout=60
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return model.FlagCheck(engine, exe, warnings=(f"running --help failed: {exc}",))
            if done.returncode == 0 and done.stdout.strip():
                help_text = done.stdout
                break
        if path is None:
            return model.FlagCheck(engine, None, warnings=(f"{engine} is not installed here",))
        if not help_text:
            return model.FlagCheck(engine, path, warnings=("--help printed nothing usable",))
        result = engines.check_flags(help_text, argv)
        return model.FlagCheck(engine, path, tuple(result.missing), tuple(result.warnings))


def read_epoch(path: Path) -> int:
    """The epoch kept at `path`; 0 when there is none yet. One that cannot be read
    ends the agent with a line naming the file: starting from 0 would obey a deposed
    leader."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the newest epoch seen: {exc.strerror}") from None
    value = text.strip()
    if not (value.isascii() and value.isdigit()):
        raise ConfigError(
            f"{path}: holds {value[:40]!r}, not an epoch; remove it only if no deposed "
            "control plane may still send commands"
        )
    return int(value)


def write_epoch(path: Path, epoch: int) -> None:
    """Written whole and renamed, and synced: a crash leaves the old epoch or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{epoch}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
