"""The catalog: what should run. The `models:` section of server.yaml.

All validation happens here, with every error naming its path
(`models[3].profiles[0].gpu_class: unknown class "h100-80"`). Each profile
has a fingerprint that travels with its shards to the agent and back, so a
replica started from an older profile shows as stale, also after a control
plane restart. The fingerprint holds the source, the served names, the profile
and, when server.yaml's `engines:` declares the profile's engine, its declared
version (`Catalog.engine_versions`): declaring another version rolls the models
that run it. An engine not declared adds nothing, so a fleet without `engines:`
keeps the fingerprints it had before versions counted. Likewise a profile's
`max_adapters`/`max_adapter_rank` and its share of a card (`gpu_memory_gib`, `mig`:
llmgw/cp/_fleet/_catalog_sharing.py) enter its fingerprint only once set, and the
`adapters:` section (llmgw/cp/_fleet/_catalog_adapters.py) never does: adding an
adapter rolls nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import attrs

from llmgw import config, core, engines, model
from llmgw.cp._fleet import _catalog_adapters, _catalog_sharing, _traffic
from llmgw.cp._fleet._catalog_adapters import CatalogAdapter as CatalogAdapter
from llmgw.errors import ConfigError

_CLASS = re.compile(r"^[a-z0-9][a-z0-9-]*-\d+g$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@attrs.define(kw_only=True, frozen=True)
class Profile:
    engine: str
    gpu_class: str | None = None  # absent: CPU (only for engines that run without a card)
    gpus_per_node: int | None = None  # default: 1 with a gpu_class, 0 without
    nodes: int = 1
    tp: int | None = None  # default: gpus_per_node x nodes / pp
    pp: int = 1
    multinode: str = "ray"
    quantization: str | None = None
    min_memory_gb: float | None = None
    node_selector: dict[str, str] = attrs.field(factory=dict)
    fabric: str | None = None
    engine_args: list[str] = attrs.field(factory=list)
    startup_timeout_s: float = 900.0
    port_range: list[int] | None = None
    # LoRA adapters (server.yaml `adapters:`): the most one replica holds at once; None:
    # the replica takes none. Their highest rank; None: the engine's default.
    max_adapters: int | None = None
    max_adapter_rank: int | None = None
    # A share of a card (llmgw/cp/_fleet/_catalog_sharing.py): GiB of each card, or one MIG
    # instance of this profile ("3g.40gb"); None for both: whole cards.
    gpu_memory_gib: float | None = None
    mig: str | None = None

    @property
    def cards(self) -> int:
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return 1 if self.gpu_class else 0

    @property
    def tensor_parallel(self) -> int:
        if self.tp is not None:
            return self.tp
        return max(1, self.cards * self.nodes // max(1, self.pp))


@attrs.define(kw_only=True, frozen=True)
class Rollout:
    """How a changed model's replicas are replaced (llmgw/core/_rollout.py)."""

    max_surge: int = 1  # new replicas beyond the count while rolling
    max_unavailable: int = 0  # ready replicas the count may drop by while rolling
    max_failures: int = 3  # new replicas that may fail before the rollout stops itself

    def policy(self) -> core.RolloutPolicy:
        return core.RolloutPolicy(self.max_surge, self.max_unavailable, self.max_failures)


@attrs.define(kw_only=True, frozen=True)
class AutoscaleTarget:
    """What one replica should carry; each set target may raise the count."""

    requests_per_replica: float | None = None  # requests queued + in flight, per replica
    ttft_p90_s: float | None = None  # time to first byte, p90 over the window


@attrs.define(kw_only=True, frozen=True)
class Autoscale:
    """A model's `autoscale:` (llmgw/core/_autoscale.py decides). A setting not given
    (None) is the core's default (`core.AutoscalePolicy`)."""

    min: int = 0
    max: int
    target: AutoscaleTarget = attrs.field(factory=AutoscaleTarget)
    window_s: float | None = None
    scale_down_after_s: float | None = None
    max_step_up: int | None = None
    up_cooldown_s: float | None = None
    down_cooldown_s: float | None = None
    predict_s: float | None = None
    trend_window_s: float | None = None
    hold_max: int | None = None
    hold_s: float | None = None

    def policy(self) -> core.AutoscalePolicy:
        return autoscale_policy(self)


def autoscale_policy(a: Autoscale) -> core.AutoscalePolicy:
    """`a` as the decision takes it: a setting not given is the core's default."""
    given: dict[str, float | int | None] = {
        "window_s": a.window_s,
        "scale_down_after_s": a.scale_down_after_s,
        "max_step_up": a.max_step_up,
        "up_cooldown_s": a.up_cooldown_s,
        "down_cooldown_s": a.down_cooldown_s,
        "predict_s": a.predict_s,
        "trend_window_s": a.trend_window_s,
        "hold_max": a.hold_max,
        "hold_s": a.hold_s,
    }
    t = a.target
    if t.requests_per_replica is not None or t.ttft_p90_s is not None:
        given |= {"requests_per_replica": t.requests_per_replica, "ttft_p90_s": t.ttft_p90_s}
    kept = {k: v for k, v in given.items() if v is not None or k.startswith(("requests", "ttft"))}
    return core.AutoscalePolicy(min=a.min, max=a.max, **kept)  # type: ignore[arg-type]


@attrs.define(kw_only=True, frozen=True)
class CatalogModel:
    name: str
    source: str  # a local path, a URL, a URL ending in / (multi-file), or a hub id
    served_names: list[str] = attrs.field(factory=list)
    replicas: int = 1
    profiles: list[Profile]
    rollout: Rollout = attrs.field(factory=Rollout)  # not in the fingerprint: how, not what
    # The count follows the load between its min and max (`replicas` is then not given).
    autoscale: Autoscale | None = None
    # On a full fleet a model with demand may displace idle replicas of a lower priority.
    priority: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """What clients may ask for: the served names, else the model's name."""
        return tuple(self.served_names) or (self.name,)


@attrs.define(kw_only=True, frozen=True)
class CatalogFile:
    """The catalog's part of server.yaml (the rest is ServerConfig's)."""

    models: list[CatalogModel] = attrs.field(factory=list)
    adapters: list[CatalogAdapter] = attrs.field(factory=list)  # llmgw.cp._fleet._catalog_adapters


@attrs.frozen
class Catalog:
    models: tuple[CatalogModel, ...] = ()
    # server.yaml's `traffic:`: served names split between models (llmgw/cp/_fleet/_traffic.py)
    traffic: tuple[core.TrafficSplit, ...] = ()
    # server.yaml's `engines:`: (engine, declared version), sorted by engine; () when
    # nothing is declared. Filled where the file's two parts meet (`with_engines`).
    engine_versions: tuple[tuple[str, str], ...] = ()
    # server.yaml's `adapters:`: LoRA adapters on the models' replicas; no fingerprint holds them
    adapters: tuple[CatalogAdapter, ...] = ()

    def model(self, name: str) -> CatalogModel | None:
        return next((m for m in self.models if m.name == name), None)

    def by_served_name(self) -> dict[str, CatalogModel]:
        return {served: m for m in self.models for served in m.names}

    def adapter(self, name: str) -> CatalogAdapter | None:
        return next((a for a in self.adapters if a.name == name), None)

    def adapters_of(self, model_name: str) -> tuple[CatalogAdapter, ...]:
        """The adapters whose base is `model_name`, in the file's order."""
        return tuple(a for a in self.adapters if a.base == model_name)

    def weight_sources(self) -> list[tuple[str, str]]:
        """(who wants it, source) for every source the catalog wants on the nodes: its
        models' and its adapters' (`NAME (adapter of BASE)`)."""
        return _catalog_adapters.weight_sources(self.models, self.adapters)

    def fingerprint(self, m: CatalogModel, profile: Profile) -> str:
        """The fingerprint of `profile` of `m` in this catalog: with its engine's
        declared version when there is one."""
        version = next((v for name, v in self.engine_versions if name == profile.engine), None)
        return fingerprint(m, profile, version)

    def fingerprints(self, m: CatalogModel) -> tuple[str, ...]:
        """Each profile's fingerprint, in the profiles' order."""
        return tuple(self.fingerprint(m, p) for p in m.profiles)


def with_engines(catalog: Catalog, decls: model.EngineDecls | None) -> Catalog:
    """`catalog` with the declared engines' versions (None: nothing declared)."""
    versions = tuple(sorted((d.name, d.version) for d in decls.engines)) if decls else ()
    return attrs.evolve(catalog, engine_versions=versions)


def fingerprint(m: CatalogModel, profile: Profile, engine_version: str | None = None) -> str:
    """Changes exactly when what a shard of this profile would run changes. Callers
    go through `Catalog.fingerprint`, which knows the declared engine version; None
    (not declared) leaves the body as it was before versions counted, so fleets
    without `engines:` are not rolled by an upgrade."""
    shape = config.unstructure(profile)
    # Unset: the body as it was before adapters and shares of a card existed.
    for key in ("max_adapters", "max_adapter_rank", "gpu_memory_gib", "mig"):
        if shape.get(key) is None:
            del shape[key]
    body: dict[str, object] = {
        "source": m.source,
        "served_names": list(m.names),
        "profile": shape,
    }
    if engine_version is not None:
        body["engine_version"] = engine_version
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def engine_profile(
    model: CatalogModel, profile: Profile, *, gpu_memory_fraction: float | None = None
) -> engines.EngineProfile:
    """`profile` of `model` as the engines take it. `gpu_memory_fraction`: its share of
    each card, which only the card placement picks can tell (`engines.memory_fraction`
    of `gpu_memory_gib` and that card's size); None: whole cards, or not yet placed."""
    port_range = tuple(profile.port_range) if profile.port_range else None
    return engines.EngineProfile(
        engine=profile.engine,  # type: ignore[arg-type]  # checked by validate_catalog
        model=model.source,
        served_names=model.names,
        gpu_class=profile.gpu_class,
        gpus_per_node=profile.cards,
        nodes=profile.nodes,
        tp=profile.tensor_parallel,
        pp=profile.pp,
        multinode=profile.multinode,  # type: ignore[arg-type]
        quantization=profile.quantization,
        engine_args=tuple(profile.engine_args),
        port_range=port_range,  # type: ignore[arg-type]
        max_adapters=profile.max_adapters or 0,
        max_adapter_rank=profile.max_adapter_rank,
        gpu_memory_fraction=gpu_memory_fraction,
    )


def validate_catalog(catalog: Catalog, source: str, problems: list[str] | None = None) -> None:
    """Raises ConfigError listing every problem (`problems`: found before, e.g. in traffic)."""
    problems = list(problems or ())
    names: set[str] = set()
    served: dict[str, str] = {}
    for i, m in enumerate(catalog.models):
        where = f"models[{i}]"
        if not _NAME.match(m.name):
            problems.append(f"{where}.name: {m.name!r}: use letters, digits, '.', '_', '-'")
        if m.name in names:
            problems.append(f"{where}.name: {m.name!r} is defined twice")
        names.add(m.name)
        for name in m.names:
            if name in served and served[name] != m.name:
                problems.append(
                    f"{where}.served_names: {name!r} is also served by model {served[name]!r}"
                )
            served[name] = m.name
        if not m.source:
            problems.append(f"{where}.source: empty")
        if m.replicas < 0:
            problems.append(f"{where}.replicas: {m.replicas} is negative")
        if m.autoscale is not None:
            found = core.validate_policy(m.autoscale.policy(), f"{where}.autoscale")
            for target in ("requests_per_replica", "ttft_p90_s"):  # written under target:
                found = [p.replace(f".{target}:", f".target.{target}:") for p in found]
            problems += found
        problems += _rollout_problems(m.rollout, f"{where}.rollout")
        if not m.profiles:
            problems.append(f"{where}.profiles: at least one profile is needed")
        for j, p in enumerate(m.profiles):
            problems += _profile_problems(m, p, f"{where}.profiles[{j}]")
    splits = [s.name for s in catalog.traffic]
    problems += _catalog_adapters.adapter_problems(catalog.adapters, catalog.models, splits)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))


def _rollout_problems(r: Rollout, where: str) -> list[str]:
    problems = [
        f"{where}.{name}: {value} is negative"
        for name, value in (("max_surge", r.max_surge), ("max_unavailable", r.max_unavailable))
        if value < 0
    ]
    if not problems and r.max_surge == 0 and r.max_unavailable == 0:
        problems.append(
            f"{where}: max_surge and max_unavailable are both 0, so no replica could ever be "
            "replaced; allow one extra (max_surge: 1) or one fewer (max_unavailable: 1)"
        )
    if r.max_failures < 1:
        problems.append(f"{where}.max_failures: {r.max_failures}: at least 1")
    return problems


def _profile_problems(model: CatalogModel, p: Profile, where: str) -> list[str]:
    problems = []
    if p.engine not in engines.ENGINES:
        known = ", ".join(engines.ENGINES)
        return [f"{where}.engine: unknown engine {p.engine!r} (known: {known})"]
    if p.gpu_class is not None and not _CLASS.match(p.gpu_class):
        problems.append(
            f"{where}.gpu_class: unknown class {p.gpu_class!r} "
            "(a class is the card and its size in GiB, e.g. h100-80g, l40s-45g)"
        )
    if p.multinode not in ("ray", "native"):
        problems.append(f"{where}.multinode: {p.multinode!r}: use ray or native")
    if p.nodes > 1 and p.engine == "llama-server":
        pass  # engines.validate names it below
    if p.port_range is not None and (
        len(p.port_range) != 2 or not 0 < p.port_range[0] <= p.port_range[1] < 65536
    ):
        problems.append(f"{where}.port_range: {p.port_range} is not [first, last] ports")
    if p.startup_timeout_s <= 0:
        problems.append(f"{where}.startup_timeout_s: must be positive")
    problems += _catalog_adapters.profile_problems(p.max_adapters, p.max_adapter_rank, where)
    problems += _catalog_sharing.sharing_problems(p, where)
    if problems:
        return problems
    try:
        engines.validate(engine_profile(model, p))
    except engines.EngineConfigError as exc:
        problems += [f"{where}: {problem}" for problem in exc.problems]
    return problems


def parse(data: Any, source: str) -> Catalog:
    """The catalog from server.yaml's parsed data (other keys are ServerConfig's)."""
    models = data.get("models", []) if isinstance(data, dict) else []
    adapters = data.get("adapters", []) if isinstance(data, dict) else []
    parsed = config.structure({"models": models, "adapters": adapters}, CatalogFile, source)
    traffic = data.get("traffic") if isinstance(data, dict) else None
    splits, problems = _traffic.parse(traffic, tuple(parsed.models), source)
    for i, raw in enumerate(models if isinstance(models, list) else ()):
        if isinstance(raw, dict) and "replicas" in raw and "autoscale" in raw:
            problems.append(
                f"models[{i}]: replicas and autoscale are both set: autoscale sets the count "
                "between its min and max; leave replicas out"
            )
    catalog = Catalog(models=tuple(parsed.models), adapters=tuple(parsed.adapters), traffic=splits)
    validate_catalog(catalog, source, problems)
    return catalog
