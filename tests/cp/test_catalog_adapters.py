"""server.yaml's `adapters:` and the profile keys `max_adapters`/`max_adapter_rank`
(llmgw/cp/_fleet/_catalog_adapters.py, _catalog.py): every error with its whole path,
all at once; a real server.yaml loaded as llmgw-cp loads it; the engine profile the
keys reach; fingerprints that do not move for a fleet without adapters."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from llmgw.cp._fleet import _catalog, _catalog_file
from llmgw.cp._fleet._catalog import Catalog, CatalogAdapter, CatalogModel, Profile, parse
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._main import load_server
from llmgw.errors import ConfigError

TAKES = {"engine": "llama-server", "gpus_per_node": 0, "max_adapters": 2, "max_adapter_rank": 16}
PLAIN = {"engine": "llama-server", "gpus_per_node": 0}
BASE = {"name": "base", "source": "/m.gguf", "served_names": ["base-chat"], "profiles": [TAKES]}
OTHER = {"name": "other", "source": "/o.gguf", "profiles": [PLAIN]}
TRAFFIC = {"canary": {"split": {"base": 1}}}
RENAME = "a name is a model's, a split's or an adapter's: rename the adapter"


def adapter(**kw: Any) -> dict[str, Any]:
    return {"name": "sql", "base": "base", "source": "/loras/sql.gguf", **kw}


def errors(*adapters: dict[str, Any], models: list[dict[str, Any]] | None = None) -> list[str]:
    data = {"models": models or [BASE, OTHER], "adapters": list(adapters), "traffic": TRAFFIC}
    with pytest.raises(ConfigError) as info:
        parse(data, "server.yaml")
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    ("adapters", "expected"),
    [
        ([adapter(name="bad name")],
         "adapters[0].name: 'bad name': use letters, digits, '.', '_', '-'"),
        ([adapter(), adapter()], "adapters[1].name: 'sql' is defined twice"),
        ([adapter(name="other")], f"adapters[0].name: 'other' is also the name of model 'other'; {RENAME}"),
        ([adapter(name="base-chat")],
         f"adapters[0].name: 'base-chat' is also a served name of model 'base'; {RENAME}"),
        ([adapter(name="canary")],
         f"adapters[0].name: 'canary' is also a traffic split (traffic.canary); {RENAME}"),
        ([adapter(base="llama")],
         "adapters[0].base: no model 'llama' in the catalog (models: base, other)"),
        ([adapter(base="other")],
         "adapters[0].base: model 'other' takes no adapters: none of its profiles sets "
         "max_adapters; set models[1].profiles[N].max_adapters (how many adapters one replica "
         "holds at once)"),
        ([adapter(rank=32)],
         "adapters[0].rank: 32 is above models[0].profiles[0].max_adapter_rank (16); raise "
         "max_adapter_rank there, or use an adapter of that rank or less"),
        ([adapter(rank=0)], "adapters[0].rank: 0: at least 1"),
        ([adapter(scale=0)], "adapters[0].scale: 0.0: a finite number above 0 (1.0: as trained)"),
        ([adapter(scale=-0.5)], "adapters[0].scale: -0.5: a finite number above 0 (1.0: as trained)"),
        ([adapter(scale=math.nan)], "adapters[0].scale: nan: a finite number above 0 (1.0: as trained)"),
        ([adapter(scale=math.inf)], "adapters[0].scale: inf: a finite number above 0 (1.0: as trained)"),
        ([adapter(tenants=[])],
         "adapters[0].tenants: empty, so no tenant could use the adapter; leave tenants out to "
         "allow every tenant"),
        ([adapter(tenants=["acme", ""])], "adapters[0].tenants[1]: empty; name a tenant"),
        ([adapter(source="")], "adapters[0].source: '': empty or surrounded by spaces"),
        ([adapter(source=" /l.gguf")], "adapters[0].source: ' /l.gguf': empty or surrounded by spaces"),
        ([adapter(source="mirror:loras/")],
         "adapters[0].source: 'mirror:loras/': a mirror source is mirror:/path (a file) or "
         "mirror:/path/ (a version)"),
        ([adapter(source="https://host")],
         "adapters[0].source: 'https://host': a URL needs a host and a path, e.g. "
         "https://host/model.gguf"),
        # What the converter refuses, with the same paths.
        ([adapter(weight=1)], "adapters[0].weight: unknown key"),
        ([{"name": "sql", "source": "/l.gguf"}], "adapters[0].base: required, but missing"),
        ([adapter(scale="big")], "adapters[0].scale: expected a number, got 'big'"),
        ([adapter(tenants="acme")], "adapters[0].tenants: expected a list, got 'acme'"),
    ],
)  # fmt: skip
def test_each_adapter_error_is_one_line_with_its_path(
    adapters: list[dict[str, Any]], expected: str
) -> None:
    assert errors(*adapters) == [f"server.yaml: {expected}"]


def test_a_rank_above_several_profiles_names_each() -> None:
    wide = {**TAKES, "max_adapter_rank": 64}
    narrow = {**TAKES, "max_adapter_rank": 8}
    base = {**BASE, "profiles": [narrow, PLAIN, wide, {**TAKES, "max_adapter_rank": None}, narrow]}
    assert errors(adapter(rank=32), models=[base]) == [
        "server.yaml: adapters[0].rank: 32 is above models[0].profiles[0].max_adapter_rank (8); "
        "raise max_adapter_rank there, or use an adapter of that rank or less",
        "server.yaml: adapters[0].rank: 32 is above models[0].profiles[4].max_adapter_rank (8); "
        "raise max_adapter_rank there, or use an adapter of that rank or less",
    ]
    # A profile without max_adapter_rank takes any rank; a base of one such profile is fine.
    ok = parse({"models": [{**BASE, "profiles": [{**TAKES, "max_adapter_rank": None}]}],
                "adapters": [adapter(rank=512)]}, "server.yaml")  # fmt: skip
    assert ok.adapters[0].rank == 512


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ({**PLAIN, "max_adapters": 0},
         "models[0].profiles[0].max_adapters: 0: at least 1 (leave it out for a replica that "
         "takes no adapters)"),
        ({**TAKES, "max_adapter_rank": 0}, "models[0].profiles[0].max_adapter_rank: 0: at least 1"),
        ({**PLAIN, "max_adapter_rank": 8},
         "models[0].profiles[0].max_adapter_rank: set, but max_adapters is not, so the profile "
         "takes no adapters: set max_adapters too, or leave max_adapter_rank out"),
    ],
)  # fmt: skip
def test_each_profile_key_error(profile: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse({"models": [{**BASE, "profiles": [profile]}]}, "server.yaml")
    assert str(info.value).splitlines() == [f"server.yaml: {expected}"]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama-server"])
def test_every_engine_takes_adapters(engine: str) -> None:
    profile = {"engine": engine, "gpu_class": "h100-80g", "max_adapters": 4, "max_adapter_rank": 64}
    catalog = parse({"models": [{**BASE, "profiles": [profile]}], "adapters": [adapter()]}, "s")
    m = catalog.models[0]
    ep = _catalog.engine_profile(m, m.profiles[0])
    assert (ep.engine, ep.max_adapters, ep.max_adapter_rank) == (engine, 4, 64)


def test_a_profile_without_the_keys_gives_the_engine_zero_and_none() -> None:
    m = parse({"models": [OTHER]}, "s").models[0]
    ep = _catalog.engine_profile(m, m.profiles[0])
    assert (ep.max_adapters, ep.max_adapter_rank) == (0, None)


def test_every_problem_is_reported_at_once() -> None:
    bad_profile = {**OTHER, "profiles": [{**PLAIN, "max_adapters": 0}]}
    lines = errors(
        adapter(name="base-chat", base="nope", source="", scale=0, tenants=[], rank=0),
        adapter(name="ok", base="other"),
        adapter(name="ok"),
        models=[BASE, bad_profile],
    )
    assert lines == [
        "server.yaml: models[1].profiles[0].max_adapters: 0: at least 1 (leave it out for a "
        "replica that takes no adapters)",
        f"server.yaml: adapters[0].name: 'base-chat' is also a served name of model 'base'; {RENAME}",
        "server.yaml: adapters[0].source: '': empty or surrounded by spaces",
        "server.yaml: adapters[0].scale: 0.0: a finite number above 0 (1.0: as trained)",
        "server.yaml: adapters[0].tenants: empty, so no tenant could use the adapter; leave "
        "tenants out to allow every tenant",
        "server.yaml: adapters[0].rank: 0: at least 1",
        "server.yaml: adapters[0].base: no model 'nope' in the catalog (models: base, other)",
        "server.yaml: adapters[2].name: 'ok' is defined twice",
    ]  # adapters[1].base: 'other' sets max_adapters: 0, already named under its profile


# --- a real server.yaml, as llmgw-cp loads it ------------------------------------------------

SERVER = {
    "tls": {"ca": "/pki/ca.crt", "cert": "/pki/cp.crt", "key": "/pki/cp.key"},
    "models": [
        {"name": "llama-8b", "source": "mirror:/llama-8b/", "served_names": ["llama"],
         "profiles": [{"engine": "vllm", "gpu_class": "h100-80g", "max_adapters": 4,
                       "max_adapter_rank": 64},
                      {"engine": "llama-server", "max_adapters": 2}]},
        {"name": "qwen", "source": "Qwen/Qwen2.5-7B-Instruct",
         "profiles": [{"engine": "sglang", "gpu_class": "h100-80g"}]},
    ],
    "adapters": [
        {"name": "sql-lora", "base": "llama-8b", "source": "mirror:/loras/sql/", "rank": 16},
        {"name": "acme-tone", "base": "llama-8b", "source": "/loras/tone.gguf", "scale": 0.5,
         "tenants": ["acme", "globex"]},
    ],
}  # fmt: skip


def _write(path: Path, data: dict[str, Any]) -> Path:
    with path.open("w") as f:
        YAML(typ="safe", pure=True).dump(data, f)
    return path


def test_a_server_yaml_with_adapters_loads_as_llmgw_cp_loads_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "server.yaml", SERVER)
    cfg, catalog, _router, _hashes = load_server(path, check_tls=False)
    assert len(cfg.adapters) == 2  # the settings take the key; the catalog reads it
    cat = catalog.catalog
    assert catalog.adapters == cat.adapters
    assert cat.adapters == (
        CatalogAdapter(name="sql-lora", base="llama-8b", source="mirror:/loras/sql/", rank=16),
        CatalogAdapter(name="acme-tone", base="llama-8b", source="/loras/tone.gguf", scale=0.5,
                       tenants=["acme", "globex"]),
    )  # fmt: skip
    assert cat.adapter("acme-tone") is cat.adapters[1] and cat.adapter("llama") is None
    assert [a.name for a in cat.adapters_of("llama-8b")] == ["sql-lora", "acme-tone"]
    assert cat.adapters_of("qwen") == () and cat.adapters_of("nope") == ()
    llama = cat.models[0]
    vllm, cpu = (_catalog.engine_profile(llama, p) for p in llama.profiles)
    assert (vllm.max_adapters, vllm.max_adapter_rank) == (4, 64)
    assert (cpu.max_adapters, cpu.max_adapter_rank) == (2, None)
    assert cat.weight_sources() == [
        ("llama-8b", "mirror:/llama-8b/"),
        ("qwen", "Qwen/Qwen2.5-7B-Instruct"),
        ("sql-lora (adapter of llama-8b)", "mirror:/loras/sql/"),
        ("acme-tone (adapter of llama-8b)", "/loras/tone.gguf"),
    ]


def test_a_server_yaml_with_bad_adapters_is_refused_naming_each(tmp_path: Path) -> None:
    bad = {**SERVER, "adapters": [
        {"name": "sql-lora", "base": "qwen", "source": "mirror:/loras/sql/"},
        {"name": "llama", "base": "llama-8b", "source": "mirror:/x/", "rank": 128},
    ]}  # fmt: skip
    path = _write(tmp_path / "server.yaml", bad)
    with pytest.raises(ConfigError) as info:
        load_server(path, check_tls=False)
    assert str(info.value).splitlines() == [
        f"{path}: adapters[0].base: model 'qwen' takes no adapters: none of its profiles sets "
        "max_adapters; set models[1].profiles[N].max_adapters (how many adapters one replica "
        "holds at once)",
        f"{path}: adapters[1].name: 'llama' is also a served name of model 'llama-8b'; {RENAME}",
        f"{path}: adapters[1].rank: 128 is above models[0].profiles[0].max_adapter_rank (64); "
        "raise max_adapter_rank there, or use an adapter of that rank or less",
    ]


# --- fingerprints -----------------------------------------------------------------------------

LLAMA = CatalogModel(name="llama-8b", source="mirror:/llama-8b/", served_names=["llama"],
                     profiles=[Profile(engine="vllm", gpu_class="h100-80g", gpus_per_node=1)])  # fmt: skip
# Obtained on main at 8afcd23 (before the adapter keys existed) with
#   Catalog(models=(LLAMA,)).fingerprint(LLAMA, LLAMA.profiles[0])
# for exactly the model above: a fleet without adapters must keep it (no roll on upgrade).
LLAMA_FINGERPRINT = "525e12b8c72c1f85"


def test_a_profile_without_adapter_keys_keeps_its_fingerprint() -> None:
    assert Catalog(models=(LLAMA,)).fingerprint(LLAMA, LLAMA.profiles[0]) == LLAMA_FINGERPRINT
    # As the file gives it, too (the keys absent, not null-valued by the loader).
    data = {"name": "llama-8b", "source": "mirror:/llama-8b/", "served_names": ["llama"],
            "profiles": [{"engine": "vllm", "gpu_class": "h100-80g", "gpus_per_node": 1}]}  # fmt: skip
    cat = parse({"models": [data]}, "s")
    assert cat.fingerprints(cat.models[0]) == (LLAMA_FINGERPRINT,)


def test_setting_max_adapters_or_the_rank_changes_the_fingerprint() -> None:
    def fp(**keys: Any) -> str:
        p = Profile(engine="vllm", gpu_class="h100-80g", gpus_per_node=1, **keys)
        return _catalog.fingerprint(LLAMA, p)

    seen = {fp(), fp(max_adapters=4), fp(max_adapters=8), fp(max_adapters=4, max_adapter_rank=64)}
    assert len(seen) == 4 and LLAMA_FINGERPRINT in seen


def test_adapters_never_change_a_fingerprint() -> None:
    base = {**BASE, "profiles": [TAKES, PLAIN]}
    without = parse({"models": [base]}, "s")
    fps = without.fingerprints(without.models[0])
    for adapters in ([adapter()], [adapter(), adapter(name="b", scale=2.0, rank=4,
                                                        tenants=["t"])]):  # fmt: skip
        with_them = parse({"models": [base], "adapters": adapters}, "s")
        assert with_them.adapters and with_them.fingerprints(with_them.models[0]) == fps


async def test_a_reload_that_adds_an_adapter_is_a_change_that_rolls_nothing(tmp_path: Path) -> None:
    path = _write(tmp_path / "server.yaml", {**SERVER, "adapters": []})
    file = CatalogFile(path, _catalog_file.read(path))
    fps = file.catalog.fingerprints(file.catalog.models[0])
    changes: list[int] = []
    _write(path, SERVER)
    assert await file.reload("test", on_change=lambda: changes.append(1))
    assert changes == [1]  # the router and the adapter manager must hear of it
    assert [a.name for a in file.adapters] == ["sql-lora", "acme-tone"]
    assert file.catalog.fingerprints(file.catalog.models[0]) == fps
    assert await file.reload("again", on_change=lambda: changes.append(2))
    assert changes == [1]  # nothing changed: no call
    _write(path, {**SERVER, "adapters": [{"name": "x", "base": "qwen", "source": "/x"}]})
    assert not await file.reload("bad", on_change=lambda: changes.append(3))
    assert changes == [1] and [a.name for a in file.adapters] == ["sql-lora", "acme-tone"]
