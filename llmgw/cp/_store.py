"""The control plane's store, by its old name: llmgw/store, re-exported.

The store moved below the control plane and the router (llmgw/store), so that
router-only mode keeps its keys in it too. Control-plane modules that still
import `llmgw.cp._store` get the same names from here; new code imports
`llmgw.store`.
"""

from llmgw.keys import UsageRow
from llmgw.store import (
    OVERRIDE_KINDS,
    SQLITE_FILE,
    Account,
    AuditEntry,
    KnownNode,
    Lease,
    NodeOverride,
    SqlStore,
    Store,
    StoredKey,
    StoreDump,
    known_schema,
    open_store,
    store_location,
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
    "UsageRow",
    "known_schema",
    "open_store",
    "store_location",
]
