"""The wedge detector (llmgw/core/_wedge.py): which endpoints of a model to quarantine."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import EndpointActivity, InFlight, WedgeConfig, Wedged, wedged
from llmgw.core._wedge import latest_byte, silent_since, threshold

CONFIG = WedgeConfig(wedge_after_s=10.0)


def ep(
    eid: str, *flights: InFlight, last: float | None = None, q: bool = False
) -> EndpointActivity:
    return EndpointActivity(eid, tuple(flights), last, quarantined=q)


def test_three_silent_requests_beside_a_busy_endpoint_are_a_wedge_with_its_reason() -> None:
    stuck = ep("a", InFlight(0.0, None), InFlight(1.0, 2.0), InFlight(3.0, None))
    busy = ep("b", InFlight(11.0, 11.5))
    got = wedged([stuck, busy], 12.0, CONFIG)
    assert got == (Wedged("a", requests=3, waiting_first_byte=2, silent_s=10.0, threshold_s=10.0),)
    assert got[0].reason("/health 200") == "wedged: 3 requests, no bytes for 10 s, /health 200"
    assert got[0].reason() == "wedged: 3 requests, no bytes for 10 s"


def test_one_request_is_said_in_the_singular() -> None:
    w = Wedged("a", 1, 1, 12.4, 10.0)
    assert w.reason("/health timed out after 1 s") == (
        "wedged: 1 request, no bytes for 12 s, /health timed out after 1 s"
    )


def test_a_byte_within_the_threshold_keeps_it_out() -> None:
    slow = ep("a", InFlight(0.0, None), InFlight(1.0, 5.0))
    busy = ep("b", last=14.0)
    assert wedged([slow, busy], 14.9, CONFIG) == ()
    assert [w.endpoint_id for w in wedged([slow, busy], 15.0, CONFIG)] == ["a"]


def test_without_another_endpoint_making_progress_nothing_is_quarantined() -> None:
    stuck = ep("a", InFlight(0.0, None))
    assert wedged([stuck], 100.0, CONFIG) == ()  # one endpoint: nothing to compare with
    idle = ep("b", last=None)
    assert wedged([stuck, idle], 100.0, CONFIG) == ()  # the other never answered either
    before = ep("b", last=-1.0)  # its last byte is older than a's silence
    assert wedged([stuck, before], 100.0, CONFIG) == ()
    quarantined = ep("b", InFlight(0.0, 99.0), q=True)  # a quarantined one is no witness
    assert wedged([stuck, quarantined], 100.0, CONFIG) == ()


def test_a_long_prefill_estimate_raises_the_threshold() -> None:
    long = ep("a", InFlight(0.0, None, expected_first_byte_s=30.0))
    busy = ep("b", last=59.0)
    assert wedged([long, busy], 59.0, CONFIG) == ()  # 30 s estimated, waited twice over
    got = wedged([long, busy], 60.0, CONFIG)
    assert [(w.endpoint_id, w.threshold_s) for w in got] == [("a", 60.0)]
    # An estimate is of a prefill only: once bytes came, it no longer raises anything.
    answering = ep("a", InFlight(0.0, 1.0, expected_first_byte_s=30.0))
    assert threshold(answering.in_flight, CONFIG) == 10.0
    capped = WedgeConfig(wedge_after_s=10.0, max_wait_s=40.0)
    assert threshold(long.in_flight, capped) == 40.0


def test_silence_counts_from_the_newest_byte_or_the_earliest_send() -> None:
    assert silent_since(ep("a", last=3.0)) is None  # idle: owes nothing
    assert silent_since(ep("a", InFlight(5.0, None), InFlight(2.0, None))) == 2.0
    assert silent_since(ep("a", InFlight(5.0, None), InFlight(2.0, 3.0))) == 3.0
    # An ended request's byte after the earliest send is the engine alive too...
    assert silent_since(ep("a", InFlight(2.0, None), last=4.0)) == 4.0
    # ...and one before it says nothing about what is owed now.
    assert silent_since(ep("a", InFlight(2.0, None), last=1.0)) == 2.0
    assert latest_byte(ep("a", InFlight(0.0, 4.0), last=3.0)) == 4.0
    assert latest_byte(ep("a", InFlight(0.0, None), last=None)) is None


# --- properties --------------------------------------------------------------------------

times = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)
flights = st.builds(
    InFlight,
    started_at=times,
    last_byte_at=st.none() | times,
    expected_first_byte_s=st.none() | st.floats(min_value=0.0, max_value=100.0),
)
endpoints = st.lists(
    st.builds(
        EndpointActivity,
        endpoint_id=st.sampled_from("abcdef"),
        in_flight=st.lists(flights, max_size=4).map(tuple),
        progress_at=st.none() | times,
        quarantined=st.booleans(),
    ),
    max_size=5,
    unique_by=lambda e: e.endpoint_id,
)
configs = st.builds(
    WedgeConfig,
    wedge_after_s=st.floats(min_value=0.5, max_value=60.0),
    prefill_margin=st.floats(min_value=1.0, max_value=4.0),
    max_wait_s=st.floats(min_value=1.0, max_value=600.0),
)


@given(endpoints, times, configs)
def test_only_busy_silent_unquarantined_endpoints_beside_a_progressing_one(
    eps: list[EndpointActivity], now: float, config: WedgeConfig
) -> None:
    got = wedged(eps, now, config)
    by_id = {e.endpoint_id: e for e in eps}
    for w in got:
        e = by_id[w.endpoint_id]
        assert e.in_flight and not e.quarantined
        since = silent_since(e)
        assert since is not None and w.silent_s == now - since
        assert w.silent_s >= w.threshold_s >= config.wedge_after_s
        assert w.requests == len(e.in_flight)
        assert any(
            (b := latest_byte(o)) is not None and b > since
            for o in eps
            if o.endpoint_id != e.endpoint_id and not o.quarantined
        )
    # Never every endpoint that could serve: the one that progressed last stays.
    open_ = [e for e in eps if not e.quarantined]
    assert len(got) < len(open_) or not open_


@given(endpoints, times, st.floats(min_value=0.0, max_value=100.0), configs)
def test_a_wedge_stays_a_wedge_as_time_passes(
    eps: list[EndpointActivity], now: float, later: float, config: WedgeConfig
) -> None:
    first = {w.endpoint_id for w in wedged(eps, now, config)}
    again = {w.endpoint_id for w in wedged(eps, now + later, config)}
    assert first <= again


@given(endpoints, times, configs)
def test_a_single_endpoint_is_never_quarantined(
    eps: list[EndpointActivity], now: float, config: WedgeConfig
) -> None:
    for e in eps:
        assert wedged([e], now, config) == ()
