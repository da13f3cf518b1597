"""Convert between llmgw.model attrs values and capnp structs, by field name.

Runs only on the capnp thread (it touches builders and readers). The mapping
is derived once per class from its type hints:

- `int`, `float`, `bool`, `str`: the capnp field of the same (camelCase) name;
- `int | None`, `float | None`: a pointer to OptI64/OptF64, null when None;
- `str | None`: a Text pointer, null when None;
- attrs class (optional or not): a struct pointer, null when None;
- `tuple[X, ...]` (optional or not): a List pointer; null when None, so an
  empty tuple and None stay apart.

An agent older than a field leaves the pointer null, which decodes to None
(or to the field's default for non-optional fields).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

import attrs

from llmgw import model

_SCALARS = (int, float, bool, str)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


@attrs.frozen
class _Field:
    attr: str
    wire: str
    optional: bool
    kind: str  # scalar, opt_number, struct, list
    inner: Any  # the attrs class, the scalar type, or the list item type
    item_is_struct: bool = False


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union {tp!r}")
    return tp, False


_PLANS: dict[type, tuple[_Field, ...]] = {}


def _plan(cls: type) -> tuple[_Field, ...]:
    cached = _PLANS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls, vars(model))
    plan = []
    for field in attrs.fields(cls):
        tp, optional = _unwrap_optional(hints[field.name])
        wire = _camel(field.name)
        if typing.get_origin(tp) is tuple:
            item = typing.get_args(tp)[0]
            plan.append(_Field(field.name, wire, optional, "list", item, attrs.has(item)))
        elif attrs.has(tp):
            plan.append(_Field(field.name, wire, optional, "struct", tp))
        elif tp in (int, float) and optional:
            plan.append(_Field(field.name, wire, True, "opt_number", tp))
        elif tp in _SCALARS:
            plan.append(_Field(field.name, wire, optional, "scalar", tp))
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: unsupported type {tp!r}")
    _PLANS[cls] = tuple(plan)
    return _PLANS[cls]


def encode(value: Any, builder: Any) -> None:
    """Write attrs `value` into the capnp struct `builder`."""
    for f in _plan(type(value)):
        v = getattr(value, f.attr)
        if v is None:
            continue  # leave the pointer null: unknown
        if f.kind == "scalar":
            setattr(builder, f.wire, v)
        elif f.kind == "opt_number":
            builder.init(f.wire).v = v
        elif f.kind == "struct":
            encode(v, builder.init(f.wire))
        else:
            items = builder.init(f.wire, len(v))
            for i, item in enumerate(v):
                if f.item_is_struct:
                    encode(item, items[i])
                else:
                    items[i] = item


def decode(cls: type[Any], reader: Any) -> Any:
    """Read the capnp struct `reader` into a new `cls` value."""
    return _decoder(cls)(reader)


_DECODERS: dict[type, Callable[[Any], Any]] = {}


def _decoder(cls: type) -> Callable[[Any], Any]:
    """A function that decodes `cls`, generated once from its plan.

    The control plane decodes a heartbeat per agent per interval and a whole
    inventory per registration; walking the plan field by field for each
    value was most of its CPU at fleet size (bench/fleet.py). The generated
    function does the same reads, in one expression per field.
    """
    fn = _DECODERS.get(cls)
    if fn is not None:
        return fn
    plan = _plan(cls)
    namespace: dict[str, Any] = {"cls": cls, "tuple": tuple}
    args = []
    for i, f in enumerate(plan):
        # `_get(name)` is the reader's own accessor: the attribute form goes
        # through __getattr__ to it, at 2.5 times the cost.
        read = f"get({f.wire!r})"
        if f.kind == "scalar":
            namespace[f"t{i}"] = f.inner
            expr = f"t{i}({read})"
        elif f.kind == "opt_number":
            namespace[f"t{i}"] = f.inner
            expr = f"t{i}({read}._get('v'))"
        elif f.kind == "struct":
            namespace[f"d{i}"] = _decoder(f.inner)
            expr = f"d{i}({read})"
        else:
            namespace[f"d{i}"] = _decoder(f.inner) if f.item_is_struct else f.inner
            expr = f"tuple([d{i}(item) for item in {read}])"
        if f.optional:
            expr = f"({expr} if has({f.wire!r}) else None)"
        args.append(f"        {f.attr}={expr},")
    head = [f"def decode_{cls.__name__}(r):", "    get, has = r._get, r._has", "    return cls("]
    source = "\n".join([*head, *args, "    )"])
    exec(compile(source, f"<llmgw.rpc._codec decoder for {cls.__name__}>", "exec"), namespace)
    fn = namespace[f"decode_{cls.__name__}"]
    _DECODERS[cls] = fn
    return fn  # type: ignore[no-any-return]
