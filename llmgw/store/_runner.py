"""One store connection from trio: one caller at a time, each wait bounded.

The backend's connection is used from one worker thread at a time; a trio.Lock
orders the callers, and waiting for it is bounded by `fail_after` (the
statement itself is bounded by the driver: llmgw/store/_backends.py). Every
repository of the store (accounts and keys, nodes, audit, usage, the lease)
runs its statements through the one `Runner` its `SqlStore` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from llmgw.errors import DeadlineExceeded
from llmgw.store._backends import Backend, Exec, Rows

T = TypeVar("T")


class Runner:
    def __init__(self, backend: Backend, timeout_s: float) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._lock = trio.Lock()  # one call at a time on the one connection
        self.calls = 0

    def __repr__(self) -> str:
        return f"<Runner {self.where}, {self.calls} calls>"

    @property
    def where(self) -> str:
        return self.backend.where

    @property
    def now_sql(self) -> str:
        return self.backend.now_sql

    async def tx(self, fn: Callable[[Exec], T]) -> T:
        """Run `fn` in one transaction in a worker thread; its result."""
        try:
            with trio.fail_after(self.timeout_s):
                await self._lock.acquire()
        except trio.TooSlowError:
            raise DeadlineExceeded(
                f"store {self.where}: busy for {self.timeout_s:g} s with another call"
            ) from None
        try:
            self.calls += 1
            return await trio.to_thread.run_sync(self.backend.transaction, fn)
        finally:
            self._lock.release()

    async def q(self, sql: str, args: Sequence[Any] = ()) -> Rows:
        """One statement in a transaction of its own; its rows."""
        return await self.tx(lambda run: run(sql, args))

    async def aclose(self) -> None:
        async with self._lock:
            await trio.to_thread.run_sync(self.backend.close)
