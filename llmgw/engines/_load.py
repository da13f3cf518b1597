"""An engine's load, read through its metric names (pure).

Engines name the same figures differently, and rename them between versions
(see `MetricNames`). This turns a `/metrics` page (Prometheus text format),
and llama.cpp's `GET /slots`, into one `EngineLoad`. A figure the page does
not carry is None (unknown), never 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from llmgw.engines._types import MetricNames


@attrs.frozen
class EngineLoad:
    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0..1
    generated: float | None = None  # tokens generated since the engine started


def parse_samples(text: str) -> dict[str, float]:
    """Sum of every sample per metric name; lines that do not parse are skipped.

    A page is outside input: one odd line must not cost the whole reading.
    """
    sums: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            labels_end = rest.rfind("}")
            if labels_end < 0:
                continue
            fields = rest[labels_end + 1 :].split()
        else:
            name, *fields = line.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value) or math.isinf(value):
            continue
        sums[name.strip()] = sums.get(name.strip(), 0.0) + value
    return sums


def parse_load(text: str, names: MetricNames) -> EngineLoad:
    samples = parse_samples(text)
    kv = None
    for name in (names.kv_usage, names.kv_usage_fallback):
        if name is not None and name in samples:
            kv = samples[name]
            break
    generated = samples.get(names.generated) if names.generated is not None else None
    return EngineLoad(samples.get(names.running), samples.get(names.waiting), kv, generated)


def slots_usage(slots: Any) -> float | None:
    """Busy share of llama.cpp's slots (its KV gauge was removed upstream).

    Each slot owns a fixed part of the KV cache, so the share of slots that
    are processing is the share of KV in use at slot granularity.
    """
    if not isinstance(slots, Sequence) or isinstance(slots, str | bytes) or not slots:
        return None
    busy = 0
    for slot in slots:
        if not isinstance(slot, dict) or not isinstance(slot.get("is_processing"), bool):
            return None
        busy += slot["is_processing"]
    return busy / len(slots)
