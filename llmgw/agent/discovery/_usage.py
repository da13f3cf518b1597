"""Usage: what changes between heartbeats (memory, load, CPU, the cards' use, the
disks' free space, each shard's CPU, RSS and GPU memory), sampled by one
`UsageSampler` per agent. Rates are differences between two samples, so the first
sample leaves them unknown; absent is not zero, as in the probes (_probe.py) it
reads with."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import psutil

from llmgw.model import GpuUsage, ShardUsage, Usage

from ._host import CpuTimes, cpu_util_pct
from ._nvml import NvmlLoader, load_pynvml
from ._probe import (
    gpu_usage,
    probe_filesystems,
    probe_gpus,
    read_cpu_times,
    read_loadavg,
    read_memory,
    read_mounts,
)
from ._procs import process_group
from ._runner import Runner, SubprocessRunner
from ._smi import ComputeApp


@attrs.frozen
class _ProcSample:
    create_time: float
    cpu_s: float


class UsageSampler:
    """What changes between heartbeats. Keep one per agent: rates (CPU
    utilisation, cores per shard) are differences between two samples, so the
    first sample leaves them unknown."""

    def __init__(
        self,
        *,
        root: Path = Path("/"),
        runner: Runner | None = None,
        dirs: Sequence[str | Path] = (),
        nvml: NvmlLoader | None = load_pynvml,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.runner: Runner = runner if runner is not None else SubprocessRunner()
        self.dirs = tuple(dirs)
        self.nvml = nvml
        self._clock = clock
        self._cpu: CpuTimes | None = None
        self._procs: dict[int, _ProcSample] = {}
        self._procs_at: tuple[float, float] | None = None  # (monotonic, wall)
        self.samples = 0

    def __repr__(self) -> str:
        return f"<UsageSampler root={self.root} dirs={len(self.dirs)} samples={self.samples}>"

    def sample(
        self,
        *,
        shards: Mapping[str, Collection[int]] | None = None,
        llmgw_pids: Collection[int] = (),
        gpus: bool = True,
    ) -> Usage:
        mem = read_memory(self.root)
        load = read_loadavg(self.root)
        cpu = read_cpu_times(self.root)
        util = cpu_util_pct(self._cpu, cpu) if self._cpu is not None and cpu is not None else None
        self._cpu = cpu
        cards: tuple[GpuUsage, ...] = ()
        apps: tuple[ComputeApp, ...] | None = None
        if gpus:
            probe = probe_gpus(self.runner, nvml=self.nvml, llmgw_pids=llmgw_pids, topology=False)
            cards = gpu_usage(probe.gpus)
            apps = probe.apps if probe.gpus else None
        shard_usage = self._shards(shards or {}, apps)
        self.samples += 1
        return Usage(
            memory_total_bytes=mem.total_bytes if mem else None,
            memory_available_bytes=mem.available_bytes if mem else None,
            load1=load.load1 if load else None,
            load5=load.load5 if load else None,
            load15=load.load15 if load else None,
            cpu_util_pct=util,
            gpus=cards,
            filesystems=probe_filesystems(self.dirs, read_mounts(self.root)),
            shards=shard_usage,
        )

    def _shards(
        self, shards: Mapping[str, Collection[int]], apps: tuple[ComputeApp, ...] | None = None
    ) -> tuple[ShardUsage, ...]:
        """Each shard's process group: its CPU, RSS and GPU memory (`apps`: the GPU
        probe's reading of who holds what; None: not read, so the GPU memory unknown)."""
        now, wall = self._clock(), time.time()
        before, before_at = self._procs, self._procs_at
        seen: dict[int, _ProcSample] = {}
        result: list[ShardUsage] = []
        for shard_id, pids in shards.items():
            rss = 0
            delta = 0.0
            alive = 0
            group = process_group(pids)
            for proc in group:
                try:
                    with proc.oneshot():
                        times = proc.cpu_times()
                        sample = _ProcSample(proc.create_time(), times.user + times.system)
                        rss += proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                alive += 1
                seen[proc.pid] = sample
                prev = before.get(proc.pid)
                if prev is not None and prev.create_time == sample.create_time:
                    delta += max(0.0, sample.cpu_s - prev.cpu_s)
                elif before_at is not None and sample.create_time >= before_at[1]:
                    delta += sample.cpu_s  # started since the last sample
            cores = None
            if alive and before_at is not None and now > before_at[0]:
                cores = delta / (now - before_at[0])
            held = shard_gpu_memory_mib(apps, {p.pid for p in group}) if alive else None
            rss_known = rss if alive else None
            result.append(ShardUsage(shard_id, cores, rss_known, held))
        self._procs, self._procs_at = seen, (now, wall)
        return tuple(result)


def shard_gpu_memory_mib(apps: Iterable[ComputeApp] | None, group: Collection[int]) -> int | None:
    """What a shard's process group holds on the card where it holds most: its processes'
    memory summed per card (its claim is per card too). 0: the reading answered and listed
    none of them; None: not read, or one of its processes' sizes not reported."""
    if apps is None:
        return None
    per_card: dict[str, int | None] = {}
    for app in apps:
        if app.pid not in group:
            continue
        held = per_card.get(app.gpu_uuid, 0)
        if held is None or app.used_memory_mib is None:
            per_card[app.gpu_uuid] = None
        else:
            per_card[app.gpu_uuid] = held + app.used_memory_mib
    if None in per_card.values():
        return None
    return max((v for v in per_card.values() if v is not None), default=0)


def collect_usage(
    *,
    root: Path = Path("/"),
    runner: Runner | None = None,
    dirs: Sequence[str | Path] = (),
    shards: Mapping[str, Collection[int]] | None = None,
    llmgw_pids: Collection[int] = (),
    nvml: NvmlLoader | None = load_pynvml,
    sampler: UsageSampler | None = None,
) -> Usage:
    """One usage sample. Pass the same `sampler` each time to get rates;
    without one, CPU utilisation and cores per shard are unknown."""
    if sampler is None:
        sampler = UsageSampler(root=root, runner=runner, dirs=dirs, nvml=nvml)
    return sampler.sample(shards=shards, llmgw_pids=llmgw_pids)
