"""server.yaml's `traffic:`: a served name split between catalog models (versions).

    traffic:
      qwen:                                # what clients ask for
        split: {qwen-v1: 90, qwen-v2: 10}  # catalog model: weight (integers >= 0)
        keys: {key-1a2b3c4d5e6f: qwen-v2}  # API key id: the version it always gets

Read with the catalog (llmgw/cp/_fleet/_catalog.py), so a reload of server.yaml
changes the weights with nothing restarted: the split travels in the router's
endpoint view (llmgw/cp/_fleet/_endpoints.py), and the router draws a version per
request (llmgw/core/_traffic.py). A split name must not also be a model's served
name: which one a request meant would be a guess. Every error names its path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from llmgw import config, core
from llmgw.errors import ConfigError

if TYPE_CHECKING:
    from llmgw.cp._fleet._catalog import CatalogModel


@attrs.define(kw_only=True, frozen=True)
class TrafficEntry:
    split: dict[str, Any]  # catalog model -> weight (checked here, with its path)
    keys: dict[str, str] = attrs.field(factory=dict)  # API key id -> catalog model


def parse(
    data: Any, models: tuple[CatalogModel, ...], source: str
) -> tuple[tuple[core.TrafficSplit, ...], list[str]]:
    """The splits `traffic:` declares, and every problem found (each naming its path).
    A split with a problem is left out; the caller refuses the file when any is found."""
    if data is None:
        return (), []
    if not isinstance(data, dict):
        return (), [f"traffic: expected a mapping of split name -> {{split, keys}}, got {data!r}"]
    by_name = {m.name: m for m in models}
    served = {name: m.name for m in models for name in m.names}
    splits: list[core.TrafficSplit] = []
    problems: list[str] = []
    for name, body in data.items():
        where = f"traffic.{name}"
        try:
            entry = config.structure(body, TrafficEntry, source, at=where)
        except ConfigError as exc:
            prefix = f"{source}: "
            problems += [p.removeprefix(prefix) for p in str(exc).splitlines()]
            continue
        found = _problems(str(name), entry, by_name, served, where)
        if found:
            problems += found
            continue
        versions = tuple(
            core.TrafficVersion(model, by_name[model].names[0], weight)
            for model, weight in entry.split.items()
        )
        splits.append(core.TrafficSplit(str(name), versions, tuple(sorted(entry.keys.items()))))
    return tuple(sorted(splits, key=lambda s: s.name)), problems


def _problems(
    name: str,
    entry: TrafficEntry,
    by_name: dict[str, CatalogModel],
    served: dict[str, str],
    where: str,
) -> list[str]:
    problems = []
    if not name:
        problems.append(f"{where}: a split needs a name (what clients ask for)")
    if name in served:
        problems.append(
            f"{where}: {name!r} is also a served name of model {served[name]!r}; a name is "
            "either a model's or a split's: rename the split, or take the name out of the "
            "model's served_names"
        )
    if not entry.split:
        problems.append(f"{where}.split: empty; name at least one catalog model and its weight")
    known = ", ".join(sorted(by_name)) or "none"
    for model, weight in entry.split.items():
        if model not in by_name:
            problems.append(f"{where}.split.{model}: no model {model!r} in the catalog "
                            f"(models: {known})")  # fmt: skip
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            problems.append(f"{where}.split.{model}: weight {weight!r}: a whole number, 0 or more")
    weights = [w for w in entry.split.values() if isinstance(w, int) and not isinstance(w, bool)]
    if entry.split and len(weights) == len(entry.split) and sum(weights) <= 0:
        problems.append(
            f"{where}.split: the weights sum to 0, so no request could be sent anywhere; "
            "give at least one version a weight above 0"
        )
    versions = ", ".join(entry.split) or "none"
    for key_id, model in entry.keys.items():
        if model not in entry.split:
            problems.append(f"{where}.keys.{key_id}: {model!r} is not a version of this split "
                            f"(versions: {versions})")  # fmt: skip
    return problems
