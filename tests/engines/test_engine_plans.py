"""Exact command lines and environments, per engine and shape."""

from __future__ import annotations

from llmgw.engines import (
    Assignment,
    EngineProfile,
    LaunchPlan,
    MetricNames,
    ProcessSpec,
    help_commands,
    metric_names,
    plan_launch,
    widest_command,
)
from llmgw.model import Gpu

LEADER, WORKER = "10.0.0.1", "10.0.0.2"


def gpu(i: int, cls: str = "h100-80g", cc: str | None = "9.0") -> Gpu:
    return Gpu(index=i, uuid=f"GPU-{cls}-{i}", name="NVIDIA", gpu_class=cls, compute_capability=cc)


def gpus(n: int, cls: str = "h100-80g", start: int = 0) -> tuple[Gpu, ...]:
    return tuple(gpu(i, cls) for i in range(start, start + n))


def cvd(n: int, start: int = 0) -> tuple[str, str]:
    return ("CUDA_VISIBLE_DEVICES", ",".join(f"GPU-h100-80g-{i}" for i in range(start, start + n)))


VLLM_METRICS = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
    kv_usage_fallback="vllm:gpu_cache_usage_perc",
    generated="vllm:generation_tokens_total",
)
SGLANG_METRICS = MetricNames(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage="sglang:token_usage",
    generated="sglang:generation_tokens_total",
)
LLAMA_METRICS = MetricNames(
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    kv_from_slots=True,
    generated="llamacpp:tokens_predicted_total",
)


# --- vLLM ---------------------------------------------------------------------


def test_vllm_single_gpu() -> None:
    profile = EngineProfile(
        engine="vllm",
        model="meta-llama/Llama-3.1-8B-Instruct",
        served_names=("llama-8b",),
        gpu_class="h100-80g",
    )
    assignment = Assignment(
        rank=0, node_addresses=(LEADER,), gpus=gpus(1), port=8001, rendezvous_port=29500
    )
    assert plan_launch(profile, assignment) == LaunchPlan(
        processes=(
            ProcessSpec(
                name="engine",
                argv=(
                    "vllm",
                    "serve",
                    "meta-llama/Llama-3.1-8B-Instruct",
                    "--host",
                    "0.0.0.0",
                    "--port",
                    "8001",
                    "--enable-prompt-tokens-details",
                    "--served-model-name",
                    "llama-8b",
                    "--tensor-parallel-size",
                    "1",
                ),
                env=(cvd(1),),
                role="engine",
            ),
        ),
        serves_http=True,
        port=8001,
        health_path="/health",
        models_path="/v1/models",
        metrics=VLLM_METRICS,
    )


def test_vllm_tensor_parallel_one_node_sets_no_fabric_env() -> None:
    profile = EngineProfile(
        engine="vllm",
        model="/models/llama-70b",
        served_names=("llama-70b", "llama"),
        gpu_class="h100-80g",
        gpus_per_node=4,
        tp=4,
        quantization="fp8",
        engine_args=("--max-model-len", "8192", "--enable-prefix-caching"),
    )
    # A fabric on a single-node replica is ignored: NCCL stays on NVLink.
    assignment = Assignment(
        rank=0,
        node_addresses=(LEADER,),
        gpus=gpus(4),
        port=8002,
        rendezvous_port=29500,
        fabric_adapters=("mlx5_0",),
        socket_interface="ens1f0",
    )
    (engine,) = plan_launch(profile, assignment).processes
    assert engine.argv == (
        "vllm",
        "serve",
        "/models/llama-70b",
        "--host",
        "0.0.0.0",
        "--port",
        "8002",
        "--enable-prompt-tokens-details",
        "--served-model-name",
        "llama-70b",
        "llama",
        "--tensor-parallel-size",
        "4",
        "--quantization",
        "fp8",
        "--max-model-len",
        "8192",
        "--enable-prefix-caching",
    )
    assert engine.env == (cvd(4),)


def _two_node(engine: str, multinode: str = "ray") -> EngineProfile:
    return EngineProfile(
        engine=engine,  # type: ignore[arg-type]
        model="/models/llama-405b",
        served_names=("llama-405b",),
        gpu_class="h100-80g",
        gpus_per_node=4,
        nodes=2,
        tp=4,
        pp=2,
        multinode=multinode,  # type: ignore[arg-type]
        engine_args=("--max-model-len", "32768"),
    )


def _rank(rank: int) -> Assignment:
    return Assignment(
        rank=rank,
        node_addresses=(LEADER, WORKER),
        gpus=gpus(4, start=4 * rank),
        port=8000,
        rendezvous_port=6379,
        fabric_adapters=("mlx5_0", "mlx5_1") if rank == 0 else ("mlx5_2", "mlx5_3"),
        socket_interface="ens1f0",
    )


def _net(rank: int) -> tuple[tuple[str, str], ...]:
    adapters = "=mlx5_0,mlx5_1" if rank == 0 else "=mlx5_2,mlx5_3"
    me = LEADER if rank == 0 else WORKER
    return (
        cvd(4, start=4 * rank),
        ("NCCL_IB_HCA", adapters),
        ("NCCL_SOCKET_IFNAME", "=ens1f0"),
        ("GLOO_SOCKET_IFNAME", "ens1f0"),
        ("VLLM_HOST_IP", me),
    )


def test_vllm_ray_leader_runs_ray_head_then_engine() -> None:
    plan = plan_launch(_two_node("vllm"), _rank(0))
    assert plan.processes == (
        ProcessSpec(
            name="ray-head",
            argv=(
                "ray",
                "start",
                "--head",
                "--port=6379",
                f"--node-ip-address={LEADER}",
                "--block",
            ),
            env=_net(0),
            role="sidecar",
            wait_for=(LEADER, 6379),
            wait_timeout_s=120.0,
        ),
        ProcessSpec(
            name="engine",
            argv=(
                "vllm",
                "serve",
                "/models/llama-405b",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--enable-prompt-tokens-details",
                "--served-model-name",
                "llama-405b",
                "--tensor-parallel-size",
                "4",
                "--pipeline-parallel-size",
                "2",
                "--distributed-executor-backend",
                "ray",
                "--max-model-len",
                "32768",
            ),
            env=(*_net(0), ("RAY_ADDRESS", f"{LEADER}:6379")),
            role="engine",
        ),
    )
    assert (plan.serves_http, plan.port) == (True, 8000)


def test_vllm_ray_worker_runs_only_a_ray_worker() -> None:
    plan = plan_launch(_two_node("vllm"), _rank(1))
    assert plan.processes == (
        ProcessSpec(
            name="ray-worker",
            argv=(
                "ray",
                "start",
                f"--address={LEADER}:6379",
                f"--node-ip-address={WORKER}",
                "--block",
            ),
            env=_net(1),
            role="engine",
        ),
    )
    assert (plan.serves_http, plan.port) == (False, None)
    assert plan.metrics == VLLM_METRICS


def test_vllm_native_leader() -> None:
    plan = plan_launch(_two_node("vllm", "native"), _rank(0))
    assert plan.processes == (
        ProcessSpec(
            name="engine",
            argv=(
                "vllm",
                "serve",
                "/models/llama-405b",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--enable-prompt-tokens-details",
                "--served-model-name",
                "llama-405b",
                "--tensor-parallel-size",
                "4",
                "--pipeline-parallel-size",
                "2",
                "--distributed-executor-backend",
                "mp",
                "--nnodes",
                "2",
                "--node-rank",
                "0",
                "--master-addr",
                LEADER,
                "--master-port",
                "6379",
                "--max-model-len",
                "32768",
            ),
            env=_net(0),
            role="engine",
        ),
    )
    assert (plan.serves_http, plan.port) == (True, 8000)


def test_vllm_native_worker_is_headless() -> None:
    plan = plan_launch(_two_node("vllm", "native"), _rank(1))
    assert plan.processes == (
        ProcessSpec(
            name="engine",
            argv=(
                "vllm",
                "serve",
                "/models/llama-405b",
                "--served-model-name",
                "llama-405b",
                "--tensor-parallel-size",
                "4",
                "--pipeline-parallel-size",
                "2",
                "--distributed-executor-backend",
                "mp",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                LEADER,
                "--master-port",
                "6379",
                "--headless",
                "--max-model-len",
                "32768",
            ),
            env=_net(1),
            role="engine",
        ),
    )
    assert (plan.serves_http, plan.port) == (False, None)


def test_executables_can_be_named() -> None:
    plan = plan_launch(
        _two_node("vllm"),
        _rank(0),
        executable="/opt/llmgw/engines/vllm-0.9/bin/vllm",
        ray_executable="/opt/llmgw/engines/vllm-0.9/bin/ray",
    )
    assert [p.argv[0] for p in plan.processes] == [
        "/opt/llmgw/engines/vllm-0.9/bin/ray",
        "/opt/llmgw/engines/vllm-0.9/bin/vllm",
    ]


# --- SGLang -------------------------------------------------------------------


def test_sglang_single_node_tp2() -> None:
    profile = EngineProfile(
        engine="sglang",
        model="Qwen/Qwen2.5-14B-Instruct",
        served_names=("qwen-14b",),
        gpu_class="h100-80g",
        gpus_per_node=2,
        tp=2,
    )
    assignment = Assignment(
        rank=0, node_addresses=(LEADER,), gpus=gpus(2), port=30010, rendezvous_port=29500
    )
    assert plan_launch(profile, assignment) == LaunchPlan(
        processes=(
            ProcessSpec(
                name="engine",
                argv=(
                    "python3",
                    "-m",
                    "sglang.launch_server",
                    "--model-path",
                    "Qwen/Qwen2.5-14B-Instruct",
                    "--host",
                    "0.0.0.0",
                    "--port",
                    "30010",
                    "--served-model-name",
                    "qwen-14b",
                    "--tp-size",
                    "2",
                    "--enable-metrics",
                    "--enable-cache-report",
                ),
                env=(cvd(2),),
                role="engine",
            ),
        ),
        serves_http=True,
        port=30010,
        health_path="/health",
        models_path="/v1/models",
        metrics=SGLANG_METRICS,
    )


def _sglang_env(rank: int) -> tuple[tuple[str, str], ...]:
    return _net(rank)[:-1]  # no VLLM_HOST_IP


def _sglang_argv(rank: int) -> tuple[str, ...]:
    return (
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/llama-405b",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "llama-405b",
        "--tp-size",
        "4",
        "--pp-size",
        "2",
        "--enable-metrics",
        "--enable-cache-report",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--dist-init-addr",
        f"{LEADER}:6379",
        "--max-model-len",
        "32768",
    )


def test_sglang_rank0_serves_http() -> None:
    plan = plan_launch(_two_node("sglang"), _rank(0))
    assert plan.processes == (
        ProcessSpec(name="engine", argv=_sglang_argv(0), env=_sglang_env(0), role="engine"),
    )
    assert (plan.serves_http, plan.port) == (True, 8000)


def test_sglang_rank1_is_judged_by_staying_alive() -> None:
    plan = plan_launch(_two_node("sglang"), _rank(1))
    assert plan.processes == (
        ProcessSpec(name="engine", argv=_sglang_argv(1), env=_sglang_env(1), role="engine"),
    )
    assert (plan.serves_http, plan.port) == (False, None)


def test_sglang_ipv6_leader_is_bracketed() -> None:
    assignment = Assignment(
        rank=1,
        node_addresses=("fd00::1", "fd00::2"),
        gpus=gpus(4),
        port=8000,
        rendezvous_port=29500,
        fabric_adapters=("mlx5_0",),
    )
    (engine,) = plan_launch(_two_node("sglang"), assignment).processes
    i = engine.argv.index("--dist-init-addr")
    assert engine.argv[i + 1] == "[fd00::1]:29500"
    # No socket interface given: NCCL and Gloo are left to choose.
    assert engine.env == (("CUDA_VISIBLE_DEVICES", cvd(4)[1]), ("NCCL_IB_HCA", "=mlx5_0"))


# --- llama-server -------------------------------------------------------------


def test_llama_server_on_cpu_hides_every_gpu() -> None:
    profile = EngineProfile(
        engine="llama-server",
        model="/models/qwen2.5-0.5b-instruct-q4_k_m.gguf",
        served_names=("qwen-small",),
        gpus_per_node=0,
    )
    assignment = Assignment(
        rank=0, node_addresses=(LEADER,), gpus=(), port=8080, rendezvous_port=29500
    )
    assert plan_launch(profile, assignment) == LaunchPlan(
        processes=(
            ProcessSpec(
                name="engine",
                argv=(
                    "llama-server",
                    "--model",
                    "/models/qwen2.5-0.5b-instruct-q4_k_m.gguf",
                    "--host",
                    "0.0.0.0",
                    "--port",
                    "8080",
                    "--jinja",
                    "--metrics",
                    "--alias",
                    "qwen-small",
                ),
                env=(("CUDA_VISIBLE_DEVICES", ""),),
                role="engine",
            ),
        ),
        serves_http=True,
        port=8080,
        health_path="/health",
        models_path="/v1/models",
        metrics=LLAMA_METRICS,
    )


def test_llama_server_no_jinja_from_the_profile_replaces_jinja() -> None:
    profile = EngineProfile(
        engine="llama-server",
        model="/models/m.gguf",
        served_names=("a", "b"),
        gpu_class="l40s-45g",
        gpus_per_node=2,
        engine_args=("--no-jinja", "--ctx-size", "8192"),
    )
    assignment = Assignment(
        rank=0, node_addresses=(LEADER,), gpus=gpus(2, "l40s-45g"), port=8081, rendezvous_port=1
    )
    (engine,) = plan_launch(profile, assignment).processes
    assert engine.argv == (
        "llama-server",
        "--model",
        "/models/m.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "8081",
        "--metrics",
        "--alias",
        "a,b",
        "--no-jinja",
        "--ctx-size",
        "8192",
    )
    assert engine.env == (("CUDA_VISIBLE_DEVICES", "GPU-l40s-45g-0,GPU-l40s-45g-1"),)


# --- per-engine facts ---------------------------------------------------------


def test_metric_names() -> None:
    assert metric_names("vllm") == VLLM_METRICS
    assert metric_names("sglang") == SGLANG_METRICS
    assert metric_names("llama-server") == LLAMA_METRICS


def test_widest_commands() -> None:
    assert widest_command("vllm") == (
        "vllm",
        "serve",
        "MODEL",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--enable-prompt-tokens-details",
        "--served-model-name",
        "NAME",
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "2",
        "--quantization",
        "QUANTIZATION",
        "--gpu-memory-utilization",
        "0.5",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--distributed-executor-backend",
        "ray",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "LEADER",
        "--master-port",
        "29500",
        "--headless",
    )
    assert widest_command("sglang") == (
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "MODEL",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "NAME",
        "--tp-size",
        "1",
        "--pp-size",
        "2",
        "--quantization",
        "QUANTIZATION",
        "--enable-metrics",
        "--enable-cache-report",
        "--mem-fraction-static",
        "0.5",
        "--enable-lora",
        "--max-loras-per-batch",
        "3",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "all",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--dist-init-addr",
        "LEADER:29500",
    )
    assert widest_command("llama-server") == (
        "llama-server",
        "--model",
        "MODEL",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--jinja",
        "--metrics",
        "--alias",
        "NAME",
        "--cache-ram",
        "0",
        "--lora-scaled",
        "ADAPTER_SOURCE:0",
    )


def test_help_commands() -> None:
    assert help_commands("vllm") == (
        ("vllm", "serve", "--help=all"),
        ("vllm", "serve", "--help"),
    )
    assert help_commands("sglang", "/venv/bin/python") == (
        ("/venv/bin/python", "-m", "sglang.launch_server", "--help"),
    )
    assert help_commands("llama-server") == (("llama-server", "--help"),)
