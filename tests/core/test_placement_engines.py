"""Placement and the engines a node has: the declared version, and the node's own words.

Pure: `engine_facts` (what the reconciler's `node_facts` gives placement) and the
refusal texts of `place`.
"""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core, model
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


def status(state: str, version: str | None = "b6123") -> model.EngineStatus:
    return model.EngineStatus("llama-server", state, f"{state} llama-server", version)


def test_a_refusal_names_as_data_the_nodes_that_only_wait_for_their_engine_install() -> None:
    nodes = {
        "n1": model.Engines(pending=(status("installing"),)),
        "n2": model.Engines(pending=(status("waiting"),)),  # behind another apt-get
        # told of b6123 but not yet reporting its install: it replaces its b6000
        "n3": model.Engines(found=(found("llama-server", "b6000"),)),
        "n4": model.Engines(pending=(status("failed"),)),  # the agent retries it
        "n5": model.Engines(found=(found("llama-server", "b6000"),), pending=(status("failed"),)),
        "n6": model.Engines(),  # never had it, nothing under way: only an operator helps
        "n7": model.Engines(found=(found("llama-server", "b1", "configured"),)),  # runs it
        "n8": model.Engines(pending=(status("installing"),)),  # installing, but too small
        "n9": model.Engines(pending=(model.EngineStatus("vllm", "installing", "pip", "0.9.2"),)),
    }
    installing = {n: core.engines_installing(e, DECLS) for n, e in nodes.items()}
    assert {n for n, names in installing.items() if "llama-server" in names} == {
        "n1", "n2", "n3", "n4", "n5", "n8"
    }  # fmt: skip
    assert installing["n1"] == frozenset({"llama-server"})
    # Nothing declared: nothing to wait for; not probed: unknown, nothing either.
    assert core.engines_installing(nodes["n1"], None) == frozenset()
    assert core.engines_installing(None, DECLS) == frozenset()

    def facts(nid: str, engines: model.Engines) -> NodeFacts:
        runnable, words = engine_facts(engines, DECLS)
        memory = 2 * 2**30 if nid == "n8" else 64 * 2**30
        return NodeFacts(nid, nid, True, engines=runnable, engine_words=words,
                         engines_installing=installing[nid],
                         memory_total_bytes=memory)  # fmt: skip

    needs = attrs.evolve(CPU_LLAMA, min_memory_gb=8.0)
    # n7 can run it (and has room: no refusal at all), n8 would still not fit once installed
    assert isinstance(place([facts("n7", nodes["n7"])], needs), Placement)
    del nodes["n7"]
    fleet = [facts(n, e) for n, e in nodes.items()]
    result = place(fleet, needs)
    assert isinstance(result, Refusal)
    assert result.installing == ("n1", "n2", "n3", "n4", "n5")
    assert "n1, n8: installing: installing llama-server" in result.reasons  # the words stay
    # A node that has what it needs is a placement, not a wait.
    ready = NodeFacts("n10", "n10", True, engines=frozenset({"llama-server"}))
    assert isinstance(place([*fleet, ready], needs), Placement)
    # Another engine's install is no wait for this profile.
    vllm = attrs.evolve(needs, engine="vllm")
    refused = place(fleet, vllm)
    assert isinstance(refused, Refusal) and refused.installing == ("n9",)


LLAMA_ONLY = frozenset({"llama-server"})
# what a node says of llama-server -> (NodeFacts.engines, NodeFacts.engines_installing)
ENGINE_STATES: dict[str, tuple[frozenset[str] | None, frozenset[str]]] = {
    "runs": (LLAMA_ONLY, frozenset()),
    "installing": (frozenset(), LLAMA_ONLY),
    "none": (frozenset(), frozenset()),
    "unknown": (None, frozenset()),
}

nodes_strategy = st.lists(
    st.tuples(
        st.booleans(),  # ready
        st.booleans(),  # cordoned
        st.sampled_from([None, 2 * 2**30, 64 * 2**30]),  # memory
        st.sampled_from(sorted(ENGINE_STATES)),  # llama-server
    ),
    min_size=1,
    max_size=8,
)


@given(nodes_strategy)
def test_installing_is_exactly_the_nodes_the_engine_alone_keeps_out(
    drawn: list[tuple[bool, bool, int | None, str]],
) -> None:
    needs = attrs.evolve(CPU_LLAMA, min_memory_gb=8.0)
    fleet = [
        NodeFacts(
            f"n{i}", f"n{i}", ready, cordoned=cordoned, memory_total_bytes=memory,
            engines=ENGINE_STATES[engine][0], engines_installing=ENGINE_STATES[engine][1],
        )
        for i, (ready, cordoned, memory, engine) in enumerate(drawn)
    ]  # fmt: skip
    result = place(fleet, needs)
    if isinstance(result, Placement):
        return
    # A CPU profile has no card to run short of: once installed, a node in `installing`
    # fits; a node not in it is kept out by something the install does not change.
    for f in fleet:
        with_engine = attrs.evolve(f, engines=frozenset({"llama-server"}))
        fits_once_installed = isinstance(place([with_engine], needs), Placement)
        expected = "llama-server" in f.engines_installing and fits_once_installed
        assert (f.node_id in result.installing) == expected, (f, result)
