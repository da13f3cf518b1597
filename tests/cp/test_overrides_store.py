"""Operator overrides and known nodes live in the store (llmgw/cp/_fleet/_registry.py), and what an
older llmgw-cp kept in files is imported into it once (llmgw/cp/_legacy.py)."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from pathlib import Path

import attrs
import httpx
import pytest
from router.test_keys import write_old_keys_db

from llmgw.cp._legacy import import_legacy
from llmgw.errors import ConfigError
from llmgw.keys import new_key
from llmgw.store import SQLITE_FILE, open_store
from llmgw.testing.cluster import LocalCluster, wait_for


def rows(state_dir: Path, sql: str) -> list[tuple[object, ...]]:
    """The store's SQLite file, read beside the running control plane (WAL)."""
    with contextlib.closing(sqlite3.connect(state_dir / SQLITE_FILE)) as db:
        return list(db.execute(sql).fetchall())


def node_row(cluster: LocalCluster, node: str) -> str | None:
    table = cluster.ctl("nodes").stdout.splitlines()
    return next((line for line in table if line.split()[0] == node), None)


@pytest.mark.slow
def test_cordon_drain_and_forget_survive_a_killed_control_plane(cluster: LocalCluster) -> None:
    nodes = ["n1", "n2", "n3"]
    cluster.setup(nodes)
    cluster.start_cp()
    for node in nodes:
        cluster.start_agent(node)
    cluster.wait_states(dict.fromkeys(nodes, "ready"), timeout=30)
    cluster.ctl("cordon", "n1", "--reason", "bad fan")
    cluster.ctl("drain", "n2", "--reason", "kernel update")
    cluster.agents["n3"].terminate()
    wait_for("n3 not connected", lambda: cluster.states()["n3"] != "ready", 30)
    cluster.ctl("nodes", "forget", "n3")
    # Written before each answer: a control plane killed at once loses none of it.
    assert cluster.cp is not None
    cluster.cp.kill9()
    state = cluster.root / "cp"
    assert rows(state, "SELECT node_id, kind, reason FROM node_overrides ORDER BY node_id") == [
        ("n1", "cordon", "bad fan"),
        ("n2", "drain", "kernel update"),
    ]
    assert rows(state, "SELECT node_id FROM known_nodes ORDER BY node_id") == [("n1",), ("n2",)]
    cluster.start_cp()
    cluster.wait_states({"n1": "ready", "n2": "ready"}, timeout=30)
    assert "ready,cordoned" in (node_row(cluster, "n1") or "")
    assert "ready,drained" in (node_row(cluster, "n2") or "")  # nothing runs there
    nodes_now = cluster.nodes()
    assert (nodes_now["n1"]["cordoned"], nodes_now["n2"]["draining"]) == (
        "bad fan",
        "kernel update",
    )
    assert "n3" not in nodes_now
    audit = json.loads(cluster.ctl("audit", "--json").stdout)["entries"]
    assert [e["action"] for e in reversed(audit)] == ["cordon", "drain", "forget"]
    cluster.ctl("uncordon", "n1")
    assert rows(state, "SELECT node_id FROM node_overrides ORDER BY node_id") == [("n2",)]


def write_legacy(state_dir: Path) -> tuple[str, str, str]:
    """The three files an llmgw-cp before the store kept; (live key id, its secret, revoked
    key id)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "overrides.json").write_text(
        json.dumps({"cordoned": {"old-1": "bad disk"}, "draining": {"old-2": "retire"}})
    )
    (state_dir / "known_nodes.json").write_text(json.dumps({"nodes": ["old-1", "old-2"]}))

    live, secret = new_key(tenant="acme", models=["chat"], name="ci")
    gone, gone_secret = new_key(tenant="beta")
    # keys.sqlite was the router's SqliteKeyStore file, written here as it wrote it.
    write_old_keys_db(
        state_dir / "keys.sqlite", [(live, secret), (attrs.evolve(gone, revoked=True), gone_secret)]
    )
    return live.key_id, secret, gone.key_id


@pytest.mark.slow
def test_the_files_of_an_older_control_plane_are_imported_once(cluster: LocalCluster) -> None:
    cluster.setup([])
    state = cluster.root / "cp"
    live, secret, gone = write_legacy(state)
    cluster.start_cp()
    assert cluster.cp is not None
    log = cluster.cp.output()
    assert "1 cordoned, 1 draining" in log and "2 known nodes" in log
    assert "2 API keys (1 revoked), 2 tenants without limits" in log
    for name in ("overrides.json", "known_nodes.json", "keys.sqlite"):
        assert not (state / name).exists() and (state / f"{name}.imported").exists()
    keys = {
        k["key_id"]: k for k in json.loads(cluster.ctl("keys", "list", "--json").stdout)["keys"]
    }
    assert (keys[live]["state"], keys[live]["tenant"], keys[live]["models"]) == (
        "active",
        "acme",
        ["chat"],
    )
    assert (keys[gone]["state"], keys[gone]["tenant"]) == ("revoked", "beta")
    tenants = json.loads(cluster.ctl("tenants", "list", "--json").stdout)["tenants"]
    assert [(t["name"], t["rpm"], t["tpm"], t["max_band"]) for t in tenants] == [
        ("acme", None, None, None),
        ("beta", None, None, None),
    ]
    assert rows(state, "SELECT node_id, kind FROM node_overrides ORDER BY node_id") == [
        ("old-1", "cordon"),
        ("old-2", "drain"),
    ]
    assert rows(state, "SELECT node_id FROM known_nodes ORDER BY node_id") == [
        ("old-1",),
        ("old-2",),
    ]
    # The old secret still works: the router knows it (no model here, so 404, not 401).
    body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    auth = {"Authorization": f"Bearer {secret}"}
    answer = httpx.post(cluster.router_url + "/chat/completions", json=body, headers=auth)
    assert answer.status_code == 404, answer.text
    # A second start imports nothing again (the log is appended to: count the lines).
    imported = cluster.cp.output().count("imported ")
    cluster.cp.terminate()
    cluster.start_cp()
    assert cluster.cp.output().count("imported ") == imported
    assert len(json.loads(cluster.ctl("keys", "list", "--json").stdout)["keys"]) == 2


async def test_an_unreadable_old_file_stops_the_start_naming_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    store = await open_store(state)
    try:
        (state / "known_nodes.json").write_text('["a"]')
        with pytest.raises(
            ConfigError, match=re.escape('known_nodes.json: expected {"nodes": [node ids')
        ):
            await import_legacy(state, store)
        (state / "known_nodes.json").unlink()
        (state / "keys.sqlite").write_text("not a database")
        with pytest.raises(ConfigError, match=re.escape("keys.sqlite: unreadable key file")):
            await import_legacy(state, store)
        (state / "keys.sqlite").unlink()
        (state / "overrides.json").write_text("{")
        with pytest.raises(
            ConfigError, match=re.escape("overrides.json: unreadable node overrides")
        ):
            await import_legacy(state, store)
        assert (state / "overrides.json").exists()  # left where it is for the operator
        assert await store.overrides() == [] and await store.known_nodes() == []
    finally:
        await store.aclose()


async def test_a_store_that_has_rows_already_takes_none_from_an_old_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = await open_store(state)
    try:
        await store.set_override("new", "cordon", "mine")
        await store.remember_node("new", "10.0.0.1:5000")
        (state / "overrides.json").write_text(json.dumps({"cordoned": {"old": "x"}}))
        (state / "known_nodes.json").write_text(json.dumps({"nodes": ["old"]}))
        lines = await import_legacy(state, store)
        assert [o.node_id for o in await store.overrides()] == ["new"]
        assert [k.node_id for k in await store.known_nodes()] == ["new"]
        assert len(lines) == 2 and all("not imported, the store already has" in x for x in lines)
        assert (state / "overrides.json.imported").exists()
    finally:
        await store.aclose()
