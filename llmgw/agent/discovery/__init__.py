"""Hardware discovery: what a node has, and how much of it is in use.

Parsers are pure functions from the text of a command or a /proc, /sys or /etc
file to values, raising `llmgw.errors.ParseError` on anything they cannot read.
Probes run commands through a `Runner` and read files under a root path, so
tests drive them with recorded output and fake trees. Nothing here imports
trio: probes block, and the agent calls them from a worker thread.
"""

from ._host import (
    CpuInfo,
    CpuTimes,
    LoadAvg,
    MemInfo,
    cpu_util_pct,
    cpu_warnings,
    lscpu_fields,
    parse_cpuinfo,
    parse_loadavg,
    parse_lscpu,
    parse_meminfo,
    parse_proc_stat,
    vector_flags,
)
from ._ib import (
    advertise_fabrics,
    parse_ib_link_layer,
    parse_ib_phys_state,
    parse_ib_rate,
    parse_ib_state,
    parse_ibstatus,
    read_ib_adapter,
    read_ib_adapters,
)
from ._mig import (
    MIG_MODE_FIELDS,
    ListedMig,
    QueriedMig,
    join_mig,
    mig_warnings,
    parse_mig_modes,
    parse_smi_list,
    parse_smi_q_mig,
)
from ._mounts import (
    SHARED_FSTYPES,
    SHARED_FUSE_SUBTYPES,
    Mount,
    is_shared_fstype,
    parse_mount_output,
    parse_mountinfo,
)
from ._nvml import NvmlLoader, NvmlReading, NvmlUnavailable, load_pynvml, read_nvml
from ._probe import (
    GpuProbe,
    collect_inventory,
    probe_engines,
    probe_filesystems,
    probe_gpus,
    probe_host,
    read_cpu,
    read_memory,
    read_mounts,
    read_os_release,
)
from ._procs import process_tree
from ._report import format_inventory, inventory_to_json
from ._runner import Runner, RunResult, SubprocessRunner
from ._smi import (
    COMPUTE_APPS_FIELDS,
    GPU_QUERY_FIELDS,
    ComputeApp,
    SmiVersions,
    foreign_memory_mib,
    gpu_class,
    invalid_query_field,
    parse_compute_apps,
    parse_gpu_csv,
    parse_smi_csv,
    parse_smi_versions,
)
from ._smi_q import MemoryErrors, parse_smi_q_memory
from ._topo import GpuAffinity, TopoMatrix, parse_topo
from ._usage import UsageSampler, collect_usage
from ._weights_scan import complete_entry, scan_weights

__all__ = [
    "COMPUTE_APPS_FIELDS",
    "GPU_QUERY_FIELDS",
    "MIG_MODE_FIELDS",
    "SHARED_FSTYPES",
    "SHARED_FUSE_SUBTYPES",
    "ComputeApp",
    "CpuInfo",
    "CpuTimes",
    "GpuAffinity",
    "GpuProbe",
    "ListedMig",
    "LoadAvg",
    "MemInfo",
    "MemoryErrors",
    "Mount",
    "NvmlLoader",
    "NvmlReading",
    "NvmlUnavailable",
    "QueriedMig",
    "RunResult",
    "Runner",
    "SmiVersions",
    "SubprocessRunner",
    "TopoMatrix",
    "UsageSampler",
    "advertise_fabrics",
    "collect_inventory",
    "collect_usage",
    "complete_entry",
    "cpu_util_pct",
    "cpu_warnings",
    "foreign_memory_mib",
    "format_inventory",
    "gpu_class",
    "invalid_query_field",
    "inventory_to_json",
    "is_shared_fstype",
    "join_mig",
    "load_pynvml",
    "lscpu_fields",
    "mig_warnings",
    "parse_compute_apps",
    "parse_cpuinfo",
    "parse_gpu_csv",
    "parse_ib_link_layer",
    "parse_ib_phys_state",
    "parse_ib_rate",
    "parse_ib_state",
    "parse_ibstatus",
    "parse_loadavg",
    "parse_lscpu",
    "parse_meminfo",
    "parse_mig_modes",
    "parse_mount_output",
    "parse_mountinfo",
    "parse_proc_stat",
    "parse_smi_csv",
    "parse_smi_list",
    "parse_smi_q_memory",
    "parse_smi_q_mig",
    "parse_smi_versions",
    "parse_topo",
    "probe_engines",
    "probe_filesystems",
    "probe_gpus",
    "probe_host",
    "process_tree",
    "read_cpu",
    "read_ib_adapter",
    "read_ib_adapters",
    "read_memory",
    "read_mounts",
    "read_nvml",
    "read_os_release",
    "scan_weights",
    "vector_flags",
]
