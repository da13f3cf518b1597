"""The LoRA adapter GGUF the adapter tests write: llama.cpp's layout, read back with gguf."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from llmgw.testing import tiny_gguf
from llmgw.testing.tiny_lora import TARGETS, write_lora


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf.write(tmp_path_factory.mktemp("base") / "tiny.gguf")


def test_the_adapter_has_llama_cpps_keys_and_a_pair_per_adapted_matrix(
    tmp_path: Path, base: Path
) -> None:
    adapter = write_lora(tmp_path / "a.gguf", base, rank=3, alpha=6.0)
    reader = gguf.GGUFReader(str(adapter))
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["adapter.type"].contents() == "lora"
    alpha = reader.fields["adapter.lora.alpha"]
    assert alpha.types == [gguf.GGUFValueType.FLOAT32] and alpha.contents() == 6.0
    # ggml order (ne): base [n_in, n_out] -> lora_a [n_in, rank], lora_b [rank, n_out].
    base_ne = {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(str(base)).tensors}
    got = {t.name: ([int(n) for n in t.shape], t.tensor_type) for t in reader.tensors}
    want: dict[str, tuple[list[int], gguf.GGMLQuantizationType]] = {}
    f32 = gguf.GGMLQuantizationType.F32
    names = [f"blk.{i}.{t}.weight" for i in range(tiny_gguf.N_LAYER) for t in TARGETS[:-1]]
    for name in [*names, "output.weight"]:
        n_in, n_out = base_ne[name]
        want[f"{name}.lora_a"] = ([n_in, 3], f32)
        want[f"{name}.lora_b"] = ([3, n_out], f32)
    assert got == want
    assert all(not (t.data == 0).all() for t in reader.tensors)


def test_the_same_arguments_write_the_same_bytes_and_a_seed_changes_them(
    tmp_path: Path, base: Path
) -> None:
    one = write_lora(tmp_path / "1.gguf", base, targets=["attn_q"]).read_bytes()
    assert write_lora(tmp_path / "2.gguf", base, targets=["attn_q"]).read_bytes() == one
    assert write_lora(tmp_path / "3.gguf", base, targets=["attn_q"], seed=2).read_bytes() != one
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "1.gguf")).tensors}
    assert names == {f"blk.{i}.attn_q.weight.lora_{ab}" for i in (0, 1) for ab in "ab"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.gguf", "2.gguf", "3.gguf"]


def test_an_unknown_target_names_the_matrices_there_are(tmp_path: Path, base: Path) -> None:
    with pytest.raises(
        ValueError, match=r"target 'attn_qkv': no matrix attn_qkv.weight in .*attn_q, "
    ):
        write_lora(tmp_path / "a.gguf", base, targets=["attn_qkv"])
    with pytest.raises(ValueError, match="target 'token_embd': its LoRA layout differs"):
        write_lora(tmp_path / "a.gguf", base, targets=["token_embd"])
    with pytest.raises(ValueError, match="rank 0: a LoRA rank is at least 1"):
        write_lora(tmp_path / "a.gguf", base, rank=0)
    with pytest.raises(ValueError, match=r"base .* is one part of a split model \(2 parts\)"):
        write_lora(tmp_path / "a.gguf", tiny_gguf.write(tmp_path / "s" / "t.gguf", parts=2))
    assert not (tmp_path / "a.gguf").exists()
