"""The one-token generation the agent's readiness check sends, per engine: pure.

`/health` answering 200 says the engine's HTTP server runs, not that it can
generate: a wedged engine (a CUDA hang) answers it all the same. So a shard
that generates is also asked for one token before it is reported ready, and
then at a bounded rate (llmgw/agent/_health.py). All three engines serve the
OpenAI `POST /v1/completions` (llama-server: `max_tokens` or its own
`n_predict`; vLLM and SGLang need `model` to be a served name).

An embedding-only engine generates nothing and is not asked: llama-server
started with `--embedding`/`--embeddings` (it then refuses completions),
vLLM with `--task embed` / `--task=embed` (older), `--runner pooling` or
`--convert embed` (newer), SGLang with `--is-embedding`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

PROBE_PATH = "/v1/completions"
# Sent with the probe: engines ignore it; the fake engine counts probes apart by it.
PROBE_HEADER = b"x-llmgw-probe"

# engine -> (switches that make it embedding-only, {flag: values that do})
_EMBEDDING_FLAGS: dict[str, tuple[set[str], dict[str, set[str]]]] = {
    "llama-server": ({"--embedding", "--embeddings"}, {}),
    "vllm": (set(), {"--task": {"embed", "embedding", "classify", "score", "reward"},
                     "--runner": {"pooling"}, "--convert": {"embed", "classify", "reward"}}),
    "sglang": ({"--is-embedding"}, {}),
}  # fmt: skip


def generates(engine: str, argv: Sequence[str]) -> bool:
    """Whether an engine started with `argv` serves generation (False: embedding only)."""
    switches, valued = _EMBEDDING_FLAGS.get(engine, (set(), {}))
    args = list(argv)
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name in switches and not eq:
            return False
        if name in valued:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value in valued[name]:
                return False
    return True


def probe_body(served_name: str) -> bytes:
    """One token from a one-character prompt, not streamed."""
    body = {"model": served_name, "prompt": "a", "max_tokens": 1, "temperature": 0}
    return json.dumps(body).encode()
