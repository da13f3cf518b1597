"""Why things happened: recent events per replica and per node, and each replica's last failure.

A failed engine is replaced in about a second, and its shard (logs included)
is gone from the agent soon after; what an operator needs afterwards is here.
`EventLog` is fed by the registry (shard reports that say `failed` or
`unhealthy`, node state changes), by the reconciler (each replica it stops,
and why) and by whoever meets a stuck command. It keeps bounded rings, per
replica, per node and overall, so a chatty node cannot push a quiet replica's
story out, and a fleet of any size holds a bounded amount.

It does no I/O and imports no trio: it is fed with events and reads its time
from the two clocks it was given (a monotonic one for the retention window,
the wall clock for what is shown). Reading never changes it: every query
returns frozen values, and expired failures are dropped only when something
new is recorded.

What it records is also kept in the store, by a writer off the request path
(llmgw/cp/_observe/_event_keeper.py): each event goes into `unsaved` as a
`Recorded`, which carries what recording it derived (the replica failure it
was, the repeat it suppresses), and `replace` rebuilds the log from the
store's records at start and when this control plane is elected, so `ctl
events` and "why was this replaced" survive a restart or a failover.

A shard's reason is read by one convention, the supervisor's: its first line
is the summary (`engine (pid 12) was killed by SIGKILL`), and the lines after
it are the output that explains it (the engine's last stderr/stdout lines).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

import attrs

from llmgw import core, model

# Kinds of event; the admin API and `ctl events` show them as they are.
SHARD_FAILED = "shard-failed"
SHARD_UNHEALTHY = "shard-unhealthy"
REPLICA_STOPPED = "replica-stopped"
NODE_STATE = "node-state"
COMMAND_STUCK = "command-stuck"
GPU_FAULT = "gpu-fault"

# Replica states in which the reconciler replaces a replica: a stop for one of
# these is a failure; a stop because the model left the catalog or has too
# many replicas is not (llmgw/core/_replica.py, the `replaced` column).
REPLACED_STATES = core.REPLACED_REPLICA_STATES

DEFAULT_FAILURE_RETENTION_S = 15 * 60.0
DEFAULT_UNSAVED = 10_000  # events waiting for the store; past it the oldest go (counted)
LAST_LINES = 10  # output lines kept with a failure


@attrs.frozen
class Event:
    seq: int  # increasing: the order events were recorded in
    at: float  # wall clock, seconds since the epoch
    kind: str
    message: str  # one line
    node_id: str | None = None
    replica_id: str | None = None
    model_name: str | None = None
    shard_id: str | None = None
    lines: tuple[str, ...] = ()  # output that explains it (an engine's last lines)


# What an event suppresses when it is seen again: ("shard", node, shard, state, reason)
# or ("gpu", node, index, kind, xid, line or meaning).
Seen = tuple[str | int | None, ...]


@attrs.frozen
class Recorded:
    """An event as the store keeps it, with what recording it derived, so that replaying
    it (`EventLog.replace`) rebuilds the same failures and the same repeat suppression."""

    event: Event
    failure: str | None = None  # the reason, when it was a replica's failure
    strong: bool = False  # a shard's own report: it overrides a stop's weaker reason
    seen: Seen | None = None


@attrs.frozen
class Failure:
    """The last failure of a replica: what `ctl replicas` shows under it."""

    at: float  # wall clock
    kind: str  # the event kind it came from
    reason: str  # one line
    lines: tuple[str, ...]
    node_id: str | None
    shard_id: str | None
    replica_id: str
    model_name: str | None


@attrs.frozen
class _Kept:
    mono: float  # the monotonic clock when recorded: retention is measured on it
    failure: Failure


def split_reason(reason: str | None) -> tuple[str, tuple[str, ...]]:
    """A shard's reason as (summary, explaining lines); see the module's docstring."""
    if not reason or not reason.strip():
        return "no reason given", ()
    head, *rest = reason.splitlines()
    head = head.strip().removesuffix("; last output:").removesuffix(":").strip()
    lines = tuple(line for line in rest if line.strip())
    return head or "no reason given", lines[-LAST_LINES:]


class _Rings:
    """Events per key (a replica or a node), each a ring; the least recently used key goes."""

    def __init__(self, per_key: int, keys: int) -> None:
        self._per_key = per_key
        self._keys = keys
        self._rings: OrderedDict[str, deque[Event]] = OrderedDict()

    def add(self, key: str, event: Event) -> None:
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = deque(maxlen=self._per_key)
            while len(self._rings) > self._keys:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        ring.append(event)

    def get(self, key: str) -> tuple[Event, ...]:
        return tuple(self._rings.get(key, ()))

    def __len__(self) -> int:
        return len(self._rings)


class _Repeats:
    """What was recorded already, each bounded to `keys` entries (the oldest go): each
    shard's last failed or unhealthy (state, reason), since a report repeated on a
    registration or a status message is one event, not two; and the GPU faults, since an
    agent sends its cards' faults with every sample, and again after a restart (it reads
    the kernel log from the start)."""

    def __init__(self, keys: int) -> None:
        self._keys = keys
        self.shards: OrderedDict[tuple[str, str], tuple[str, str | None]] = OrderedDict()
        self.faults: OrderedDict[tuple[str, int, str, int | None, str], None] = OrderedDict()

    def shard(self, key: tuple[str, str], state: str, reason: str | None) -> None:
        self.shards[key] = (state, reason)
        self.shards.move_to_end(key)
        while len(self.shards) > self._keys:
            self.shards.popitem(last=False)

    def fault(self, key: tuple[str, int, str, int | None, str]) -> None:
        self.faults[key] = None
        while len(self.faults) > self._keys:
            self.faults.popitem(last=False)

    def replay(self, seen: Seen) -> None:
        """A stored event's `seen`, as recording it noted it."""
        if seen[0] == "shard" and len(seen) == 5:
            _, node, shard, state, reason = seen
            self.shard((str(node), str(shard)), str(state), None if reason is None else str(reason))
        elif seen[0] == "gpu" and len(seen) == 6:
            _, node, index, kind, xid, line = seen
            xid_ = None if xid is None else int(xid)
            self.fault((str(node), int(index or 0), str(kind), xid_, str(line)))


class EventLog:
    def __init__(
        self,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float],
        failure_retention_s: float = DEFAULT_FAILURE_RETENTION_S,
        per_key: int = 50,
        keys: int = 4096,
        total: int = 2000,
        unsaved: int = DEFAULT_UNSAVED,
    ) -> None:
        if failure_retention_s <= 0:
            raise ValueError(f"failure_retention_s must be > 0, got {failure_retention_s!r}")
        self.failure_retention_s = failure_retention_s
        self._clock = clock
        self._wall = wall
        self._seq = itertools.count(1)
        self._all: deque[Event] = deque(maxlen=total)
        self._by_replica = _Rings(per_key, keys)
        self._by_node = _Rings(per_key, keys)
        self._failures: OrderedDict[str, _Kept] = OrderedDict()  # replica id -> its last
        self._by_model: dict[str, deque[_Kept]] = {}  # model -> its last few, oldest first
        self._keys = keys
        # What was recorded already, so that a repeat is not recorded again (_Repeats).
        self._seen = _Repeats(keys)
        self._per_key, self._total = per_key, total
        # Recorded here and not yet in the store, oldest first (the keeper takes them).
        self._unsaved: deque[Recorded] = deque()
        self._unsaved_max = unsaved
        self.unsaved_dropped = 0  # recorded while the store was out and the queue full

    def __repr__(self) -> str:
        return f"<EventLog {self.statistics()}>"

    def statistics(self) -> dict[str, int]:
        return {
            "events": len(self._all),
            "replicas": len(self._by_replica),
            "nodes": len(self._by_node),
            "failures": len(self._failures),
            "unsaved": len(self._unsaved),
            "unsaved_dropped": self.unsaved_dropped,
        }

    # feeding ----------------------------------------------------------------------------

    def record(
        self,
        kind: str,
        message: str,
        *,
        node_id: str | None = None,
        replica_id: str | None = None,
        model_name: str | None = None,
        shard_id: str | None = None,
        lines: Iterable[str] = (),
    ) -> Event:
        """Any event; the typed helpers below are the usual way in."""
        event = self._add(kind, message, node_id=node_id, replica_id=replica_id,
                          model_name=model_name, shard_id=shard_id, lines=lines)  # fmt: skip
        self._journal(Recorded(event))
        return event

    def _add(
        self,
        kind: str,
        message: str,
        *,
        node_id: str | None = None,
        replica_id: str | None = None,
        model_name: str | None = None,
        shard_id: str | None = None,
        lines: Iterable[str] = (),
        at: float | None = None,
    ) -> Event:
        """A new event, into the rings; not yet in `unsaved` (`_journal` does that)."""
        event = Event(
            seq=next(self._seq),
            at=self._wall() if at is None else at,
            kind=kind,
            message=message,
            node_id=node_id,
            replica_id=replica_id,
            model_name=model_name,
            shard_id=shard_id,
            lines=tuple(lines),
        )
        self._all.append(event)
        if replica_id is not None:
            self._by_replica.add(replica_id, event)
        if node_id is not None:
            self._by_node.add(node_id, event)
        return event

    def _journal(self, recorded: Recorded) -> None:
        self._unsaved.append(recorded)
        while len(self._unsaved) > self._unsaved_max:
            self._unsaved.popleft()
            self.unsaved_dropped += 1

    def shard_report(self, node_id: str, shard: model.ShardReport) -> Event | None:
        """A shard report from an agent; only `failed` and `unhealthy` are events."""
        key = (node_id, shard.shard_id)
        if shard.state not in (model.ShardState.FAILED, model.ShardState.UNHEALTHY):
            self._seen.shards.pop(key, None)  # recovered or restarted: a new failure is news
            return None
        if self._seen.shards.get(key) == (shard.state, shard.reason):
            return None
        self._seen.shard(key, shard.state, shard.reason)
        reason, lines = split_reason(shard.reason)
        kind = SHARD_FAILED if shard.state == model.ShardState.FAILED else SHARD_UNHEALTHY
        event = self._add(
            kind,
            f"shard {shard.shard_id} {shard.state}: {reason}",
            node_id=node_id,
            replica_id=shard.replica_id,
            model_name=shard.model_name,
            shard_id=shard.shard_id,
            lines=lines,
        )
        failed = shard.replica_id is not None
        if failed:
            self._fail(event, reason, strong=True)
        seen = ("shard", node_id, shard.shard_id, str(shard.state), shard.reason)
        self._journal(Recorded(event, reason if failed else None, True, seen))
        return event

    def replica_stopped(
        self,
        *,
        node_id: str,
        shard_id: str,
        reason: str,
        replica_id: str | None,
        model_name: str | None,
        state: str | None,
    ) -> Event:
        """The reconciler stopped a shard of a replica; `state`: the replica's, when known.

        A stop because the replica failed, timed out, was lost or incomplete is
        its failure unless a shard already said more (its reason and output).
        """
        # The summary only: the output in a stop's reason is the failed shard's,
        # already on that shard's own event.
        summary, _ = split_reason(reason)
        event = self._add(
            REPLICA_STOPPED,
            f"stopping shard {shard_id}: {summary}",
            node_id=node_id,
            replica_id=replica_id,
            model_name=model_name,
            shard_id=shard_id,
        )
        failed = replica_id is not None and state in REPLACED_STATES
        if failed:
            self._fail(event, summary, strong=False)
        self._journal(Recorded(event, summary if failed else None))
        return event

    def node_state(
        self,
        node_id: str,
        before: str,
        after: str,
        reason: str | None,
        *,
        replicas: Iterable[tuple[str, str | None, str]] = (),
    ) -> Event:
        """A node changed state; `replicas`: (replica, model, shard) of what it ran.

        A node that went lost takes its replicas with it: that is their failure.
        """
        why = f" ({reason})" if reason else ""
        event = self.record(
            NODE_STATE, f"node {node_id}: {before} -> {after}{why}", node_id=node_id
        )
        if after == core.NodeState.LOST:
            for replica_id, model_name, shard_id in replicas:
                lost = self._add(
                    NODE_STATE,
                    f"replica {replica_id} lost with node {node_id}{why}",
                    node_id=node_id,
                    replica_id=replica_id,
                    model_name=model_name,
                    shard_id=shard_id,
                )
                self._fail(lost, f"node {node_id} is lost{why}", strong=False)
                self._journal(Recorded(lost, f"node {node_id} is lost{why}"))
        return event

    def gpu_faults(self, node_id: str, gpus: Iterable[model.GpuUsage]) -> list[Event]:
        """The faults a node's cards report that were not recorded yet, one event each:
        what happened and what llmgw does (the card taken out, or reported only)."""
        out = []
        for g in gpus:
            for f in g.faults or ():
                key = (node_id, g.index, f.kind, f.xid, f.line or f.meaning)
                if key in self._seen.faults:
                    continue
                self._seen.fault(key)
                if f.unusable:
                    act = "the card is taken out: its replicas are replaced elsewhere, then stopped"
                else:
                    whose = core.classify_xid(f.xid).whose if f.xid is not None else "unknown"
                    act = f"reported only ({whose} fault): nothing moves"
                event = self._add(
                    GPU_FAULT,
                    f"gpu {g.index}: {core.fault_words(f)}; {act}",
                    node_id=node_id,
                    lines=(f.line.strip(),) if f.line else (),
                )
                self._journal(Recorded(event, seen=("gpu", *key)))
                out.append(event)
        return out

    def command_stuck(
        self,
        node_id: str,
        message: str,
        *,
        shard_id: str | None = None,
        replica_id: str | None = None,
        model_name: str | None = None,
    ) -> Event:
        """A command to an agent ran past its deadline ("did not answer startShard in 10 s").

        A start that got stuck is why its replica never ran: its failure.
        """
        event = self._add(
            COMMAND_STUCK,
            message,
            node_id=node_id,
            replica_id=replica_id,
            model_name=model_name,
            shard_id=shard_id,
        )
        if replica_id is not None:
            self._fail(event, message, strong=False)
        self._journal(Recorded(event, message if replica_id is not None else None))
        return event

    def _fail(self, event: Event, reason: str, *, strong: bool, mono: float | None = None) -> None:
        """`mono`: when it happened on the monotonic clock (a replayed event's); None: now."""
        assert event.replica_id is not None
        now = self._clock() if mono is None else mono
        self._expire(self._clock())
        if not strong and event.replica_id in self._failures:
            return  # the shard's own report said more than the stop that followed it
        kept = _Kept(
            now,
            Failure(
                at=event.at,
                kind=event.kind,
                reason=reason,
                lines=event.lines,
                node_id=event.node_id,
                shard_id=event.shard_id,
                replica_id=event.replica_id,
                model_name=event.model_name,
            ),
        )
        self._failures[event.replica_id] = kept
        self._failures.move_to_end(event.replica_id)
        while len(self._failures) > self._keys:
            self._failures.popitem(last=False)
        if event.model_name is not None:
            ring = self._by_model.setdefault(event.model_name, deque(maxlen=8))
            if ring and ring[-1].failure.replica_id == event.replica_id:
                ring.pop()  # one entry per replica: its latest
            ring.append(kept)

    # the store: what is still to be written, and the log rebuilt from it ---------------

    def unsaved(self, limit: int) -> tuple[Recorded, ...]:
        """The oldest `limit` events not yet in the store, oldest first."""
        return tuple(itertools.islice(self._unsaved, limit))

    def saved(self, up_to_seq: int) -> None:
        """The store has every unsaved event up to this one (its `seq`)."""
        while self._unsaved and self._unsaved[0].event.seq <= up_to_seq:
            self._unsaved.popleft()

    def replace(self, stored: Iterable[Recorded]) -> None:
        """The log rebuilt from the store's records (oldest first), then what is recorded
        here and not yet written, replayed after them: at start and when this control
        plane is elected, so it holds what the one before it recorded. Each event gets a
        new `seq` (the order is kept); failures count their window from when they
        happened (their wall-clock age)."""
        waiting = list(self._unsaved)
        self._seq = itertools.count(1)
        self._all = deque(maxlen=self._total)
        self._by_replica = _Rings(self._per_key, self._keys)
        self._by_node = _Rings(self._per_key, self._keys)
        self._failures.clear()
        self._by_model.clear()
        self._seen = _Repeats(self._keys)
        self._unsaved.clear()
        for rec in stored:
            self._replay(rec)
        for rec in waiting:
            self._unsaved.append(self._replay(rec))

    def _replay(self, rec: Recorded) -> Recorded:
        e = rec.event
        event = self._add(e.kind, e.message, node_id=e.node_id, replica_id=e.replica_id,
                          model_name=e.model_name, shard_id=e.shard_id, lines=e.lines,
                          at=e.at)  # fmt: skip
        age = max(0.0, self._wall() - e.at)
        if (
            rec.failure is not None
            and event.replica_id is not None
            and (age <= self.failure_retention_s)
        ):
            self._fail(event, rec.failure, strong=rec.strong, mono=self._clock() - age)
        if rec.seen:
            self._seen.replay(rec.seen)
        return attrs.evolve(rec, event=event)

    def _expire(self, now: float) -> None:
        for replica_id, kept in list(self._failures.items()):
            if not self._fresh(kept, now):
                del self._failures[replica_id]
        for name, ring in list(self._by_model.items()):
            while ring and not self._fresh(ring[0], now):
                ring.popleft()
            if not ring:
                del self._by_model[name]

    def _fresh(self, kept: _Kept, now: float) -> bool:
        return now - kept.mono <= self.failure_retention_s

    # reading ----------------------------------------------------------------------------

    def events(
        self, *, replica_id: str | None = None, node_id: str | None = None, limit: int = 50
    ) -> tuple[Event, ...]:
        """The newest `limit` events, oldest first; both filters given: events matching both."""
        if replica_id is not None:
            found: Iterable[Event] = self._by_replica.get(replica_id)
            if node_id is not None:
                found = [e for e in found if e.node_id == node_id]
        elif node_id is not None:
            found = self._by_node.get(node_id)
        else:
            found = self._all
        out = tuple(found)
        return out[-limit:] if limit > 0 else ()

    def last_failure(self, replica_id: str) -> Failure | None:
        """This replica's last failure, within the retention window."""
        kept = self._failures.get(replica_id)
        return kept.failure if kept is not None and self._fresh(kept, self._clock()) else None

    def predecessor_failure(
        self,
        model_name: str,
        *,
        started: float | None,
        present: Iterable[str],
        slack_s: float = 5.0,
    ) -> Failure | None:
        """Why a replica of `model_name` that started at `started` was needed.

        The newest failure, within the window, of a replica of that model that
        is no longer `present` and failed before it started (`started` on this
        log's monotonic clock, the reconciler's; None: any time, for a
        replacement that could not be placed yet). `slack_s`: a stop is
        recorded as it is sent, and the reconciler may start the replacement a
        moment before, in the same pass.
        """
        now = self._clock()
        still = set(present)
        for kept in reversed(self._by_model.get(model_name, ())):
            if not self._fresh(kept, now) or kept.failure.replica_id in still:
                continue
            if started is None or kept.mono <= started + slack_s:
                return kept.failure
        return None
