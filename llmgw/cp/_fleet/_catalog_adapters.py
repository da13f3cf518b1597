"""server.yaml's `adapters:`: LoRA adapters served on a catalog model's replicas.

    adapters:
      - name: sql-lora             # what clients put in `model`
        base: llama-8b             # the catalog model whose replicas serve it
        source: mirror:/loras/sql/ # as a model's source: a local path, a URL, mirror:
        scale: 1.0                 # optional, > 0
        tenants: [acme]            # optional: only these tenants; absent: every tenant
        rank: 16                   # optional: its LoRA rank, checked against the base

Read with the catalog (llmgw/cp/_fleet/_catalog.py). A base takes adapters when one of
its profiles sets `max_adapters`; an adapter's rank must fit each such profile's
`max_adapter_rank`. An adapter's name is one namespace with the models' names, their
served names and the traffic splits: which one a request meant would be a guess.
Adapters never enter a profile's fingerprint: adding one rolls nothing. Every error
names its path.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from llmgw import core
from llmgw.errors import ConfigError

if TYPE_CHECKING:
    from llmgw.cp._fleet._catalog import CatalogModel

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # as a model's name


@attrs.define(kw_only=True, frozen=True)
class CatalogAdapter:
    name: str  # what clients put in `model`
    base: str  # a catalog model's name
    source: str  # as a model's source (llmgw.core.classify_source)
    scale: float = 1.0
    tenants: list[str] | None = None  # None: every tenant
    rank: int | None = None  # its LoRA rank; None: not said (the engine checks it on load)


def adapter_problems(
    adapters: Sequence[CatalogAdapter],
    models: Sequence[CatalogModel],
    splits: Sequence[str],
) -> list[str]:
    """Every problem of `adapters` against the catalog's models and traffic split names,
    each naming its path."""
    problems: list[str] = []
    index = {m.name: i for i, m in enumerate(models)}
    served = {name: m.name for m in models for name in m.names}
    seen: set[str] = set()
    for i, a in enumerate(adapters):
        where = f"adapters[{i}]"
        problems += _name_problems(a.name, where, seen, index, served, splits)
        seen.add(a.name)
        problems += _source_problems(a.source, where)
        if not math.isfinite(a.scale) or a.scale <= 0:  # the converter refuses a bool
            problems.append(
                f"{where}.scale: {a.scale!r}: a finite number above 0 (1.0: as trained)"
            )
        if a.tenants is not None and not a.tenants:
            problems.append(
                f"{where}.tenants: empty, so no tenant could use the adapter; leave tenants "
                "out to allow every tenant"
            )
        for j, tenant in enumerate(a.tenants or ()):
            if not tenant:
                problems.append(f"{where}.tenants[{j}]: empty; name a tenant")
        if a.rank is not None and a.rank < 1:
            problems.append(f"{where}.rank: {a.rank}: at least 1")
        if a.base not in index:
            known = ", ".join(m.name for m in models) or "none"
            problems.append(f"{where}.base: no model {a.base!r} in the catalog (models: {known})")
            continue
        problems += _base_problems(a, models[index[a.base]], index[a.base], where)
    return problems


def _name_problems(
    name: str,
    where: str,
    seen: set[str],
    models: dict[str, int],
    served: dict[str, str],
    splits: Sequence[str],
) -> list[str]:
    if not _NAME.match(name):
        return [f"{where}.name: {name!r}: use letters, digits, '.', '_', '-'"]
    rename = "a name is a model's, a split's or an adapter's: rename the adapter"
    if name in seen:
        return [f"{where}.name: {name!r} is defined twice"]
    if name in models:
        return [f"{where}.name: {name!r} is also the name of model {name!r}; {rename}"]
    if name in served:
        return [f"{where}.name: {name!r} is also a served name of model {served[name]!r}; {rename}"]
    if name in splits:
        return [f"{where}.name: {name!r} is also a traffic split (traffic.{name}); {rename}"]
    return []


def _source_problems(source: str, where: str) -> list[str]:
    try:
        core.classify_source(source)
    except ConfigError as exc:
        why = str(exc).removeprefix(f"source {source!r}: ")
        return [f"{where}.source: {source!r}: {why}"]
    return []


def _base_problems(a: CatalogAdapter, base: CatalogModel, k: int, where: str) -> list[str]:
    taking = [(j, p) for j, p in enumerate(base.profiles) if p.max_adapters is not None]
    if not taking:
        return [
            f"{where}.base: model {base.name!r} takes no adapters: none of its profiles sets "
            f"max_adapters; set models[{k}].profiles[N].max_adapters (how many adapters one "
            "replica holds at once)"
        ]
    if a.rank is None:
        return []
    return [
        f"{where}.rank: {a.rank} is above models[{k}].profiles[{j}].max_adapter_rank "
        f"({p.max_adapter_rank}); raise max_adapter_rank there, or use an adapter of that "
        "rank or less"
        for j, p in taking
        if p.max_adapter_rank is not None and a.rank > p.max_adapter_rank
    ]


def profile_problems(
    max_adapters: int | None, max_adapter_rank: int | None, where: str
) -> list[str]:
    """A profile's two adapter keys."""
    problems = []
    if max_adapters is not None and max_adapters < 1:
        problems.append(
            f"{where}.max_adapters: {max_adapters}: at least 1 (leave it out for a replica "
            "that takes no adapters)"
        )
    if max_adapter_rank is not None and max_adapter_rank < 1:
        problems.append(f"{where}.max_adapter_rank: {max_adapter_rank}: at least 1")
    elif max_adapter_rank is not None and max_adapters is None:
        problems.append(
            f"{where}.max_adapter_rank: set, but max_adapters is not, so the profile takes no "
            "adapters: set max_adapters too, or leave max_adapter_rank out"
        )
    return problems


def weight_sources(
    models: Sequence[CatalogModel], adapters: Sequence[CatalogAdapter]
) -> list[tuple[str, str]]:
    """(who wants it, source) for every source the catalog wants on the nodes: each model's
    under its name, each adapter's as `NAME (adapter of BASE)`; reclaim keeps them all."""
    return [(m.name, m.source) for m in models] + [
        (f"{a.name} (adapter of {a.base})", a.source) for a in adapters
    ]
