"""Every refusal, with the message the operator reads."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from llmgw.engines import Assignment, EngineConfigError, EngineProfile, plan_launch, validate
from llmgw.errors import ConfigError
from llmgw.model import Gpu

H100 = ("h100-80g", "9.0")
L40S = ("l40s-45g", "8.9")
A100 = ("a100-80g", "8.0")


def cards(n: int, kind: tuple[str, str | None] = H100, start: int = 0) -> list[Gpu]:
    cls, cc = kind
    return [
        Gpu(index=i, uuid=f"GPU-{cls}-{i}", name=cls, gpu_class=cls, compute_capability=cc)
        for i in range(start, start + n)
    ]


def vllm(**changes: Any) -> EngineProfile:
    base = EngineProfile(
        engine="vllm", model="/models/m", gpu_class="h100-80g", gpus_per_node=4, nodes=2, tp=4, pp=2
    )
    return attrs.evolve(base, **changes)


def refusal(profile: EngineProfile, group: list[list[Gpu]] | None = None) -> EngineConfigError:
    with pytest.raises(EngineConfigError) as caught:
        validate(profile, group)
    return caught.value


def test_a_valid_profile_and_group_pass() -> None:
    validate(vllm(), [cards(4), cards(4, start=4)])  # the positive control for the refusals below


def test_error_is_a_config_error_listing_every_problem() -> None:
    err = refusal(vllm(tp=3, engine_args=("--port", "9")))
    assert isinstance(err, ConfigError)
    assert err.problems == (
        "2 nodes x 4 GPUs = 8, but tp 3 x pp 2 = 6",
        "engine_args sets --port, which llmgw sets itself: remove it",
    )
    assert str(err) == "; ".join(err.problems)


def test_mixed_gpu_types_across_nodes() -> None:
    err = refusal(vllm(), [cards(4), cards(4, L40S)])
    assert str(err) == "node 1 has l40s-45g, node 0 has h100-80g: one replica must use one GPU type"


def test_mixed_gpu_types_within_a_node() -> None:
    err = refusal(vllm(nodes=1, pp=1), [cards(2) + cards(2, L40S, start=2)])
    assert str(err) == "node 0 has h100-80g and l40s-45g: one replica must use one GPU type"


def test_counts_that_do_not_add_up() -> None:
    assert str(refusal(vllm(pp=1))) == "2 nodes x 4 GPUs = 8, but tp 4 x pp 1 = 4"
    assert str(refusal(vllm(nodes=1, gpus_per_node=1, pp=1))) == (
        "1 node x 1 GPU = 1, but tp 4 x pp 1 = 4"
    )


def test_sglang_counts_too() -> None:
    profile = EngineProfile(engine="sglang", model="m", gpu_class="h100-80g", gpus_per_node=8, tp=4)
    assert str(refusal(profile)) == "1 node x 8 GPUs = 8, but tp 4 x pp 1 = 4"


def test_fp8_below_compute_capability_8_9() -> None:
    profile = vllm(gpu_class="a100-80g", nodes=1, pp=1, quantization="fp8")
    err = refusal(profile, [cards(4, A100)])
    assert str(err) == "fp8 needs compute capability 8.9 or newer; a100-80g has 8.0"


def test_fp8_on_ada_and_on_unknown_capability_passes() -> None:
    validate(vllm(gpu_class="l40s-45g", nodes=1, pp=1, quantization="fp8"), [cards(4, L40S)])
    # The driver did not say: unknown is not a reason to refuse.
    validate(
        vllm(gpu_class="a100-80g", nodes=1, pp=1, quantization="fp8"),
        [cards(4, ("a100-80g", None))],
    )


def test_engines_other_than_llama_server_need_a_gpu_class() -> None:
    assert str(refusal(EngineProfile(engine="vllm", model="m"))) == (
        "vllm needs a gpu_class; only llama-server runs on CPU"
    )
    assert str(refusal(EngineProfile(engine="sglang", model="m"))) == (
        "sglang needs a gpu_class; only llama-server runs on CPU"
    )


def test_a_cpu_profile_takes_no_gpus() -> None:
    profile = EngineProfile(engine="llama-server", model="m.gguf")  # gpus_per_node defaults to 1
    assert str(refusal(profile)) == (
        "a CPU profile (no gpu_class) uses no GPUs, but gpus_per_node is 1: "
        "make it 0, or name a gpu_class"
    )
    cpu = attrs.evolve(profile, gpus_per_node=0)
    validate(cpu, [[]])
    assert str(refusal(cpu, [cards(1)])) == "a CPU profile takes no GPUs, but node 0 offers 1"


def test_llama_server_refuses_tensor_parallel_and_multi_node() -> None:
    profile = EngineProfile(
        engine="llama-server", model="m.gguf", gpu_class="h100-80g", gpus_per_node=2, tp=2
    )
    assert refusal(profile).problems == (
        "llama-server cannot run tensor-parallel: tp is 2, it must be 1 "
        "(use vllm or sglang to split a model by tensor parallelism)",
    )
    assert refusal(attrs.evolve(profile, tp=1, nodes=2)).problems == (
        "llama-server runs on one node, the profile asks for 2 (use vllm or sglang across nodes)",
    )
    assert refusal(attrs.evolve(profile, tp=1, pp=2)).problems == (
        "llama-server cannot run pipeline-parallel: pp is 2, it must be 1",
    )


def test_llama_server_takes_quantization_from_the_gguf() -> None:
    profile = EngineProfile(
        engine="llama-server", model="m.gguf", gpus_per_node=0, quantization="q4"
    )
    assert str(refusal(profile)) == (
        "llama-server takes its quantization from the GGUF file: remove quantization 'q4' "
        "(pick a quantized GGUF as the model instead)"
    )


def test_llama_server_alias_with_a_comma() -> None:
    profile = EngineProfile(
        engine="llama-server", model="m.gguf", gpus_per_node=0, served_names=("a,b",)
    )
    assert str(refusal(profile)) == (
        "served name 'a,b' has a comma, which llama-server's --alias reads as a separator"
    )


def test_native_multinode_is_vllm_only() -> None:
    profile = EngineProfile(
        engine="sglang",
        model="m",
        gpu_class="h100-80g",
        gpus_per_node=4,
        nodes=2,
        tp=8,
        multinode="native",
    )
    assert str(refusal(profile)) == (
        "multinode 'native' is vLLM's own multi-node mode; sglang cannot use it: remove multinode"
    )
    validate(attrs.evolve(vllm(), multinode="native"))


def test_sglang_serves_one_name() -> None:
    profile = EngineProfile(
        engine="sglang", model="m", gpu_class="h100-80g", served_names=("a", "b")
    )
    assert (
        str(refusal(profile)) == "sglang serves one model name, the profile has 2 (a, b): keep one"
    )


def test_engine_args_may_not_set_what_llmgw_sets() -> None:
    err = refusal(vllm(engine_args=("--tensor_parallel_size", "8", "-tp", "8", "--master-port=1")))
    assert err.problems == (
        "engine_args sets --tensor_parallel_size, which llmgw sets itself: remove it",
        "engine_args sets --master-port, which llmgw sets itself: remove it",
        "engine_args sets -tp, which llmgw sets itself: remove it",
    )
    llama = EngineProfile(
        engine="llama-server", model="m.gguf", gpus_per_node=0, engine_args=("-m", "other.gguf")
    )
    assert str(refusal(llama)) == "engine_args sets -m, which llmgw sets itself: remove it"
    # Values that look like negative numbers are not options.
    validate(attrs.evolve(llama, engine_args=("--n-predict", "-1")))


def test_scalar_fields() -> None:
    profile = EngineProfile(
        engine="vllm",
        model="",
        gpu_class="h100-80g",
        gpus_per_node=0,
        nodes=0,
        tp=0,
        multinode="slurm",  # type: ignore[arg-type]
        port_range=(9000, 8000),
        served_names=(" x",),
    )
    assert refusal(profile).problems == (
        "model is empty: give a local path or a hub id",
        "nodes must be 1 or more, not 0",
        "tp must be 1 or more, not 0",
        "multinode 'slurm' is not one of ray, native",
        "gpus_per_node must be 1 or more for a GPU profile (h100-80g), not 0",
        "port_range 9000-8000 is not a range of TCP ports (low <= high, both within 1-65535)",
        "served name ' x' is empty or has spaces around it",
    )


def test_unknown_engine() -> None:
    profile = EngineProfile(engine="tgi", model="m", gpu_class="h100-80g")  # type: ignore[arg-type]
    assert str(refusal(profile)) == "engine 'tgi' is not one of vllm, sglang, llama-server"


def test_group_shape_against_the_profile() -> None:
    err = refusal(vllm(), [cards(3, A100)])
    assert err.problems == (
        "the group has 1 node, the profile needs 2",
        "node 0 offers 3 GPUs for this replica, the profile needs 4 per node",
        "the GPUs are a100-80g, the profile asks for h100-80g",
    )


# --- checks that need the assignment (plan_launch) ----------------------------


def assignment(**changes: Any) -> Assignment:
    base = Assignment(
        rank=0,
        node_addresses=("10.0.0.1", "10.0.0.2"),
        gpus=tuple(cards(4)),
        port=8000,
        rendezvous_port=6379,
        fabric_adapters=("mlx5_0",),
        socket_interface="ib0",
    )
    return attrs.evolve(base, **changes)


def plan_refusal(profile: EngineProfile, a: Assignment) -> EngineConfigError:
    with pytest.raises(EngineConfigError) as caught:
        plan_launch(profile, a)
    return caught.value


def test_multi_node_without_a_fabric_is_refused_when_planning() -> None:
    err = plan_refusal(vllm(), assignment(rank=1, fabric_adapters=()))
    assert str(err) == (
        "a 2-node replica needs a fabric, but the assignment for rank 1 names no IB adapters: "
        "without NCCL_IB_HCA, NCCL may pick an adapter its peers cannot reach and hang"
    )
    # One node needs none.
    single = vllm(nodes=1, pp=1)
    plan_launch(single, assignment(node_addresses=("10.0.0.1",), fabric_adapters=()))


def test_profile_problems_are_refused_when_planning_too() -> None:
    err = plan_refusal(vllm(pp=1), assignment())
    assert str(err) == "2 nodes x 4 GPUs = 8, but tp 4 x pp 1 = 4"


def test_assignment_that_does_not_fit_the_profile() -> None:
    err = plan_refusal(
        vllm(port_range=(8000, 8099)),
        assignment(
            rank=2,
            node_addresses=("10.0.0.1",),
            port=9000,
            rendezvous_port=70000,
            gpus=tuple(cards(2)),
        ),
    )
    assert err.problems == (
        "the assignment names 1 node address, the profile needs 2",
        "rank 2 is outside 0-1 for a 2-node profile",
        "rendezvous_port 70000 is not a TCP port (1-65535)",
        "port 9000 is outside the profile's port_range 8000-8099",
        "node 2 offers 2 GPUs for this replica, the profile needs 4 per node",
    )


def test_port_and_rendezvous_port_must_differ_across_nodes() -> None:
    err = plan_refusal(vllm(), assignment(rendezvous_port=8000))
    assert str(err) == "port and rendezvous_port are both 8000; they must differ"


def test_fp8_is_checked_on_the_assigned_cards() -> None:
    profile = vllm(gpu_class="a100-80g", nodes=1, pp=1, quantization="fp8")
    err = plan_refusal(
        profile, assignment(node_addresses=("10.0.0.1",), gpus=tuple(cards(4, A100)))
    )
    assert str(err) == "fp8 needs compute capability 8.9 or newer; a100-80g has 8.0"
