"""vLLM: `vllm serve MODEL ...`, on one node, across nodes with Ray, or natively.

Flag spellings were read from vLLM's source and docs (see the report in the
commit): `--host`, `--port`, `--served-model-name` (one or more names),
`--tensor-parallel-size`, `--pipeline-parallel-size`, `--quantization`,
`--gpu-memory-utilization` (a share of a card: `_memory`),
`--distributed-executor-backend {ray,mp}`, `--enable-prompt-tokens-details`
(a frontend flag: without it vLLM's usage has no
`prompt_tokens_details.cached_tokens`, and the router's prefix index never
learns what the engine had cached), and for vLLM's own multi-node mode
`--nnodes`, `--node-rank`, `--master-addr`, `--master-port` (ParallelConfig
fields, vllm/config/parallel.py) with `--headless` on every rank but 0
(vllm/entrypoints/cli/serve.py). Ray: `ray start --head --port=P --block` on
the leader, `ray start --address=HEAD:P --block` on the others, both with
`--node-ip-address` so Ray advertises the address placement chose.

Multi-node with Ray: the leader runs the Ray head as a sidecar, waits for its
port, then runs `vllm serve ... --distributed-executor-backend ray` with
RAY_ADDRESS pointing at that head (not "auto", which picks the newest Ray on
the machine and could be another replica's). The other ranks run only a Ray
worker, which is their "engine": its exit is the shard's exit.

Multi-node native: every rank runs `vllm serve` with the same model and shape;
rank 0 serves HTTP, the others run `--headless`.
"""

from __future__ import annotations

from llmgw.engines import _adapters, _memory
from llmgw.engines._common import (
    BIND_HOST,
    HEALTH_PATH,
    MODELS_PATH,
    SIDECAR_WAIT_S,
    count_problem,
    fabric_env,
    gpu_env,
    host_port,
    owned_conflicts,
)
from llmgw.engines._types import Assignment, EngineProfile, LaunchPlan, MetricNames, ProcessSpec

PROGRAM = "vllm"
CACHE_REPORT = "--enable-prompt-tokens-details"
RAY_PROGRAM = "ray"
METRICS = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
    kv_usage_fallback="vllm:gpu_cache_usage_perc",
    generated="vllm:generation_tokens_total",
)
# Flags llmgw sets; `-tp`, `-pp` and `-q` are vLLM's short spellings of three.
OWNED = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--tensor-parallel-size",
        "-tp",
        "--pipeline-parallel-size",
        "-pp",
        "--quantization",
        "-q",
        "--distributed-executor-backend",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--headless",
    }
)


def profile_problems(profile: EngineProfile) -> list[str]:
    problems: list[str] = []
    count = count_problem(profile)
    if count is not None:
        problems.append(count)
    for flag in owned_conflicts(profile.engine_args, OWNED, underscores=True):
        problems.append(f"engine_args sets {flag}, which llmgw sets itself: remove it")
    return problems


def plan(
    profile: EngineProfile,
    assignment: Assignment,
    *,
    program: str = PROGRAM,
    ray_program: str = RAY_PROGRAM,
) -> LaunchPlan:
    rank = assignment.rank
    leader = assignment.node_addresses[0]
    me = assignment.node_addresses[rank]
    rdv = assignment.rendezvous_port
    env = gpu_env(assignment) + fabric_env(profile, assignment)
    if profile.nodes > 1:
        # vLLM reads its own address from VLLM_HOST_IP for the distributed
        # groups; without it it guesses, and may guess another interface.
        env.append(("VLLM_HOST_IP", me))
    serve_env = env + _adapters.launch_env(profile)  # what `vllm serve` runs with
    # Only the rank that serves HTTP: the flags of vLLM's OpenAI frontend.
    http = ["--host", BIND_HOST, "--port", str(assignment.port), CACHE_REPORT]
    shape = _shape_args(profile)

    if profile.nodes == 1:
        argv = (program, "serve", profile.model, *http, *shape, *profile.engine_args)
        return _plan((_engine(argv, serve_env),), assignment.port)

    if profile.multinode == "ray":
        address = host_port(leader, rdv)
        if rank != 0:
            worker = ProcessSpec(
                name="ray-worker",
                argv=(
                    ray_program,
                    "start",
                    f"--address={address}",
                    f"--node-ip-address={me}",
                    "--block",
                ),
                env=tuple(env),
                role="engine",
            )
            return _plan((worker,), None)
        head = ProcessSpec(
            name="ray-head",
            argv=(
                ray_program,
                "start",
                "--head",
                f"--port={rdv}",
                f"--node-ip-address={me}",
                "--block",
            ),
            env=tuple(env),
            role="sidecar",
            wait_for=(leader, rdv),
            wait_timeout_s=SIDECAR_WAIT_S,
        )
        argv = (
            program, "serve", profile.model, *http, *shape,
            "--distributed-executor-backend", "ray",
            *profile.engine_args,
        )  # fmt: skip
        engine_env = [*serve_env, ("RAY_ADDRESS", address)]
        return _plan((head, _engine(argv, engine_env)), assignment.port)

    native = [
        "--distributed-executor-backend", "mp",
        "--nnodes", str(profile.nodes),
        "--node-rank", str(rank),
        "--master-addr", leader,
        "--master-port", str(rdv),
    ]  # fmt: skip
    if rank == 0:
        argv = (program, "serve", profile.model, *http, *shape, *native, *profile.engine_args)
        return _plan((_engine(argv, serve_env),), assignment.port)
    argv = (program, "serve", profile.model, *shape, *native, "--headless", *profile.engine_args)
    return _plan((_engine(argv, serve_env),), None)


def _shape_args(profile: EngineProfile) -> list[str]:
    args: list[str] = []
    if profile.served_names:
        args += ["--served-model-name", *profile.served_names]
    args += ["--tensor-parallel-size", str(profile.tp)]
    if profile.pp > 1:
        args += ["--pipeline-parallel-size", str(profile.pp)]
    if profile.quantization is not None:
        args += ["--quantization", profile.quantization]
    args += _memory.memory_args(profile)  # every rank's workers allocate on their cards
    # Every rank: the LoRA layers are part of the model each worker builds.
    return args + _adapters.launch_args(profile)


def _engine(argv: tuple[str, ...], env: list[tuple[str, str]]) -> ProcessSpec:
    return ProcessSpec(name="engine", argv=argv, env=tuple(env), role="engine")


def _plan(processes: tuple[ProcessSpec, ...], port: int | None) -> LaunchPlan:
    serves = port is not None
    return LaunchPlan(
        processes=processes,
        serves_http=serves,
        port=port,
        health_path=HEALTH_PATH,
        models_path=MODELS_PATH,
        metrics=METRICS,
    )
