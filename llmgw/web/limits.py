"""The client-side bounds of an llmgw HTTP listener: one value for every listener.

`ListenerLimits` holds what a listener allows one client: how long its head,
its body, each write to it and an idle keep-alive may take, how large its head
may be, how long its TLS handshake may take, how much of an unread body is
read and thrown away before the connection closes, and how many connections
may be open at once. The router's lean listener (llmgw/router/_server.py), its
hypercorn listener (llmgw/router/_hypercorn.py: keep-alive, head size and read
timeout) and the weights mirror (llmgw/cp/_weights/_mirror.py) read the bounds
they apply from it; a bound a listener has no use for (the router speaks no
TLS; the mirror takes no request body) is simply not read by that listener.

The defaults are the router's listener's (its config, `RouterConfig`, sets
them through `llmgw.router.listener_limits`); the mirror builds its own
(`MIRROR_LIMITS` there: shorter timeouts, a smaller head, 256 connections).

`discard_bytes` is here because it is a bound on the client: the most of an
unread request body a listener reads after an early answer. The mirror's
`chunk_bytes` (the size of each file read and write) is not: it bounds nothing
a client does, it is how the mirror moves its own bytes, so it stays in the
mirror as a constant (`CHUNK_BYTES`).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["ListenerLimits"]


def _positive(_: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    # A programmer's value (an operator's comes through a validated config first).
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"ListenerLimits.{attribute.name} must be > 0 (got {value!r})")


@attrs.frozen(kw_only=True)
class ListenerLimits:
    """The client-side bounds of one listener (the router's by default)."""

    # A request head must arrive within this of its first byte (408); for an idle
    # connection's next request the clock starts at the first byte, not before.
    head_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    # A request body must arrive within this of its head: a total bound, so a client
    # that sends 1 byte/s is cut too (408).
    body_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    # Every write to the client must complete within this; a client that stops
    # reading is cut (and the app answering it cancelled).
    send_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    # An idle keep-alive connection is closed after this. 75 s is longer than common
    # client pools keep idle connections, so the client closes first.
    keepalive_s: float = attrs.field(default=75.0, validator=_positive)
    # A request head (request line and headers) larger than this is refused (431).
    max_head_bytes: int = attrs.field(default=32768, validator=_positive)
    # A TLS handshake must complete within this (for a listener that speaks TLS).
    handshake_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    # After an early answer (413, or any answer sent before the body was read) at
    # most this much of the rest of the body is read and discarded, so the client
    # reads the answer rather than a reset; past it the connection is closed.
    discard_bytes: int = attrs.field(default=64 << 20, validator=_positive)
    # Connections beyond this many open ones are closed at once. None: no cap of the
    # listener's own (the router's: its admission control bounds the work, and the
    # process's file-descriptor limit bounds the sockets).
    max_connections: int | None = attrs.field(default=None, validator=_positive)
