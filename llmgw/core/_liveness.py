"""Node liveness: ready -> unreachable -> lost, as a pure state machine.

Events and a clock value in, the next state and the reason out. No I/O: the
control plane feeds it registrations, heartbeats, lost connections and clock
ticks, and logs every change with its reason.

Each input is first classified into a `LivenessEvent` (the guards: whether the
session is connected, how long the node has been silent, how long it has been
unreachable), then looked up in `TRANSITIONS`; a pair missing from the table
is invalid and raises.

| event          | ready       | unreachable | lost  |
|----------------|-------------|-------------|-------|
| REGISTER       | ready       | ready       | ready |
| HEARTBEAT      | ready       | ready       | ready |
| LATE_HEARTBEAT | -           | unreachable | lost  |
| DISCONNECT     | unreachable | unreachable | lost  |
| TICK           | ready       | unreachable | lost  |
| MISSED         | unreachable | -           | -     |
| LOST_AFTER     | -           | lost        | -     |

- REGISTER: `Registered`; the node starts again from `registered(now)`,
  whatever it was (in ready too: `since` and the reason are new).
- HEARTBEAT: `HeartbeatSeen` while connected; it sets `last_seen`.
- LATE_HEARTBEAT: `HeartbeatSeen` after the connection was lost: a late
  heartbeat from a closed session proves nothing, and changes nothing. A ready
  node is always connected (losing the connection makes it unreachable), so
  the pair with ready cannot happen.
- DISCONNECT: `ConnectionLost`; the node is no longer connected.
- MISSED: `Tick` in ready once the node has been silent for longer than
  `missed_heartbeats` intervals (`silence_limit_s`).
- LOST_AFTER: `Tick` in unreachable once it has been unreachable for
  `lost_after_s`.
- TICK: any other `Tick`.
"""

from __future__ import annotations

import enum

import attrs


class NodeState(enum.StrEnum):
    READY = "ready"
    UNREACHABLE = "unreachable"
    LOST = "lost"


@attrs.frozen
class LivenessPolicy:
    heartbeat_interval_s: float = 5.0
    missed_heartbeats: int = 3
    lost_after_s: float = 60.0

    @property
    def silence_limit_s(self) -> float:
        return self.heartbeat_interval_s * self.missed_heartbeats


@attrs.frozen
class Liveness:
    state: NodeState
    since: float  # clock value of the last state change
    reason: str
    last_seen: float  # clock value of the last registration or heartbeat
    connected: bool


@attrs.frozen
class Registered:
    now: float


@attrs.frozen
class HeartbeatSeen:
    now: float


@attrs.frozen
class ConnectionLost:
    now: float


@attrs.frozen
class Tick:
    now: float


Event = Registered | HeartbeatSeen | ConnectionLost | Tick


def registered(now: float) -> Liveness:
    """The liveness of a node that has just registered."""
    return Liveness(NodeState.READY, now, "registered", now, connected=True)


class LivenessEvent(enum.StrEnum):
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    LATE_HEARTBEAT = "late_heartbeat"
    DISCONNECT = "disconnect"
    TICK = "tick"
    MISSED = "missed"
    LOST_AFTER = "lost_after"


_S = NodeState
_E = LivenessEvent

# (state, event) -> next state; the module docstring's table, as data.
TRANSITIONS: dict[tuple[NodeState, LivenessEvent], NodeState] = {
    (_S.READY, _E.REGISTER): _S.READY,
    (_S.READY, _E.HEARTBEAT): _S.READY,
    (_S.READY, _E.DISCONNECT): _S.UNREACHABLE,
    (_S.READY, _E.TICK): _S.READY,
    (_S.READY, _E.MISSED): _S.UNREACHABLE,
    (_S.UNREACHABLE, _E.REGISTER): _S.READY,
    (_S.UNREACHABLE, _E.HEARTBEAT): _S.READY,
    (_S.UNREACHABLE, _E.LATE_HEARTBEAT): _S.UNREACHABLE,
    (_S.UNREACHABLE, _E.DISCONNECT): _S.UNREACHABLE,
    (_S.UNREACHABLE, _E.TICK): _S.UNREACHABLE,
    (_S.UNREACHABLE, _E.LOST_AFTER): _S.LOST,
    (_S.LOST, _E.REGISTER): _S.READY,
    (_S.LOST, _E.HEARTBEAT): _S.READY,
    (_S.LOST, _E.LATE_HEARTBEAT): _S.LOST,
    (_S.LOST, _E.DISCONNECT): _S.LOST,
    (_S.LOST, _E.TICK): _S.LOST,
}


class InvalidTransition(ValueError):
    """A (state, event) pair that is not in `TRANSITIONS`: a bug in the caller of `next_state`."""


def next_state(state: NodeState, event: LivenessEvent) -> NodeState:
    """The table lookup; raises `InvalidTransition` for a pair not in the table."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(
            f"event {event.value!r} is not valid in node state {state.value!r}"
        ) from None


def classify(live: Liveness, event: Event, policy: LivenessPolicy) -> LivenessEvent:
    """The table's event for `event`: the guards of the module docstring, applied."""
    if isinstance(event, Registered):
        return LivenessEvent.REGISTER
    if isinstance(event, HeartbeatSeen):
        return LivenessEvent.HEARTBEAT if live.connected else LivenessEvent.LATE_HEARTBEAT
    if isinstance(event, ConnectionLost):
        return LivenessEvent.DISCONNECT
    if live.state is NodeState.READY and event.now - live.last_seen > policy.silence_limit_s:
        return LivenessEvent.MISSED
    if live.state is NodeState.UNREACHABLE and event.now - live.since >= policy.lost_after_s:
        return LivenessEvent.LOST_AFTER
    return LivenessEvent.TICK


def step(live: Liveness, event: Event, policy: LivenessPolicy) -> Liveness:
    """The node's liveness after `event`. A changed `state` comes with a new `reason`."""
    kind = classify(live, event, policy)
    after = next_state(live.state, kind)
    now = event.now
    if kind is LivenessEvent.REGISTER:
        return registered(now)
    last_seen = now if kind is LivenessEvent.HEARTBEAT else live.last_seen
    connected = live.connected and kind is not LivenessEvent.DISCONNECT
    if after is live.state:
        if (last_seen, connected) == (live.last_seen, live.connected):
            return live
        return attrs.evolve(live, last_seen=last_seen, connected=connected)
    return Liveness(after, now, _reason(kind, live, now, policy), last_seen, connected)


def _reason(kind: LivenessEvent, live: Liveness, now: float, policy: LivenessPolicy) -> str:
    """Why `kind` changed the state of a node whose liveness was `live`."""
    if kind is LivenessEvent.HEARTBEAT:
        return "heartbeats resumed"
    if kind is LivenessEvent.DISCONNECT:
        return "connection lost"
    if kind is LivenessEvent.MISSED:
        silent = now - live.last_seen
        return f"missed {policy.missed_heartbeats} heartbeats (last seen {silent:.0f} s ago)"
    assert kind is LivenessEvent.LOST_AFTER, f"{kind.value!r} changes no state"
    return f"unreachable for {now - live.since:.0f} s ({live.reason})"
