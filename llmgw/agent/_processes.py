"""A shard's processes: spawned in their own session with output to files, ended as groups.

Every process runs in its own session (so its own process group), started
with `posix_spawn` and its stdout and stderr appended to files in the shard's
directory, not to pipes: an engine must outlive a `kill -9` of the agent, and
a pipe to a dead agent would kill it on its next write. Its environment names
its shard and this agent (`_procfs.SHARD_ENV`, `OWNER_ENV`), so a restarted
agent can tell what it started. Ending a shard signals each group: SIGTERM,
then SIGKILL after the grace, so that nothing stays behind.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import trio

from llmgw import model
from llmgw.agent import _procfs, _runfile
from llmgw.agent._fit import fit_env
from llmgw.agent._shard import ProcRecord, Shard, ShardError
from llmgw.core import local_argv

# Part of the supervisor, as operators know it.
log = logging.getLogger("llmgw.agent.supervisor")

# Each engine's program as its adapter writes argv[0]: the one the installer's path replaces.
PROGRAMS = {"vllm": "vllm", "llama-server": "llama-server", "sglang": "python3"}


class Launcher:
    """Starts a shard's processes: argv[0] resolved, the environment marked, files for output."""

    def __init__(
        self,
        *,
        owner: str,
        proc: Path,
        engine_paths: Mapping[str, str],
        path_of: Callable[[str], str | None],
    ) -> None:
        self._owner = owner
        self._proc = proc
        self._engine_paths = dict(engine_paths)
        # The engine installer's: what it installed and proved, by engine name.
        self._path_of = path_of

    def __repr__(self) -> str:
        return f"<Launcher owner={self._owner} engine_paths={sorted(self._engine_paths)}>"

    def env(self, spec: model.ShardSpec, proc: model.ProcessSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update({v.name: v.value for v in proc.env})
        env[_procfs.SHARD_ENV] = spec.shard_id
        env[_procfs.OWNER_ENV] = self._owner
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def resolve(self, argv: Sequence[str], engine: str | None = None) -> list[str]:
        """argv[0] as agent.yaml's engine_paths name it (the operator's word wins), else
        the engine the installer installed for this shard's engine, else as written."""
        argv = list(argv)
        if argv and argv[0] in self._engine_paths:
            argv[0] = self._engine_paths[argv[0]]
        elif argv and engine is not None and argv[0] == PROGRAMS.get(engine):
            installed = self._path_of(engine)
            if installed is not None:
                argv[0] = installed
        return argv

    async def spawn(self, shard: Shard, spec: model.ProcessSpec) -> ProcRecord:
        """Start one process; it is in `shard.procs` and run.json before this returns."""
        argv = local_argv(self.resolve(spec.argv, shard.spec.engine), shard.local_paths)
        env = self.env(shard.spec, spec)
        share, gpus = shard.spec.gpu_memory_mib, shard.spec.gpus
        if shard.spec.engine == "llama-server" and spec.role == "engine" and share and gpus:
            env.update(await fit_env(gpus, share))  # held to its share (llmgw/agent/_fit.py)
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
                env,
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
        _runfile.save_run(shard)
        log.info("shard %s: started %s (pid %d)", shard.spec.shard_id, spec.name, pid)
        return record


async def wait_port(spec: model.ProcessSpec) -> None:
    """Until `spec.wait_port` accepts a connection; ShardError past `spec.wait_timeout_s`."""
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


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.warning("cannot signal process group %d: %s", pid, exc)


async def terminate(shard: Shard, grace_s: float, proc: Path) -> None:
    """SIGTERM every group, SIGKILL what is left after the grace; nothing stays behind."""
    live = [p for p in shard.procs if p.poll(proc)]
    for record in reversed(live):
        signal_group(record.pid, signal.SIGTERM)
    with trio.move_on_after(grace_s):
        while any(p.poll(proc) for p in live):  # noqa: ASYNC110 - /proc has no event
            await trio.sleep(0.1)
    for record in live:
        if record.poll(proc):
            log.warning(
                "shard %s: %s (pid %d) ignored SIGTERM for %g s; killing it",
                shard.spec.shard_id,
                record.name,
                record.pid,
                grace_s,
            )
        # The group may hold children even when the leader has exited.
        signal_group(record.pid, signal.SIGKILL)
    with trio.move_on_after(5):
        while any(p.poll(proc) for p in live):  # noqa: ASYNC110 - reaps our children
            await trio.sleep(0.05)
