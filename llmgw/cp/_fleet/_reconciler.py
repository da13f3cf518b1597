"""The reconciler's I/O shell: observe, plan (pure), act, and again.

Every `interval_s` (and on every change) it turns the registry's shard
reports into observations, asks `core.reconcile` what to do, places each Start
with `core.place` (the weights keyed and sized as `core.weights_key` and `sizes` say:
a fetched source's cache name, its size from llmgw/cp/_weights/_sizes.py), and sends
start/stop commands through the agents'
capabilities. Decide, then act: a pass plans synchronously, hands each start
and stop to a task of its own in the reconciler's nursery, each bounded by a
deadline, and returns; the next pass plans again from what is then observed.
Starts still in flight count as pending (their model's replicas, their cards,
their ports), so no pass starts the same replica twice, and a start that
failed or timed out stops counting as soon as its task ends. One agent that
accepts a call and never answers holds up only its own task.

After the control plane starts it does not act until the fleet has registered
again (the settle, llmgw/cp/_fleet/_settle.py): agents re-register first, and their
replicas are adopted rather than started again.

It acts only while the registry may (`registry.acting()`: this control plane
leads and is inside its lease, llmgw/cp/_fleet/_leader.py): a standby's passes plan
nothing and say nothing. The settle starts again from each election
(`elected()`), not from the process start: a standby that takes over waits
for the fleet to register with it before it acts.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping

import attrs
import trio

from llmgw import core, model
from llmgw.core import (
    DesiredModel,
    ObservedShard,
    Plan,
    ReplicaView,
    Start,
    Stop,
)
from llmgw.cp._fleet._backoffs import ModelBackoffs
from llmgw.cp._fleet._catalog import Catalog, CatalogModel, Profile
from llmgw.cp._fleet._launch import shard_specs
from llmgw.cp._fleet._memory_watch import MemoryWatch
from llmgw.cp._fleet._placing import Placing, Unplaced
from llmgw.cp._fleet._priorities import Priorities
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._retiring import Retiring
from llmgw.cp._fleet._rollouts import Rollouts
from llmgw.cp._fleet._settle import Settle
from llmgw.cp._fleet._shards import PORTS
from llmgw.cp._fleet._wake import Wakeup
from llmgw.cp._fleet._wedged import WedgedReplicas
from llmgw.cp._weights._sizes import Measuring
from llmgw.errors import DeadlineExceeded, LlmgwError, StaleEpoch

log = logging.getLogger("llmgw.cp.reconciler")

FAILED_START_VISIBLE_S = 600.0  # a start that never reached its agent stays in `replicas()`
# Pokes are coalesced: a pass starts no sooner after the last one than COALESCE_S, or
# COALESCE_COST times what the last pass took, whichever is longer. A register storm pokes
# once per registration, and each pass reads the whole fleet: one pass per poke cost a
# fifth of a 10,000-agent storm's CPU; this bounds the reconciler to about a fifth of a
# core whatever the fleet's size, and delays a lone change by nothing (the gap has passed).
COALESCE_S = 0.2
COALESCE_COST = 4.0


@attrs.frozen
class _Pending:
    """A replica whose start is in flight: counted, and its cards and ports taken."""

    model_name: str
    since: float
    ranks: tuple[tuple[str, model.ShardSpec], ...]  # (node, spec), the leader first


def desired(
    catalog: Catalog, count: Callable[[CatalogModel], int] | None = None
) -> list[DesiredModel]:
    """The catalog as the plan wants it: each model's replicas (`count`: the
    autoscaler's, llmgw/cp/_fleet/_autoscaler.py; else the catalog's `replicas`), and
    its profiles' fingerprints with their startup timeouts."""
    out = []
    for m in catalog.models:
        prints = catalog.fingerprints(m)
        timeouts = {fp: p.startup_timeout_s for fp, p in zip(prints, m.profiles, strict=True)}
        wanted = count(m) if count is not None else m.replicas
        out.append(DesiredModel(m.name, wanted, prints, timeouts, m.rollout.policy()))
    return out


class Reconciler:
    def __init__(
        self,
        registry: NodeRegistry,
        catalog: Callable[[], Catalog],
        *,
        interval_s: float = 2.0,
        settle_s: float = 10.0,
        stop_grace_s: float = 30.0,
        drain_timeout_s: float = 300.0,
        unhealthy_replace_s: float = 30.0,
        engine_ports: tuple[int, int] = PORTS,
        clock: Callable[[], float] = trio.current_time,
        sizes: Callable[[str], int | Measuring | None] | None = None,
        wake: Wakeup | None = None,
        retiring: Retiring | None = None,
        in_flight: Callable[[str, str], int | None] | None = None,
        backoff: core.BackoffPolicy | None = None,
        rollouts: Rollouts | None = None,
        wedged: Callable[[], Mapping[str, str]] | None = None,
        count: Callable[[CatalogModel], int] | None = None,
        queued: Callable[[str], int | None] | None = None,
        lower: Callable[[str, int, str], None] | None = None,
    ) -> None:
        self._registry = registry
        self._catalog = catalog
        # Each model's replicas now: the autoscaler's count, else the catalog's.
        self.count: Callable[[CatalogModel], int] = count or (lambda m: m.replicas)
        # Placement's input (llmgw/cp/_fleet/_placing.py), with each source's size.
        self.placing = Placing(registry, self._flying, clock, sizes)
        # A full fleet: idle lower-priority replicas make room (llmgw/cp/_fleet/_priorities.py).
        self.priorities = Priorities(
            registry, self.placing, in_flight=in_flight,
            queued=queued or (lambda name: None), lower=lower or (lambda name, n, why: None),
        )  # fmt: skip
        # Poked by whatever has news (the registry, the sizes, the catalog:
        # llmgw/cp/_fleet/_wake.py)
        self._wake = wake if wake is not None else Wakeup()
        self.interval_s = interval_s
        self._settle = Settle(settle_s, clock)
        self.stop_grace_s = stop_grace_s
        self._clock = clock
        self.unhealthy_replace_s = unhealthy_replace_s
        self._engine_ports = engine_ports  # for a profile with no port_range
        self._guard_held_at: float | None = None  # the last pass that found the fleet away
        self._passes = 0
        self._pass_cost_s = 0.0  # what the last pass took (wall clock)
        self._first_seen: dict[str, float] = {}
        self._pending: dict[str, _Pending] = {}  # replica id -> its start, in flight
        self._failed_starts: dict[str, ReplicaView] = {}  # replica id -> why it never started
        self._unhealthy_since: dict[str, float] = {}  # shard id -> first seen unhealthy
        self._stopping: set[tuple[str, str]] = set()
        self._unplaced: dict[str, Unplaced] = {}
        self._last_plan = Plan((), ())
        self._last_notes: tuple[str, ...] = ()
        self._nursery: trio.Nursery | None = None
        # Draining (the rule: llmgw/core/_drain.py). `in_flight(replica id, rank-0 node)`
        # is the router's count (None: no router here, so unknown); `retiring` the
        # replicas retiring, which the endpoint list reads (llmgw/cp/_fleet/_retiring.py).
        self.drain_timeout_s = drain_timeout_s
        self._in_flight = in_flight
        self._retiring = retiring if retiring is not None else Retiring()
        self.backoff = ModelBackoffs(backoff)  # per model (llmgw/cp/_fleet/_backoffs.py)
        # Rolling changed models (llmgw/cp/_fleet/_rollouts.py); `_models` is the catalog
        # the last pass acted on: server.yaml's, with undone models pinned.
        self.rollouts = rollouts if rollouts is not None else Rollouts()
        self._models: Catalog | None = None
        self.memory = MemoryWatch(registry)  # shared cards: llmgw/cp/_fleet/_memory_watch.py
        self.wedged = WedgedReplicas(self.memory.with_routers(wedged))  # _wedged.py

    def __repr__(self) -> str:
        return f"<Reconciler {self.statistics()}>"

    def statistics(self) -> dict[str, int]:
        """`passes`: completed passes (plan, then act or wait); a test that waits for one
        more knows the reconciler has looked at what it just did. `settling`: 1 while
        it waits for the fleet to re-register after its start; `holding`: 1 while the
        guard holds (most of the fleet away, or just back)."""
        return {
            "passes": self._passes,
            "pokes": self._wake.pokes,
            "settling": int(not self._settle.settled),
            "holding": int(self._last_plan.holding),
            "replicas": len(self._last_plan.replicas),
            "pending": len(self._pending),
            "stopping": len(self._stopping),
            "unplaced": len(self._unplaced),
        }

    def poke(self) -> None:
        """Something changed (a report, a catalog reload): plan again soon."""
        self._wake.poke()

    def elected(self) -> None:
        """This control plane took the lease: settle from now, waiting for the nodes known
        now (the store's, read at the election), and forget the last term's plans."""
        self._settle.begin(self._registry.known)
        self._guard_held_at = None
        self.placing.clear()
        self._unhealthy_since.clear()
        self._retiring.clear()
        self._unplaced.clear()
        self.backoff.clear()
        self._last_plan = Plan((), ())
        self.poke()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._settle.begin(self._registry.known)  # known before this start
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.rollouts.writer)
            task_status.started()
            gap = 0.0
            while True:
                await self._wake.wait(max(0.0, self.interval_s - gap))
                began = time.perf_counter()
                try:
                    await self.tick()
                except LlmgwError as exc:
                    log.error("reconciling failed: %s; trying again", exc)
                self._pass_cost_s = time.perf_counter() - began
                # Pokes meanwhile (a storm's registrations) wait for the next pass together.
                gap = max(COALESCE_S, COALESCE_COST * self._pass_cost_s)
                await trio.sleep(gap)

    # observe -----------------------------------------------------------------------------

    def observe(self) -> tuple[list[ObservedShard], dict[str, str]]:
        return core.observed_shards(self._registry.records())

    def plan(self) -> Plan:
        now = self._clock()
        shards, states = self.observe()
        # Expected but not registered (since our start): away, for the guard.
        for node_id in self._registry.known:
            states.setdefault(node_id, "absent")
        ready_since = {
            rec.node_id: rec.liveness.since
            for rec in self._registry.records()
            if rec.liveness.state is core.NodeState.READY
        }
        seen = {s.replica_id for s in shards if s.replica_id}
        # Only replicas still reported or in flight: the map must not grow for ever.
        self._first_seen = {r: self._first_seen.get(r, now) for r in seen | self._pending.keys()}
        # A start in flight counts until its replica is reported, not twice after.
        pending: dict[str, int] = {}
        for replica_id, p in self._pending.items():
            if replica_id not in seen:
                pending[p.model_name] = pending.get(p.model_name, 0) + 1
        sick = {s.shard_id for s in shards if s.state == model.ShardState.UNHEALTHY}
        self._unhealthy_since = {
            sid: self._unhealthy_since.get(sid, now) for sid in sick
        }  # a shard that recovers starts from zero next time
        file_catalog = self._catalog()
        catalog = self._models = self.rollouts.catalog(file_catalog)
        wanted = desired(catalog, self.count)
        current = {d.name: d.fingerprints for d in wanted}
        stale = {
            s.replica_id
            for s in shards
            if s.replica_id
            and s.fingerprint not in current.get(s.model_name or "", (s.fingerprint,))
        }
        drain = core.drain_input(shards, self._registry.draining, self._in_flight,
                                 self._retiring.since(), self.drain_timeout_s,
                                 also=stale | _too_many(shards, wanted),
                                 replicas=core.gpu_drains(self._registry.records()))  # fmt: skip
        controls = self.rollouts.controls(self._unplaced)
        self.memory.note(seen)
        self.wedged.note(seen, now)

        def reconcile() -> Plan:
            return core.reconcile(
                wanted, shards, states, self._first_seen, now,
                pending=pending, drain=drain,
                unhealthy_since=self._unhealthy_since,
                unhealthy_replace_s=self.unhealthy_replace_s,
                guard_held_at=self._guard_held_at, ready_since=ready_since,
                settle_s=self._settle.settle_s,
                backoff=self.backoff.current(), backoff_policy=self.backoff.policy,
                rollouts=controls, wedged=self.wedged.reasons,
                settling=not self._settle.settled,
                retire_first=self.priorities.retire_first(),
            )  # fmt: skip

        plan = reconcile()
        others = self._failed_starts.keys() | self._pending.keys()
        again = self.backoff.note(plan, {d.name for d in wanted}, others, now)
        if self._settle.settled and self._registry.acting():
            again = self.rollouts.note(plan, catalog, file_catalog, self.count) or again
            controls = self.rollouts.controls(self._unplaced)
        if again:
            plan = reconcile()  # a failure seen in this pass delays its own replacement
        if plan.cut_off:
            self._guard_held_at = now
        self.wedged.planned(plan, now)
        retiring = [v.replica_id for v in plan.replicas if v.state == core.ReplicaState.RETIRING]
        self._retiring.note(retiring, now)
        return plan

    def backoffs(self) -> dict[str, core.Backoff]:
        """The models whose starts the backoff holds back (`ctl replicas`, the pages)."""
        wanted = {m.name: self.count(m) for m in self._catalog().models}  # undo keeps the count
        return self.backoff.holding(self._last_plan.replicas, wanted)

    def retiring(self) -> frozenset[str]:
        """Replicas on draining nodes whose replacement is ready: the router leaves them out."""
        return self._retiring.replicas()

    # act -----------------------------------------------------------------------------------

    async def tick(self) -> None:
        """One pass: plan, then hand the actions to tasks; it never waits on an agent."""
        try:
            if not self._registry.acting():
                return  # a standby (or a leader past its lease) plans nothing, says nothing
            plan = self.plan()
            self._last_plan = plan
            if plan.notes != self._last_notes:
                for note in plan.notes:
                    log.warning("%s", note)
                self._last_notes = plan.notes
            if self._settle.done(self._registry.records(), self._registry.known):
                self._act(plan)
                catalog = self._models if self._models is not None else self._catalog()
                self.priorities.after_pass(catalog, plan, self._unplaced, self.count)
        finally:
            self._passes += 1
        await trio.lowlevel.checkpoint()

    def _act(self, plan: Plan) -> None:
        catalog = self._models if self._models is not None else self._catalog()
        starts = [a for a in plan.actions if isinstance(a, Start)]
        for action in plan.actions:
            if isinstance(action, Stop):
                self._stop_soon(action)
        placed_models = set()
        placer = self.placing.placer() if starts else None
        for action in starts:
            m = catalog.model(action.model_name)
            if m is not None and placer is not None:
                self._start_soon(catalog, m, placer)
                placed_models.add(m.name)
        for name in list(self._unplaced):
            if catalog.model(name) is None or (
                name not in {a.model_name for a in starts} and name not in placed_models
            ):
                self._unplaced.pop(name, None)
        now = self._clock()
        for replica_id, view in list(self._failed_starts.items()):
            old = now - view.first_seen > FAILED_START_VISIBLE_S
            if old or catalog.model(view.model_name) is None:
                del self._failed_starts[replica_id]

    def _stop_soon(self, action: Stop) -> None:
        key = (action.node_id, action.shard_id)
        if key in self._stopping or self._nursery is None:
            return
        self._stopping.add(key)
        self._nursery.start_soon(self._stop, action)

    async def _stop(self, action: Stop) -> None:
        try:
            agent = self._registry.agent(action.node_id)
            if agent is None:
                return
            log.info("stopping shard %s on %s: %s", action.shard_id, action.node_id, action.reason)
            self._note_stop(action)
            # Bounded by the handle: the grace, plus its deadline (llmgw/rpc Deadlines).
            await agent.stop_shard(self._registry.epoch, action.shard_id, self.stop_grace_s)
            self._registry.forget_shard(action.node_id, action.shard_id)
        except StaleEpoch as exc:
            self._registry.stale_epoch(action.node_id, exc)
        except DeadlineExceeded as exc:
            self.placing.unanswered(action.node_id)
            log.warning("stopping %s: node %s %s", action.shard_id, action.node_id, exc)
            self._registry.events.command_stuck(
                action.node_id, f"node {action.node_id} {exc}", shard_id=action.shard_id
            )
        except LlmgwError as exc:
            log.warning("stopping %s on %s failed: %s", action.shard_id, action.node_id, exc)
        finally:
            self._stopping.discard((action.node_id, action.shard_id))
            self.poke()

    def _note_stop(self, action: Stop) -> None:
        _note_stop(self._registry, self._last_plan, action)

    def _flying(self) -> list[tuple[str, model.ShardSpec]]:
        """Every rank of the starts in flight: (node, spec)."""
        return [rank for p in self._pending.values() for rank in p.ranks]

    def try_place(
        self, m: CatalogModel, placer: core.Placer | None = None
    ) -> tuple[Profile, core.Placement] | Unplaced:
        return self.placing.try_place(m, placer)

    def _start_soon(self, catalog: Catalog, m: CatalogModel, placer: core.Placer) -> None:
        """Place one replica now (synchronously, so the pass's next placement sees its
        cards taken) and send its start in a task of its own."""
        if self.placing.measuring(m):
            # Its size comes within the size task's deadline, and that round pokes us:
            # placing now could start a fetch onto a disk that cannot hold it.
            log.debug("placing %s waits for the size of %s", m.name, m.source)
            return
        found = self.try_place(m, placer)
        if isinstance(found, Unplaced):
            if self._unplaced.get(m.name) != found:
                log.warning("cannot place %s:\n  %s", m.name, "\n  ".join(found.reasons))
            self._unplaced[m.name] = found
            return
        self._unplaced.pop(m.name, None)
        profile, where = found
        placer.add(where)  # the next placement of this pass sees these cards taken
        replica_id = f"{m.name}-{secrets.token_hex(3)}"
        records = {r.node_id: r for r in self._registry.records()}
        specs = shard_specs(catalog, m, profile, where, replica_id, records, flying=self._flying(),
                            engine_ports=self._engine_ports)  # fmt: skip
        now = self._clock()
        log.info(
            "starting replica %s of %s on %s",
            replica_id,
            m.name,
            ", ".join(f"{r.node_id}{list(r.gpu_indexes) or ''}" for r in where.ranks),
        )
        if self._nursery is None:  # not running: nothing can be sent
            return
        self._pending[replica_id] = _Pending(m.name, now, tuple(specs))
        self.backoff.started(replica_id, m.name)
        self._first_seen[replica_id] = now
        self._nursery.start_soon(self._start, replica_id)

    async def _start(self, replica_id: str) -> None:
        """Every rank, the leader first, each call bounded; on any failure the ranks
        already started are stopped, and the next pass plans from what is reported."""
        p = self._pending[replica_id]
        started: list[tuple[str, str]] = []
        failure: str | None = None
        blame = True  # the model's failure, for its backoff; not a node gone or our epoch
        try:
            for node_id, spec in p.ranks:
                agent = self._registry.agent(node_id)
                if agent is None:
                    failure = f"node {node_id} went away before rank {spec.rank} was started"
                    blame = False
                    break
                try:
                    # Bounded by the handle (llmgw/rpc Deadlines, startShard 10 s).
                    report = await agent.start_shard(self._registry.epoch, spec)
                except StaleEpoch as exc:
                    self._registry.stale_epoch(node_id, exc)
                    failure = f"node {node_id} refused epoch {self._registry.epoch} as stale"
                    blame = False
                    break
                except DeadlineExceeded as exc:
                    self.placing.unanswered(node_id)
                    failure = f"node {node_id} {exc}"
                    self._registry.events.command_stuck(node_id, failure, shard_id=spec.shard_id,
                                                        replica_id=replica_id,
                                                        model_name=p.model_name)  # fmt: skip
                    break
                except LlmgwError as exc:
                    failure = f"starting rank {spec.rank} on {node_id} failed: {exc}"
                    break
                started.append((node_id, spec.shard_id))
                self._registry.note_shard(node_id, report)
        finally:
            del self._pending[replica_id]
        if failure is None:
            self.poke()  # plan again from what the agents answered
            return
        # No poke: an agent that refuses at once would be asked again in a busy loop;
        # the next pass, `interval_s` on, plans from what is observed.
        log.warning("replica %s of %s: %s", replica_id, p.model_name, failure)
        self._failed_starts[replica_id] = ReplicaView(
            replica_id, p.model_name, core.ReplicaState.FAILED, tuple(n for n, _ in p.ranks),
            p.since, False,
            failure,
        )  # fmt: skip
        if blame:
            self.backoff.failed(p.model_name, replica_id, failure, self._clock())
            self.rollouts.failed(p.model_name, replica_id)
        for node_id, shard_id in started:
            self._stop_soon(Stop(node_id, shard_id, f"replica {replica_id}: {failure}"))

    # views ---------------------------------------------------------------------------------

    def replicas(self) -> list[ReplicaView]:
        """The last plan's replicas, then starts in flight not reported yet, then starts
        that never reached their agent (with why), and wedged ones, for 10 minutes."""
        return self.memory.annotate(_views(self._last_plan, self._pending,
                                           self.wedged.views() | self._failed_starts))  # fmt: skip

    def unplaced(self) -> list[Unplaced]:
        return list(self._unplaced.values())

    def live(self, model_name: str) -> int:
        """The model's replicas alive in the last plan, with its starts in flight."""
        flying = sum(1 for p in self._pending.values() if p.model_name == model_name)
        return _alive(self._last_plan, model_name) + flying


def _alive(plan: Plan, model_name: str) -> int:
    return sum(
        1
        for v in plan.replicas
        if v.model_name == model_name and v.state in core.ALIVE_REPLICA_STATES
    )


def _too_many(shards: list[ObservedShard], wanted: list[DesiredModel]) -> set[str]:
    """Every replica of a model that has more than it wants: the plan retires some, and
    their in-flight counts are what a retirement waits on."""
    counts = {d.name: d.replicas for d in wanted}
    by_model: dict[str, set[str]] = {}
    for s in shards:
        if s.replica_id and s.model_name in counts:
            by_model.setdefault(s.model_name, set()).add(s.replica_id)
    return {r for name, ids in by_model.items() if len(ids) > counts[name] for r in ids}


def _views(
    plan: Plan, pending: dict[str, _Pending], failed_starts: dict[str, ReplicaView]
) -> list[ReplicaView]:
    views = list(plan.replicas)
    shown = {v.replica_id for v in views}
    for replica_id, p in sorted(pending.items()):
        if replica_id not in shown:
            nodes = tuple(n for n, _ in p.ranks)
            why = "start sent, not answered yet"
            views.append(ReplicaView(replica_id, p.model_name, core.ReplicaState.STARTING,
                                     nodes, p.since, False, why))  # fmt: skip
    views += [v for r, v in sorted(failed_starts.items()) if r not in shown]
    return views


def _note_stop(registry: NodeRegistry, plan: Plan, action: Stop) -> None:
    """Keep why, for `ctl replicas` and `ctl events` (llmgw/cp/_observe/_events.py)."""
    rec = registry.record(action.node_id)
    shards = rec.shards if rec is not None else ()
    shard = next((s for s in shards if s.shard_id == action.shard_id), None)
    replica_id = shard.replica_id if shard is not None else None
    view = next((v for v in plan.replicas if v.replica_id == replica_id), None)
    registry.events.replica_stopped(
        node_id=action.node_id,
        shard_id=action.shard_id,
        reason=action.reason,
        replica_id=replica_id,
        model_name=shard.model_name if shard is not None else None,
        state=view.state if view is not None else None,
    )
