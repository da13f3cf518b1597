"""Leadership over a real store: one leader, deposition the moment renewal fails,
takeover after expiry with the next epoch; "single" on SQLite (llmgw/cp/_fleet/_leader.py)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from helpers import postgres_server
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import config
from llmgw.cp._fleet._leader import Holder, Leadership, advertised, resolve_address
from llmgw.errors import PeerError
from llmgw.store import Lease, SqlStore, open_store

LEASE_S = 1.5  # renewed every 0.5 s


@pytest.fixture(scope="module")
def pg_dsn() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


@pytest.fixture
async def pg(pg_dsn: str) -> AsyncIterator[str]:
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    yield pg_dsn


@attrs.define
class Seen:
    """What one Leadership's callbacks saw, with the trio clock."""

    elected: list[tuple[float, int]] = attrs.field(factory=list)
    deposed: list[tuple[float, str]] = attrs.field(factory=list)
    leaders: list[Holder | None] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    async def on_elected(self, epoch: int) -> None:
        self.elected.append((trio.current_time(), epoch))
        self._poke()

    def on_deposed(self, why: str) -> None:
        self.deposed.append((trio.current_time(), why))
        self._poke()

    def on_leader(self, holder: Holder | None) -> None:
        self.leaders.append(holder)
        self._poke()

    def _poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


def make(store: Any, name: str, lease_s: float = LEASE_S) -> tuple[Leadership, Seen]:
    seen = Seen()
    me = Holder(rpc=f"{name}:7070", admin=f"{name}:8081")
    lead = Leadership(
        store, me, lease_s, seen.on_elected, seen.on_deposed, on_leader=seen.on_leader
    )
    return lead, seen


async def wait_for(cond: Any, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.02)


async def test_two_control_planes_one_leader_and_the_standby_names_it(pg: str) -> None:
    a_store, b_store = await open_store(pg), await open_store(pg)
    try:
        a, a_seen = make(a_store, "cp-a")
        b, b_seen = make(b_store, "cp-b")
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            await wait_for(lambda: b_seen.leaders)
            # Several renewal intervals: still exactly one leader, the first, at epoch 1.
            await trio.sleep(4 * a.interval_s)
            assert (a.may_act(), b.may_act()) == (True, False)
            assert [e for _, e in a_seen.elected] == [1] and not b_seen.elected
            assert a.view().json() == {
                "role": "leader", "epoch": 1, "leader": {"rpc": "cp-a:7070", "admin": "cp-a:8081"},
                "me": {"rpc": "cp-a:7070", "admin": "cp-a:8081"}, "lease_s": LEASE_S,
            }  # fmt: skip
            assert b.view().role == "standby" and b.view().leader == a.me
            assert b_seen.leaders == [a.me]
            assert b.epoch == 1  # the newest the standby saw
            lease = await b_store.current()
            assert lease is not None and Holder.decode(lease.holder) == a.me
            nursery.cancel_scope.cancel()
    finally:
        await a_store.aclose()
        await b_store.aclose()


async def test_the_standby_takes_over_after_expiry_with_the_next_epoch(pg: str) -> None:
    a_store, b_store = await open_store(pg), await open_store(pg)
    try:
        a, _ = make(a_store, "cp-a")
        b, b_seen = make(b_store, "cp-b")
        async with trio.open_nursery() as outer:
            a_scope = trio.CancelScope()

            async def run_a(task_status: trio.TaskStatus[None]) -> None:
                with a_scope:
                    await a.run(task_status=task_status)

            await outer.start(run_a)
            await outer.start(b.run)
            assert a.may_act() and a.epoch == 1
            a_scope.cancel()  # the leader dies: nobody renews
            died = trio.current_time()
            await wait_for(lambda: b_seen.elected)
            took, epoch = b_seen.elected[0]
            assert epoch == 2
            # Not before the lease ran out (counted from the last renewal, at most one
            # interval before the death), and within the lease plus one retry.
            assert (
                died - a.interval_s + LEASE_S - 0.2 <= took <= died + LEASE_S + b.interval_s + 0.5
            )
            assert b.may_act() and b.view().role == "leader" and b.view().leader == b.me
            outer.cancel_scope.cancel()
    finally:
        await a_store.aclose()
        await b_store.aclose()


async def test_a_refused_renewal_deposes_at_once(pg: str) -> None:
    """The lease is taken from under the leader (by hand, as the other control plane's
    try_acquire would after a pause past the lease): its next renewal is answered False,
    and it stops acting then, not at its lease's end."""
    import psycopg

    a_store, b_store = await open_store(pg), await open_store(pg)
    try:
        a, a_seen = make(a_store, "cp-a", lease_s=6.0)  # renewed every 2 s
        b, b_seen = make(b_store, "cp-b", lease_s=6.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            assert a.may_act() and not b.may_act()
            with psycopg.connect(pg, autocommit=True) as conn:
                conn.execute(
                    "UPDATE lease SET holder = %s, epoch = epoch + 1,"
                    " expires_at = EXTRACT(EPOCH FROM now()) + 6",
                    (b.me.encode(),),
                )
            taken = trio.current_time()
            await wait_for(lambda: a_seen.deposed)
            at, why = a_seen.deposed[0]
            assert "renewal refused" in why, why
            assert at - taken <= a.interval_s + 0.5  # its next renewal, not its lease's end
            assert not a.may_act() and a.view().role == "standby"
            # The one named in the lease re-takes its own (the epoch moves on again).
            await wait_for(lambda: b_seen.elected)
            assert b_seen.elected[0][1] == 3 and b.may_act()
            # The deposed one competes again and names the new leader.
            await wait_for(lambda: a.view().leader == b.me)
            nursery.cancel_scope.cancel()
    finally:
        await a_store.aclose()
        await b_store.aclose()


class Breakable:
    """A real store whose calls fail once `broken` (the database unreachable from here)."""

    def __init__(self, store: SqlStore) -> None:
        self._store = store
        self.broken = False
        self.shared = store.shared

    def _check(self) -> None:
        if self.broken:
            raise PeerError(f"store {self._store.where}: connection refused")

    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None:
        self._check()
        return await self._store.try_acquire(holder, ttl_s)

    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool:
        self._check()
        return await self._store.renew(holder, epoch, ttl_s)

    async def current(self) -> Lease | None:
        self._check()
        return await self._store.current()


async def test_a_leader_whose_store_fails_stops_before_the_standby_can_start(pg: str) -> None:
    """Renewals that error: deposed once less than an interval of lease is left, so the
    old leader has stopped acting before the lease can pass to anyone else."""
    a_store, b_store = await open_store(pg), await open_store(pg)
    try:
        breakable = Breakable(a_store)
        a, a_seen = make(breakable, "cp-a")
        b, b_seen = make(b_store, "cp-b")
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            breakable.broken = True
            broke = trio.current_time()
            await wait_for(lambda: a_seen.deposed)
            await wait_for(lambda: b_seen.elected)
            assert not a.may_act()
            at, why = a_seen.deposed[0]
            assert "renewal failed" in why and "connection refused" in why, why
            assert at - broke <= LEASE_S - a.interval_s + 0.3  # not at the lease's end
            assert at < b_seen.elected[0][0]  # never two leaders at once
            assert b_seen.elected[0][1] == 2
            nursery.cancel_scope.cancel()
    finally:
        await a_store.aclose()
        await b_store.aclose()


async def test_sqlite_is_single_and_each_start_takes_the_next_epoch(tmp_path: Path) -> None:
    for start in (1, 2, 3):
        store = await open_store(tmp_path)
        try:
            lead, seen = make(store, "cp")
            async with trio.open_nursery() as nursery:
                await nursery.start(lead.run)  # leads before `started`: before it listens
                assert lead.may_act() and seen.elected[0][1] == start
                assert lead.view().role == "single" and lead.view().leader == lead.me
                await trio.sleep(2 * lead.interval_s)  # renewed, still single
                assert lead.may_act() and not seen.deposed
                nursery.cancel_scope.cancel()
        finally:
            await store.aclose()


# --- on a fake store, with trio's mock clock: the local count of the lease -----------


class HangingStore:
    """A lease store whose renewals never answer (a partition without RST)."""

    shared = True

    def __init__(self) -> None:
        self.epoch = 0
        self.renewals = 0

    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None:
        if self.epoch:
            return None  # held (by us, unrenewed: as far as this store knows, still held)
        self.epoch += 1
        return Lease(holder, self.epoch, 0.0, False)

    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool:
        self.renewals += 1
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def current(self) -> Lease | None:
        return None


@pytest.mark.parametrize("lease_s", [3.0, 10.0])
async def test_a_renewal_that_never_answers_ends_acting_by_the_local_clock(
    lease_s: float, autojump_clock: trio.testing.MockClock
) -> None:
    store = HangingStore()
    lead, seen = make(store, "cp", lease_s=lease_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(lead.run)
        t0 = trio.current_time()
        assert lead.may_act()
        await wait_for(lambda: seen.deposed, timeout=3 * lease_s)
        at, why = seen.deposed[0]
        # Never acting past the lease counted from the acquire; and not deposed while a
        # full renewal interval of it was left.
        assert lease_s - lead.interval_s <= at - t0 <= lease_s + 1e-6, (at - t0, why)
        assert not lead.may_act() and store.renewals >= 1
        nursery.cancel_scope.cancel()


async def test_the_same_leader_at_a_new_epoch_is_news_to_the_standby(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A leader deposed by a store outage and elected again keeps its address: the standby
    still passes the new epoch on (agents that left it at the old one dial it at once)."""
    other = Holder(rpc="cp-a:7070", admin="cp-a:8081")

    class Held:
        shared = True
        epoch = 1

        async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None:
            return None

        async def current(self) -> Lease | None:
            return Lease(other.encode(), self.epoch, 0.0, expired=False)

    store = Held()
    lead, seen = make(store, "cp-b")
    async with trio.open_nursery() as nursery:
        await nursery.start(lead.run)
        await wait_for(lambda: seen.leaders)
        assert seen.leaders == [other] and lead.epoch == 1
        await trio.sleep(3 * lead.interval_s)
        assert seen.leaders == [other]  # nothing new: nothing said
        store.epoch = 2
        await wait_for(lambda: len(seen.leaders) == 2)
        assert seen.leaders == [other, other] and lead.epoch == 2
        nursery.cancel_scope.cancel()


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


# --- addresses -------------------------------------------------------------------------


def test_the_holder_round_trips_and_garbage_reads_as_no_leader() -> None:
    h = Holder(rpc="[::1]:7070", admin="cp1.example:8081")
    assert Holder.decode(h.encode()) == h
    for bad in (None, "", "cp1:7070", "[]", '{"rpc": 1, "admin": "x"}', '{"rpc": "x"}'):
        assert Holder.decode(bad) is None, bad


def test_advertised_addresses_resolve_wildcards_to_the_fqdn(tmp_path: Path) -> None:
    def fqdn() -> str:
        return "cp1.example"

    assert resolve_address("0.0.0.0:7070", fqdn) == "cp1.example:7070"
    assert resolve_address("[::]:7070", fqdn) == "cp1.example:7070"
    assert resolve_address("10.0.0.5:7070", fqdn) == "10.0.0.5:7070"
    assert resolve_address("[fd00::5]:7070", fqdn) == "[fd00::5]:7070"
    tls = config.TlsFiles(ca=tmp_path / "ca", cert=tmp_path / "c", key=tmp_path / "k")
    base = config.ServerConfig(tls=tls, state_dir=tmp_path)
    assert advertised(base, fqdn) == Holder("cp1.example:7070", "127.0.0.1:8081")
    cfg = attrs.evolve(
        base,
        advertise=config.HostPort("cp1.lan:7171"),
        admin_listen=config.HostPort("0.0.0.0:9000"),
    )
    assert advertised(cfg, fqdn) == Holder("cp1.lan:7171", "cp1.lan:9000")
    assert not math.isnan(base.lease_s)


# --- never two at once: a model of the database, slow and failing answers ----------------


@attrs.define
class MemLease:
    """The lease row, on the database's clock (here trio's mock clock)."""

    holder: str | None = None
    epoch: int = 0
    expires: float = 0.0


class MemConn:
    """One control plane's connection: each call waits `before` (the request on its way),
    is applied at the database's now, then waits `after` (the answer on its way), from a
    schedule hypothesis draws; during an outage (a partition) a request or an answer on
    its way is lost, and the caller sees a reset."""

    shared = True

    def __init__(
        self,
        row: MemLease,
        delays: list[tuple[float, float]],
        outages: list[tuple[float, float]],
    ) -> None:
        self.row = row
        self.delays = delays
        self.outages = outages
        self.calls = 0

    def _cut(self) -> bool:
        now = trio.current_time()
        return any(start <= now < start + length for start, length in self.outages)

    async def _call(self, apply: Callable[[float], Any]) -> Any:
        before, after = self.delays[self.calls % len(self.delays)]
        self.calls += 1
        await trio.sleep(before)
        if self._cut():  # the database never saw it
            raise PeerError("store: connection reset")
        result = apply(trio.current_time())
        await trio.sleep(after)
        if self._cut():  # applied, but the answer never came
            raise PeerError("store: connection reset")
        return result

    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None:
        def apply(now: float) -> Lease | None:
            row = self.row
            if not (row.holder is None or row.holder == holder or row.expires <= now):
                return None
            row.holder, row.epoch, row.expires = holder, row.epoch + 1, now + ttl_s
            return Lease(holder, row.epoch, row.expires, False)

        result: Lease | None = await self._call(apply)
        return result

    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool:
        def apply(now: float) -> bool:
            row = self.row
            if row.holder != holder or row.epoch != epoch:
                return False
            row.expires = now + ttl_s
            return True

        result: bool = await self._call(apply)
        return result

    async def current(self) -> Lease | None:
        def apply(now: float) -> Lease | None:
            row = self.row
            if row.holder is None:
                return None
            return Lease(row.holder, row.epoch, row.expires, row.expires <= now)

        result: Lease | None = await self._call(apply)
        return result


delays = st.lists(st.tuples(st.floats(0, 2.5), st.floats(0, 2.5)), min_size=1, max_size=6)
outages = st.lists(st.tuples(st.floats(0, 30), st.floats(0, 10)), max_size=4)


@settings(max_examples=100, deadline=None)
@given(a_delays=delays, a_outages=outages, b_delays=delays, b_outages=outages)
def test_never_two_leaders_whatever_the_store_answers_and_when(
    a_delays: list[tuple[float, float]],
    a_outages: list[tuple[float, float]],
    b_delays: list[tuple[float, float]],
    b_outages: list[tuple[float, float]],
) -> None:
    """Slow requests, slow answers, partitions that lose requests or answers (applied,
    unanswered): at no instant do both may_act, and each election's epoch is above
    every earlier one."""
    row = MemLease()
    a, a_seen = make(MemConn(row, a_delays, a_outages), "cp-a", lease_s=3.0)
    b, b_seen = make(MemConn(row, b_delays, b_outages), "cp-b", lease_s=3.0)
    overlaps: list[float] = []

    class Watch(trio.abc.Instrument):
        """Both may_act is checked after every step of every task: may_act turns true
        only inside a step (time passing can only turn it false), so no overlap can
        begin unseen, however short."""

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            if a.may_act() and b.may_act():
                overlaps.append(trio.current_time())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run)
            nursery.start_soon(b.run)
            await trio.sleep(40)  # of the mock clock
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0), instruments=[Watch()])
    assert overlaps == []
    elected = sorted(a_seen.elected + b_seen.elected)
    epochs = [e for _, e in elected]
    assert epochs == sorted(set(epochs)), elected
