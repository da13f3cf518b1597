"""The API surface clients speak: the routes, how each names its model, its error shape.

Pure: no trio, no sockets. The router asks this module which path is an
inference route, what a request must carry, where its model is named (the
JSON body's `model`, or the multipart form's `model` field for audio), which
key header it sent (`Authorization: Bearer` or Anthropic's `x-api-key`), and
how an error reads on that route (OpenAI's shape, or Anthropic's on
`/v1/messages`), and what of a request's prompt the prefix index reads. What an
answer says of its tokens is llmgw/router/_tokens.py; asking a stream for its
usage event is llmgw/router/_metering.py.

Every inference route is proxied as it is, to the same path on an engine
serving the model; an engine that does not serve a path answers its own 404
(vLLM, SGLang) or 501 (llama.cpp without `--reranking`, or a model without
audio), and that answer reaches the client as the engine sent it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from array import array
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from llmgw.web.asgi import HttpError as _AsgiHttpError

ErrorShape = Literal["openai", "anthropic"]
JSON_CONTENT_TYPE = b"application/json"


class HttpError(_AsgiHttpError):
    """Answer the client with this status, in its route's error shape; `type` and `code`
    are the OpenAI body's fields (`error_body`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(status, message, headers=headers)
        self.type = type
        self.code = code


@attrs.frozen
class Route:
    path: str
    # A field the JSON body must carry besides "model", checked here because an
    # engine may answer its absence with a 5xx (llama.cpp's /v1/messages does),
    # which would count against a healthy engine's breaker.
    required: str | None = None
    body: Literal["json", "form"] = "json"
    errors: ErrorShape = "openai"


def _table(*routes: Route) -> dict[str, Route]:
    return {r.path: r for r in routes}


ROUTES: dict[str, Route] = _table(
    Route("/v1/chat/completions", "messages"),
    Route("/v1/completions", "prompt"),
    Route("/v1/embeddings", "input"),
    # The Responses API (llama.cpp, vLLM); `input` may be absent there (a stored prompt).
    Route("/v1/responses"),
    # Anthropic's Messages API (llama.cpp, vLLM).
    Route("/v1/messages", "messages", errors="anthropic"),
    Route("/v1/messages/count_tokens", "messages", errors="anthropic"),
    # Retrieval: llama.cpp serves /rerank and /v1/rerank; vLLM those, /v2/rerank
    # (Cohere's v2 shape), /score and /v1/score.
    Route("/v1/rerank"),
    Route("/v2/rerank"),
    Route("/rerank"),
    Route("/v1/score"),
    Route("/score"),
    Route("/v1/audio/transcriptions", body="form"),
    Route("/v1/audio/translations", body="form"),
    # llama.cpp and vLLM; the router needs `model` to know where to send them.
    Route("/tokenize"),
    Route("/detokenize"),
)


# --- the key ------------------------------------------------------------------------------


def api_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a client sent: `Authorization: Bearer <key>`, else `x-api-key: <key>`."""
    other = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, rest = value.partition(b" ")
            if scheme.lower() == b"bearer" and rest.strip():
                return rest.strip().decode("latin-1")
        elif name == b"x-api-key" and other is None and value.strip():
            other = value.strip().decode("latin-1")
    return other


# --- multipart forms (audio) --------------------------------------------------------------

_BOUNDARY = re.compile(rb'boundary\s*=\s*(?:"([^"]{1,200})"|([^\s;,"]{1,200}))', re.IGNORECASE)
_PART_NAME = re.compile(rb'(?:^|;)\s*name\s*=\s*(?:"([^"]*)"|([^;\s]+))', re.IGNORECASE)
# A form's small fields come before its file in every client seen; past this many
# parts the field is taken as absent rather than scanning further.
MAX_FORM_PARTS = 64


def _bad_form(message: str) -> HttpError:
    return HttpError(
        400,
        f"the multipart form: {message}",
        type="invalid_request_error",
        code="invalid_form",
    )


def form_fields(body: bytes, content_type: bytes | None, names: frozenset[str]) -> dict[str, str]:
    """The values of the form fields in `names` (the first of each), from a
    `multipart/form-data` body; the parts not named (the file) are skipped, not copied."""
    if content_type is None or not content_type.lower().startswith(b"multipart/form-data"):
        got = "none" if content_type is None else repr(content_type.decode("latin-1"))
        raise _bad_form(f"Content-Type must be multipart/form-data with a boundary (got {got})")
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise _bad_form("Content-Type multipart/form-data has no boundary parameter")
    delimiter = b"--" + (match.group(1) or match.group(2))
    fields: dict[str, str] = {}
    pos = body.find(delimiter)
    if pos < 0:
        raise _bad_form("the body has no part that starts with the boundary")
    for _ in range(MAX_FORM_PARTS):
        pos += len(delimiter)
        if body.startswith(b"--", pos):
            return fields  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", pos)
        if head_end < 0:
            raise _bad_form("a part's headers do not end (no blank line)")
        end = body.find(b"\r\n" + delimiter, head_end + 4)
        if end < 0:
            raise _bad_form("a part does not end with the boundary")
        name = _part_name(body[pos:head_end])
        if name is not None and name in names and name not in fields:
            raw = body[head_end + 4 : end]
            try:
                fields[name] = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise _bad_form(f"the field {name!r} is not UTF-8 text") from None
            if len(fields) == len(names):
                return fields
        pos = end + 2
    return fields


def _part_name(head: bytes) -> str | None:
    for line in head.split(b"\r\n"):
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == b"content-disposition":
            match = _PART_NAME.search(value)
            if match is None:
                return None
            return (match.group(1) if match.group(1) is not None else match.group(2)).decode(
                "latin-1"
            )
    return None


_FORM_FIELDS = frozenset({"model", "stream"})


def form_model(body: bytes, content_type: bytes | None) -> tuple[str, bool]:
    """The model a multipart request names, and whether it asks for a stream."""
    fields = form_fields(body, content_type, _FORM_FIELDS)
    model = fields.get("model", "").strip()
    if not model:
        raise _bad_form("model: required, a form field naming a served model (see GET /v1/models)")
    return model, fields.get("stream", "").strip().lower() == "true"


# --- error bodies -------------------------------------------------------------------------


def anthropic_type(status: int) -> str:
    """Anthropic's error type for a status (docs.anthropic.com, "Errors")."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status == 429:
        return "rate_limit_error"
    if status in (503, 529):
        return "overloaded_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def error_body(shape: ErrorShape, exc: HttpError) -> dict[str, Any]:
    """The JSON body of an error answer on a route of this shape."""
    if shape == "anthropic":
        return {"type": "error", "error": {"type": anthropic_type(exc.status), "message": str(exc)}}
    return {"error": {"message": str(exc), "type": exc.type, "code": exc.code, "param": None}}


def stream_error(shape: ErrorShape, message: str, *, status: int, code: str) -> bytes:
    """The SSE event that tells a client its stream broke after it began (the status is
    sent already): Anthropic's `event: error`, or OpenAI's `data: {"error": ...}`."""
    if shape == "anthropic":
        body = {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    body = {"error": {"message": message, "type": "upstream_error", "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


# --- the router's own errors, in words ----------------------------------------------------
# Each names the thing, the value, and what would be right (docs: CONVENTIONS.md).


def unknown_route(method: str, path: str) -> HttpError:
    return HttpError(
        404, f"no such API route: {method} {path}", type="invalid_request_error", code="unknown_url"
    )


def method_not_allowed(method: str, path: str, allow: bytes) -> HttpError:
    return HttpError(
        405,
        f"{method} is not allowed on {path}",
        type="invalid_request_error",
        code="method_not_allowed",
        headers=((b"allow", allow),),
    )


def missing_key() -> HttpError:
    return HttpError(
        401,
        "an API key is needed: Authorization: Bearer <key> (or x-api-key: <key>)",
        type="authentication_error",
        code="missing_api_key",
    )


def invalid_key() -> HttpError:
    return HttpError(
        401,
        "the API key is not valid (unknown or revoked)",
        type="authentication_error",
        code="invalid_api_key",
    )


def key_store_unavailable(detail: object) -> HttpError:
    return HttpError(
        503,
        f"the API key cannot be checked now (the key store is unreachable: {detail})",
        type="server_error",
        code="key_store_unavailable",
        headers=((b"retry-after", b"5"),),
    )


def too_large(limit: int) -> HttpError:
    return HttpError(
        413,
        f"the request body is over the limit of {limit} bytes",
        type="invalid_request_error",
        code="request_too_large",
    )


def unknown_model(name: str) -> HttpError:
    return HttpError(
        404,
        f"the model {name!r} does not exist (see GET /v1/models)",
        type="invalid_request_error",
        code="model_not_found",
    )


def model_not_listed(name: str) -> HttpError:
    """GET /v1/models/{name} for a name the key does not see: 404, not 403, so that
    the answer does not tell that the name exists."""
    return HttpError(
        404,
        f"the model {name!r} does not exist or is not available to this key (see GET /v1/models)",
        type="invalid_request_error",
        code="model_not_found",
    )


def model_not_allowed(key_id: str, name: str) -> HttpError:
    return HttpError(
        403,
        f"API key {key_id} may not use the model {name!r}",
        type="permission_error",
        code="model_not_allowed",
    )


def adapter_not_allowed(tenant: str, name: str) -> HttpError:
    return HttpError(
        403,
        f"tenant {tenant} may not use the adapter {name!r} (its catalog entry names the "
        "tenants that may)",
        type="permission_error",
        code="model_not_allowed",
    )


def unknown_band(header: str, asked: str, known: str) -> HttpError:
    return HttpError(
        400,
        f"{header}: no band {asked!r}; the bands are {known}",
        type="invalid_request_error",
        code="unknown_band",
    )


def default_band_unknown(key_id: str, name: str, known: str) -> HttpError:
    return HttpError(
        403,
        f"API key {key_id}: its default band {name!r} is not configured (the bands are {known})",
        type="permission_error",
        code="unknown_band",
    )


def band_not_allowed(message: str) -> HttpError:
    return HttpError(403, message, type="permission_error", code="band_not_allowed")


def rate_limited(message: str, retry_after_s: int | None) -> HttpError:
    return HttpError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers=((b"retry-after", b"%d" % retry_after_s),) if retry_after_s is not None else (),
    )


def over_capacity(reason: str, retry_after_s: float) -> HttpError:
    seconds = max(1, math.ceil(retry_after_s))
    return HttpError(
        429,
        f"over capacity: {reason}; retry after {seconds} s",
        type="rate_limit_error",
        code="over_capacity",
        headers=((b"retry-after", b"%d" % seconds),),
    )


def queue_timed_out(band: str, timeout_s: float, model: str, retry_after_s: float) -> HttpError:
    return over_capacity(
        f"waited {timeout_s:g} s (the {band} band's queue timeout) for capacity on {model}",
        retry_after_s,
    )


def no_replica(model: str, *, reachable: bool = False) -> HttpError:
    detail = (
        "no replica of it is ready"
        if not reachable
        else "none of its replicas can take a request now (unhealthy or circuit open)"
    )
    return HttpError(
        503,
        f"the model {model!r} is not available: {detail}",
        type="service_unavailable",
        code="no_ready_replica",
        headers=((b"retry-after", b"5"),),
    )


def not_started(
    model: str, detail: str, retry_after_s: float, base: str | None = None
) -> HttpError:
    """A request for a model at zero replicas that its hold did not keep (full, or held
    its longest): 503 with Retry-After, as for no replica (the same code). `base`: the
    model is a LoRA adapter of it, which no replica holds yet."""
    seconds = max(1, math.ceil(retry_after_s))
    what = (
        f"the adapter {model!r} is not loaded yet: a replica of {base!r} is to load it"
        if base is not None
        else f"the model {model!r} is not available yet: its first replica is starting"
    )
    return HttpError(
        503,
        f"{what} and {detail}; retry after {seconds} s",
        type="service_unavailable",
        code="no_ready_replica",
        headers=((b"retry-after", b"%d" % seconds),),
    )


UpstreamKind = Literal["connect", "timeout", "failed"]


def upstream_error(model: str, kind: UpstreamKind, detail: object) -> HttpError:
    """An attempt's failure as the client hears it: `kind` connect (no replica could be
    reached), timeout (no answer in time) or failed (anything else)."""
    if kind == "connect":
        return HttpError(
            503,
            f"the model {model!r} is not available: no replica could be reached ({detail})",
            type="service_unavailable",
            code="no_ready_replica",
            headers=((b"retry-after", b"5"),),
        )
    if kind == "timeout":
        return HttpError(
            504,
            f"the model {model!r}'s replica did not answer in time: {detail}",
            type="upstream_error",
            code="upstream_timeout",
        )
    return HttpError(
        502,
        f"the model {model!r}'s replica failed: {detail}",
        type="upstream_error",
        code="upstream_failed",
    )


def broken_stream(shape: ErrorShape, detail: object, *, status: int, code: str) -> bytes:
    """The error event for a stream its replica broke after the head was sent."""
    return stream_error(
        shape, f"the model's replica failed mid-response: {detail}", status=status, code=code
    )


def explain_without_admin_key(header: str) -> HttpError:
    return HttpError(
        403,
        f"{header}: this router has no admin key configured, so it explains no decisions",
        type="permission_error",
        code="explain_not_allowed",
    )


def explain_not_admin(header: str) -> HttpError:
    return HttpError(
        403,
        f"{header}: only the admin key may ask why an endpoint "
        "is chosen (its answer shows the whole fleet's load)",
        type="permission_error",
        code="explain_not_allowed",
    )


# --- the JSON body ------------------------------------------------------------------------

# JSON strings, skipped when measuring nesting (brackets inside them do not nest).
# Possessive, so an unterminated string costs one pass, not a backtracking search.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NESTING = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def nests_deeper(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays and objects more than `limit` deep.

    Cheap for the usual body: fewer opening brackets than the limit cannot nest
    deeper. Otherwise the strings are taken out and the brackets summed as +1/-1
    in C (translate, array, accumulate): no Python loop over the bytes.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    structure = _JSON_STRING.sub(b"", body).translate(_NESTING, _NOT_BRACKETS)
    return max(itertools.accumulate(array("b", structure)), default=0) > limit


def _invalid_json(message: str) -> HttpError:
    return HttpError(400, message, type="invalid_request_error", code="invalid_json")


def parse_json(body: bytes, required: str | None, max_depth: int) -> tuple[dict[str, Any], str]:
    """The request object and the model it names, or the 400 that says what is wrong.

    `required`: a field the route needs besides `model`; `max_depth`: the router's
    `max_json_depth`, checked before the body is parsed.
    """
    if nests_deeper(body, max_depth):
        raise _invalid_json(
            f"the request body nests arrays and objects more than {max_depth} levels deep "
            "(the router's max_json_depth)"
        )
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise _invalid_json(f"the request body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise _invalid_json("the request body must be a JSON object")
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError(
            400,
            "model: required, a string naming a served model (see GET /v1/models)",
            type="invalid_request_error",
            code="missing_field",
        )
    if required is not None and required not in request:
        raise HttpError(
            400, f"{required}: required", type="invalid_request_error", code="missing_field"
        )
    return request, model


# --- the prompt, for the prefix index -----------------------------------------------------

_RS, _US = b"\x1e", b"\x1f"  # record and unit separators: a message's edges, a field's


def _text(value: Any) -> bytes:
    """A content value's bytes: a string as UTF-8, anything else as sorted JSON."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, list):
        return b"".join(
            _text(p.get("text")) if isinstance(p, dict) and set(p) <= {"type", "text"} else _text(p)
            for p in value
        )
    return json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _messages(messages: Any) -> Iterable[bytes]:
    if not isinstance(messages, list):
        yield _text(messages)
        return
    for m in messages:
        if not isinstance(m, dict):
            yield _RS + _text(m)
            continue
        yield _RS + _text(m.get("role", "")) + _US + _text(m.get("content", ""))
        rest = {k: v for k, v in m.items() if k not in ("role", "content")}
        if rest:
            yield _US + _text(rest)


def prompt_bytes(path: str, request: dict[str, Any]) -> bytes | None:
    """The request's prompt as one canonical byte string, or None for a route without one.

    Equal message prefixes give equal byte prefixes, whatever the order of the
    body's keys or its whitespace: what the tools and system prompt are comes
    first (the chat templates put them there), then each message's role and
    content. Only identity matters here, not the engine's exact template.
    """
    if path == "/v1/chat/completions":
        head = _text(request["tools"]) if "tools" in request else b""
        return head + b"".join(_messages(request.get("messages")))
    if path == "/v1/completions":
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one is the prompt itself
        return _text(prompt)
    if path == "/v1/messages":
        head = _text(request["tools"]) if "tools" in request else b""
        system = _RS + _text(request["system"]) if "system" in request else b""
        return head + system + b"".join(_messages(request.get("messages")))
    if path == "/v1/responses":
        head = _text(request["tools"]) if "tools" in request else b""
        if "instructions" in request:
            head += _RS + _text(request["instructions"])
        return head + b"".join(_messages(request.get("input")))
    return None


def output_limit(request: dict[str, Any]) -> int | None:
    """The most tokens the request lets the engine write, when it says."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = request.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
