"""A declared engine's version is part of its profiles' fingerprints (llmgw/cp/_fleet/
_catalog.py): declaring another version rolls the models that run it, a fleet without
`engines:` keeps the fingerprints it had, and the rollout waits, without retiring a
replica early, while the nodes install the new version.

The service path (a real llmgw-cp, agent and llama-server installed twice from the
mirror) is tests/integration/test_engine_install.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from llmgw import config, core, model
from llmgw.core import ObservedShard
from llmgw.cp._fleet._catalog import Catalog, CatalogModel, Profile, with_engines
from llmgw.cp._fleet._catalog_file import CatalogFile, read
from llmgw.cp._fleet._engines import declare, load
from llmgw.cp._fleet._placing import Unplaced
from llmgw.cp._fleet._reconciler import desired
from llmgw.cp._fleet._rollouts import Rollouts
from llmgw.cp._weights._mirror import ManifestCache
from llmgw.errors import UsageError

LLAMA = Profile(engine="llama-server", engine_args=["--ctx-size", "256"])
VLLM = Profile(engine="vllm", gpu_class="h100-80g")
TINY = CatalogModel(name="tiny", source="/m/tiny.gguf", profiles=[LLAMA, VLLM])


def llama(version: str) -> model.EngineDecl:
    return model.EngineDecl("llama-server", version, (model.EngineArchive("cpu-x86_64", "x", "0"),))


def vllm(version: str) -> model.EngineDecl:
    return model.EngineDecl("vllm", version, requirement=f"vllm=={version}")


def before_versions_counted(m: CatalogModel, p: Profile) -> str:
    """The fingerprint as llmgw computed it before engine versions were in it (and before
    a profile had the adapter keys and the share of a card, which stay out of it while
    unset)."""
    shape = config.unstructure(p)
    for key in ("max_adapters", "max_adapter_rank", "gpu_memory_gib", "mig"):
        assert shape.pop(key) is None
    body = {"source": m.source, "served_names": list(m.names), "profile": shape}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def test_without_a_declaration_for_its_engine_a_profile_keeps_its_fingerprint() -> None:
    was = tuple(before_versions_counted(TINY, p) for p in TINY.profiles)
    assert Catalog((TINY,)).fingerprints(TINY) == was
    assert with_engines(Catalog((TINY,)), None).fingerprints(TINY) == was
    # Declaring sglang changes neither profile: neither runs it.
    sglang = model.EngineDecl("sglang", "0.4.0", requirement="sglang==0.4.0")
    assert with_engines(Catalog((TINY,)), declare((sglang,))).fingerprints(TINY) == was


def test_a_declared_version_is_in_the_fingerprint_of_the_profiles_running_that_engine() -> None:
    was = Catalog((TINY,)).fingerprints(TINY)
    b1 = with_engines(Catalog((TINY,)), declare((llama("b1"), vllm("0.9.2"))))
    b2 = with_engines(Catalog((TINY,)), declare((llama("b2"), vllm("0.9.2"))))
    assert b1.engine_versions == (("llama-server", "b1"), ("vllm", "0.9.2"))
    assert len({was[0], b1.fingerprints(TINY)[0], b2.fingerprints(TINY)[0]}) == 3
    assert b1.fingerprints(TINY)[1] == b2.fingerprints(TINY)[1] != was[1]  # vllm's is 0.9.2
    # What the reconciler wants and what a start is tagged with are the same fingerprints.
    assert desired(b2)[0].fingerprints == b2.fingerprints(TINY)


async def test_a_reload_that_changes_only_an_engine_version_is_a_catalog_change(
    tmp_path: Path,
) -> None:
    path = tmp_path / "server.yaml"

    def write(version: str, sglang: str = "0.4.0") -> None:
        path.write_text(
            "models:\n"
            "  - name: big\n"
            "    source: org/big\n"
            "    profiles: [{engine: vllm, gpu_class: h100-80g}]\n"
            f"engines:\n  vllm: {{version: {version}}}\n  sglang: {{version: {sglang}}}\n"
        )

    cache = ManifestCache()

    async def loader(data: Any) -> model.EngineDecls | None:
        return await load(data, str(path), tmp_path, cache.sha256)

    write("0.9.2")

    first = CatalogFile(path, read(path), await loader(config.read_yaml(path)), loader)
    big = first.catalog.models[0]
    assert first.catalog.engine_versions == (("sglang", "0.4.0"), ("vllm", "0.9.2"))  # at start
    was = first.catalog.fingerprints(big)
    changes: list[str] = []
    declared: list[model.EngineDecls | None] = []

    async def reload() -> bool:
        return await first.reload(
            "test", on_change=lambda: changes.append("catalog"), on_engines=declared.append
        )

    assert await reload() is True
    assert (changes, declared) == ([], [])  # the same file: nothing changed
    write("0.9.3")
    assert await reload() is True
    assert changes == ["catalog"]  # the reconciler is poked...
    assert [dict(first.catalog.engine_versions)["vllm"]] == ["0.9.3"]
    assert len(declared) == 1  # ...and the agents told
    assert first.catalog.models == (big,)
    assert first.catalog.fingerprints(big) != was
    # A version no model runs: the agents are told, no fingerprint changes, no poke.
    write("0.9.3", sglang="0.4.1")
    assert await reload() is True
    assert (changes, len(declared)) == (["catalog"], 2)
    assert dict(first.catalog.engine_versions)["sglang"] == "0.4.1"
    path.write_text("models:\n  - {name: big, source: org/big, "
                    "profiles: [{engine: vllm, gpu_class: h100-80g}]}\n")  # fmt: skip
    assert await reload() is True
    assert changes == ["catalog", "catalog"]  # the declaration gone: back to no version
    assert first.catalog.fingerprints(big) == (before_versions_counted(big, big.profiles[0]),)


# --- the rollout an engine version begins ------------------------------------------------

ONE = CatalogModel(name="tiny", source="/m/tiny.gguf", replicas=1, profiles=[LLAMA])
V1 = with_engines(Catalog((ONE,)), declare((llama("b1"),)))
V2 = with_engines(Catalog((ONE,)), declare((llama("b2"),)))


def plan(catalog: Catalog, r: Rollouts, fleet: dict[str, str], unplaced: dict[str, Unplaced]
         ) -> core.Plan:  # fmt: skip
    shards = [ObservedShard("n1", "ready", f"{rid}.0", "ready", rid, "tiny", 0, 1, fp)
              for rid, fp in sorted(fleet.items())]  # fmt: skip
    return core.reconcile(desired(catalog), shards, {"n1": "ready"}, {rid: 0.0 for rid in fleet},
                          1.0, rollouts=r.controls(unplaced))  # fmt: skip


def passes(r: Rollouts, file: Catalog, fleet: dict[str, str],
           unplaced: dict[str, Unplaced] | None = None) -> core.Plan:  # fmt: skip
    running = r.catalog(file)
    p = plan(running, r, fleet, unplaced or {})
    if r.note(p, running, file):
        p = plan(running, r, fleet, unplaced or {})
    return p


def test_a_new_engine_version_rolls_and_waits_while_the_nodes_install_it() -> None:
    (fp1,), (fp2,) = V1.fingerprints(ONE), V2.fingerprints(ONE)
    r = Rollouts(clock=lambda: 100.0)
    passes(r, V1, {"a": fp1})  # settled on b1
    p = passes(r, V2, {"a": fp1})
    assert [a for a in p.actions if isinstance(a, core.Start)] == [core.Start("tiny")]
    rec = r.status("tiny").record  # type: ignore[union-attr]
    assert rec is not None and (rec.to, rec.previous) == ((fp2,), (fp1,))

    # The start was refused: n1 is only installing b2. The one replica keeps serving.
    waits = {"tiny": Unplaced("tiny", ("n1: installing: downloading",), installing=("n1",))}
    p = passes(r, V2, {"a": fp1}, waits)
    assert [(v.replica_id, v.state) for v in p.replicas] == [("a", "ready")]
    assert not [a for a in p.actions if isinstance(a, core.Stop)]
    assert p.rollouts[0].status.endswith("waiting for the engine to be installed on n1")
    # Refused for want of room (no node installing): one at a time, the old one retires.
    full = {"tiny": Unplaced("tiny", ("n1: 0 free healthy cards",))}
    p = passes(r, V2, {"a": fp1}, full)
    assert [(v.replica_id, v.state) for v in p.replicas] == [("a", "retiring")]
    assert "no room for an extra replica" in p.rollouts[0].status

    # Undo cannot take a fleet-wide engine version back, and says how.
    with pytest.raises(UsageError, match="declare the previous version under engines:"):
        r.undo("tiny", V2)
    assert r.status("tiny").pin is None  # type: ignore[union-attr]


def test_undo_knows_an_entry_stored_before_the_adapter_keys_existed() -> None:
    """A version the store kept from before a profile had max_adapters/max_adapter_rank
    lacks those keys; it is still the same entry as the file's, so the undo of a rollout
    that changed only the engine version is refused as such."""
    (fp1,) = V1.fingerprints(ONE)
    r = Rollouts(clock=lambda: 100.0)
    passes(r, V1, {"a": fp1})
    passes(r, V2, {"a": fp1})
    mr = r.status("tiny")
    assert mr is not None and mr.previous is not None
    for profile in mr.previous.spec["profiles"]:
        assert (profile.pop("max_adapters"), profile.pop("max_adapter_rank")) == (None, None)
    with pytest.raises(UsageError, match="declare the previous version under engines:"):
        r.undo("tiny", V2)


def test_the_running_catalog_keeps_the_declared_versions_through_an_undo() -> None:
    other = attrs.evolve(ONE, source="/m/other.gguf")
    v3 = with_engines(Catalog((other,)), declare((llama("b2"),)))
    r = Rollouts()
    passes(r, V2, {"a": V2.fingerprints(ONE)[0]})
    passes(r, v3, {"a": V2.fingerprints(ONE)[0]})  # rolling to the other source
    r.undo("tiny", v3)  # back to ONE, still on b2
    running = r.catalog(v3)
    assert running.engine_versions == (("llama-server", "b2"),)
    assert running.models == (ONE,)
    assert running.fingerprints(running.models[0]) == V2.fingerprints(ONE)
