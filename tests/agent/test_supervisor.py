"""The supervisor with real processes: never loses, never orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import trio
from conftest import alive

from llmgw import model
from llmgw.agent import _procfs
from llmgw.agent._supervisor import Supervisor
from llmgw.testing.cluster import free_port

PY = sys.executable


def proc(name: str, code: str, *, role: str = "engine", **kw: object) -> model.ProcessSpec:
    return model.ProcessSpec(name=name, argv=(PY, "-c", code), role=role, **kw)  # type: ignore[arg-type]


SLEEPER = "import time, sys; print('up', flush=True); time.sleep(3600)"


def listener(port: int) -> str:
    return (
        "import socket, time; s = socket.socket(); "
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); print('listening', flush=True); time.sleep(3600)"
    )


async def wait_state(
    sup: Supervisor, shard_id: str, state: str, timeout: float = 20
) -> model.ShardReport:
    with trio.fail_after(timeout):
        while True:
            for report in sup.reports():
                if report.shard_id == shard_id and report.state == state:
                    return report
            await trio.sleep(0.05)


def spec(shard_id: str, *processes: model.ProcessSpec) -> model.ShardSpec:
    return model.ShardSpec(
        shard_id=shard_id, model="m", engine="test", processes=processes, serves_http=False
    )


async def test_sidecar_first_then_engine_ready_and_stop_leaves_nothing(tmp_path: Path) -> None:
    port = free_port()
    seen: list[model.ShardReport] = []
    sup = Supervisor(tmp_path, on_change=seen.append, grace_s=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.start(
            spec(
                "s1",
                proc(
                    "sidecar",
                    listener(port),
                    role="sidecar",
                    wait_host="127.0.0.1",
                    wait_port=port,
                    wait_timeout_s=20,
                ),
                proc("engine", SLEEPER),
            )
        )
        ready = await wait_state(sup, "s1", "ready")
        assert len(ready.pids) == 2 and all(alive(p) for p in ready.pids)
        assert [r.state for r in seen][:3] == ["starting", "loading", "ready"]
        # Each process leads its own group.
        assert all(os.getpgid(p) == p for p in ready.pids)
        stopped = await sup.stop("s1")
        assert stopped.state == "stopped"
        assert not any(alive(p) for p in ready.pids)
        assert not (tmp_path / "shards" / "s1").exists()
        nursery.cancel_scope.cancel()


async def test_sidecar_that_never_opens_its_port_fails_the_shard_and_is_killed(
    tmp_path: Path,
) -> None:
    sup = Supervisor(tmp_path, grace_s=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        port = free_port()
        await sup.start(
            spec(
                "s2",
                proc("ray-head", SLEEPER, role="sidecar", wait_port=port, wait_timeout_s=1.0),
                proc("engine", SLEEPER),
            )
        )
        failed = await wait_state(sup, "s2", "failed")
        assert failed.reason == f"ray-head did not open 127.0.0.1:{port} within 1 s"
        assert len(failed.pids) == 1 and not alive(failed.pids[0])
        nursery.cancel_scope.cancel()


async def test_engine_killed_behind_the_back_is_failed_with_its_last_lines(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, grace_s=1)
    code = "import sys, time; print('loading weights', flush=True); print('CUDA out of memory', file=sys.stderr, flush=True); time.sleep(3600)"
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.start(spec("s3", proc("engine", code)))
        ready = await wait_state(sup, "s3", "ready")
        os.kill(ready.pids[0], signal.SIGKILL)
        failed = await wait_state(sup, "s3", "failed")
        assert failed.reason is not None
        assert failed.reason.startswith(f"engine (pid {ready.pids[0]}) was killed by SIGKILL")
        assert "CUDA out of memory" in failed.reason and "loading weights" in failed.reason
        nursery.cancel_scope.cancel()


async def test_restarted_supervisor_adopts_live_engines_without_restarting_them(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as nursery:
        first = Supervisor(tmp_path)
        scope = trio.CancelScope()

        async def run_first(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await first.run(task_status=task_status)

        await nursery.start(run_first)
        await first.start(spec("s4", proc("engine", SLEEPER)))
        ready = await wait_state(first, "s4", "ready")
        scope.cancel()  # the agent goes away; the engine must not
        await trio.sleep(0.3)
        assert alive(ready.pids[0])

        second = Supervisor(tmp_path, grace_s=1)
        await nursery.start(second.run)
        (adopted,) = second.reports()
        assert (adopted.shard_id, adopted.state, adopted.pids) == ("s4", "ready", ready.pids)
        # Adopted, it is still watched: killed behind the back, it is reported failed.
        os.kill(ready.pids[0], signal.SIGKILL)
        failed = await wait_state(second, "s4", "failed", timeout=10)
        assert "engine" in (failed.reason or "")
        nursery.cancel_scope.cancel()


def write_shard(
    state: Path, shard_id: str, pid: int, start_time: int, argv: list[str], *, with_spec: bool
) -> None:
    d = state / "shards" / shard_id
    d.mkdir(parents=True)
    run = {
        "state": "ready",
        "reason": None,
        "procs": [
            {"name": "engine", "role": "engine", "argv": argv, "pid": pid, "start_time": start_time}
        ],
    }
    (d / "run.json").write_text(json.dumps(run))
    if with_spec:
        s = spec(shard_id, model.ProcessSpec(name="engine", argv=tuple(argv)))
        from llmgw import config

        (d / "spec.json").write_text(json.dumps(config.unstructure(s)))


async def test_pid_reused_by_another_process_is_not_touched(tmp_path: Path) -> None:
    other = subprocess.Popen([PY, "-c", SLEEPER], stdout=subprocess.DEVNULL)
    try:
        started = _procfs.start_time(other.pid)
        assert started is not None
        # The recorded engine had this pid once, with another start time.
        write_shard(tmp_path, "s5", other.pid, started - 1, [PY, "-c", SLEEPER], with_spec=True)
        sup = Supervisor(tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            (report,) = sup.reports()
            assert report.state == "failed"
            assert "the pid now belongs to another process" in (report.reason or "")
            await trio.sleep(0.5)
            assert other.poll() is None, "a process that is not ours was touched"
            nursery.cancel_scope.cancel()
    finally:
        other.kill()
        other.wait()


async def test_leftover_engine_with_no_spec_is_killed(tmp_path: Path) -> None:
    engine = subprocess.Popen(
        [PY, "-c", SLEEPER], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        started = _procfs.start_time(engine.pid)
        assert started is not None
        write_shard(tmp_path, "s6", engine.pid, started, [PY, "-c", SLEEPER], with_spec=False)
        sup = Supervisor(tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            assert sup.reports() == ()
            assert engine.wait(5) == -signal.SIGKILL
            assert not (tmp_path / "shards" / "s6").exists()
            nursery.cancel_scope.cancel()
    finally:
        if engine.poll() is None:
            engine.kill()


async def test_marked_process_whose_shard_is_unknown_is_killed_but_another_agents_is_not(
    tmp_path: Path,
) -> None:
    owner = str(tmp_path.resolve())
    mine = subprocess.Popen(
        [PY, "-c", SLEEPER],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, _procfs.SHARD_ENV: "ghost", _procfs.OWNER_ENV: owner},
    )
    theirs = subprocess.Popen(
        [PY, "-c", SLEEPER],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, _procfs.SHARD_ENV: "ghost", _procfs.OWNER_ENV: owner + "-other"},
    )
    try:
        await trio.sleep(0.2)
        sup = Supervisor(tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            assert mine.wait(5) == -signal.SIGKILL
            assert theirs.poll() is None
            nursery.cancel_scope.cancel()
    finally:
        for p in (mine, theirs):
            if p.poll() is None:
                p.kill()
                p.wait()
