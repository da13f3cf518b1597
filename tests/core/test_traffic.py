"""The traffic split's choice (llmgw/core/_traffic.py): a version per request, by weight
among those serving, or the one the request pins."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import TrafficChoice, TrafficPinError, TrafficSplit, TrafficVersion, route, shares


@st.composite
def splits(draw: st.DrawFn) -> TrafficSplit:
    n = draw(st.integers(1, 5))
    weights = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    if sum(weights) == 0:
        weights[draw(st.integers(0, n - 1))] = draw(st.integers(1, 100))
    versions = tuple(TrafficVersion(f"m{i}", f"served-{i}", w) for i, w in enumerate(weights))
    pinned = draw(st.lists(st.sampled_from([v.model for v in versions]), max_size=3))
    keys = tuple(sorted((f"key-{i}", m) for i, m in enumerate(pinned)))
    return TrafficSplit("name", versions, keys)


@st.composite
def split_and_serving(draw: st.DrawFn) -> tuple[TrafficSplit, set[str]]:
    split = draw(splits())
    serving = draw(st.sets(st.sampled_from([v.served for v in split.versions])))
    return split, serving


def drawn(split: TrafficSplit, serving: set[str], u: float) -> TrafficVersion:
    choice = route(split, u=u, available=serving)
    assert isinstance(choice, TrafficChoice) and choice.how == "split"
    return choice.version


@given(split_and_serving(), st.floats(0, 1, exclude_max=True))
def test_a_draw_lands_on_a_weighted_serving_version_while_there_is_one(
    case: tuple[TrafficSplit, set[str]], u: float
) -> None:
    split, serving = case
    version = drawn(split, serving, u)
    candidates = [v for v in split.versions if v.served in serving and v.weight > 0]
    if candidates:
        assert version in candidates
    else:  # nothing serving: drawn over every weighted version (the router then says 503)
        assert version.weight > 0


@given(split_and_serving())
def test_draws_spread_over_u_in_proportion_to_the_weights(
    case: tuple[TrafficSplit, set[str]],
) -> None:
    """Evenly spaced u: each version's count is its share of them, give or take one
    at each edge of its stretch, and `shares` says the same share."""
    split, serving = case
    n = 1000
    counts = Counter(drawn(split, serving, (i + 0.5) / n).model for i in range(n))
    expected = shares(split, serving)
    assert abs(sum(expected.values()) - 1.0) < 1e-9
    for v in split.versions:
        assert abs(counts[v.model] - expected[v.model] * n) <= 2, (v, counts, expected)


@given(split_and_serving(), st.floats(0, 1, exclude_max=True), st.data())
def test_a_header_pin_wins_over_the_weights_and_the_key(
    case: tuple[TrafficSplit, set[str]], u: float, data: st.DataObject
) -> None:
    split, serving = case
    v = data.draw(st.sampled_from(split.versions))
    by = data.draw(st.sampled_from([v.model, v.served]))
    key = data.draw(st.sampled_from([None, *[k for k, _ in split.keys]]))
    choice = route(split, u=u, available=serving, header=by, key_id=key)
    assert choice == TrafficChoice(v, "header")  # weight 0 and not serving included


@given(split_and_serving(), st.floats(0, 1, exclude_max=True))
def test_a_pinned_key_always_gets_its_version(
    case: tuple[TrafficSplit, set[str]], u: float
) -> None:
    split, serving = case
    for key_id, model in split.keys:
        choice = route(split, u=u, available=serving, key_id=key_id)
        assert isinstance(choice, TrafficChoice)
        assert (choice.version.model, choice.how) == (model, "key")
    other = route(split, u=u, available=serving, key_id="key-not-pinned")
    assert isinstance(other, TrafficChoice) and other.how == "split"


def test_a_header_naming_no_version_is_refused_naming_the_versions() -> None:
    split = TrafficSplit(
        "qwen", (TrafficVersion("qwen-v1", "qwen-v1", 90), TrafficVersion("qwen-v2", "q2", 10))
    )
    got = route(split, u=0.5, available={"qwen-v1"}, header="qwen-v3")
    assert got == TrafficPinError("qwen", "qwen-v3")
    assert got.message(split.versions) == (
        "'qwen-v3' is not a version of 'qwen' (its versions: qwen-v1, qwen-v2)"
    )


def test_ninety_ten_by_the_numbers() -> None:
    split = TrafficSplit("qwen", (TrafficVersion("v1", "v1", 90), TrafficVersion("v2", "v2", 10)))
    both = {"v1", "v2"}
    assert drawn(split, both, 0.0).model == "v1"
    assert drawn(split, both, 0.8999).model == "v1"
    assert drawn(split, both, 0.9).model == "v2"
    assert drawn(split, both, 0.9999).model == "v2"
    assert shares(split, both) == {"v1": 0.9, "v2": 0.1}
    # The canary not serving yet: its share goes to the other, not to 503s.
    assert drawn(split, {"v1"}, 0.95).model == "v1"
    assert shares(split, {"v1"}) == {"v1": 1.0, "v2": 0.0}
