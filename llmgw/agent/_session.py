"""The agent's session with the control plane.

Connect, register with the whole inventory and every shard, heartbeat, and
when anything breaks, reconnect: every address in turn, then a jittered
exponential backoff, forever. A standby's refusal moves on at once (to the
leader it names, when it names one), except back to a control plane whose session
was just lost: the standby is asked again until it has taken over, unless the refusal
names that leader at a newer epoch than the lost session's (re-elected: dialled at once).

`hello_inventory` is asked for the inventory at every registration; the
agent's (`Node.hello_inventory`) discovers once per process and answers later
registrations from what it knows plus a fresh usage sample, so a reconnect
costs no probing.

Progress (`notify_progress`, a fetch's bytes, keyed by source) is not state:
the latest per source is pushed on the session's `progress` method, dropped
while not connected and never replayed at registration.
"""

from __future__ import annotations

import logging
import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

from llmgw import __version__, model
from llmgw.errors import Disconnected, PeerError, RegistrationRefused, RemoteError, TlsRefused
from llmgw.rpc import CapnpThread, ClientConnection, SessionHandle

log = logging.getLogger("llmgw.agent.session")

# A control plane whose session was lost this recently is not dialled again while another
# address may answer (see AgentSession._round); longer than a lease plus a retry (lease_s
# defaults to 10 s), short enough that a blip costs no more than this. The rule ends
# sooner when a standby's refusal names that control plane as the leader at a newer
# epoch than the lost session's: it was deposed and has been elected again.
LOST_RECENTLY_S = 20.0


@attrs.frozen
class Backoff:
    """Jittered exponential backoff: `initial * 2**attempt`, capped, times a factor in [0.5, 1]."""

    initial_s: float = 0.5
    max_s: float = 5.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        return float(
            min(self.max_s, self.initial_s * 2 ** min(attempt, 30)) * rng.uniform(0.5, 1.0)
        )


class AgentSession:
    def __init__(
        self,
        *,
        node_id: str,
        addresses: Sequence[tuple[str, int]],
        tls: ssl.SSLContext,
        servant: object,
        hello_inventory: Callable[[], Awaitable[model.Inventory]],
        heartbeat: Callable[[int], Awaitable[model.Heartbeat]],
        shards: Callable[[], tuple[model.ShardReport, ...]] = tuple,
        backoff: Backoff = Backoff(),
        rng: random.Random | None = None,
        cert_path: Path | None = None,
        on_registered: Callable[[model.Settings], None] = lambda settings: None,
    ) -> None:
        self.node_id = node_id
        # Each registration's settings (the engine declaration among them).
        self._on_registered = on_registered
        self.addresses = list(addresses)
        self._tls = tls
        self._cert_path = cert_path  # named when the control plane refuses it
        self._servant = servant
        self._hello_inventory = hello_inventory
        self._heartbeat = heartbeat
        self._shards = shards
        self._backoff = backoff
        self._rng = rng or random.Random()
        self.registered_with: str | None = None
        self.registrations = 0
        self.connected = trio.Event()
        self._last_complaint: str | None = None
        self._pending: dict[str, model.ShardReport] = {}
        self._pending_event = trio.Event()
        self._progress: dict[str, model.Progress] = {}
        self._progress_event = trio.Event()
        self.progress_sent = 0
        # The last registration: where it dialled and what it was told (the mirror's port).
        self.control_plane: tuple[str, int, model.Settings] | None = None
        # When a registered session with each address ended (trio clock), and the epoch
        # that session was registered at: see _round and `_dial_named`.
        self._lost_at: dict[tuple[str, int], tuple[float, int]] = {}

    def notify_shard(self, report: model.ShardReport) -> None:
        """A shard changed: tell the control plane now if connected, else at registration."""
        self._pending[report.shard_id] = report
        self._pending_event.set()

    def notify_progress(self, progress: model.Progress) -> None:
        """A fetch moved on: pushed now if connected (the latest per source), else dropped."""
        if not self.connected.is_set():
            return
        self._progress[progress.source] = progress
        self._progress_event.set()

    def __repr__(self) -> str:
        return (
            f"<AgentSession {self.node_id} registered_with={self.registered_with} "
            f"registrations={self.registrations}>"
        )

    def _round(self, now: float) -> list[tuple[str, int]]:
        """The addresses to try in this round: a control plane whose session was lost
        less than LOST_RECENTLY_S ago is left out while there is another to try, so a
        standby that still names it (its lease not yet lapsed) does not send the agent
        back to a leader that stopped answering (SIGSTOP, a partition): the standby is
        asked again after a backoff, and takes over once the lease lapses."""
        fresh = [
            a
            for a in self.addresses
            if now - self._lost_at.get(a, (-LOST_RECENTLY_S, 0))[0] >= LOST_RECENTLY_S
        ]
        return fresh or list(self.addresses)

    async def run(self, bridge: CapnpThread) -> None:
        """Stay registered until cancelled."""
        attempt = 0
        while True:
            queue = self._round(trio.current_time())
            tried: set[tuple[str, int]] = set()
            while queue:
                host, port = queue.pop(0)
                if (host, port) in tried:
                    continue
                tried.add((host, port))
                try:
                    await self._one_session(bridge, host, port)
                    attempt = 0  # we were registered: start the backoff afresh
                except RegistrationRefused as exc:
                    self._complain(f"control plane {host}:{port} refused registration: {exc}")
                    leader = self._dial_named(exc, f"{host}:{port}")
                    if leader is not None:
                        queue.insert(0, leader)
                except TlsRefused as exc:
                    self._complain(str(exc), logging.ERROR)
                except PeerError as exc:
                    self._complain(f"control plane {host}:{port}: {exc}")
                except trio.TooSlowError:
                    self._complain(f"control plane {host}:{port} did not answer in time")
                finally:
                    self.registered_with = None
            delay = self._backoff.delay(attempt, self._rng)
            attempt += 1
            log.log(
                logging.INFO if attempt % 10 == 1 else logging.DEBUG,
                "no control plane reachable; next try in %.1f s (attempt %d)",
                delay,
                attempt,
            )
            await trio.sleep(delay)

    def _dial_named(self, exc: RegistrationRefused, by: str) -> tuple[str, int] | None:
        """The leader a standby's refusal names, to dial next; None to ask again after a
        pause: its session was lost less than LOST_RECENTLY_S ago and the refusal does not
        say it was elected again since (an epoch newer than that session's)."""
        leader = _parse_address(exc.leader) if exc.leader else None
        if leader is None:
            return None
        lost = self._lost_at.get(leader)
        if lost is None:
            return leader
        ago = trio.current_time() - lost[0]
        if ago >= LOST_RECENTLY_S:
            return leader
        if exc.epoch is not None and exc.epoch > lost[1]:
            log.info(
                "%s names %s as the leader at epoch %d, newer than the session lost %.0f s "
                "ago (epoch %d): dialling it now",
                by, exc.leader, exc.epoch, ago, lost[1],
            )  # fmt: skip
            del self._lost_at[leader]  # a new term: the rule was about the old one
            return leader
        log.info(
            "%s names %s as the leader, whose session was lost %.0f s ago: asking again "
            "after a pause",
            by, exc.leader, ago,
        )  # fmt: skip
        return None

    def _complain(self, message: str, level: int = logging.WARNING) -> None:
        """Log a failure; the same failure again, on every retry, only at debug level."""
        log.log(level if message != self._last_complaint else logging.DEBUG, "%s", message)
        self._last_complaint = message

    async def _one_session(self, bridge: CapnpThread, host: str, port: int) -> None:
        async with bridge.connect(
            host,
            port,
            self._tls,
            agent=self._servant,  # type: ignore[arg-type]
            cert_path=self._cert_path,
            node=self.node_id,
        ) as conn:
            self._pending.clear()
            self._progress.clear()
            hello = model.Hello(
                node_id=self.node_id,
                agent_version=__version__,
                inventory=await self._hello_inventory(),
                shards=self._shards(),
            )
            # Bounded (30 s) in the bridge: DeadlineExceeded, then the next address.
            session, settings = await conn.register(hello, deadline=30.0)
            self.registered_with = f"{host}:{port}"
            self.control_plane = (host, port, settings)
            self._on_registered(settings)
            self._last_complaint = None
            self.registrations += 1
            self.connected.set()
            log.info(
                "registered with %s:%s (heartbeat every %g s, epoch %d)",
                host,
                port,
                settings.heartbeat_interval_s,
                settings.epoch,
            )
            try:
                await self._heartbeats(conn, session, settings)
            finally:
                self._lost_at[(host, port)] = (trio.current_time(), settings.epoch)
                session.release()
                self.connected = trio.Event()

    async def _heartbeats(
        self, conn: ClientConnection, session: SessionHandle, settings: model.Settings
    ) -> None:
        interval = settings.heartbeat_interval_s
        # A control plane that holds the connection and stops answering (SIGSTOP,
        # a partition without RST) must cost a reconnect, not a hang.
        deadline = max(2 * interval, 1.0)
        seq = 0
        failure: PeerError | None = None

        async def beat_forever() -> None:
            nonlocal seq
            while True:
                await trio.sleep(interval)
                seq += 1
                beat = await self._heartbeat(seq)
                await session.heartbeat(beat, deadline=deadline)

        async def push_shards() -> None:
            while True:
                await self._pending_event.wait()
                self._pending_event = trio.Event()
                while self._pending:
                    _, report = self._pending.popitem()
                    await session.shard_status(report, deadline=deadline)

        async def push_progress() -> None:
            while True:
                await self._progress_event.wait()
                self._progress_event = trio.Event()
                while self._progress:
                    _, progress = self._progress.popitem()
                    try:
                        await session.progress(progress, deadline=deadline)
                    except RemoteError as exc:
                        # Refused by the control plane: progress is not state, the
                        # session goes on (a dead or silent peer still ends it).
                        log.debug("progress for %s refused: %s", progress.source, exc)
                    else:
                        self.progress_sent += 1

        async def until_failure(fn: Callable[[], Awaitable[None]]) -> None:
            # A failed call ends the session here, outside the nursery's exception group.
            nonlocal failure
            try:
                await fn()
            except PeerError as exc:
                failure = failure or exc
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(until_failure, beat_forever)
            nursery.start_soon(until_failure, push_shards)
            nursery.start_soon(until_failure, push_progress)
            await conn.closed.wait()
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        raise Disconnected(f"connection to {conn.address} lost")


def _parse_address(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):  # "²" passes isdigit alone
        return None
    return host.strip("[]"), int(port)
