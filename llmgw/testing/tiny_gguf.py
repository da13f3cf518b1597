"""A tiny llama model that a real llama-server loads: random weights, small vocabulary.

For tests and the demo, which cannot download weights. The text it writes is
gibberish, which is fine: what is tested is everything around the model.
`python -m llmgw.testing.tiny_gguf PATH [PARTS]` writes one (a few hundred KB),
split into PARTS files beside PATH as llama.cpp's gguf-split names them.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "N_CTX",
    "N_EMBD",
    "N_FF",
    "N_HEAD",
    "N_LAYER",
    "WORDS",
    "split_names",
    "write",
]

N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX = 2048
WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "was",
    "he",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "from",
    "have",
    "or",
    "by",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "hello",
    "world",
    "fleet",
    "node",
    "engine",
    "model",
    "token",
    "llama",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def write(
    path: Path,
    *,
    parts: int = 1,
    seed: int = 0,
    n_embd: int = N_EMBD,
    n_layer: int = N_LAYER,
    n_ff: int = N_FF,
    n_head: int = N_HEAD,
    n_ctx: int = N_CTX,
    f16: bool = False,
) -> Path:
    """Write the model to `path` (replacing it) and return the path.

    The defaults make a model of a few hundred KB that loads in a blink; a benchmark
    that needs prefill to take noticeable time passes larger sizes (bench/routing.py:
    n_embd 512, 4 layers). `f16` stores the matrices as F16 (norms stay F32).

    `parts` > 1 splits the model as llama.cpp's gguf-split does and returns the
    first part: `path` names the set (`tiny.gguf`), the parts are written beside
    it as `tiny-00001-of-00002.gguf`, ... (no file is written at `path` itself).
    Each part is a whole GGUF with `split.no` (u16, from 0), `split.count` (u16)
    and `split.tensors.count` (i32, the tensors of all parts); the model's other
    metadata is in the first part only. llama-server is given the first part and
    finds the rest beside it."""
    import gguf
    import numpy as np

    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
    n_tensors = 3 + 9 * n_layer

    # gguf's writer splits by tensor count: ceil(tensors / parts) a part, which makes
    # exactly `parts` parts for most counts (21 tensors: not 8, 9, 10 or 12 to 20).
    def made(p: int) -> int:
        return -(-n_tensors // -(-n_tensors // p))

    per_part = -(-n_tensors // parts) if parts >= 1 else 0
    if parts < 1 or made(parts) != parts:
        can = [p for p in range(1, n_tensors + 1) if made(p) == p]
        raise ValueError(
            f"parts {parts}: the model's {n_tensors} tensors split by count into one of {can}"
        )

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["\u2581" + w for w in WORDS] + list("abcdefghijklmnopqrstuvwxyz")
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    n_vocab = len(tokens)

    path.parent.mkdir(parents=True, exist_ok=True)
    names = [path] if parts == 1 else split_names(path, parts)
    # Written under names no reader takes for the model (a dot, a .partial), renamed whole.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        tmp = tmp_dir / path.name
        writer = gguf.GGUFWriter(str(tmp), "llama", split_max_tensors=0 if parts == 1 else per_part)
        writer.add_name("llmgw-tiny-llama")
        writer.add_context_length(n_ctx)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(n_layer)
        writer.add_feed_forward_length(n_ff)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head)
        writer.add_rope_dimension_count(n_embd // n_head)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_file_type(1 if f16 else 0)  # mostly F16, or all F32
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_chat_template(CHAT_TEMPLATE)

        def weight(*shape: int) -> Any:
            w = rng.standard_normal(shape) * 0.02
            return w.astype(np.float16 if f16 else np.float32)

        ones = np.ones(n_embd, dtype=np.float32)
        writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
        for i in range(n_layer):
            writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                writer.add_tensor(f"blk.{i}.{name}.weight", weight(n_embd, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
            writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
        writer.add_tensor("output_norm.weight", ones)
        writer.add_tensor("output.weight", weight(n_vocab, n_embd))
        written = [f.name for f in writer.format_shard_names(tmp)]
        if written != [n.name for n in names]:  # a gguf release that splits otherwise
            raise RuntimeError(f"gguf would write {written}, not the {parts} parts {names}")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        # Never visible half-written under its final name; the first part (what an
        # engine is given) last, so a part that is there has its rest beside it.
        for part in reversed(names):
            (tmp_dir / part.name).replace(part)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return names[0]


def split_names(path: Path, parts: int) -> list[Path]:
    """The names gguf-split gives the parts of `path` (`x.gguf`): `x-00001-of-00002.gguf`, ..."""
    return [path.with_name(f"{path.stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and not sys.argv[2].isdigit()):
        print("usage: python -m llmgw.testing.tiny_gguf PATH [PARTS]", file=sys.stderr)
        sys.exit(2)
    print(write(Path(sys.argv[1]), parts=int(sys.argv[2]) if len(sys.argv) == 3 else 1))
