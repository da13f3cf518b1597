"""The node registry: who is connected, what they have, and whether they are alive.

The registry is the control plane's `RegistryServant`: the RPC boundary hands
it registrations (with the peer's certificate CN and an `AgentHandle`), and it
feeds the pure liveness machine in llmgw.core with registrations, heartbeats,
lost connections and clock ticks, logging every state change with its reason.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import trio

from llmgw import core, model
from llmgw.cp import _engines
from llmgw.cp._events import EventLog
from llmgw.cp._history import History
from llmgw.errors import ConfigError, NotFound, RegistrationRefused, UsageError
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
        self._registry.on_heartbeat(self._node_id, self._generation, beat)

    async def shard_status(self, shard: model.ShardReport) -> None:
        self._registry.on_shard_status(self._node_id, self._generation, shard)

    async def progress(self, progress: model.Progress) -> None:
        self._registry.on_progress(self._node_id, self._generation, progress)


# A fetch's progress (issue 12). Not a state transition: it is kept beside the node's
# record, never in it, and changes nothing anyone plans from.
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
    ) -> None:
        self.policy = policy
        self.forget_after_s = forget_after_s  # a node lost this long is forgotten; None: never
        self.epoch = epoch
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
        self._overrides: Path | None = None
        # Every node that ever registered and was not forgotten: whom a restarted
        # control plane waits for before it acts (the reconciler's settle).
        self.known: set[str] = set()
        self._known_path: Path | None = None
        self._known_dirty = False
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

    def load_overrides(self, path: Path) -> None:
        """Operator overrides (cordons, drains) survive a restart: they live in the state dir."""
        self._overrides = path
        try:
            data = json.loads(path.read_text())
            self.cordoned = {str(k): str(v) for k, v in data.get("cordoned", {}).items()}
            self.draining = {str(k): str(v) for k, v in data.get("draining", {}).items()}
        except FileNotFoundError:
            self.cordoned, self.draining = {}, {}
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{path}: unreadable node overrides: {exc}") from None

    def cordon(self, node_id: str, reason: str | None) -> None:
        self.cordoned[node_id] = reason or "cordoned by an operator"
        self._save_overrides()
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
        self._save_overrides()
        log.info("node %s uncordoned (lifted: %s)", node_id, ", ".join(lifted))
        self._changed()
        return lifted

    def drain(self, node_id: str, reason: str | None) -> None:
        """Move what runs on the node elsewhere, replacement first, and place nothing there."""
        self.draining[node_id] = reason or "drained by an operator"
        self._save_overrides()
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
            self._save_known()  # now, not on the next tick: a restart must not wait for it
        had = self.cordoned.pop(node_id, None), self.draining.pop(node_id, None)
        if any(v is not None for v in had):
            self._save_overrides()
        reason = f": {rec.liveness.reason}" if rec is not None else ""
        log.info("node %s forgotten (%s; it was %s%s)", node_id, why, was, reason)
        self.events.node_state(node_id, was, "forgotten", why)
        self._changed()
        return was

    def load_known(self, path: Path) -> None:
        """The known nodes survive a restart: a JSON list in the state dir."""
        self._known_path = path
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            self.known = set()
            return
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{path}: unreadable list of known nodes: {exc}; fix or delete it (the control "
                "plane then waits reconcile_settle_s after its start instead)"
            ) from None
        nodes = data.get("nodes") if isinstance(data, dict) else None
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise ConfigError(
                f'{path}: expected {{"nodes": [node ids]}}, got {str(data)[:80]!r}; fix or '
                "delete it (the control plane then waits reconcile_settle_s after its start)"
            )
        self.known = set(nodes)

    def _save_known(self) -> None:
        self._known_dirty = False
        if self._known_path is None:
            return
        tmp = self._known_path.with_name(self._known_path.name + ".tmp")
        tmp.write_text(json.dumps({"nodes": sorted(self.known)}, indent=1))
        os.replace(tmp, self._known_path)

    def _save_overrides(self) -> None:
        if self._overrides is None:
            return
        tmp = self._overrides.with_name(self._overrides.name + ".tmp")
        body = {"cordoned": self.cordoned, "draining": self.draining}
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self._overrides)

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the per-session watchers and ticks the liveness machine every second."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await trio.sleep(1.0)
                self.tick()

    # RegistryServant ------------------------------------------------------------

    async def register(
        self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle
    ) -> tuple[SessionServant, model.Settings]:
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
        )
        self._nodes[hello.node_id] = rec
        if self.history is not None:
            self.history.record(hello.node_id, hello.inventory.usage, hello.shards)
        if hello.node_id not in self.known:
            self.known.add(hello.node_id)
            self._known_dirty = True  # written on the next tick: a storm writes it once
        before = old.liveness.state.value if old else "new"
        log.info(
            "node %s: %s -> ready (registered from %s, %d shards)",
            hello.node_id,
            before,
            peer.address,
            len(hello.shards),
        )
        self.events.node_state(hello.node_id, before, "ready", f"registered from {peer.address}")
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
        for rec in self.records():
            if rec.agent is not None:
                self._nursery.start_soon(self._declare, rec.node_id, rec.generation, sent)

    async def _declare(self, node_id: str, generation: int, decls: model.EngineDecls) -> None:
        rec = self._current(node_id, generation)
        if rec is None or rec.agent is None:
            return
        try:
            await rec.agent.declare_engines(self.epoch, decls)
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
        rec.shards = others if shard.state == "stopped" else (*others, shard)
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
        if self._known_dirty:
            self._save_known()
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
        rec = self._nodes.get(node_id)
        return rec.agent if rec is not None else None

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
