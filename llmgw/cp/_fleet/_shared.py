"""Values that repeat across nodes, kept once: a fleet is a few kinds of machine.

Every registration brings a whole inventory, decoded into new objects: an
8-GPU node's is about 25 KB of Python objects (tracemalloc), most of it the
same on every node of its kind: the NVLink and NIC topology, the InfiniBand
adapters, the CPU flags, the engines, the GPU model names. At 10,000 agents
that is a quarter of the 100 KB an agent may cost. `SharedValues` returns an
equal value built from values already held where there are some: strings are
interned; values of the kinds that repeat (`KEPT`, and tuples of strings) are
looked up in a table and the one already held is returned. Values that are
one node's own (a GPU with its UUID, the host with its name) are rebuilt from
shared parts but not kept; the usage, replaced by every heartbeat, is left
alone (sharing it on every beat would cost more CPU than it saves memory).

The table is bounded (`max_entries`): once full, new values are returned as
they are, so an agent that reports ever-new values cannot grow it. Values are
frozen, so sharing one between nodes is safe; equality is the values' own.

Pure: no I/O.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

import attrs

from llmgw import model

T = TypeVar("T")

# Kinds whose values repeat across nodes of one kind of machine.
KEPT: frozenset[type] = frozenset(
    {
        model.NvLink,
        model.NicDistance,
        model.Topology,
        model.IbPort,
        model.IbAdapter,
        model.Fabric,
        model.Engine,
        model.EngineStatus,
        model.Engines,
        model.WeightFile,
        model.Label,
    }
)
# Left as they are: a registration's usage is replaced by the first heartbeat's.
SKIPPED: frozenset[type] = frozenset({model.Usage})
MAX_STR = 256  # longer strings (a warning, a log line) are left alone


class SharedValues:
    def __init__(self, max_entries: int = 50_000) -> None:
        self.max_entries = max_entries
        self._table: dict[Any, Any] = {}
        self._fields: dict[type, tuple[str, ...] | None] = {}
        self.hits = 0  # values returned from the table (for statistics and tests)

    def __repr__(self) -> str:
        return f"<SharedValues {len(self._table)} kept, {self.hits} hits>"

    def __len__(self) -> int:
        return len(self._table)

    def __call__(self, value: T) -> T:
        """`value`, or an equal one made of values already held."""
        shared: T = self._share(value)
        return shared

    def hello(self, hello: model.Hello) -> model.Hello:
        """A registration with its inventory shared."""
        return attrs.evolve(hello, inventory=self(hello.inventory))

    def beat(self, beat: model.Heartbeat) -> model.Heartbeat:
        """A heartbeat with what it rarely carries (only when changed) shared; its
        usage, new every beat, as it is."""
        if beat.weights is None and beat.engines is None and beat.warnings is None:
            return beat
        return attrs.evolve(
            beat,
            weights=self(beat.weights),
            engines=self(beat.engines),
            warnings=self(beat.warnings),
        )

    def _share(self, v: Any) -> Any:
        cls = type(v)
        if cls is str:
            return sys.intern(v) if len(v) <= MAX_STR else v
        if cls is tuple:
            if not v:
                return v
            keepable = type(v[0]) is str or type(v[0]) in KEPT
            # A value seen before is found whole, without walking it (a registration
            # storm makes this the common case).
            if keepable and (found := self._table.get(v)) is not None:
                self.hits += 1
                return found
            items = tuple([self._share(x) for x in v])
            if keepable and all(type(x) is str or type(x) in KEPT for x in items):
                return self._keep(items)
            return items if any(a is not b for a, b in zip(items, v, strict=True)) else v
        names = self._fields.get(cls, ())
        if names == ():
            names = self._fields[cls] = (
                tuple(f.name for f in attrs.fields(cls)) if attrs.has(cls) else None
            )
        if names is None or cls in SKIPPED:
            return v  # numbers, None, enums: nothing to share
        kept = cls in KEPT
        if kept and (found := self._table.get(v)) is not None:
            self.hits += 1
            return found
        changes = {}
        for name in names:
            old = getattr(v, name)
            new = self._share(old)
            if new is not old:
                changes[name] = new
        if changes:
            v = attrs.evolve(v, **changes)
        return self._keep(v) if kept else v

    def _keep(self, v: Any) -> Any:
        found = self._table.get(v)
        if found is not None:
            self.hits += 1
            return found
        if len(self._table) < self.max_entries:
            self._table[v] = v
        return v
