"""The admin listener: JSON API for operators and `llmgw ctl`, split by resource.

`_app` is the dispatcher (`AdminApp`: authentication, the standby's refusal, the JSON
answer, error mapping, `/healthz`, `/metrics`, the pages under `/admin`); each resource
module declares the routes it owns: `_fleet` (nodes, their overrides and shards),
`_models` (catalog, replicas, status, place, route), `_weights`, `_tenants` (tenants,
API keys, usage) and `_logs` (events, history, logs, audit). `_http` is the plumbing
they share, `_key` the admin key.
"""

from llmgw.cp._admin._app import AdminApp, LeaderSource
from llmgw.cp._admin._common import NODES_PER_SLICE as _NODES_PER_SLICE
from llmgw.cp._admin._http import HttpError
from llmgw.cp._admin._key import ADMIN_KEY_FILE, ensure_admin_key, read_admin_key
from llmgw.cp._admin._models import Explainer

__all__ = [
    "ADMIN_KEY_FILE",
    "_NODES_PER_SLICE",
    "AdminApp",
    "Explainer",
    "HttpError",
    "LeaderSource",
    "ensure_admin_key",
    "read_admin_key",
]
