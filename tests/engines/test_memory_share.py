"""A share of a card (`EngineProfile.gpu_memory_fraction`): the exact flag each engine
gets, what is refused, `memory_fraction`, MIG uuids in CUDA_VISIBLE_DEVICES, and the
engines' helps (the fake's, and the real llama-server's) against the widest commands."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest
from helpers import llama_server_binary

from llmgw.engines import (
    Assignment,
    EngineConfigError,
    EngineProfile,
    check_flags,
    memory_fraction,
    plan_launch,
    validate,
    widest_command,
)
from llmgw.model import Gpu

LEADER, WORKER = "10.0.0.1", "10.0.0.2"
MIG = "MIG-377e0049-554c-540b-93c6-d0976f8426cb"
MIG2 = "MIG-f39aa248-6f1b-5769-b119-8d650bb34b27"


def card(uuid: str = "GPU-0", index: int = 0) -> Gpu:
    return Gpu(index=index, uuid=uuid, name="NVIDIA H100", gpu_class="h100-80g")


def one(rank: int = 0, nodes: int = 1, gpus: tuple[Gpu, ...] = (card(),)) -> Assignment:
    return Assignment(
        rank=rank,
        node_addresses=(LEADER, WORKER)[:nodes],
        gpus=gpus,
        port=8001,
        rendezvous_port=29500,
        fabric_adapters=("mlx5_0",) if nodes > 1 else (),
    )


def engine_argv(profile: EngineProfile, assignment: Assignment) -> tuple[str, ...]:
    (engine,) = [p for p in plan_launch(profile, assignment).processes if p.name == "engine"]
    return engine.argv


VLLM = EngineProfile(engine="vllm", model="org/m", gpu_class="h100-80g")
SGLANG = EngineProfile(engine="sglang", model="org/m", gpu_class="h100-80g")
LLAMA = EngineProfile(engine="llama-server", model="/m/x.gguf", gpu_class="h100-80g")


# --- the exact command lines ----------------------------------------------------------------


def test_vllm_gets_gpu_memory_utilization() -> None:
    profile = attrs.evolve(VLLM, gpu_memory_fraction=0.45)
    assert engine_argv(profile, one()) == (
        "vllm", "serve", "org/m",
        "--host", "0.0.0.0", "--port", "8001", "--enable-prompt-tokens-details",
        "--tensor-parallel-size", "1",
        "--gpu-memory-utilization", "0.45",
    )  # fmt: skip
    assert "--gpu-memory-utilization" not in engine_argv(VLLM, one())  # whole card: nothing


def test_vllm_writes_the_share_on_every_rank_that_runs_vllm() -> None:
    # Native multi-node: every rank runs `vllm serve` and allocates on its own cards.
    profile = attrs.evolve(
        VLLM, gpus_per_node=1, nodes=2, tp=2, multinode="native", gpu_memory_fraction=0.3
    )
    worker = engine_argv(profile, one(rank=1, nodes=2))
    assert worker == (
        "vllm", "serve", "org/m",
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.3",
        "--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", LEADER, "--master-port", "29500", "--headless",
    )  # fmt: skip
    # Ray: the leader's `vllm serve` carries it (the Ray workers run what it starts).
    ray = attrs.evolve(profile, multinode="ray")
    leader = engine_argv(ray, one(rank=0, nodes=2))
    assert leader[leader.index("--gpu-memory-utilization") + 1] == "0.3"


def test_sglang_gets_mem_fraction_static_on_every_rank() -> None:
    profile = attrs.evolve(SGLANG, gpu_memory_fraction=0.5)
    assert engine_argv(profile, one()) == (
        "python3", "-m", "sglang.launch_server", "--model-path", "org/m",
        "--host", "0.0.0.0", "--port", "8001", "--tp-size", "1",
        "--enable-metrics", "--enable-cache-report", "--mem-fraction-static", "0.5",
    )  # fmt: skip
    two = attrs.evolve(profile, nodes=2, tp=2)
    worker = engine_argv(two, one(rank=1, nodes=2))
    assert worker[worker.index("--mem-fraction-static") + 1] == "0.5"
    assert "--mem-fraction-static" not in engine_argv(SGLANG, one())


def test_llama_server_gets_no_memory_flag() -> None:
    """No llama-server option holds it to a budget (llmgw/engines/_memory.py): its
    command line is the same with a share as without; the watch enforces the share."""
    shared = attrs.evolve(LLAMA, gpu_memory_fraction=0.25)
    assert engine_argv(shared, one()) == engine_argv(LLAMA, one()) == (
        "llama-server", "--model", "/m/x.gguf", "--host", "0.0.0.0", "--port", "8001",
        "--jinja", "--metrics",
    )  # fmt: skip


def test_the_fraction_is_written_exactly_never_rounded_up() -> None:
    for fraction, text in ((1.0, "1.0"), (0.01, "0.01"), (0.333, "0.333"), (1 / 3, repr(1 / 3))):
        argv = engine_argv(attrs.evolve(VLLM, gpu_memory_fraction=fraction), one())
        assert argv[argv.index("--gpu-memory-utilization") + 1] == text
        assert float(text) == fraction


# --- what is refused --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -0.2, 1.01, 2.0, float("nan"), float("inf")])
def test_a_fraction_outside_0_to_1_is_refused_naming_it(bad: float) -> None:
    with pytest.raises(EngineConfigError) as caught:
        validate(attrs.evolve(VLLM, gpu_memory_fraction=bad))
    assert caught.value.problems == (
        f"gpu_memory_fraction {bad!r} is not a share of a card: it must be above 0 and at most 1",
    )


def test_the_bounds_themselves() -> None:
    validate(attrs.evolve(VLLM, gpu_memory_fraction=1.0))
    validate(attrs.evolve(SGLANG, gpu_memory_fraction=0.01))


def test_a_cpu_profile_takes_no_share() -> None:
    cpu = EngineProfile(
        engine="llama-server", model="/m/x.gguf", gpus_per_node=0, gpu_memory_fraction=0.5
    )
    with pytest.raises(EngineConfigError) as caught:
        validate(cpu)
    assert caught.value.problems == (
        "gpu_memory_fraction 0.5 is a share of a card, but the profile runs on CPU "
        "(no gpu_class): leave it out",
    )


def test_engine_args_may_not_set_the_share_llmgw_sets() -> None:
    vllm = attrs.evolve(
        VLLM,
        gpu_memory_fraction=0.5,
        engine_args=("--gpu_memory_utilization=0.9", "--gpu-memory-utilization", "0.8"),
    )
    with pytest.raises(EngineConfigError) as caught:
        plan_launch(vllm, one())
    assert caught.value.problems == (
        "engine_args sets --gpu_memory_utilization, which llmgw sets itself for "
        "gpu_memory_fraction 0.5: remove it",
        "engine_args sets --gpu-memory-utilization, which llmgw sets itself for "
        "gpu_memory_fraction 0.5: remove it",
    )
    sglang = attrs.evolve(SGLANG, gpu_memory_fraction=0.5, engine_args=("--mem-fraction-static=1",))
    with pytest.raises(EngineConfigError) as caught:
        validate(sglang)
    assert caught.value.problems == (
        "engine_args sets --mem-fraction-static, which llmgw sets itself for "
        "gpu_memory_fraction 0.5: remove it",
    )
    # Without a share the operator's own setting stays theirs, as before.
    validate(attrs.evolve(VLLM, engine_args=("--gpu-memory-utilization", "0.8")))
    validate(attrs.evolve(SGLANG, engine_args=("--mem-fraction-static", "0.8")))


# --- memory_fraction ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gib", "mib", "fraction"),
    [
        (40, 81920, 0.5),  # exactly half
        (40.0, 81559, 0.5),  # an H100 80GB's real size: 0.5022 -> 0.5
        (20, 81559, 0.25),  # 0.2511
        (0.3, 1024, 0.3),  # the decimal the operator wrote, not 0.29999...
        (10, 81559, 0.12),  # 0.1255: down, never up
        (79.9, 81559, 1.0),  # 1.0032: never above the card
        (80, 81559, 1.0),
        (1, 10240, 0.1),
    ],
)
def test_memory_fraction(gib: float, mib: int, fraction: float) -> None:
    assert memory_fraction(gib, mib) == fraction


def test_memory_fraction_refuses_what_no_flag_could_say() -> None:
    with pytest.raises(ValueError) as caught:
        memory_fraction(0.5, 81559)
    assert str(caught.value) == (
        "gpu_memory_gib 0.5 is under 1% of a 81559 MiB card; the engines take a share in "
        "hundredths of the card: ask for at least 0.8 GiB"
    )
    assert memory_fraction(0.8, 81559) == 0.01  # the least it names does fit
    with pytest.raises(ValueError, match=r"^gpu_memory_gib 0 must be above 0$"):
        memory_fraction(0, 81559)
    with pytest.raises(ValueError, match=r"^card_memory_mib 0 must be above 0$"):
        memory_fraction(10, 0)


# --- MIG instances in CUDA_VISIBLE_DEVICES ------------------------------------------------


@pytest.mark.parametrize("profile", [VLLM, SGLANG, LLAMA], ids=lambda p: p.engine)
def test_a_mig_instance_is_named_by_its_uuid(profile: EngineProfile) -> None:
    plan = plan_launch(profile, one(gpus=(card(MIG, index=2),)))
    (engine,) = plan.processes
    assert dict(engine.env)["CUDA_VISIBLE_DEVICES"] == MIG


def test_a_replica_takes_one_mig_instance() -> None:
    two = attrs.evolve(VLLM, gpus_per_node=2, tp=2)
    with pytest.raises(EngineConfigError) as caught:
        plan_launch(two, one(gpus=(card(MIG), card(MIG2, index=1))))
    assert caught.value.problems == (
        f"node 0 offers 2 MIG instances ({MIG}, {MIG2}) for one replica: a CUDA process "
        "uses only one MIG instance, so a replica on MIG takes exactly one",
    )


# --- the helps --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "command", "flag"),
    [
        ("vllm", ["serve", "--help=all"], "--gpu-memory-utilization"),
        ("sglang", ["--model-path", "m", "--help"], "--mem-fraction-static"),
    ],
)
def test_the_fake_engines_help_lists_the_widest_command(
    engine: str, command: list[str], flag: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw.testing.fake_engine", "--fake-engine", engine, *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    widest = widest_command(engine)
    assert flag in widest
    assert check_flags(done.stdout, widest).missing == ()


def test_the_real_llama_server_has_no_budget_only_a_margin_against_free_memory() -> None:
    """The fact llama-server's plan rests on, read from the real binary's help: `--fit`
    fits to the device's free memory, and `--fit-target` is a margin left free, not a
    budget; and the widest command (with or without a share) is all in its help."""
    done = subprocess.run(
        [llama_server_binary(), "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join((done.stdout + done.stderr).split())
    assert "--fit-target MiB0,MiB1,MiB2,... target margin per device for --fit" in text
    assert "whether to adjust unset arguments to fit in device memory" in text
    assert check_flags(done.stdout + done.stderr, widest_command("llama-server")).missing == ()
