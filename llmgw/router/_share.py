"""Router workers tell each other what their prefix indexes learn, over JSON lines.

The facts, the outbox and the merge rule are pure (llmgw/core/_prefix_share.py);
this module moves them. Every `SHARE_EVERY_S` (50 ms) a worker takes its fleet's
outbox (`Fleet.outbox`: chains it recorded, coalesced and bounded) and, if it holds
anything, sends one line

    {"learned": [[endpoint id, sent 0|1, delta, [block hash, ...]], ...]}

to the relay, which adds the facts to every other worker's outbox at the relay
(coalesced and bounded again, so a slow worker costs memory bounded by
`RELAY_MAX_BLOCKS`, never a wait for the others) and sends each worker its own
outbox's facts, the same line, on the same tick. A worker applies what it receives
to its indexes (`Fleet.learned`). Nothing of this is on a request's path: a request
only adds to an in-memory outbox; the lines go in a task of their own. A channel
that breaks or lags loses facts and nothing else: the workers then route as they
would without sharing.

Where the relay lives:
- inside llmgw-cp (llmgw/cp/_workers.py) it is the control plane: the lines go on
  each worker's existing channel beside the views and reports, and worker 0 (the
  control plane's own router) takes part as a member of the relay;
- in router-only mode (llmgw/router/_main.py) the supervisor, which routes nothing,
  serves `serve_relay` on a Unix socket of its own (mode 0600 in a directory of
  mode 0700) and each worker dials it (`share_via_relay`), saying `{"relay": i}`
  first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from llmgw.core import Learned, Outbox
from llmgw.router._fleet import SHARE_MAX_BLOCKS, Fleet

log = logging.getLogger("llmgw.router.share")

SHARE_EVERY_S = 0.05
# Each member's untold facts at the relay: 4 workers' worth of a worker's bound.
RELAY_MAX_BLOCKS = 4 * SHARE_MAX_BLOCKS
_MAX_LINE = 64 << 20
_REDIAL_S = 1.0


class Lines:
    """JSON values, one per line, from a stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = bytearray()

    async def next(self) -> Any:
        """The next value; EOFError when the peer closed."""
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 1]
                return json.loads(line)
            if len(self._buf) > _MAX_LINE:
                raise ValueError(f"a line longer than {_MAX_LINE} bytes on the worker channel")
            chunk = await self._stream.receive_some(1 << 16)
            if not chunk:
                raise EOFError
            self._buf += chunk


async def send_line(stream: trio.abc.SendStream, value: Any) -> None:
    await stream.send_all(json.dumps(value, separators=(",", ":")).encode() + b"\n")


class LineSender:
    """`send_line` for several tasks on one stream: one line at a time, whole."""

    def __init__(self, stream: trio.abc.SendStream) -> None:
        self._stream = stream
        self._lock = trio.Lock()

    async def __call__(self, value: Any) -> None:
        async with self._lock:
            await send_line(self._stream, value)


def learned_line(facts: list[Learned]) -> dict[str, Any]:
    return {"learned": [f.to_json() for f in facts]}


def parse_learned(message: Any) -> list[Learned]:
    """The facts of a `{"learned": [...]}` line; ValueError naming what is wrong."""
    facts = message.get("learned") if isinstance(message, dict) else None
    if not isinstance(facts, list):
        raise ValueError(f'a learned line is {{"learned": [fact, ...]}}, got {message!r:.200}')
    return [Learned.from_json(f) for f in facts]


class Relay:
    """The fan-out: each member's outbox holds what the others learned and it has not
    been sent yet. Member 0 may be the relay's own process (llmgw-cp's router)."""

    def __init__(self, max_blocks: int = RELAY_MAX_BLOCKS) -> None:
        self._max_blocks = max_blocks
        self._outboxes: dict[int, Outbox] = {}
        self.relayed = 0  # facts published, ever

    def __repr__(self) -> str:
        return f"<Relay members {sorted(self._outboxes)}, {self.relayed} facts relayed>"

    def join(self, member: int) -> Outbox:
        """The member's outbox, new and empty (a member that joins again starts afresh)."""
        box = self._outboxes[member] = Outbox(self._max_blocks)
        return box

    def leave(self, member: int, box: Outbox) -> None:
        if self._outboxes.get(member) is box:
            del self._outboxes[member]

    def publish(self, source: int, facts: list[Learned]) -> None:
        """`source` learned `facts`: every other member is to hear them."""
        self.relayed += len(facts)
        for member, box in self._outboxes.items():
            if member != source:
                for fact in facts:
                    box.add(fact)

    def statistics(self) -> dict[str, Any]:
        return {
            "members": sorted(self._outboxes),
            "relayed": self.relayed,
            "dropped": sum(b.dropped for b in self._outboxes.values()),
        }


async def tell(fleet: Fleet, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Send what the fleet's indexes learned, every SHARE_EVERY_S, until cancelled or the
    channel breaks (raises trio.BrokenResourceError / ClosedResourceError)."""
    box = fleet.outbox
    if box is None:
        return
    while True:
        await trio.sleep(SHARE_EVERY_S)
        fleet.expire_remote(trio.current_time())
        if len(box):
            await send(learned_line(box.take()))


def hear(fleet: Fleet, message: Any) -> int:
    """Apply a received learned line to the fleet; how many facts applied."""
    return fleet.learned(parse_learned(message), trio.current_time())


# --- router-only mode: the supervisor's relay, and a worker's end of it ---------------------


async def private_unix_listener(path: Path) -> trio.socket.SocketType:
    """A listening Unix socket at `path` (a previous run's removed), created 0600: only
    this user may speak for a worker."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            await sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_relay(
    path: Path, members: int, *, task_status: trio.TaskStatus[Relay] = trio.TASK_STATUS_IGNORED
) -> None:
    """Relay learned facts between `members` workers that dial `path` (a Unix socket)."""
    relay = Relay()
    sock = await private_unix_listener(path)

    async def member(stream: trio.SocketStream) -> None:
        index: int | None = None
        box: Outbox | None = None
        try:
            lines = Lines(stream)
            hello = await lines.next()
            index = int(hello["relay"])
            if not 0 <= index < members:
                log.warning("prefix relay: no worker %s (of %d)", index, members)
                return
            box = relay.join(index)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_relay_out, stream, box, nursery.cancel_scope)
                try:
                    while True:
                        relay.publish(index, parse_learned(await lines.next()))
                except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("prefix relay: worker %s sent a bad line: %s", index, exc)
                nursery.cancel_scope.cancel()
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("prefix relay: a bad hello: %s", exc)
        finally:
            if index is not None and box is not None:
                relay.leave(index, box)
            await stream.aclose()

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, member, [trio.SocketListener(sock)])
            task_status.started(relay)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _relay_out(stream: trio.SocketStream, box: Outbox, scope: trio.CancelScope) -> None:
    try:
        while True:
            await trio.sleep(SHARE_EVERY_S)
            if len(box):
                await send_line(stream, learned_line(box.take()))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        scope.cancel()


async def share_via_relay(fleet: Fleet, path: Path, index: int) -> None:
    """Worker `index`'s end: dial the relay, tell it what the fleet learns and apply what
    it relays; dial again after a second when the relay is not there or the channel
    breaks (the worker routes on, unshared, meanwhile). Until cancelled."""
    if fleet.outbox is None:
        return
    while True:
        try:
            stream = await trio.open_unix_socket(str(path))
        except OSError as exc:
            log.warning(
                "router worker %d: prefix relay %s: %s; routing unshared, dialling again",
                index,
                path,
                exc.strerror or exc,
            )
            await trio.sleep(_REDIAL_S)
            continue
        async with stream:
            send = LineSender(stream)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_told, fleet, send, nursery.cancel_scope)
                try:
                    await send({"relay": index})
                    lines = Lines(stream)
                    while True:
                        hear(fleet, await lines.next())
                except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                    log.warning("router worker %d: prefix relay closed; dialling again", index)
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("router worker %d: prefix relay sent a bad line: %s", index, exc)
                nursery.cancel_scope.cancel()
        await trio.sleep(_REDIAL_S)


async def _told(
    fleet: Fleet, send: Callable[[dict[str, Any]], Awaitable[None]], scope: trio.CancelScope
) -> None:
    try:
        await tell(fleet, send)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        scope.cancel()
