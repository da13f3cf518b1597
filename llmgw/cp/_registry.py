"""The node registry: who is connected, what they have, and whether they are alive.

The registry is the control plane's `RegistryServant`: the RPC boundary hands
it registrations (with the peer's certificate CN and an `AgentHandle`), and it
feeds the pure liveness machine in llmgw.core with registrations, heartbeats,
lost connections and clock ticks, logging every state change with its reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping

import attrs
import trio

from llmgw import core, model
from llmgw.cp import _engines
from llmgw.cp._events import EventLog
from llmgw.cp._history import History
from llmgw.cp._store import Store
from llmgw.errors import LlmgwError, NotFound, RegistrationRefused, StaleEpoch, UsageError
from llmgw.rpc import AgentHandle, PeerInfo, SessionServant

log = logging.getLogger("llmgw.cp.registry")


@attrs.define
class NodeRecord:
    node_id: str
    liveness: core.Liveness
    generation: int  # bumped on every registration; older sessions are ignored
    address: str
    agent_version: str
    inventory: model.Inventory
    shards: tuple[model.ShardReport, ...]
    agent: AgentHandle | None
    last_seen_wall: float
    registered_at: float = 0.0  # clock value of this registration
    conn_id: int | None = None  # the RPC connection, closed when this control plane steps down

    @property
    def host(self) -> str:
        """The host part of the agent's address: where its engines listen."""
        return self.address.rsplit(":", 1)[0].strip("[]")


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


# A fetch's progress (issue 12). Not a state transition: it is kept beside the node's
# record, never in it, and changes nothing anyone plans from.
STORE_RETRY_S = 2.0  # a failed write of overrides or known nodes is tried again after this

PROGRESS_SILENCE_S = 30.0  # no message for this long: the fetch is no longer news
PROGRESS_PER_NODE = 64  # a node may report this many sources at once; the oldest go first
PROGRESS_SOURCE_MAX = 4096  # characters; a longer source text is no catalog's
PROGRESS_RATE_TAU_S = 5.0  # the rate's smoothing: about the last five seconds count


@attrs.frozen
class FetchProgress:
    """What the registry knows of one fetch on one node."""

    source: str
    done_bytes: int
    total_bytes: int | None  # None: nobody said the length
    rate_bytes_per_s: float | None  # smoothed; None until two messages
    at: float  # clock value of the last message
    at_wall: float  # unix time of the last message

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate; None without a length or a rate."""
        if self.total_bytes is None or not self.rate_bytes_per_s:
            return None
        return max(0.0, self.total_bytes - self.done_bytes) / self.rate_bytes_per_s


def next_progress(
    last: FetchProgress | None, msg: model.Progress, *, now: float, wall: float
) -> FetchProgress:
    """The fetch's view after one more message (pure). The rate is an exponentially
    weighted mean of the rates between messages, weighted by the time between them, so
    irregular messages count for the time they cover; a count that went back (a
    download restarted from 0) starts the rate again."""
    rate: float | None = None
    if last is not None and msg.done_bytes >= last.done_bytes and now > last.at:
        dt = now - last.at
        seen = (msg.done_bytes - last.done_bytes) / dt
        if last.rate_bytes_per_s is None:
            rate = seen
        else:
            keep = math.exp(-dt / PROGRESS_RATE_TAU_S)
            rate = keep * last.rate_bytes_per_s + (1 - keep) * seen
    elif last is not None and msg.done_bytes >= last.done_bytes:
        rate = last.rate_bytes_per_s  # two messages in one instant: nothing new to learn
    return FetchProgress(msg.source, msg.done_bytes, msg.total_bytes, rate, now, wall)


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
    ) -> None:
        self.policy = policy
        self.forget_after_s = forget_after_s  # a node lost this long is forgotten; None: never
        self.epoch = epoch
        # Leadership (llmgw/cp/_leader.py): a standby refuses registrations, naming the
        # leader's RPC address when it knows it; `may_act` is the lease's own check (True
        # only inside the lease by this process's clock), consulted before every command.
        self.leading = leading
        self.leader_rpc: str | None = None
        self.may_act: Callable[[], bool] = lambda: True
        # An agent refused a command as stale: counted, and this control plane steps down.
        self.commands_refused_stale = 0
        self.on_stale: Callable[[str], None] | None = None
        # Closes an agent's RPC connection (the bridge's close_connection) on stepping down.
        self.close_connection: Callable[[int], Awaitable[None]] | None = None
        # The weights mirror agents resolve `mirror:` sources against (on the host they
        # dialled); None: this control plane serves none.
        self.mirror_port: int | None = None
        self.mirror_tls = False
        # server.yaml's `engines:`, in every registration's Settings and pushed to every
        # connected agent when it changes (declare_engines); None: nothing declared.
        self.engines: model.EngineDecls | None = None
        self.declarations_sent = 0  # declareEngines calls answered, for tests and statistics
        self._clock = clock
        self._wall = wall
        self._nodes: dict[str, NodeRecord] = {}
        self._nursery: trio.Nursery | None = None
        self._generations = 0
        self.cordoned: dict[str, str] = {}  # node -> why; placement leaves these nodes out
        # node -> why; cordoned for placement, and what runs there is moved off
        # (the reconcile plan's drain rule, llmgw/core/_drain.py)
        self.draining: dict[str, str] = {}
        # Every node that ever registered and was not forgotten: whom a restarted
        # control plane waits for before it acts (the reconciler's settle).
        self.known: set[str] = set()
        # Where overrides and known nodes are kept (load_state); None: nowhere (tests).
        self._store: Store | None = None
        self._dirty_overrides: set[str] = set()  # nodes whose override is to be written
        self._dirty_known: set[str] = set()  # nodes known or forgotten since the last write
        self._wake_writer = trio.Event()
        self._flush_lock = trio.Lock()
        self.store_writes = 0
        # Called on a registration, a shard report, a state change.
        self.listeners: list[Callable[[], None]] = []
        # Why things happened (failed shards, state changes), for the admin API.
        self.events = EventLog(clock=clock, wall=wall)
        # node -> source -> its fetch's progress, least recently updated first.
        self._progress: dict[str, OrderedDict[str, FetchProgress]] = {}
        # Each node's last hour (llmgw/cp/_history.py): a sample per heartbeat; None: none kept.
        self.history: History | None = None

    def __repr__(self) -> str:
        return f"<NodeRegistry {self.statistics()}>"

    def statistics(self) -> dict[str, int]:
        counts = {state.value: 0 for state in core.NodeState}
        for rec in self._nodes.values():
            counts[rec.liveness.state.value] += 1
        return counts

    async def load_state(self, store: Store) -> None:
        """Read the operator's overrides and the known nodes from the store, and keep them
        there from now on (a task of `run` writes what changes, batched).

        Called at start, and again when a standby becomes leader: the other control
        plane may have changed them. What this one had not yet written is dropped: the
        store is the record.
        """
        overrides = await store.overrides()
        known = await store.known_nodes()
        self._store = store
        self.cordoned = {o.node_id: o.reason for o in overrides if o.kind == "cordon"}
        self.draining = {o.node_id: o.reason for o in overrides if o.kind == "drain"}
        self.known = {k.node_id for k in known}
        self._dirty_overrides.clear()
        self._dirty_known.clear()
        log.info(
            "from the store: %d cordoned, %d draining, %d known nodes",
            len(self.cordoned),
            len(self.draining),
            len(self.known),
        )
        self._changed()

    def cordon(self, node_id: str, reason: str | None) -> None:
        self.cordoned[node_id] = reason or "cordoned by an operator"
        self._note_override(node_id)
        log.info("node %s cordoned: %s", node_id, self.cordoned[node_id])
        self._changed()

    def uncordon(self, node_id: str) -> list[str]:
        """Lift a cordon and a drain (as kubectl's uncordon does); returns what was lifted."""
        lifted = [
            what
            for what, table in (("cordon", self.cordoned), ("drain", self.draining))
            if table.pop(node_id, None) is not None
        ]
        if not lifted:
            return lifted
        self._note_override(node_id)
        log.info("node %s uncordoned (lifted: %s)", node_id, ", ".join(lifted))
        self._changed()
        return lifted

    def drain(self, node_id: str, reason: str | None) -> None:
        """Move what runs on the node elsewhere, replacement first, and place nothing there."""
        self.draining[node_id] = reason or "drained by an operator"
        self._note_override(node_id)
        log.info("node %s draining: %s", node_id, self.draining[node_id])
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
        self._progress.pop(node_id, None)
        if self.history is not None:
            self.history.forget(node_id)
        if node_id in self.known:
            self.known.discard(node_id)
            self._note_known(node_id)
        had = self.cordoned.pop(node_id, None), self.draining.pop(node_id, None)
        if any(v is not None for v in had):
            self._note_override(node_id)
        reason = f": {rec.liveness.reason}" if rec is not None else ""
        log.info("node %s forgotten (%s; it was %s%s)", node_id, why, was, reason)
        self.events.node_state(node_id, was, "forgotten", why)
        self._changed()
        return was

    # persistence: the store ---------------------------------------------------

    def _note_override(self, node_id: str) -> None:
        self._dirty_overrides.add(node_id)
        self._wake_writer.set()

    def _note_known(self, node_id: str) -> None:
        self._dirty_known.add(node_id)
        self._wake_writer.set()

    async def flush(self) -> None:
        """Write every changed override and known node to the store now (an operator's
        cordon, drain or forget is written before the admin API answers). On a failure
        what is not written stays to be written (by the next flush or the writer task)
        and the store's error is raised."""
        async with self._flush_lock:
            store = self._store
            if store is None:
                self._dirty_overrides.clear()
                self._dirty_known.clear()
                return
            while self._dirty_overrides or self._dirty_known:
                if self._dirty_overrides:
                    node_id = min(self._dirty_overrides)
                    self._dirty_overrides.discard(node_id)
                    write = self._write_override(store, node_id)
                    again = self._dirty_overrides
                else:
                    node_id = min(self._dirty_known)
                    self._dirty_known.discard(node_id)
                    write = self._write_known(store, node_id)
                    again = self._dirty_known
                try:
                    await write
                except BaseException:
                    again.add(node_id)
                    raise
                self.store_writes += 1

    async def _write_override(self, store: Store, node_id: str) -> None:
        # One row a node: a drain holds it for placement too, so it wins over a cordon.
        if node_id in self.draining:
            await store.set_override(node_id, "drain", self.draining[node_id])
        elif node_id in self.cordoned:
            await store.set_override(node_id, "cordon", self.cordoned[node_id])
        else:
            await store.clear_override(node_id)

    async def _write_known(self, store: Store, node_id: str) -> None:
        if node_id in self.known:
            rec = self._nodes.get(node_id)
            await store.remember_node(node_id, rec.address if rec is not None else "")
        else:
            await store.forget_node(node_id)

    async def _writer(self) -> None:
        """Writes what changed, off the tick and the RPC handlers: a registration storm
        is written as it comes, never waited for."""
        while True:
            await self._wake_writer.wait()
            self._wake_writer = trio.Event()
            try:
                await self.flush()
            except LlmgwError as exc:
                log.warning(
                    "the store: cannot write %d node overrides and %d known nodes (retried "
                    "in %g s): %s",
                    len(self._dirty_overrides),
                    len(self._dirty_known),
                    STORE_RETRY_S,
                    exc,
                )
                await trio.sleep(STORE_RETRY_S)
                self._wake_writer.set()

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the per-session watchers and ticks the liveness machine every second."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._writer)
            task_status.started()
            while True:
                await trio.sleep(1.0)
                self.tick()

    # RegistryServant ------------------------------------------------------------

    # leadership ------------------------------------------------------------------

    def acting(self) -> bool:
        """Whether this control plane may command agents now: leading, inside its lease."""
        return self.leading and self.may_act()

    def refusal(self) -> RegistrationRefused:
        """What a standby answers an agent: where the leader is, when it knows."""
        if self.leader_rpc is None:
            return RegistrationRefused("standby; no leader yet")
        return RegistrationRefused(f"standby; leader is {self.leader_rpc}", leader=self.leader_rpc)

    def set_leader(self, rpc: str | None) -> None:
        """A standby learned whom to send agents to (None: nobody holds the lease)."""
        self.leader_rpc = rpc

    def lead(self, epoch: int) -> None:
        """Elected: every command and registration from now carries `epoch`."""
        self.epoch = epoch
        self.leader_rpc = None
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
            close, nursery = self.close_connection, self._nursery
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
        leads. Counted (`commands_refused_stale`), and this control plane steps down."""
        self.commands_refused_stale += 1
        log.warning("node %s refused a command at epoch %d as stale: %s", node_id, self.epoch, exc)
        if self.on_stale is not None:
            self.on_stale(f"node {node_id} refused epoch {self.epoch} as stale")

    async def register(
        self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle
    ) -> tuple[SessionServant, model.Settings]:
        if not self.acting():
            # Before anything of the hello is read: a standby keeps no fleet.
            agent.release()
            raise self.refusal()
        if peer.common_name != hello.node_id:
            log.warning(
                "refused registration from %s: its certificate is for node %r "
                "but it claims to be node %r",
                peer.address,
                peer.common_name,
                hello.node_id,
            )
            agent.release()
            raise RegistrationRefused(
                f"refused: the client certificate is for node {peer.common_name!r} "
                f"but the agent claims to be node {hello.node_id!r}; issue one with "
                f"`llmgw ctl cert agent {hello.node_id}` or fix node_id in agent.yaml"
            )
        now = self._clock()
        self._generations += 1
        generation = self._generations
        old = self._nodes.get(hello.node_id)
        if old is not None and old.agent is not None:
            old.agent.release()
        self._progress.pop(hello.node_id, None)  # a new session reports its fetches anew
        rec = NodeRecord(
            node_id=hello.node_id,
            liveness=core.registered(now),
            generation=generation,
            address=peer.address,
            agent_version=hello.agent_version,
            inventory=hello.inventory,
            shards=hello.shards,
            agent=agent,
            last_seen_wall=self._wall(),
            registered_at=now,
            conn_id=peer.conn_id,
        )
        self._nodes[hello.node_id] = rec
        if self.history is not None:
            self.history.record(hello.node_id, hello.inventory.usage, hello.shards)
        if hello.node_id not in self.known:
            self.known.add(hello.node_id)
            self._note_known(hello.node_id)  # written by the writer task, never waited for
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
        agent is told now, each in a task of its own bounded by the RPC deadline (the
        bridge's), so that one slow or failed node delays and fails only itself. Going
        from a declaration to none sends an empty one: nothing is declared any more."""
        old = self.engines.fingerprint if self.engines is not None else None
        new = decls.fingerprint if decls is not None else None
        self.engines = decls
        if old == new or self._nursery is None:
            return
        sent = decls if decls is not None else _engines.declare(())
        if not self.acting():
            return  # the next registrations with the leader carry it
        for rec in self.records():
            if rec.agent is not None:
                self._nursery.start_soon(self._declare, rec.node_id, rec.generation, sent)

    async def _declare(self, node_id: str, generation: int, decls: model.EngineDecls) -> None:
        rec = self._current(node_id, generation)
        if rec is None or rec.agent is None:
            return
        if not self.acting():
            return
        try:
            await rec.agent.declare_engines(self.epoch, decls)
        except StaleEpoch as exc:
            self.stale_epoch(node_id, exc)
            return
        except Exception as exc:  # that node's failure only: it converges at its next registration
            log.warning(
                "node %s: declaring engines %s failed: %s", node_id, decls.fingerprint[:12], exc
            )
            return
        self.declarations_sent += 1
        log.info("node %s: engines %s declared", node_id, decls.fingerprint[:12])

    async def _watch(self, node_id: str, generation: int, closed: trio.Event) -> None:
        await closed.wait()
        rec = self._current(node_id, generation)
        if rec is not None:
            if rec.agent is not None:
                rec.agent.release()
                rec.agent = None
            self._progress.pop(node_id, None)  # no session, no news of its fetches
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
                self._progress.pop(rec.node_id, None)
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
        inv = rec.inventory
        changes: dict[str, object] = {"usage": beat.usage}
        if beat.weights is not None:
            changes["weights"] = beat.weights
        if beat.engines is not None:
            changes["engines"] = beat.engines
        if beat.warnings is not None:
            changes["warnings"] = beat.warnings
        rec.inventory = attrs.evolve(inv, **changes)  # type: ignore[arg-type]
        if self.history is not None:
            self.history.record(node_id, beat.usage, rec.shards)
        self._apply(rec, core.HeartbeatSeen(self._clock()))

    def on_shard_status(self, node_id: str, generation: int, shard: model.ShardReport) -> None:
        rec = self._current(node_id, generation)
        if rec is None:
            return
        self.events.shard_report(node_id, shard)
        if shard.source is not None and shard.state != model.ShardState.STARTING:
            self._clear_progress(node_id, shard.source)  # the fetch's news ends with it
        others = tuple(s for s in rec.shards if s.shard_id != shard.shard_id)
        rec.shards = others if shard.state == model.ShardState.STOPPED else (*others, shard)
        self._changed()

    def on_progress(self, node_id: str, generation: int, msg: model.Progress) -> None:
        """A fetch's progress. Not a state transition: no listener hears of it, and it
        touches neither liveness nor the node's record (so it cannot reset a timer)."""
        rec = self._current(node_id, generation)
        if rec is None or rec.agent is None:
            return
        if (
            not isinstance(msg.source, str)
            or not msg.source
            or len(msg.source) > PROGRESS_SOURCE_MAX
            or msg.done_bytes < 0
            or (msg.total_bytes is not None and msg.total_bytes < 0)
        ):
            log.debug("%s: progress ignored (a source of %d characters, done %s, total %s)",
                      node_id, len(msg.source or ""), msg.done_bytes, msg.total_bytes)  # fmt: skip
            return
        table = self._progress.setdefault(node_id, OrderedDict())
        last = table.pop(msg.source, None)
        table[msg.source] = next_progress(last, msg, now=self._clock(), wall=self._wall())
        while len(table) > PROGRESS_PER_NODE:
            table.popitem(last=False)

    def _clear_progress(self, node_id: str, source: str) -> None:
        table = self._progress.get(node_id)
        if table is not None:
            table.pop(source, None)
            if not table:
                del self._progress[node_id]

    def progress(self, node_id: str) -> dict[str, FetchProgress]:
        """The node's fetches heard from in the last PROGRESS_SILENCE_S, by source."""
        now = self._clock()
        table: Mapping[str, FetchProgress] = self._progress.get(node_id) or {}
        return {s: p for s, p in table.items() if now - p.at < PROGRESS_SILENCE_S}

    def _expire_progress(self, now: float) -> None:
        for node_id in list(self._progress):
            table = self._progress[node_id]
            for source in [s for s, p in table.items() if now - p.at >= PROGRESS_SILENCE_S]:
                del table[source]
            if not table:
                del self._progress[node_id]

    def tick(self) -> None:
        now = self._clock()
        self._expire_progress(now)
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
        return [
            model.NodeView(
                node_id=rec.node_id,
                state=rec.liveness.state.value,
                state_reason=rec.liveness.reason,
                since=now_wall - (now_clock - rec.liveness.since),
                last_seen=rec.last_seen_wall,
                address=rec.address,
                agent_version=rec.agent_version,
                inventory=rec.inventory,
                shards=rec.shards,
                cordoned=self.cordoned.get(rec.node_id),
                draining=self.draining.get(rec.node_id),
                generation=rec.generation,
            )
            for rec in sorted(self._nodes.values(), key=lambda r: r.node_id)
        ]

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
            rec.shards = tuple(s for s in rec.shards if s.shard_id != shard_id)
            self._changed()
