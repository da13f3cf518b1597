"""What one simulated 8-GPU node of bench/fleet.py registers with and heartbeats.

The inventory is taken by the agent's own discovery code
(`discovery.collect_inventory`) over recorded outputs from tests/data/ (see
INDEX.md there): the H100 SXM node's `nvidia-smi topo -m`
(8 GPUs on NV18, 8 NICs), its `/sys/class/infiniband`, a dual EPYC 9374F's
`lscpu`, Ubuntu 22.04's os-release; the cards' `--query-gpu` rows come from
the fake nvidia-smi, whose names and sizes are the recorded ones
("NVIDIA H100 80GB HBM3", 81559 MiB; "NVIDIA H200", 143771 MiB).

A heartbeat's usage is sampled the way the agent samples it
(`UsageSampler.sample`, then `GpuFaults.annotate`, which adds every card's
health and fault list), once per kind of node; each simulated node then
varies the figures that change between samples (memory available, load, CPU
utilisation, every card's memory used and utilisation) on every beat, so the
control plane decodes and keeps fresh values, as it does from a real fleet.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import attrs

from llmgw import model

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
TOPO = "topo-h100sxm-8gpu-nv18-8nics-niclegend-gpunumaid-drv570.txt"
SYSFS_IB = "sysfs-infiniband-h100-ndr400-plus-bf3-roce-bond"
LSCPU = "cpu-lscpu-amd-epyc9374f-avx512.txt"
OS_RELEASE = "osrelease-ubuntu-22.04.5-gpud-no-trailing-newline.txt"
# The fake nvidia-smi's classes whose names and sizes are the recorded cards'.
KINDS = {"h100": "8xh100-80g", "h200": "8xh200-140g"}
MEM_TOTAL = 2 * 1024**4  # 2 TiB: what an 8-GPU server of this kind carries
GPUS = 8


def _fake_root(work: Path) -> Path:
    """A file tree the discovery reads as / : recorded files where there are some,
    /proc figures of a busy 2-socket server where nothing was recorded."""
    root = work / "root"
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "etc").mkdir(exist_ok=True)
    shutil.copy(DATA / OS_RELEASE, root / "etc/os-release")
    ib = root / "sys/class/infiniband"
    if not ib.exists():
        shutil.copytree(DATA / SYSFS_IB, ib)
    gib = 1024**3
    (root / "proc/meminfo").write_text(
        f"MemTotal: {MEM_TOTAL // 1024} kB\nMemFree: {400 * gib // 1024} kB\n"
        f"MemAvailable: {1500 * gib // 1024} kB\n"
    )
    (root / "proc/loadavg").write_text("23.41 22.87 21.05 9/3121 77810\n")
    _write_stat(root, 0)
    (root / "proc/self/mountinfo").write_text(
        Path("/proc/self/mountinfo").read_text()  # the models dir's filesystem, as it is
    )
    return root


def _write_stat(root: Path, n: int) -> None:
    # Two samples 5 s apart of 64 CPUs about 35 % busy: the sampler's CPU figure is a rate.
    user, idle = 1_000_000 + n * 11_200, 2_000_000 + n * 20_800
    (root / "proc/stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\n")


def _bin(work: Path) -> Path:
    """nvidia-smi: the recorded `topo -m`, else the fake; lscpu: the recorded one."""
    from llmgw.testing import fake_nvidia_smi

    bin_dir = work / "bin"
    fake_nvidia_smi.install(bin_dir / "fake")
    fake = bin_dir / "fake" / "nvidia-smi"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        f'#!/bin/sh\nif [ "$1" = topo ]; then cat {DATA / TOPO}; exit 0; fi\nexec {fake} "$@"\n'
    )
    lscpu = bin_dir / "lscpu"
    lscpu.write_text(f"#!/bin/sh\ncat {DATA / LSCPU}\n")
    for f in (smi, lscpu):
        f.chmod(0o755)
    return bin_dir


def take(work: Path, kind: str) -> tuple[model.Inventory, model.Usage]:
    """(inventory, one usage sample) of an 8-GPU node of `kind` (h100, h200), taken by
    the agent's discovery and sampler over the recorded outputs."""
    from llmgw.agent import discovery
    from llmgw.agent._gpu_faults import GpuFaultWatch

    work = work / kind
    (work / "models").mkdir(parents=True, exist_ok=True)
    root = _fake_root(work)
    bin_dir = _bin(work)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "LLMGW_FAKE_GPUS": KINDS[kind],
        "LLMGW_FAKE_NICS": "8",
        "LLMGW_FAKE_SMI_MEM_USED_MIB": "71234",
        "LLMGW_FAKE_SMI_UTIL": "87",
    }
    runner = discovery.SubprocessRunner(env=env)
    inventory = discovery.collect_inventory(
        root=root,
        runner=runner,
        nvml=None,
        hostname=f"bench-{kind}",
        model_dirs=[str(work / "models")],
        with_engines=False,
    )
    if not inventory.gpus or len(inventory.gpus) != GPUS:
        raise SystemExit(f"fleet bench: discovery gave {inventory.gpus!r}, not {GPUS} GPUs")
    if inventory.topology is None or len(inventory.topology.nic_distances) != 64:
        raise SystemExit(f"fleet bench: the recorded topology was not read: {inventory.topology}")
    sampler = discovery.UsageSampler(
        root=root, runner=runner, dirs=[str(work / "models")], nvml=None
    )
    sampler.sample()
    _write_stat(root, 1)
    usage = GpuFaultWatch(None).annotate(sampler.sample())
    return inventory, usage


def check_usage(usage: model.Usage) -> None:
    """A heartbeat's usage carries what an 8-GPU node sends, or the bench says what not."""
    missing = [
        name
        for name in ("memory_total_bytes", "memory_available_bytes", "load1", "cpu_util_pct")
        if getattr(usage, name) is None
    ]
    if len(usage.gpus) != GPUS:
        missing.append(f"{GPUS} GPUs (has {len(usage.gpus)})")
    for g in usage.gpus:
        if g.memory_used_mib is None or g.utilization_pct is None or g.health is None:
            missing.append(f"GPU {g.index}'s memory, utilisation or health")
    if missing:
        raise SystemExit(f"fleet bench: the sampled heartbeat lacks {', '.join(missing)}")


class Beats:
    """One node's heartbeats: the sample, with the changing figures moved on each beat."""

    def __init__(self, usage: model.Usage, memory_total_mib: int, rng: random.Random) -> None:
        self.usage = usage
        self.rng = rng
        self.memory_total_mib = memory_total_mib

    def next(self) -> model.Usage:
        r = self.rng
        u = self.usage
        top = self.memory_total_mib
        gpus = tuple(
            attrs.evolve(
                g,
                memory_used_mib=r.randrange(top // 2, top),
                utilization_pct=float(r.randrange(0, 101)),
            )
            for g in u.gpus
        )
        total = u.memory_total_bytes or MEM_TOTAL
        load = r.uniform(8.0, 40.0)
        return attrs.evolve(
            u,
            memory_available_bytes=r.randrange(total // 4, total // 4 * 3),
            load1=round(load, 2),
            load5=round(load * r.uniform(0.9, 1.1), 2),
            load15=round(load * r.uniform(0.8, 1.2), 2),
            cpu_util_pct=round(r.uniform(5.0, 60.0), 1),
            gpus=gpus,
        )
