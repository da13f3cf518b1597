"""The supervisor with real processes: never loses, never orphans."""

from __future__ import annotations

import calendar
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from conftest import alive

from llmgw import model
from llmgw.agent import _procfs
from llmgw.agent._supervisor import HealthPolicy, Supervisor
from llmgw.core import ShardEvent
from llmgw.errors import NotFound
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
        reply = await sup.start(
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
        # Every report is numbered, later ones higher: the reply to the start is newer
        # than the report of the same moment, older than what followed it.
        seqs = [r.seq for r in seen]
        assert seqs == sorted(set(seqs)) and seqs[0] >= 1, seqs
        assert seen[0].seq < reply.seq < seen[1].seq, (reply, seen)
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
        # The reason carries what the process said last: here, its one line.
        assert failed.reason == (
            f"ray-head did not open 127.0.0.1:{port} within 1 s; last output:\n[stdout] up"
        )
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
        # Recorded ready, but not reported so until checked again.
        assert (adopted.shard_id, adopted.state, adopted.pids) == ("s4", "loading", ready.pids)
        again = await wait_state(second, "s4", "ready")
        assert again.pids == ready.pids
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
            # Waited for in a thread: a blocking wait here would hold the event loop, and
            # with it the supervisor's own task that kills the engine (5 s, now and then).
            assert await trio.to_thread.run_sync(engine.wait, 5) == -signal.SIGKILL
            assert not (tmp_path / "shards" / "s6").exists()
            nursery.cancel_scope.cancel()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


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
            assert await trio.to_thread.run_sync(mine.wait, 5) == -signal.SIGKILL
            assert theirs.poll() is None
            nursery.cancel_scope.cancel()
    finally:
        for p in (mine, theirs):
            if p.poll() is None:
                p.kill()
                p.wait()


# --- readiness is watched ---------------------------------------------------------------

FAST = HealthPolicy(interval_s=0.2, poll_s=0.1, timeout_s=0.5, failures=3)


def fake_engine(shard_id: str, port: int, **env: str) -> model.ShardSpec:
    """A vLLM-like engine, the real fake one, as its own process."""
    argv = (PY, "-m", "llmgw.testing.fake_engine", "serve", "m", "--port", str(port))
    variables = (
        model.EnvVar("LLMGW_FAKE_ENGINE", "vllm"),
        *(model.EnvVar(k, v) for k, v in env.items()),
    )
    return model.ShardSpec(
        shard_id=shard_id,
        model="m",
        engine="vllm",
        processes=(model.ProcessSpec(name="engine", argv=argv, env=variables),),
        port=port,
    )


async def test_engine_that_stops_answering_health_becomes_unhealthy_and_recovers(
    tmp_path: Path,
) -> None:
    port = free_port()
    seen: list[model.ShardReport] = []
    sup = Supervisor(tmp_path, on_change=seen.append, grace_s=2, health=FAST)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.start(fake_engine("h1", port))
        ready = await wait_state(sup, "h1", "ready")
        # Hung, not dead: it still accepts TCP and reads the request, and never answers.
        async with httpx.AsyncClient() as client:
            hung = await client.post(f"http://127.0.0.1:{port}/fake/health", json={"hang": True})
            assert hung.json() == {"hang": True}
            unhealthy = await wait_state(sup, "h1", "unhealthy")
            assert unhealthy.reason == (
                "/health failed 3 times in a row: timed out after 0.5 s; "
                "timed out after 0.5 s; timed out after 0.5 s"
            )
            assert unhealthy.pids == ready.pids and alive(ready.pids[0])
            # Still unhealthy while the checks keep failing, and reported once.
            await trio.sleep(1.0)
            assert sup.reports()[0].state == "unhealthy"
            assert [r.state for r in seen].count("unhealthy") == 1
            await client.post(f"http://127.0.0.1:{port}/fake/health", json={"hang": False})
            back = await wait_state(sup, "h1", "ready")
        assert back.reason is None and back.pids == ready.pids
        states = [r.state for r in seen]
        assert states == ["starting", "loading", "ready", "unhealthy", "ready"]
        await sup.stop("h1")
        nursery.cancel_scope.cancel()


async def test_adopted_engine_is_checked_before_ready_and_a_hung_one_is_unhealthy(
    tmp_path: Path,
) -> None:
    port = free_port()
    async with trio.open_nursery() as nursery:
        first = Supervisor(tmp_path, health=FAST)
        scope = trio.CancelScope()

        async def run_first(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await first.run(task_status=task_status)

        await nursery.start(run_first)
        # /health hangs 2 s after it listens: ready first, hung by the time the
        # next agent adopts it.
        await first.start(fake_engine("h2", port, LLMGW_FAKE_HEALTH_HANG_AFTER="2"))
        ready = await wait_state(first, "h2", "ready")
        scope.cancel()  # the agent goes away, the engine stays
        async with httpx.AsyncClient() as client:
            with trio.fail_after(10):
                while True:
                    try:
                        await client.get(f"http://127.0.0.1:{port}/health", timeout=0.3)
                    except httpx.TimeoutException:
                        break
                    await trio.sleep(0.1)

        second = Supervisor(tmp_path, grace_s=2, health=FAST)
        await nursery.start(second.run)
        (adopted,) = second.reports()
        assert (adopted.state, adopted.pids) == ("loading", ready.pids)
        # It was ready before: its failed checks count from the first.
        unhealthy = await wait_state(second, "h2", "unhealthy")
        assert unhealthy.reason is not None
        assert unhealthy.reason.startswith("/health failed 3 times in a row: timed out after 0.5 s")
        await second.stop("h2")
        # Once its memory is released (cmdline empty) the supervisor counts it
        # gone; the kernel may take a moment more to make it a zombie.
        with trio.fail_after(5):
            while alive(ready.pids[0]):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


# --- failed shards keep their logs -------------------------------------------------------


async def test_failed_shard_logs_outlive_its_stop_and_a_gone_one_says_so(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, grace_s=1, failed_kept=2, node_id="n7")
    code = (
        "import sys, time; print('loading weights', flush=True); "
        "print('CUDA error: an illegal memory access', file=sys.stderr, flush=True); time.sleep(3600)"
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        before = time.time()
        await sup.start(spec("f1", proc("engine", code)))
        ready = await wait_state(sup, "f1", "ready")
        os.kill(ready.pids[0], signal.SIGKILL)
        failed = await wait_state(sup, "f1", "failed")
        assert failed.reason is not None and "CUDA error" in failed.reason
        # The control plane clears the failed shard away: its logs stay.
        stopped = await sup.stop("f1")
        assert stopped.state == "stopped"
        assert not (tmp_path / "shards" / "f1").exists()
        (kept,) = (tmp_path / "failed").iterdir()
        assert kept.name.startswith("f1@")
        lines = sup.tail("f1")
        first = lines[0]
        assert first.source == "llmgw"
        assert first.text.startswith("shard f1 failed at ")
        assert first.text.endswith(f": engine (pid {ready.pids[0]}) was killed by SIGKILL")
        stamp = first.text.removeprefix("shard f1 failed at ").split(" UTC")[0]
        when = calendar.timegm(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
        assert before - 1 <= when <= time.time() + 1
        assert model.LogLine("engine/stdout", "loading weights") in lines
        assert model.LogLine("engine/stderr", "CUDA error: an illegal memory access") in lines

        with pytest.raises(NotFound) as gone:
            sup.tail("never-here")
        assert str(gone.value) == (
            "no shard never-here on node n7 (never started here, or its logs were reclaimed)"
        )

        # Only the newest `failed_kept` stay.
        for shard_id in ("f2", "f3"):
            await sup.start(spec(shard_id, proc("engine", "import sys; sys.exit(3)")))
            await wait_state(sup, shard_id, "failed")
            await sup.stop(shard_id)
        kept_now = sorted(p.name.split("@")[0] for p in (tmp_path / "failed").iterdir())
        assert kept_now == ["f2", "f3"]
        assert sup.statistics()["failed_kept"] == 2
        with pytest.raises(NotFound):
            sup.tail("f1")
        assert sup.tail("f3")[0].text.endswith("exited with code 3")
        nursery.cancel_scope.cancel()


async def test_an_event_the_table_refuses_is_logged_and_the_engine_stays_supervised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in classifying (here: a second launch of a ready shard) must not end
    supervision of the node's shards: the pair is logged and counted, the shard stays
    ready, and a later exit of its engine is still seen and reported."""
    seen: list[model.ShardReport] = []
    sup = Supervisor(tmp_path, on_change=seen.append, grace_s=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.start(spec("s1", proc("engine", SLEEPER)))
        ready = await wait_state(sup, "s1", "ready")
        reports = len(seen)
        with caplog.at_level(logging.ERROR, logger="llmgw.agent.supervisor"):
            sup._apply(sup._shards["s1"], ShardEvent.LAUNCHED)
        assert [r.getMessage() for r in caplog.records] == [
            "shard s1: event 'launched' is not valid in shard state 'ready' "
            "(a bug in the supervisor); it stays ready"
        ]
        assert len(seen) == reports  # nothing changed, so nothing was reported
        assert sup.statistics() == {"ready": 1, "failed_kept": 0, "illegal_transitions": 1}
        os.kill(ready.pids[0], signal.SIGKILL)
        failed = await wait_state(sup, "s1", "failed")
        assert failed.reason is not None
        assert failed.reason.startswith(f"engine (pid {ready.pids[0]}) was killed by SIGKILL")
        await sup.stop("s1")
        nursery.cancel_scope.cancel()
