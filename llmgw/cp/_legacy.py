"""What an older llmgw-cp kept in files of its state dir, moved into the store once.

Before the store, node overrides lived in `overrides.json`, the known nodes in
`known_nodes.json` and the router's keys in `keys.sqlite` (the SqliteKeyStore's
file). At start, each file that exists is imported when the store has none of
its rows yet (a store that has some was already written by this llmgw: the file
is older than it), then renamed to `*.imported`, so nothing is lost on upgrade
and nothing is imported twice. A file that cannot be read stops the start,
naming it: guessing would drop an operator's cordon or a tenant's keys.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

import trio

from llmgw.errors import ConfigError
from llmgw.keys import ApiKey
from llmgw.store import Account, Store

log = logging.getLogger("llmgw.cp.legacy")

OVERRIDES_FILE = "overrides.json"
KNOWN_FILE = "known_nodes.json"
KEYS_FILE = "keys.sqlite"
_KEY_COLUMNS = "key_id, secret_sha256, tenant, models, default_band, max_band, created_at, revoked"


def parse_overrides(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(cordoned, draining), node -> reason, from an old overrides.json."""
    try:
        data = json.loads(path.read_text())
        cordoned = {str(k): str(v) for k, v in data.get("cordoned", {}).items()}
        draining = {str(k): str(v) for k, v in data.get("draining", {}).items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f'{path}: unreadable node overrides: {exc}; expected {{"cordoned": {{node: '
            'reason}}, "draining": {...}}: fix or remove it'
        ) from None
    return cordoned, draining


def parse_known(path: Path) -> list[str]:
    """The node ids of an old known_nodes.json."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{path}: unreadable list of known nodes: {exc}; fix or delete it (the control "
            "plane then waits reconcile_settle_s after its start instead)"
        ) from None
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ConfigError(
            f'{path}: expected {{"nodes": [node ids]}}, got {str(data)[:80]!r}; fix or '
            "delete it (the control plane then waits reconcile_settle_s after its start)"
        )
    return sorted(set(nodes))


def read_keys(path: Path) -> list[tuple[ApiKey, bytes]]:
    """Every key of an old keys.sqlite with its secret's digest, opened read-only."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows: list[tuple[Any, ...]] = db.execute(
                f"SELECT {_KEY_COLUMNS}, name FROM api_keys ORDER BY created_at, key_id"
            ).fetchall()
        finally:
            db.close()
        out = []
        for key_id, secret, tenant, models, default_band, max_band, created, revoked, name in rows:
            key = ApiKey(
                key_id=str(key_id),
                tenant=str(tenant),
                models=None if models is None else frozenset(json.loads(str(models))),
                default_band=str(default_band),
                max_band=str(max_band),
                created_at=float(created),
                revoked=bool(revoked),
                name=str(name or ""),
            )
            out.append((key, bytes(secret)))
        return out
    except (sqlite3.Error, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{path}: unreadable key file: {exc}; it holds the router's keys from before "
            "the store: fix it, or move it away to start without them"
        ) from None


async def import_legacy(state_dir: Path, store: Store) -> list[str]:
    """Import the old files in `state_dir` the store has no rows of; one line per file."""
    done = []
    overrides = state_dir / OVERRIDES_FILE
    if overrides.exists():
        cordoned, draining = await trio.to_thread.run_sync(parse_overrides, overrides)
        if await store.overrides():
            done.append(_skip(overrides, "node overrides"))
        else:
            for node, reason in cordoned.items():
                if node not in draining:  # a drain holds it for placement as well
                    await store.set_override(node, "cordon", reason)
            for node, reason in draining.items():
                await store.set_override(node, "drain", reason)
            done.append(_imported(overrides, f"{len(cordoned)} cordoned, {len(draining)} draining"))
    known = state_dir / KNOWN_FILE
    if known.exists():
        nodes = await trio.to_thread.run_sync(parse_known, known)
        if await store.known_nodes():
            done.append(_skip(known, "known nodes"))
        else:
            for node in nodes:
                await store.remember_node(node, "")
            done.append(_imported(known, f"{len(nodes)} known nodes"))
    keys = state_dir / KEYS_FILE
    if keys.exists():
        found = await trio.to_thread.run_sync(read_keys, keys)
        if await store.list_keys():
            done.append(_skip(keys, "API keys"))
        else:
            accounts = {a.name for a in await store.list_accounts()}
            tenants = sorted({k.tenant for k, _ in found} - accounts)
            for tenant in tenants:
                await store.create_account(Account(tenant))  # no limits, as before
            for key, secret_digest in found:
                await store.put_key(key, secret_digest)
            revoked = sum(k.revoked for k, _ in found)
            done.append(
                _imported(
                    keys,
                    f"{len(found)} API keys ({revoked} revoked), "
                    f"{len(tenants)} tenants without limits",
                )
            )
    for line in done:
        log.info("%s", line)
    return done


def _imported(path: Path, counts: str) -> str:
    os.replace(path, path.with_name(path.name + ".imported"))
    return f"imported {path} into the store: {counts}; the file is now {path.name}.imported"


def _skip(path: Path, what: str) -> str:
    os.replace(path, path.with_name(path.name + ".imported"))
    return (
        f"{path}: not imported, the store already has {what} (the file is older than "
        f"them); it is now {path.name}.imported"
    )
