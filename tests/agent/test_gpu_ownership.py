"""Whose GPU memory: every process in an engine's tree is llmgw's, anything else is foreign."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import trio
from helpers import FIXTURES, alive

from llmgw import config, model
from llmgw.agent import discovery
from llmgw.agent._node import Node
from llmgw.agent._supervisor import Supervisor
from llmgw.testing import fake_nvidia_smi

PY = sys.executable
RECORDED = FIXTURES / "csv-compute-apps-h100-mig-load-drv590.txt"

# A vLLM-like engine: the API server process starts a worker, the worker its own
# child (vLLM's engine core and its GPU workers), and the GPU memory is theirs.
ENGINE = """
import pathlib, subprocess, sys, time
leaf = "import time; time.sleep(3600)"
worker = (
    "import subprocess, sys, time; "
    f"g = subprocess.Popen([sys.executable, '-c', {leaf!r}]); "
    "print(g.pid, flush=True); time.sleep(3600)"
)
child = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True)
grandchild = child.stdout.readline().strip()
pathlib.Path(sys.argv[1]).write_text(f"{child.pid} {grandchild}")
print("workers up", flush=True)
time.sleep(3600)
"""


def rewrite(recorded: str, pids: dict[str, int]) -> str:
    """The recording, with the pid column of some rows replaced."""
    lines = recorded.splitlines(keepends=True)
    out = [lines[0]]
    for line in lines[1:]:
        cells = line.split(", ")
        if cells[5] in pids:
            cells[5] = str(pids[cells[5]])
        out.append(", ".join(cells))
    return "".join(out)


async def test_memory_held_by_an_engines_child_and_grandchild_is_not_foreign(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "workers"
    stranger = subprocess.Popen([PY, "-c", "import time; time.sleep(3600)"])
    sup = Supervisor(tmp_path / "state", grace_s=2)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            await sup.start(
                model.ShardSpec(
                    shard_id="v1",
                    model="m",
                    engine="vllm",
                    processes=(
                        model.ProcessSpec(name="engine", argv=(PY, "-c", ENGINE, str(pidfile))),
                    ),
                    serves_http=False,
                )
            )
            with trio.fail_after(20):
                while not pidfile.exists() or len(pidfile.read_text().split()) != 2:
                    await trio.sleep(0.05)
            child, grandchild = (int(p) for p in pidfile.read_text().split())
            (engine_pid,) = sup.pids()
            assert child not in sup.pids() and grandchild not in sup.pids()

            # The recorded rows: 2296 MiB and 1272 MiB become the engine's worker
            # and that worker's child; 7484 MiB is a process llmgw did not start.
            recorded = RECORDED.read_text()
            apps = tmp_path / "compute-apps.csv"
            apps.write_text(
                rewrite(recorded, {"21180": child, "21181": grandchild, "21198": stranger.pid})
            )
            bin_dir = tmp_path / "bin"
            fake_nvidia_smi.install(bin_dir)
            env = dict(os.environ)
            env.update(
                PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
                LLMGW_FAKE_GPUS="1xh100-80g",
                LLMGW_FAKE_SMI_MEM_USED_MIB="11052",
                LLMGW_FAKE_SMI_APPS_FILE=str(apps),
            )
            cfg = config.AgentConfig(
                servers=[config.HostPort("127.0.0.1:1")],
                tls=config.TlsFiles(ca=tmp_path / "a", cert=tmp_path / "b", key=tmp_path / "c"),
                state_dir=tmp_path / "state",
                weights_dir=tmp_path / "weights",
            )
            node = Node(
                cfg,
                runner=discovery.SubprocessRunner(env=env),
                nvml=None,
                llmgw_pids=sup.pids,
                shard_pids=sup.shard_pids,
            )

            usage = await trio.to_thread.run_sync(node.collect_usage)
            (gpu,) = usage.gpus
            assert gpu.memory_used_mib == 11052
            assert gpu.foreign_memory_mib == 7484  # not 2296 + 1272 + 7484
            assert gpu.ecc_uncorrected == 0
            inventory = await trio.to_thread.run_sync(node.collect_inventory)
            assert inventory.gpus is not None
            assert [g.foreign_memory_mib for g in inventory.gpus] == [7484]
            # What the heartbeat carries is that sample.
            node._usage, node._usage_at = usage, trio.current_time()
            beat = await node.heartbeat(1)
            assert [(g.foreign_memory_mib, g.ecc_uncorrected) for g in beat.usage.gpus] == [
                (7484, 0)
            ]

            await sup.stop("v1")
            # The whole tree went with the engine's process group.
            with trio.fail_after(10):
                while any(alive(p) for p in (engine_pid, child, grandchild)):
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    finally:
        stranger.kill()
        stranger.wait()


def test_process_tree_holds_descendants_and_keeps_gone_pids(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [PY, "-c", "import subprocess, sys, time; "
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
         "print(c.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        kid = int(parent.stdout.readline())
        gone = 2**22 + 12345  # above pid_max's default: never a live process here
        tree = discovery.process_tree([parent.pid, gone])
        assert {parent.pid, kid, gone} <= tree
        assert os.getpid() not in tree
    finally:
        if "kid" in locals():
            os.kill(kid, signal.SIGKILL)
        parent.kill()
        parent.wait()
        assert parent.stdout is not None
        parent.stdout.close()
