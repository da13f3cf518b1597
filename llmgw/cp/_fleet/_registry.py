"""The node registry: who is connected, what they have, and whether they are alive.

The registry is the control plane's `RegistryServant`: the RPC boundary hands
it registrations (with the peer's certificate CN and an `AgentHandle`), and it
feeds the pure liveness machine in llmgw.core with registrations, heartbeats,
lost connections and clock ticks, logging every state change with its reason.

Its parts, each a module of its own: the node records (llmgw/cp/_fleet/_node_record.py),
the overrides and known nodes kept in the store (llmgw/cp/_fleet/_fleet_state.py), the
fetches' progress (llmgw/cp/_fleet/_progress.py), and the push of an engine
declaration to the connected agents (llmgw/cp/_fleet/_declare.py).

What it needs from the rest of the control plane it is given when built: the
`Lease` it acts under, whom it tells of every change, the mirror agents fetch
from, the engine declaration, the history it samples into, and how to close
an RPC connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import trio

from llmgw import core, model
from llmgw.cp._fleet import _declare, _node_record
from llmgw.cp._fleet._fleet_state import FleetState
from llmgw.cp._fleet._node_record import NodeRecord as NodeRecord  # re-exported: named from here
from llmgw.cp._fleet._progress import FetchProgress as FetchProgress  # re-exported, as NodeRecord
from llmgw.cp._fleet._progress import ProgressBook
from llmgw.cp._fleet._shared import SharedValues
from llmgw.cp._observe._events import EventLog
from llmgw.cp._observe._history import History
from llmgw.errors import NotFound, RegistrationRefused, StaleEpoch, UsageError
from llmgw.rpc import AgentHandle, PeerInfo, SessionServant
from llmgw.store import Store

log = logging.getLogger("llmgw.cp.registry")


class Lease(Protocol):
    """Leadership as the registry sees it (llmgw/cp/_fleet/_leader.py's `Leadership` is one)."""

    def may_act(self) -> bool:
        """True only inside the lease by this process's clock."""
        ...

    def step_down(self, why: str) -> None:
        """Stop acting now: an agent knows a newer leader."""
        ...


class _Unleased:
    """The lease of a registry that competes with nobody (tests): it may always act."""

    def may_act(self) -> bool:
        return True

    def step_down(self, why: str) -> None:
        pass


class _Session:
    """One registration's NodeSession; stale once the node registers again."""

    def __init__(self, registry: NodeRegistry, node_id: str, generation: int) -> None:
        self._registry = registry
        self._node_id = node_id
        self._generation = generation

    async def heartbeat(self, beat: model.Heartbeat) -> None:
        if not self._registry.leading:
            # Deposed: the agent must go to the leader; the refusal names it when known.
            raise self._registry.refusal()
        self._registry.on_heartbeat(self._node_id, self._generation, beat)

    async def shard_status(self, shard: model.ShardReport) -> None:
        self._registry.on_shard_status(self._node_id, self._generation, shard)

    async def progress(self, progress: model.Progress) -> None:
        self._registry.on_progress(self._node_id, self._generation, progress)


class NodeRegistry:
    def __init__(
        self,
        policy: core.LivenessPolicy,
        *,
        clock: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
        epoch: int = 1,
        forget_after_s: float | None = None,
        leading: bool = True,
        lease: Lease | None = None,
        listeners: Iterable[Callable[[], None]] = (),
        close_connection: Callable[[int], Awaitable[None]] | None = None,
        mirror_port: int | None = None,
        mirror_tls: bool = False,
        engines: model.EngineDecls | None = None,
        history: History | None = None,
    ) -> None:
        self.policy = policy
        self.forget_after_s = forget_after_s  # a node lost this long is forgotten; None: never
        self.epoch = epoch
        # Leadership (llmgw/cp/_fleet/_leader.py): a standby refuses registrations, naming the
        # leader's RPC address and the lease's epoch when it knows them; `lease.may_act()`
        # (True only inside the lease by this process's clock) is consulted before every
        # command. None: nobody competes, it may always act.
        self.leading = leading
        self.leader_rpc: str | None = None
        self.leader_epoch: int | None = None
        self._lease: Lease = lease if lease is not None else _Unleased()
        # An agent refused a command as stale: counted, and the lease is stepped down.
        self.commands_refused_stale = 0
        # Closes an agent's RPC connection (the bridge's close_connection) on stepping down.
        self._close_connection = close_connection
        # The weights mirror agents resolve `mirror:` sources against (on the host they
        # dialled); None: this control plane serves none.
        self.mirror_port, self.mirror_tls = mirror_port, mirror_tls
        # server.yaml's `engines:`, in every registration's Settings and pushed to every
        # connected agent when it changes (declare_engines); None: nothing declared.
        self.engines = engines
        self.declarations_sent = 0  # declareEngines calls answered, for tests and statistics
        self._clock = clock
        self._wall = wall
        self._nodes: dict[str, NodeRecord] = {}
        self._nursery: trio.Nursery | None = None
        self._generations = 0
        # Cordoned, draining and known nodes, kept in the store (load_state).
        self._kept = FleetState(self._address)
        # Called on a registration, a shard report, a state change (llmgw/cp/_fleet/_wake.py).
        self._listeners = tuple(listeners)
        # Why things happened (failed shards, state changes), for the admin API.
        self.events = EventLog(clock=clock, wall=wall)
        self._progress = ProgressBook()
        self.history = history  # each node's last hour (_observe/_history.py); None: none kept
        self.shared = SharedValues()  # kept once: what repeats across nodes (_shared.py)

    def __repr__(self) -> str:
        return f"<NodeRegistry {self.statistics()}>"

    def statistics(self) -> dict[str, int]:
        counts = {state.value: 0 for state in core.NodeState}
        for rec in self._nodes.values():
            counts[rec.liveness.state.value] += 1
        return counts

    # the overrides and known nodes: what each means, llmgw/cp/_fleet/_fleet_state.py ----

    @property
    def cordoned(self) -> dict[str, str]:
        return self._kept.cordoned

    @property
    def draining(self) -> dict[str, str]:
        return self._kept.draining

    @property
    def known(self) -> set[str]:
        return self._kept.known

    @property
    def store_writes(self) -> int:
        return self._kept.store_writes

    def _address(self, node_id: str) -> str:
        rec = self._nodes.get(node_id)
        return rec.address if rec is not None else ""

    async def load_state(self, store: Store) -> None:
        """Read the overrides and the known nodes from the store, and keep them there from
        now on (a task of `run` writes what changes). Called at start, and again when a
        standby becomes leader: the other control plane may have changed them."""
        await self._kept.load(store)
        self._changed()

    async def flush(self) -> None:
        """Write what changed now (an operator's cordon, drain or forget is written before
        the admin API answers); the store's error is raised, and the rest kept to write."""
        await self._kept.flush()

    def cordon(self, node_id: str, reason: str | None) -> None:
        self._kept.cordon(node_id, reason)
        self._changed()

    def uncordon(self, node_id: str) -> list[str]:
        """Lift a cordon and a drain (as kubectl's uncordon does); returns what was lifted."""
        lifted = self._kept.uncordon(node_id)
        if lifted:
            self._changed()
        return lifted

    def drain(self, node_id: str, reason: str | None) -> None:
        """Move what runs on the node elsewhere, replacement first, and place nothing there."""
        self._kept.drain(node_id, reason)
        self._changed()

    def forget(self, node_id: str, why: str = "forgotten by an operator") -> str:
        """Remove a node that is not connected from the fleet, from the guard's count and
        from the known nodes a restarted control plane waits for; returns what it was.

        Its cordon and drain go with it: if it comes back, it registers as a new node.
        """
        rec = self._nodes.get(node_id)
        if rec is None and node_id not in self.known:
            raise NotFound(f"no node {node_id!r} is known to this control plane")
        if rec is not None and rec.agent is not None:
            raise UsageError(
                f"node {node_id} is connected ({rec.liveness.state.value}): only a node "
                "that is not connected can be forgotten; stop its agent first, or drain it"
            )
        was = "not registered since this start" if rec is None else rec.liveness.state.value
        self._nodes.pop(node_id, None)
        self._progress.drop(node_id)
        if self.history is not None:
            self.history.forget(node_id)
        self._kept.forget(node_id)
        reason = f": {rec.liveness.reason}" if rec is not None else ""
        log.info("node %s forgotten (%s; it was %s%s)", node_id, why, was, reason)
        self.events.node_state(node_id, was, "forgotten", why)
        self._changed()
        return was

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the per-session watchers and the store's writer, and ticks the liveness
        machine every second."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._kept.writer)
            task_status.started()
            while True:
                await trio.sleep(1.0)
                self.tick()

    # leadership ------------------------------------------------------------------

    def acting(self) -> bool:
        """Whether this control plane may command agents now: leading, inside its lease."""
        return self.leading and self._lease.may_act()

    def refusal(self) -> RegistrationRefused:
        """What a standby answers an agent: where the leader is, when it knows."""
        rpc, epoch = self.leader_rpc, self.leader_epoch
        if rpc is None:
            return RegistrationRefused("standby; no leader yet")
        return RegistrationRefused(f"standby; leader is {rpc}", leader=rpc, epoch=epoch)

    def set_leader(self, rpc: str | None, epoch: int | None = None) -> None:
        """A standby learned the leader (None: nobody holds the lease) and the epoch."""
        self.leader_rpc, self.leader_epoch = rpc, epoch

    def lead(self, epoch: int) -> None:
        """Elected: every command and registration from now carries `epoch`."""
        self.epoch = epoch
        self.leader_rpc = self.leader_epoch = None
        self.leading = True
        log.info("registry: leading at epoch %d; accepting registrations", epoch)
        self._changed()

    def step_down(self, why: str) -> None:
        """Deposed: stop acting, drop every agent session (each agent redials and is sent
        to the leader), forget what the fleet reported. Known nodes and overrides stay."""
        was_leading = self.leading
        self.leading = False
        dropped = 0
        for rec in self._nodes.values():
            if rec.agent is not None:
                rec.agent.release()
                rec.agent = None
                dropped += 1
            close, nursery = self._close_connection, self._nursery
            if rec.conn_id is not None and close is not None and nursery is not None:
                nursery.start_soon(close, rec.conn_id)
        self._nodes.clear()
        self._progress.clear()
        if was_leading:
            log.warning(
                "registry: stepped down at epoch %d (%s): dropped %d agent sessions",
                self.epoch,
                why,
                dropped,
            )
        self._changed()

    def stale_epoch(self, node_id: str, exc: StaleEpoch) -> None:
        """An agent refused a command as older than an epoch it has seen: someone else
        leads. Counted (`commands_refused_stale`), and the lease is stepped down."""
        self.commands_refused_stale += 1
        log.warning("node %s refused a command at epoch %d as stale: %s", node_id, self.epoch, exc)
        self._lease.step_down(f"node {node_id} refused epoch {self.epoch} as stale")

    async def register(
        self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle
    ) -> tuple[SessionServant, model.Settings]:
        if not self.acting():
            # Before anything of the hello is read: a standby keeps no fleet.
            agent.release()
            raise self.refusal()
        impostor = _node_record.impostor(peer, hello)
        if impostor is not None:
            agent.release()
            raise impostor
        now = self._clock()
        self._generations += 1
        generation = self._generations
        old = self._nodes.get(hello.node_id)
        if old is not None and old.agent is not None:
            old.agent.release()
        self._progress.drop(hello.node_id)  # a new session reports its fetches anew
        rec = _node_record.registered(
            peer, self.shared.hello(hello), agent, generation=generation, now=now, wall=self._wall()
        )
        self._nodes[hello.node_id] = rec
        if self.history is not None:
            self.history.record(hello.node_id, hello.inventory.usage, hello.shards)
        self._kept.remember(hello.node_id)  # written by the writer task, never waited for
        before = old.liveness.state.value if old else "new"
        log.info(
            "node %s: %s -> ready (registered from %s, %d shards)",
            hello.node_id,
            before,
            peer.address,
            len(hello.shards),
        )
        ready = core.NodeState.READY.value
        self.events.node_state(hello.node_id, before, ready, f"registered from {peer.address}")
        for shard in hello.shards:  # a failure while it was away is news too
            self.events.shard_report(hello.node_id, shard)
        self.events.gpu_faults(hello.node_id, hello.inventory.usage.gpus)
        if self._nursery is not None:
            self._nursery.start_soon(self._watch, hello.node_id, generation, peer.closed)
        self._changed()
        return _Session(self, hello.node_id, generation), model.Settings(
            heartbeat_interval_s=self.policy.heartbeat_interval_s,
            epoch=self.epoch,
            mirror_port=self.mirror_port,
            mirror_tls=self.mirror_tls,
            engines=self.engines,
        )

    def declare_engines(self, decls: model.EngineDecls | None) -> None:
        """A new engine declaration: the next registrations carry it, and every connected
        agent is told now, each in a task of its own (llmgw/cp/_fleet/_declare.py)."""
        sent = _declare.to_send(self.engines, decls)
        self.engines = decls
        if sent is None or self._nursery is None or not self.acting():
            return  # a standby's next registrations with the leader carry it
        for rec in self.records():
            if rec.agent is not None:
                self._nursery.start_soon(self._declare, rec.node_id, rec.generation, sent)

    async def _declare(self, node_id: str, generation: int, decls: model.EngineDecls) -> None:
        rec = self._current(node_id, generation)
        if rec is None or rec.agent is None or not self.acting():
            return
        if await _declare.declare(rec.agent, node_id, self.epoch, decls, self):
            self.declarations_sent += 1

    async def _watch(self, node_id: str, generation: int, closed: trio.Event) -> None:
        await closed.wait()
        rec = self._current(node_id, generation)
        if rec is not None:
            if rec.agent is not None:
                rec.agent.release()
                rec.agent = None
            self._progress.drop(node_id)  # no session, no news of its fetches
            self._apply(rec, core.ConnectionLost(self._clock()))

    # events -------------------------------------------------------------------

    def _current(self, node_id: str, generation: int) -> NodeRecord | None:
        rec = self._nodes.get(node_id)
        return rec if rec is not None and rec.generation == generation else None

    def _apply(self, rec: NodeRecord, event: core.Event) -> None:
        before = rec.liveness
        rec.liveness = core.step(before, event, self.policy)
        if rec.liveness.state is not before.state:
            if rec.liveness.state is core.NodeState.LOST:
                self._progress.drop(rec.node_id)
            self.events.node_state(
                rec.node_id,
                before.state.value,
                rec.liveness.state.value,
                rec.liveness.reason,
                replicas=[(s.replica_id, s.model_name, s.shard_id) for s in rec.shards
                          if s.replica_id is not None],
            )  # fmt: skip
            self._changed()
            log.info(
                "node %s: %s -> %s (%s)",
                rec.node_id,
                before.state.value,
                rec.liveness.state.value,
                rec.liveness.reason,
            )

    def on_heartbeat(self, node_id: str, generation: int, beat: model.Heartbeat) -> None:
        rec = self._current(node_id, generation)
        if rec is None:
            return
        rec.last_seen_wall = self._wall()
        beat = self.shared.beat(beat)
        rec.inventory = _node_record.with_heartbeat(rec.inventory, beat)
        if self.history is not None:
            self.history.record(node_id, beat.usage, rec.shards)
        self._apply(rec, core.HeartbeatSeen(self._clock()))
        if self.events.gpu_faults(node_id, beat.usage.gpus):
            self._changed()  # a card may be out: the reconciler plans now, not next pass

    def on_shard_status(self, node_id: str, generation: int, shard: model.ShardReport) -> None:
        rec = self._current(node_id, generation)
        if rec is None:
            return
        if not rec.take(shard):
            return  # older than what it holds: state never goes backwards
        self.events.shard_report(node_id, shard)
        if shard.source is not None and shard.state != model.ShardState.STARTING:
            self._progress.end(node_id, shard.source)  # the fetch's news ends with it
        self._changed()

    def on_progress(self, node_id: str, generation: int, msg: model.Progress) -> None:
        """A fetch's progress (llmgw/cp/_fleet/_progress.py). Not a state transition: no
        listener hears of it, and it touches neither liveness nor the node's record."""
        rec = self._current(node_id, generation)
        if rec is None or rec.agent is None:
            return
        self._progress.hear(node_id, msg, now=self._clock(), wall=self._wall())

    def progress(self, node_id: str) -> dict[str, FetchProgress]:
        """The node's fetches heard from in the last PROGRESS_SILENCE_S, by source."""
        return self._progress.of(node_id, self._clock())

    def tick(self) -> None:
        now = self._clock()
        self._progress.expire(now)
        event = core.Tick(now)
        for rec in list(self._nodes.values()):
            self._apply(rec, event)
            if (
                self.forget_after_s is not None
                and rec.liveness.state is core.NodeState.LOST
                and rec.agent is None
                and now - rec.liveness.since >= self.forget_after_s
            ):
                self.forget(rec.node_id, f"lost for {self.forget_after_s:g} s (forget_after_s)")

    # views --------------------------------------------------------------------

    def views(self) -> list[model.NodeView]:
        now_clock, now_wall = self._clock(), self._wall()
        return _node_record.views(self.records(), now_clock, now_wall, self.cordoned, self.draining)

    def agent(self, node_id: str) -> AgentHandle | None:
        """The node's handle for a command; None when not connected, or when this control
        plane may not act (a standby, or a leader past its lease by its own clock)."""
        rec = self._nodes.get(node_id)
        if rec is None or not self.acting():
            return None
        return rec.agent

    def record(self, node_id: str) -> NodeRecord | None:
        return self._nodes.get(node_id)

    def records(self) -> list[NodeRecord]:
        return sorted(self._nodes.values(), key=lambda r: r.node_id)

    def note_shard(self, node_id: str, shard: model.ShardReport) -> None:
        """Record what a command to the agent answered, before its status message arrives."""
        rec = self._nodes.get(node_id)
        if rec is not None:
            self.on_shard_status(node_id, rec.generation, shard)

    def forget_shard(self, node_id: str, shard_id: str) -> None:
        rec = self._nodes.get(node_id)
        if rec is not None:
            rec.remove_shard(shard_id)
            self._changed()
