"""Priorities on a full fleet: which idle replicas of lower-priority models give up
their cards to a model with demand that cannot be placed.

Pure: the shell (the control plane's reconciler) says which replicas hold cards
(`Holder`: model, priority, whether its model would lose demand, how many replicas its
model has above its `min`) and simulates placement (`fits(freed)`: could one more
replica be placed if these replicas' cards were free); `displace` picks the victims,
which the shell drains (never stops outright), and `no_room` words why nothing may be
taken.

Rules: a victim has a priority strictly lower than the asker's, its model is idle, and
its model keeps at least its `min` (no more of a model's replicas are taken than its
`spare`). Among the sets that fit, the fewest victims; among those, the lowest
priorities, then the most cards freed. With up to `EXACT_UP_TO` candidates every set
is tried by size (a placement simulation costs well under a millisecond, 2^12 of them
at worst); beyond that the candidates are taken greedily in that order until the
replica fits, and any victim the result fits without is given back. `fits` is assumed
monotone (freeing more cards never makes a placement impossible): if freeing every
candidate does not fit, nothing is taken.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import attrs

# Candidates up to which every set is tried (by size); more are chosen greedily.
EXACT_UP_TO = 12


@attrs.frozen
class Holder:
    """A live replica that could give up its cards."""

    replica_id: str
    model_name: str
    priority: int
    idle: bool  # its model has no demand it would lose (the shell decides)
    spare: int  # how many replicas its model has above its min (same for all its replicas)
    cards: int  # cards it holds (for the words)


@attrs.frozen
class Displacement:
    victims: tuple[str, ...]  # replica ids to drain, in order
    # "qwen-7b wants 3, has 2: no room; llama-70b (priority 1) holds the 8 cards it
    # could use: draining replica r1 (idle, 1 above its min)"
    reason: str


Fits = Callable[[frozenset[str]], bool]


def _may_take(h: Holder, model_name: str, priority: int) -> bool:
    return h.model_name != model_name and h.priority < priority and h.idle and h.spare > 0


def _order(h: Holder) -> tuple[int, int, str]:
    return (h.priority, -h.cards, h.replica_id)


def _within_spare(victims: Iterable[Holder]) -> bool:
    taken = Counter(h.model_name for h in victims)
    spare = {h.model_name: h.spare for h in victims}
    return all(taken[m] <= spare[m] for m in taken)


def _ids(victims: Iterable[Holder]) -> frozenset[str]:
    return frozenset(h.replica_id for h in victims)


def _exact(candidates: Sequence[Holder], fits: Fits) -> tuple[Holder, ...] | None:
    for size in range(1, len(candidates) + 1):
        sets = [c for c in itertools.combinations(candidates, size) if _within_spare(c)]
        sets.sort(
            key=lambda c: (
                sorted((h.priority for h in c), reverse=True),
                -sum(h.cards for h in c),
                [h.replica_id for h in c],
            )
        )
        for victims in sets:
            if fits(_ids(victims)):
                return victims
    return None


def _greedy(candidates: Sequence[Holder], fits: Fits) -> tuple[Holder, ...] | None:
    taken: list[Holder] = []
    per_model: Counter[str] = Counter()
    for h in candidates:
        if per_model[h.model_name] >= h.spare:
            continue
        taken.append(h)
        per_model[h.model_name] += 1
        if fits(_ids(taken)):
            # Give back, last taken first, any victim the replica fits without.
            for extra in reversed(list(taken)):
                fewer = [h for h in taken if h is not extra]
                if fewer and fits(_ids(fewer)):
                    taken = fewer
            return tuple(taken)
    return None


def displace(
    model_name: str,
    priority: int,
    wants: int,
    has: int,
    holders: Sequence[Holder],
    fits: Fits,
) -> Displacement | None:
    """The replicas to drain so that one more replica of `model_name` (priority
    `priority`, wanting `wants` and having `has`) fits; None when no allowed set fits.
    A replica that fits already needs no victim: `victims` is then empty."""
    head = f"{model_name} wants {wants}, has {has}"
    if fits(frozenset()):
        return Displacement((), f"{head}: fits without displacing anything")
    candidates = sorted((h for h in holders if _may_take(h, model_name, priority)), key=_order)
    if not candidates or not fits(_ids(candidates)):
        return None
    if len(candidates) <= EXACT_UP_TO:
        victims = _exact(candidates, fits)
    else:
        victims = _greedy(candidates, fits)
    if victims is None:
        return None
    parts = []
    for name, group in _by_model(victims):
        ids = ", ".join(h.replica_id for h in group)
        cards = sum(h.cards for h in group)
        parts.append(
            f"{name} (priority {group[0].priority}) holds the {cards} cards it could use: "
            f"draining {ids} (idle, {group[0].spare} above its min)"
        )
    return Displacement(
        tuple(h.replica_id for h in victims), f"{head}: no room; " + "; ".join(parts)
    )


def _by_model(holders: Iterable[Holder]) -> list[tuple[str, list[Holder]]]:
    groups: dict[str, list[Holder]] = {}
    for h in holders:
        groups.setdefault(h.model_name, []).append(h)
    return list(groups.items())


def no_room(
    model_name: str,
    wants: int,
    has: int,
    holders: Sequence[Holder],
    fits: Fits,
    *,
    priority: int | None = None,
) -> str:
    """Why nothing may be displaced for `model_name`, in words: which models hold the
    room it could use and why each may not give it up (priority not lower than
    `priority` when given, busy, at its min)."""
    head = f"{model_name} wants {wants}, has {has}: no room"
    others = [h for h in holders if h.model_name != model_name]
    groups = _by_model(others)
    could = [(name, group) for name, group in groups if fits(_ids(group))]
    if not could:
        if others and fits(_ids(others)):
            could = groups
            head += "; only the replicas of several models together hold the room"
        else:
            return f"{head}, even if every other model's replicas gave up their cards"
    parts = []
    for name, group in could:
        first = group[0]
        why = []
        if priority is not None and first.priority >= priority:
            why.append(f"priority {first.priority} is not lower than {priority}")
        if not all(h.idle for h in group):
            why.append("busy")
        if first.spare <= 0:
            why.append("at its min")
        cards = sum(h.cards for h in group)
        because = ", ".join(why) if why else "only part of it may be taken"
        parts.append(
            f"{name} (priority {first.priority}) holds the {cards} cards it could use "
            f"but may not give them up: {because}"
        )
    return f"{head}; " + "; ".join(parts)
