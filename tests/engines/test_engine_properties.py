"""Properties over every valid shape, and the package's purity."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import attrs
from hypothesis import given
from hypothesis import strategies as st

import llmgw.engines
from llmgw.engines import (
    ENGINES,
    Assignment,
    EngineConfigError,
    EngineProfile,
    check_flags,
    plan_launch,
    validate,
    widest_command,
)
from llmgw.engines._common import flags_in
from llmgw.model import Gpu

# Long flags that are not llmgw's to own; they stand in for an operator's engine_args.
EXTRA_ARGS = st.lists(
    st.sampled_from(
        [
            ("--max-model-len", "8192"),
            ("--trust-remote-code",),
            ("--gpu-memory-utilization=0.85",),
            ("--enable-prefix-caching",),
        ]
    ),
    max_size=3,
    unique=True,
).map(lambda groups: tuple(tok for group in groups for tok in group))


@st.composite
def gpu_shapes(draw: st.DrawFn) -> tuple[EngineProfile, Assignment]:
    engine = draw(st.sampled_from(["vllm", "sglang"]))
    nodes = draw(st.integers(1, 4))
    per_node = draw(st.sampled_from([1, 2, 4, 8]))
    total = nodes * per_node
    pp = draw(st.sampled_from([d for d in range(1, total + 1) if total % d == 0]))
    names = draw(
        st.lists(
            st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True),
            max_size=1 if engine == "sglang" else 3,
        )
    )
    profile = EngineProfile(
        engine=engine,  # type: ignore[arg-type]
        model=draw(st.sampled_from(["/models/m", "org/model-7b"])),
        served_names=tuple(names),
        gpu_class="h100-80g",
        gpus_per_node=per_node,
        nodes=nodes,
        tp=total // pp,
        pp=pp,
        multinode=draw(st.sampled_from(["ray", "native"])) if engine == "vllm" else "ray",
        quantization=draw(st.sampled_from([None, "fp8", "awq"])),
        engine_args=draw(EXTRA_ARGS),
    )
    if not (engine == "vllm" and "--gpu-memory-utilization=0.85" in profile.engine_args):
        # a share of each card (the operator's own vLLM setting would be refused with it)
        share = draw(st.sampled_from([None, 0.01, 0.25, 0.5, 1.0]))
        profile = attrs.evolve(profile, gpu_memory_fraction=share)
    rank = draw(st.integers(0, nodes - 1))
    adapters = draw(
        st.lists(st.integers(0, 17).map(lambda i: f"mlx5_{i}"), min_size=1, max_size=4, unique=True)
    )
    port = draw(st.integers(1024, 65535))
    assignment = Assignment(
        rank=rank,
        node_addresses=tuple(f"10.0.0.{i + 1}" for i in range(nodes)),
        gpus=tuple(
            Gpu(
                index=i,
                uuid=f"GPU-{rank}-{i}",
                name="H100",
                gpu_class="h100-80g",
                compute_capability="9.0",
            )
            for i in range(per_node)
        ),
        port=port,
        rendezvous_port=draw(st.integers(1024, 65535).filter(lambda p: p != port)),
        fabric_adapters=tuple(adapters),
        socket_interface=draw(st.sampled_from([None, "ib0", "ens1f0"])),
    )
    return profile, assignment


@given(gpu_shapes())
def test_every_valid_shape_plans(shape: tuple[EngineProfile, Assignment]) -> None:
    profile, assignment = shape
    validate(profile)
    plan = plan_launch(profile, assignment)
    roles = [p.role for p in plan.processes]
    assert roles[-1] == "engine" and set(roles[:-1]) <= {"sidecar"}
    assert plan.serves_http == (assignment.rank == 0)
    assert plan.port == (assignment.port if assignment.rank == 0 else None)
    for process in plan.processes:
        env = dict(process.env)
        assert len(env) == len(process.env), "a variable set twice"
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in assignment.gpus)


@given(gpu_shapes())
def test_nccl_ib_hca_names_only_the_assigned_adapters(
    shape: tuple[EngineProfile, Assignment],
) -> None:
    profile, assignment = shape
    for process in plan_launch(profile, assignment).processes:
        env = dict(process.env)
        if profile.nodes == 1:
            assert "NCCL_IB_HCA" not in env
            continue
        value = env["NCCL_IB_HCA"]
        assert value.startswith("=")  # exact names: "mlx5_1" must not select mlx5_10
        assert tuple(value[1:].split(",")) == assignment.fabric_adapters


@given(gpu_shapes())
def test_plans_use_only_flags_of_the_widest_command(
    shape: tuple[EngineProfile, Assignment],
) -> None:
    profile, assignment = shape
    widest = set(flags_in(widest_command(profile.engine)))
    for process in plan_launch(profile, assignment).processes:
        if process.name != "engine":
            continue
        n = len(profile.engine_args)
        ours, theirs = process.argv[: len(process.argv) - n], process.argv[len(process.argv) - n :]
        assert theirs == profile.engine_args  # the profile's arguments go last, verbatim
        assert set(flags_in(ours)) <= widest


def test_widest_commands_hold_each_flag_once() -> None:
    for engine in ENGINES:
        command = widest_command(engine)
        counts = Counter(tok.split("=", 1)[0] for tok in command if tok.startswith("--"))
        assert counts and max(counts.values()) == 1, (engine, counts)


@given(st.text(max_size=300), st.lists(st.text(max_size=12), max_size=6))
def test_check_flags_never_raises_and_reports_a_subset(help_text: str, argv: list[str]) -> None:
    result = check_flags(help_text, argv)
    assert set(result.missing) <= set(flags_in(argv))
    assert len(set(result.missing)) == len(result.missing)


@given(
    st.lists(st.from_regex(r"--[a-z]{1,8}(-[a-z]{1,6})?", fullmatch=True), min_size=1, max_size=8)
)
def test_a_help_listing_each_flag_satisfies_it(flags: list[str]) -> None:
    help_text = "".join(f"  {flag} VALUE    some help\n" for flag in flags)
    assert check_flags(help_text, ["prog", *flags]).missing == ()


@given(
    st.builds(
        EngineProfile,
        engine=st.sampled_from(["vllm", "sglang", "llama-server"]),
        model=st.sampled_from(["", "m"]),
        served_names=st.lists(st.sampled_from(["a", "b,c", ""]), max_size=2).map(tuple),
        gpu_class=st.sampled_from([None, "h100-80g"]),
        gpus_per_node=st.integers(-1, 8),
        nodes=st.integers(0, 3),
        tp=st.integers(0, 8),
        pp=st.integers(0, 3),
        multinode=st.sampled_from(["ray", "native"]),
        quantization=st.sampled_from([None, "fp8"]),
        engine_args=st.sampled_from([(), ("--port", "1"), ("--max-model-len", "4")]),
    )
)
def test_validate_accepts_or_names_problems(profile: EngineProfile) -> None:
    try:
        validate(profile)
    except EngineConfigError as err:
        assert err.problems and all(p for p in err.problems)
        assert str(err) == "; ".join(err.problems)


FORBIDDEN = {
    "trio",
    "anyio",
    "asyncio",
    "subprocess",
    "socket",
    "os",
    "pathlib",
    "shutil",
    "io",
    "threading",
    "multiprocessing",
    "capnp",
    "httpx",
    "httpcore",
    "hypercorn",
    "signal",
    "tempfile",
    "urllib",
    "http",
}


def test_the_package_does_no_io() -> None:
    package = Path(llmgw.engines.__file__).parent
    for source in sorted(package.glob("*.py")):
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN, f"{source.name} imports {name}"
                if top == "llmgw":
                    assert name.startswith(("llmgw.engines", "llmgw.model", "llmgw.errors")), (
                        f"{source.name} imports {name}"
                    )
