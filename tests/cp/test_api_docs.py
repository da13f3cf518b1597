"""docs/api.md has one section per admin API route, and no section for a route that
does not exist.

The routes are read from the real app: its route table, and the paths its
`__call__` answers before the table (`GET /api/v1/leader`). Each route is asked
for once, so the test also shows that a documented route is answered, not 404.
"""

from __future__ import annotations

import json
import re

import pytest
import trio
from helpers import REPO, asgi_call

from llmgw import core
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._registry import NodeRegistry

DOC = REPO / "docs" / "api.md"
HEADING = re.compile(r"^### `(GET|POST|PUT|PATCH|DELETE) (/api/v1/[^`\s]*)`$", re.M)


def template(pattern: re.Pattern[str]) -> str:
    """`^/api/v1/nodes/(?P<node>[^/]+)$` -> `/api/v1/nodes/{node}`."""
    text = pattern.pattern.removeprefix("^").removesuffix("$")
    return re.sub(r"\(\?P<([a-z_]+)>\[\^/\]\+\)", r"{\1}", text)


def app() -> AdminApp:
    return AdminApp(NodeRegistry(core.LivenessPolicy()), "key")


def served() -> set[tuple[str, str]]:
    routes = {(method, template(pattern)) for method, pattern, _ in app()._routes}
    return routes | {("GET", "/api/v1/leader")}


def test_every_route_has_its_section_and_every_section_its_route() -> None:
    documented = HEADING.findall(DOC.read_text())
    assert len(documented) == len(set(documented)), "a route documented twice"
    assert served() - set(documented) == set(), "routes docs/api.md leaves out"
    assert set(documented) - served() == set(), "sections for routes that do not exist"


@pytest.mark.parametrize(("method", "path"), sorted(HEADING.findall(DOC.read_text())))
async def test_a_documented_route_is_answered_not_404_as_unknown(method: str, path: str) -> None:
    concrete = re.sub(r"\{[a-z_]+\}", "x", path)
    with trio.fail_after(10):
        status, body = await asgi_call(app(), method, concrete, {} if method != "GET" else None)
    # A 404 may say that node x is unknown, never that the route is.
    assert "no such API route" not in json.dumps(body), (status, body)
