"""Replicas on a shared card against their claims (llmgw/core/_card_memory.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import OOM_MARGIN_MIB, CardUse, OverClaim, ShareUse, watch_card

TOTAL = 81559  # an H100 80 GB, as nvidia-smi says


def share(sid: str, claim: int | None, used: int | None) -> ShareUse:
    return ShareUse(sid, f"r-{sid}", claim, used)


def test_a_share_over_its_claim_is_reported_with_its_numbers() -> None:
    card = CardUse(TOTAL, 60000, 0, (share("a", 24576, 30720), share("b", 24576, 20000)))
    v = watch_card(card)
    assert v.over == (OverClaim("a", "r-a", 24576, 30720),)
    assert v.over[0].over_mib == 6144
    assert v.over[0].words() == "holds 30720 MiB, claims 24576 (6144 over)"
    assert v.out_of_memory is False and v.replace is None
    assert v.held_mib == 60000


def test_a_full_card_replaces_the_share_most_over_its_claim() -> None:
    shares = (
        share("a", 24576, 26000),  # 1424 over
        share("b", 24576, 34000),  # 9424 over: the one
        share("c", 24576, 20000),  # within
    )
    v = watch_card(CardUse(TOTAL, TOTAL - 100, 0, shares))
    assert v.out_of_memory is True
    assert v.replace == OverClaim("b", "r-b", 24576, 34000)
    assert v.full_words(TOTAL) == f"holds {TOTAL - 100} of {TOTAL} MiB"


def test_used_just_outside_the_margin_is_not_full_and_the_apps_sum_alone_can_be() -> None:
    over = (share("a", 24576, 40000),)
    assert watch_card(CardUse(TOTAL, TOTAL - OOM_MARGIN_MIB - 1, 0, over)).out_of_memory is False
    assert watch_card(CardUse(TOTAL, TOTAL - OOM_MARGIN_MIB, 0, over)).out_of_memory is True
    # memory.used says 0 (a reading that lags), the processes' sum says full.
    shares = (share("a", 24576, 40000), share("b", 24576, 24000))
    v = watch_card(CardUse(TOTAL, 0, TOTAL - 64000, shares))
    assert v.out_of_memory is True and v.replace is not None and v.replace.shard_id == "a"
    assert v.held_mib == TOTAL


def test_ties_go_to_the_largest_then_the_id() -> None:
    shares = (share("a", 20000, 25000), share("b", 30000, 35000), share("c", 30000, 35000))
    v = watch_card(CardUse(TOTAL, TOTAL, 0, shares))
    assert v.replace is not None and v.replace.shard_id == "b"


def test_a_full_card_with_no_share_over_replaces_none() -> None:
    shares = (share("a", 24576, 24576), share("b", None, 50000), share("c", 24576, None))
    v = watch_card(CardUse(TOTAL, TOTAL, 30000, shares))
    assert v.out_of_memory is True
    assert v.over == () and v.replace is None


def test_nothing_known_decides_nothing() -> None:
    v = watch_card(CardUse(None, None, None, (share("a", 1, None),)))
    assert v.over == () and v.out_of_memory is False and v.replace is None
    assert v.held_mib is None


mib = st.integers(min_value=0, max_value=100_000)
shares_st = st.lists(
    st.builds(
        ShareUse,
        st.sampled_from("abcdefgh"),
        st.none() | st.text(min_size=1, max_size=3),
        st.none() | mib,
        st.none() | mib,
    ),
    max_size=8,
    unique_by=lambda s: s.shard_id,
).map(tuple)
cards = st.builds(CardUse, st.none() | mib, st.none() | mib, st.none() | mib, shares_st)


@given(cards)
def test_properties_of_the_pick(card: CardUse) -> None:
    v = watch_card(card)
    over_ids = {o.shard_id for o in v.over}
    # Over means a known measurement past a known claim; every such share is reported.
    for s in card.shares:
        known = s.claim_mib is not None and s.used_mib is not None
        assert (s.shard_id in over_ids) == (known and s.used_mib > s.claim_mib)  # type: ignore[operator]
    if v.replace is None:
        # Nothing picked only where the card is not full or no share is over.
        assert not v.out_of_memory or not v.over
        return
    # At most one, only on a full card, never one within its claim or unmeasured.
    assert v.out_of_memory
    picked = next(s for s in card.shares if s.shard_id == v.replace.shard_id)
    assert picked.used_mib is not None and picked.claim_mib is not None
    assert picked.used_mib > picked.claim_mib
    # The most over; ties the largest.
    assert all((v.replace.over_mib, v.replace.used_mib) >= (o.over_mib, o.used_mib) for o in v.over)


@given(cards)
def test_a_card_not_full_picks_nothing_and_unknown_shares_never_are_picked(card: CardUse) -> None:
    v = watch_card(card)
    if not v.out_of_memory:
        assert v.replace is None
    unknown = {s.shard_id for s in card.shares if s.used_mib is None or s.claim_mib is None}
    assert v.replace is None or v.replace.shard_id not in unknown
    # Making every measurement unknown picks nothing, whatever the card says.
    blind = CardUse(
        card.total_mib,
        card.used_mib,
        card.foreign_mib,
        tuple(ShareUse(s.shard_id, s.replica_id, s.claim_mib, None) for s in card.shares),
    )
    assert watch_card(blind).replace is None and watch_card(blind).over == ()
