"""Dispatch by engine: plan a shard, name its metrics, give the widest command."""

from __future__ import annotations

import attrs

from llmgw.engines import _llamacpp, _sglang, _vllm
from llmgw.engines._common import merge_commands
from llmgw.engines._types import (
    ENGINES,
    Assignment,
    EngineConfigError,
    EngineProfile,
    LaunchAdapter,
    LaunchPlan,
    MetricNames,
)
from llmgw.engines._validate import assignment_problems, profile_problems
from llmgw.model import Gpu


def plan_launch(
    profile: EngineProfile,
    assignment: Assignment,
    *,
    executable: str | None = None,
    ray_executable: str | None = None,
) -> LaunchPlan:
    """The processes to run for one shard, or `EngineConfigError` naming every problem.

    `executable` replaces the engine's program (`vllm`, the Python that
    imports sglang, `llama-server`); `ray_executable` replaces `ray`. By
    default they are looked up on PATH by whoever runs the plan.
    """
    problems = profile_problems(profile)
    if not problems:
        problems = assignment_problems(profile, assignment)
    if problems:
        raise EngineConfigError(tuple(problems))
    if profile.engine == "vllm":
        return _vllm.plan(
            profile,
            assignment,
            program=executable or _vllm.PROGRAM,
            ray_program=ray_executable or _vllm.RAY_PROGRAM,
        )
    if profile.engine == "sglang":
        return _sglang.plan(profile, assignment, program=executable or _sglang.PROGRAM)
    return _llamacpp.plan(profile, assignment, program=executable or _llamacpp.PROGRAM)


def metric_names(engine: str) -> MetricNames:
    if engine == "vllm":
        return _vllm.METRICS
    if engine == "sglang":
        return _sglang.METRICS
    if engine == "llama-server":
        return _llamacpp.METRICS
    raise _unknown(engine)


def help_commands(engine: str, executable: str | None = None) -> tuple[tuple[str, ...], ...]:
    """The commands that print `engine`'s help, best first.

    Recent vLLM prints a grouped summary for `--help` and every flag only for
    `--help=all`; older vLLM rejects `--help=all`, hence the fallback.
    """
    if engine == "vllm":
        program = executable or _vllm.PROGRAM
        return ((program, "serve", "--help=all"), (program, "serve", "--help"))
    if engine == "sglang":
        return ((executable or _sglang.PROGRAM, "-m", _sglang.MODULE, "--help"),)
    if engine == "llama-server":
        return ((executable or _llamacpp.PROGRAM, "--help"),)
    raise _unknown(engine)


def widest_command(engine: str) -> tuple[str, ...]:
    """The engine command with every flag any plan can produce, each once.

    Built by planning the shapes that between them produce every flag
    (multi-node leader and worker ranks, pipeline parallelism, quantization,
    served names, LoRA adapters, a share of a card) and merging their engine
    command lines, so it cannot drift from what `plan_launch` writes. Values
    are placeholders. Ray's own commands (vLLM multi-node) are not part of
    it: Ray is another program with another help.
    """
    if engine not in ENGINES:
        raise _unknown(engine)
    if engine == "llama-server":
        profile = EngineProfile(
            engine="llama-server",
            model="MODEL",
            served_names=("NAME",),
            gpus_per_node=0,
            max_adapters=1,
            adapters=(LaunchAdapter("ADAPTER", "ADAPTER_SOURCE"),),
        )
        return _llamacpp.plan(profile, _assignment(0, gpus=False)).processes[-1].argv
    base = EngineProfile(
        engine=ENGINES[ENGINES.index(engine)],  # the same name, typed as EngineName
        model="MODEL",
        served_names=("NAME",),
        gpu_class="GPU_CLASS",
        gpus_per_node=1,
        nodes=2,
        tp=1,
        pp=2,
        quantization="QUANTIZATION",
        max_adapters=2,
        max_adapter_rank=16,
        gpu_memory_fraction=0.5,
    )
    shapes = [base, attrs.evolve(base, multinode="native")] if engine == "vllm" else [base]
    commands: list[tuple[str, ...]] = []
    for profile in shapes:
        for rank in (0, 1):
            planned = (
                _vllm.plan(profile, _assignment(rank))
                if engine == "vllm"
                else _sglang.plan(profile, _assignment(rank))
            )
            commands += [p.argv for p in planned.processes if p.name == "engine"]
    return merge_commands(commands)


def _assignment(rank: int, *, gpus: bool = True) -> Assignment:
    return Assignment(
        rank=rank,
        node_addresses=("LEADER", "NODE1"),
        gpus=(Gpu(index=0, uuid="GPU-UUID", name="GPU", gpu_class="GPU_CLASS"),) if gpus else (),
        port=8000,
        rendezvous_port=29500,
        fabric_adapters=("mlx5_0",),
        socket_interface="eth0",
    )


def _unknown(engine: str) -> EngineConfigError:
    return EngineConfigError((f"engine {engine!r} is not one of {', '.join(ENGINES)}",))
