"""Which engines the agent asks for a token (llmgw/engines/_probe.py)."""

from __future__ import annotations

import json

import pytest

from llmgw.engines import generates, probe_body


@pytest.mark.parametrize(
    ("engine", "argv", "expected"),
    [
        ("llama-server", ["-m", "x.gguf", "--port", "8000"], True),
        ("llama-server", ["-m", "x.gguf", "--embedding"], False),
        ("llama-server", ["-m", "x.gguf", "--embeddings"], False),
        ("vllm", ["serve", "m"], True),
        ("vllm", ["serve", "m", "--task", "generate"], True),
        ("vllm", ["serve", "m", "--task", "embed"], False),
        ("vllm", ["serve", "m", "--task=embed"], False),
        ("vllm", ["serve", "m", "--runner", "pooling"], False),
        ("vllm", ["serve", "m", "--runner=generate"], True),
        ("vllm", ["serve", "m", "--convert", "embed"], False),
        ("vllm", ["serve", "m", "--task"], True),  # no value: the engine refuses it, not us
        ("sglang", ["--model-path", "m"], True),
        ("sglang", ["--model-path", "m", "--is-embedding"], False),
        ("other", ["--embedding"], True),
    ],
)
def test_embedding_only_engines_are_not_probed(
    engine: str, argv: list[str], expected: bool
) -> None:
    assert generates(engine, argv) is expected


def test_the_probe_asks_one_token_of_a_served_name() -> None:
    body = json.loads(probe_body("chat"))
    assert body == {"model": "chat", "prompt": "a", "max_tokens": 1, "temperature": 0}
