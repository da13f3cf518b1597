"""What every adapter shares: the GPU and fabric environment, and argv helpers."""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.engines._types import Assignment, EngineProfile

# Engines listen on every interface: the router reaches them across the network,
# and a node may have several addresses. The port comes from the assignment.
BIND_HOST = "0.0.0.0"
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
# How long the supervisor waits for a sidecar's port (a Ray head) before the
# engine that needs it starts.
SIDECAR_WAIT_S = 120.0


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def gpu_env(assignment: Assignment) -> list[tuple[str, str]]:
    """CUDA_VISIBLE_DEVICES by UUID, so indexes can never point at another card.

    nvidia-smi numbers cards in PCI order while CUDA's default order is
    "fastest first"; UUIDs mean the same card to both. With no GPUs (a CPU
    profile) the variable is set empty, so a CUDA build of the engine cannot
    reach for a card another replica owns.

    Caveat: vLLM before its NVML-based UUID lookup crashed on UUIDs
    (vllm-project/vllm#13815, "invalid literal for int()"), and MIG UUIDs
    were still refused in 0.20.1 (#41848).
    """
    return [("CUDA_VISIBLE_DEVICES", ",".join(g.uuid for g in assignment.gpus))]


def fabric_env(profile: EngineProfile, assignment: Assignment) -> list[tuple[str, str]]:
    """NCCL/Gloo network selection for a replica that spans nodes.

    NCCL_IB_HCA lists only the chosen fabric's adapters: left to itself NCCL
    may pick an adapter on a fabric the peer cannot reach, and the job hangs in
    its first collective. NCCL matches these names as prefixes ("mlx5_1" also
    selects mlx5_10..mlx5_17), so the list starts with "=", which NCCL reads as
    "exact names" (NCCL docs, "Environment Variables"). NCCL_SOCKET_IFNAME has
    the same prefix rule; GLOO_SOCKET_IFNAME takes the plain interface name.
    """
    if profile.nodes <= 1:
        return []
    env: list[tuple[str, str]] = []
    if assignment.fabric_adapters:
        env.append(("NCCL_IB_HCA", "=" + ",".join(assignment.fabric_adapters)))
    if assignment.socket_interface:
        env.append(("NCCL_SOCKET_IFNAME", "=" + assignment.socket_interface))
        env.append(("GLOO_SOCKET_IFNAME", assignment.socket_interface))
    return env


def flag_name(token: str) -> str | None:
    """`--port=8000` -> `--port`; `--port` -> `--port`; anything else -> None."""
    if not token.startswith("--") or token == "--":
        return None
    return token.split("=", 1)[0]


def flags_in(argv: Sequence[str]) -> tuple[str, ...]:
    """The long flags of a command line, in order, once each; stops at a bare `--`."""
    seen: dict[str, None] = {}
    for token in argv:
        if token == "--":
            break
        name = flag_name(token)
        if name is not None:
            seen.setdefault(name, None)
    return tuple(seen)


def short_flags_in(argv: Sequence[str]) -> tuple[str, ...]:
    """Single-dash options (`-m`, `-tp`) of a command line, for conflict checks only."""
    out: list[str] = []
    for token in argv:
        if token == "--":
            break
        if token.startswith("-") and not token.startswith("--") and len(token) > 1:
            head = token.split("=", 1)[0]
            if not head[1:2].isdigit():  # -1 is a value, not an option
                out.append(head)
    return tuple(out)


def owned_conflicts(
    engine_args: Sequence[str], owned: frozenset[str], *, underscores: bool = False
) -> list[str]:
    """Flags in `engine_args` that llmgw sets itself.

    Engines keep the last value of a repeated flag, so an operator's `--port`
    after ours would silently move the engine away from where the router looks.
    `underscores`: the engine also accepts `--tensor_parallel_size` spellings.
    """
    found: list[str] = []
    for name in (*flags_in(engine_args), *short_flags_in(engine_args)):
        key = name.replace("_", "-") if underscores and name.startswith("--") else name
        if key in owned and name not in found:
            found.append(name)
    return found


def split_command(argv: Sequence[str]) -> tuple[tuple[str, ...], list[tuple[str, tuple[str, ...]]]]:
    """(program and positionals before the first flag, [(flag, its tokens)])."""
    prefix: list[str] = []
    groups: list[tuple[str, list[str]]] = []
    for token in argv:
        name = flag_name(token)
        if name is not None:
            groups.append((name, [token]))
        elif groups:
            groups[-1][1].append(token)
        else:
            prefix.append(token)
    return tuple(prefix), [(n, tuple(t)) for n, t in groups]


def merge_commands(commands: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """One command holding every flag of `commands` once, first spelling wins."""
    prefix, _ = split_command(commands[0])
    merged: dict[str, tuple[str, ...]] = {}
    for command in commands:
        _, groups = split_command(command)
        for name, tokens in groups:
            merged.setdefault(name, tokens)
    out = list(prefix)
    for tokens in merged.values():
        out.extend(tokens)
    return tuple(out)


def count_problem(profile: EngineProfile) -> str | None:
    """nodes x GPUs per node must equal tp x pp, for the engines that shard by TP/PP."""
    have = profile.nodes * profile.gpus_per_node
    need = profile.tp * profile.pp
    if have == need:
        return None
    return (
        f"{plural(profile.nodes, 'node')} x {plural(profile.gpus_per_node, 'GPU')} = {have}, "
        f"but tp {profile.tp} x pp {profile.pp} = {need}"
    )


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
