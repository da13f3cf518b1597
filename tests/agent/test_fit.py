"""A llama-server on a shared card held to its share by `--fit-target`
(llmgw/agent/_fit.py): the margin is each card's free memory now less the share."""

from __future__ import annotations

from llmgw.agent._fit import fit_target, parse_free

SMI = """GPU-aaaa, 81559
GPU-bbbb, 40000
GPU-cccc, [N/A]
"""


def test_the_margin_is_free_memory_less_the_share_per_card_in_order() -> None:
    free = parse_free(SMI)
    assert free == {"GPU-aaaa": 81559, "GPU-bbbb": 40000}
    assert fit_target(free, ["GPU-aaaa"], 30720) == "50839"
    assert fit_target(free, ["GPU-bbbb", "GPU-aaaa"], 30720) == "9280,50839"
    # Less free than the share: no margin at all (llama-server fits what there is).
    assert fit_target(free, ["GPU-bbbb"], 50000) == "0"


def test_a_card_of_unknown_free_memory_sets_nothing() -> None:
    free = parse_free(SMI)
    assert fit_target(free, ["GPU-cccc"], 1024) is None
    assert fit_target(free, ["GPU-aaaa", "GPU-gone"], 1024) is None
    assert fit_target(free, [], 1024) is None
