"""llama.cpp's llama-server: one process, one node, GPUs or CPU only.

Flag spellings from llama.cpp tools/server/README.md (generated from the
server's own `--help`): `-m, --model FNAME`, `--host HOST`, `--port PORT`,
`--jinja, --no-jinja`, `--metrics`, `-a, --alias STRING` (comma-separated
aliases in current builds; older builds took a single alias, so one served
name is the portable case). llmgw writes the long spellings so that the engine
check can confirm every one of them against `--help`; the check reads long
flags only.

`--jinja` is written unless the profile's engine_args already say `--jinja`
or `--no-jinja` (how a profile turns it off). Recent builds enable jinja by
default, older ones did not, so llmgw says it explicitly.

With several GPUs llama-server splits the model by layers across all the
cards it can see (its `--split-mode layer` default): that is neither tensor
nor pipeline parallelism in llmgw's terms, so a llama-server profile keeps
tp 1, pp 1, and simply gets `gpus_per_node` cards.

A share of a card (`gpu_memory_fraction`) adds nothing to its command line:
llama-server has no option that holds it to a memory budget (`_memory` says
why `--fit-target` is not one), so its share is enforced by the watch only.
"""

from __future__ import annotations

from llmgw.engines import _adapters
from llmgw.engines._common import (
    BIND_HOST,
    HEALTH_PATH,
    MODELS_PATH,
    flags_in,
    gpu_env,
    owned_conflicts,
)
from llmgw.engines._types import Assignment, EngineProfile, LaunchPlan, MetricNames, ProcessSpec

PROGRAM = "llama-server"
# Its KV-usage gauge was removed upstream: the KV state comes from GET /slots.
METRICS = MetricNames(
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    kv_from_slots=True,
    generated="llamacpp:tokens_predicted_total",  # counted as each request ends
)
OWNED = frozenset({"--model", "-m", "--host", "--port", "--alias", "-a"})


def profile_problems(profile: EngineProfile) -> list[str]:
    problems: list[str] = []
    if profile.tp != 1:
        problems.append(
            f"llama-server cannot run tensor-parallel: tp is {profile.tp}, it must be 1 "
            "(use vllm or sglang to split a model by tensor parallelism)"
        )
    if profile.pp != 1:
        problems.append(
            f"llama-server cannot run pipeline-parallel: pp is {profile.pp}, it must be 1"
        )
    if profile.nodes != 1:
        problems.append(
            f"llama-server runs on one node, the profile asks for {profile.nodes} "
            "(use vllm or sglang across nodes)"
        )
    if profile.quantization is not None:
        problems.append(
            f"llama-server takes its quantization from the GGUF file: remove quantization "
            f"{profile.quantization!r} (pick a quantized GGUF as the model instead)"
        )
    for name in profile.served_names:
        if "," in name:
            problems.append(
                f"served name {name!r} has a comma, which llama-server's --alias reads "
                "as a separator"
            )
    for flag in owned_conflicts(profile.engine_args, OWNED):
        problems.append(f"engine_args sets {flag}, which llmgw sets itself: remove it")
    return problems


def plan(profile: EngineProfile, assignment: Assignment, *, program: str = PROGRAM) -> LaunchPlan:
    argv: list[str] = [
        program,
        "--model", profile.model,
        "--host", BIND_HOST,
        "--port", str(assignment.port),
    ]  # fmt: skip
    own_flags = flags_in(profile.engine_args)
    if "--jinja" not in own_flags and "--no-jinja" not in own_flags:
        argv.append("--jinja")
    argv.append("--metrics")
    if profile.served_names:
        argv += ["--alias", ",".join(profile.served_names)]
    argv += _adapters.launch_args(profile)
    argv += profile.engine_args
    engine = ProcessSpec(
        name="engine", argv=tuple(argv), env=tuple(gpu_env(assignment)), role="engine"
    )
    return LaunchPlan(
        processes=(engine,),
        serves_http=True,
        port=assignment.port,
        health_path=HEALTH_PATH,
        models_path=MODELS_PATH,
        metrics=METRICS,
    )
