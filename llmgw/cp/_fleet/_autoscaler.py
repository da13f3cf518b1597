"""The leader's autoscaler: the routers' load -> each autoscaled model's count.

Every `sample_s` this control plane reads its own routers' loads (this process and
its router workers: `loads`, router id -> served name -> core.RouterLoad) and writes
them to the store (`router_load`, one row per control plane), so that a standby's
routers count too; the leader also reads every other control plane's row written
within `FRESH_S`. Per router, counters become their growth since that router's last
reading (core.grown); summed over routers and over a model's served names they make
one core.LoadSample per autoscaled model, kept for its window, and core.autoscale
decides (llmgw/core/_autoscale.py). A change of count is logged, recorded as an
`autoscaled` event, and pokes the reconciler, which asks `count(m)` for every model
(a fixed model's count is its `replicas`).

A standby decides nothing; it only writes its row. With no autoscaled model and no
LoRA adapter in the catalog nothing is read or written (an adapter's waiting requests
are its demand: `demand`, read by llmgw/cp/_fleet/_adapters.py). A new leader starts each model at
what runs (`live`: the reconciler's live replicas, within [min, max]), so the count
follows the fleet over a failover and a scale-down waits its full
`scale_down_after_s` again. An operator's pause (`ctl autoscale pause`, in the store,
read every `paused_every_s` and at once after a change through this control plane)
holds the count it names; decisions go on being made and shown, not applied.

Nothing waits on the store inside a decision: the write and the read are bounded by
`store_timeout_s`, and a store out of reach leaves the other control planes' rows as
last read until they are FRESH_S old; then they are absent (not zero).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import attrs
import trio

from llmgw import core
from llmgw.cp._fleet._catalog import Catalog, CatalogModel
from llmgw.errors import LlmgwError

log = logging.getLogger("llmgw.cp.autoscaler")

AUTOSCALED = "autoscaled"  # the event kind of a change of count
FRESH_S = 10.0  # another control plane's row older than this is not counted
SAMPLE_S = 1.0


class LoadStore(Protocol):
    async def put_router_load(self, cp: str, body_json: str, now: float) -> None: ...
    async def router_loads(self, since: float) -> list[tuple[str, str, float]]: ...
    async def autoscale_paused(self) -> dict[str, tuple[int, str, float]]: ...


class EventSink(Protocol):
    def record(self, kind: str, message: str, *, model_name: str | None = None) -> object: ...


Loads = Mapping[str, Mapping[str, core.RouterLoad]]  # router id -> served name -> load


@attrs.frozen
class ModelScale:
    """What `ctl status` and the pages show of one autoscaled model."""

    name: str
    policy: core.AutoscalePolicy
    desired: int  # what the reconciler is asked for (a pause's count while paused)
    decision: core.AutoscaleDecision | None  # the last one; None: none made yet
    paused: tuple[int, str, float] | None  # (count held, who, when) while paused
    sample: core.LoadSample | None  # the newest
    routers: int = 0  # how many routers (every control plane's, every worker) it sums
    # The decision that last changed the count, and when (wall clock): what set it.
    changed: tuple[core.AutoscaleDecision, float] | None = None


def encode_loads(loads: Loads) -> str:
    body = {rid: {n: load.as_json() for n, load in ms.items()} for rid, ms in loads.items()}
    return json.dumps(body, sort_keys=True)


def decode_loads(text: str) -> dict[str, dict[str, core.RouterLoad]]:
    """A control plane's row back; raises ValueError naming what is wrong (the store is
    shared with other machines: nothing in it is trusted)."""
    if len(text) > 4 << 20:
        raise ValueError(f"a router_load row of {len(text)} bytes is over the limit")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("expected {router id: {model: load}}")
    out: dict[str, dict[str, core.RouterLoad]] = {}
    for rid, models in data.items():
        if not isinstance(models, dict):
            raise ValueError(f"router {str(rid)[:60]!r}: expected {{model: load}}")
        out[str(rid)] = {str(name): core.RouterLoad.from_json(v) for name, v in models.items()}
    return out


class Autoscaler:
    def __init__(
        self,
        catalog: Callable[[], Catalog],
        loads: Callable[[], Loads],
        store: LoadStore,
        cp_id: str,
        acting: Callable[[], bool],
        events: EventSink,
        *,
        poke: Callable[[], None] = lambda: None,
        live: Callable[[str], int] = lambda name: 0,
        sample_s: float = SAMPLE_S,
        paused_every_s: float = 5.0,
        store_timeout_s: float = 3.0,
        clock: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._catalog = catalog
        self._loads = loads
        self._store = store
        self._cp = cp_id
        self._acting = acting
        self._events = events
        self.poke = poke  # the reconciler's wake-up, set by whoever builds both
        self.live = live  # model -> its live replicas (the reconciler's last plan)
        self.sample_s = sample_s
        self._paused_every_s = paused_every_s
        self._timeout_s = store_timeout_s
        self._clock = clock
        self._wall = wall
        self._state: dict[str, core.AutoscaleState] = {}
        self._decisions: dict[str, core.AutoscaleDecision] = {}
        self._samples: dict[str, deque[core.LoadSample]] = {}
        self._last: dict[tuple[str, str, str], core.RouterLoad] = {}  # (cp, router, name)
        self._others: list[tuple[str, dict[str, dict[str, core.RouterLoad]], float]] = []
        self._paused: dict[str, tuple[int, str, float]] = {}
        self._routers: dict[str, int] = {}  # model -> routers its last sample summed
        self._changes: dict[str, tuple[core.AutoscaleDecision, float]] = {}
        self._was_acting = False
        # served name -> the other control planes' routers' sum at the last step
        self._others_by_name: dict[str, core.RouterLoad] = {}

    def __repr__(self) -> str:
        return f"<Autoscaler {self._cp} {len(self._state)} models>"

    # what the reconciler and the views read -------------------------------------------

    def count(self, m: CatalogModel) -> int:
        """The replicas `m` should have now."""
        if m.autoscale is None:
            return m.replicas
        if m.name in self._paused:
            return self._paused[m.name][0]
        state = self._state.get(m.name)
        return state.desired if state is not None else self._start(m)

    def _start(self, m: CatalogModel) -> int:
        """Where a model's decisions start (a new leader): what runs, within its range."""
        assert m.autoscale is not None
        policy = m.autoscale.policy()
        return min(max(self.live(m.name), policy.min), policy.max)

    def scales(self) -> list[ModelScale]:
        out = []
        for m in self._catalog().models:
            if m.autoscale is None:
                continue
            samples = self._samples.get(m.name)
            newest = samples[-1] if samples else None
            decision, paused = self._decisions.get(m.name), self._paused.get(m.name)
            routers, changed = self._routers.get(m.name, 0), self._changes.get(m.name)
            out.append(
                ModelScale(
                    m.name,
                    m.autoscale.policy(),
                    self.count(m),
                    decision,
                    paused,
                    newest,
                    routers,
                    changed,
                )
            )
        return out

    def queued(self, name: str) -> int | None:
        """Requests waiting for model `name` in the routers, as last sampled; None: not
        autoscaled here, or no sample yet."""
        samples = self._samples.get(name)
        return samples[-1].queued if samples else None

    def demand(self, names: Iterable[str]) -> dict[str, core.RouterLoad]:
        """What the routers hold of each served name in `names` now (queued, in flight,
        last use): this control plane's own routers read now (once, for all of them),
        plus the other control planes' as their rows said at the last step (never this
        one's own as sampled then: a request answered since would still look queued); a
        name no router reports is left out. Read by the adapter manager
        (llmgw/cp/_fleet/_adapters.py), for which this runs with adapters too."""
        own = self._loads().values()
        out = {}
        for name in names:
            parts = [models[name] for models in own if name in models]
            theirs = self._others_by_name.get(name)
            if theirs is not None:
                parts.append(theirs)
            if parts:
                out[name] = core.merge_loads(parts)
        return out

    def lower(self, name: str, fewer: int, why: str) -> None:
        """A higher priority takes `fewer` of `name`'s replicas (never below its min)."""
        m = self._catalog().model(name)
        if m is None or m.autoscale is None:
            return
        before = self.count(m)
        state = self._state.get(name) or core.AutoscaleState(before)
        after = max(m.autoscale.policy().min, before - fewer)
        now = self._clock()
        self._state[name] = attrs.evolve(state, desired=after, changed_at=now, low_since=None)
        message = f"{name}: lowered {before} -> {after}: {why}"
        log.info("autoscale %s", message)
        self._events.record(AUTOSCALED, message, model_name=name)
        self.poke()

    def paused_changed(self, paused: Mapping[str, tuple[int, str, float]]) -> None:
        """The store's paused counts, as just written through this control plane."""
        self._paused = dict(paused)
        self.poke()

    # the loop ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_paused)
            task_status.started()
            while True:
                catalog = self._catalog()
                if not any(m.autoscale for m in catalog.models) and not catalog.adapters:
                    await trio.sleep(self.sample_s)  # nothing to decide: no store writes
                    continue
                own = dict(self._loads())
                nursery.start_soon(self._publish, own)
                if self._acting():
                    if not self._was_acting:
                        self._elected()
                    nursery.start_soon(self._read_others)
                    self.step(own, self._clock())
                elif self._was_acting:
                    self._was_acting = False
                    self._state.clear()  # a standby decides nothing; a new term starts anew
                await trio.sleep(self.sample_s)

    def _elected(self) -> None:
        self._was_acting = True
        self._changes.clear()
        self._state.clear()
        self._samples.clear()
        self._last.clear()

    async def _publish(self, own: Loads) -> None:
        with trio.move_on_after(self._timeout_s):
            try:
                await self._store.put_router_load(self._cp, encode_loads(own), self._wall())
            except LlmgwError as exc:
                log.debug("router load not written: %s", exc)

    async def _read_others(self) -> None:
        with trio.move_on_after(self._timeout_s):
            try:
                rows = await self._store.router_loads(self._wall() - FRESH_S)
            except LlmgwError as exc:
                log.debug("router loads not read: %s", exc)
                return
            others = []
            for cp, body, at in rows:
                if cp == self._cp:
                    continue
                try:
                    others.append((cp, decode_loads(body), at))
                except ValueError as exc:
                    log.warning("control plane %s: its router_load row is refused: %s", cp, exc)
            self._others = others

    async def _read_paused(self) -> None:
        while True:
            with trio.move_on_after(self._timeout_s):
                try:
                    paused = await self._store.autoscale_paused()
                except LlmgwError as exc:
                    log.debug("paused autoscalers not read: %s", exc)
                else:
                    if paused != self._paused:
                        self._paused = paused
                        self.poke()
            await trio.sleep(self._paused_every_s)

    # one step (synchronous: tests drive it) ---------------------------------------------

    def step(self, own: Loads, now: float) -> None:
        """Sample every router's load, then decide each autoscaled model's count."""
        fresh = self._wall() - FRESH_S
        routers: list[tuple[str, Loads]] = [(self._cp, own)]
        routers += [(cp, loads) for cp, loads, at in self._others if at >= fresh]
        grown: list[dict[str, core.RouterLoad]] = []
        theirs: list[Mapping[str, core.RouterLoad]] = []
        seen: set[tuple[str, str, str]] = set()
        reporting: dict[str, set[tuple[str, str]]] = {}  # served name -> routers
        for cp, loads in routers:
            for rid, models in loads.items():
                one = {}
                for name, load in models.items():
                    key = (cp, rid, name)
                    seen.add(key)
                    reporting.setdefault(name, set()).add((cp, rid))
                    one[name] = core.grown(self._last.get(key), load)
                    self._last[key] = load
                grown.append(one)
                if cp != self._cp:
                    theirs.append(models)
        self._last = {k: v for k, v in self._last.items() if k in seen}
        by_name = core.merge_models(grown)
        self._others_by_name = core.merge_models(theirs)
        changed = False
        for m in self._catalog().models:
            if m.autoscale is None:
                continue
            parts = [by_name[n] for n in m.names if n in by_name]
            self._routers[m.name] = len(set().union(*(reporting.get(n, set()) for n in m.names)))
            policy = m.autoscale.policy()
            samples = self._samples.setdefault(m.name, deque())
            if parts:
                samples.append(core.sample(now, core.merge_loads(parts)))
            while samples and samples[0].at < now - policy.window_s:
                samples.popleft()
            state = self._state.get(m.name) or core.AutoscaleState(self._start(m))
            decision = core.autoscale(policy, list(samples), state, now, ready=None)
            self._state[m.name] = decision.state
            self._decisions[m.name] = decision
            if decision.desired != state.desired:
                changed = True
                self._changed(m.name, state.desired, decision)
        gone = set(self._state) - {m.name for m in self._catalog().models if m.autoscale}
        for name in gone:
            self._changes.pop(name, None)
            self._state.pop(name, None)
            self._samples.pop(name, None)
            self._decisions.pop(name, None)
        if changed:
            self.poke()

    def _changed(self, name: str, before: int, decision: core.AutoscaleDecision) -> None:
        paused = self._paused.get(name)
        held = f" (paused at {paused[0]} by {paused[1]}: not applied)" if paused else ""
        message = f"{name}: {decision.reason}{held}"
        self._changes[name] = (decision, self._wall())
        log.info("autoscale %s", message)
        self._events.record(AUTOSCALED, message, model_name=name)
