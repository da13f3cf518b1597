"""`llmgw ctl tenants`, `keys create --expires` and `usage` against a real llmgw-cp."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import trio

from llmgw.ctl._accounts import parse_duration, parse_expires
from llmgw.ctl._client import CtlError
from llmgw.keys import UsageRow
from llmgw.store import open_store
from llmgw.testing.cluster import LocalCluster


def test_spans_and_dates_for_expiry_and_since() -> None:
    now = 1_800_000_000.0
    assert parse_duration("90m", "--since") == 5400
    assert parse_duration("24h", "--since") == 86400
    assert parse_expires("30d", now=now) == now + 30 * 86400
    assert (
        parse_expires("2030-01-01", now=now)
        == datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC).timestamp()
    )
    assert (
        parse_expires("2030-01-01T12:00+02:00", now=now)
        == datetime.datetime(2030, 1, 1, 10, tzinfo=datetime.UTC).timestamp()
    )
    with pytest.raises(CtlError, match="'7w' is not a time span"):
        parse_duration("7w", "--since")
    with pytest.raises(CtlError, match="'soon' is neither a time span"):
        parse_expires("soon", now=now)
    with pytest.raises(CtlError, match="is not in the future"):
        parse_expires("2020-01-01", now=now)


def lines(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


@pytest.mark.slow
def test_tenants_and_keys_through_ctl(cluster: LocalCluster) -> None:
    cluster.setup([])
    cluster.start_cp()
    out = cluster.ctl("tenants", "create", "acme", "--rpm", "60", "--max-band", "batch").stdout
    assert lines(out) == [["TENANT", "RPM", "TPM", "MAX", "BAND", "KEYS"],
                          ["acme", "60", "-", "batch", "0"]]  # fmt: skip
    out = cluster.ctl("tenants", "set", "acme", "--rpm", "none", "--tpm", "500").stdout
    assert lines(out)[1] == ["acme", "-", "500", "batch", "0"]
    bad = cluster.ctl("tenants", "set", "acme", "--rpm", "many", check=False)
    assert (bad.returncode, bad.stderr.strip()) == (
        1, "llmgw ctl: --rpm: 'many' is not a count >= 0 or none")  # fmt: skip
    bad = cluster.ctl("tenants", "create", "acme", check=False)
    assert bad.returncode == 1 and "409: tenant acme exists" in bad.stderr

    # Keys: at most the tenant's band; an expiry as a span or a date.
    bad = cluster.ctl("keys", "create", "--tenant", "acme", "--max-band", "interactive",
                      check=False)  # fmt: skip
    assert bad.returncode == 1
    assert "max_band 'interactive' is above tenant acme's highest band 'batch'" in bad.stderr
    before = time.time()
    made = json.loads(
        cluster.ctl("keys", "create", "--tenant", "acme", "--expires", "30d", "--json").stdout
    )
    assert before + 30 * 86400 <= made["key"]["expires_at"] <= time.time() + 30 * 86400
    assert (made["key"]["max_band"], made["key"]["state"]) == ("batch", "active")
    out = cluster.ctl("keys", "create", "--tenant", "newco", "--expires", "2099-12-31").stdout
    assert out.splitlines()[0] == (
        "tenant newco did not exist: created with no limits "
        "(set some with `llmgw ctl tenants set newco`)"
    )
    assert "expires 2099-12-31 00:00 UTC" in out.splitlines()[1]
    newco_key = out.splitlines()[1].split()[1]
    cluster.ctl("keys", "revoke", newco_key)
    table = cluster.ctl("keys", "list").stdout.splitlines()
    assert table[0].split() == ["KEY", "TENANT", "MODELS", "BAND", "MAX", "BAND", "EXPIRES",
                                "STATE", "NAME"]  # fmt: skip
    rows = {line.split()[0]: line for line in table[1:]}
    assert "2099-12-31 00:00 UTC  revoked" in rows[newco_key]
    assert "  active" in rows[made["key"]["key_id"]]

    listed = json.loads(cluster.ctl("tenants", "list", "--json").stdout)["tenants"]
    assert [(t["name"], t["rpm"], t["tpm"], t["max_band"], t["keys"]) for t in listed] == [
        ("acme", None, 500, "batch", 1),
        ("newco", None, None, None, 0),
    ]
    bad = cluster.ctl("tenants", "delete", "acme", check=False)
    assert bad.returncode == 1 and "tenant acme has 1 unrevoked key" in bad.stderr
    assert cluster.ctl("tenants", "delete", "newco").stdout.strip() == "tenant newco deleted"
    actions = [e["action"] for e in json.loads(cluster.ctl("audit", "--json").stdout)["entries"]]
    assert actions[::-1] == ["tenant create", "tenant set", "key create", "tenant create",
                             "key create", "key revoke", "tenant delete"]  # fmt: skip


@pytest.mark.slow
def test_usage_through_ctl(cluster: LocalCluster) -> None:
    cluster.setup([])
    hour = int(time.time()) // 3600 * 3600

    async def seed() -> None:  # the SQLite store the control plane will open
        store = await open_store(cluster.root / "cp")
        await store.add_usage(
            [
                UsageRow(hour, "acme", "key-a", "chat", 3, 30, 12),
                UsageRow(hour, "beta", "key-b", "chat", 1, 5, 2),
                UsageRow(hour - 3 * 86400, "acme", "key-a", "chat", 2, 20, 4),
            ]
        )
        await store.aclose()

    trio.run(seed)
    cluster.start_cp()
    data = json.loads(cluster.ctl("usage", "--json").stdout)
    assert data["totals"] == {"requests": 6, "prompt_tokens": 55, "completion_tokens": 18}
    assert [(r["hour"], r["tenant"], r["requests"]) for r in data["rows"]] == [
        (hour - 3 * 86400, "acme", 2),
        (hour, "acme", 3),
        (hour, "beta", 1),
    ]
    out = cluster.ctl("usage", "--tenant", "acme", "--since", "24h").stdout
    shown = datetime.datetime.fromtimestamp(hour, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    assert lines(out) == [
        ["HOUR", "TENANT", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION"],
        [*shown.split(), "acme", "key-a", "chat", "3", "30", "12"],
        ["total", "3", "30", "12"],
    ]
    assert lines(cluster.ctl("usage", "--since", "90m").stdout)[-1] == ["total", "4", "35", "14"]
    bad = cluster.ctl("usage", "--since", "1y", check=False)
    assert (bad.returncode, bad.stderr.strip()) == (
        1, "llmgw ctl: --since: '1y' is not a time span; expected minutes, hours or days "
        "such as 90m, 24h, 7d")  # fmt: skip
