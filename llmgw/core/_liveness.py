"""Node liveness: ready -> unreachable -> lost, as a pure state machine.

Events and a clock value in, the next state and the reason out. No I/O: the
control plane feeds it registrations, heartbeats, lost connections and clock
ticks, and logs every change with its reason.

| state       | register | heartbeat          | disconnect  | tick                       |
|-------------|----------|--------------------|-------------|----------------------------|
| ready       | ready    | ready              | unreachable | unreachable after `missed` |
| unreachable | ready    | ready if connected | unreachable | lost after `lost_after_s`  |
| lost        | ready    | ready if connected | lost        | lost                       |
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


def step(live: Liveness, event: Event, policy: LivenessPolicy) -> Liveness:
    """The node's liveness after `event`. A changed `state` comes with a new `reason`."""
    if isinstance(event, Registered):
        return registered(event.now)
    if isinstance(event, HeartbeatSeen):
        if not live.connected:
            return live  # a late heartbeat from a closed session proves nothing
        if live.state is NodeState.READY:
            return attrs.evolve(live, last_seen=event.now)
        return Liveness(NodeState.READY, event.now, "heartbeats resumed", event.now, True)
    if isinstance(event, ConnectionLost):
        if live.state is NodeState.READY:
            return Liveness(
                NodeState.UNREACHABLE, event.now, "connection lost", live.last_seen, False
            )
        return attrs.evolve(live, connected=False)
    # Tick
    now = event.now
    silent = now - live.last_seen
    if live.state is NodeState.READY and silent > policy.silence_limit_s:
        return Liveness(
            NodeState.UNREACHABLE,
            now,
            f"missed {policy.missed_heartbeats} heartbeats (last seen {silent:.0f} s ago)",
            live.last_seen,
            live.connected,
        )
    if live.state is NodeState.UNREACHABLE and now - live.since >= policy.lost_after_s:
        return Liveness(
            NodeState.LOST,
            now,
            f"unreachable for {now - live.since:.0f} s ({live.reason})",
            live.last_seen,
            live.connected,
        )
    return live
