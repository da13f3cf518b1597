"""Probes: what this node has, read from the driver, /proc, /sys and the disks.

Each probe takes its command runner and filesystem root as parameters, so tests
drive it with recorded output, a fake binary on PATH, or a fake tree. Probes
block; the agent calls them from a worker thread.

Absent is not zero: whatever a probe cannot tell stays None (or absent), and a
probe that fails leaves its part unknown with a warning instead of failing the
inventory. Memory is read first, before anything that can fail, because
placement needs it even when every other probe breaks.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import attrs

from llmgw.errors import ParseError
from llmgw.host.os_release import OsRelease, parse_os_release
from llmgw.model import (
    Engine,
    Engines,
    Filesystem,
    Gpu,
    GpuUsage,
    Host,
    IbAdapter,
    Inventory,
    NvLink,
    Topology,
    Usage,
)

from ._host import (
    CpuInfo,
    CpuTimes,
    LoadAvg,
    MemInfo,
    cpu_warnings,
    parse_cpuinfo,
    parse_loadavg,
    parse_lscpu,
    parse_meminfo,
    parse_proc_stat,
)
from ._ib import advertise_fabrics, read_ib_adapters
from ._mig import (
    MIG_MODE_FIELDS,
    ListedMig,
    QueriedMig,
    join_mig,
    mig_warnings,
    parse_mig_modes,
    parse_smi_list,
    parse_smi_q_mig,
    pending_of,
)
from ._mounts import Mount, is_shared_fstype, parse_mountinfo
from ._nvml import NvmlLoader, NvmlUnavailable, load_pynvml, read_nvml
from ._procs import process_tree
from ._runner import Runner, RunResult, SubprocessRunner
from ._smi import (
    COMPUTE_APPS_FIELDS,
    GPU_QUERY_FIELDS,
    GPU_REQUIRED_FIELDS,
    ComputeApp,
    foreign_memory_mib,
    invalid_query_field,
    parse_compute_apps,
    parse_gpu_csv,
    parse_smi_versions,
)
from ._topo import parse_topo
from ._weights_scan import scan_weights

logger = logging.getLogger("llmgw.agent.discovery")

SMI_TIMEOUT_S = 30.0
# Importing sglang imports torch: tens of seconds on a cold disk.
SGLANG_IMPORT_TIMEOUT_S = 180.0

T = TypeVar("T")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


# --- GPUs ------------------------------------------------------------------------------


@attrs.frozen
class GpuProbe:
    """What the GPU probe found. gpus None: could not tell; (): no NVIDIA cards."""

    gpus: tuple[Gpu, ...] | None
    topology: Topology | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    warnings: tuple[str, ...] = ()
    source: str | None = None  # "nvml" or "nvidia-smi"
    # Every process holding memory on a card, as the same reading listed them (each
    # shard's own memory is read from it); None: not read, or a card did not answer.
    apps: tuple[ComputeApp, ...] | None = None


def probe_gpus(
    runner: Runner,
    *,
    nvml: NvmlLoader | None = load_pynvml,
    llmgw_pids: Collection[int] = (),
    topology: bool = True,
) -> GpuProbe:
    """The cards, through NVML when it loads, else nvidia-smi's CSV queries.

    Topology comes from `nvidia-smi topo -m` after either path; NVLink pairs
    NVML reported win over the matrix for those pairs. `nvml=None` skips NVML.
    `topology=False` (per heartbeat) skips the matrix and the driver versions.

    `llmgw_pids` are the engines llmgw runs; every process in their trees
    (workers, their children) is llmgw's too, so its memory is not foreign.
    """
    llmgw_pids = process_tree(llmgw_pids)
    warnings: list[str] = []
    nvml_reason: str | None = None
    probe: GpuProbe | None = None
    nvml_links: tuple[NvLink, ...] = ()
    if nvml is not None:
        try:
            reading = read_nvml(nvml(), with_nvlinks=topology)
        except NvmlUnavailable as e:
            nvml_reason = str(e)
        except Exception as e:  # the import itself: no library, a broken wheel
            nvml_reason = f"{type(e).__name__}: {e}"
        else:
            found = tuple(
                attrs.evolve(
                    g,
                    foreign_memory_mib=_foreign_from_apps(
                        reading.apps.get(g.uuid), g.uuid, llmgw_pids
                    ),
                )
                for g in reading.gpus
            )
            nvml_links = reading.nvlinks
            listed = [reading.apps.get(g.uuid) for g in reading.gpus]
            every = None if None in listed else tuple(a for apps in listed for a in apps or ())
            probe = GpuProbe(found, None, reading.driver_version, reading.cuda_version, (), "nvml",
                             every)  # fmt: skip
    if probe is None:
        probe = _smi_gpus(runner, llmgw_pids, versions=topology)
        if nvml_reason is not None:
            if probe.source is None:
                # No NVML and no nvidia-smi: a node without an NVIDIA driver.
                logger.info("no NVIDIA driver (NVML: %s; nvidia-smi: not found)", nvml_reason)
            else:
                message = f"NVML unavailable ({nvml_reason}): GPUs read with nvidia-smi"
                # Said once per inventory; a heartbeat repeating it would flood the log.
                logger.log(logging.WARNING if topology else logging.DEBUG, "%s", message)
                warnings.append(message)
    warnings.extend(probe.warnings)
    topo: Topology | None = None
    gpus: tuple[Gpu, ...] | None = probe.gpus
    if topology and gpus:
        # Reported, never acted on: a reset would stop whatever runs on the card.
        warnings.extend(mig_warnings(gpus))
    if topology and gpus:
        gpus, topo, topo_warning = _topology(runner, gpus, nvml_links)
        if topo_warning:
            warnings.append(topo_warning)
    return attrs.evolve(probe, gpus=gpus, topology=topo, warnings=tuple(warnings))


def _foreign_from_apps(
    apps: tuple[ComputeApp, ...] | None, uuid: str, llmgw_pids: Collection[int]
) -> int | None:
    if apps is None:
        return None
    return foreign_memory_mib(apps, [uuid], llmgw_pids)[uuid]


def _smi(runner: Runner, *args: str) -> RunResult:
    return runner(["nvidia-smi", *args], SMI_TIMEOUT_S)


def _smi_gpus(runner: Runner, llmgw_pids: Collection[int], *, versions: bool) -> GpuProbe:
    fields = list(GPU_QUERY_FIELDS)
    while True:
        query = f"--query-gpu={','.join(fields)}"
        r = _smi(runner, query, "--format=csv,noheader,nounits")
        if r.missing:
            return GpuProbe(gpus=())
        bad = invalid_query_field(r.stdout + r.stderr)
        if r.returncode != 0 and bad is not None and bad in fields:
            if bad in GPU_REQUIRED_FIELDS:
                break
            # Older drivers do not know newer fields (compute_cap before 510):
            # ask again without it, rather than lose the cards.
            logger.info("nvidia-smi does not know --query-gpu field %s; asking without it", bad)
            fields.remove(bad)
            continue
        break
    output = r.stdout + r.stderr
    if "No devices were found" in output:
        logger.info("nvidia-smi: No devices were found")
        return GpuProbe(gpus=(), source="nvidia-smi")
    if not r.ok:
        message = f"nvidia-smi {query} failed ({r.describe()}): GPUs unknown"
        logger.warning("%s", message)
        return GpuProbe(gpus=None, warnings=(message,), source="nvidia-smi")
    try:
        gpus = parse_gpu_csv(r.stdout, fields, source=f"nvidia-smi {query}")
    except ParseError as e:
        logger.warning("%s", e)
        return GpuProbe(gpus=None, warnings=(f"GPUs unknown: {e}",), source="nvidia-smi")

    apps_query = f"--query-compute-apps={','.join(COMPUTE_APPS_FIELDS)}"
    a = _smi(runner, apps_query, "--format=csv,noheader,nounits")
    foreign: dict[str, int | None] = {}
    apps: tuple[ComputeApp, ...] | None = None
    if a.ok:
        try:
            apps = parse_compute_apps(a.stdout, source=f"nvidia-smi {apps_query}")
            foreign = foreign_memory_mib(apps, [g.uuid for g in gpus], llmgw_pids)
        except ParseError as e:
            logger.warning("foreign GPU memory unknown: %s", e)
    else:
        logger.warning("nvidia-smi %s failed (%s)", apps_query, a.describe())
    gpus = tuple(attrs.evolve(g, foreign_memory_mib=foreign.get(g.uuid)) for g in gpus)
    mig_problems: tuple[str, ...] = ()
    if versions:
        gpus, mig_problems = _smi_mig(runner, gpus)

    driver = cuda = None
    # Only the plain table prints the CUDA version; not worth a run per heartbeat.
    v = _smi(runner) if versions else RunResult(0, "", "")
    if versions and v.ok:
        try:
            found = parse_smi_versions(v.stdout)
            driver, cuda = found.driver, found.cuda
        except ParseError as e:
            logger.info("driver version unknown: %s", e)
    return GpuProbe(gpus, None, driver, cuda, mig_problems, "nvidia-smi", apps)


def _smi_mig(runner: Runner, gpus: tuple[Gpu, ...]) -> tuple[tuple[Gpu, ...], tuple[str, ...]]:
    """The cards with their MIG mode and, where enabled, instances (module _mig),
    and a warning when an enabled card's instances could not be read: the
    model holds no "unknown" for them, so the node says it in words.

    Asked once per inventory, not per heartbeat: instances change only when
    an operator makes them. A driver that does not know the mode fields
    (before MIG, 450) leaves the mode unknown.
    """
    query = f"--query-gpu={','.join(MIG_MODE_FIELDS)}"
    r = _smi(runner, query, "--format=csv")
    if not r.ok:
        logger.info("MIG mode unknown: nvidia-smi %s: %s", query, r.describe())
        return gpus, ()
    try:
        modes = parse_mig_modes(r.stdout, source=f"nvidia-smi {query}")
    except ParseError as e:
        logger.warning("MIG mode unknown: %s", e)
        return gpus, ()
    gpus = tuple(
        attrs.evolve(g, mig_mode=modes[g.uuid][0], mig_pending=pending_of(*modes[g.uuid]))
        if g.uuid in modes
        else g
        for g in gpus
    )
    enabled = [g.index for g in gpus if g.mig_mode == "enabled"]
    if not enabled:
        return gpus, ()
    listed = _smi(runner, "-L")
    queried = _smi(runner, "-q")
    problem = None
    instances: tuple[ListedMig, ...] = ()
    by_bus: dict[str | None, tuple[QueriedMig, ...]] = {}
    if not listed.ok:
        problem = f"nvidia-smi -L failed ({listed.describe()})"
    else:
        try:
            instances = parse_smi_list(listed.stdout)
        except ParseError as e:
            problem = str(e)
    # Without -q the instances stay, their ids and memory unknown.
    try:
        by_bus = parse_smi_q_mig(queried.stdout) if queried.ok else {}
    except ParseError as e:
        logger.warning("MIG instance ids unknown: %s", e)
    if not queried.ok:
        logger.warning("MIG instance ids unknown: nvidia-smi -q: %s", queried.describe())
    gpus = tuple(
        attrs.evolve(g, mig_devices=join_mig(instances, by_bus, g))
        if g.mig_mode == "enabled"
        else g
        for g in gpus
    )
    if problem is None:
        return gpus, ()
    message = f"gpu {', '.join(map(str, enabled))}: MIG enabled, instances unknown: {problem}"
    logger.warning("%s", message)
    return gpus, (message,)


def _topology(
    runner: Runner, gpus: tuple[Gpu, ...], nvml_links: tuple[NvLink, ...]
) -> tuple[tuple[Gpu, ...], Topology | None, str | None]:
    r = _smi(runner, "topo", "-m")
    if not r.ok:
        message = f"nvidia-smi topo -m failed ({r.describe()}): GPU topology unknown"
        logger.warning("%s", message)
        topo = Topology(nvlinks=nvml_links) if nvml_links else None
        return gpus, topo, message
    try:
        matrix = parse_topo(r.stdout)
    except ParseError as e:
        logger.warning("%s", e)
        topo = Topology(nvlinks=nvml_links) if nvml_links else None
        return gpus, topo, f"GPU topology unknown: {e}"
    links = {(nv.a, nv.b): nv.links for nv in matrix.topology.nvlinks}
    links.update({(nv.a, nv.b): nv.links for nv in nvml_links})
    topo = attrs.evolve(
        matrix.topology, nvlinks=tuple(NvLink(a, b, n) for (a, b), n in sorted(links.items()))
    )
    affinity = {a.index: a for a in matrix.affinity}
    merged = tuple(
        attrs.evolve(
            g,
            numa_node=affinity[g.index].numa_node,
            cpu_affinity=affinity[g.index].cpu_affinity,
        )
        if g.index in affinity
        else g
        for g in gpus
    )
    return merged, topo, None


# --- Host --------------------------------------------------------------------------------


def read_memory(root: Path = Path("/")) -> MemInfo | None:
    text = _read_text(root / "proc/meminfo")
    if text is None:
        return None
    try:
        return parse_meminfo(text, source=str(root / "proc/meminfo"))
    except ParseError as e:
        logger.warning("%s", e)
        return None


def read_loadavg(root: Path = Path("/")) -> LoadAvg | None:
    text = _read_text(root / "proc/loadavg")
    if text is None:
        return None
    try:
        return parse_loadavg(text, source=str(root / "proc/loadavg"))
    except ParseError as e:
        logger.warning("%s", e)
        return None


def read_cpu_times(root: Path = Path("/")) -> CpuTimes | None:
    text = _read_text(root / "proc/stat")
    if text is None:
        return None
    try:
        return parse_proc_stat(text, source=str(root / "proc/stat"))
    except ParseError as e:
        logger.warning("%s", e)
        return None


def read_cpu(root: Path, runner: Runner) -> CpuInfo | None:
    """/proc/cpuinfo, else `lscpu`; lscpu also names the architecture."""
    cpu: CpuInfo | None = None
    text = _read_text(root / "proc/cpuinfo")
    if text is not None:
        try:
            cpu = parse_cpuinfo(text, source=str(root / "proc/cpuinfo"))
        except ParseError as e:
            logger.warning("%s", e)
    if cpu is None or cpu.model is None or cpu.flags is None:
        r = runner(["lscpu"], 10.0)
        if r.ok:
            try:
                lscpu = parse_lscpu(r.stdout)
            except ParseError as e:
                logger.warning("%s", e)
            else:
                if cpu is None:
                    return lscpu
                return CpuInfo(
                    model=cpu.model or lscpu.model,
                    count=cpu.count or lscpu.count,
                    flags=cpu.flags if cpu.flags is not None else lscpu.flags,
                    arch=lscpu.arch,
                    hypervisor=cpu.hypervisor if cpu.hypervisor is not None else lscpu.hypervisor,
                )
    return cpu


def read_os_release(root: Path = Path("/")) -> OsRelease | None:
    for rel in ("etc/os-release", "usr/lib/os-release"):
        text = _read_text(root / rel)
        if text is None:
            continue
        try:
            return parse_os_release(text, source=str(root / rel))
        except ParseError as e:
            logger.warning("%s", e)
            return None
    return None


def probe_host(
    *, root: Path = Path("/"), runner: Runner, hostname: str | None = None
) -> tuple[Host, tuple[str, ...]]:
    """OS, CPU and architecture, and the warnings about them (no AVX2)."""
    os_rel = read_os_release(root)
    cpu = read_cpu(root, runner)
    arch = cpu.arch if cpu is not None and cpu.arch else None
    if arch is None and root == Path("/"):
        arch = platform.machine() or None
    if cpu is not None and cpu.arch is None and arch is not None:
        cpu = attrs.evolve(cpu, arch=arch)
    warnings = cpu_warnings(cpu) if cpu is not None else ()
    for w in warnings:
        logger.warning("%s", w)
    host = Host(
        hostname=hostname or socket.gethostname(),
        os_id=os_rel.id if os_rel else None,
        os_like=os_rel.id_like if os_rel else (),
        os_version=os_rel.version_id if os_rel else None,
        arch=arch,
        cpu_model=cpu.model if cpu else None,
        cpu_count=cpu.count if cpu else None,
        cpu_flags=cpu.flags or () if cpu else (),
    )
    return host, warnings


# --- Storage -------------------------------------------------------------------------------


def read_mounts(root: Path = Path("/")) -> tuple[Mount, ...]:
    path = root / "proc/self/mountinfo"
    text = _read_text(path)
    if text is None:
        return ()
    try:
        return parse_mountinfo(text, source=str(path))
    except ParseError as e:
        logger.warning("%s", e)
        return ()


def _mount_point(path: str, dev: int, stat: Callable[[str], os.stat_result]) -> str:
    # Walk up while the device stays the same: where it changes is the mount.
    p = path
    while p != "/":
        parent = os.path.dirname(p)
        try:
            if stat(parent).st_dev != dev:
                return p
        except OSError:
            return p
        p = parent
    return "/"


def _mount_entry(real: str, walked: str, dev: int, mounts: Sequence[Mount]) -> Mount | None:
    def under(m: Mount) -> bool:
        mp = m.mount_point.rstrip("/") or "/"
        return real == mp or real.startswith(mp if mp == "/" else mp + "/")

    # Later entries shadow earlier ones at the same point, so search from the end.
    for m in reversed(mounts):
        if m.mount_point == walked:
            return m
    same_dev = [m for m in mounts if m.dev is not None and os.makedev(*m.dev) == dev and under(m)]
    candidates = same_dev or [m for m in mounts if under(m)]
    if not candidates:
        return None
    return max(candidates, key=lambda m: len(m.mount_point))


def probe_filesystems(
    dirs: Iterable[str | Path],
    mounts: Sequence[Mount] = (),
    *,
    stat: Callable[[str], os.stat_result] = os.stat,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
) -> tuple[Filesystem, ...]:
    """Free and total space per filesystem holding the configured directories.

    Directories are grouped by device (st_dev), so two directories on one disk
    are one entry and its space is counted once. A directory that does not
    exist is skipped: it holds nothing, and reporting it as full would stop
    placement for no reason. Free space is what an unprivileged writer gets
    (f_bavail), since the agent need not run as root.
    """
    groups: dict[int, tuple[str, list[str]]] = {}
    for d in dirs:
        path = str(d)
        try:
            st = stat(path)
        except OSError as e:
            logger.info("storage: %s skipped (%s)", path, e.strerror or e)
            continue
        if st.st_dev not in groups:
            groups[st.st_dev] = (os.path.realpath(path), [])
        if path not in groups[st.st_dev][1]:
            groups[st.st_dev][1].append(path)
    result: list[Filesystem] = []
    for dev, (real, paths) in groups.items():
        walked = _mount_point(real, dev, stat)
        entry = _mount_entry(real, walked, dev, mounts)
        mount = entry.mount_point if entry is not None else walked
        fstype = entry.fstype if entry is not None else "unknown"
        total = free = None
        try:
            vfs = statvfs(real)
            total = vfs.f_blocks * vfs.f_frsize
            free = vfs.f_bavail * vfs.f_frsize
        except OSError as e:
            logger.warning("storage: statvfs %s: %s", real, e)
        result.append(
            Filesystem(
                mount=mount,
                fstype=fstype,
                paths=tuple(paths),
                total_bytes=total,
                free_bytes=free,
                shared=is_shared_fstype(fstype),
            )
        )
    return tuple(result)


# --- Engines ----------------------------------------------------------------------------------


def probe_engines(
    runner: Runner,
    *,
    sglang_python: str | None = None,
    engine_paths: Mapping[str, str] | None = None,
) -> Engines:
    """The engines agent.yaml names on purpose ("configured", version unknown).

    Nothing is looked up on PATH: an executable that happens to be called
    `vllm` or `llama-server` is not an engine (the installer reports what it
    installed and proved). `engine_paths`' vllm and llama-server count when the
    file exists and is executable; they are never run, since a wrapper script
    may start a server. SGLang has no executable of its own, so the configured
    Python is asked to import it, judged by the exit status alone.
    """
    found: list[Engine] = []
    for name, path in sorted((engine_paths or {}).items()):
        if name in ("vllm", "llama-server") and os.access(path, os.X_OK):
            found.append(Engine(name=name, path=path, state="configured"))
    if sglang_python is not None:
        r = runner([sglang_python, "-c", "import sglang"], SGLANG_IMPORT_TIMEOUT_S)
        if r.ok:
            found.append(Engine(name="sglang", path=sglang_python, state="configured"))
        else:
            logger.info("sglang: %s -c 'import sglang': %s", sglang_python, r.describe())
    return Engines(found=tuple(sorted(found, key=lambda e: e.name)))


# --- Usage as the inventory carries it -----------------------------------------------------


def gpu_usage(gpus: tuple[Gpu, ...] | None) -> tuple[GpuUsage, ...]:
    return tuple(
        GpuUsage(
            index=g.index,
            memory_used_mib=g.memory_used_mib,
            utilization_pct=g.utilization_pct,
            foreign_memory_mib=g.foreign_memory_mib,
            ecc_uncorrected=g.ecc_uncorrected,
        )
        for g in gpus or ()
    )


# --- Inventory ---------------------------------------------------------------------------------


def _guarded(what: str, warnings: list[str], fn: Callable[[], T], default: T) -> T:
    # One broken probe must not cost the node its whole inventory.
    try:
        return fn()
    except Exception as e:
        logger.exception("%s probe failed", what)
        warnings.append(f"{what} unknown: probe failed ({type(e).__name__}: {e})")
        return default


def collect_inventory(
    *,
    root: Path = Path("/"),
    runner: Runner | None = None,
    model_dirs: Sequence[str | Path] = (),
    weights_dir: str | Path | None = None,
    fabrics: Mapping[str, Sequence[str]] | None = None,
    fabric_interfaces: Mapping[str, str] | None = None,
    sglang_python: str | None = None,
    llmgw_pids: Collection[int] = (),
    nvml: NvmlLoader | None = load_pynvml,
    engine_paths: Mapping[str, str] | None = None,
    hostname: str | None = None,
    storage_dirs: Sequence[str | Path] = (),
    with_weights: bool = True,
    with_engines: bool = True,
) -> Inventory:
    """Everything the control plane needs to know about this node.

    `root` is where /proc, /sys and /etc are read from (a fake tree in tests);
    the configured directories are used as given; `weights_dir` is scanned as
    `scan_weights` says. `nvml=None` reads GPUs with
    nvidia-smi only. `engine_paths` are agent.yaml's (engines are never
    looked up on PATH). `storage_dirs` are reported by filesystem
    beside the model directories, but not scanned for weights.
    `with_weights=False`, `with_engines=False` leave those unknown (None): the
    agent probes them on their own, since they may take minutes.
    """
    run: Runner = runner if runner is not None else SubprocessRunner()
    warnings: list[str] = []
    mem = read_memory(root)  # first: see the module docstring
    dirs = [*model_dirs, *([weights_dir] if weights_dir is not None else [])]

    no_host: tuple[Host, tuple[str, ...]] = (Host(hostname=hostname or socket.gethostname()), ())
    host, host_warnings = _guarded(
        "host",
        warnings,
        lambda: probe_host(root=root, runner=run, hostname=hostname),
        no_host,
    )
    warnings.extend(host_warnings)
    gpu = _guarded(
        "GPU", warnings, lambda: probe_gpus(run, nvml=nvml, llmgw_pids=llmgw_pids), GpuProbe(None)
    )
    warnings.extend(gpu.warnings)
    host = attrs.evolve(host, driver_version=gpu.driver_version, cuda_version=gpu.cuda_version)

    empty_ib: tuple[tuple[IbAdapter, ...], tuple[str, ...]] = ((), ())
    adapters, ib_warnings = _guarded(
        "RDMA", warnings, lambda: read_ib_adapters(root / "sys/class/infiniband"), empty_ib
    )
    warnings.extend(ib_warnings)
    advertised, fabric_warnings = advertise_fabrics(fabrics or {}, adapters, fabric_interfaces)
    warnings.extend(fabric_warnings)

    no_filesystems: tuple[Filesystem, ...] = ()
    filesystems = _guarded(
        "storage",
        warnings,
        # Each directory once: weights_dir is both scanned and written to.
        lambda: probe_filesystems(
            list(dict.fromkeys(str(d) for d in [*dirs, *storage_dirs])), read_mounts(root)
        ),
        no_filesystems,
    )
    weights = (
        _guarded(
            "weights",
            warnings,
            lambda: scan_weights(model_dirs, weights_dir=weights_dir),
            None,
        )
        if with_weights
        else None
    )
    engines = (
        _guarded(
            "engines",
            warnings,
            lambda: probe_engines(run, sglang_python=sglang_python, engine_paths=engine_paths),
            None,
        )
        if with_engines
        else None
    )
    load = read_loadavg(root)
    usage = Usage(
        memory_total_bytes=mem.total_bytes if mem else None,
        memory_available_bytes=mem.available_bytes if mem else None,
        load1=load.load1 if load else None,
        load5=load.load5 if load else None,
        load15=load.load15 if load else None,
        gpus=gpu_usage(gpu.gpus),
        filesystems=filesystems,
    )
    return Inventory(
        host=host,
        usage=usage,
        gpus=gpu.gpus,
        topology=gpu.topology,
        ib_adapters=adapters,
        fabrics=advertised,
        weights=weights,
        engines=engines,
        warnings=tuple(warnings),
    )
