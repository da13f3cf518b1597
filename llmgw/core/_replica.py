"""A replica's states, and what the plan does with a replica in each, as a table.

A replica is one copy of a catalog model: its ranks, a shard each, on one or
more nodes. Unlike a shard (llmgw/core/_shard.py), it has no state of its own
to move from: every pass the reconciler derives it afresh from the shards the
agents report and the nodes' liveness (llmgw/core/_reconcile.py, in the order
of its rules), and the drain rule (llmgw/core/_drain.py) renames a live one on
a draining node. So its table is not (state, event) -> state but what each
state means for the plan. The values are what the admin API, `ctl` and the
event log show; they never change.

| state       | alive | replaced | behind |
|-------------|-------|----------|--------|
| ready       | yes   | no       | 0      |
| unreachable | yes   | no       | 1      |
| starting    | yes   | no       | 2      |
| unhealthy   | yes   | yes      | 3      |
| lost        | no    | yes      | 1      |
| failed      | no    | yes      | -      |
| timed-out   | no    | yes      | -      |
| incomplete  | no    | yes      | -      |
| removed     | no    | no       | -      |
| extra       | no    | no       | -      |
| draining    | no    | no       | -      |
| retiring    | no    | no       | -      |

- alive: counted as one of its model's replicas and left running (on a
  draining node: handed to the drain rule instead). Any other state the plan
  derives is stopped, all its ranks on ready nodes; but a lost replica is
  held as if alive while the mass-unreachable guard holds (this control plane
  may be the one cut off).
- replaced: a stop of a replica in this state is its failure (it is
  replaced, and the event log records why); a stop because its model left
  the catalog (removed), it was one too many (extra) or its node is drained
  is not. An unhealthy replica is left alone until it has been unhealthy for
  `unhealthy_replace_s`, when the plan calls it failed.
- behind: how far from serving it is, for choosing which of too many to
  stop: the furthest behind first, then the newest. Only the states that are
  counted (alive, and lost while held) have one.
- extra, draining and retiring are never derived from shards: the plan gives
  `extra` to the replicas it stops for being too many, and the drain rule
  gives `draining` (kept until its replacement is ready) and `retiring`
  (taken out of the router, then stopped).
"""

from __future__ import annotations

import enum

import attrs


class ReplicaState(enum.StrEnum):
    READY = "ready"
    UNREACHABLE = "unreachable"
    STARTING = "starting"
    UNHEALTHY = "unhealthy"
    LOST = "lost"
    FAILED = "failed"
    TIMED_OUT = "timed-out"
    INCOMPLETE = "incomplete"
    REMOVED = "removed"
    EXTRA = "extra"
    DRAINING = "draining"
    RETIRING = "retiring"


@attrs.frozen
class ReplicaMeaning:
    """One row of the table: the module docstring says what each column means."""

    alive: bool
    replaced: bool
    behind: int | None


_R = ReplicaState
_M = ReplicaMeaning

MEANINGS: dict[ReplicaState, ReplicaMeaning] = {
    _R.READY: _M(alive=True, replaced=False, behind=0),
    _R.UNREACHABLE: _M(alive=True, replaced=False, behind=1),
    _R.STARTING: _M(alive=True, replaced=False, behind=2),
    _R.UNHEALTHY: _M(alive=True, replaced=True, behind=3),
    _R.LOST: _M(alive=False, replaced=True, behind=1),
    _R.FAILED: _M(alive=False, replaced=True, behind=None),
    _R.TIMED_OUT: _M(alive=False, replaced=True, behind=None),
    _R.INCOMPLETE: _M(alive=False, replaced=True, behind=None),
    _R.REMOVED: _M(alive=False, replaced=False, behind=None),
    _R.EXTRA: _M(alive=False, replaced=False, behind=None),
    _R.DRAINING: _M(alive=False, replaced=False, behind=None),
    _R.RETIRING: _M(alive=False, replaced=False, behind=None),
}
assert set(MEANINGS) == set(ReplicaState), "every replica state has its row"

# The table's columns, as the plan and the event log ask them.
ALIVE_REPLICA_STATES: frozenset[ReplicaState] = frozenset(s for s, m in MEANINGS.items() if m.alive)
REPLACED_REPLICA_STATES: frozenset[ReplicaState] = frozenset(
    s for s, m in MEANINGS.items() if m.replaced
)
BEHIND: dict[ReplicaState, int] = {s: m.behind for s, m in MEANINGS.items() if m.behind is not None}
