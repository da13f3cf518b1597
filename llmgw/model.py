"""The values that travel between agent, control plane and CLI.

Plain frozen attrs classes, no behaviour. `None` always means unknown (the
probe could not tell, or the agent is older than the field) and is never turned
into 0 on the way to the wire, a page or a metric. The wire schema
(schema/llmgw.capnp) mirrors these classes field for field; the codec in
llmgw.rpc converts between them by name.
"""

from __future__ import annotations

import enum

import attrs

__all__ = [
    "Engine",
    "EngineArchive",
    "EngineDecl",
    "EngineDecls",
    "EngineStatus",
    "Engines",
    "EnvVar",
    "Fabric",
    "Filesystem",
    "FlagCheck",
    "Gpu",
    "GpuFault",
    "GpuHealth",
    "GpuUsage",
    "Heartbeat",
    "Hello",
    "Host",
    "IbAdapter",
    "IbPort",
    "Inventory",
    "Label",
    "LogLine",
    "MigDevice",
    "NicDistance",
    "NodeView",
    "NvLink",
    "ProcessSpec",
    "Progress",
    "Reclaimed",
    "Refusal",
    "Settings",
    "ShardReport",
    "ShardSpec",
    "ShardState",
    "ShardUsage",
    "Topology",
    "Usage",
    "WeightFile",
    "Weights",
]

# --- Hardware inventory -----------------------------------------------------


@attrs.frozen
class MigDevice:
    """One MIG instance of a card: what CUDA_VISIBLE_DEVICES names ("MIG-..." uuid).

    `profile` is the driver's name for its size ("3g.40gb": 3 compute slices,
    about 40 GB); `memory_mib` its own memory; the GPU and compute instance
    ids are the driver's (`nvidia-smi -q`, NVML), None where it did not say.
    """

    uuid: str
    profile: str
    memory_mib: int | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None


@attrs.frozen
class Gpu:
    """One NVIDIA card as the driver reports it."""

    index: int
    uuid: str
    name: str
    gpu_class: str  # "h100-80g", "l40s-45g": name and size in GiB as the driver reports it
    pci_bus_id: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    compute_capability: str | None = None  # "9.0"
    ecc_uncorrected: int | None = None
    utilization_pct: float | None = None
    foreign_memory_mib: int | None = None  # held by processes llmgw did not start
    numa_node: int | None = None
    cpu_affinity: str | None = None  # "0-47,96-143" as topo -m prints it
    mig_mode: str | None = None  # "enabled" / "disabled"; None: unknown or not a MIG card
    # The mode after the next GPU reset, only when it differs from mig_mode.
    mig_pending: str | None = None
    mig_devices: tuple[MigDevice, ...] = ()  # the card's MIG instances, when mig_mode is enabled


@attrs.frozen
class NvLink:
    """GPUs `a` and `b` (indexes) joined by `links` NVLinks (NV18 -> 18)."""

    a: int
    b: int
    links: int


@attrs.frozen
class NicDistance:
    """How far network adapter `nic` is from GPU `gpu`: PIX, PXB, PHB, NODE or SYS."""

    gpu: int
    nic: str
    distance: str


@attrs.frozen
class Topology:
    nvlinks: tuple[NvLink, ...] = ()
    nic_distances: tuple[NicDistance, ...] = ()


@attrs.frozen
class IbPort:
    number: int
    state: str  # ACTIVE, DOWN, INIT, ARMED
    phys_state: str  # LinkUp, Disabled, Polling
    rate_gbps: float | None
    link_layer: str  # InfiniBand or Ethernet (RoCE)


@attrs.frozen
class IbAdapter:
    name: str  # mlx5_0
    ports: tuple[IbPort, ...] = ()
    hca_type: str | None = None
    fw_ver: str | None = None


@attrs.frozen
class Fabric:
    """A declared fabric this node advertises: only adapters with an ACTIVE port."""

    name: str
    adapters: tuple[str, ...]
    rate_gbps: float | None  # the slowest active link
    # agent.yaml's fabrics.<name>.interface: the socket interface NCCL's and Gloo's
    # bootstrap use on this fabric; None: not named, the engine picks one.
    interface: str | None = None


@attrs.frozen
class Host:
    hostname: str
    os_id: str | None = None
    os_like: tuple[str, ...] = ()
    os_version: str | None = None
    arch: str | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None  # logical CPUs
    cpu_flags: tuple[str, ...] = ()  # vector extensions only: avx, avx2, avx512f, ...
    driver_version: str | None = None
    cuda_version: str | None = None


@attrs.frozen
class Filesystem:
    """One pool of bytes: two configured directories on one disk are one entry."""

    mount: str
    fstype: str
    paths: tuple[str, ...]  # the configured directories that live on it
    total_bytes: int | None
    free_bytes: int | None
    shared: bool  # NFS, Lustre, GPFS, BeeGFS, CephFS, CIFS...: never summed into the node's own


@attrs.frozen
class WeightFile:
    path: str
    size_bytes: int


@attrs.frozen
class Weights:
    """The model files on the node. Sent only when `fingerprint` changes.

    An empty `files` means "holds nothing"; an absent `Weights` means nothing to report.
    """

    fingerprint: str
    files: tuple[WeightFile, ...] = ()
    # The agent's weights directory (resolved), where fetched sources live under
    # their cache names (llmgw.core.cache_name); None: an agent that fetches nothing.
    dir: str | None = None
    # Cache entries under `dir` not complete (a download under way, or one given up):
    # each its directory and the bytes in it when the list was made (a list is sent
    # when an entry appears or goes, not as it grows). None: not reported (no `dir`,
    # or an agent older than the field).
    unfinished: tuple[WeightFile, ...] | None = None


@attrs.frozen
class Engine:
    name: str  # vllm, sglang, llama-server
    path: str  # the executable, or the Python that imports the module
    version: str | None = None  # the installed version; None: not known (configured by hand)
    # "installed": installed by the agent from the control plane's declaration and
    # proven to run; "configured": named in agent.yaml engine_paths (the operator's word).
    state: str = "configured"


@attrs.frozen
class EngineStatus:
    """A declared engine the node cannot run yet, in the node's own words."""

    name: str
    state: str  # installing | waiting | failed
    detail: str  # one line: "downloading llama-b6xxx-bin-ubuntu-x64.tar.gz (16 MB, 40 %)"
    version: str | None = None  # the declared version it is working on


@attrs.frozen
class Engines:
    """Engines on the node. Present means the agent probed: empty `found` = runs none.

    `found` holds only engines that can run (installed and proven, or configured);
    `pending` what the agent is still doing, or failed to do, about declared ones."""

    found: tuple[Engine, ...] = ()
    pending: tuple[EngineStatus, ...] = ()


@attrs.frozen
class EngineArchive:
    variant: str  # cpu-x86_64, cpu-aarch64, cuda12-x86_64, ...
    url: str  # http(s):// or mirror:/path
    sha256: str


@attrs.frozen
class EngineDecl:
    """One engine the control plane wants on every node, at one version."""

    name: str  # llama-server | vllm | sglang
    version: str
    archives: tuple[EngineArchive, ...] = ()  # llama-server: one per variant
    requirement: str | None = None  # vllm, sglang: a pip requirement ("vllm==0.9.2")
    index_url: str | None = None  # pip's index; None: the control plane's mirror's /simple/


@attrs.frozen
class EngineDecls:
    """The control plane's engine declaration; `fingerprint` changes with any of it."""

    fingerprint: str
    engines: tuple[EngineDecl, ...] = ()


class GpuHealth(enum.StrEnum):
    """A card's health as its agent judges it from its faults (GpuUsage.health)."""

    OK = "ok"  # watched, and no fault that makes it unusable
    UNHEALTHY = "unhealthy"  # a fault that takes the card out (llmgw.core.XID_CLASSES)


@attrs.frozen
class GpuFault:
    """One fault the agent read for a card: an Xid (from the kernel log or NVML's
    events) or an uncorrected ECC count. `unusable`: the card cannot be trusted
    with work until it is reset (Xid 79, 48, ...); otherwise it is reported only
    (Xid 13, 31, 43: the application's fault)."""

    kind: str  # "xid" | "ecc"
    meaning: str  # "GPU has fallen off the bus"
    unusable: bool
    at: float  # unix time the agent read it
    xid: int | None = None
    source: str | None = None  # where it was read: "/dev/kmsg", "nvml", "nvidia-smi"
    line: str | None = None  # the kernel log's line, as it was read


@attrs.frozen
class GpuUsage:
    index: int
    memory_used_mib: int | None = None
    utilization_pct: float | None = None
    foreign_memory_mib: int | None = None  # held by processes outside every engine's tree
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors since the driver loaded
    # A GpuHealth value; None: not known (an agent older than the field never says
    # "ok" for a card it does not watch).
    health: str | None = None
    # The faults read for this card since the agent started (the newest few), the
    # reported-only ones too; None: not watched (an older agent).
    faults: tuple[GpuFault, ...] | None = None


@attrs.frozen
class ShardUsage:
    shard_id: str
    cpu_cores: float | None = None
    rss_bytes: int | None = None
    # What its process group holds on the one of its cards where it holds most (MiB), read
    # from the cards' compute-apps: 0 when they list none of its processes; None: unknown.
    gpu_memory_mib: int | None = None


@attrs.frozen
class Usage:
    """What changes between heartbeats. Each field is absent when its measurement is stale."""

    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    load1: float | None = None
    load5: float | None = None
    load15: float | None = None
    cpu_util_pct: float | None = None
    gpus: tuple[GpuUsage, ...] = ()
    filesystems: tuple[Filesystem, ...] = ()
    shards: tuple[ShardUsage, ...] = ()


@attrs.frozen
class Inventory:
    host: Host
    usage: Usage = Usage()
    gpus: tuple[Gpu, ...] | None = None  # None: could not tell; () : no NVIDIA cards
    topology: Topology | None = None
    ib_adapters: tuple[IbAdapter, ...] = ()
    fabrics: tuple[Fabric, ...] = ()
    weights: Weights | None = None
    engines: Engines | None = None
    warnings: tuple[str, ...] = ()
    labels: tuple[Label, ...] = ()


@attrs.frozen
class Label:
    key: str
    value: str


# --- Session ------------------------------------------------------------------


class ShardState(enum.StrEnum):
    """Where a shard stands; the values are what travels (ShardReport.state).

    The agent's supervisor moves between them through the transition table
    (llmgw.core._shard.TRANSITIONS); `unhealthy` is a shard that was
    ready and whose health checks have failed several times in a row.
    """

    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    FAILED = "failed"
    STOPPED = "stopped"


@attrs.frozen
class ShardReport:
    """A shard the agent runs, as reported at registration and on every change."""

    shard_id: str
    model: str
    engine: str
    state: str  # a ShardState value
    port: int | None = None
    pids: tuple[int, ...] = ()
    reason: str | None = None
    profile_fingerprint: str | None = None
    replica_id: str | None = None  # None: started by hand, not from the catalog
    model_name: str | None = None  # the catalog model
    rank: int = 0
    ranks: int = 1
    gpus: tuple[str, ...] = ()  # UUIDs of the cards it was given
    source: str | None = None  # its spec's source: a fetch's progress ends with a transition
    # The shard's own count of reports, from its agent: a later report is higher, so the
    # control plane keeps the newest whichever way they arrive (a command's reply can be
    # overtaken by the agent's own later report). 0: not known (an older agent).
    seq: int = 0
    adapters: tuple[str, ...] = ()  # its spec's LoRA adapters, in id order
    gpu_memory_mib: int | None = None  # its spec's share of each card (None: whole cards)


@attrs.frozen
class EnvVar:
    name: str
    value: str


@attrs.frozen
class ProcessSpec:
    """One process of a shard: a sidecar (Ray head, ...) or the engine itself."""

    name: str
    argv: tuple[str, ...]
    env: tuple[EnvVar, ...] = ()  # only what llmgw adds to the agent's environment
    role: str = "engine"  # sidecar | engine
    wait_host: str | None = None  # before the next process starts, this must accept TCP
    wait_port: int | None = None
    wait_timeout_s: float = 60.0


@attrs.frozen
class ShardSpec:
    """Everything an agent needs to run, and after a restart to recognise, a shard."""

    shard_id: str
    model: str
    engine: str
    processes: tuple[ProcessSpec, ...]
    served_names: tuple[str, ...] = ()
    serves_http: bool = True
    port: int | None = None
    health_path: str = "/health"
    models_path: str = "/v1/models"
    profile_fingerprint: str | None = None
    replica_id: str | None = None
    model_name: str | None = None
    rank: int = 0
    ranks: int = 1
    gpus: tuple[str, ...] = ()
    # The catalog source the agent makes ready before launch: checks a local path,
    # fetches a URL or `mirror:` source, and puts the local path in place of every
    # argv element equal to it. None: nothing to check (a shard started by hand).
    source: str | None = None
    # The LoRA adapters the shard holds from launch (their names, in id order) and their
    # catalog sources (same order). Each source is made ready as `source` is, and its
    # local path put in place of every argv element equal to it or starting with it
    # and ":" (llama-server's `--lora-scaled PATH:SCALE`).
    adapters: tuple[str, ...] = ()
    adapter_sources: tuple[str, ...] = ()
    # The memory it claims on each of its cards, MiB, when it shares them with other
    # replicas (`gpu_memory_gib` in its profile); None: its cards are its own.
    gpu_memory_mib: int | None = None


@attrs.frozen
class LogLine:
    source: str  # "engine/stdout", "ray-head/stderr", ...
    text: str


@attrs.frozen
class FlagCheck:
    engine: str
    path: str | None  # the executable whose --help was read; None: not found
    missing: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@attrs.frozen
class Hello:
    node_id: str
    agent_version: str
    inventory: Inventory
    shards: tuple[ShardReport, ...] = ()


@attrs.frozen
class Heartbeat:
    seq: int
    usage: Usage = Usage()
    weights: Weights | None = None
    engines: Engines | None = None
    warnings: tuple[str, ...] | None = None  # None: unchanged


@attrs.frozen
class Settings:
    """What the control plane tells an agent at registration."""

    heartbeat_interval_s: float
    epoch: int
    # The weights mirror's port on the host the agent dialled (`mirror:` sources
    # resolve against it), and whether it speaks TLS; None: no mirror is served.
    mirror_port: int | None = None
    mirror_tls: bool = False
    engines: EngineDecls | None = None  # what every node should install; None: nothing declared


@attrs.frozen
class Progress:
    """A fetch's progress: one per source per node, however many shards wait on it."""

    source: str  # the catalog's source text, as in ShardSpec.source
    done_bytes: int
    total_bytes: int | None = None  # None: nobody said the length


@attrs.frozen
class Refusal:
    path: str
    reason: str  # one of llmgw.core's reclaim reasons ("not a cache name"): stable, for counting
    detail: str  # one line for the operator


@attrs.frozen
class Reclaimed:
    """What an agent's reclaim removed (or, in a dry run, would remove) and refused."""

    removed: tuple[str, ...] = ()
    freed_bytes: int = 0
    refused: tuple[Refusal, ...] = ()


# --- Control plane views ------------------------------------------------------


@attrs.frozen
class NodeView:
    """One node as the admin API shows it."""

    node_id: str
    state: str  # ready, unreachable, lost
    state_reason: str
    since: float  # unix time of the last state change
    last_seen: float | None
    address: str | None
    agent_version: str | None
    inventory: Inventory | None
    shards: tuple[ShardReport, ...] = ()
    cordoned: str | None = None  # why, when an operator cordoned it
    draining: str | None = None  # why, when an operator drained it (uncordon lifts it)
    # Which registration this is: larger after every new one (the control plane's
    # count, not the agent's). None: not known.
    generation: int | None = None
