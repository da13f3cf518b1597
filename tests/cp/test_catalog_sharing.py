"""The profile keys `gpu_memory_gib` and `mig` (llmgw/cp/_fleet/_catalog_sharing.py):
every error exact, with its path, all at once; what a valid share looks like once
loaded; fingerprints that do not move for a catalog without the keys, and move
when they are set."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.cp._fleet import _catalog
from llmgw.cp._fleet._catalog import engine_profile, parse
from llmgw.errors import ConfigError

VLLM = {"engine": "vllm", "gpu_class": "h100-80g"}
WHERE = "models[0].profiles[0]"


def model(*profiles: dict[str, Any]) -> dict[str, Any]:
    return {"name": "qwen", "source": "Qwen/Qwen2.5-7B-Instruct", "profiles": list(profiles)}


def errors(*profiles: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse({"models": [model(*profiles)]}, "server.yaml")
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ({**VLLM, "gpu_memory_gib": 20, "mig": "3g.40gb"},
         f"{WHERE}: gpu_memory_gib and mig are both set: a replica takes either a share of a "
         "card (gpu_memory_gib) or a MIG instance (mig), not both: keep one"),
        ({**VLLM, "gpu_memory_gib": 0},
         f"{WHERE}.gpu_memory_gib: 0.0: must be above 0 (GiB of each card)"),
        ({**VLLM, "gpu_memory_gib": -4},
         f"{WHERE}.gpu_memory_gib: -4.0: must be above 0 (GiB of each card)"),
        ({**VLLM, "gpu_memory_gib": float("nan")},
         f"{WHERE}.gpu_memory_gib: nan: must be above 0 (GiB of each card)"),
        ({**VLLM, "gpu_memory_gib": 90},
         f"{WHERE}.gpu_memory_gib: 90.0 is more than a h100-80g card holds (80 GiB): ask for "
         "at most 80, or leave gpu_memory_gib out for whole cards"),
        ({**VLLM, "gpu_memory_gib": 0.5},
         f"{WHERE}.gpu_memory_gib: 0.5 is under 1% of a h100-80g card (80 GiB): the engines "
         "take a share in hundredths of the card: ask for at least 0.8"),
        ({"engine": "llama-server", "gpus_per_node": 0, "gpu_memory_gib": 8},
         f"{WHERE}.gpu_memory_gib: set, but the profile has no gpu_class (it runs on CPU): name "
         "the class of the card to share (e.g. gpu_class: h100-80g), or leave gpu_memory_gib out"),
        ({"engine": "llama-server", "gpus_per_node": 0, "mig": "1g.10gb"},
         f"{WHERE}.mig: set, but the profile has no gpu_class (it runs on CPU): name the class "
         "of the card to share (e.g. gpu_class: h100-80g), or leave mig out"),
        ({**VLLM, "mig": "3g40gb"},
         f"{WHERE}.mig: '3g40gb' is not a MIG profile: write it as nvidia-smi names it, e.g. "
         "1g.10gb, 3g.40gb, 1g.10gb+me"),
        ({**VLLM, "mig": "MIG 3g.40gb"},
         f"{WHERE}.mig: 'MIG 3g.40gb' is not a MIG profile: write it as nvidia-smi names it, "
         "e.g. 1g.10gb, 3g.40gb, 1g.10gb+me"),
        ({**VLLM, "mig": "3g.40gb", "gpus_per_node": 2},
         f"{WHERE}.mig: '3g.40gb' with gpus_per_node 2 and nodes 1: CUDA does not run tensor "
         "parallelism across MIG instances (a process sees one); a MIG profile runs on one "
         "instance: gpus_per_node 1, nodes 1"),
        ({**VLLM, "mig": "7g.80gb", "nodes": 2, "fabric": "ib"},
         f"{WHERE}.mig: '7g.80gb' with gpus_per_node 1 and nodes 2: CUDA does not run tensor "
         "parallelism across MIG instances (a process sees one); a MIG profile runs on one "
         "instance: gpus_per_node 1, nodes 1"),
        ({**VLLM, "mig": "4g.96gb"},
         f"{WHERE}.mig: '4g.96gb' holds 96 GB, more than a h100-80g card (80 GiB): pick a "
         "profile the card offers (nvidia-smi mig -lgip)"),
    ],
)  # fmt: skip
def test_each_error(profile: dict[str, Any], expected: str) -> None:
    assert errors(profile) == [f"server.yaml: {expected}"]


def test_every_problem_at_once_each_with_its_path() -> None:
    found = errors(
        {**VLLM, "gpu_memory_gib": 90},
        {**VLLM, "mig": "big"},
        {**VLLM, "mig": "2g.20gb", "gpus_per_node": 4, "tp": 4},
    )
    assert [line.split(": ", 2)[1] for line in found] == [
        "models[0].profiles[0].gpu_memory_gib",
        "models[0].profiles[1].mig",
        "models[0].profiles[2].mig",
    ]


def test_a_string_where_a_number_belongs_is_named() -> None:
    found = errors({**VLLM, "gpu_memory_gib": "twenty"})
    assert len(found) == 1 and "models[0].profiles[0].gpu_memory_gib" in found[0]


@pytest.mark.parametrize(
    "keys",
    [
        {"gpu_memory_gib": 20},
        {"gpu_memory_gib": 80},  # the whole class: allowed
        {"gpu_memory_gib": 0.8},  # 1% of it: the least an engine flag can say
        {"gpu_memory_gib": 20, "gpus_per_node": 2},  # a share of each of two cards
        {"mig": "3g.40gb"},
        {"mig": "1g.10gb+me"},
        {"mig": "7g.80gb"},
    ],
)
def test_valid_shares(keys: dict[str, Any]) -> None:
    cat = parse({"models": [model({**VLLM, **keys})]}, "server.yaml")
    (p,) = cat.models[0].profiles
    assert (p.gpu_memory_gib, p.mig) == (keys.get("gpu_memory_gib"), keys.get("mig"))


def test_the_engine_profile_gets_the_fraction_only_from_the_placement() -> None:
    cat = parse({"models": [model({**VLLM, "gpu_memory_gib": 20})]}, "server.yaml")
    m = cat.models[0]
    assert engine_profile(m, m.profiles[0]).gpu_memory_fraction is None
    placed = engine_profile(m, m.profiles[0], gpu_memory_fraction=0.25)
    assert placed.gpu_memory_fraction == 0.25


# --- fingerprints -----------------------------------------------------------------------------

# Obtained at 9fec6fc (before gpu_memory_gib and mig existed) by parsing exactly OLD below
# and printing `cat.fingerprints(cat.models[0])`: a catalog without the keys keeps them.
OLD = model(
    {**VLLM, "gpus_per_node": 2, "engine_args": ["--max-model-len", "8192"], "max_adapters": 4,
     "max_adapter_rank": 64},
    {"engine": "sglang", "gpu_class": "l40s-45g"},
    {"engine": "llama-server", "gpus_per_node": 0},
)  # fmt: skip
OLD_FINGERPRINTS = ("caa9c2dc1753170b", "29a023adac957816", "15fdf2994eb42469")


def test_a_catalog_without_the_keys_keeps_its_fingerprints() -> None:
    cat = parse({"models": [OLD]}, "server.yaml")
    assert cat.fingerprints(cat.models[0]) == OLD_FINGERPRINTS
    nulls = model(*({**p, "gpu_memory_gib": None, "mig": None} for p in OLD["profiles"]))
    cat = parse({"models": [nulls]}, "server.yaml")
    assert cat.fingerprints(cat.models[0]) == OLD_FINGERPRINTS  # null is absent


def test_setting_a_share_changes_the_fingerprint() -> None:
    def fp(**keys: Any) -> str:
        cat = parse({"models": [model({**VLLM, **keys})]}, "server.yaml")
        return _catalog.fingerprint(cat.models[0], cat.models[0].profiles[0])

    seen = [
        fp(),
        fp(gpu_memory_gib=20),
        fp(gpu_memory_gib=40),
        fp(mig="3g.40gb"),
        fp(mig="1g.10gb"),
    ]
    assert len(set(seen)) == len(seen)
    assert fp(gpu_memory_gib=20) == fp(gpu_memory_gib=20.0)  # the same share, written as a float
