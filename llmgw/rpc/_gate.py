"""The agents' listener: unauthenticated peers are cheap.

asyncio's `create_server(ssl=...)` builds an `SSLProtocol` for every accepted
socket, and that allocates a 256 KiB receive buffer at once: 1,000 TCP
connections that never start TLS held ~300 MiB of the control plane for up to
a minute, and glibc did not give it back after they closed. So this listener
accepts plain TCP itself and keeps, per pending connection, a socket and a
timer. Only when the first byte that arrives opens a TLS handshake record
(0x16, then 0x03) is the socket given a TLS protocol (`TlsProtocol`, which also
sends the alert of a failed handshake); anything else is closed at once.

Bounds (`HandshakeLimits`):

- `timeout_s`: from accept to a finished TLS handshake, both stages together;
  past it the connection is closed.
- `max_pending`: connections accepted and not yet authenticated. A new one
  beyond it first evicts the oldest *silent* pending connection (one that has
  sent nothing costs an attacker nothing to hold, so holding it must not lock
  agents out: an agent's ClientHello follows its SYN by one round trip; one
  whose ClientHello has arrived, unread yet, goes on to its handshake instead);
  when every pending connection is already in its TLS handshake, the listener
  stops accepting until one of them finishes: newcomers wait in the kernel's
  accept queue (`backlog`), where they cost the control plane nothing, and are
  taken in turn. (Closing them, as this did before, turned a register storm of
  10,000 agents into resets and retries with backoff: 38 s, and agents that
  gave up.) So the memory held by pending connections is at most
  `max_pending` TLS handshakes, and the handshake deadline starts at accept,
  not while a connection waits in the queue.

Agents that are registered never wait on any of this: their connections are
established transports the event loop serves as before, and an accept burst
is handled in slices of at most `_ACCEPT_BATCH` sockets per loop turn.

Failures are logged with the peer's address and the reason, once per peer IP
per minute (`RateLimit`); the rest are counted in `statistics()`.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import collections
import contextlib
import errno
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from llmgw.rpc import _tls

log = logging.getLogger("llmgw.rpc.listener")

_ACCEPT_BATCH = 128
_TLS_HANDSHAKE = 0x16  # TLS record content type "handshake"
_TLS_MAJOR = 0x03
# accept() errors that mean "out of a resource", not "this peer went away".
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@attrs.frozen
class HandshakeLimits:
    """How long, and how many, unauthenticated connections the agents' listener holds."""

    timeout_s: float = 5.0
    max_pending: int = 256
    # Connections wait here while max_pending handshakes are under way (the kernel
    # caps it at net.core.somaxconn; beyond it a SYN is dropped and the client resends).
    backlog: int = 4096


class RateLimit:
    """Says yes once per key per `period_s`; counts what it said no to.

    `clock` is injectable so tests need not wait a minute. Memory is bounded:
    keys older than a period are forgotten when the table grows past `max_keys`.
    """

    def __init__(
        self,
        period_s: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 10_000,
    ) -> None:
        self.period_s = period_s
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return f"<RateLimit period={self.period_s:g}s keys={len(self._last)}>"

    def allow(self, key: str) -> tuple[bool, int]:
        """(allowed, how many were suppressed for `key` since the last allowed one)."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self._suppressed[key] += 1
            return False, 0
        if len(self._last) >= self._max_keys:
            for k in [k for k, t in self._last.items() if now - t >= self.period_s]:
                del self._last[k]
                self._suppressed.pop(k, None)
        self._last[key] = now
        return True, self._suppressed.pop(key, 0)


_read_buffers = threading.local()  # TlsProtocol's receive buffer, one per event loop thread


class TlsProtocol(asyncio.sslproto.SSLProtocol):
    """asyncio's TLS protocol, with two changes that matter to a fleet.

    - A failed handshake sends its alert. asyncio's own drops the alert
      OpenSSL wrote (the handshake error path never flushes it), so a refused
      agent saw only a closed connection, never "unknown ca" or "certificate
      expired". The refusal tests would fail if a Python release changed this.
    - One receive buffer per thread, shared by every connection, instead of
      256 KiB each (32 KiB each before this, still a third of the 100 KiB an
      agent may cost). asyncio's selector transport asks for the buffer, reads
      the socket into it and hands it back within one call (`get_buffer`,
      `recv_into`, `buffer_updated`), and `buffer_updated` copies it into
      OpenSSL's memory BIO before anything else runs: no two connections ever
      hold it at once.

    Built on a plain transport (`connect_accepted_socket` / `create_connection`
    without ssl=), as `loop.start_tls` does internally; `waiter` resolves when
    the handshake is done, or fails with its error (see `open_tls`).
    """

    max_size = 64 * 1024  # a read from the socket: up to four TLS records

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        view: memoryview | None = getattr(_read_buffers, "view", None)
        if view is None:
            view = _read_buffers.view = memoryview(bytearray(self.max_size))
        # asyncio's own (allocated above) is dropped here; get_buffer returns this one.
        self._ssl_buffer = view.obj
        self._ssl_buffer_view = view

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        transport = getattr(self, "_transport", None)
        if handshake_exc is not None and isinstance(transport, asyncio.Transport):
            with contextlib.suppress(Exception):
                # The MemoryBIO OpenSSL wrote the alert to (untyped in typeshed).
                alert = self._outgoing.read()  # type: ignore[attr-defined]
                if alert and not transport.is_closing():
                    transport.write(alert)
        super()._on_handshake_complete(handshake_exc)
        # The control plane reads only the subject (the node id); the rest of the parsed
        # certificate (issuer, validity, names) is ~1.5 KiB per connected agent.
        extra: dict[str, Any] = self._extra
        cert = extra.get("peercert")
        if self._server_side and cert:
            extra["peercert"] = {"subject": cert.get("subject")}


async def open_tls(
    connect: Callable[[Callable[[], asyncio.BaseProtocol]], Any],
    app_protocol: asyncio.BaseProtocol,
    tls: ssl.SSLContext,
    *,
    server_side: bool,
    server_hostname: str | None = None,
    timeout: float,
) -> asyncio.BaseTransport:
    """TLS over the plain transport `connect(factory)` makes; returns the TLS transport.

    Raises what the handshake raised (ssl.SSLError, ConnectionError, TimeoutError).
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    protocol = TlsProtocol(
        loop,
        app_protocol,
        tls,
        waiter,
        server_side=server_side,
        server_hostname=server_hostname,
        ssl_handshake_timeout=timeout,
    )
    transport, _ = await connect(lambda: protocol)
    try:
        await waiter
    except BaseException:
        transport.close()
        raise
    app_transport: asyncio.BaseTransport = protocol._app_transport
    return app_transport


class _Pending:
    __slots__ = ("address", "host", "sock", "stage", "task", "timer")

    def __init__(self, sock: socket.socket, host: str, address: str) -> None:
        self.sock = sock
        self.host = host
        self.address = address
        self.stage = "silent"  # then "tls"
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None


class HandshakeGate:
    """Accepts on `sock`, upgrades to TLS, and gives each authenticated connection away.

    `protocol_factory` is what `connect_accepted_socket` builds for a
    connection whose handshake then succeeds; the caller's work starts in its
    `connection_made`.
    """

    def __init__(
        self,
        sock: socket.socket,
        tls: ssl.SSLContext,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        limits: HandshakeLimits = HandshakeLimits(),
        *,
        refusals: RateLimit | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._tls = tls
        self._factory = protocol_factory
        self.limits = limits
        self._refusals = refusals or RateLimit()
        # fd -> pending connection, oldest first.
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()
        self._paused = False  # out of file descriptors: accepting again in a moment
        self._held = False  # every slot is a handshake: newcomers wait in the accept queue
        self._reading = True
        self._closed = False
        self.counts: collections.Counter[str] = collections.Counter()
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_accept)

    def __repr__(self) -> str:
        return f"<HandshakeGate pending={len(self._pending)} {dict(self.counts)}>"

    @property
    def port(self) -> int:
        port: int = self._sock.getsockname()[1]
        return port

    def statistics(self) -> dict[str, int]:
        in_tls = sum(1 for p in self._pending.values() if p.stage == "tls")
        return {
            "pending": len(self._pending),
            "pending_silent": len(self._pending) - in_tls,
            "pending_tls": in_tls,
            "holding": int(self._held),
            **self.counts,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._poll_listener()
        self._sock.close()
        for fd in list(self._pending):
            self._drop(fd)

    # accepting -------------------------------------------------------------------

    def _on_accept(self) -> None:
        for i in range(_ACCEPT_BATCH):
            if len(self._pending) >= self.limits.max_pending:
                # Only the first turn knows someone waits (the socket polled readable);
                # later ones come back on the next loop turn rather than evict for nobody.
                if i > 0:
                    return
                if not self._evict_silent():
                    self._hold()
                    return
            try:
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRNOS:
                    self._out_of_resources(exc)
                # ECONNABORTED and the like: that peer is gone, the next may not be.
                return
            self.counts["accepted"] += 1
            self._admit(conn, peer)

    def _out_of_resources(self, exc: OSError) -> None:
        self.counts["accept_errors"] += 1
        if self._evict_silent():
            return  # an fd was freed: accept again on the next turn
        # Nothing to free: stop polling the listener for a moment instead of spinning.
        if not self._paused:
            self._paused = True
            allowed, _ = self._refusals.allow("accept-error")
            if allowed:
                log.warning(
                    "agents' listener cannot accept: %s; raise the open-files limit "
                    "(LimitNOFILE=) of llmgw-cp",
                    exc.strerror or exc,
                )
            self._poll_listener()
            self._loop.call_later(0.1, self._resume)

    def _resume(self) -> None:
        self._paused = False
        self._poll_listener()

    def _hold(self) -> None:
        """Every slot is a handshake under way: accept no more until one ends."""
        if self._held:
            return
        self._held = True
        self.counts["held_full"] += 1
        self._note(
            "listener full",
            logging.INFO,
            "%d connections are in their TLS handshake (rpc_max_pending_handshakes): "
            "new ones wait in the listen backlog until one finishes",
            self.limits.max_pending,
        )
        self._poll_listener()

    def _slot_freed(self) -> None:
        if self._held and len(self._pending) < self.limits.max_pending:
            self._held = False
            self._poll_listener()

    def _poll_listener(self) -> None:
        """Watch the listening socket exactly while accepting is wanted."""
        want = not (self._closed or self._paused or self._held)
        if want == self._reading:
            return
        self._reading = want
        if want:
            self._loop.add_reader(self._sock.fileno(), self._on_accept)
        else:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())

    def _admit(self, conn: socket.socket, peer: Any) -> None:
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        address = _tls.format_peer(peer)
        conn.setblocking(False)
        fd = conn.fileno()
        pending = _Pending(conn, host, address)
        pending.timer = self._loop.call_later(self.limits.timeout_s, self._expire, fd)
        self._pending[fd] = pending
        self._loop.add_reader(fd, self._on_first_bytes, fd)

    def _evict_silent(self) -> bool:
        """Free a slot held by a silent connection, oldest first; False if none is.

        Each is looked at first: under load, a connection whose ClientHello has
        arrived but whose reader has not run yet is an agent, not silence (in a
        register storm, evicting those reset agents by the hundred); it goes on
        to its handshake instead, and the next silent one is looked at."""
        for fd in [fd for fd, p in self._pending.items() if p.stage == "silent"]:
            self._on_first_bytes(fd)
            pending = self._pending.get(fd)
            if pending is None:
                return True  # it had closed, or sent something that is not TLS: dropped
            if pending.stage == "silent":
                self.counts["evicted_silent"] += 1
                self._drop(fd)
                return True
        return False

    def _on_first_bytes(self, fd: int) -> None:
        pending = self._pending.get(fd)
        if pending is None:
            return
        try:
            head = pending.sock.recv(2, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.counts["reset_silent"] += 1
            self._drop(fd)
            return
        if not head:
            self.counts["closed_silent"] += 1
            self._drop(fd)
            return
        if head[0] != _TLS_HANDSHAKE or (len(head) > 1 and head[1] != _TLS_MAJOR):
            self.counts["not_tls"] += 1
            self._note(
                f"{pending.host} noise",
                logging.INFO,
                "closed connection from %s: it does not speak TLS (first bytes %r); "
                "agents dial this port with mutual TLS",
                pending.address,
                head,
            )
            self._drop(fd)
            return
        if _peer_gave_up(pending.sock):
            # Its ClientHello waited in the accept queue past the agent's own connect
            # timeout: a handshake now would be work for nobody (in a storm that is
            # congestion collapse: every retry queues behind dead connections).
            self.counts["abandoned"] += 1
            self._drop(fd)
            return
        self._loop.remove_reader(fd)
        pending.stage = "tls"
        pending.task = self._loop.create_task(self._upgrade(fd, pending))

    async def _upgrade(self, fd: int, pending: _Pending) -> None:
        remaining = max(0.05, (pending.timer.when() if pending.timer else 0) - self._loop.time())
        failure: BaseException | None = None
        sock = pending.sock
        try:
            await open_tls(
                lambda factory: self._loop.connect_accepted_socket(factory, sock),
                self._factory(),
                self._tls,
                server_side=True,
                # Ours expires first and counts it; this one is a backstop.
                timeout=remaining + 1.0,
            )
        except asyncio.CancelledError:
            return  # expired or closed: _drop has done the rest
        except (OSError, EOFError) as exc:
            failure = exc
        # The socket now belongs to asyncio's transport (closed by it on failure).
        if self._pending.get(fd) is pending:
            del self._pending[fd]
            if pending.timer is not None:
                pending.timer.cancel()
            self._slot_freed()
        if failure is None:
            self.counts["authenticated"] += 1
            return
        self.counts["refused_tls"] += 1
        self._note(
            pending.host,
            logging.WARNING,
            "refused agent connection from %s: %s",
            pending.address,
            _tls.describe_client_refusal(failure),
        )

    def _expire(self, fd: int) -> None:
        pending = self._pending.get(fd)
        if pending is None:
            return
        self.counts[f"timed_out_{pending.stage}"] += 1
        stage = "sent nothing" if pending.stage == "silent" else "did not finish its TLS handshake"
        self._note(
            f"{pending.host} noise",
            logging.INFO,
            "closed connection from %s: it %s within %g s (rpc_handshake_timeout_s)",
            pending.address,
            stage,
            self.limits.timeout_s,
        )
        self._drop(fd)

    def _drop(self, fd: int) -> None:
        pending = self._pending.pop(fd, None)
        if pending is None:
            return
        self._slot_freed()
        if pending.timer is not None:
            pending.timer.cancel()
        if pending.stage == "silent":
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)
            _abort(pending.sock)
        elif pending.task is not None:
            # connect_accepted_socket closes its transport, and the socket, when
            # cancelled; a task cancelled before it ever ran never got the socket.
            pending.task.cancel()
            sock = pending.sock
            pending.task.add_done_callback(lambda _: sock.close())

    def _note(self, key: str, level: int, message: str, *args: object) -> None:
        # TLS refusals are keyed by the peer's IP alone; other noise gets its own key,
        # so a port scanner on an agent's address does not mute that agent's refusal.
        allowed, suppressed = self._refusals.allow(key)
        if not allowed:
            log.debug(message, *args)
            return
        if suppressed:
            message += " (%d more like it were not logged)"
            args = (*args, suppressed)
        log.log(level, message + " (logged once a minute per address)", *args)


_TCP_CLOSE_WAIT = 8  # linux/tcp_states.h: the peer sent FIN, this side has not closed


def _peer_gave_up(sock: socket.socket) -> bool:
    """The peer has closed its side already (TCP CLOSE_WAIT, read from TCP_INFO's first
    byte); False where the platform does not say."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, 1)
    except OSError:
        return False
    return bool(info) and info[0] == _TCP_CLOSE_WAIT


def _abort(sock: socket.socket) -> None:
    """Close at once, with a reset: nothing is owed to an unauthenticated peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A bound, listening TCP socket (dual-stack where the host asks for it)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def raise_open_files_limit() -> None:
    """Lift the soft open-files limit to the hard one: each agent holds a connection.

    Without it a control plane started with the common soft limit of 1,024
    stops accepting (EMFILE) near a thousand agents, or sooner under a flood
    of unauthenticated connections.
    """
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.debug("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
