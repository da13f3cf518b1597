"""Which engine's stream is asked for its usage event on a client's behalf (the table)."""

from __future__ import annotations

import pathlib

import pytest

from llmgw.core import METERED_STREAM_ROUTES, StreamMetering, stream_metering

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(
    ("engine", "path", "expected"),
    [
        # llama-server says its tokens unasked (`timings`, or completions' `usage`).
        ("llama-server", CHAT, StreamMetering(ask=False, nulls=False)),
        ("llama-server", COMPLETIONS, StreamMetering(ask=False, nulls=False)),
        # vLLM says nothing unasked; asked, its chat chunks get `"usage":null`
        # (0.5.3-0.6), its completions chunks have it asked or not.
        ("vllm", CHAT, StreamMetering(ask=True, nulls=True)),
        ("vllm", COMPLETIONS, StreamMetering(ask=True, nulls=False)),
        ("sglang", CHAT, StreamMetering(ask=True, nulls=False)),
        ("sglang", COMPLETIONS, StreamMetering(ask=True, nulls=False)),
        # An engine not known: asked (the only way to be sure of a count).
        ("other", CHAT, StreamMetering(ask=True, nulls=False)),
        # Routes whose streams always say (Anthropic's, Responses) are never asked.
        ("vllm", "/v1/messages", StreamMetering(ask=False, nulls=False)),
        ("sglang", "/v1/responses", StreamMetering(ask=False, nulls=False)),
    ],
)
def test_the_table(engine: str, path: str, expected: StreamMetering) -> None:
    assert stream_metering(engine, path) == expected


def test_the_metered_routes_are_openais_chat_and_completions() -> None:
    assert {CHAT, COMPLETIONS} == METERED_STREAM_ROUTES


def test_the_table_is_pure() -> None:
    source = (pathlib.Path(__file__).parents[2] / "llmgw/core/_metering.py").read_text()
    for name in ("trio", "capnp", "httpx", "h11", "socket", "os", "pathlib"):
        assert f"import {name}" not in source and f"from {name}" not in source
