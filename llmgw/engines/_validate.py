"""Whether a profile can run, and on which GPUs: every problem, in one error.

Two places check, because they know different things:

- `validate(profile, group_gpus)` checks the profile itself and, when given,
  the GPUs a placement picked for one replica (per node, rank order). The
  control plane calls it when the catalog loads and when it places a replica.
- `plan_launch(profile, assignment)` checks the assignment against the profile
  before it plans (rank, addresses, GPU count, ports) and is where a
  multi-node replica without a fabric is refused: only the assignment says
  which fabric placement chose, and the agent must never start NCCL across
  nodes without `NCCL_IB_HCA`.

Unknown is not a problem: a GPU whose compute capability the driver did not
report is not refused for fp8 (absent is not zero).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.engines import _adapters, _llamacpp, _memory, _sglang, _vllm
from llmgw.engines._common import owned_conflicts, plural
from llmgw.engines._types import ENGINES, Assignment, EngineConfigError, EngineProfile
from llmgw.model import Gpu

_ADAPTERS = {"vllm": _vllm, "sglang": _sglang, "llama-server": _llamacpp}
_FP8_MIN_CC = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores


def validate(profile: EngineProfile, group_gpus: Sequence[Sequence[Gpu]] | None = None) -> None:
    """Raise `EngineConfigError` naming every problem found, or return None."""
    problems = profile_problems(profile)
    if group_gpus is not None:
        problems += group_problems(profile, list(enumerate(group_gpus)), whole_group=True)
    if problems:
        raise EngineConfigError(tuple(problems))


def profile_problems(profile: EngineProfile) -> list[str]:
    problems: list[str] = []
    engine: str = profile.engine
    if engine not in ENGINES:
        problems.append(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    if not profile.model:
        problems.append("model is empty: give a local path or a hub id")
    for field in ("nodes", "tp", "pp"):
        value = getattr(profile, field)
        if value < 1:
            problems.append(f"{field} must be 1 or more, not {value}")
    multinode: str = profile.multinode
    if multinode not in ("ray", "native"):
        problems.append(f"multinode {multinode!r} is not one of ray, native")
    elif multinode == "native" and engine != "vllm" and engine in ENGINES:
        problems.append(
            f"multinode 'native' is vLLM's own multi-node mode; {engine} cannot use it: "
            "remove multinode"
        )
    if profile.gpu_class is None:
        if engine in ENGINES and engine != "llama-server":
            problems.append(f"{engine} needs a gpu_class; only llama-server runs on CPU")
        elif profile.gpus_per_node != 0:
            problems.append(
                f"a CPU profile (no gpu_class) uses no GPUs, but gpus_per_node is "
                f"{profile.gpus_per_node}: make it 0, or name a gpu_class"
            )
    elif profile.gpus_per_node < 1:
        problems.append(
            f"gpus_per_node must be 1 or more for a GPU profile ({profile.gpu_class}), "
            f"not {profile.gpus_per_node}"
        )
    if profile.port_range is not None:
        low, high = profile.port_range
        if not 1 <= low <= high <= 65535:
            problems.append(
                f"port_range {low}-{high} is not a range of TCP ports "
                "(low <= high, both within 1-65535)"
            )
    for name in profile.served_names:
        if not name or name != name.strip():
            problems.append(f"served name {name!r} is empty or has spaces around it")
    adapter = _ADAPTERS.get(engine)
    if adapter is not None:
        problems += adapter.profile_problems(profile)
    problems += lora_problems(profile)
    problems += _memory.memory_problems(profile)
    return problems


def lora_problems(profile: EngineProfile) -> list[str]:
    """The LoRA adapter fields: counts, rank, names, and what each engine can take
    (facts and versions in `_adapters`)."""
    problems: list[str] = []
    engine: str = profile.engine
    count, rank = profile.max_adapters, profile.max_adapter_rank
    if count < 0:
        problems.append(f"max_adapters must be 0 or more, not {count}")
    if rank is not None and rank < 1:
        problems.append(f"max_adapter_rank must be 1 or more, not {rank}")
    held = profile.adapters
    if len(held) > max(count, 0):
        listed = ", ".join(a.name for a in held)
        problems.append(
            f"adapters holds {plural(len(held), 'adapter')} ({listed}) but max_adapters is "
            f"{count}: make max_adapters at least {len(held)}"
        )
    names = [a.name for a in held]
    for name in dict.fromkeys(names):
        if names.count(name) > 1:
            problems.append(f"adapter name {name!r} appears {names.count(name)} times in adapters")
    for a in held:
        if not a.name or a.name != a.name.strip():
            problems.append(f"adapter name {a.name!r} is empty or has spaces around it")
        if not a.source.strip():
            problems.append(f"adapter {a.name!r} has an empty source")
        elif engine == "llama-server" and (
            "," in a.source or (a.source.startswith("/") and ":" in a.source)
        ):
            problems.append(
                f"adapter {a.name!r} source {a.source!r} holds ',' or ':', which "
                "llama-server's --lora-scaled PATH:SCALE cannot carry: move the file"
            )
    if count <= 0:
        return problems
    if engine == "vllm" and rank is not None and rank >= 1 and rank not in _adapters.VLLM_RANKS:
        allowed = ", ".join(map(str, _adapters.VLLM_RANKS))
        problems.append(
            f"max_adapter_rank {rank} is not one vLLM takes for --max-lora-rank "
            f"({allowed}): pick the next one up"
        )
    servers = _api_server_count(profile.engine_args) if engine == "vllm" else None
    if servers is not None and servers > 1:
        problems.append(
            f"engine_args sets --api-server-count {servers}; vLLM refuses its run-time "
            "adapter loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) with more than one API "
            "server: remove it, or set max_adapters 0"
        )
    if engine == "sglang" and rank is None:
        problems.append(
            f"sglang with max_adapters {count} needs max_adapter_rank: it starts with no "
            "adapter to infer the rank from (--max-lora-rank)"
        )
    owned = _adapters.OWNED.get(engine, frozenset())
    for flag in owned_conflicts(profile.engine_args, owned, underscores=engine == "vllm"):
        problems.append(
            f"engine_args sets {flag}, which llmgw sets itself for max_adapters {count}: remove it"
        )
    return problems


def _api_server_count(engine_args: Sequence[str]) -> int | None:
    """The last `--api-server-count`/`-asc` value in engine_args (vLLM keeps the last)."""
    found: int | None = None
    for i, token in enumerate(engine_args):
        flag, eq, inline = token.partition("=")
        if flag in ("--api-server-count", "--api_server_count", "-asc"):
            value = inline if eq else (engine_args[i + 1] if i + 1 < len(engine_args) else "")
            found = int(value) if value.isdigit() else found
    return found


def group_problems(
    profile: EngineProfile,
    nodes: Sequence[tuple[int, Sequence[Gpu]]],
    *,
    whole_group: bool,
) -> list[str]:
    """Problems with the GPUs picked for a replica: `nodes` is [(node index, its GPUs)].

    `whole_group`: `nodes` is every node of the replica (validate), not one
    shard's node (plan_launch), so the node count can be checked too.
    """
    problems: list[str] = []
    if whole_group and len(nodes) != profile.nodes:
        problems.append(
            f"the group has {plural(len(nodes), 'node')}, the profile needs {profile.nodes}"
        )
    if profile.gpu_class is None:
        for index, gpus in nodes:
            if gpus:
                problems.append(f"a CPU profile takes no GPUs, but node {index} offers {len(gpus)}")
        return problems
    for index, gpus in nodes:
        if len(gpus) != profile.gpus_per_node:
            problems.append(
                f"node {index} offers {plural(len(gpus), 'GPU')} for this replica, "
                f"the profile needs {profile.gpus_per_node} per node"
            )
    problems += _mixed_classes(nodes)
    problems += _mig_problems(nodes)
    classes = {g.gpu_class for _, gpus in nodes for g in gpus}
    if len(classes) == 1 and profile.gpu_class not in classes:
        (have,) = classes
        problems.append(f"the GPUs are {have}, the profile asks for {profile.gpu_class}")
    problems += _capability_problems(profile, nodes)
    return problems


def _mixed_classes(nodes: Sequence[tuple[int, Sequence[Gpu]]]) -> list[str]:
    reference: tuple[int, str] | None = None
    problems: list[str] = []
    for index, gpus in nodes:
        classes = list(dict.fromkeys(g.gpu_class for g in gpus))
        if not classes:
            continue
        if reference is None:
            reference = (index, classes[0])
        ref_index, ref_class = reference
        others = [c for c in classes if c != ref_class]
        if not others:
            continue
        if index == ref_index:
            described = " and ".join(classes)
            problems.append(f"node {index} has {described}: one replica must use one GPU type")
        else:
            problems.append(
                f"node {index} has {', '.join(others)}, node {ref_index} has {ref_class}: "
                "one replica must use one GPU type"
            )
    return problems


def _mig_problems(nodes: Sequence[tuple[int, Sequence[Gpu]]]) -> list[str]:
    """A replica placed on MIG instances runs on one: a CUDA process enumerates a single
    MIG device however many CUDA_VISIBLE_DEVICES lists (NVIDIA's MIG user guide, "CUDA
    Device Enumeration"), so a second one would sit idle while the engine assumes it."""
    problems: list[str] = []
    for index, gpus in nodes:
        migs = [g.uuid for g in gpus if g.uuid.startswith("MIG-")]
        if len(migs) > 1:
            problems.append(
                f"node {index} offers {len(migs)} MIG instances ({', '.join(migs)}) for one "
                "replica: a CUDA process uses only one MIG instance, so a replica on MIG "
                "takes exactly one"
            )
    return problems


def _capability_problems(
    profile: EngineProfile, nodes: Sequence[tuple[int, Sequence[Gpu]]]
) -> list[str]:
    quantization = profile.quantization
    if quantization is None or "fp8" not in quantization.lower():
        return []
    problems: list[str] = []
    reported: set[str] = set()
    for _, gpus in nodes:
        for gpu in gpus:
            cc = _parse_cc(gpu.compute_capability)
            if cc is None or cc >= _FP8_MIN_CC or gpu.gpu_class in reported:
                continue
            reported.add(gpu.gpu_class)
            problems.append(
                f"{quantization} needs compute capability 8.9 or newer; "
                f"{gpu.gpu_class} has {gpu.compute_capability}"
            )
    return problems


def _parse_cc(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    major, _, minor = text.strip().partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        return None
    return int(major), int(minor or "0")


def assignment_problems(profile: EngineProfile, assignment: Assignment) -> list[str]:
    """Whether `assignment` fits `profile`; see the module docstring for why here."""
    problems: list[str] = []
    if len(assignment.node_addresses) != profile.nodes:
        problems.append(
            f"the assignment names {plural(len(assignment.node_addresses), 'node address')}, "
            f"the profile needs {profile.nodes}"
        )
    if not 0 <= assignment.rank < max(profile.nodes, 1):
        problems.append(
            f"rank {assignment.rank} is outside 0-{profile.nodes - 1} "
            f"for a {profile.nodes}-node profile"
        )
    for index, address in enumerate(assignment.node_addresses):
        if not address.strip():
            problems.append(f"node address {index} is empty")
    for field in ("port", "rendezvous_port"):
        value = getattr(assignment, field)
        if not 1 <= value <= 65535:
            problems.append(f"{field} {value} is not a TCP port (1-65535)")
    if profile.port_range is not None:
        low, high = profile.port_range
        if not low <= assignment.port <= high:
            problems.append(
                f"port {assignment.port} is outside the profile's port_range {low}-{high}"
            )
    if profile.nodes > 1:
        if assignment.port == assignment.rendezvous_port:
            problems.append(
                f"port and rendezvous_port are both {assignment.port}; they must differ"
            )
        if not assignment.fabric_adapters:
            problems.append(
                f"a {profile.nodes}-node replica needs a fabric, but the assignment for rank "
                f"{assignment.rank} names no IB adapters: without NCCL_IB_HCA, NCCL may pick "
                "an adapter its peers cannot reach and hang"
            )
        for adapter in assignment.fabric_adapters:
            if not adapter or "," in adapter or adapter != adapter.strip():
                problems.append(f"fabric adapter {adapter!r} is not an adapter name")
    problems += group_problems(profile, [(assignment.rank, assignment.gpus)], whole_group=False)
    return problems
