"""The capnp thread: asyncio + KJ on a thread of its own, bridged to trio.

pycapnp 2.x runs only on an asyncio loop with KJ attached (`capnp.kj_loop()`),
and a capnp object destroyed on a thread without that loop aborts the
process. So every capnp object lives on one dedicated thread (`Bridge`), and
the rule is: **no capnp object crosses into trio code**.

- Calls from trio run as coroutines on the capnp thread (`Bridge.run`,
  `run_coroutine_threadsafe`); their results are converted to attrs values
  there, and errors are rebuilt as llmgw errors *outside* the `except` block,
  so neither a KjException nor a traceback frame holding a capnp reader
  reaches trio.
- Capabilities stay in a table on the capnp thread; trio holds handles
  (`Handle`: an integer id and the bridge). A handle released from trio, or
  collected there, schedules its removal on the capnp thread.
- Calls into trio (the servants behind Registry, NodeSession, Agent, LogSink)
  are served by `Bridge.answer`: scheduled with `TrioToken.run_sync_soon` into
  a nursery the bridge owns and answered through an asyncio future;
  cancelling either side cancels the other.

This module knows no capability and no socket: those are in _agent.py,
_registry.py and _net.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import capnp
import trio

from llmgw.errors import DeadlineExceeded, Disconnected, LlmgwError, PeerError
from llmgw.rpc._wire import Deadlines, encode_error, map_remote_error

log = logging.getLogger("llmgw.rpc")

T = TypeVar("T")


class _Outcome:
    __slots__ = ("error", "value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error


class Bridge:
    """One thread running asyncio + KJ, where every capnp object lives, and the
    two ways across: `run` (trio -> capnp) and `answer` (capnp -> trio)."""

    def __init__(self, *, deadlines: Deadlines | None = None) -> None:
        self.deadlines = deadlines or Deadlines()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._failure: BaseException | None = None
        self.ids = itertools.count(1)
        # capnp side only:
        self._caps: dict[int, Any] = {}
        self.conns: dict[int, Conn] = {}
        self.calls_in_flight = 0

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} caps={len(self._caps)} conns={len(self.conns)} "
            f"in_flight={self.calls_in_flight}>"
        )

    def statistics(self) -> dict[str, int]:
        return {
            "capabilities": len(self._caps),
            "connections": len(self.conns),
            "calls_in_flight": self.calls_in_flight,
        }

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start the thread; stop it, and close what is left on it, on exit."""
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._thread = threading.Thread(target=self._main, name="capnp", daemon=True)
            self._thread.start()
            await trio.to_thread.run_sync(self._ready.wait, abandon_on_cancel=True)
            if self._failure is not None:
                raise RuntimeError("the capnp thread failed to start") from self._failure
            try:
                yield
            finally:
                with trio.CancelScope(shield=True):
                    self._shutdown()
                    await trio.to_thread.run_sync(self._thread.join, 10.0)
                nursery.cancel_scope.cancel()

    # thread side -------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._amain())
        except BaseException as exc:  # surfaced to running() or logged
            self._failure = exc
            log.exception("capnp thread ended with an error")
        finally:
            self._ready.set()

    async def _amain(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with capnp.kj_loop():
            self._ready.set()
            await self._stop.wait()
            await self.close_all()
            await asyncio.sleep(0)

    async def close_all(self) -> None:
        """On the capnp thread, once stopping: close every connection and capability."""
        for conn in list(self.conns.values()):
            conn.close()
        self._caps.clear()

    def _shutdown(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop.set)

    # trio -> capnp -------------------------------------------------------------

    async def run(
        self,
        fn: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        what: str | None = None,
        deadline: float | None = None,
    ) -> T:
        """Run `fn(*args)` on the capnp thread and return its (plain) result.

        `fn` must return plain values. Cancelling the trio caller cancels the
        coroutine, and with it the capnp call it awaits. With a `deadline`
        (seconds), a call not answered by then is cancelled the same way and
        raises `DeadlineExceeded("did not answer WHAT in N s")`; `what` names
        the call (default: `fn`'s name).
        """
        what = what or getattr(fn, "__name__", "call").lstrip("_")
        loop = self._loop
        if loop is None or loop.is_closed():
            raise Disconnected("the RPC thread has stopped")
        cfut = asyncio.run_coroutine_threadsafe(self._guard(fn, args, what), loop)
        done = trio.Event()
        token = self._token
        assert token is not None

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        cfut.add_done_callback(wake)
        try:
            with trio.move_on_after(deadline if deadline is not None else float("inf")):
                await done.wait()
        except trio.Cancelled:
            cfut.cancel()
            raise
        if not done.is_set():
            cfut.cancel()
            raise DeadlineExceeded(f"did not answer {what} in {deadline:g} s")
        outcome: _Outcome = cfut.result()
        if outcome.error is not None:
            raise outcome.error
        return outcome.value  # type: ignore[no-any-return]

    async def _guard(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], what: str
    ) -> _Outcome:
        # Build our error outside the except block: the capnp exception, and
        # the frames its traceback holds, must die on this thread.
        self.calls_in_flight += 1
        error: LlmgwError | None = None
        try:
            return _Outcome(value=await fn(*args))
        except LlmgwError as exc:
            # Ours, but raised here: its context and frames may hold capnp objects.
            exc.__context__ = exc.__cause__ = None
            error = exc.with_traceback(None)
        except capnp.KjException as exc:
            error = map_remote_error(exc, what)
        except (ConnectionError, OSError) as exc:
            error = Disconnected(f"{what}: {exc}")
        except Exception as exc:
            log.exception("unexpected error in %s on the capnp thread", what)
            error = PeerError(f"{what}: {type(exc).__name__}: {exc}")
        finally:
            self.calls_in_flight -= 1
        return _Outcome(error=error)

    # capnp -> trio ---------------------------------------------------------------

    async def to_trio(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """From the capnp thread: run `fn(*args)` as a trio task and await it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_Outcome] = loop.create_future()
        box: dict[str, Any] = {"scope": None, "cancel": False}

        def deliver(outcome: _Outcome) -> None:
            if not fut.done():
                fut.set_result(outcome)

        async def runner() -> None:
            outcome = _Outcome(error=Disconnected("cancelled"))
            try:
                with trio.CancelScope() as scope:
                    box["scope"] = scope
                    if box["cancel"]:
                        scope.cancel()
                    try:
                        outcome = _Outcome(value=await fn(*args))
                    except Exception as exc:
                        outcome = _Outcome(error=exc)
            finally:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(deliver, outcome)

        def spawn() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(runner)

        def cancel() -> None:
            box["cancel"] = True
            if box["scope"] is not None:
                box["scope"].cancel()

        assert self._token is not None
        self._token.run_sync_soon(spawn)
        try:
            outcome = await fut
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(cancel)
            raise
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    async def answer(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Serve one capnp call (any server's `*_context`) with the trio servant's `fn(*args)`.

        A servant's exception leaves as `encode_error(exc)`: its code, message
        and extra fields. The KjException is raised outside the `except` block
        so the trio-side exception (and its frames) is not chained onto it.
        """
        message = None
        try:
            return await self.to_trio(fn, *args)
        except Exception as exc:
            message = encode_error(exc)
        raise capnp.KjException(message)

    def notify(self, event: trio.Event) -> None:
        """From the capnp thread: set a trio event."""
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(event.set)

    # capability table (capnp side) ---------------------------------------------------

    def keep(self, cap: Any, conn: Conn | None) -> int:
        """Capnp thread: hold `cap` (until released or `conn` closes); its id for a handle."""
        cap_id = next(self.ids)
        self._caps[cap_id] = cap
        if conn is not None:
            conn.caps.add(cap_id)
        return cap_id

    def cap(self, cap_id: int, what: str) -> Any:
        """Capnp thread: the capability behind a handle's id."""
        try:
            return self._caps[cap_id]
        except KeyError:
            raise Disconnected(f"{what}: capability released or its connection closed") from None

    def drop(self, cap_id: int) -> Any:
        """Capnp thread: forget a capability now; what was held, or None."""
        return self._caps.pop(cap_id, None)

    def release(self, cap_id: int) -> None:
        """Drop a capability; callable from any thread, idempotent."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._caps.pop, cap_id, None)


class Conn:
    """One connection, capnp side: its RPC system, stream and capabilities."""

    def __init__(
        self, conn_id: int, rpc: Any, stream: Any, closed: trio.Event, bridge: Bridge
    ) -> None:
        self.conn_id = conn_id
        self.rpc = rpc
        self.stream = stream
        self.closed = closed
        self.bridge = bridge
        self.caps: set[int] = set()
        self.watcher: asyncio.Task[None] | None = None
        self.done = False

    def watch(self, on_disconnect: Awaitable[Any]) -> None:
        async def wait() -> None:
            with contextlib.suppress(Exception):
                await on_disconnect
            self.close()

        self.watcher = asyncio.ensure_future(wait())

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        self.bridge.conns.pop(self.conn_id, None)
        for cap_id in self.caps:
            self.bridge.drop(cap_id)
        self.caps.clear()
        if self.watcher is not None and self.watcher is not asyncio.current_task():
            self.watcher.cancel()
        with contextlib.suppress(Exception):
            self.stream.close()
        self.bridge.notify(self.closed)


class Handle:
    """What trio code holds for a capability: its id in the bridge's table, no capnp object."""

    def __init__(self, bridge: Bridge, cap_id: int) -> None:
        self._bridge = bridge
        self._cap_id = cap_id
        self._released = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cap={self._cap_id}{' released' if self._released else ''}>"

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._bridge.release(self._cap_id)

    def __del__(self) -> None:
        # Collected on the trio thread: the capnp object itself is dropped on its own thread.
        with contextlib.suppress(Exception):
            self.release()
