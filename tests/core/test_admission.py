from __future__ import annotations

import itertools

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from llmgw.core._admission import (
    MAX_RETRY_AFTER_S,
    MIN_RETRY_AFTER_S,
    TRANSITIONS,
    Admission,
    AdmissionConfig,
    Admit,
    Band,
    Queued,
    Reject,
    RequestEvent,
    RequestState,
    next_state,
)

INTERACTIVE = Band("interactive", 0, queue_timeout_s=5.0)
BATCH = Band("batch", 1, queue_timeout_s=30.0)
BANDS = (INTERACTIVE, BATCH)


def admission(concurrency: int = 1, queue_limit: int = 10) -> Admission:
    return Admission(AdmissionConfig(concurrency, queue_limit, BANDS), name="llama-8b")


def test_admits_up_to_the_limit_then_queues_then_rejects() -> None:
    a = admission(concurrency=2, queue_limit=2)
    assert a.request("r1", "t", "interactive", 0.0) == Admit("r1")
    assert a.request("r2", "t", "batch", 0.0) == Admit("r2")
    assert a.request("r3", "t", "interactive", 1.0) == Queued("r3", deadline=6.0)
    assert a.request("r4", "t", "batch", 1.0) == Queued("r4", deadline=31.0)
    reject = a.request("r5", "u", "interactive", 2.0)
    assert isinstance(reject, Reject)
    assert reject.reason == (
        "the queue for llama-8b is full (2 requests waiting, the limit is 2; 2 of 2 slots busy)"
    )
    assert a.state_of("r5") is None
    stats = a.statistics()
    assert (stats["in_flight"], stats["queued"]) == (2, {"interactive": 1, "batch": 1})
    assert (stats["admitted_total"], stats["rejected_total"]) == (2, 1)


def test_no_queue_at_all_rejects_as_soon_as_the_slots_are_busy() -> None:
    a = admission(concurrency=1, queue_limit=0)
    assert isinstance(a.request("r1", "t", "batch", 0.0), Admit)
    assert isinstance(a.request("r2", "t", "interactive", 0.0), Reject)


def test_a_higher_band_is_always_served_first() -> None:
    a = admission(concurrency=1)
    a.request("run", "t", "batch", 0.0)
    a.request("b1", "t", "batch", 0.0)
    a.request("b2", "u", "batch", 0.0)
    a.request("i1", "v", "interactive", 1.0)
    a.request("i2", "t", "interactive", 2.0)
    order = []
    running = "run"
    for now in range(3, 7):
        (running,) = a.release(running, float(now))
        order.append(running)
    assert order == ["i1", "i2", "b1", "b2"]


def test_tenants_take_turns_inside_a_band_and_each_tenant_is_fifo() -> None:
    a = admission(concurrency=1, queue_limit=20)
    a.request("run", "x", "batch", 0.0)
    for i in range(5):
        a.request(f"flood{i}", "flooder", "batch", 0.0)
    a.request("b0", "polite", "batch", 0.1)
    a.request("b1", "polite", "batch", 0.2)
    a.request("c0", "late", "batch", 0.3)
    order = []
    running = "run"
    while a.queued:
        (running,) = a.release(running, 1.0)
        order.append(running)
    assert order == [
        "flood0", "b0", "c0", "flood1", "b1", "flood2", "flood3", "flood4",
    ]  # fmt: skip


def test_release_hands_every_freed_slot_to_the_queue_in_order() -> None:
    a = admission(concurrency=1)
    a.request("r1", "t", "batch", 0.0)
    a.request("q1", "t", "batch", 0.0)
    a.request("q2", "u", "interactive", 0.0)
    a.request("q3", "t", "interactive", 0.0)
    assert a.set_concurrency(3, 1.0) == ("q2", "q3")
    assert a.release("r1", 2.0) == ("q1",)
    assert a.statistics()["admitted_total"] == 4


def test_lowering_concurrency_cancels_nothing_and_admits_nothing_until_below() -> None:
    a = admission(concurrency=3)
    for r in ("r1", "r2", "r3"):
        a.request(r, "t", "batch", 0.0)
    a.request("q1", "t", "batch", 0.0)
    assert a.set_concurrency(1, 1.0) == ()
    assert a.in_flight == 3
    assert a.release("r1", 2.0) == ()
    assert a.release("r2", 2.0) == ()
    assert a.release("r3", 2.0) == ("q1",)
    assert a.set_concurrency(0, 3.0) == ()
    assert isinstance(a.request("q2", "t", "batch", 3.0), Queued)
    assert a.release("q1", 4.0) == ()  # no replicas: the queue waits
    assert a.set_concurrency(1, 5.0) == ("q2",)


def test_withdraw_from_the_queue_or_in_flight_and_of_an_id_already_gone() -> None:
    a = admission(concurrency=1)
    a.request("r1", "t", "batch", 0.0)
    a.request("q1", "t", "batch", 0.0)
    a.request("q2", "t", "batch", 0.0)
    assert a.withdraw("q1", 1.0) == ()
    assert a.state_of("q1") is None
    assert a.withdraw("r1", 2.0) == ("q2",)
    assert a.state_of("q2") is RequestState.ADMITTED
    assert a.withdraw("q1", 3.0) == ()  # already gone: not an error
    assert a.withdraw("never-seen", 3.0) == ()
    assert a.statistics()["withdrawn_total"] == 2


def test_expire_removes_exactly_those_past_their_deadline() -> None:
    a = admission(concurrency=1)
    a.request("r1", "t", "batch", 0.0)
    a.request("i1", "t", "interactive", 0.0)  # deadline 5
    a.request("b1", "u", "batch", 1.0)  # deadline 31
    a.request("i2", "u", "interactive", 2.0)  # deadline 7
    assert a.next_deadline() == 5.0
    assert a.expire(4.9) == ()
    assert [r for r, _ in a.expire(5.0)] == ["i1"]  # at the deadline is past it
    assert a.next_deadline() == 7.0
    a.withdraw("i2", 6.0)
    assert a.next_deadline() == 31.0
    expired = a.expire(100.0)
    assert [r for r, _ in expired] == ["b1"]
    assert a.next_deadline() is None
    assert a.statistics()["expired_total"] == 2
    assert a.release("r1", 101.0) == ()


def test_retry_after_estimate() -> None:
    a = admission(concurrency=2, queue_limit=3)
    # Nothing has finished yet: the estimate falls back to the band's timeout.
    a.request("r1", "t", "batch", 0.0)
    a.request("r2", "t", "batch", 0.0)
    assert a.retry_after("interactive") == (0 + 1) * 5.0 / 2
    # Two requests held their slots 4 s and 4 s: the mean is 4 s.
    a.release("r1", 4.0)
    a.release("r2", 4.0)
    a.request("r3", "t", "batch", 4.0)
    a.request("r4", "t", "batch", 4.0)
    a.request("q1", "t", "interactive", 4.0)
    a.request("q2", "t", "batch", 4.0)
    a.request("q3", "t", "batch", 4.0)
    reject = a.request("r5", "u", "batch", 4.0)
    assert isinstance(reject, Reject)
    # Three are waiting ahead of a batch newcomer: (3 + 1) x 4 s / 2 slots.
    assert reject.retry_after_s == 8.0
    # An interactive newcomer has only the interactive one ahead: (1 + 1) x 4 / 2.
    reject = a.request("r6", "u", "interactive", 4.0)
    assert isinstance(reject, Reject) and reject.retry_after_s == 4.0
    # Expired requests get the estimate for the queue they leave behind.
    assert a.expire(9.0) == (("q1", 2.0),)
    # Clamped at both ends.
    assert admission(concurrency=1000).retry_after("interactive") == MIN_RETRY_AFTER_S
    slow = Admission(AdmissionConfig(1, 5, (Band("x", 0, queue_timeout_s=600.0),)))
    assert slow.retry_after("x") == MAX_RETRY_AFTER_S
    assert admission(concurrency=0).retry_after("batch") == 30.0  # no replica: the timeout


def test_unknown_band_and_misuse_are_errors_that_say_what_is_wrong() -> None:
    a = admission()
    with pytest.raises(ValueError, match="unknown priority band 'realtime'; the bands are "):
        a.request("r1", "t", "realtime", 0.0)
    a.request("r1", "t", "batch", 0.0)
    with pytest.raises(ValueError, match="'r1' is already admitted"):
        a.request("r1", "t", "batch", 0.0)
    a.request("q1", "t", "batch", 0.0)
    with pytest.raises(ValueError, match="'q1' is queued: release is not valid; withdraw"):
        a.release("q1", 1.0)
    with pytest.raises(ValueError, match="'nope' is not known"):
        a.release("nope", 1.0)
    assert a.state_of("q1") is RequestState.QUEUED  # the refused call changed nothing


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="band names must be distinct"):
        AdmissionConfig(1, 1, (Band("a", 0, 1.0), Band("a", 1, 1.0)))
    with pytest.raises(ValueError, match="band ranks must be distinct"):
        AdmissionConfig(1, 1, (Band("a", 0, 1.0), Band("b", 0, 1.0)))
    with pytest.raises(ValueError, match="at least one band"):
        AdmissionConfig(1, 1, ())
    with pytest.raises(ValueError, match="queue_limit must be 0 or more, got -1"):
        AdmissionConfig(1, -1, BANDS)
    with pytest.raises(ValueError, match="queue_timeout_s must be a positive number"):
        Band("a", 0, 0.0)


def test_repr_and_statistics() -> None:
    a = admission(concurrency=1, queue_limit=4)
    a.request("r1", "t", "batch", 0.0)
    a.request("q1", "t", "interactive", 0.0)
    a.request("q2", "u", "interactive", 0.0)
    assert repr(a) == (
        "<Admission llama-8b 1/1 in flight, queued interactive=2, batch=0 (limit 4)>"
    )
    assert a.statistics() == {
        "name": "llama-8b",
        "concurrency": 1,
        "in_flight": 1,
        "queue_limit": 4,
        "queued": {"interactive": 2, "batch": 0},
        "queued_tenants": {"interactive": 2, "batch": 0},
        "admitted_total": 1,
        "rejected_total": 0,
        "expired_total": 0,
        "withdrawn_total": 0,
        "released_total": 0,
        "mean_service_s": None,
    }


@pytest.mark.parametrize(("state", "event"), list(itertools.product(RequestState, RequestEvent)))
def test_every_pair_is_in_the_table_or_invalid(state: RequestState, event: RequestEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert next_state(state, event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(ValueError, match=f"is {state.value}: {event.value} is not valid"):
            next_state(state, event)


# -- properties ----------------------------------------------------------------

TENANTS = ("a", "b", "c")
# Short timeouts, so that random traffic sees expiries as often as admissions.
FAST_BANDS = (Band("interactive", 0, queue_timeout_s=1.0), Band("batch", 1, queue_timeout_s=3.0))
Op = tuple[str, int, int, float]  # (kind, x, y, dt)

op = st.tuples(
    st.sampled_from(["request"] * 5 + ["release"] * 3 + ["withdraw", "expire", "expire", "limit"]),
    st.integers(0, 5),
    st.integers(0, 5),
    st.sampled_from([0.0] * 3 + [0.25, 0.5, 1.0, 2.5]),
)


class Model:
    """What the test believes, built only from the answers Admission gave."""

    def __init__(self, a: Admission, concurrency: int, tenants: int) -> None:
        self.a = a
        self.tenants = tenants
        self.concurrency = concurrency
        self.band: dict[str, Band] = {}
        self.tenant: dict[str, str] = {}
        self.queued: dict[str, float] = {}  # req_id -> deadline, in arrival order
        self.admitted: list[str] = []
        self.ended: dict[str, str] = {}  # req_id -> how it ended
        # Fairness: admissions of others in the same band since a request reached
        # the head of its tenant's line.
        self.head_waits: dict[str, int] = {}

    def lines(self, band: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for r in self.queued:
            if self.band[r].name == band:
                out.setdefault(self.tenant[r], []).append(r)
        return out

    def refresh_heads(self) -> None:
        heads = {line[0] for b in FAST_BANDS for line in self.lines(b.name).values()}
        self.head_waits = {r: self.head_waits.get(r, 0) for r in heads}

    def end(self, req_id: str, how: str) -> None:
        assert req_id not in self.ended, f"{req_id} ended twice"
        self.ended[req_id] = how

    def promoted(self, ids: tuple[str, ...]) -> None:
        ranks = [self.band[r].rank for r in ids]
        assert ranks == sorted(ranks), "admitted from the queue out of band order"
        for r in ids:
            assert r in self.queued, f"{r} admitted from the queue without being queued"
            band, tenant = self.band[r], self.tenant[r]
            # FIFO inside a tenant, and a higher band before any lower one.
            assert self.lines(band.name)[tenant][0] == r
            assert all(self.band[q].rank >= band.rank for q in self.queued)
            del self.queued[r]
            self.admitted.append(r)
            for h in self.head_waits:
                if h != r and self.band[h] == band and h in self.queued:
                    self.head_waits[h] += 1
                    assert self.head_waits[h] <= self.tenants - 1, "starved at the head"
            self.refresh_heads()
        assert len(self.admitted) <= self.concurrency or not ids

    def check(self) -> None:
        assert self.a.in_flight == len(self.admitted)
        assert self.a.queued == len(self.queued)
        for r in self.queued:
            assert self.a.state_of(r) is RequestState.QUEUED
        for r in self.admitted:
            assert self.a.state_of(r) is RequestState.ADMITTED
        # Work-conserving: a free slot and a waiting request never coexist.
        assert not self.queued or len(self.admitted) >= self.concurrency
        assert self.a.next_deadline() == min(self.queued.values(), default=None)
        stats = self.a.statistics()
        per_band = {b.name: sum(self.band[r] == b for r in self.queued) for b in FAST_BANDS}
        assert stats["queued"] == per_band
        assert stats["expired_total"] == sum(h == "expired" for h in self.ended.values())
        assert stats["rejected_total"] == sum(h == "rejected" for h in self.ended.values())


# One tenant's burst ahead of another's request: the shape that starvation needs.
BURST = [("request", 1, 0, 0.0)] * 4 + [("request", 1, 1, 0.0)] + [("release", 0, 0, 0.0)] * 4


@settings(max_examples=300, deadline=None)
@given(
    concurrency=st.integers(0, 3),
    queue_limit=st.integers(0, 8),
    tenants=st.integers(2, 3),
    ops=st.lists(op, min_size=20, max_size=80),
)
@example(concurrency=1, queue_limit=6, tenants=3, ops=BURST)
def test_random_traffic_keeps_every_promise(
    concurrency: int, queue_limit: int, tenants: int, ops: list[Op]
) -> None:
    a = Admission(AdmissionConfig(concurrency, queue_limit, FAST_BANDS))
    m = Model(a, concurrency, tenants)
    now = 0.0
    admitted_total = 0
    for i, (kind, x, y, dt) in enumerate(ops):
        now += dt
        if kind == "request":
            req_id, band = f"r{i}", FAST_BANDS[x % 2]
            tenant = TENANTS[y % tenants]
            m.band[req_id], m.tenant[req_id] = band, tenant
            before_in_flight, before_queued = len(m.admitted), len(m.queued)
            result = a.request(req_id, tenant, band.name, now)
            if isinstance(result, Admit):
                assert before_in_flight < m.concurrency
                assert not any(m.band[q].rank <= band.rank for q in m.queued)
                m.admitted.append(req_id)
                admitted_total += 1
            elif isinstance(result, Queued):
                assert before_in_flight >= m.concurrency and before_queued < queue_limit
                assert result.deadline == now + band.queue_timeout_s
                m.queued[req_id] = result.deadline
                m.refresh_heads()
            else:
                assert before_in_flight >= m.concurrency and before_queued == queue_limit
                assert MIN_RETRY_AFTER_S <= result.retry_after_s <= MAX_RETRY_AFTER_S
                m.end(req_id, "rejected")
        elif kind == "release" and m.admitted:
            req_id = m.admitted.pop(x % len(m.admitted))
            ids = a.release(req_id, now)
            m.end(req_id, "released")
            m.promoted(ids)
            admitted_total += len(ids)
        elif kind == "withdraw" and (m.admitted or m.queued):
            live = [*m.admitted, *m.queued]
            req_id = live[x % len(live)]
            if req_id in m.queued:
                del m.queued[req_id]
                m.refresh_heads()
            else:
                m.admitted.remove(req_id)
            m.end(req_id, "withdrawn")
            ids = a.withdraw(req_id, now)
            m.promoted(ids)
            admitted_total += len(ids)
        elif kind == "expire":
            due = {r for r, d in m.queued.items() if d <= now}
            expired = a.expire(now)
            assert {r for r, _ in expired} == due
            assert len(expired) == len(due)
            for r, retry in expired:
                assert MIN_RETRY_AFTER_S <= retry <= MAX_RETRY_AFTER_S
                del m.queued[r]
                m.end(r, "expired")
            m.refresh_heads()
        elif kind == "limit":
            m.concurrency = x % 4
            ids = a.set_concurrency(m.concurrency, now)
            m.promoted(ids)
            admitted_total += len(ids)
        m.check()
        assert a.statistics()["admitted_total"] == admitted_total
    event(f"admitted from the queue: {'some' if admitted_total > len(m.band) // 3 else 'few'}")
    event(f"expired: {'some' if any(h == 'expired' for h in m.ended.values()) else 'none'}")
    # Drain: everything still live ends exactly once.
    a.set_concurrency(3, now)
    for r in list(m.queued):
        a.withdraw(r, now)
        m.end(r, "withdrawn")
    for r in a_admitted(a, m):
        a.release(r, now)
        m.end(r, "released")
    assert set(m.ended) == set(m.band)
    assert a.in_flight == 0 and a.queued == 0 and a.next_deadline() is None


def a_admitted(a: Admission, m: Model) -> list[str]:
    return [r for r in m.band if a.state_of(r) is RequestState.ADMITTED]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 6)), min_size=2, max_size=6))
def test_a_flood_from_one_tenant_does_not_starve_another(bursts: list[tuple[str, int]]) -> None:
    """Everyone queues at once; then, with one slot, the order of service
    interleaves tenants: between two admissions of one tenant, every other
    tenant with a request still waiting gets one."""
    a = admission(concurrency=1, queue_limit=100)
    a.request("run", "x", "batch", 0.0)
    waiting: dict[str, list[str]] = {}
    n = 0
    for tenant, count in bursts:
        for _ in range(count):
            n += 1
            a.request(f"r{n}", tenant, "batch", 0.0)
            waiting.setdefault(tenant, []).append(f"r{n}")
    order: list[str] = []
    running = "run"
    while a.queued:
        (running,) = a.release(running, 1.0)
        order.append(running)
    tenant_of = {r: t for t, rs in waiting.items() for r in rs}
    served = [tenant_of[r] for r in order]
    for t, rs in waiting.items():
        assert [r for r in order if tenant_of[r] == t] == rs  # FIFO per tenant
    for i, t in enumerate(served):
        nxt = served.index(t, i + 1) if t in served[i + 1 :] else len(served)
        between = set(served[i + 1 : nxt])
        still_waiting = {u for u in waiting if u != t and u in served[i + 1 :]}
        if nxt < len(served):
            assert still_waiting <= between
