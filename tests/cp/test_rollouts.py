"""The reconciler's rollouts (llmgw/cp/_fleet/_rollouts.py): begun, counted, finished and
settled from plans; kept in a real store and read back by another control plane; undo
pins the version before until server.yaml changes again.

The plans are the pure reconcile plan's, fed with shards of two fingerprints; the
service path (real llmgw-cp, agents and llama-servers) is
tests/integration/test_rollout_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw import core
from llmgw.core import ObservedShard
from llmgw.cp._fleet._catalog import Catalog, CatalogModel, Profile
from llmgw.cp._fleet._placing import Unplaced
from llmgw.cp._fleet._reconciler import desired
from llmgw.cp._fleet._rollouts import Rollouts
from llmgw.errors import UsageError
from llmgw.store import open_store


def tiny(ctx: int, replicas: int = 2) -> CatalogModel:
    args = ["--ctx-size", str(ctx)]
    profile = Profile(engine="llama-server", engine_args=args)
    return CatalogModel(name="tiny", source="/m/tiny.gguf", replicas=replicas, profiles=[profile])


def plan(
    catalog: Catalog,
    rollouts: Rollouts,
    fleet: dict[str, tuple[str, str]],
    unplaced: dict[str, Unplaced] | None = None,
) -> core.Plan:
    """fleet: replica id -> (fingerprint, shard state); unplaced: the last pass's refusals."""
    shards = [
        ObservedShard("n1", "ready", f"{r}.0", state, r, "tiny", 0, 1, fp)
        for r, (fp, state) in sorted(fleet.items())
    ]
    return core.reconcile(desired(catalog), shards, {"n1": "ready"}, {r: 0.0 for r in fleet},
                          1.0, rollouts=rollouts.controls(unplaced or {}))  # fmt: skip


def passes(rollouts: Rollouts, file: Catalog, fleet: dict[str, tuple[str, str]]) -> core.Plan:
    """One acting pass as the reconciler makes it: plan, note, plan again if asked."""
    running = rollouts.catalog(file)
    p = plan(running, rollouts, fleet)
    if rollouts.note(p, running, file):
        p = plan(running, rollouts, fleet)
    return p


async def test_a_rollout_is_kept_in_the_store_and_another_control_plane_continues_it(
    tmp_path: Path,
) -> None:
    v1, v2 = Catalog((tiny(256),)), Catalog((tiny(512),))
    fp1, fp2 = v1.fingerprints(v1.models[0]), v2.fingerprints(v2.models[0])
    store = await open_store(tmp_path / "state", timeout_s=10)
    try:
        first = Rollouts(clock=lambda: 1000.0)
        await first.load(store)
        passes(first, v1, {"a": (fp1[0], "ready"), "b": (fp1[0], "ready")})
        mr = first.status("tiny")
        assert mr is not None and mr.settled is not None and mr.settled.fingerprints == fp1
        assert mr.record is None  # settled, never rolled

        p = passes(first, v2, {"a": (fp1[0], "ready"), "b": (fp1[0], "ready")})
        assert [a for a in p.actions if isinstance(a, core.Start)] == [core.Start("tiny")]
        rec = first.status("tiny").record  # type: ignore[union-attr]
        assert rec is not None and (rec.to, rec.previous, rec.started_at) == (fp2, fp1, 1000.0)
        first.pause("tiny")
        p = passes(first, v2, {"a": (fp1[0], "ready"), "b": (fp1[0], "ready"),
                               "c": (fp2[0], "failed")})  # fmt: skip
        assert p.rollouts[0].phase is core.RolloutPhase.PAUSED
        await first.flush()

        # Another control plane (a restart, a failover) reads it all back.
        second = Rollouts(clock=lambda: 2000.0)
        await second.load(store)
        got = second.status("tiny")
        assert got is not None and got.record is not None
        assert (got.record.started_at, got.record.paused, got.record.failures) == (1000.0, True, 1)
        assert got.previous is not None and got.previous.fingerprints == fp1
        second.resume("tiny")
        fleet = {"a": (fp1[0], "ready"), "b": (fp1[0], "ready"), "d": (fp2[0], "ready")}
        p = passes(second, v2, fleet)
        assert p.rollouts[0].phase is core.RolloutPhase.ROLLING
        assert [v.state for v in p.replicas if v.replica_id == "a"] == ["retiring"]
        done = passes(second, v2, {"d": (fp2[0], "ready"), "e": (fp2[0], "ready")})
        assert done.rollouts[0].phase is core.RolloutPhase.DONE
        passes(second, v2, {"d": (fp2[0], "ready"), "e": (fp2[0], "ready")})
        got = second.status("tiny")
        assert got is not None and got.record is not None and got.record.finished_at == 2000.0
        assert got.settled is not None and got.settled.fingerprints == fp2
        with pytest.raises(UsageError, match="tiny is not being rolled out"):
            second.pause("tiny")
    finally:
        await store.aclose()


def test_undo_pins_the_version_before_until_server_yaml_changes_again() -> None:
    v1, v2, v3 = (Catalog((tiny(ctx, replicas=1),)) for ctx in (256, 512, 1024))
    fp1, fp2, fp3 = (c.fingerprints(c.models[0]) for c in (v1, v2, v3))
    r = Rollouts()
    with pytest.raises(UsageError, match="has not been rolled out"):
        r.undo("tiny", v2)
    passes(r, v1, {"a": (fp1[0], "ready")})
    passes(r, v2, {"a": (fp1[0], "ready")})  # rolling to v2
    r.undo("tiny", v2)
    assert v2.fingerprints(r.catalog(v2).models[0]) == fp1  # v1 runs while server.yaml says v2
    p = passes(r, v2, {"a": (fp1[0], "ready"), "b": (fp2[0], "ready")})
    assert [v.stale for v in p.replicas] == [False, True]  # now v2's replica is the old one
    rec = r.status("tiny").record  # type: ignore[union-attr]
    assert rec is not None and (rec.to, rec.previous, rec.undone) == (fp1, fp2, True)
    r.undo("tiny", v2)  # again: forward to what server.yaml says
    assert v2.fingerprints(r.catalog(v2).models[0]) == fp2
    r.undo("tiny", v2)
    assert v2.fingerprints(r.catalog(v2).models[0]) == fp1
    passes(r, v3, {"a": (fp1[0], "ready")})  # an edit of server.yaml lets the pin go
    assert v3.fingerprints(r.catalog(v3).models[0]) == fp3
    assert r.status("tiny").pin is None  # type: ignore[union-attr]


def test_a_model_first_seen_at_its_new_version_cannot_be_undone_and_says_why() -> None:
    v2 = Catalog((tiny(512),))
    r = Rollouts()
    passes(r, v2, {"a": ("fp-from-before", "ready")})  # rolling, from a version not known here
    with pytest.raises(UsageError, match="the version before this rollout is not known here"):
        r.undo("tiny", v2)


def test_an_edit_right_after_a_rollout_finishes_goes_back_to_the_finished_version() -> None:
    """Found by a loaded fresh-clone run of test_rollout_e2e: v1 -> v2 finished, and an
    edit to v3 arrived in the very next pass. The version a rollout came from was the
    last settled one, which was only recorded a pass after the rollout finished, so the
    undo of v3 went back to v1, replacing v2's replicas, not to v2."""
    v1, v2, v3 = (Catalog((tiny(ctx, replicas=1),)) for ctx in (256, 512, 1024))
    fp1, fp2, fp3 = (c.fingerprints(c.models[0]) for c in (v1, v2, v3))
    r = Rollouts()
    passes(r, v1, {"a": (fp1[0], "ready")})  # v1 settled
    passes(r, v2, {"a": (fp1[0], "ready")})  # rolling to v2: b starts
    passes(r, v2, {"a": (fp1[0], "ready"), "b": (fp2[0], "ready")})  # a retires
    passes(r, v2, {"b": (fp2[0], "ready")})  # the pass that finishes it
    passes(r, v3, {"b": (fp2[0], "ready")})  # the edit, at once: rolling to v3
    r.undo("tiny", v3)
    assert v3.fingerprints(r.catalog(v3).models[0]) == fp2 != fp3
