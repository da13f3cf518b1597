"""Query values from a hostile client: a number is a number, or a clear 400 or the
default, never a 500 (str.isdigit() is true of "²", which int() refuses)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from helpers import asgi_call, register

from llmgw import core
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._registry import NodeRegistry


class LogsAgent:
    """A connected agent that answers log reads, recording how many lines were asked."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.asked: list[tuple[str, float]] = []

    def release(self) -> None:
        pass

    def deadline_of(self, call: str) -> float:
        return 10.0

    async def logs(self, source: str, lines: int) -> list[Any]:
        self.asked.append((source, lines))
        return []

    async def stop_shard(self, epoch: int, shard: str, grace: float) -> None:
        self.asked.append((f"stop {shard}", grace))


@pytest.mark.parametrize("hostile", ["²", "١٢", "-1", "1e3", " 5", "99999999999999999999999"])
async def test_a_number_in_the_query_is_a_number_or_a_clear_400_never_a_500(hostile: str) -> None:
    """ "²" and Arabic-Indic digits pass str.isdigit() but not int(): they are refused,
    or read as the default, like any other value that is not a whole number."""
    registry = NodeRegistry(core.LivenessPolicy())
    admin = AdminApp(registry, "key")
    agent = LogsAgent("n1")
    await register(registry, "n1", agent=agent)  # type: ignore[arg-type]
    q = quote(hostile)
    for path in (f"/api/v1/events?limit={q}", f"/api/v1/audit?limit={q}"):
        status, body = await asgi_call(admin, "GET", path)
        assert status in (400, 404), (path, body)  # audit: 404, this app keeps no store
        if "events" in path:
            assert body["error"]["message"].startswith("limit: expected a whole number")
    for path in (f"/api/v1/nodes/n1/logs?lines={q}", f"/api/v1/nodes/n1/shards/s1/logs?lines={q}"):
        status, body = await asgi_call(admin, "GET", path)
        assert status == 200, (path, body)
    # Not numbers: each read gets its default (100, 40); the huge one is bounded.
    huge = hostile.isascii() and hostile.isdigit()
    assert [n for _, n in agent.asked] == ([2000, 2000] if huge else [100, 40])


async def test_a_stops_grace_is_seconds_from_0_to_an_hour_and_nothing_else() -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    admin = AdminApp(registry, "key")
    agent = LogsAgent("n1")
    await register(registry, "n1", agent=agent)  # type: ignore[arg-type]
    for hostile in ("nan", "inf", "-1", "x", "3601", "1e400"):
        status, body = await asgi_call(
            admin, "DELETE", f"/api/v1/nodes/n1/shards/s1?grace={hostile}"
        )
        assert status == 400, (hostile, body)
        assert body["error"]["message"].startswith("grace: expected seconds from 0 to 3600")
    assert agent.asked == []  # nothing reached the agent
    status, body = await asgi_call(admin, "DELETE", "/api/v1/nodes/n1/shards/s1?grace=2.5")
    assert (status, body, agent.asked) == (200, {"stopped": "s1"}, [("stop s1", 2.5)])
