"""LoRA adapters as the router serves them: a name clients put in `model`, answered by
the replicas of its base model that hold it.

The endpoint source lists an adapter like any served name: its endpoints are the
base's replicas that hold it now (each `Endpoint.adapters` is what that replica holds,
in the engine's own order), so admission, the load bound, the prefix index (per
served name: a prefix cached under one adapter is not cached under another), holds,
usage and metrics all count it apart from its base. What only an adapter has comes
from the source's optional `adapters()`, an `AdapterRoute` per adapter name:

- `base`: the base model's first served name (what `GET /v1/models` gives as
  `parent`, as vLLM does);
- `scale`: what a llama-server request applies it at;
- `tenants`: who may ask for it (None: every tenant); any other tenant gets 403;
- `loading`: the replicas loading it now (for explain).

A request for an adapter no replica holds waits on the adapter's hold (the source
gives one per adapter, llmgw/router/_holds.py) while the control plane loads it; the
waiting requests are what the control plane sees as the adapter's demand (each
router's `loads()`).

The engines take an adapter in their own form (`llmgw.engines.adapter_request`):
vLLM by its registered name in `model`, which the client's request already carries;
SGLang by that name in `lora_path` as well; llama-server by a `lora` list naming a
scale for every adapter the replica holds. A llama-server replica's prompt caches mix
adapters (tests/integration/test_llama_lora.py), so every request sent to one that
holds adapters carries the whole list, all 0 for the base: `engine_body` does that at
send time, per endpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from llmgw import engines

if TYPE_CHECKING:
    from llmgw.router._types import Endpoint

__all__ = [
    "AdapterRoute",
    "adapters_of",
    "decode_adapters",
    "encode_adapters",
    "engine_body",
]


def _scale(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"an adapter's scale must be a finite number, not {value!r}")


def _tenants(value: object) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(t) for t in value)  # type: ignore[attr-defined]


def _strings(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class AdapterRoute:
    """What the router knows of one adapter name (see the module)."""

    base: str
    scale: float = attrs.field(default=1.0, validator=_scale)
    tenants: tuple[str, ...] | None = attrs.field(default=None, converter=_tenants)
    loading: tuple[str, ...] = attrs.field(default=(), converter=_strings)

    def allows(self, tenant: str | None) -> bool:
        return self.tenants is None or (tenant is not None and tenant in self.tenants)


def adapters_of(source: object) -> Mapping[str, AdapterRoute]:
    """The source's adapters by name (`adapters()` is optional: none without it)."""
    adapters = getattr(source, "adapters", None)
    return adapters() if adapters is not None else {}


def encode_adapters(routes: Mapping[str, AdapterRoute]) -> dict[str, dict[str, Any]]:
    """The routes as JSON: {name: {"base", "scale", "tenants", "loading"}} (sorted)."""
    return {
        name: {
            "base": r.base,
            "scale": r.scale,
            "tenants": None if r.tenants is None else list(r.tenants),
            "loading": list(r.loading),
        }
        for name, r in sorted(routes.items())
    }


_KEYS = {"base", "scale", "tenants", "loading"}


def decode_adapters(value: object) -> dict[str, AdapterRoute]:
    """`encode_adapters`' value back (None, from a sender before adapters: none); raises
    ValueError naming what is wrong (the store is shared: nothing in it is trusted)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"adapters: expected {{name: {{...}}}}, not {value!r:.80}")
    out: dict[str, AdapterRoute] = {}
    for name, raw in value.items():
        where = f"adapters: {str(name)[:60]!r}"
        if not isinstance(name, str) or not isinstance(raw, dict) or set(raw) != _KEYS:
            raise ValueError(f"{where}: expected an object with {', '.join(sorted(_KEYS))}")
        tenants, loading = raw["tenants"], raw["loading"]
        if not isinstance(raw["base"], str) or not (
            tenants is None
            or (isinstance(tenants, list) and all(isinstance(t, str) for t in tenants))
        ):
            raise ValueError(f"{where}: base must be a name and tenants null or a list of names")
        if not isinstance(loading, list) or not all(isinstance(r, str) for r in loading):
            raise ValueError(f"{where}: loading must be a list of replica ids")
        try:
            out[name] = AdapterRoute(raw["base"], raw["scale"], tenants, loading)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return out


def engine_body(endpoint: Endpoint, body: bytes, adapter: str | None, scale: float) -> bytes:
    """`body` as `endpoint`'s engine takes it for `adapter` (None: the base): vLLM's is
    the client's; SGLang's names the adapter in `lora_path` too (and a base request
    loses a client's `lora_path`: it would pick an adapter the router never checked);
    llama-server's, when this replica holds adapters, lists them all. Raises ValueError
    when `adapter` is not held there (the router only sends an adapter to a replica
    listed as holding it)."""
    if endpoint.engine == "vllm":
        return body  # the client's `model` is the adapter's registered name already
    if endpoint.engine == "llama-server" and not endpoint.adapters:
        return body
    request = json.loads(body)
    if not isinstance(request, dict):
        return body
    rewritten = engines.adapter_request(
        endpoint.engine, request, adapter=adapter, held=endpoint.adapters, scale=scale
    )
    return json.dumps(rewritten, separators=(",", ":")).encode()
