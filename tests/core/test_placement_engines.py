"""Placement and the engines a node has: the declared version, and the node's own words.

Pure: `engine_facts` (what the reconciler's `node_facts` gives placement) and the
refusal texts of `place`.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw import model
from llmgw.core import engine_facts
from llmgw.core._placement import NodeFacts, Placement, PlacementProfile, Refusal, place
from llmgw.cp._fleet._engines import declare

LLAMA = model.EngineDecl("llama-server", "b6123", (model.EngineArchive("cpu-x86_64", "x", "0"),))
DECLS = declare((LLAMA, model.EngineDecl("vllm", "0.9.2", requirement="vllm==0.9.2")))
CPU_LLAMA = PlacementProfile("tiny", "llama-server", None, 0)


def found(name: str, version: str | None, state: str = "installed") -> model.Engine:
    return model.Engine(name, f"/e/{name}", version, state)


def test_a_declared_engine_counts_only_at_its_version_or_when_configured() -> None:
    engines = model.Engines(
        found=(
            found("llama-server", "b6000"),
            found("vllm", None, "configured"),  # the operator's word wins
            found("sglang", "0.4.0"),  # not declared: found is enough
        )
    )
    runnable, words = engine_facts(engines, DECLS)
    assert runnable == frozenset({"vllm", "sglang"})
    assert words == (("llama-server", "has llama-server b6000, needs b6123"),)
    # Without a declaration every found engine runs, whatever its version.
    assert engine_facts(engines, None) == (frozenset({"llama-server", "vllm", "sglang"}), ())
    # Not probed yet: unknown, never "has none".
    assert engine_facts(None, DECLS) == (None, ())


def test_the_nodes_words_replace_not_installed_without_the_percentage() -> None:
    engines = model.Engines(
        found=(found("llama-server", "b6000"),),
        pending=(
            model.EngineStatus(
                "llama-server",
                "installing",
                "downloading llama-b6123-bin-cpu-x86_64.tar.gz (16 MB, 40 %)",
                "b6123",
            ),
            model.EngineStatus("vllm", "failed", "no matching distribution for vllm==0.9.2"),
        ),
    )
    runnable, words = engine_facts(engines, DECLS)
    assert runnable == frozenset()
    assert dict(words) == {
        # what it is doing beats what it has
        "llama-server": "installing: downloading llama-b6123-bin-cpu-x86_64.tar.gz (16 MB)",
        "vllm": "failed: no matching distribution for vllm==0.9.2",
    }
    fleet = [
        NodeFacts("n1", "a", True, engines=runnable, engine_words=words),
        NodeFacts("n2", "b", True, engines=frozenset()),
        NodeFacts(
            "n3",
            "c",
            True,
            engines=frozenset(),
            engine_words=(("llama-server", "has llama-server b6000, needs b6123"),),
        ),
    ]
    result = place(fleet, CPU_LLAMA)
    assert isinstance(result, Refusal)
    assert sorted(str(result).splitlines()) == [
        "n1: installing: downloading llama-b6123-bin-cpu-x86_64.tar.gz (16 MB)",
        "n2: engine llama-server not installed",
        "n3: has llama-server b6000, needs b6123",
    ]


def test_a_percentage_alone_goes_and_waiting_keeps_its_words() -> None:
    engines = model.Engines(
        pending=(
            model.EngineStatus("llama-server", "installing", "unpacking (40 %)"),
            model.EngineStatus("vllm", "waiting", "for another apt-get to finish"),
        )
    )
    assert dict(engine_facts(engines, DECLS)[1]) == {
        "llama-server": "installing: unpacking",
        "vllm": "waiting: for another apt-get to finish",
    }


def test_a_node_at_the_declared_version_is_placed() -> None:
    runnable, words = engine_facts(model.Engines(found=(found("llama-server", "b6123"),)), DECLS)
    result = place([NodeFacts("n1", "a", True, engines=runnable, engine_words=words)], CPU_LLAMA)
    assert isinstance(result, Placement)
    assert result.node_ids == ("n1",)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["llama-server", "vllm", "sglang"]),
            st.sampled_from([None, "b6000", "b6123", "0.9.2"]),
            st.sampled_from(["installed", "configured"]),
        ),
        max_size=4,
    ),
    st.lists(st.sampled_from(["llama-server", "vllm", "sglang"]), max_size=3),
)
def test_runnable_and_words_never_overlap(
    found_: list[tuple[str, str | None, str]], pending: list[str]
) -> None:
    engines = model.Engines(
        found=tuple(found(n, v, s) for n, v, s in found_),
        pending=tuple(
            model.EngineStatus(n, "installing", "downloading x (1 MB, 5 %)") for n in pending
        ),
    )
    runnable, words = engine_facts(engines, DECLS)
    assert runnable is not None
    said = {n for n, _ in words}
    assert not runnable & said
    wanted = {d.name: d.version for d in DECLS.engines}
    for n, v, s in found_:
        if s == "configured" or wanted.get(n) in (None, v):
            assert n in runnable  # the operator's word, or the declared version: always runs
    assert all("%" not in w for _, w in words)
