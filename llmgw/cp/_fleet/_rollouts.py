"""The reconciler's rollouts: what the pure rule (llmgw/core/_rollout.py) needs remembered,
what the operator said (pause, resume, undo), and what the store keeps of both.

Per model, two things: its last settled version (the fingerprints and the catalog
entry of the last time every replica ran one version and enough were ready) and
its rollout, if one has begun since (`core.RolloutRecord`: from which version to
which, paused, the failures counted, how far it is). A rollout begins on the
first acting pass whose plan rolls the model; it counts each new replica that
fails once; it finishes when the rule says done, and its version is then the
settled one.

Undo turns a rollout around: the model runs its previous catalog entry (the
`pin`, kept with it) while server.yaml still says what was undone; an edit of
the model in server.yaml (another fingerprint) lets the pin go and rolls to the
edit. Undo again rolls forward to what server.yaml says.

Everything is read from the store at each election (`load`) and written by a
task of its own (`writer`) whenever it changes; an operator's command is
written before the admin API answers (`flush`). The fleet is the record of
what runs: a restarted control plane rebuilds old and new replicas from the
agents' reports, so the store's part is only what the fleet cannot say.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from llmgw import config, core
from llmgw.core import Plan, RolloutPhase, RolloutRecord
from llmgw.cp._fleet._catalog import Catalog, CatalogModel
from llmgw.cp._fleet._placing import Unplaced
from llmgw.errors import ConfigError, LlmgwError, UsageError
from llmgw.store import Store

log = logging.getLogger("llmgw.cp.reconciler")

STORE_RETRY_S = 2.0
FAILURE_STATES = frozenset(
    {core.ReplicaState.FAILED, core.ReplicaState.TIMED_OUT, core.ReplicaState.INCOMPLETE}
)


@attrs.frozen
class Version:
    fingerprints: tuple[str, ...]
    spec: dict[str, Any]  # the catalog entry, unstructured


@attrs.frozen
class Pin:
    """An undo in force: run `version` while server.yaml's entry has `against`."""

    version: Version
    against: tuple[str, ...]


@attrs.define
class ModelRollout:
    settled: Version | None = None
    record: RolloutRecord | None = None
    previous: Version | None = None  # the version the record rolls from, for undo
    pin: Pin | None = None

    def body(self) -> str:
        return json.dumps(config.unstructure(self), sort_keys=True)


class Rollouts:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall clock: the store keeps these past this process
        self._models: dict[str, ModelRollout] = {}
        self._counted: set[str] = set()  # failed replica ids already counted
        self._store: Store | None = None
        self._dirty: set[str] = set()
        self._wake_writer = trio.Event()
        self._flush_lock = trio.Lock()

    def __repr__(self) -> str:
        active = [n for n, r in self._models.items() if _active(r.record)]
        return f"<Rollouts active {sorted(active)}>"

    # the store -------------------------------------------------------------------------

    async def load(self, store: Store) -> None:
        rows = await store.rollouts()
        models = {}
        for name, body in rows.items():
            try:
                models[name] = config.structure(json.loads(body), ModelRollout, f"rollout {name}")
            except (ConfigError, ValueError) as exc:
                log.warning("the store's rollout of %s cannot be read, dropped: %s", name, exc)
        self._store = store
        self._models = models
        self._dirty.clear()
        self._counted.clear()
        if models:
            log.info("from the store: %d models' rollouts", len(models))

    def _changed(self, name: str) -> None:
        self._dirty.add(name)
        self._wake_writer.set()

    async def flush(self) -> None:
        async with self._flush_lock:
            store = self._store
            if store is None:
                self._dirty.clear()
                return
            while self._dirty:
                name = min(self._dirty)
                self._dirty.discard(name)
                try:
                    if name in self._models:
                        await store.put_rollout(name, self._models[name].body())
                    else:
                        await store.delete_rollout(name)
                except BaseException:
                    self._dirty.add(name)
                    raise

    async def writer(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer = trio.Event()
            try:
                await self.flush()
            except LlmgwError as exc:
                log.warning("the store: cannot write %d rollouts (retried in %g s): %s",
                            len(self._dirty), STORE_RETRY_S, exc)  # fmt: skip
                await trio.sleep(STORE_RETRY_S)
                self._wake_writer.set()

    # the plan ---------------------------------------------------------------------------

    def catalog(self, catalog: Catalog) -> Catalog:
        """The catalog the fleet runs: an undone model runs its pinned entry while
        server.yaml still has what was undone (the reconciler acts on it, the endpoint
        list names it)."""
        out = []
        for m in catalog.models:
            mr = self._models.get(m.name)
            if mr is not None and mr.pin is not None and mr.pin.against == catalog.fingerprints(m):
                out.append(config.structure(mr.pin.version.spec, CatalogModel, f"undo of {m.name}"))
            else:
                out.append(m)
        # The splits and the declared engine versions stay: the engines are the fleet's.
        return attrs.evolve(catalog, models=tuple(out))

    def _drop_lapsed_pins(self, catalog: Catalog) -> None:
        for m in catalog.models:
            mr = self._models.get(m.name)
            if mr is not None and mr.pin is not None and mr.pin.against != catalog.fingerprints(m):
                log.info("%s: server.yaml changed since its undo; rolling to it", m.name)
                mr.pin = None
                self._changed(m.name)

    def controls(self, unplaced: Mapping[str, Unplaced]) -> dict[str, core.RolloutControl]:
        """The rule's input per model: the last pass's refusal, with the nodes refused only
        while they install the declared engine (the rule then waits instead of taking it
        as no room)."""
        out = {}
        for name, mr in self._models.items():
            rec = mr.record
            if rec is not None:
                u = unplaced.get(name)
                out[name] = core.RolloutControl(
                    paused=rec.paused, failures=rec.failures, no_room=u is not None,
                    active=_active(rec), installing=u.installing if u is not None else (),
                )  # fmt: skip
        for name, u in unplaced.items():
            out.setdefault(name, core.RolloutControl(no_room=True, installing=u.installing))
        return out

    def failed(self, model_name: str, replica_id: str) -> None:
        """A new replica of a model being rolled out failed (counted once)."""
        mr = self._models.get(model_name)
        if mr is None or not _active(mr.record) or replica_id in self._counted:
            return
        self._counted.add(replica_id)
        assert mr.record is not None
        mr.record = attrs.evolve(mr.record, failures=mr.record.failures + 1)
        log.warning("%s: a new replica failed during its rollout (%d failures)",
                    model_name, mr.record.failures)  # fmt: skip
        self._changed(model_name)

    def note(
        self,
        plan: Plan,
        catalog: Catalog,
        file_catalog: Catalog,
        count: Callable[[CatalogModel], int] | None = None,
    ) -> bool:
        """After an acting pass on `catalog` (this class's `catalog(file_catalog)`): begin,
        count, finish; keep each model's settled version. True when a rollout began or a
        failure was counted: the pass plans again with it."""
        self._drop_lapsed_pins(file_catalog)
        now = self._clock()
        steps = {s.model_name: s for s in plan.rollouts}
        again = False
        for m in catalog.models:
            mr = self._models.setdefault(m.name, ModelRollout())
            fps = catalog.fingerprints(m)
            step = steps.get(m.name)
            rec = mr.record
            if step is not None and (rec is None or rec.to != fps or not _active(rec)):
                # This pass's step was planned without the new record: plan again.
                self._begin(m, mr, fps, now)
                again = True
                continue
            rec = mr.record
            if rec is not None and _active(rec) and rec.to == fps:
                for v in plan.replicas:
                    if (v.model_name == m.name and not v.stale and v.state in FAILURE_STATES
                            and v.replica_id not in self._counted):  # fmt: skip
                        self.failed(m.name, v.replica_id)
                        again = True
                rec = mr.record
                assert rec is not None
                if step is not None and (step.phase, step.status) != (rec.phase, rec.status):
                    finished = now if step.phase is RolloutPhase.DONE else None
                    mr.record = attrs.evolve(rec, phase=step.phase, status=step.status,
                                             finished_at=finished)  # fmt: skip
                    self._changed(m.name)
                    if step.phase is not RolloutPhase.ROLLING or rec.phase != step.phase:
                        log.info("%s: rollout %s", m.name, step.status)
            # Settled from the pass that finishes a rollout on: an edit in the next
            # pass's gap would otherwise record the version before as its `previous`.
            done = step is None or step.phase is RolloutPhase.DONE
            if done and _settles(plan, m, count(m) if count else m.replicas):
                version = Version(fps, config.unstructure(m))
                if mr.settled != version:
                    mr.settled = version
                    self._changed(m.name)
        for name in [n for n in self._models if catalog.model(n) is None]:
            del self._models[name]  # it left the catalog: nothing to roll or undo
            self._changed(name)
        keep = {v.replica_id for v in plan.replicas}
        self._counted &= keep
        return again

    def _begin(self, m: CatalogModel, mr: ModelRollout, fps: tuple[str, ...], now: float) -> None:
        before = mr.settled if mr.settled is not None and mr.settled.fingerprints != fps else None
        undone = mr.pin is not None and mr.pin.version.fingerprints == fps
        mr.previous = before  # what undo pins; None: not known, or an undo is what began it
        # Shown as where it came from: the settled version, else the one it turns from.
        came = before.fingerprints if before else mr.record.to if mr.record else ()
        mr.record = RolloutRecord(m.name, to=fps, previous=came, started_at=now, undone=undone)
        was = ",".join(came) or "a version not known here"
        log.info("%s: rolling out %s (from %s)", m.name, ",".join(fps), was)
        self._changed(m.name)

    # the operator ------------------------------------------------------------------------

    def status(self, name: str) -> ModelRollout | None:
        return self._models.get(name)

    def pause(self, name: str) -> RolloutRecord:
        rec = self._active_record(name)
        self._models[name].record = attrs.evolve(rec, paused=True)
        self._changed(name)
        return self._models[name].record  # type: ignore[return-value]

    def resume(self, name: str) -> RolloutRecord:
        """Go on: unpaused, and a stopped rollout tries again from zero failures."""
        rec = self._active_record(name)
        self._models[name].record = attrs.evolve(rec, paused=False, failures=0)
        self._counted.clear()
        self._changed(name)
        return self._models[name].record  # type: ignore[return-value]

    def undo(self, name: str, file_catalog: Catalog) -> RolloutRecord:
        """Back to the version before the last rollout (or forward again after an undo).
        Only the model's catalog entry goes back: the engine versions are declared for
        the whole fleet, so a rollout that changed only those is refused here."""
        file_model = file_catalog.model(name)
        if file_model is None:
            raise UsageError(f"no model {name!r} in the catalog")
        mr = self._models.get(name)
        if mr is None or mr.record is None:
            raise UsageError(f"{name} has not been rolled out since this store has known it")
        if mr.pin is not None:  # undoing the undo: what server.yaml says again
            mr.pin = None
        else:
            # The version this rollout came from, else the last that every replica ran.
            back = mr.previous
            if back is None and mr.settled is not None:
                now = file_catalog.fingerprints(file_model)
                back = mr.settled if mr.settled.fingerprints != now else None
            if back is None:
                raise UsageError(
                    f"{name}: the version before this rollout is not known here (the control "
                    "plane first saw the model at its new version): edit server.yaml back"
                )
            # Compared as models: a spec stored before a key existed lacks it.
            if config.structure(back.spec, CatalogModel, f"undo of {name}") == file_model:
                engines = ", ".join(f"{e} {v}" for e, v in file_catalog.engine_versions)
                raise UsageError(
                    f"{name}: its entry in server.yaml is what it was before this rollout; "
                    f"what changed is the declared engine version ({engines}), which is the "
                    "whole fleet's: declare the previous version under engines: in "
                    "server.yaml again to go back"
                )
            mr.pin = Pin(back, file_catalog.fingerprints(file_model))
        self._changed(name)
        log.info("%s: rollout undone by an operator", name)
        return mr.record

    def _active_record(self, name: str) -> RolloutRecord:
        mr = self._models.get(name)
        if mr is None or mr.record is None or not _active(mr.record):
            raise UsageError(f"{name} is not being rolled out")
        return mr.record


def _active(rec: RolloutRecord | None) -> bool:
    return rec is not None and rec.finished_at is None


def _settles(plan: Plan, m: CatalogModel, wanted: int) -> bool:
    """Every replica of `m` runs its catalog version and enough (of `wanted`) are ready."""
    mine = [v for v in plan.replicas if v.model_name == m.name]
    ready = sum(1 for v in mine if v.state == core.ReplicaState.READY)
    return not any(v.stale for v in mine) and ready >= wanted and (ready > 0 or wanted == 0)
