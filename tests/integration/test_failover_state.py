"""What survives a failover: the event log and the admin pages' sessions (issue 24).

Real processes on loopback: a PostgreSQL started for the test, two llmgw-cp sharing it
(`store:`), two llmgw-agent listing both. The leader records its events (each node's
registration) and a login on its pages; it is killed with SIGKILL; the standby takes
over. `ctl events` on the new leader then lists the events recorded before, as the old
leader recorded them (same times, same words), and the page session made on the old
leader is still logged in on the new one, and after a restart of the old one; a logout
on either ends it on both. The node page on the new leader says since when it holds
history rather than drawing an hour that reads as idle.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import postgres_server

from llmgw.cp._pages import COOKIE
from llmgw.testing.cluster import ControlPlane, LocalCluster, wait_for

LEASE_S = 3.0
NODES = ("s1", "s2")


@pytest.fixture
def pg() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


def stored_events(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT COUNT(*) FROM events").fetchone()
    return int(row[0]) if row else 0


# events and states are polled, so they are read over HTTP: the admin API's answers, which
# `ctl events --limit 1000 --json` and `ctl nodes --json` print as is (a ctl process per
# poll is ~0.4 s of CPU on the suite's two cores). `ctl events` itself is read below.
def events(cp: ControlPlane) -> list[dict[str, Any]]:
    return list(cp.api_get("/api/v1/events?limit=1000")["events"])


def registrations(evs: list[dict[str, Any]]) -> list[tuple[float, str]]:
    return [(e["at"], e["message"]) for e in evs if "registered from" in e["message"]]


def states(cp: ControlPlane) -> dict[str, str]:
    nodes = cp.api_get("/api/v1/nodes")["nodes"]
    return {n["node_id"]: n["state"] for n in nodes}


def login(cp: ControlPlane) -> httpx.Client:
    """A browser's session on `cp`'s pages: the login form posted with its admin key."""
    client = httpx.Client(base_url=cp.admin_url, timeout=30)
    r = client.post("/admin/login", data={"key": cp.admin_key})
    if r.status_code != 303 or r.headers.get("location") != "/admin/":
        client.close()
        raise AssertionError(f"login on {cp.name}: {r.status_code} {r.text[:500]}")
    assert client.cookies.get(COOKIE)
    return client


def page(cp: ControlPlane, cookie: str, path: str = "/admin/") -> httpx.Response:
    """`path` on `cp`'s pages with the session cookie only (another browser tab)."""
    with httpx.Client(base_url=cp.admin_url, timeout=30) as c:
        c.cookies.set(COOKIE, cookie, path="/admin")
        return c.get(path)


def csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, html[:2000]
    return found.group(1)


@pytest.mark.slow(seconds=20)
def test_events_and_page_sessions_survive_a_failover(pg: str, cluster: LocalCluster) -> None:
    cluster.server_extra.update(store=pg, lease_s=LEASE_S)
    cp1 = cluster.first
    cp2 = cluster.add_control_plane("cp2")
    cluster.setup(NODES)
    cluster.start_cp()
    wait_for("cp1 leading", lambda: cp1.leader()["role"] == "leader", 20)
    cluster.start_cp("cp2")
    wait_for("cp2 standing by", lambda: cp2.leader()["role"] == "standby", 20)
    for node in NODES:
        cluster.start_agent(node)
    cluster.wait_states({n: "ready" for n in NODES}, timeout=60)

    before = registrations(events(cp1))
    assert sorted(m.split(":")[0] for _, m in before) == [f"node {n}" for n in NODES], before
    # Written behind, within about half a second: wait until the store has them.
    wait_for("cp1's events in the store", lambda: stored_events(pg) >= len(before), 20)

    browser = login(cp1)
    try:
        cookie = browser.cookies[COOKIE]
        home = browser.get("/admin/")
    finally:
        browser.close()
    assert home.status_code == 200
    token = csrf(home.text)
    # The standby knows the session too (the store has it): not sent to the login form.
    on_standby = wait_for(
        "the session valid on cp2", lambda: (r := page(cp2, cookie)).status_code == 200 and r, 20
    )
    assert csrf(on_standby.text) == token

    assert cluster.cp is not None
    killed_at = time.time()
    cluster.cp.kill9()
    wait_for("cp2 leading", lambda: cp2.leader()["role"] == "leader", 30)
    wait_for("both agents ready on cp2", lambda: states(cp2) == dict.fromkeys(NODES, "ready"), 60)

    def with_old() -> list[dict[str, Any]] | None:
        evs = events(cp2)
        return evs if set(before) <= set(registrations(evs)) else None

    after = wait_for("cp1's events on cp2", with_old, 30)
    older = [(e["at"], e["message"]) for e in after if e["at"] < killed_at]
    assert set(before) <= set(older), (before, older)
    # And the agents' registrations with cp2, recorded by cp2 after the takeover.
    assert any(at > killed_at for at, _ in registrations(after)), after
    seqs = [e["seq"] for e in after]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    text = cp2.ctl("events").stdout
    for _, message in before:
        assert message in text, text

    # The session made on cp1 is still logged in on cp2, with the same CSRF token.
    r = page(cp2, cookie)
    assert r.status_code == 200 and csrf(r.text) == token
    # The node page: history only since the takeover, and it says so.
    node_page = page(cp2, cookie, f"/admin/nodes/{NODES[0]}").text
    note = re.search(r'data-field="history-since">([^<]*)<', node_page)
    assert note is not None, node_page[-3000:]
    assert "history since " in note.group(1) and "this control plane" in note.group(1)

    # cp1 restarted: a standby now, it reads the events and knows the session at start.
    cluster.start_cp()
    wait_for("cp1 standing by", lambda: cp1.leader()["role"] == "standby", 30)
    assert set(before) <= set(registrations(events(cp1)))
    assert page(cp1, cookie).status_code == 200

    # Logged out on cp2: ended on both (cp1 checks again within 5 s).
    with httpx.Client(base_url=cp2.admin_url, timeout=30) as c:
        c.cookies.set(COOKIE, cookie, path="/admin")
        out = c.post("/admin/logout", data={"csrf": token})
    assert (out.status_code, out.headers["location"]) == (303, "/admin/login")
    assert page(cp2, cookie).status_code == 303
    wait_for("the logout honoured on cp1", lambda: page(cp1, cookie).status_code == 303, 20)
    print(
        f"failover state: {len(before)} events of cp1 on cp2 after the SIGKILL "
        f"({len(after)} in all); the page session held on cp2 and on cp1 restarted"
    )
