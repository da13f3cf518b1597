"""Pure decisions: plain values in, decisions out; no trio, capnp, HTTP or filesystem."""

from llmgw.core._liveness import (
    ConnectionLost,
    Event,
    HeartbeatSeen,
    Liveness,
    LivenessPolicy,
    NodeState,
    Registered,
    Tick,
    registered,
    step,
)

__all__ = [
    "ConnectionLost",
    "Event",
    "HeartbeatSeen",
    "Liveness",
    "LivenessPolicy",
    "NodeState",
    "Registered",
    "Tick",
    "registered",
    "step",
]
