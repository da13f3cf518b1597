"""What the registry keeps in the store: the operator's overrides and the known nodes.

Cordons and drains (one row a node in the store's overrides) and every node that
ever registered and was not forgotten (whom a restarted control plane waits for
before it acts: the reconciler's settle). They are read at start and again at
each election (`load`), and each change is written by a task of its own
(`writer`), batched, off the tick and the RPC handlers: a registration storm is
written as it comes, never waited for. An operator's cordon, drain or forget is
written before the admin API answers (`flush`). A failed write stays to be
written and is tried again after `STORE_RETRY_S`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from llmgw.errors import LlmgwError
from llmgw.store import Store

log = logging.getLogger("llmgw.cp.registry")

STORE_RETRY_S = 2.0  # a failed write of overrides or known nodes is tried again after this


class FleetState:
    """The cordoned, draining and known nodes, and what of them is still to be written.

    `address(node_id)` is where a known node last registered from ("" if it has not
    since this start), written beside it.
    """

    def __init__(self, address: Callable[[str], str]) -> None:
        self._address = address
        self.cordoned: dict[str, str] = {}  # node -> why; placement leaves these nodes out
        # node -> why; cordoned for placement, and what runs there is moved off
        # (the reconcile plan's drain rule, llmgw/core/_drain.py)
        self.draining: dict[str, str] = {}
        self.known: set[str] = set()
        # Where they are kept (load); None: nowhere (tests).
        self._store: Store | None = None
        self._dirty_overrides: set[str] = set()  # nodes whose override is to be written
        self._dirty_known: set[str] = set()  # nodes known or forgotten since the last write
        self._wake_writer = trio.Event()
        self._flush_lock = trio.Lock()
        self.store_writes = 0

    def __repr__(self) -> str:
        return (
            f"<FleetState {len(self.cordoned)} cordoned, {len(self.draining)} draining, "
            f"{len(self.known)} known, {len(self._dirty_overrides) + len(self._dirty_known)}"
            " to write>"
        )

    async def load(self, store: Store) -> None:
        """Read them from the store, and keep them there from now on. What was not yet
        written is dropped: the store is the record."""
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

    def cordon(self, node_id: str, reason: str | None) -> None:
        self.cordoned[node_id] = reason or "cordoned by an operator"
        self.note_override(node_id)
        log.info("node %s cordoned: %s", node_id, self.cordoned[node_id])

    def uncordon(self, node_id: str) -> list[str]:
        """Lift a cordon and a drain; returns what was lifted."""
        lifted = [
            what
            for what, table in (("cordon", self.cordoned), ("drain", self.draining))
            if table.pop(node_id, None) is not None
        ]
        if lifted:
            self.note_override(node_id)
            log.info("node %s uncordoned (lifted: %s)", node_id, ", ".join(lifted))
        return lifted

    def drain(self, node_id: str, reason: str | None) -> None:
        self.draining[node_id] = reason or "drained by an operator"
        self.note_override(node_id)
        log.info("node %s draining: %s", node_id, self.draining[node_id])

    def remember(self, node_id: str) -> None:
        """A node registered: known from now on (written by the writer, never waited for)."""
        if node_id not in self.known:
            self.known.add(node_id)
            self._note_known(node_id)

    def forget(self, node_id: str) -> None:
        """Neither known nor cordoned nor draining any more."""
        if node_id in self.known:
            self.known.discard(node_id)
            self._note_known(node_id)
        had = self.cordoned.pop(node_id, None), self.draining.pop(node_id, None)
        if any(v is not None for v in had):
            self.note_override(node_id)

    def note_override(self, node_id: str) -> None:
        self._dirty_overrides.add(node_id)
        self._wake_writer.set()

    def _note_known(self, node_id: str) -> None:
        self._dirty_known.add(node_id)
        self._wake_writer.set()

    async def flush(self) -> None:
        """Write every changed override and known node to the store now. On a failure
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
            await store.remember_node(node_id, self._address(node_id))
        else:
            await store.forget_node(node_id)

    async def writer(self) -> None:
        """Writes what changed, whenever something did; runs until cancelled."""
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
