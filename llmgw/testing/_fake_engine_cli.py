"""The fake engine's command lines, help texts and environment switches: no I/O.

Each imitated engine has one table of the flags it "supports". The same table
builds the parser that reads a command line and the `--help` text, so the
help never lists a flag the fake would not read. Flags outside the table are
ignored (`parse_known_args`): llmgw passes real engine flags, and the fake only
acts on the few that change what a client can observe.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs

from llmgw.errors import UsageError

N = TypeVar("N", int, float)
# Tokens per prefix-cache block: vLLM's default block size. A prompt is cached, and
# matched, in whole blocks only, as vLLM's block hashing does.
PREFIX_BLOCK_TOKENS = 16
Engine = Literal["vllm", "llama-server", "sglang"]
ENGINES: tuple[Engine, ...] = ("vllm", "llama-server", "sglang")
# What --version prints. The LoRA routes and flags (_fake_engine_adapters) follow
# vLLM 0.34.0 and SGLang 0.5.23, as llmgw/engines/_adapters.py does.
VERSIONS: dict[Engine, str] = {"vllm": "0.10.1.1", "llama-server": "6123", "sglang": "0.4.10"}
DEFAULT_PORT: dict[Engine, int] = {"vllm": 8000, "llama-server": 8080, "sglang": 30000}
# vLLM binds every interface when --host is absent; the other two bind loopback.
DEFAULT_HOST: dict[Engine, str] = {
    "vllm": "0.0.0.0",
    "llama-server": "127.0.0.1",
    "sglang": "127.0.0.1",
}
# How many requests generate at once when neither a flag nor LLMGW_FAKE_SLOTS says:
# vLLM's --max-num-seqs default, SGLang's usual --max-running-requests, llama-server's
# automatic -np.
DEFAULT_SLOTS: dict[Engine, int] = {"vllm": 256, "llama-server": 4, "sglang": 256}


@attrs.frozen
class Flag:
    names: tuple[str, ...]
    help: str
    metavar: str | None = None  # None: a switch without a value
    kind: Literal["str", "int", "float", "list", "append", "bool", "bool-pair"] = "str"
    dest: str | None = None
    llama_env: str | None = None  # llama-server's LLAMA_ARG_* twin, shown in its help


def _f(*names: str, help: str, metavar: str | None = None, **kw: object) -> Flag:
    kind = kw.pop("kind", "str" if metavar else "bool")
    return Flag(names=names, help=help, metavar=metavar, kind=kind, **kw)  # type: ignore[arg-type]


# fmt: off
VLLM_FLAGS: tuple[Flag, ...] = (
    _f("--model", metavar="MODEL", help="Name or path of the Hugging Face model to use."),
    _f("--host", metavar="HOST", help="Host name."),
    _f("--port", metavar="PORT", kind="int", help="Port number."),
    _f("--served-model-name", metavar="SERVED_MODEL_NAME", kind="list",
       help="The model name(s) used in the API. If multiple names are provided, the server "
       "will respond to any of the provided names. The model name in the model field of "
       "a response will be the first name in this list."),
    _f("--tensor-parallel-size", "-tp", metavar="TENSOR_PARALLEL_SIZE", kind="int",
       help="Number of tensor parallel groups."),
    _f("--pipeline-parallel-size", "-pp", metavar="PIPELINE_PARALLEL_SIZE", kind="int",
       help="Number of pipeline parallel groups."),
    _f("--data-parallel-size", "-dp", metavar="DATA_PARALLEL_SIZE", kind="int",
       help="Number of data parallel groups."),
    _f("--distributed-executor-backend", metavar="{external_launcher,mp,ray,uni}",
       help="Backend to use for distributed model workers, either \"ray\" or \"mp\" "
       "(multiprocessing)."),
    _f("--nnodes", "-n", metavar="NNODES", kind="int",
       help="Number of nodes in multi-node distributed serving."),
    _f("--node-rank", "-r", metavar="NODE_RANK", kind="int",
       help="Distributed node rank for multi-node distributed serving."),
    _f("--master-addr", metavar="MASTER_ADDR",
       help="Distributed master address for multi-node distributed serving."),
    _f("--master-port", metavar="MASTER_PORT", kind="int",
       help="Distributed master port for multi-node distributed serving."),
    _f("--headless",
       help="Run in headless mode. See multi-node data parallel documentation for more "
       "details."),
    _f("--quantization", "-q", metavar="QUANTIZATION", help="Method used to quantize the weights."),
    _f("--max-model-len", metavar="MAX_MODEL_LEN", kind="int",
       help="Model context length (prompt and output)."),
    _f("--gpu-memory-utilization", metavar="GPU_MEMORY_UTILIZATION", kind="float",
       help="The fraction of GPU memory to be used for the model executor, which can range "
       "from 0 to 1."),
    _f("--max-num-seqs", metavar="MAX_NUM_SEQS", kind="int",
       help="Maximum number of sequences to be processed in a single iteration."),
    _f("--max-num-batched-tokens", metavar="MAX_NUM_BATCHED_TOKENS", kind="int",
       help="Maximum number of tokens to be processed in a single iteration."),
    _f("--dtype", metavar="{auto,bfloat16,float,float16,float32,half}",
       help="Data type for model weights and activations."),
    _f("--kv-cache-dtype", metavar="{auto,fp8,fp8_e4m3,fp8_e5m2}",
       help="Data type for kv cache storage."),
    _f("--tokenizer", metavar="TOKENIZER",
       help="Name or path of the Hugging Face tokenizer to use."),
    _f("--revision", metavar="REVISION", help="The specific model version to use."),
    _f("--download-dir", metavar="DOWNLOAD_DIR",
       help="Directory to download and load the weights."),
    _f("--trust-remote-code", kind="bool-pair",
       help="Trust remote code (e.g., from HuggingFace) when downloading the model and "
       "tokenizer."),
    _f("--enforce-eager", kind="bool-pair", help="Whether to always use eager-mode PyTorch."),
    _f("--enable-prefix-caching", kind="bool-pair", help="Whether to enable prefix caching."),
    _f("--enable-expert-parallel", kind="bool-pair",
       help="Use expert parallelism instead of tensor parallelism for MoE layers."),
    _f("--swap-space", metavar="SWAP_SPACE", kind="float",
       help="Size of the CPU swap space per GPU (in GiB)."),
    _f("--seed", metavar="SEED", kind="int", help="Random seed for operations."),
    _f("--api-key", metavar="API_KEY",
       help="If provided, the server will require this key to be presented in the header."),
    _f("--enable-prompt-tokens-details", kind="bool-pair",
       help="If set to True, enable prompt_tokens_details in usage."),
    _f("--chat-template", metavar="CHAT_TEMPLATE",
       help="The file path to the chat template, or the template in single-line form."),
    _f("--enable-auto-tool-choice", help="Enable auto tool choice for supported models."),
    _f("--tool-call-parser", metavar="TOOL_CALL_PARSER",
       help="Select the tool call parser depending on the model that you're using."),
    _f("--reasoning-parser", metavar="REASONING_PARSER",
       help="Select the reasoning parser depending on the model that you're using."),
    _f("--generation-config", metavar="GENERATION_CONFIG",
       help="The folder path to the generation config."),
    _f("--uvicorn-log-level", metavar="{critical,debug,error,info,trace,warning}",
       help="Log level for uvicorn."),
    _f("--disable-log-requests", help="Disable logging requests."),
    _f("--disable-log-stats", help="Disable logging statistics."),
    _f("--enable-lora", kind="bool-pair", help="If True, enable handling of LoRA adapters."),
    _f("--max-loras", metavar="MAX_LORAS", kind="int",
       help="Max number of LoRAs in a single batch."),
    _f("--max-lora-rank", metavar="{1,8,16,32,64,128,256,320,512}", kind="int",
       help="Max LoRA rank."),
    _f("--max-cpu-loras", metavar="MAX_CPU_LORAS", kind="int",
       help="Maximum number of LoRAs to store in CPU memory. Must be >= than `max_loras`."),
)

LLAMA_FLAGS: tuple[Flag, ...] = (
    _f("--version", help="show version and build info"),
    _f("-t", "--threads", metavar="N", kind="int", llama_env="LLAMA_ARG_THREADS",
       help="number of threads to use during generation (default: -1)"),
    _f("-c", "--ctx-size", metavar="N", kind="int", llama_env="LLAMA_ARG_CTX_SIZE",
       help="size of the prompt context (default: 4096, 0 = loaded from model)"),
    _f("-n", "--predict", "--n-predict", metavar="N", kind="int", llama_env="LLAMA_ARG_N_PREDICT",
       help="number of tokens to predict (default: -1, -1 = infinity)"),
    _f("-b", "--batch-size", metavar="N", kind="int", llama_env="LLAMA_ARG_BATCH",
       help="logical maximum batch size (default: 2048)"),
    _f("-ub", "--ubatch-size", metavar="N", kind="int", llama_env="LLAMA_ARG_UBATCH",
       help="physical maximum batch size (default: 512)"),
    _f("-fa", "--flash-attn", metavar="[on|off|auto]", llama_env="LLAMA_ARG_FLASH_ATTN",
       help="set Flash Attention use ('on', 'off', or 'auto', default: 'auto')"),
    _f("--mlock", llama_env="LLAMA_ARG_MLOCK",
       help="force system to keep model in RAM rather than swapping or compressing"),
    _f("--no-mmap", llama_env="LLAMA_ARG_NO_MMAP",
       help="do not memory-map model (slower load but may reduce pageouts if not using mlock)"),
    _f("-dev", "--device", metavar="<dev1,dev2,..>", llama_env="LLAMA_ARG_DEVICE",
       help="comma-separated list of devices to use for offloading (none = don't offload)"),
    _f("-ngl", "--gpu-layers", "--n-gpu-layers", metavar="N", kind="int",
       llama_env="LLAMA_ARG_N_GPU_LAYERS",
       help="number of layers to store in VRAM"),
    _f("-sm", "--split-mode", metavar="{none,layer,row}", llama_env="LLAMA_ARG_SPLIT_MODE",
       help="how to split the model across multiple GPUs (default: layer)"),
    _f("-ts", "--tensor-split", metavar="N0,N1,N2,...", llama_env="LLAMA_ARG_TENSOR_SPLIT",
       help="fraction of the model to offload to each GPU, comma-separated list of "
       "proportions, e.g. 3,1"),
    _f("-mg", "--main-gpu", metavar="INDEX", kind="int", llama_env="LLAMA_ARG_MAIN_GPU",
       help="the GPU to use for the model (with split-mode = none) (default: 0)"),
    _f("--rpc", metavar="SERVERS", llama_env="LLAMA_ARG_RPC",
       help="comma separated list of RPC servers"),
    _f("--lora", metavar="FNAME", kind="append",
       help="path to LoRA adapter (use comma-separated values to load multiple adapters)"),
    _f("--lora-scaled", metavar="FNAME:SCALE,...", kind="append",
       help="path to LoRA adapter with user defined scaling (format: FNAME:SCALE,...)"),
    _f("-m", "--model", metavar="FNAME", llama_env="LLAMA_ARG_MODEL",
       help="model path (default: `models/$filename` with filename from `--hf-file` or "
       "`--model-url` if set, otherwise models/7B/ggml-model-f16.gguf)"),
    _f("-hf", "-hfr", "--hf-repo", metavar="<user>/<model>[:quant]", llama_env="LLAMA_ARG_HF_REPO",
       help="Hugging Face model repository"),
    _f("-a", "--alias", metavar="STRING", llama_env="LLAMA_ARG_ALIAS",
       help="set alias for model name (to be used by REST API)"),
    _f("--host", metavar="HOST", llama_env="LLAMA_ARG_HOST",
       help="ip address to listen, or bind to an UNIX socket if the address ends with .sock "
       "(default: 127.0.0.1)"),
    _f("--port", metavar="PORT", kind="int", llama_env="LLAMA_ARG_PORT",
       help="port to listen (default: 8080)"),
    _f("--api-key", metavar="KEY", llama_env="LLAMA_API_KEY",
       help="API key to use for authentication (default: none)"),
    _f("-to", "--timeout", metavar="N", kind="int", llama_env="LLAMA_ARG_TIMEOUT",
       help="server read/write timeout in seconds (default: 600)"),
    _f("--threads-http", metavar="N", kind="int", llama_env="LLAMA_ARG_THREADS_HTTP",
       help="number of threads used to process HTTP requests (default: -1)"),
    _f("-np", "--parallel", metavar="N", kind="int", llama_env="LLAMA_ARG_N_PARALLEL",
       help="number of parallel sequences to decode (default: -1)"),
    _f("-cb", "--cont-batching", llama_env="LLAMA_ARG_CONT_BATCHING",
       help="enable continuous batching (a.k.a dynamic batching) (default: enabled)"),
    _f("--embedding", "--embeddings", llama_env="LLAMA_ARG_EMBEDDINGS",
       help="restrict to only support embedding use case; use only with dedicated embedding "
       "models (default: disabled)"),
    _f("--jinja", "--no-jinja", kind="bool-pair", llama_env="LLAMA_ARG_JINJA",
       help="whether to use jinja template engine for chat (default: disabled)"),
    _f("--chat-template", metavar="JINJA_TEMPLATE", llama_env="LLAMA_ARG_CHAT_TEMPLATE",
       help="set custom jinja chat template (default: template taken from model's metadata)"),
    _f("--metrics", llama_env="LLAMA_ARG_ENDPOINT_METRICS",
       help="enable prometheus compatible metrics endpoint (default: disabled)"),
    _f("--props", llama_env="LLAMA_ARG_ENDPOINT_PROPS",
       help="enable changing global properties via POST /props (default: disabled)"),
    _f("--slots", "--no-slots", kind="bool-pair", llama_env="LLAMA_ARG_ENDPOINT_SLOTS",
       help="expose slots monitoring endpoint (default: enabled)"),
    _f("-cram", "--cache-ram", metavar="N", kind="int", llama_env="LLAMA_ARG_CACHE_RAM",
       help="set the maximum cache size in MiB (default: 8192, -1 - no limit, 0 - disable)"),
    _f("--lora-init-without-apply",
       help="load LoRA adapters without applying them (apply later via POST /lora-adapters) "
       "(default: disabled)"),
    _f("--log-disable", help="Log disable"),
    _f("-v", "--verbose", "--log-verbose",
       help="Set verbosity level to infinity (i.e. log all messages, useful for debugging)"),
)

SGLANG_FLAGS: tuple[Flag, ...] = (
    _f("--model-path", "--model", metavar="MODEL_PATH",
       help="The path of the model weights. This can be a local folder or a Hugging Face repo"
       " ID."),
    _f("--tokenizer-path", metavar="TOKENIZER_PATH", help="The path of the tokenizer."),
    _f("--host", metavar="HOST", help="The host of the HTTP server."),
    _f("--port", metavar="PORT", kind="int", help="The port of the HTTP server."),
    _f("--served-model-name", metavar="SERVED_MODEL_NAME",
       help="Override the model name returned by the v1/models endpoint in OpenAI API server."),
    _f("--tp-size", "--tp", metavar="TP_SIZE", kind="int", dest="tp_size",
       help="The tensor parallelism size."),
    _f("--dp-size", "--dp", metavar="DP_SIZE", kind="int", dest="dp_size",
       help="The data parallelism size."),
    _f("--pp-size", metavar="PP_SIZE", kind="int", help="The pipeline parallelism size."),
    _f("--nnodes", metavar="NNODES", kind="int", help="The number of nodes."),
    _f("--node-rank", metavar="NODE_RANK", kind="int", help="The node rank."),
    _f("--dist-init-addr", "--nccl-init-addr", metavar="DIST_INIT_ADDR",
       help="The host address for initializing distributed backend (e.g., "
       "`192.168.0.2:25000`)."),
    _f("--quantization", metavar="QUANTIZATION", help="The quantization method."),
    _f("--dtype", metavar="{auto,half,float16,bfloat16,float,float32}",
       help="Data type for model weights and activations."),
    _f("--context-length", metavar="CONTEXT_LENGTH", kind="int",
       help="The model's maximum context length."),
    _f("--mem-fraction-static", metavar="MEM_FRACTION_STATIC", kind="float",
       help="The fraction of the memory used for static allocation (model weights and KV "
       "cache memory pool)."),
    _f("--max-running-requests", metavar="MAX_RUNNING_REQUESTS", kind="int",
       help="The maximum number of running requests."),
    _f("--chunked-prefill-size", metavar="CHUNKED_PREFILL_SIZE", kind="int",
       help="The maximum number of tokens in a chunk for the chunked prefill."),
    _f("--kv-cache-dtype", metavar="{auto,fp8_e5m2,fp8_e4m3}",
       help="Data type for kv cache storage."),
    _f("--trust-remote-code",
       help="Whether or not to allow for custom models defined on the Hub in their own "
       "modeling files."),
    _f("--is-embedding", help="Whether to use a CausalLM as an embedding model."),
    _f("--enable-metrics", help="Enable log prometheus metrics."),
    _f("--enable-cache-report",
       help="Return number of cached tokens in usage.prompt_tokens_details for each openai "
       "request."),
    _f("--api-key", metavar="API_KEY", help="Set API key of the server."),
    _f("--log-level", metavar="LOG_LEVEL", help="The logging level of all loggers."),
    _f("--attention-backend", metavar="ATTENTION_BACKEND",
       help="Choose the kernels for attention layers."),
    _f("--skip-server-warmup", help="If set, skip warmup."),
    _f("--enable-torch-compile", help="Optimize the model with torch.compile."),
    _f("--enable-lora",
       help="Enable LoRA support for the model. This argument is automatically set to True if "
       "`--lora-paths` is provided for backward compatibility."),
    _f("--max-lora-rank", metavar="MAX_LORA_RANK", kind="int",
       help="The maximum rank of LoRA adapters. If not specified, it will be automatically "
       "inferred from the adapters provided in --lora-paths."),
    _f("--lora-target-modules", kind="list",
       metavar="{q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,all}",
       help="The union set of all target modules where LoRA should be applied."),
    _f("--lora-paths", metavar="LORA_PATHS", kind="list",
       help="The list of LoRA adapters to load."),
    _f("--max-loras-per-batch", metavar="MAX_LORAS_PER_BATCH", kind="int",
       help="Maximum number of adapters for a running batch, include base-only request."),
    _f("--max-loaded-loras", metavar="MAX_LOADED_LORAS", kind="int",
       help="If specified, it limits the maximum number of LoRA adapters loaded in CPU memory "
       "at a time."),
)
# fmt: on

FLAGS: dict[Engine, tuple[Flag, ...]] = {
    "vllm": VLLM_FLAGS,
    "llama-server": LLAMA_FLAGS,
    "sglang": SGLANG_FLAGS,
}
HELP_FLAGS = ("-h", "--help", "--usage")


@attrs.frozen
class Behaviour:
    """The LLMGW_FAKE_* switches; see the fake_engine module docstring for each."""

    load_delay: float = 0.0
    tokens: int = 16
    token_delay: float = 0.0
    first_token_delay: float = 0.0
    crash_after: float | None = None
    crash_message: str | None = None
    hang_after_tokens: int | None = None
    health_hang_after: float | None = None
    fail_rate: float = 0.0
    slots: int | None = None
    log_every: float | None = None
    embed_dim: int = 16
    kv_tokens: int = 65536
    keepalive: float = 5.0
    version: str | None = None
    prefix_cache_tokens: int = 0  # 0: no prefix cache is modelled
    prefill_token_delay: float = 0.0
    # Recorded streams sent instead of generating (without, and with, the usage event).
    replay: bytes | None = None
    replay_usage: bytes | None = None


@attrs.frozen
class FakeConfig:
    """What the fake serves: read from the imitated engine's command line."""

    engine: Engine
    model: str
    served_names: tuple[str, ...]
    host: str
    port: int
    slots: int
    ctx_per_slot: int
    metrics_enabled: bool
    # `usage.prompt_tokens_details.cached_tokens`: llama-server always reports it,
    # vLLM with --enable-prompt-tokens-details, SGLang with --enable-cache-report.
    reports_cached: bool
    slots_endpoint: bool
    embeddings_enabled: bool
    api_key: str | None
    version: str
    # LoRA (_fake_engine_adapters): --enable-lora (llama-server: any launch adapter), the
    # engine's limit (vLLM --max-loras, SGLang --max-loras-per-batch), --max-lora-rank,
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, llama-server's launch adapters (path,
    # default scale) in id order and --cache-ram.
    lora_enabled: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_runtime: bool = False
    launch_loras: tuple[tuple[str, float], ...] = ()
    cache_ram: int | None = None


@attrs.frozen
class HelpRequest:
    text: bytes


@attrs.frozen
class VersionRequest:
    text: str
    to_stderr: bool


Command = FakeConfig | HelpRequest | VersionRequest


def choose_engine(
    argv: Sequence[str], prog: str, env: Mapping[str, str], default: Engine | None = None
) -> tuple[Engine, list[str]]:
    """Which engine to imitate, and argv without `--fake-engine`.

    Order: the `--fake-engine` flag, `LLMGW_FAKE_ENGINE`, `default` (what an
    installed wrapper names), argv[0]'s basename, then the command line's shape.
    """
    rest: list[str] = []
    chosen: str | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--fake-engine":
            if i + 1 >= len(args):
                raise UsageError("--fake-engine needs a value: vllm, llama-server or sglang")
            chosen = args[i + 1]
            i += 2
            continue
        if arg.startswith("--fake-engine="):
            chosen = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    if chosen is None:
        chosen = env.get("LLMGW_FAKE_ENGINE") or None
    if chosen is None and default is not None:
        chosen = default
    if chosen is None:
        base = prog.rsplit("/", 1)[-1]
        if base in ENGINES:
            chosen = base
    if chosen is None:
        if rest[:1] == ["serve"]:
            chosen = "vllm"
        elif "--model-path" in rest:
            chosen = "sglang"
        elif "-m" in rest:
            chosen = "llama-server"
    if chosen is None:
        raise UsageError(
            "cannot tell which engine to imitate: pass --fake-engine vllm|llama-server|sglang, "
            "set LLMGW_FAKE_ENGINE, or run it through a wrapper named vllm or llama-server"
        )
    if chosen not in ENGINES:
        raise UsageError(
            f"--fake-engine/LLMGW_FAKE_ENGINE is {chosen!r}; it must be one of "
            + ", ".join(ENGINES)
        )
    return chosen, rest


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _parser(engine: Engine) -> argparse.ArgumentParser:
    prog = {"vllm": "vllm serve", "llama-server": "llama-server", "sglang": "launch_server.py"}
    usage = {"vllm": "vllm serve [model_tag] [options]", "llama-server": None, "sglang": None}
    parser = _Parser(
        prog=prog[engine],
        usage=usage[engine],
        description="Start the vLLM OpenAI Compatible API server." if engine == "vllm" else None,
        add_help=False,
        allow_abbrev=False,
        formatter_class=functools.partial(argparse.HelpFormatter, width=100),
    )
    if engine == "vllm":
        parser.add_argument(
            "model_tag", nargs="?", help="The model tag to serve (optional if specified in config)"
        )
    parser.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    for flag in FLAGS[engine]:
        dest = flag.dest or flag.names[0].lstrip("-").replace("-", "_")
        if engine == "llama-server" and flag.kind != "bool-pair":
            dest = max(flag.names, key=len).lstrip("-").replace("-", "_")
        if flag.kind == "bool":
            parser.add_argument(*flag.names, dest=dest, action="store_true", help=flag.help)
        elif flag.kind == "bool-pair":
            if len(flag.names) == 2 and flag.names[1].startswith("--no-"):
                parser.add_argument(
                    flag.names[0], dest=dest, action="store_true", default=None, help=flag.help
                )
                parser.add_argument(
                    flag.names[1], dest=dest, action="store_false", help=argparse.SUPPRESS
                )
            else:
                parser.add_argument(
                    *flag.names, dest=dest, action=argparse.BooleanOptionalAction, help=flag.help
                )
        else:
            types = {"int": int, "float": float, "str": str, "list": str, "append": str}
            parser.add_argument(
                *flag.names,
                dest=dest,
                metavar=flag.metavar,
                type=types[flag.kind],
                nargs="+" if flag.kind == "list" else None,
                action="append" if flag.kind == "append" else "store",
                help=flag.help,
            )
    return parser


def _llama_help() -> str:
    lines = ["----- common params -----", ""]
    lines.append(f"{'-h,    --help, --usage':<40}print usage and exit")
    for flag in LLAMA_FLAGS:
        if flag.names[0] == "-m":
            lines += ["", "----- example-specific params -----", ""]
        shorts = [n for n in flag.names if not n.startswith("--")]
        longs = [n for n in flag.names if n.startswith("--")]
        left = ""
        if shorts:
            left = ", ".join(shorts) + ","
            left = f"{left:<7}" if len(left) < 7 else left + " "
        left += ", ".join(longs)
        if flag.metavar:
            left += f" {flag.metavar}"
        if len(left) >= 40:
            lines.append(left)
            left = ""
        lines.append(f"{left:<40}{flag.help}")
        if flag.llama_env:
            lines.append(f"{'':<40}(env: {flag.llama_env})")
    lines += ["", "", "example usage:", "",
              "    llama-server -m model.gguf --port 8080 --host 127.0.0.1", ""]  # fmt: skip
    return "\n".join(lines)


def _vllm_top_help() -> str:
    return (
        "usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...\n\n"
        "vLLM CLI\n\n"
        "positional arguments:\n"
        "  {chat,complete,serve,bench,collect-env,run-batch}\n"
        "    chat                Generate chat completions via the running API server.\n"
        "    complete            Generate text completions based on the given prompt via the "
        "running API server.\n"
        "    serve               Start the vLLM OpenAI Compatible API server.\n"
        "    bench               vLLM bench subcommand.\n"
        "    collect-env         Start collecting environment information.\n"
        "    run-batch           Run batch prompts and write results to file.\n\n"
        "options:\n"
        "  -h, --help            show this help message and exit\n"
        "  -v, --version         show program's version number and exit\n\n"
        "For full list:            vllm [subcommand] --help=all\n"
    )


def help_text(engine: Engine, env: Mapping[str, str], top_level: bool = False) -> bytes:
    """The engine's help, with LLMGW_FAKE_HELP_RENAME and LLMGW_FAKE_HELP_TRUNCATE applied."""
    if engine == "llama-server":
        text = _llama_help()
    elif top_level:
        text = _vllm_top_help()
    else:
        text = _parser(engine).format_help()
    rename = env.get("LLMGW_FAKE_HELP_RENAME", "")
    for pair in filter(None, (p.strip() for p in rename.split(","))):
        old, sep, new = pair.partition("=")
        if not sep or not old.startswith("-") or not new.startswith("-"):
            raise UsageError(
                f"LLMGW_FAKE_HELP_RENAME is {rename!r}; it must be --old=--new "
                "(several separated by commas)"
            )
        text = re.sub(rf"(?<![\w-]){re.escape(old)}(?![\w-])", new, text)
    data = text.encode()
    limit = env.get("LLMGW_FAKE_HELP_TRUNCATE")
    if limit is not None and limit != "":
        data = data[: _number(env, "LLMGW_FAKE_HELP_TRUNCATE", int, 0) or 0]
    return data


def _number(
    env: Mapping[str, str], name: str, kind: type[N], minimum: N, default: N | None = None
) -> N | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise UsageError(f"{name} is {raw!r}; it must be {what}") from None
    if value < minimum or value != value:
        raise UsageError(f"{name} is {raw!r}; it must be at least {minimum}")
    return value


def _recording(env: Mapping[str, str], name: str) -> bytes | None:
    """The recorded SSE stream the file named by `name` holds (None: not set)."""
    path = env.get(name)
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(
            f"{name} is {path!r}, which cannot be read ({exc}); it must name "
            "a recorded SSE stream (tests/data/*.sse)"
        ) from exc
    if not data.rstrip().endswith(b"data: [DONE]"):
        raise UsageError(
            f"{name} is {path!r}, which does not end with `data: [DONE]`; it "
            "must be a whole recorded SSE stream (tests/data/*.sse)"
        )
    return data


def read_behaviour(env: Mapping[str, str]) -> Behaviour:
    """The LLMGW_FAKE_* switches, each checked; a bad value raises UsageError naming it."""
    fail_rate = _number(env, "LLMGW_FAKE_FAIL_RATE", float, 0.0, 0.0)
    assert fail_rate is not None
    if fail_rate > 1.0:
        raise UsageError(f"LLMGW_FAKE_FAIL_RATE is {fail_rate}; it must be between 0 and 1")
    slots = _number(env, "LLMGW_FAKE_SLOTS", int, 1)
    log_every = _number(env, "LLMGW_FAKE_LOG_EVERY", float, 0.0)
    prefix_cache = _number(env, "LLMGW_FAKE_PREFIX_CACHE_TOKENS", int, 0, 0) or 0
    if 0 < prefix_cache < PREFIX_BLOCK_TOKENS:
        raise UsageError(
            f"LLMGW_FAKE_PREFIX_CACHE_TOKENS is {prefix_cache}; it must be 0 (no prefix cache) "
            f"or at least {PREFIX_BLOCK_TOKENS}, one cache block"
        )
    return Behaviour(
        load_delay=_number(env, "LLMGW_FAKE_LOAD_DELAY", float, 0.0, 0.0) or 0.0,
        tokens=_number(env, "LLMGW_FAKE_TOKENS", int, 1, 16) or 16,
        token_delay=_number(env, "LLMGW_FAKE_TOKEN_DELAY", float, 0.0, 0.0) or 0.0,
        first_token_delay=_number(env, "LLMGW_FAKE_FIRST_TOKEN_DELAY", float, 0.0, 0.0) or 0.0,
        crash_after=_number(env, "LLMGW_FAKE_CRASH_AFTER", float, 0.0),
        crash_message=env.get("LLMGW_FAKE_CRASH_MESSAGE") or None,
        hang_after_tokens=_number(env, "LLMGW_FAKE_HANG_AFTER_TOKENS", int, 0),
        health_hang_after=_number(env, "LLMGW_FAKE_HEALTH_HANG_AFTER", float, 0.0),
        fail_rate=fail_rate,
        slots=slots,
        log_every=log_every if log_every else None,
        embed_dim=_number(env, "LLMGW_FAKE_EMBED_DIM", int, 1, 16) or 16,
        kv_tokens=_number(env, "LLMGW_FAKE_KV_TOKENS", int, 1, 65536) or 65536,
        keepalive=_number(env, "LLMGW_FAKE_KEEPALIVE", float, 0.0, 5.0) or 5.0,
        version=env.get("LLMGW_FAKE_VERSION") or None,
        prefix_cache_tokens=prefix_cache,
        prefill_token_delay=_number(env, "LLMGW_FAKE_PREFILL_TOKEN_DELAY", float, 0.0, 0.0) or 0.0,
        replay=_recording(env, "LLMGW_FAKE_REPLAY"),
        replay_usage=_recording(env, "LLMGW_FAKE_REPLAY_USAGE"),
    )


def parse_command_line(
    argv: Sequence[str],
    prog: str,
    env: Mapping[str, str],
    behaviour: Behaviour,
    default_engine: Engine | None = None,
) -> Command:
    """Read an engine command line into what the fake should do."""
    engine, args = choose_engine(argv, prog, env, default_engine)
    version = behaviour.version or VERSIONS[engine]
    if engine == "vllm":
        if not args or args[0] != "serve":
            if any(a in ("-v", "--version") for a in args):
                return VersionRequest(version, to_stderr=False)
            if any(a in HELP_FLAGS or a.startswith("--help=") for a in args) or not args:
                return HelpRequest(help_text(engine, env, top_level=True))
            raise UsageError(
                f"argument subparser: invalid choice: {args[0]!r} (choose from 'chat', "
                "'complete', 'serve', 'bench', 'collect-env', 'run-batch')"
            )
        args = args[1:]
    if any(a in HELP_FLAGS or a.startswith("--help=") for a in args):
        return HelpRequest(help_text(engine, env))
    if engine == "llama-server" and "--version" in args:
        return VersionRequest(
            f"version: {version} (1a2b3c4d)\nbuilt with cc (GCC) 13.3.0 for x86_64-linux-gnu",
            to_stderr=True,
        )
    ns, _unknown = _parser(engine).parse_known_args(args)
    opts = vars(ns)
    if engine == "vllm":
        model = opts.get("model_tag") or opts.get("model")
        if not model:
            raise UsageError("vllm serve needs a model: `vllm serve MODEL` or --model MODEL")
        names = tuple(opts.get("served_model_name") or (model,))
        slots = opts.get("max_num_seqs") or behaviour.slots or DEFAULT_SLOTS[engine]
        max_len = opts.get("max_model_len") or 4096
        metrics, slots_endpoint, embeddings = True, False, True
        reports_cached = bool(opts.get("enable_prompt_tokens_details"))
    elif engine == "llama-server":
        model = opts.get("model") or opts.get("hf_repo")
        if not model:
            raise UsageError("llama-server needs a model: -m FNAME or -hf REPO")
        names = (opts.get("alias") or model,)
        parallel = opts.get("parallel")
        slots = parallel if parallel and parallel > 0 else behaviour.slots or DEFAULT_SLOTS[engine]
        ctx = opts.get("ctx_size") or 4096 * slots
        max_len = max(1, ctx // slots)
        metrics = bool(opts.get("metrics"))
        slots_endpoint = opts.get("slots") is not False
        embeddings = bool(opts.get("embeddings"))
        reports_cached = True
    else:
        model = opts.get("model_path")
        if not model:
            raise UsageError("the following arguments are required: --model-path")
        names = (opts.get("served_model_name") or model,)
        slots = opts.get("max_running_requests") or behaviour.slots or DEFAULT_SLOTS[engine]
        max_len = opts.get("context_length") or 4096
        metrics, slots_endpoint, embeddings = bool(opts.get("enable_metrics")), False, True
        reports_cached = bool(opts.get("enable_cache_report"))
    port = opts.get("port")
    lora = _lora_options(engine, opts, args, env)
    return FakeConfig(
        engine=engine,
        model=model,
        served_names=names,
        host=opts.get("host") or DEFAULT_HOST[engine],
        port=DEFAULT_PORT[engine] if port is None else port,
        slots=slots,
        ctx_per_slot=max_len,
        metrics_enabled=metrics,
        reports_cached=reports_cached,
        slots_endpoint=slots_endpoint,
        embeddings_enabled=embeddings,
        api_key=opts.get("api_key"),
        version=version,
        **lora,
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_options(
    engine: Engine, opts: Mapping[str, Any], args: Sequence[str], env: Mapping[str, str]
) -> dict[str, Any]:
    """FakeConfig's LoRA fields, refusing what the engine refuses at startup."""
    rank = opts.get("max_lora_rank")
    if engine == "vllm":
        if rank is not None and rank not in VLLM_LORA_RANKS:
            raise UsageError(
                f"argument --max-lora-rank: invalid choice: {rank} (choose from "
                + ", ".join(map(str, VLLM_LORA_RANKS))
                + ")"
            )
        runtime = env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
        return {
            "lora_enabled": bool(opts.get("enable_lora")),
            "max_loras": opts.get("max_loras") or 1,
            "max_lora_rank": rank or 16,
            "lora_runtime": runtime in ("1", "true"),
        }
    if engine == "sglang":
        paths = opts.get("lora_paths")
        enabled = bool(opts.get("enable_lora") or paths)
        if enabled and not paths and not (rank and opts.get("lora_target_modules")):
            raise UsageError(
                "When no initial --lora-paths is provided, you need to specify both "
                "--max-lora-rank and --lora-target-modules for LoRA initialization."
            )
        return {
            "lora_enabled": enabled,
            "max_loras": opts.get("max_loras_per_batch") or 8,
            "max_lora_rank": rank,
        }
    loras = _llama_loras(args)
    cache_ram = opts.get("cache_ram")
    return {
        "lora_enabled": bool(loras),
        "launch_loras": loras,
        "cache_ram": cache_ram if isinstance(cache_ram, int) else None,
    }


def _llama_loras(args: Sequence[str]) -> tuple[tuple[str, float], ...]:
    """llama-server's adapters in id order: `--lora` (scale 1) and `--lora-scaled
    FNAME:SCALE`, each repeatable and comma-separated, in command-line order. A
    FNAME:SCALE that does not split in two at ':' is refused, as llama-server does;
    so is a file that is not there (it fails to load it)."""
    out: list[tuple[str, float]] = []
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag not in ("--lora", "--lora-scaled"):
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        for item in filter(None, value.split(",")):
            path, scale = item, 1.0
            if flag == "--lora-scaled":
                parts = item.split(":")
                try:
                    path, scale = parts[0], float(parts[1]) if len(parts) == 2 else math.nan
                except ValueError:
                    scale = math.nan
                if len(parts) != 2 or math.isnan(scale):
                    raise UsageError(
                        'error while handling argument "--lora-scaled": lora-scaled format: '
                        "FNAME:SCALE"
                    )
            if not Path(path).exists():
                raise UsageError(f"failed to apply lora adapter '{path}': no such file")
            out.append((path, scale))
    return tuple(out)
