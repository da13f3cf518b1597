"""Tenant limits, pure: the token buckets, Retry-After, per-worker shares, the band ceiling."""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from llmgw.keys import TenantLimits
from llmgw.router._tenants import Bucket, TenantLimiter, ceiling, retry_seconds

RANKS = {"interactive": 0, "batch": 1, "bulk": 2}

# Gaps between arrivals, in seconds: bursts (0) and pauses.
gaps = st.lists(st.floats(min_value=0, max_value=30, allow_nan=False), min_size=1, max_size=200)


@given(rpm=st.integers(1, 600), gaps=gaps)
def test_requests_never_exceed_capacity_plus_refill(rpm: int, gaps: list[float]) -> None:
    limiter = TenantLimiter()
    limits = TenantLimits(rpm=rpm)
    now = 0.0
    admitted = 0
    for gap in gaps:
        now += gap
        if limiter.admit("acme", limits, now) is None:
            admitted += 1
        # Within any prefix of the run: at most the burst plus what refilled since the start.
        assert admitted <= rpm + rpm / 60 * now + 1e-6


def replay(limits: TenantLimits, burst: int, spent: int, at: float) -> TenantLimiter:
    """A limiter that took `burst` requests and was charged `spent` tokens at 0, then
    was asked once more at `at`."""
    limiter = TenantLimiter()
    for _ in range(burst):
        limiter.admit("acme", limits, 0.0)
    limiter.charge("acme", spent, 0.0)
    limiter.admit("acme", limits, at)
    return limiter


@given(
    rpm=st.integers(1, 600) | st.none(),
    tpm=st.integers(1, 100_000) | st.none(),
    burst=st.integers(1, 700),
    spent=st.integers(0, 1_000_000),
    gap=st.floats(0, 200, allow_nan=False),
)
def test_retry_after_is_exactly_when_it_admits_again(
    rpm: int | None, tpm: int | None, burst: int, spent: int, gap: float
) -> None:
    limits = TenantLimits(rpm=rpm, tpm=tpm)
    limiter = TenantLimiter()
    for _ in range(burst):
        limiter.admit("acme", limits, 0.0)
    limiter.charge("acme", spent, 0.0)
    refused = limiter.admit("acme", limits, gap)
    if refused is None:
        return
    assert refused.reason in ("rpm", "tpm")
    assert refused.limit == (rpm if refused.reason == "rpm" else tpm)
    wait = refused.retry_after_s
    assert wait is not None and wait >= 1
    # At Retry-After it admits; a whole second earlier (when that is later than now) it
    # still refuses: the figure is the first whole second that admits.
    if wait > 1:
        again = replay(limits, burst, spent, gap)
        assert again.admit("acme", limits, gap + wait - 1) is not None
    assert limiter.admit("acme", limits, gap + wait) is None


@given(
    tpm=st.integers(1, 100_000),
    spent=st.integers(0, 1_000_000),
    later=st.floats(0, 120, allow_nan=False),
)
def test_tokens_go_into_debt_and_refuse_until_refilled(tpm: int, spent: int, later: float) -> None:
    limiter = TenantLimiter()
    limits = TenantLimits(tpm=tpm)
    assert limiter.admit("acme", limits, 0.0) is None  # a full bucket admits
    limiter.charge("acme", spent, 0.0)
    debt = spent - tpm  # below zero by this many tokens
    refused = limiter.admit("acme", limits, later)
    left = debt - tpm / 60 * later
    if left > 1e-3:
        assert refused is not None and refused.reason == "tpm" and refused.limit == tpm
        wait = refused.retry_after_s
        assert wait is not None
        true_wait = left / (tpm / 60)  # the first whole second at or after it
        # (to 1e-4 s: the limiter and this test compute it in different float orders)
        assert wait >= 1 and true_wait - 1e-4 <= wait < max(true_wait, 1) + 1 + 1e-4
    elif left < -1e-3:
        assert refused is None


def test_a_refused_request_takes_nothing_from_either_bucket() -> None:
    limiter = TenantLimiter()
    limits = TenantLimits(rpm=10, tpm=100)
    assert limiter.admit("acme", limits, 0.0) is None
    limiter.charge("acme", 160, 0.0)  # 60 tokens in debt: 36 s to refill
    for _ in range(20):
        refused = limiter.admit("acme", limits, 1.0)
        assert refused is not None and refused.reason == "tpm"
    assert refused.retry_after_s == 35  # (60 - 100/60) / (100/60) = 35 s after t=1
    # The token refusals took no requests: 9 left of 10, plus what refilled.
    assert limiter.statistics()["acme"]["requests"] == 9.0 + 10 / 60
    assert refused.message == "tenant acme: over its 100 tokens per minute; retry in 35 s"


def test_the_message_names_the_tenant_the_limit_and_the_wait() -> None:
    limiter = TenantLimiter()
    limits = TenantLimits(rpm=60)
    for _ in range(60):
        assert limiter.admit("acme", limits, 0.0) is None
    refused = limiter.admit("acme", limits, 0.0)
    assert refused is not None
    assert refused.message == "tenant acme: over its 60 requests per minute; retry in 1 s"
    assert limiter.admit("other", limits, 0.0) is None  # each tenant has its own buckets


@given(rpm=st.integers(1, 1000), workers=st.integers(1, 8))
def test_workers_share_the_limit(rpm: int, workers: int) -> None:
    # Each worker admits its share in a burst; together, the tenant's limit (a limit
    # below the worker count lets each admit 1, as the router's own limits do).
    total = 0
    for index in range(workers):
        limiter = TenantLimiter(worker=index, workers=workers)
        while limiter.admit("acme", TenantLimits(rpm=rpm), 0.0) is None:
            total += 1
    assert total == max(rpm, workers)


def test_a_zero_limit_admits_nothing_and_names_no_wait() -> None:
    limiter = TenantLimiter()
    for limits, what in ((TenantLimits(rpm=0), "requests"), (TenantLimits(tpm=0), "tokens")):
        for now in (0.0, 1e6):
            refused = limiter.admit("acme", limits, now)
            assert refused is not None and refused.retry_after_s is None and refused.limit == 0
            flag = "--rpm" if what == "requests" else "--tpm"
            assert refused.message == (
                f"tenant acme: its limit is 0 {what} per minute, so nothing is admitted "
                f"(llmgw ctl tenants set acme {flag} N)"
            )


def test_no_limits_admit_everything_and_keep_no_state() -> None:
    limiter = TenantLimiter()
    for _ in range(10_000):
        assert limiter.admit("acme", None, 0.0) is None
        assert limiter.admit("acme", TenantLimits(max_band="batch"), 0.0) is None
    assert limiter.statistics() == {}


def test_idle_tenants_are_dropped_once_refilled() -> None:
    limiter = TenantLimiter(idle_s=600)
    limits = TenantLimits(rpm=5, tpm=100)
    limiter.admit("idle", limits, 0.0)
    limiter.admit("debtor", limits, 0.0)
    limiter.charge("debtor", 100_000, 0.0)  # ~1000 minutes of debt
    limiter.admit("busy", limits, 650.0)
    assert set(limiter.tenants()) == {"busy", "debtor"}  # the debt is not forgiven
    assert limiter.admit("debtor", limits, 700.0) is not None


def test_a_changed_limit_resizes_the_bucket() -> None:
    limiter = TenantLimiter()
    for _ in range(10):
        limiter.admit("acme", TenantLimits(rpm=10), 0.0)
    assert limiter.admit("acme", TenantLimits(rpm=10), 0.0) is not None
    # Raised: it refills at the new rate from then on (10 per second).
    assert limiter.admit("acme", TenantLimits(rpm=600), 0.1) is not None
    assert limiter.admit("acme", TenantLimits(rpm=600), 0.2) is None
    # Lowered: the level is capped at the new capacity.
    for _ in range(100):
        limiter.admit("wide", TenantLimits(rpm=600), 0.0)
    admitted = sum(limiter.admit("wide", TenantLimits(rpm=2), 0.0) is None for _ in range(10))
    assert admitted == 2


@given(asked=st.sampled_from(sorted(RANKS)), highest=st.sampled_from(sorted(RANKS)))
def test_band_ceiling(asked: str, highest: str) -> None:
    refused = ceiling("acme", asked, highest, RANKS)
    if RANKS[asked] < RANKS[highest]:
        assert refused is not None and refused.reason == "band"
        assert refused.message == (
            f"tenant acme: the priority band {asked!r} is above its highest allowed "
            f"band {highest!r}"
        )
    else:
        assert refused is None


def test_an_unknown_or_absent_ceiling_is_no_ceiling() -> None:
    assert ceiling("acme", "interactive", "platinum", RANKS) is None
    assert ceiling("acme", "interactive", None, RANKS) is None


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_retry_seconds_is_whole_at_least_one_and_not_early(wait: float) -> None:
    seconds = retry_seconds(wait)
    assert isinstance(seconds, int) and seconds >= 1
    assert seconds >= wait - 1e-6 and seconds < max(wait, 1) + 1


def test_bucket_repr_and_refill() -> None:
    b = Bucket(60, 0.0)
    b.level = 0.0
    assert abs(b.wait_s(1.0, 0.0) - 1.0) < 1e-6
    assert b.refill(30.0) == 30.0
    assert "30.000/60" in repr(b)


def test_the_module_does_no_io() -> None:
    source = Path(__file__).parents[2] / "llmgw" / "router" / "_tenants.py"
    tree = ast.parse(source.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"trio", "socket", "capnp", "httpx", "os", "pathlib", "time"}
