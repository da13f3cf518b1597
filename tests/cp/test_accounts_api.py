"""Tenants, keys with expiry, usage and the audit log through the admin API
(llmgw/cp/_admin/_tenants.py and _logs.py), on the store (llmgw/store) over SQLite
and a real PostgreSQL started here."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import asgi_call as call
from helpers import postgres_server, register

from llmgw import core
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.keys import TenantLimits, UsageRow, digest
from llmgw.router._keys import CachedKeys, StoreKeys
from llmgw.store import SqlStore, open_store

BANDS = {"interactive": 0, "batch": 1}


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    with postgres_server() as dsn:
        yield dsn


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqlStore]:
    if request.param == "sqlite":
        where = str(tmp_path / "state")
    else:
        import psycopg

        where = request.getfixturevalue("pg_dsn")
        with psycopg.connect(where, autocommit=True) as conn:  # an empty database per test
            conn.execute("DROP SCHEMA public CASCADE")
            conn.execute("CREATE SCHEMA public")
    s = await open_store(where, timeout_s=10)
    try:
        yield s
    finally:
        await s.aclose()


def make_app(store: SqlStore, registry: NodeRegistry | None = None) -> AdminApp:
    registry = registry or NodeRegistry(core.LivenessPolicy())
    keys = CachedKeys(StoreKeys(store))
    return AdminApp(registry, "key", keys=keys, store=store, bands=BANDS)


def message(reply: tuple[int, dict[str, Any]]) -> tuple[int, str]:
    status, body = reply
    return status, str(body["error"]["message"])


async def test_tenants_are_created_changed_and_deleted_with_clear_refusals(
    store: SqlStore,
) -> None:
    app = make_app(store)
    status, body = await call(app, "POST", "/api/v1/tenants", {"name": "acme", "rpm": 60})
    assert status == 201
    assert body["tenant"] == {"name": "acme", "rpm": 60, "tpm": None, "max_band": None,
                              "created_at": body["tenant"]["created_at"], "keys": 0}  # fmt: skip
    assert message(await call(app, "POST", "/api/v1/tenants", {"name": "acme"})) == (
        409, "tenant acme exists; change its limits with `llmgw ctl tenants set acme`")  # fmt: skip
    assert message(
        await call(app, "POST", "/api/v1/tenants", {"name": "b", "max_band": "gold"})
    ) == (400, "max_band: no band 'gold'; the router's bands are interactive, batch")
    status, text = message(
        await call(app, "POST", "/api/v1/tenants", {"name": "c", "rpm": -1, "tpm": "9"})
    )
    assert status == 400
    assert (
        text
        == "rpm: expected a count >= 0 or null, got -1; tpm: expected a count >= 0 or null, got '9'"
    )
    assert message(await call(app, "POST", "/api/v1/tenants", {"name": "a b"}))[0] == 400

    # PATCH changes what it names and leaves the rest; null lifts a limit.
    status, body = await call(
        app, "PATCH", "/api/v1/tenants/acme", {"rpm": None, "tpm": 1000, "max_band": "batch"}
    )
    assert (status, body["tenant"]["rpm"], body["tenant"]["tpm"]) == (200, None, 1000)
    status, body = await call(app, "PATCH", "/api/v1/tenants/acme", {"rpm": 5})
    assert (body["tenant"]["rpm"], body["tenant"]["tpm"], body["tenant"]["max_band"]) == (
        5, 1000, "batch")  # fmt: skip
    assert message(await call(app, "PATCH", "/api/v1/tenants/nope", {"rpm": 5})) == (
        404, "no tenant 'nope'")  # fmt: skip

    # The router reads the tenant's limits with each key.
    status, made = await call(
        app, "POST", "/api/v1/keys", {"tenant": "acme", "default_band": "batch"}
    )
    assert status == 201 and made["tenant_created"] is False
    looked = await store.lookup_key(digest(made["secret"]))
    assert looked is not None and looked.limits == TenantLimits(rpm=5, tpm=1000, max_band="batch")
    status, body = await call(app, "GET", "/api/v1/tenants")
    assert [(t["name"], t["keys"]) for t in body["tenants"]] == [("acme", 1)]

    # Deleting is refused while a key is not revoked, naming how many.
    key_id = made["key"]["key_id"]
    assert message(await call(app, "DELETE", "/api/v1/tenants/acme")) == (
        409, f"tenant acme has 1 unrevoked key ({key_id}); revoke them first "
        "(llmgw ctl keys revoke KEY)")  # fmt: skip
    assert (await call(app, "DELETE", f"/api/v1/keys/{key_id}"))[0] == 200
    assert await call(app, "DELETE", "/api/v1/tenants/acme") == (200, {"deleted": "acme"})
    assert message(await call(app, "GET", "/api/v1/tenants/acme")) == (404, "no tenant 'acme'")
    assert await store.get_account("acme") is None


async def test_keys_expire_and_ask_no_more_than_their_tenant_may(store: SqlStore) -> None:
    from router.conftest import serve_router

    app = make_app(store)
    assert (await call(app, "POST", "/api/v1/tenants", {"name": "low", "max_band": "batch"}))[
        0
    ] == 201
    assert message(
        await call(app, "POST", "/api/v1/keys", {"tenant": "low", "max_band": "interactive"})
    ) == (400, "max_band 'interactive' is above tenant low's highest band 'batch'; ask for "
               "'batch' or lower, or raise the tenant's (llmgw ctl tenants set low "
               "--max-band ...)")  # fmt: skip
    # A key that asks nothing gets at most its tenant's highest band.
    status, made = await call(app, "POST", "/api/v1/keys", {"tenant": "low"})
    assert status == 201
    assert (made["key"]["default_band"], made["key"]["max_band"]) == ("interactive", "batch")
    assert message(await call(app, "POST", "/api/v1/keys", {"tenant": "low", "default_band": "x"}))[1] == (
        "default_band: no band 'x'; the router's bands are interactive, batch")  # fmt: skip
    past = time.time() - 10
    status, text = message(
        await call(app, "POST", "/api/v1/keys", {"tenant": "low", "expires_at": past})
    )
    assert status == 400 and text.startswith(f"expires_at: {past!r} is not a time in the future")

    # A key for a tenant with no account makes one, with no limits, and says so.
    soon = time.time() + 3600
    status, fresh = await call(app, "POST", "/api/v1/keys", {"tenant": "new", "expires_at": soon})
    assert (status, fresh["tenant_created"]) == (201, True)
    assert fresh["key"]["expires_at"] == pytest.approx(soon)
    account = await store.get_account("new")
    assert account is not None and (account.rpm, account.tpm, account.max_band) == (None,) * 3

    # An expired key: listed as expired, and refused by the router (StoreKeys behind it).
    gone, gone_secret = await store.create_key(tenant="new", expires_at=time.time() - 1)
    status, listed = await call(app, "GET", "/api/v1/keys")
    states = {k["key_id"]: (k["state"], k["expires_at"]) for k in listed["keys"]}
    assert states[gone.key_id][0] == "expired"
    assert states[fresh["key"]["key_id"]] == ("active", pytest.approx(soon))
    assert states[made["key"]["key_id"]] == ("active", None)
    body = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    async with serve_router([], keys=StoreKeys(store)) as r, httpx.AsyncClient(timeout=30) as h:
        url = r.base_url + "/chat/completions"
        refused = await h.post(url, headers={"Authorization": f"Bearer {gone_secret}"}, json=body)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        # The unexpired key passes authentication (and finds no model here).
        auth = {"Authorization": f"Bearer {fresh['secret']}"}
        assert (await h.post(url, headers=auth, json=body)).status_code == 404


async def test_operator_actions_are_saved_before_the_answer_and_audited(store: SqlStore) -> None:
    registry = NodeRegistry(core.LivenessPolicy())
    await registry.load_state(store)
    await register(registry, "n1")
    app = make_app(store, registry)
    assert await call(app, "POST", "/api/v1/nodes/n1/cordon", {"reason": "fan"}) == (
        200, {"cordoned": "n1"})  # fmt: skip
    # In the store already: no writer task runs here, the handler wrote it.
    assert [(o.node_id, o.kind, o.reason) for o in await store.overrides()] == [
        ("n1", "cordon", "fan")]  # fmt: skip
    assert (await call(app, "POST", "/api/v1/nodes/n1/drain", {}))[0] == 200
    assert [(o.kind, o.reason) for o in await store.overrides()] == [
        ("drain", "drained by an operator")]  # fmt: skip
    assert (await call(app, "DELETE", "/api/v1/nodes/n1/cordon"))[0] == 200
    assert await store.overrides() == []
    assert (await call(app, "POST", "/api/v1/tenants", {"name": "acme", "tpm": 10}))[0] == 201
    assert (await call(app, "PATCH", "/api/v1/tenants/acme", {"tpm": None}))[0] == 200
    status, made = await call(app, "POST", "/api/v1/keys", {"tenant": "acme"})
    key_id = made["key"]["key_id"]
    assert (await call(app, "DELETE", f"/api/v1/keys/{key_id}"))[0] == 200
    assert (await call(app, "DELETE", "/api/v1/tenants/acme"))[0] == 200

    status, body = await call(app, "GET", "/api/v1/audit?limit=20")
    assert status == 200
    assert [(e["actor"], e["action"], e["detail"]) for e in reversed(body["entries"])] == [
        ("admin", "cordon", "n1: fan"),
        ("admin", "drain", "n1: drained by an operator"),
        ("admin", "uncordon", "n1: lifted cordon, drain"),
        ("admin", "tenant create", "acme: rpm none, tpm 10, max_band none"),
        ("admin", "tenant set", "acme: rpm none, tpm none, max_band none"),
        ("admin", "key create", f"{key_id} for tenant acme; never expires"),
        ("admin", "key revoke", key_id),
        ("admin", "tenant delete", "acme"),
    ]
    assert [e["seq"] for e in body["entries"]] == sorted(
        (e["seq"] for e in body["entries"]), reverse=True
    )
    assert len((await call(app, "GET", "/api/v1/audit?limit=2"))[1]["entries"]) == 2
    assert (await call(app, "GET", "/api/v1/audit?limit=0"))[0] == 400


async def test_usage_rows_and_totals_by_tenant_and_since(store: SqlStore) -> None:
    app = make_app(store)
    hour = int(time.time()) // 3600 * 3600
    await store.add_usage(
        [
            UsageRow(hour, "acme", "key-a", "chat", 3, 30, 12),
            UsageRow(hour, "beta", "key-b", "chat", 1, 5, 2),
            UsageRow(hour - 10 * 86400, "acme", "key-a", "chat", 7, 70, 7),  # 10 days ago
        ]
    )
    status, body = await call(app, "GET", "/api/v1/usage?tenant=acme")  # default: 7 days
    assert status == 200
    assert body == {
        "rows": [{"hour": hour, "tenant": "acme", "key_id": "key-a", "model": "chat",
                  "requests": 3, "prompt_tokens": 30, "completion_tokens": 12}],
        "totals": {"requests": 3, "prompt_tokens": 30, "completion_tokens": 12},
    }  # fmt: skip
    status, body = await call(app, "GET", f"/api/v1/usage?since={30 * 86400}")
    assert body["totals"] == {"requests": 11, "prompt_tokens": 105, "completion_tokens": 21}
    status, body = await call(app, "GET", f"/api/v1/usage?since={hour}")  # an epoch time
    assert [r["tenant"] for r in body["rows"]] == ["acme", "beta"]
    assert message(await call(app, "GET", "/api/v1/usage?since=-5"))[0] == 400
