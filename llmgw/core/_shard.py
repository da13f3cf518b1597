"""A shard's states, as a table; and how health checks become events.

Pure: no trio, no processes, no HTTP. The supervisor classifies what it
observed into a `ShardEvent` (with `HealthRun` for health checks), looks the
pair up in `TRANSITIONS`, and then performs what the new state needs; a pair
missing from the table is a bug in the supervisor and raises.

| event        | starting | loading   | ready     | unhealthy | failed  | stopped |
|--------------|----------|-----------|-----------|-----------|---------|---------|
| LAUNCHED     | loading  | -         | -         | -         | -       | -       |
| HEALTHY      | -        | ready     | ready     | ready     | -       | -       |
| CHECK_FAILED | -        | loading   | ready     | -         | -       | -       |
| HEALTH_LOST  | -        | unhealthy | unhealthy | unhealthy | -       | -       |
| EXITED       | failed   | failed    | failed    | failed    | -       | -       |
| STOP         | stopped  | stopped   | stopped   | stopped   | stopped | -       |
| RELAUNCHED   | starting | starting  | starting  | starting  | -       | -       |

- LAUNCHED: every process was spawned and every port waited for is open.
- HEALTHY: a health check passed (`/health` answered 200 and `/v1/models`
  lists a served name; a rank that serves no HTTP: it stayed alive).
- CHECK_FAILED: a health check failed, and either fewer than `threshold` in
  a row have, or the shard has never been ready (an engine loading its
  weights fails every check, and that is not news).
- HEALTH_LOST: the check that makes `threshold` failures in a row of a shard
  that has been ready (or was ready before the agent restarted), and every
  later failure in that run.
- EXITED: a process exited, was killed, or could not be started.
- STOP: the shard was stopped on request; from failed it is the operator or
  the control plane clearing it away.
- RELAUNCHED: a running shard's processes were stopped to start it again
  from a spec that differs only in its LoRA adapters (`relaunchShard`): the
  same shard, starting again, not a stop and a new start.

A failed or stopped shard has no way back: a restart is a new start.

A shard enters the table at starting, when it is started; a shard adopted by
a restarted agent enters at loading (every process alive: not ready until a
check passes) or at failed (it had failed before, or part of it is gone).

The agent is the only one that moves shards: its supervisor
(llmgw/agent/_supervisor.py) through this table, and adoption after a restart
(llmgw/agent/_adopt.py), which enters a shard at loading or failed as above; the
control plane reads the states from reports (`ShardReport.state`
carries the `ShardState` values) and never moves them.
"""

from __future__ import annotations

import enum

import attrs

from llmgw.model import ShardState


class ShardEvent(enum.StrEnum):
    LAUNCHED = "launched"
    HEALTHY = "healthy"
    CHECK_FAILED = "check_failed"
    HEALTH_LOST = "health_lost"
    EXITED = "exited"
    STOP = "stop"
    RELAUNCHED = "relaunched"


_S = ShardState
_E = ShardEvent

TRANSITIONS: dict[tuple[ShardState, ShardEvent], ShardState] = {
    (_S.STARTING, _E.LAUNCHED): _S.LOADING,
    (_S.STARTING, _E.EXITED): _S.FAILED,
    (_S.STARTING, _E.STOP): _S.STOPPED,
    (_S.LOADING, _E.HEALTHY): _S.READY,
    (_S.LOADING, _E.CHECK_FAILED): _S.LOADING,
    (_S.LOADING, _E.HEALTH_LOST): _S.UNHEALTHY,
    (_S.LOADING, _E.EXITED): _S.FAILED,
    (_S.LOADING, _E.STOP): _S.STOPPED,
    (_S.READY, _E.HEALTHY): _S.READY,
    (_S.READY, _E.CHECK_FAILED): _S.READY,
    (_S.READY, _E.HEALTH_LOST): _S.UNHEALTHY,
    (_S.READY, _E.EXITED): _S.FAILED,
    (_S.READY, _E.STOP): _S.STOPPED,
    (_S.UNHEALTHY, _E.HEALTHY): _S.READY,
    (_S.UNHEALTHY, _E.HEALTH_LOST): _S.UNHEALTHY,
    (_S.UNHEALTHY, _E.EXITED): _S.FAILED,
    (_S.UNHEALTHY, _E.STOP): _S.STOPPED,
    (_S.FAILED, _E.STOP): _S.STOPPED,
    (_S.STARTING, _E.RELAUNCHED): _S.STARTING,
    (_S.LOADING, _E.RELAUNCHED): _S.STARTING,
    (_S.READY, _E.RELAUNCHED): _S.STARTING,
    (_S.UNHEALTHY, _E.RELAUNCHED): _S.STARTING,
}

# States in which the shard's processes are (or should be) running.
RUNNING: frozenset[ShardState] = frozenset({_S.STARTING, _S.LOADING, _S.READY, _S.UNHEALTHY})


class InvalidTransition(ValueError):
    """A (state, event) pair that is not in `TRANSITIONS`: a bug in the supervisor."""


def next_state(state: ShardState, event: ShardEvent) -> ShardState:
    """The table lookup; raises `InvalidTransition` for a pair not in the table."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(
            f"event {event.value!r} is not valid in shard state {state.value!r}"
        ) from None


@attrs.define
class HealthRun:
    """Consecutive health-check failures, and when they amount to HEALTH_LOST.

    `counting` is whether failures count at all: not until the shard has been
    ready once. `failures` holds the descriptions of the current run of
    failures, oldest first; the reason reported names the ones that tripped it.
    """

    threshold: int
    counting: bool = False
    failures: list[str] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"health failures threshold must be 1 or more, got {self.threshold}")

    def observe(self, failure: str | None) -> ShardEvent:
        """One check's outcome (None: it passed) as the event it is."""
        if failure is None:
            self.counting = True
            self.failures.clear()
            return ShardEvent.HEALTHY
        if not self.counting:
            return ShardEvent.CHECK_FAILED
        self.failures.append(failure)
        if len(self.failures) >= self.threshold:
            return ShardEvent.HEALTH_LOST
        return ShardEvent.CHECK_FAILED

    def reason(self) -> str:
        """Why the shard is unhealthy, naming the failures that made it so."""
        tripped = self.failures[: self.threshold]
        return f"/health failed {len(tripped)} times in a row: " + "; ".join(tripped)
