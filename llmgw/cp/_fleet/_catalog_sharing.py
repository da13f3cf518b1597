"""A profile's share of a card: `gpu_memory_gib` (GiB of each card) or `mig` (a MIG instance).

    profiles:
      - engine: vllm
        gpu_class: h100-80g
        gpu_memory_gib: 20      # this much of each card; the rest is for other replicas
      - engine: vllm
        gpu_class: a100-80g
        mig: 3g.40gb            # one MIG instance of this profile instead of a card

Read with the catalog (llmgw/cp/_fleet/_catalog.py), every error naming its path.
Placement picks the card (core placement); the engine is then told its share as a
fraction of that card (`engines.memory_fraction`, from the card's real size).
Both keys enter a profile's fingerprint only once set, so a catalog without them
keeps its fingerprints.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.cp._fleet._catalog import Profile

# nvidia-smi's MIG profile names: compute slices "g", memory "gb", "+me" with the media
# engines (`nvidia-smi mig -lgip`: 1g.10gb, 1g.10gb+me, 3g.40gb, 7g.80gb).
_MIG = re.compile(r"^(\d+)g\.(\d+)gb(\+me)?$")
_CLASS_GIB = re.compile(r"-(\d+)g$")  # a class names its card's size: h100-80g


def class_gib(gpu_class: str | None) -> int | None:
    """The card size a class names (h100-80g: 80), or None when it names none."""
    found = _CLASS_GIB.search(gpu_class or "")
    return int(found.group(1)) if found else None


def mig_gb(profile: str) -> int | None:
    """The memory a MIG profile names (3g.40gb: 40), or None when it is not one."""
    found = _MIG.match(profile)
    return int(found.group(2)) if found else None


def sharing_problems(p: Profile, where: str) -> list[str]:
    """Every problem of `p`'s `gpu_memory_gib` and `mig`, each naming its path."""
    gib, mig = p.gpu_memory_gib, p.mig
    if gib is None and mig is None:
        return []
    if gib is not None and mig is not None:
        return [
            f"{where}: gpu_memory_gib and mig are both set: a replica takes either a share "
            "of a card (gpu_memory_gib) or a MIG instance (mig), not both: keep one"
        ]
    if p.gpu_class is None:
        key = "gpu_memory_gib" if gib is not None else "mig"
        return [
            f"{where}.{key}: set, but the profile has no gpu_class (it runs on CPU): "
            f"name the class of the card to share (e.g. gpu_class: h100-80g), or leave "
            f"{key} out"
        ]
    size = class_gib(p.gpu_class)
    if gib is not None:
        return _gib_problems(gib, p.gpu_class, size, where)
    assert mig is not None
    return _mig_problems(p, mig, size, where)


def _gib_problems(gib: float, gpu_class: str, size: int | None, where: str) -> list[str]:
    if not (math.isfinite(gib) and gib > 0):
        return [f"{where}.gpu_memory_gib: {gib!r}: must be above 0 (GiB of each card)"]
    if size is not None and gib > size:
        return [
            f"{where}.gpu_memory_gib: {gib!r} is more than a {gpu_class} card holds "
            f"({size} GiB): ask for at most {size}, or leave gpu_memory_gib out for whole cards"
        ]
    if size is not None and gib * 100 < size:
        return [
            f"{where}.gpu_memory_gib: {gib!r} is under 1% of a {gpu_class} card ({size} GiB): "
            f"the engines take a share in hundredths of the card: ask for at least {size / 100}"
        ]
    return []


def _mig_problems(p: Profile, mig: str, size: int | None, where: str) -> list[str]:
    gb = mig_gb(mig)
    if gb is None:
        return [
            f"{where}.mig: {mig!r} is not a MIG profile: write it as nvidia-smi names it, "
            "e.g. 1g.10gb, 3g.40gb, 1g.10gb+me"
        ]
    problems: list[str] = []
    if p.cards > 1 or p.nodes > 1:
        problems.append(
            f"{where}.mig: {mig!r} with gpus_per_node {p.cards} and nodes {p.nodes}: CUDA "
            "does not run tensor parallelism across MIG instances (a process sees one); a "
            "MIG profile runs on one instance: gpus_per_node 1, nodes 1"
        )
    if size is not None and gb > size:
        problems.append(
            f"{where}.mig: {mig!r} holds {gb} GB, more than a {p.gpu_class} card "
            f"({size} GiB): pick a profile the card offers (nvidia-smi mig -lgip)"
        )
    return problems
