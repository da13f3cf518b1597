"""What a relaunch may change, and the argv a shard's sources become: pure, with hypothesis."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core, model
from llmgw.core import _relaunch
from llmgw.core._relaunch import RELAUNCH_MAY_CHANGE, local_argv, relaunch_refusal

SPEC = model.ShardSpec(
    shard_id="m-0",
    model="/w/base.gguf",
    engine="llama-server",
    processes=(model.ProcessSpec(name="engine", argv=("llama-server", "--port", "9000")),),
    port=9000,
    replica_id="r-1",
    model_name="base",
    gpus=("GPU-1",),
    source="mirror:/base.gguf",
    adapters=("a",),
    adapter_sources=("mirror:/a.gguf",),
)

# One other value per field: what a relaunch would change it to.
OTHER: dict[str, object] = {
    "shard_id": "m-1",
    "model": "/w/other.gguf",
    "engine": "vllm",
    "processes": (model.ProcessSpec(name="engine", argv=("llama-server", "--port", "9001")),),
    "served_names": ("x",),
    "serves_http": False,
    "port": 9001,
    "health_path": "/healthz",
    "models_path": "/models",
    "profile_fingerprint": "f2",
    "replica_id": "r-2",
    "model_name": "other",
    "rank": 1,
    "ranks": 2,
    "gpus": ("GPU-2",),
    "source": "mirror:/other.gguf",
    "adapters": ("a", "b"),
    "adapter_sources": ("mirror:/a.gguf", "mirror:/b.gguf"),
    "gpu_memory_mib": 24576,  # a share of each card: placement's, never a relaunch's
}


def test_every_field_but_the_adapters_is_refused_by_name() -> None:
    assert set(OTHER) == {f.name for f in attrs.fields(model.ShardSpec)}
    assert {"adapters", "adapter_sources"} == RELAUNCH_MAY_CHANGE
    for name, value in OTHER.items():
        new = attrs.evolve(SPEC, **{name: value})
        refusal = relaunch_refusal(SPEC, new)
        pairing = "(one source per adapter, in the same order)"
        if name == "adapters":  # two names, one source: the lists must pair up
            assert refusal == f"2 adapters but 1 adapter sources {pairing}"
        elif name == "adapter_sources":
            assert refusal == f"1 adapters but 2 adapter sources {pairing}"
        else:
            assert refusal is not None and f"changes {name} " in refusal, (name, refusal)
    assert relaunch_refusal(SPEC, attrs.evolve(SPEC, port=9001)) == (
        "a relaunch changes only adapters and adapter_sources, and this one changes "
        "port 9000 -> 9001 (start a new shard for that)"
    )
    both = relaunch_refusal(SPEC, attrs.evolve(SPEC, port=None, gpus=("GPU-2",)))
    assert both is not None and "port 9000 -> None; gpus ('GPU-1',) -> ('GPU-2',)" in both


def engine(*argv: str) -> tuple[model.ProcessSpec, ...]:
    return (model.ProcessSpec(name="engine", argv=("llama-server", "--port", "9000", *argv)),)


def test_the_argv_may_change_only_in_the_adapters_it_names() -> None:
    current = attrs.evolve(SPEC, processes=engine("--lora-scaled", "mirror:/a.gguf:0"))
    more = attrs.evolve(
        current,
        processes=engine("--lora-scaled", "mirror:/a.gguf:0", "--lora-scaled", "mirror:/b.gguf:0"),
        adapters=("a", "b"),
        adapter_sources=("mirror:/a.gguf", "mirror:/b.gguf"),
    )
    none = attrs.evolve(current, processes=engine(), adapters=(), adapter_sources=())
    assert relaunch_refusal(current, more) is None
    assert relaunch_refusal(more, none) is None
    # Another flag besides: refused, showing the argv apart from the adapters.
    other = attrs.evolve(more, processes=engine("-np", "2", "--lora-scaled", "mirror:/a.gguf:0"))
    refusal = relaunch_refusal(current, other)
    assert refusal is not None and "changes processes " in refusal
    assert "'--port', '9000', '-np', '2')" in refusal
    # A process's other fields are not the adapters' either.
    env = attrs.evolve(
        current,
        processes=(attrs.evolve(current.processes[0], env=(model.EnvVar("X", "1"),)),),
    )
    assert "changes processes " in (relaunch_refusal(current, env) or "")


@given(
    st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=4, unique=True),
)
def test_any_adapter_list_with_its_sources_is_allowed(names: list[str]) -> None:
    new = attrs.evolve(
        SPEC,
        adapters=tuple(names),
        adapter_sources=tuple(f"mirror:/{n}.gguf" for n in names),
    )
    assert relaunch_refusal(SPEC, new) is None


SOURCES = st.sampled_from(["mirror:/a.gguf", "mirror:/a.gguf:x", "https://h/b.gguf", "/w/c"])


@given(
    st.lists(st.one_of(SOURCES, st.text(max_size=6)), max_size=8),
    st.dictionaries(SOURCES, st.text(alphabet="/abcxyz", min_size=1, max_size=6), max_size=4),
)
def test_sources_become_their_paths_whole_or_before_a_colon(
    argv: list[str], local: dict[str, str]
) -> None:
    out = local_argv(argv, local)
    assert len(out) == len(argv)
    for before, after in zip(argv, out, strict=True):
        if before in local:
            assert after == local[before]
            continue
        prefixes = [s for s in local if before.startswith(s + ":")]
        if not prefixes:
            assert after == before
        else:
            longest = max(prefixes, key=len)
            assert after == local[longest] + before[len(longest) :]


def test_llama_servers_lora_scaled_form() -> None:
    local = {"mirror:/a.gguf": "/w/ab12/a.gguf", "mirror:/base.gguf": "/w/cd34/base.gguf"}
    argv = ["llama-server", "-m", "mirror:/base.gguf", "--lora-scaled", "mirror:/a.gguf:0"]
    assert local_argv(argv, local) == [
        "llama-server",
        "-m",
        "/w/cd34/base.gguf",
        "--lora-scaled",
        "/w/ab12/a.gguf:0",
    ]
    # Not a prefix without the colon: "mirror:/a.gguf2" is another source.
    assert local_argv(["mirror:/a.gguf2"], local) == ["mirror:/a.gguf2"]


def test_pure_and_public() -> None:
    tree = ast.parse(Path(_relaunch.__file__).read_text())
    imported = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    assert imported <= {"__future__", "collections.abc", "attrs", "llmgw.model"}
    assert (core.relaunch_refusal, core.local_argv) == (relaunch_refusal, local_argv)
