"""Leadership: which control plane acts, and for how long it may.

With a shared store (PostgreSQL) every control plane competes for one lease
(the store's `lease` row: holder, epoch, expiry on the database's clock).
A standby tries to take it every `lease_s / 3`; the leader renews it as often.
Taking the lease increments the epoch, which every command to an agent and
every registration's Settings carry, so agents refuse a deposed leader's
commands (`StaleEpoch`).

The leader counts its lease on this process's monotonic clock from the moment
it *sent* the last successful acquire or renewal (the database set the expiry
at or after that moment, so the local count ends no later than the real one).
`may_act()` is True only while leader and inside that count: the reconciler,
the registry's commands and admin writes check it, so a leader stopped past
its lease (SIGSTOP, a long pause) acts on nothing when it wakes, before its
loop has even noticed.

It is deposed at once ("stops acting the moment its renewal fails") when
  - a renewal is answered False: another control plane holds the lease;
  - a renewal fails or does not answer in time and less than one renewal
    interval of the lease is left;
  - the local count ran out (it was paused);
  - an agent refused a command as stale (`step_down`): it knows a newer leader.
Deposition calls `on_deposed(why)`; the registry then drops every agent
session, so agents redial and are sent to the leader. A deposed control plane
is a standby again and competes on the next interval.

On SQLite (not shared) the control plane takes the lease at start (it is its
own holder, so `try_acquire` re-takes its own lease after a restart, epoch+1)
and renews it; its role reads "single".

The holder string is JSON `{"admin": "H:P", "rpc": "H:P"}` (`Holder.encode`),
so a standby can name the leader's addresses: agents are sent to `rpc`, `ctl`
users to `admin`. Two control planes must advertise different addresses: the
store cannot tell two holders with one name apart.

Log lines (one each, for operators and tests):
  INFO  "leader: elected, epoch N (holder ...)"
  WARNING "leader: deposed at epoch N: WHY"
  INFO  "leader: standby; leader is H:P (admin H:P)" when the known leader changes
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any, Protocol

import attrs
import trio

from llmgw import config
from llmgw.store import Lease

log = logging.getLogger("llmgw.cp.leader")

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


@attrs.frozen
class Holder:
    """A control plane's addresses as others reach it: agents `rpc`, operators `admin`."""

    rpc: str
    admin: str

    def encode(self) -> str:
        return json.dumps({"admin": self.admin, "rpc": self.rpc}, sort_keys=True)

    @classmethod
    def decode(cls, text: str | None) -> Holder | None:
        """The holder a lease names; None for one this code cannot read (then the
        standby says it knows no leader rather than guessing an address)."""
        if not text:
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        rpc, admin = data.get("rpc"), data.get("admin")
        if not isinstance(rpc, str) or not isinstance(admin, str):
            return None
        return cls(rpc=rpc, admin=admin)

    def json(self) -> dict[str, str]:
        return {"rpc": self.rpc, "admin": self.admin}

    def describe(self) -> str:
        return f"{self.rpc} (admin {self.admin})"


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_address(listen: str, fqdn: Callable[[], str] = socket.getfqdn) -> str:
    """A listen address as others dial it: a wildcard host becomes this machine's FQDN."""
    host, port = config.split_host_port(listen)
    if host in _WILDCARDS:
        return _join(fqdn(), port)
    return _join(host, port)


def advertised(cfg: config.ServerConfig, fqdn: Callable[[], str] = socket.getfqdn) -> Holder:
    """server.yaml's `advertise` (the RPC address agents dial), or rpc_listen resolved;
    the admin address is admin_listen resolved likewise, on the same host as `advertise`
    when admin_listen's host is a wildcard and `advertise` is set."""
    rpc = str(cfg.advertise) if cfg.advertise is not None else resolve_address(cfg.rpc_listen, fqdn)
    admin_host, admin_port = config.split_host_port(cfg.admin_listen)
    if admin_host in _WILDCARDS and cfg.advertise is not None:
        admin = _join(config.split_host_port(cfg.advertise)[0], admin_port)
    else:
        admin = resolve_address(cfg.admin_listen, fqdn)
    return Holder(rpc=rpc, admin=admin)


class LeaseStore(Protocol):
    """The part of the store leadership uses (llmgw/store)."""

    @property
    def shared(self) -> bool: ...
    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None: ...
    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool: ...
    async def current(self) -> Lease | None: ...


@attrs.frozen
class LeaderView:
    """What `GET /api/v1/leader` shows (a snapshot)."""

    role: str  # leader | standby | single
    epoch: int | None
    leader: Holder | None
    me: Holder
    lease_s: float
    elections: int
    depositions: int

    def json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "epoch": self.epoch,
            "leader": self.leader.json() if self.leader is not None else None,
            "me": self.me.json(),
            "lease_s": self.lease_s,
        }


class Leadership:
    def __init__(
        self,
        store: LeaseStore,
        me: Holder,
        lease_s: float,
        on_elected: Callable[[int], Awaitable[None]],
        on_deposed: Callable[[str], None],
        *,
        on_leader: Callable[[Holder | None], None] | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._store = store
        self.me = me
        self._holder = me.encode()
        self.lease_s = float(lease_s)
        self.interval_s = self.lease_s / 3
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._on_leader = on_leader  # a standby learned (or lost) who leads
        self._clock = clock
        self._leading = False
        self._epoch: int | None = None  # the epoch of our lease while leading
        self._valid_until = float("-inf")  # local clock: the end of our lease
        self._leader: Holder | None = None  # whom we last saw holding the lease
        self._last_epoch: int | None = None  # the newest epoch seen in the store
        self._step_down = trio.Event()
        self._started = False
        self.elections = 0
        self.depositions = 0

    def __repr__(self) -> str:
        v = self.view()
        return f"<Leadership {v.role} epoch={v.epoch} me={self.me.rpc}>"

    @property
    def shared(self) -> bool:
        return bool(self._store.shared)

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def epoch(self) -> int | None:
        """Our epoch while leading, else the newest one seen in the store (None: none)."""
        return self._epoch if self._leading else self._last_epoch

    def may_act(self) -> bool:
        """True only while leader and inside the lease by this process's clock."""
        return self._leading and self._clock() < self._valid_until

    def view(self) -> LeaderView:
        leading = self.may_act()
        role = ("leader" if self.shared else "single") if leading else "standby"
        return LeaderView(
            role=role,
            epoch=self.epoch,
            leader=self.me if leading else self._leader,
            me=self.me,
            lease_s=self.lease_s,
            elections=self.elections,
            depositions=self.depositions,
        )

    def step_down(self, why: str) -> None:
        """Stop acting now (an agent knows a newer epoch); the loop competes again later."""
        if self._leading:
            self._depose(why)
            self._step_down.set()

    # the loop ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Compete, lead, and again. `started` after the first attempt: a control plane
        alone on its store (SQLite, or an idle PostgreSQL) leads before it listens."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                await self._compete()
                if not self._started:
                    self._started = True
                    task_status.started()
                if self._leading:
                    await self._lead()
                else:
                    await trio.sleep(self.interval_s)

    async def _bounded(self, fn: Callable[[], Awaitable[Any]], deadline: float) -> tuple[bool, Any]:
        """(True, result) or (False, why). The store's worker thread cannot be cancelled
        mid-statement, so the call runs in a task of its own and we stop waiting for it
        at `deadline`; its late answer is dropped."""
        box: dict[str, Any] = {}
        done = trio.Event()
        began = self._clock()

        async def call() -> None:
            try:
                box["ok"] = await fn()
            except Exception as exc:  # the store's errors, and the driver's
                box["err"] = exc
            finally:
                done.set()

        self._nursery.start_soon(call)
        with trio.move_on_at(deadline):
            await done.wait()
        if "ok" in box:
            return True, box["ok"]
        if "err" in box:
            return False, f"{type(box['err']).__name__}: {box['err']}"
        return False, f"no answer in {self._clock() - began:.1f} s"

    async def _compete(self) -> None:
        sent = self._clock()
        ok, lease = await self._bounded(
            partial(self._store.try_acquire, self._holder, self.lease_s), sent + self.interval_s
        )
        if not ok:
            log.warning("leader: could not ask the store for the lease: %s", lease)
            return
        if lease is not None:
            await self._elected(lease, sent)
            return
        ok, current = await self._bounded(self._store.current, self._clock() + self.interval_s)
        if not ok:
            return
        holder = Holder.decode(current.holder) if current is not None else None
        epoch_moved = current is not None and current.epoch != self._last_epoch
        if current is not None:
            self._last_epoch = current.epoch
        if holder != self._leader or epoch_moved:
            if holder != self._leader and holder is not None:
                log.info("leader: standby; leader is %s", holder.describe())
            self._leader = holder
            # Also when only the epoch moved: the same control plane elected again (after
            # a store outage deposed it) is news to agents that left it.
            if self._on_leader is not None:
                self._on_leader(holder)

    async def _elected(self, lease: Lease, sent: float) -> None:
        self._leading = True
        self._epoch = self._last_epoch = lease.epoch
        self._valid_until = sent + self.lease_s
        self._leader = self.me
        self._step_down = trio.Event()
        self.elections += 1
        log.info("leader: elected, epoch %d (holder %s)", lease.epoch, self._holder)
        try:
            await self._on_elected(lease.epoch)
        except Exception as exc:
            self._depose(f"taking office failed: {type(exc).__name__}: {exc}")

    def _depose(self, why: str) -> None:
        if not self._leading:
            return
        self._leading = False
        self._valid_until = float("-inf")
        self._leader = None
        self.depositions += 1
        log.warning("leader: deposed at epoch %s: %s", self._epoch, why)
        self._on_deposed(why)

    async def _lead(self) -> None:
        """Renew every interval until a renewal is refused, or fails too late."""
        next_at = self._valid_until - self.lease_s + self.interval_s
        while self._leading:
            with trio.move_on_at(next_at):
                await self._step_down.wait()
            if not self._leading:
                return  # stepped down
            now = self._clock()
            if now >= self._valid_until:
                self._depose(f"the lease ran out {now - self._valid_until:.1f} s ago unrenewed"
                             " (was this process paused?)")  # fmt: skip
                return
            epoch = self._epoch
            assert epoch is not None
            ok, renewed = await self._bounded(
                partial(self._store.renew, self._holder, epoch, self.lease_s),
                # Half an interval: a slow answer leaves time to try again in the lease.
                min(now + self.interval_s / 2, self._valid_until),
            )
            if not self._leading:
                return
            if ok and renewed:
                self._valid_until = now + self.lease_s
                next_at = now + self.interval_s
                continue
            if ok:
                self._depose("renewal refused: another control plane holds the lease")
                return
            left = self._valid_until - self._clock()
            if left < self.interval_s:
                self._depose(f"renewal failed ({renewed}) with {max(left, 0):.1f} s of lease left")
                return
            log.warning(
                "leader: renewal failed (%s); %.1f s of lease left, retrying", renewed, left
            )
            next_at = self._clock() + min(1.0, self.interval_s / 4)


class LeaderCollector:
    """Leadership's metrics, computed at each scrape: `llmgw_cp_leader` (1 while this
    control plane may act), `llmgw_cp_epoch` (absent while no epoch is known), and
    `llmgw_cp_commands_refused_stale_total` (commands agents refused as stale)."""

    def __init__(self, leadership: Leadership, refused_stale: Callable[[], int]) -> None:
        self._leadership = leadership
        self._refused_stale = refused_stale

    def describe(self) -> list[Any]:
        return []  # computed at each scrape; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        view = self._leadership.view()
        yield GaugeMetricFamily(
            "llmgw_cp_leader",
            "1 while this control plane leads (inside its lease), else 0",
            value=1.0 if view.role in ("leader", "single") else 0.0,
        )
        if view.epoch is not None:
            yield GaugeMetricFamily(
                "llmgw_cp_epoch", "the leader lease's epoch as this control plane last saw it",
                value=float(view.epoch),
            )  # fmt: skip
        yield CounterMetricFamily(
            "llmgw_cp_commands_refused_stale",
            "commands agents refused because this control plane's epoch was stale",
            value=float(self._refused_stale()),
        )
