"""The tiny model split as llama.cpp's gguf-split splits it, and the real llama-server loading it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import httpx
import pytest
from helpers import llama_server_binary

from llmgw.testing import tiny_gguf
from llmgw.testing.cluster import free_port, wait_for

SPLIT_KEYS = {
    "split.no": gguf.GGUFValueType.UINT16,
    "split.count": gguf.GGUFValueType.UINT16,
    "split.tensors.count": gguf.GGUFValueType.INT32,
}


def _split_fields(path: Path) -> tuple[dict[str, int], int, set[str]]:
    """(the split keys' values, the part's tensor count, every other key) of one part."""
    reader = gguf.GGUFReader(str(path))
    split = {}
    for key, kind in SPLIT_KEYS.items():
        field = reader.fields[key]
        assert field.types == [kind], (path.name, key, field.types)
        split[key] = int(field.contents())
    others = {k for k in reader.fields if k not in SPLIT_KEYS and not k.startswith("GGUF.")}
    return split, len(reader.tensors), others


@pytest.mark.parametrize("parts", [2, 3])
def test_parts_carry_gguf_splits_keys_and_names(tmp_path: Path, parts: int) -> None:
    first = tiny_gguf.write(tmp_path / "tiny.gguf", parts=parts)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"tiny-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)]
    assert first == tmp_path / names[0]
    read = [_split_fields(tmp_path / name) for name in names]
    whole = gguf.GGUFReader(str(tiny_gguf.write(tmp_path / "whole" / "tiny.gguf")))
    assert sum(n for _, n, _ in read) == len(whole.tensors) == 21
    for i, (split, n_tensors, others) in enumerate(read):
        assert split == {"split.no": i, "split.count": parts, "split.tensors.count": 21}
        assert n_tensors >= 1
        # The model's metadata in the first part only, as gguf-split writes it.
        assert ("general.architecture" in others) == (i == 0), (i, others)
    assert "llama.block_count" in read[0][2] and read[1][2] <= {"general.architecture"}


def test_a_count_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="parts 8: the model's 21 tensors split by count"):
        tiny_gguf.write(tmp_path / "tiny.gguf", parts=8)
    assert list(tmp_path.iterdir()) == []


def _serve(binary: str, model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*argv, "--ctx-size", "512", "--threads", "1", "--jinja"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_the_real_llama_server_loads_the_first_part_and_answers(tmp_path: Path) -> None:
    binary = llama_server_binary()
    first = tiny_gguf.write(tmp_path / "m" / "tiny.gguf", parts=2)
    proc, base = _serve(binary, first, tmp_path / "llama.log")
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "llama.log").read_text(errors="replace"))
            return httpx.get(base + "/health", timeout=5).status_code == 200

        wait_for("llama-server on the split model", healthy, 90)
        chat = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
def test_without_its_second_part_the_first_does_not_load(tmp_path: Path) -> None:
    binary = llama_server_binary()
    first = tiny_gguf.write(tmp_path / "m" / "tiny.gguf", parts=2)
    (tmp_path / "m" / "tiny-00002-of-00002.gguf").unlink()
    proc, _ = _serve(binary, first, tmp_path / "llama.log")
    try:
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "tiny-00002-of-00002.gguf" in (tmp_path / "llama.log").read_text(errors="replace")
