"""`llmgw ctl rollout status`'s text, from the admin API's row (pure: JSON in, text out)."""

from __future__ import annotations

from typing import Any

from llmgw.ctl._rollout import format_rollout


def row(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "tiny",
        "phase": "rolling",
        "status": "rolling: 1 of 2 new (1 ready), 2 old left; at most 1 extra, 0 unavailable",
        "to": ["5387022652f4a15a"],
        "previous": ["25010e01ec5c785b"],
        "started_at": 1000.0,
        "finished_at": None,
        "paused": False,
        "failures": 1,
        "undone": False,
        "fingerprints": ["5387022652f4a15a"],
        "file_fingerprints": ["5387022652f4a15a"],
        "settled": ["25010e01ec5c785b"],
        "policy": {"max_surge": 1, "max_unavailable": 0, "max_failures": 3},
        "replicas": {"old": 2, "new": 1, "new_ready": 1, "wanted": 2},
    }
    return {**base, **over}


def test_a_rolling_model_says_how_far_from_what_to_what() -> None:
    assert format_rollout(row(), now=1041.0).splitlines() == [
        "tiny: 1 of 2 ready on 53870226, 2 old",
        "  rollout rolling: 25010e01 -> 53870226, began 41 s ago",
        "  rolling: 1 of 2 new (1 ready), 2 old left; at most 1 extra, 0 unavailable",
        "  max_surge 1, max_unavailable 0, failures 1 of 3",
    ]


def test_an_undone_model_says_what_server_yaml_still_says() -> None:
    text = format_rollout(
        row(phase="done", undone=True, fingerprints=["25010e01ec5c785b"], previous=[],
            replicas={"old": 0, "new": 2, "new_ready": 2, "wanted": 2}),
        now=1000.0,
    )  # fmt: skip
    assert "tiny: 2 of 2 ready on 25010e01\n" in text
    assert "(unknown) -> 53870226" in text
    assert "undone: running 25010e01 while server.yaml says 53870226" in text


def test_a_model_never_rolled_says_so_and_nothing_else() -> None:
    text = format_rollout(row(phase=None, status=None), now=0.0)
    assert text.splitlines()[1:] == ["  never rolled out by this control plane"]
