"""Autoscaling: a window of load samples -> a model's desired replica count.

(Types only so far: the decision `autoscale()` lands with its properties.)
"""

from __future__ import annotations

import attrs


@attrs.frozen
class AutoscalePolicy:
    """A model's `autoscale:` in the catalog, validated (llmgw/cp/_fleet/_catalog.py)."""

    min: int = 0
    max: int = 1
    # Targets: None = not used; at least one is set. Demand = requests queued + in flight.
    requests_per_replica: float | None = 4.0
    ttft_p90_s: float | None = None
    window_s: float = 30.0  # the samples a decision reads
    scale_down_after_s: float = 300.0  # the load must have asked for fewer this long
    max_step_up: int = 4  # replicas added by one decision at most
    up_cooldown_s: float = 10.0  # between two raises (the first raise from zero: none)
    down_cooldown_s: float = 30.0  # between two lowerings (one replica each)
    predict_s: float = 60.0  # how far ahead a rising trend is projected (~ the start time)
    hold_max: int = 64  # requests held at zero replicas, beyond that 503
    hold_s: float = 180.0  # how long one is held at most


@attrs.frozen
class AutoscaleState:
    """What a model's autoscaler remembers between decisions (the shell keeps it)."""

    desired: int
    changed_at: float | None = None  # the last change of `desired`
    raised_at: float | None = None  # the last raise
    low_since: float | None = None  # since when the load has asked for fewer than desired


@attrs.frozen
class AutoscaleDecision:
    desired: int
    state: AutoscaleState
    rule: str  # what set it: see RULES
    signal: str  # the figure it read, in words: "5.2 requests per replica over 30 s (target 4)"
    reason: str  # one line for `ctl status` and the event: the rule and the signal


RULES = (
    "steady",  # within the targets: unchanged
    "target",  # demand per replica over the target: raised
    "ttft",  # TTFT p90 over its target with requests waiting: raised
    "rejected",  # requests refused for capacity: raised
    "trend",  # the rising trend projected predict_s ahead: raised (never lowers)
    "from-zero",  # demand at zero replicas: one at once
    "scale-down",  # the load asked for fewer for scale_down_after_s: lowered by one
    "cooldown",  # a change is due but its cooldown holds it
    "min",  # clamped to min
    "max",  # clamped to max
)
