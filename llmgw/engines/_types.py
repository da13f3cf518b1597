"""The values the engine adapters take and give: plain frozen attrs, no behaviour.

A profile says what to run (the catalog's words), an assignment says where this
one shard of it runs (placement's words), and a launch plan says exactly which
processes to start, with which arguments and which extra environment, and how
to tell they are healthy. The agent's supervisor performs the plan; nothing in
this package starts a process.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from llmgw.errors import ConfigError
from llmgw.model import Gpu

EngineName = Literal["vllm", "sglang", "llama-server"]
MultinodeMode = Literal["ray", "native"]
ProcessRole = Literal["sidecar", "engine"]

ENGINES: tuple[EngineName, ...] = ("vllm", "sglang", "llama-server")


class EngineConfigError(ConfigError):
    """A profile, or a profile with its assignment, cannot be run.

    `problems` holds every problem found, each a sentence an operator can act
    on; the message joins them so that one error names all of them.
    """

    def __init__(self, problems: tuple[str, ...]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@attrs.frozen
class LaunchAdapter:
    """A LoRA adapter a replica holds from its launch: its name and its catalog source.

    Only llama-server takes adapters at launch (it cannot load one at run time);
    the agent puts the fetched file's local path in place of `source` in the argv.
    """

    name: str
    source: str


@attrs.frozen
class EngineProfile:
    """How one replica of a model runs: the engine, its shape, its extra arguments.

    `gpu_class` None means CPU (llama-server only). `gpus_per_node` x `nodes`
    must equal `tp` x `pp` for vLLM and SGLang. `multinode` picks vLLM's way of
    spanning nodes: "ray" (a Ray cluster, the engine on the leader only) or
    "native" (vLLM's own `--nnodes`, one `vllm serve` per node). `engine_args`
    go last on the engine's command line, verbatim.

    `max_adapters`: how many LoRA adapters one replica holds at once (0: none, and
    no adapter flag is written). `max_adapter_rank`: the largest adapter rank it
    accepts (None: the engine's default; SGLang has none and needs it).
    `adapters`: the ones held from launch, in id order; llama-server only (vLLM
    and SGLang start empty and load at run time, so they ignore it).

    `gpu_memory_fraction`: the share of each of its cards the replica may use,
    0 < f <= 1, when it shares them with other replicas (None: the whole cards,
    and no memory flag is written). vLLM gets `--gpu-memory-utilization F`,
    SGLang `--mem-fraction-static F`; llama-server has no flag that holds it to
    a budget, so it gets nothing (see `_llamacpp`).
    """

    engine: EngineName
    model: str  # a local path or a hub id
    served_names: tuple[str, ...] = ()
    gpu_class: str | None = None
    gpus_per_node: int = 1
    nodes: int = 1
    tp: int = 1
    pp: int = 1
    multinode: MultinodeMode = "ray"
    quantization: str | None = None
    engine_args: tuple[str, ...] = ()
    port_range: tuple[int, int] | None = None
    max_adapters: int = 0
    max_adapter_rank: int | None = None
    adapters: tuple[LaunchAdapter, ...] = ()
    gpu_memory_fraction: float | None = None


@attrs.frozen
class HttpCall:
    """One request to an engine's own HTTP API: method, path, JSON body."""

    method: str
    path: str
    json: dict[str, Any] = attrs.field(hash=False)


@attrs.frozen
class Assignment:
    """Where one shard (one node's part of one replica) runs.

    `node_addresses` is in rank order; `[0]` is the leader. `gpus` are this
    node's cards for this replica. `fabric_adapters` are the IB adapters of the
    fabric placement chose, on this node (empty when no fabric was chosen).
    """

    rank: int
    node_addresses: tuple[str, ...]
    gpus: tuple[Gpu, ...]
    port: int  # the HTTP port
    rendezvous_port: int  # Ray head port, vLLM master port, SGLang dist-init port
    fabric_adapters: tuple[str, ...] = ()
    socket_interface: str | None = None


@attrs.frozen
class ProcessSpec:
    """One process of a shard.

    `env` holds only the variables llmgw sets; the supervisor adds them to the
    agent's own environment. When `wait_for` is set, the supervisor waits until
    that (host, port) accepts TCP connections, for at most `wait_timeout_s`,
    before it starts the next process.
    """

    name: str  # "ray-head", "ray-worker", "engine"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    role: ProcessRole
    wait_for: tuple[str, int] | None = None
    wait_timeout_s: float = 0.0


@attrs.frozen
class MetricNames:
    """Which Prometheus series carry load, per engine.

    `kv_usage` is a 0..1 gauge; when it is absent, try `kv_usage_fallback`
    (older vLLM). `kv_from_slots`: the engine has no KV gauge, read `GET /slots`.
    """

    running: str
    waiting: str
    kv_usage: str | None = None
    kv_usage_fallback: str | None = None
    kv_from_slots: bool = False
    # The generation token counter: an engine whose count moves is making progress
    # (the wedge watch reads it, llmgw/core/_wedge.py); None: not read.
    generated: str | None = None


@attrs.frozen
class LaunchPlan:
    """Everything the supervisor needs to run one shard.

    `processes`: sidecars first, the engine last; the engine's exit is the
    shard's exit. A shard that does not serve HTTP (`serves_http` False, `port`
    None) is judged healthy by staying alive.
    """

    processes: tuple[ProcessSpec, ...]
    serves_http: bool
    port: int | None
    health_path: str  # the engine's; probed only when serves_http
    models_path: str
    metrics: MetricNames


@attrs.frozen
class FlagCheck:
    """The result of checking a command line against an engine's `--help`.

    `missing`: flags of the command the help does not list. `warnings`: reasons
    to doubt the help text itself (it may be cut short), so that a "missing"
    can be told apart from a help we could not read whole.
    """

    missing: tuple[str, ...]
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.missing
