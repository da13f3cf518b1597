"""LoRA adapters on a base model's replicas: where a request for one goes, and which
replica loads it (evicting what) when none holds it.

Pure: the shell's view of one base model's replicas in, one `AdapterPlan` out.
(LoRA adapters, the fine-tunes clients name in `model`; not the engine adapters of
llmgw/engines.)

What the shell feeds in
    One `ReplicaAdapters` per ready, eligible replica of the base (healthy, breaker
    allowing): the most adapters it holds at once (`max_adapters`: the engine's
    `--max-loras` or the like, from the profile), the adapters it holds with the
    clock value of their last use and the requests using them now (`HeldAdapter`),
    the adapters it is loading now (`loading`), and its request count for the bound
    (`load`: what llmgw/core/_scoring.py's `load` counts, own plus known external),
    and what its adapters draw (`demand`: requests in flight on them, averaged).
    What a replica holds comes from what its engine lists (the agent's report), with
    the shell's own loads and evictions applied as it makes them.

What it answers (`AdapterPlan.action`), in this order of preference
    use    A replica holds the adapter within the load bound: send the request to one
           of `choices` (the router's cost choice among them, the prefix index kept
           per adapter; `replica_id` is the least loaded, for a shell that does not
           choose). When every holder is over the bound and the adapter cannot be
           loaded elsewhere within it, or a load is already in flight elsewhere,
           `choices` are the holders over the bound: a loaded adapter serves now,
           where a load would take seconds.
    join   No replica holds it and one is loading it: wait for that load (single
           flight: never a second load of an adapter while one is in flight on any
           replica of the base), then plan again.
    load   No replica holds it and none loads it: `replica_id` loads it, first
           evicting `evict` when it is full. The replica is within the bound if
           one can load it (the bound prefers, never refuses, as in _scoring),
           then one with a free slot before one that must evict (no churn while a
           slot is free), then the one whose adapters draw the least (`demand`: so
           the popular ones spread over the replicas, and a replica busy loading one
           is not picked again while another is idle), then the least loaded, then
           the one whose victim was used longest ago, then the smallest id. The
           victim is that replica's least recently used adapter with no request in
           flight (ties by name).
    wait   Nothing can take it now: no replica is ready, or every replica is full
           of adapters with requests in flight (or being loaded), or takes none.
           The shell waits for a request of the base to finish or a load to end and
           plans again; at the request's bound it answers 503 with `reason`.

What the shell does with the answer (decide, then act)
    The state changes are methods on `ReplicaAdapters`, so the shell applies them
    synchronously, before any await, and the next request plans on the new view:
    `started`/`finished` around every request sent to an adapter (in flight and last
    use), `load_started(adapter, evict)` when a plan says load (the victim leaves
    the view at once, so no request is sent to it; the new one counts against the
    maximum while it loads, which is what makes a second request join it), then
    `loaded` or `load_failed` when the engine answers (a failure wakes the joined
    requests, which plan again). A load that the shell's view cannot see (another
    router worker, another control plane) is stopped by the agent, which runs one
    load per adapter per replica at a time and joins a second to the first.

Invariants (tests/core/test_adapters.py, hypothesis): after applying any plan a
replica holds at most its maximum, loads in flight counted; an adapter with a
request in flight is never evicted; at most one load of an adapter is in flight
across the base's replicas; the victim is the least recently used evictable
adapter; a holder within the bound wins over a load; the answer does not depend on
the order of the input. `reason` is the words for explain and `ctl adapters`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

import attrs

from llmgw.core._scoring import capacity

AdapterAction = Literal["use", "join", "load", "wait"]
ADAPTER_ACTIONS: tuple[AdapterAction, ...] = ("use", "join", "load", "wait")


def _finite(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite clock value, got {value}")


def _count(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be 0 or more, got {value}")


@attrs.frozen
class HeldAdapter:
    """An adapter a replica holds."""

    name: str
    last_used: float = attrs.field(validator=_finite)  # last request's start or end, or loaded
    in_flight: int = attrs.field(default=0, validator=_count)  # requests using it now


def _held(value: Iterable[HeldAdapter]) -> tuple[HeldAdapter, ...]:
    return tuple(sorted(value, key=lambda h: h.name))


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(value))


def _load(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number, 0 or more, got {value}")


@attrs.frozen
class ReplicaAdapters:
    """One replica of the base as the plan sees it. `held` and `loading` are kept
    sorted by name, so two views that differ only in order are equal."""

    replica_id: str
    max_adapters: int = attrs.field(validator=_count)
    held: tuple[HeldAdapter, ...] = attrs.field(default=(), converter=_held)
    loading: tuple[str, ...] = attrs.field(default=(), converter=_names)
    load: float = attrs.field(default=0.0, validator=_load)  # requests, for the bound
    # The requests its adapters draw, held and loading: in flight on them averaged over
    # the last while, and those waiting for one it loads (the shell's measure). A load
    # goes where this is least, so popular adapters spread over the replicas rather than
    # piling onto the first one (one replica's engine then serves most of the traffic).
    demand: float = attrs.field(default=0.0, validator=_load)

    def __attrs_post_init__(self) -> None:
        names = [h.name for h in self.held]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"replica {self.replica_id} holds {', '.join(twice)} twice")
        twice = sorted({n for n in self.loading if self.loading.count(n) > 1})
        if twice:
            raise ValueError(f"replica {self.replica_id} loads {', '.join(twice)} twice")
        both = sorted(set(names) & set(self.loading))
        if both:
            raise ValueError(
                f"replica {self.replica_id} both holds and loads {', '.join(both)}: "
                "an adapter is loading until its load ends, then held"
            )

    @property
    def used(self) -> int:
        """Slots taken: adapters held and adapters being loaded."""
        return len(self.held) + len(self.loading)

    def holds(self, adapter: str) -> bool:
        return any(h.name == adapter for h in self.held)

    def victim(self) -> HeldAdapter | None:
        """The adapter a load here would evict: least recently used, none in flight."""
        idle = [h for h in self.held if h.in_flight == 0]
        return min(idle, key=lambda h: (h.last_used, h.name)) if idle else None

    def _one(self, adapter: str) -> HeldAdapter:
        for h in self.held:
            if h.name == adapter:
                return h
        raise ValueError(
            f"replica {self.replica_id} does not hold {adapter}; it holds "
            f"{', '.join(h.name for h in self.held) or 'none'}"
        )

    def _with(self, old: HeldAdapter, new: HeldAdapter) -> ReplicaAdapters:
        return attrs.evolve(self, held=[new if h is old else h for h in self.held])

    def started(self, adapter: str, now: float) -> ReplicaAdapters:
        """A request using `adapter` was sent here."""
        h = self._one(adapter)
        return self._with(h, HeldAdapter(h.name, max(h.last_used, now), h.in_flight + 1))

    def finished(self, adapter: str, now: float) -> ReplicaAdapters:
        """A request using `adapter` here ended (its end is its last use)."""
        h = self._one(adapter)
        if h.in_flight == 0:
            raise ValueError(
                f"replica {self.replica_id} has no request in flight on {adapter} to finish"
            )
        return self._with(h, HeldAdapter(h.name, max(h.last_used, now), h.in_flight - 1))

    def load_started(self, adapter: str, evict: str | None = None) -> ReplicaAdapters:
        """A load of `adapter` began here, after evicting `evict` (a plan's `load`)."""
        held = list(self.held)
        if evict is not None:
            h = self._one(evict)
            if h.in_flight:
                raise ValueError(
                    f"replica {self.replica_id} may not evict {evict}: "
                    f"{h.in_flight} request(s) in flight on it"
                )
            held.remove(h)
        return attrs.evolve(self, held=held, loading=(*self.loading, adapter))

    def loaded(self, adapter: str, now: float) -> ReplicaAdapters:
        """The load of `adapter` here succeeded: it is held, last used now."""
        self._loading(adapter)
        return attrs.evolve(
            self,
            held=(*self.held, HeldAdapter(adapter, now)),
            loading=[n for n in self.loading if n != adapter],
        )

    def load_failed(self, adapter: str) -> ReplicaAdapters:
        """The load of `adapter` here failed: its slot is free again."""
        self._loading(adapter)
        return attrs.evolve(self, loading=[n for n in self.loading if n != adapter])

    def _loading(self, adapter: str) -> None:
        if adapter not in self.loading:
            raise ValueError(
                f"replica {self.replica_id} is not loading {adapter}; it loads "
                f"{', '.join(self.loading) or 'none'}"
            )


@attrs.frozen
class AdapterPlan:
    """Where a request for `adapter` goes (see the module doc for each action)."""

    adapter: str
    action: AdapterAction
    replica_id: str | None  # use: least loaded of choices; join/load: the replica; wait: None
    choices: tuple[str, ...]  # use: every replica it may go to; else (replica_id,) or ()
    evict: str | None  # load: the adapter evicted first, None with a free slot
    holders: tuple[str, ...]  # replicas that hold the adapter (for explain)
    capacity: int  # the load bound: the most requests a replica may hold with this one
    reason: str


def _requests(n: float) -> str:
    text = f"{n:g}"
    return f"{text} request" + ("" if text == "1" else "s")


def plan_adapter(
    adapter: str,
    replicas: Sequence[ReplicaAdapters],
    now: float,
    *,
    base: str,
    epsilon: float = 1.0,
) -> AdapterPlan:
    """Where a request for `adapter` (of the model `base`) goes now; `epsilon` is the
    router's (`ScoringConfig.epsilon`), for the same bound as its choice."""
    rs = sorted(replicas, key=lambda r: r.replica_id)
    ids = [r.replica_id for r in rs]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"replicas of {base} listed twice: {', '.join(twice)}")
    cap = capacity([r.load for r in rs], epsilon)
    bound = f"the bound of {_requests(cap)}"

    def within(r: ReplicaAdapters) -> bool:
        return r.load + 1 <= cap

    def least(group: Sequence[ReplicaAdapters]) -> ReplicaAdapters:
        return min(group, key=lambda r: (r.load, r.replica_id))

    def shown(group: Sequence[ReplicaAdapters]) -> str:
        return ", ".join(f"{r.replica_id} ({_requests(r.load)})" for r in group)

    holders = [r for r in rs if r.holds(adapter)]
    held_by = tuple(r.replica_id for r in holders)

    def plan(
        action: AdapterAction,
        chosen: ReplicaAdapters | None,
        reason: str,
        choices: Sequence[ReplicaAdapters] = (),
        evict: str | None = None,
    ) -> AdapterPlan:
        group = tuple(r.replica_id for r in choices)
        if not group and chosen is not None:
            group = (chosen.replica_id,)
        rid = None if chosen is None else chosen.replica_id
        return AdapterPlan(adapter, action, rid, group, evict, held_by, cap, reason)

    hot = [r for r in holders if within(r)]
    if hot:
        return plan("use", least(hot), f"{adapter} is held by {shown(hot)}, within {bound}", hot)
    loads = [r for r in rs if adapter in r.loading]
    if loads:
        at = least(loads)
        if holders:
            return plan(
                "use",
                least(holders),
                f"{adapter} is held only by {shown(holders)}, over {bound}; a load on "
                f"{at.replica_id} is in flight, so none starts",
                holders,
            )
        return plan(
            "join",
            at,
            f"{adapter} is being loaded on {at.replica_id}; this request joins that load",
        )
    able = [(r, v) for r in rs if not r.holds(adapter) for v in _room(r)]

    def key(
        o: tuple[ReplicaAdapters, HeldAdapter | None],
    ) -> tuple[bool, bool, float, float, float, str]:
        r, v = o
        used = v.last_used if v else 0.0
        return (not within(r), v is not None, r.demand, r.load, used, r.replica_id)

    best = min(able, key=key) if able else None
    if best is not None and (within(best[0]) or not holders):
        r, victim = best
        return plan(
            "load",
            r,
            _load_words(adapter, base, r, victim, now, holders, bound, within(r)),
            evict=None if victim is None else victim.name,
        )
    if holders:
        return plan(
            "use",
            least(holders),
            f"{adapter} is held only by {shown(holders)}, over {bound}; "
            "no replica within it can load it",
            holders,
        )
    if not rs:
        return plan("wait", None, f"no replica of {base} is ready; {adapter} waits for one")
    return plan(
        "wait",
        None,
        f"no replica of {base} can load {adapter} now: "
        + "; ".join(_why_not(r) for r in rs)
        + f"; {adapter} waits for a request to finish or a load to end",
    )


def _room(r: ReplicaAdapters) -> tuple[HeldAdapter | None, ...]:
    """How a load fits here: (None,) a free slot, (victim,) after evicting it, () not."""
    if r.used < r.max_adapters:
        return (None,)
    victim = r.victim() if r.used == r.max_adapters else None
    return () if victim is None else (victim,)


def _load_words(
    adapter: str,
    base: str,
    r: ReplicaAdapters,
    victim: HeldAdapter | None,
    now: float,
    holders: Sequence[ReplicaAdapters],
    bound: str,
    within: bool,
) -> str:
    if holders:
        why = f"{adapter} is held only by " + ", ".join(h.replica_id for h in holders)
        why += f", over {bound}"
    else:
        why = f"no replica of {base} holds {adapter}"
    where = f"{r.replica_id} ({_requests(r.load)}, {'within' if within else 'over'} {bound}"
    where += f"; its adapters draw {r.demand:.3g})"
    if victim is None:
        room = f"a free slot ({r.used} of {r.max_adapters} taken)"
    else:
        room = (
            f"all {r.max_adapters} slots taken: evicting {victim.name} (last used "
            f"{max(0.0, now - victim.last_used):.0f} s ago, no request in flight)"
        )
    return f"{why}; loading it on {where}: {room}"


def _why_not(r: ReplicaAdapters) -> str:
    if r.max_adapters == 0:
        return f"{r.replica_id} takes no adapters (its maximum is 0)"
    if r.used > r.max_adapters:
        return (
            f"{r.replica_id} holds or loads {r.used} adapters, over its maximum of {r.max_adapters}"
        )
    busy = f"{r.replica_id} holds {len(r.held)} of {r.max_adapters} adapters"
    if r.held:
        busy += ", each with requests in flight"
    if r.loading:
        busy += f" and loads {', '.join(r.loading)}"
    return busy
