"""The store: what llmgw keeps, on SQLite or PostgreSQL, for the control plane and the router.

Accounts (tenants) and API keys (hashed), node overrides, known nodes, the
leader lease and its epoch, an audit log of operator actions and hourly usage;
not what runs: the fleet is authoritative for that. Its users depend on the
`Store` Protocol; `SqlStore` is it on one backend, opened by `open_store` (the
control plane's, server.yaml `store:` through `store_location`) or
`open_sqlite_file` (router-only mode's `keys_db`).

It sits below the control plane and the router, which both open it, and
imports neither: values (`_values.py`), schema and migrations (`_schema.py`),
connections (`_backends.py`), one repository per resource composed by
`SqlStore` (`_store.py`).
"""

from llmgw.store._schema import known_schema
from llmgw.store._store import SQLITE_FILE, SqlStore, open_sqlite_file, open_store, store_location
from llmgw.store._values import (
    OVERRIDE_KINDS,
    Account,
    AuditEntry,
    KnownNode,
    Lease,
    NodeOverride,
    Store,
    StoredKey,
    StoreDump,
)

__all__ = [
    "OVERRIDE_KINDS",
    "SQLITE_FILE",
    "Account",
    "AuditEntry",
    "KnownNode",
    "Lease",
    "NodeOverride",
    "SqlStore",
    "Store",
    "StoreDump",
    "StoredKey",
    "known_schema",
    "open_sqlite_file",
    "open_store",
    "store_location",
]
