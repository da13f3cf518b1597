"""The fake engine's LoRA adapters, as each engine keeps and answers them: no I/O but a
file-existence check.

What each engine does is read from its source (llmgw/engines/_adapters.py names the
versions): vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (only
with VLLM_ALLOW_RUNTIME_LORA_UPDATING), an adapter chosen by `model`, listed in
`/v1/models` with `parent`; SGLang's `POST /load_lora_adapter` and
`/unload_lora_adapter`, an adapter chosen by `lora_path` or `model: BASE:ADAPTER`;
llama-server's launch adapters, `GET /lora-adapters`, and a request's `lora` list
(ids not named, or named without a scale, get 0).

A generation for an adapter shows which one answered: its text starts with
`[NAME] ` (llama-server: `[PATH] `, or `[PATH*SCALE] ` when the scale is not 1, one
bracket per adapter with a nonzero scale).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from llmgw.testing._fake_engine_cli import FakeConfig
from llmgw.testing._fake_engine_wire import Reply, dumps

_Handler = Callable[[bytes], Reply]


def _vllm_error(status: int, kind: str, message: str, param: str | None = None) -> Reply:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return Reply(status, dumps(body))


def _sglang_result(ok: bool, message: str, loaded: Mapping[str, str] | None) -> Reply:
    body = {"success": ok, "error_message": message, "loaded_adapters": loaded}
    return Reply(200 if ok else 400, dumps(body))


class Adapters:
    """The adapters one fake engine holds, and its answers about them.

    vLLM and SGLang: `loaded` (name -> path, in load order), changed through the
    load and unload routes. llama-server: `launch` (path, default scale) by id,
    fixed at launch. `loads` and `unloads` count the successful calls.
    """

    def __init__(self, config: FakeConfig, exists: Callable[[str], bool] = os.path.exists):
        self.config = config
        self.engine = config.engine
        self.base = config.served_names[0]
        self.loaded: dict[str, str] = {}
        self.launch = list(config.launch_loras)
        self.loads = 0
        self.unloads = 0
        self._exists = exists
        self._created = int(time.time())

    def __repr__(self) -> str:
        held = list(self.loaded) if self.engine != "llama-server" else self.launch
        return f"<Adapters {self.engine} {held!r} loads={self.loads} unloads={self.unloads}>"

    def routes(self) -> dict[str, tuple[bytes, _Handler]]:
        """path -> (method, handler) for the routes the imitated engine has."""
        if self.engine == "vllm":
            if not self.config.lora_runtime:
                return {}  # vLLM registers them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
            return {
                "/v1/load_lora_adapter": (b"POST", self.load),
                "/v1/unload_lora_adapter": (b"POST", self.unload),
            }
        if self.engine == "sglang":
            return {
                "/load_lora_adapter": (b"POST", self.load),
                "/unload_lora_adapter": (b"POST", self.unload),
            }
        return {"/lora-adapters": (b"GET", self.listing)}

    # --- the load API -----------------------------------------------------------------

    def load(self, raw: bytes) -> Reply:
        body = self._body(raw, ("lora_name", "lora_path"))
        if isinstance(body, Reply):
            return body
        name, path = body["lora_name"], body["lora_path"]
        if self.engine == "vllm":
            return self._vllm_load(name, path)
        if not self.config.lora_enabled:
            return self._sglang_failure(
                "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            )
        if not self._exists(path):
            return self._sglang_failure(f"Failed to load LoRA adapter {name}: no adapter at {path}")
        if name in self.loaded:
            return self._sglang_failure(
                f"LoRA with name {name} already exists. Loaded LoRAs: {self._keys()}"
            )
        self.loaded[name] = path
        self.loads += 1
        return _sglang_result(True, "", self.loaded)

    def _vllm_load(self, name: str, path: str) -> Reply:
        if not name or not path:
            return _vllm_error(
                400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."
            )
        if name in self.config.served_names:
            return _vllm_error(
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' conflicts with a served base model.",
            )
        if name in self.loaded:
            return _vllm_error(
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        if not self.config.lora_enabled:
            return _vllm_error(
                500, "InternalServerError", "LoRA is not enabled. Use --enable-lora to enable LoRA."
            )
        if not self._exists(path):
            return _vllm_error(
                404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}"
            )
        self.loaded[name] = path
        self.loads += 1
        message = f"Success: LoRA adapter '{name}' added successfully."
        return Reply(200, message.encode(), "text/plain; charset=utf-8")

    def unload(self, raw: bytes) -> Reply:
        body = self._body(raw, ("lora_name",))
        if isinstance(body, Reply):
            return body
        name = body["lora_name"]
        if self.engine == "vllm":
            if name not in self.loaded:
                return _vllm_error(
                    404, "NotFoundError", f"The lora adapter '{name}' cannot be found."
                )
            del self.loaded[name]
            self.unloads += 1
            message = f"Success: LoRA adapter '{name}' removed successfully."
            return Reply(200, message.encode(), "text/plain; charset=utf-8")
        if not self.config.lora_enabled:
            return self._sglang_failure(
                "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            )
        if name not in self.loaded:
            return self._sglang_failure(
                f"LoRA with name {name} does not exist. Loaded LoRAs: {self._keys()}"
            )
        del self.loaded[name]
        self.unloads += 1
        return _sglang_result(True, "", self.loaded)

    def _sglang_failure(self, message: str) -> Reply:
        return _sglang_result(False, message, None)

    def _keys(self) -> str:
        return f"odict_keys({list(self.loaded)!r})"

    def _body(self, raw: bytes, fields: tuple[str, ...]) -> dict[str, str] | Reply:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            body, problem = None, f"JSON decode error: {exc}"
        else:
            missing = [f for f in fields if not isinstance(body, dict) or f not in body]
            wrong = [f for f in fields if f not in missing and not isinstance(body[f], str)]
            problem = "; ".join(
                [f"{f}: Field required" for f in missing]
                + [f"{f}: Input should be a valid string" for f in wrong]
            )
        if problem:
            if self.engine == "vllm":
                return _vllm_error(400, "BadRequestError", problem)
            error = {"object": "error", "message": problem, "type": "BadRequest"}
            return Reply(400, dumps({**error, "param": None, "code": 400}))
        assert isinstance(body, dict)
        return {f: body[f] for f in fields}

    # --- listings -------------------------------------------------------------------------

    def listing(self, _: bytes = b"") -> Reply:
        """llama-server's GET /lora-adapters: each launch adapter, its id and default scale."""
        entries = [
            {"id": i, "path": path, "scale": scale, "task_name": "", "prompt_prefix": ""}
            for i, (path, scale) in enumerate(self.launch)
        ]
        return Reply(200, dumps(entries))

    def model_entries(self) -> list[dict[str, Any]]:
        """The `/v1/models` entries of the loaded adapters (vLLM and SGLang)."""
        owner = "vllm" if self.engine == "vllm" else "sglang"
        return [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": owner,
                "root": path,
                "parent": self.base,
                "max_model_len": None,
            }
            for name, path in self.loaded.items()
        ]

    # --- requests ---------------------------------------------------------------------

    def accepts(self, model: str) -> bool:
        """Whether a request may name `model`: vLLM's loaded adapters; SGLang does not
        check `model` at all, so the fake lets an adapter's name and BASE:ADAPTER pass."""
        if self.engine == "vllm":
            return model in self.loaded
        if self.engine == "sglang":
            return model in self.loaded or model.startswith(f"{self.base}:")
        return False

    def select(self, body: Mapping[str, Any]) -> str | Reply:
        """The tag that starts the answer ("" for the base), or the engine's error."""
        if self.engine == "vllm":
            model = body.get("model")
            return f"[{model}] " if isinstance(model, str) and model in self.loaded else ""
        if self.engine == "sglang":
            return self._sglang_select(body)
        return self._llama_select(body)

    def _sglang_select(self, body: Mapping[str, Any]) -> str | Reply:
        model, name = body.get("model"), body.get("lora_path")
        if isinstance(model, str) and ":" in model and model not in self.config.served_names:
            if model.startswith(f"{self.base}:"):
                name = model[len(self.base) + 1 :]
            else:
                name = model.split(":", 1)[1]
            name = name.strip() or None
        if name is None:
            return ""
        if not isinstance(name, str) or name not in self.loaded:
            message = (
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {self._keys()}."
            )
            error = {"object": "error", "message": message, "type": "BadRequest"}
            return Reply(400, dumps({**error, "param": None, "code": 400}))
        return f"[{name}] "

    def _llama_select(self, body: Mapping[str, Any]) -> str | Reply:
        scales = [scale for _, scale in self.launch]
        asked = body.get("lora")
        if asked is not None:
            if not isinstance(asked, list) or not all(isinstance(a, dict) for a in asked):
                message = (
                    "Field 'lora': Error: 'lora' must be an array of objects with 'id' and "
                    "'scale' fields"
                )
                error = {"code": 400, "message": message, "type": "invalid_request_error"}
                return Reply(400, dumps({"error": error}))
            scales = [0.0] * len(self.launch)
            for item in asked:
                i, scale = item.get("id"), item.get("scale", 0.0)
                # An id it does not hold is passed over, as llama-server does.
                if isinstance(i, int) and 0 <= i < len(scales) and isinstance(scale, int | float):
                    scales[i] = float(scale)
        tags = [
            f"[{path}] " if scale == 1.0 else f"[{path}*{scale:g}] "
            for (path, _), scale in zip(self.launch, scales, strict=True)
            if scale
        ]
        return "".join(tags)
