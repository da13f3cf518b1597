"""Traffic splits in the router: a split name resolved to one version per request.

The splits come with the endpoint view (`EndpointSource.traffic()`); the choice
is llmgw/core/_traffic.py's `route`. Here: the pin header, the request body
rewritten to name the version's served name (vLLM and SGLang refuse a model name
they do not serve), and the splits' JSON form, which is how they travel to
router workers (llmgw/cp/_workers.py) and to a standby through the store
(llmgw/cp/_fleet/_endpoints.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from llmgw.core import TrafficPinError, TrafficSplit, TrafficVersion, route
from llmgw.keys import ApiKey
from llmgw.router import _surface
from llmgw.router._surface import HttpError
from llmgw.web.asgi import Message, Send

__all__ = [
    "VERSION_HEADER",
    "Versions",
    "decode_traffic",
    "encode_traffic",
    "renamed",
    "with_version",
]

# A request's pin to one version of a split (its catalog model or served name); the
# answer names the version that answered in the same header.
VERSION_HEADER = "x-llmgw-version"
_HEADER_BYTES = VERSION_HEADER.encode()


class _Fleet(Protocol):
    def draw(self) -> float: ...
    def serving(self, names: Iterable[str] | None = None) -> set[str]: ...


class _Counts(Protocol):
    def traffic_routed(self, split: str, version: str, how: str) -> None: ...


def renamed(request: dict[str, Any]) -> bytes:
    """The JSON body to send the version (its `model` already the version's served name):
    compact, as `ask_usage` writes one; the engine reads the same object."""
    return json.dumps(request, separators=(",", ":")).encode()


def encode_traffic(splits: Mapping[str, TrafficSplit]) -> dict[str, Any]:
    """{name: {"versions": [[model, served, weight]], "keys": [[key id, model]]}}, sorted."""
    return {
        name: {
            "versions": [[v.model, v.served, v.weight] for v in t.versions],
            "keys": [[k, m] for k, m in t.keys],
        }
        for name, t in sorted(splits.items())
    }


def _str(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def decode_traffic(data: Any) -> dict[str, TrafficSplit]:
    """`encode_traffic`'s form back (None or absent: no splits); raises ValueError naming
    what is wrong, since it may come from the store that other machines write."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("traffic: expected {name: {versions, keys}}")
    out: dict[str, TrafficSplit] = {}
    for name, body in data.items():
        where = f"traffic {str(name)[:60]!r}"
        versions = body.get("versions") if isinstance(body, dict) else None
        keys = body.get("keys", []) if isinstance(body, dict) else None
        if not _str(name) or not isinstance(versions, list) or not isinstance(keys, list):
            raise ValueError(f"{where}: expected {{versions: [...], keys: [...]}}")
        parsed = []
        for v in versions:
            ok = isinstance(v, list) and len(v) == 3 and _str(v[0]) and _str(v[1])
            if not ok or isinstance(v[2], bool) or not isinstance(v[2], int) or v[2] < 0:
                raise ValueError(f"{where}: a version is not [model, served, weight >= 0]")
            parsed.append(TrafficVersion(v[0], v[1], v[2]))
        if not parsed or sum(v.weight for v in parsed) <= 0:
            raise ValueError(f"{where}: no version with a weight")
        pins = []
        for k in keys:
            if not (isinstance(k, list) and len(k) == 2 and _str(k[0]) and _str(k[1])):
                raise ValueError(f"{where}: a key pin is not [key id, model]")
            pins.append((k[0], k[1]))
        out[name] = TrafficSplit(name, tuple(parsed), tuple(sorted(pins)))
    return out


class Versions:
    """The router's side of a split: draw or pin a version, count it, or say why not."""

    def __init__(self, fleet: _Fleet, metrics: _Counts) -> None:
        self._fleet = fleet
        self._metrics = metrics

    def choose(
        self,
        split: TrafficSplit,
        headers: Iterable[tuple[bytes, bytes]],
        key: ApiKey | None,
        form: bool = False,
    ) -> TrafficVersion:
        """The version for one request by `key` (None: an explanation, which is neither
        checked nor counted). Raises the 403 for a key that may not use the split's name
        (it may use every version through it), the 400 for a pin to no version, and
        the 400 for a form route, whose body the router does not rewrite."""
        if key is not None and not key.may_use(split.name):
            raise _surface.model_not_allowed(key.key_id, split.name)
        header = None
        for hname, value in headers:
            if hname == _HEADER_BYTES:
                header = value.decode("latin-1").strip()
                break
        choice = route(
            split,
            u=self._fleet.draw(),
            available=self._fleet.serving(v.served for v in split.versions),
            header=header,
            key_id=key.key_id if key is not None else None,
        )
        if isinstance(choice, TrafficPinError):
            raise HttpError(
                400,
                f"{VERSION_HEADER}: {choice.message(split.versions)}",
                type="invalid_request_error",
                code="unknown_version",
            )
        if form:
            names = ", ".join(v.served for v in split.versions)
            raise HttpError(
                400,
                f"{split.name!r} is split between versions; a form request names one of "
                f"them as its model ({names})",
                type="invalid_request_error",
                code="split_needs_version",
            )
        if key is not None:
            self._metrics.traffic_routed(split.name, choice.version.model, choice.how)
        return choice.version


def with_version(send: Send, version: TrafficVersion) -> Send:
    """`send`, with the answering version named in the response head."""
    value = version.model.encode("latin-1", "replace")

    async def send_version(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (_HEADER_BYTES, value)]
        await send(message)

    return send_version
