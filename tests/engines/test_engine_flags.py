"""check_flags: word boundaries, negations, and help texts that look cut short."""

from __future__ import annotations

import pytest

from llmgw.engines import FlagCheck, check_flags, help_warnings, widest_command

# Shaped like argparse's output for `vllm serve --help=all` (abridged by hand).
VLLM_HELP = """\
usage: vllm serve [model_tag] [options]

Launch a local OpenAI-compatible API server to serve LLM
completions via HTTP.

positional arguments:
  model_tag             The model tag to serve (optional if specified in config)

options:
  -h, --help            show this help message and exit
  --headless            Run in headless mode. See multi-node data parallel
                        documentation for more details. (default: False)
  --api-server-count API_SERVER_COUNT, -asc API_SERVER_COUNT
                        How many API server processes to run.

Frontend:
  --host HOST           Host name. (default: None)
  --port PORT           Port number. (default: 8000)
  --served-model-name SERVED_MODEL_NAME [SERVED_MODEL_NAME ...]
                        The model name(s) used in the API.
  --enable-prompt-tokens-details, --no-enable-prompt-tokens-details
                        If set to True, enable prompt_tokens_details in usage.
                        (default: False)

ModelConfig:
  --quantization QUANTIZATION, -q QUANTIZATION
                        Method used to quantize the weights.
  --max-model-len MAX_MODEL_LEN
                        Model context length.
  --enable-prefix-caching, --no-enable-prefix-caching
                        Whether to enable prefix caching.

ParallelConfig:
  --distributed-executor-backend {external_launcher,mp,ray,uni,None}
                        Backend to use for distributed model workers.
  --pipeline-parallel-size PIPELINE_PARALLEL_SIZE, -pp PIPELINE_PARALLEL_SIZE
                        Number of pipeline parallel groups. (default: 1)
  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE
                        Number of tensor parallel groups. (default: 1)
  --master-addr MASTER_ADDR
                        distributed master address for multi-node distributed
                        inference when distributed_executor_backend is mp.
  --master-port MASTER_PORT
                        distributed master port for multi-node distributed
                        inference when distributed_executor_backend is mp.
  --nnodes NNODES, -n NNODES
                        num of nodes for multi-node distributed inference
  --node-rank NODE_RANK, -r NODE_RANK
                        distributed node rank for multi-node distributed
                        inference when distributed_executor_backend is mp.

CacheConfig:
  Configuration for the KV cache.

  --gpu-memory-utilization GPU_MEMORY_UTILIZATION
                        The fraction of GPU memory to be used for the model
                        executor, which can range from 0 to 1. This is a
                        per-instance limit. (default: 0.9)

LoRAConfig:
  Configuration for LoRA.

  --enable-lora, --no-enable-lora
                        If True, enable handling of LoRA adapters.
  --max-loras MAX_LORAS
                        Max number of LoRAs in a single batch. (default: 1)
  --max-lora-rank {1,8,16,32,64,128,256,320,512}
                        Max LoRA rank. (default: 16)
"""

# Shaped like llama-server --help (common/arg.cpp's layout).
LLAMA_HELP = """\
----- common params -----

-h,    --help, --usage                  print usage and exit
--version                               show version and build info
-t,    --threads N                      number of threads to use during generation
-c,    --ctx-size N                     size of the prompt context (default: 4096)
-m,    --model FNAME                    model path (default: `models/$filename`)
-ngl,  --gpu-layers, --n-gpu-layers N   number of layers to store in VRAM
--lora FNAME                            path to LoRA adapter (use comma-separated values to load multiple
                                        adapters)
--lora-scaled FNAME:SCALE,...           path to LoRA adapter with user defined scaling (format:
                                        FNAME:SCALE,...)
                                        note: use comma-separated values

----- example-specific params -----

-a,    --alias STRING                   set alias for model name (to be used by REST API)
--host HOST                             ip address to listen (default: 127.0.0.1)
--port PORT                             port to listen (default: 8080)
--metrics                               enable prometheus compatible metrics endpoint
--slots, --no-slots                     expose slots monitoring endpoint (default: enabled)
--jinja, --no-jinja                     whether to use jinja template engine for chat
-cram, --cache-ram N                    set the maximum cache size in MiB (default: 8192, -1 - no limit, 0 -
                                        disable)
"""


def test_full_helps_satisfy_the_widest_commands() -> None:
    assert check_flags(VLLM_HELP, widest_command("vllm")) == FlagCheck(missing=(), warnings=())
    assert check_flags(LLAMA_HELP, widest_command("llama-server")) == FlagCheck((), ())
    assert check_flags(LLAMA_HELP, ["llama-server", "--no-jinja", "--no-slots"]).ok


def test_a_renamed_flag_is_reported() -> None:
    older = VLLM_HELP.replace("--headless", "--head-less")
    result = check_flags(older, widest_command("vllm"))
    assert result.missing == ("--headless",)
    assert not result.ok


@pytest.mark.parametrize(
    ("help_line", "flag", "listed"),
    [
        ("--port PORT   the port", "--port", True),
        ("[--port PORT]", "--port", True),
        ("--port=PORT", "--port", True),
        ("--host HOST, --port", "--port", True),
        ("--port-range LOW-HIGH", "--port", False),
        ("--port_x X", "--port", False),
        ("--ports P", "--port", False),
        ("--tp-size TP_SIZE", "--tp", False),
        ("--tensor-parallel-size N, --tp-size N", "--tp-size", True),
        ("--sport N", "--port", False),
        ("---port", "--port", False),
        ("--enable-metrics", "--metrics", False),
        ("--metrics", "--metrics", True),
    ],
)
def test_word_boundaries(help_line: str, flag: str, listed: bool) -> None:
    assert check_flags(help_line + "\n", [flag]).missing == (() if listed else (flag,))


def test_value_after_equals_is_not_part_of_the_flag() -> None:
    assert check_flags("--port PORT\n", ["prog", "--port=8000"]).missing == ()
    assert check_flags("--port-range R\n", ["prog", "--port=8000"]).missing == ("--port",)


@pytest.mark.parametrize(
    ("help_line", "flag", "listed"),
    [
        ("--jinja, --no-jinja   use jinja", "--no-jinja", True),  # argparse BooleanOptionalAction
        ("--jinja / --no-jinja  use jinja", "--no-jinja", True),  # click
        ("--[no-]jinja          use jinja", "--no-jinja", True),
        ("--[no-]jinja          use jinja", "--jinja", False),
        ("--jinja               use jinja", "--no-jinja", False),  # old llama-server
        ("--no-jinja            no jinja", "--jinja", False),
        ("--[no-]jinja-x        other", "--no-jinja", False),
    ],
)
def test_negations(help_line: str, flag: str, listed: bool) -> None:
    assert check_flags(help_line + "\n", [flag]).missing == (() if listed else (flag,))


def test_only_long_flags_are_checked_and_each_once() -> None:
    argv = ["python3", "-m", "sglang.launch_server", "--tp-size", "2", "--x", "--x=1", "--", "--y"]
    assert check_flags("--tp-size N\n", argv).missing == ("--x",)


# --- help texts that look cut short ------------------------------------------


def test_cut_off_mid_line() -> None:
    cut = VLLM_HELP[: VLLM_HELP.index("--master-port") + 8]
    result = check_flags(cut, widest_command("vllm"))
    # "--master-port" was cut to "--master", and what followed it is gone.
    assert result.missing == (
        "--gpu-memory-utilization",
        "--enable-lora",
        "--max-loras",
        "--max-lora-rank",
        "--nnodes",
        "--node-rank",
        "--master-port",
    )
    assert result.warnings == ("the help does not end with a newline; it may be cut off mid-line",)


def test_a_fragment() -> None:
    assert help_warnings("usage: vllm serve [-h] [--port PORT]\n") == (
        "the help is only 36 characters long; it looks cut short",
        "the help lists only 1 long options; an engine lists dozens, so it may be cut short",
    )


def test_truncation_markers_on_the_last_line() -> None:
    assert help_warnings(VLLM_HELP + "  ...\n")[-1] == (
        "the help ends with '...', which looks like a truncation marker"
    )
    assert help_warnings(VLLM_HELP + "[output truncated]\n")[-1] == (
        "the help ends with 'truncated', which looks like a truncation marker"
    )
    # "..." inside the help (argparse's nargs) is not a marker.
    assert "[SERVED_MODEL_NAME ...]" in VLLM_HELP
    assert help_warnings(VLLM_HELP) == ()


def test_a_help_that_never_mentions_help() -> None:
    headless = VLLM_HELP.replace("-h, --help", "")
    assert help_warnings(headless) == (
        "the help never mentions --help or -h; its start may be missing, "
        "or it is not the engine's help",
    )


def test_vllm_summary_hint() -> None:
    summary = (
        VLLM_HELP.split("Frontend:")[0]
        + "Use --help=all to show all options, or --help=<group> for one group.\n"
    )
    result = check_flags(summary, ["vllm", "serve", "m", "--headless", "--port", "1"])
    assert result.missing == ("--port",)
    assert result.warnings[-1] == (
        "the help mentions --help=all, so it may be a summary: check against the "
        "full listing (vllm serve --help=all)"
    )
