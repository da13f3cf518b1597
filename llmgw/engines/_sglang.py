"""SGLang: `python3 -m sglang.launch_server --model-path M ...` on every rank.

Flag spellings from SGLang's server_args.py and docs/advanced_features/
server_arguments.md: `--model-path`, `--host`, `--port`, `--served-model-name`
(one name), `--tp-size` (alias of `--tensor-parallel-size`), `--pp-size`
(alias of `--pipeline-parallel-size`), `--quantization`,
`--mem-fraction-static` (a share of a card: `_memory`), `--enable-metrics`
(off by default: without it there is no /metrics), `--enable-cache-report`
(off by default: without it the usage has no
`prompt_tokens_details.cached_tokens`, and the router's prefix index never
learns what the engine had cached), and across nodes
`--nnodes`, `--node-rank`, `--dist-init-addr HOST:PORT`.

SGLang's own docs write `--tp 2`, which works only because argparse accepts
an unambiguous prefix of `--tp-size`; the help never lists `--tp`, so the
engine check could not confirm it, and a future `--tp-foo` flag would make it
ambiguous. llmgw writes `--tp-size`.

Rank 0 serves HTTP; the other ranks run schedulers only. They still get
`--host`/`--port` (the assignment's port), so that nothing on them falls back
to SGLang's default port 30000, which another replica on the node may hold.
"""

from __future__ import annotations

from llmgw.engines import _adapters, _memory
from llmgw.engines._common import (
    BIND_HOST,
    HEALTH_PATH,
    MODELS_PATH,
    count_problem,
    fabric_env,
    gpu_env,
    host_port,
    owned_conflicts,
)
from llmgw.engines._types import Assignment, EngineProfile, LaunchPlan, MetricNames, ProcessSpec

PROGRAM = "python3"
MODULE = "sglang.launch_server"
METRICS = MetricNames(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage="sglang:token_usage",
    generated="sglang:generation_tokens_total",
)
OWNED = frozenset(
    {
        "--model-path",
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--tensor-parallel-size",
        "--tp-size",
        "--tp",
        "--pipeline-parallel-size",
        "--pp-size",
        "--quantization",
        "--nnodes",
        "--node-rank",
        "--dist-init-addr",
        "--nccl-init-addr",
    }
)


def profile_problems(profile: EngineProfile) -> list[str]:
    problems: list[str] = []
    count = count_problem(profile)
    if count is not None:
        problems.append(count)
    if len(profile.served_names) > 1:
        problems.append(
            f"sglang serves one model name, the profile has {len(profile.served_names)} "
            f"({', '.join(profile.served_names)}): keep one"
        )
    for flag in owned_conflicts(profile.engine_args, OWNED):
        problems.append(f"engine_args sets {flag}, which llmgw sets itself: remove it")
    return problems


def plan(profile: EngineProfile, assignment: Assignment, *, program: str = PROGRAM) -> LaunchPlan:
    argv: list[str] = [
        program, "-m", MODULE,
        "--model-path", profile.model,
        "--host", BIND_HOST,
        "--port", str(assignment.port),
    ]  # fmt: skip
    if profile.served_names:
        argv += ["--served-model-name", profile.served_names[0]]
    argv += ["--tp-size", str(profile.tp)]
    if profile.pp > 1:
        argv += ["--pp-size", str(profile.pp)]
    if profile.quantization is not None:
        argv += ["--quantization", profile.quantization]
    argv += ["--enable-metrics", "--enable-cache-report"]
    argv += _memory.memory_args(profile)  # every rank: each allocates on its own cards
    argv += _adapters.launch_args(profile)  # every rank: server args must agree
    if profile.nodes > 1:
        argv += [
            "--nnodes", str(profile.nodes),
            "--node-rank", str(assignment.rank),
            "--dist-init-addr", host_port(assignment.node_addresses[0], assignment.rendezvous_port),
        ]  # fmt: skip
    argv += profile.engine_args
    env = gpu_env(assignment) + fabric_env(profile, assignment)
    engine = ProcessSpec(name="engine", argv=tuple(argv), env=tuple(env), role="engine")
    serves = assignment.rank == 0
    return LaunchPlan(
        processes=(engine,),
        serves_http=serves,
        port=assignment.port if serves else None,
        health_path=HEALTH_PATH,
        models_path=MODELS_PATH,
        metrics=METRICS,
    )
