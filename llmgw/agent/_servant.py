"""What the agent answers on its `Agent` capability."""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
from collections.abc import Callable, Sequence

import trio

from llmgw import engines, model
from llmgw.agent import _reclaim
from llmgw.agent._node import Node
from llmgw.agent._supervisor import Supervisor
from llmgw.errors import StaleEpoch, UsageError

log = logging.getLogger("llmgw.agent")


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
    ) -> None:
        self._node = node
        self._supervisor = supervisor
        self._in_flight = in_flight  # cache names being fetched: reclaim leaves them
        self._engine_paths = dict(engine_paths or {})  # as the supervisor resolves them
        self._declare = declare  # the engine installer's
        self._path_of = path_of  # what the installer installed and proved, by engine
        self.newest_epoch = 0

    def _fence(self, epoch: int) -> None:
        if epoch < self.newest_epoch:
            # Travels as its own code ("stale-epoch"): the control plane learns
            # it is no longer the leader, not that a registration was refused.
            raise StaleEpoch(
                f"command from epoch {epoch} refused: epoch {self.newest_epoch} has been "
                "seen, so it came from a control plane that is no longer the leader"
            )
        self.newest_epoch = epoch

    async def inventory(self) -> model.Inventory:
        return await trio.to_thread.run_sync(self._node.collect_inventory)

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self._fence(epoch)
        return await self._supervisor.start(spec)

    async def stop_shard(self, epoch: int, shard_id: str, grace_s: float) -> None:
        self._fence(epoch)
        await self._supervisor.stop(shard_id, grace_s if grace_s > 0 else None)

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

    async def logs(self, shard_id: str, lines: int) -> list[model.LogLine]:
        return self._supervisor.tail(shard_id, max(1, min(lines, 1000)))

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
