"""A share of a card: how much of each card's memory a replica may use, per engine.

When placement puts several replicas on one card, each gets
`EngineProfile.gpu_memory_fraction` (0 < f <= 1: its share of each of its
cards) and the engine is told to stay within it:

- vLLM: `--gpu-memory-utilization F` (vllm/config/cache.py,
  `CacheConfig.gpu_memory_utilization`, `Field(default=0.9, gt=0, le=1)`):
  "the fraction of GPU memory to be used for the model executor ... a
  per-instance limit ... if you have two vLLM instances running on the same
  GPU, you can set the GPU memory utilization to 0.5 for each instance". It is
  a fraction of the card's *total* memory, which is exactly what a share is.
  vLLM checks at start that the card has that much free and refuses to start
  otherwise ("Free memory on device ... on startup is less than desired GPU
  memory utilization", as vLLM 0.9.1 reports it: vllm-project/vllm#20305), so a
  share that another process took is reported, never silently shrunk.
- SGLang: `--mem-fraction-static F` (python/sglang/srt/server_args.py: "the
  fraction of the memory used for static allocation (model weights and KV
  cache memory pool)"). In SGLang v0.5.8 (model_runner_kv_cache_mixin.py,
  `profile_max_num_token`) the KV pool is what is free after the weights load
  less `total * (1 - F)`, where `total` is the memory that was *free* when it
  started (`torch.cuda.mem_get_info`), not the card's size: weights + KV
  pool = F x free-at-start. With F computed against the whole card, SGLang
  therefore stays within its share, and takes less than it when the card
  already holds other replicas. Activations and CUDA graphs come on top, from
  the remaining (1 - F): the headroom placement keeps on a shared card.
- llama-server has no option that holds it to a memory budget. Its `--fit`
  (on by default) shrinks the unset context size and layer count until its
  projected use fits the device's *free* memory at start less
  `--fit-target MiB` (a margin left free, default 1024); turning a share into
  that margin needs the free memory at the moment it starts, which a plan
  cannot know. So llmgw writes nothing for it: it gets its cards through
  CUDA_VISIBLE_DEVICES like any replica, its share is what placement reserves
  for it, and only the agent's watch enforces it. On a shared card give it an
  explicit `--ctx-size` (or `--fit-target`) in engine_args, or `--fit` may
  grow it into memory meant for the next replica.
"""

from __future__ import annotations

import math
from fractions import Fraction

from llmgw.engines._common import owned_conflicts
from llmgw.engines._types import EngineProfile

# The flag that carries the share, per engine (llama-server: none, see above).
FLAGS: dict[str, str] = {
    "vllm": "--gpu-memory-utilization",
    "sglang": "--mem-fraction-static",
}
_MIB_PER_GIB = 1024


def memory_args(profile: EngineProfile) -> list[str]:
    """The engine's flag and value for the profile's share; [] for whole cards."""
    flag = FLAGS.get(profile.engine)
    if flag is None or profile.gpu_memory_fraction is None:
        return []
    return [flag, fraction_text(profile.gpu_memory_fraction)]


def fraction_text(fraction: float) -> str:
    """The fraction as written on a command line: the shortest text that reads back
    as the same float, so nothing is rounded up past the share."""
    return repr(float(fraction))


def memory_problems(profile: EngineProfile) -> list[str]:
    """Whether `gpu_memory_fraction` is a share of a card this profile can take."""
    fraction = profile.gpu_memory_fraction
    if fraction is None:
        return []
    problems: list[str] = []
    if isinstance(fraction, bool) or not (math.isfinite(fraction) and 0 < fraction <= 1):
        problems.append(
            f"gpu_memory_fraction {fraction!r} is not a share of a card: it must be above 0 "
            "and at most 1"
        )
    if profile.gpu_class is None:
        problems.append(
            f"gpu_memory_fraction {fraction!r} is a share of a card, but the profile runs on "
            "CPU (no gpu_class): leave it out"
        )
    flag = FLAGS.get(profile.engine)
    if flag is not None:
        vllm = profile.engine == "vllm"  # vLLM also takes --gpu_memory_utilization
        for found in owned_conflicts(profile.engine_args, frozenset({flag}), underscores=vllm):
            problems.append(
                f"engine_args sets {found}, which llmgw sets itself for gpu_memory_fraction "
                f"{fraction!r}: remove it"
            )
    return problems


def memory_fraction(gpu_memory_gib: float, card_memory_mib: int) -> float:
    """The share of a card of `card_memory_mib` MiB that `gpu_memory_gib` GiB is, as an
    engine takes it: rounded down to hundredths (never more than asked for), at most 1
    (a share as large as the card is the whole card).

    Exact: the GiB are read as the decimal the operator wrote (0.3, not the binary
    float nearest to it), so 40 GiB of an 80 GiB card is 0.5, not 0.49. Raises
    ValueError, naming the values, when either is not positive or the share is
    under one hundredth of the card (no engine flag could express it).
    """
    if not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise ValueError(f"gpu_memory_gib {gpu_memory_gib!r} must be above 0")
    if card_memory_mib <= 0:
        raise ValueError(f"card_memory_mib {card_memory_mib!r} must be above 0")
    share = Fraction(repr(float(gpu_memory_gib))) * _MIB_PER_GIB / card_memory_mib
    hundredths = min(100, math.floor(share * 100))
    if hundredths < 1:
        least = math.ceil(card_memory_mib / 100 / _MIB_PER_GIB * 100) / 100
        raise ValueError(
            f"gpu_memory_gib {gpu_memory_gib!r} is under 1% of a {card_memory_mib} MiB card; "
            f"the engines take a share in hundredths of the card: ask for at least {least} GiB"
        )
    return hundredths / 100
