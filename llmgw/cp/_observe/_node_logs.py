"""A node's logs on the admin listener: GET /api/v1/nodes/{node}/logs[?follow=1].

The tail comes from `Agent.logs` under its deadline (10 s by default); with
`follow=1` the answer is a stream of JSON lines (application/x-ndjson), one a
line, flushed as they come:

    {"source": "engine/stdout", "text": "..."}   a log line (the tail first)
    {"keepalive": true}                          the agent is there, nothing new
    {"end": "..."}                               the source ended (the shard is gone)
    {"error": "..."}                             the agent stopped answering, or failed

The stream ends after "end" or "error", or when the client goes away (the
sink then refuses the agent's next push, which ends its follower).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import trio

from llmgw import config, model
from llmgw.errors import DeadlineExceeded, PeerError
from llmgw.rpc import AgentHandle, LogStream
from llmgw.web.asgi import Receive, Send

DEFAULT_LINES = 100
MAX_LINES = 2000


def whole(raw: str) -> bool:
    """A query value int() takes as a whole number >= 0: ASCII digits only (str.isdigit
    is also true of "²", which int() refuses)."""
    return raw.isascii() and raw.isdigit()


def lines_of(query: dict[str, str], default: int = DEFAULT_LINES) -> int:
    """`lines=N`, bounded to 1..MAX_LINES; the default when absent or not a number."""
    raw = query.get("lines", "")
    return max(1, min(int(raw), MAX_LINES)) if whole(raw) else default


def silent(node: str, seconds: float) -> str:
    return f"node {node}: the agent did not answer in {seconds:g} s"


class Follow:
    """A streamed answer: `run` writes it; the follow's context is held until then."""

    def __init__(
        self,
        node: str,
        source: str,
        tail: list[model.LogLine],
        stream: LogStream,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        self.node, self.source, self.tail, self.stream = node, source, tail, stream
        self._stack = stack

    @classmethod
    async def open(cls, node: str, agent: AgentHandle, source: str, lines: int) -> Follow:
        stack = contextlib.AsyncExitStack()
        tail, stream = await stack.enter_async_context(agent.follow_logs(source, lines))
        return cls(node, source, tail, stream, stack)

    async def run(self, receive: Receive, send: Send) -> None:
        async with self._stack:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/x-ndjson"),
                        (b"cache-control", b"no-cache"),
                    ],
                }
            )

            async def write(obj: Any) -> None:
                body = (json.dumps(obj) + "\n").encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})

            async with trio.open_nursery() as nursery:

                async def client_gone() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(client_gone)
                try:
                    for line in self.tail:
                        await write(config.unstructure(line))
                    async for item in self.stream:
                        alive = {"keepalive": True}
                        await write(alive if item is None else config.unstructure(item))
                    await write({"end": f"node {self.node}: {self.source} ended (it is gone)"})
                except DeadlineExceeded:
                    await write({"error": silent(self.node, self.stream.silence_s)})
                except PeerError as exc:
                    await write({"error": f"node {self.node}: {exc}"})
                nursery.cancel_scope.cancel()
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
