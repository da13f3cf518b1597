"""The router: one OpenAI-compatible endpoint in front of the fleet's replicas.

`Router(config, endpoints, keys)` gives the ASGI app (`router.app`), the
background work (`await nursery.start(router.run)`: the load scraper and the
fleet watch) and the Prometheus registry (`router.metrics_registry`) for the
admin listener's `/metrics`. `serve_http(router.app, host, port)` is the lean
HTTP/1.1 server the router listener should run on (see `_server.py` for why
not hypercorn); `serve_hypercorn(app, config)` is hypercorn as every llmgw
listener on it runs (`_hypercorn.py`: connections closed when their client
goes); `python -m llmgw.router` is router-only mode. `listener_limits(config)`
is the router listener's `ListenerLimits` (llmgw.web.limits, re-exported here).
`router.loads()` is its load per served model (the autoscaler's signals); an
endpoint source's optional `holds()` (`Hold`) keeps requests for a model at zero
replicas waiting for its first, `encode_holds`/`decode_holds` carry them; its
optional `adapters()` (`AdapterRoute`) names the LoRA adapters among its served
names (`encode_adapters`/`decode_adapters` carry them).
"""

from llmgw.router._adapters import AdapterRoute, adapters_of, decode_adapters, encode_adapters
from llmgw.router._hypercorn import serve as serve_hypercorn
from llmgw.router._keys import CachedKeys, KeyStore, StaticKeys, StoreKeys
from llmgw.router._main import keep_worker, listener_limits, metrics_app
from llmgw.router._router import (
    DEFAULT_BANDS,
    EXPLAIN_HEADER,
    PRIORITY_HEADER,
    Router,
    RouterConfig,
)
from llmgw.router._server import serve as serve_http
from llmgw.router._share import (
    Lines,
    LineSender,
    Relay,
    hear,
    learned_line,
    parse_learned,
    private_unix_listener,
    send_line,
    serve_relay,
    share_via_relay,
    tell,
)
from llmgw.router._surface import HttpError
from llmgw.router._traffic import VERSION_HEADER, decode_traffic, encode_traffic
from llmgw.router._types import (
    Endpoint,
    EndpointSource,
    Hold,
    StaticEndpoints,
    decode_holds,
    encode_holds,
    holds_of,
)
from llmgw.web.limits import ListenerLimits

__all__ = [
    "DEFAULT_BANDS",
    "EXPLAIN_HEADER",
    "PRIORITY_HEADER",
    "VERSION_HEADER",
    "AdapterRoute",
    "CachedKeys",
    "Endpoint",
    "EndpointSource",
    "Hold",
    "HttpError",
    "KeyStore",
    "LineSender",
    "Lines",
    "ListenerLimits",
    "Relay",
    "Router",
    "RouterConfig",
    "StaticEndpoints",
    "StaticKeys",
    "StoreKeys",
    "adapters_of",
    "decode_adapters",
    "decode_holds",
    "decode_traffic",
    "encode_adapters",
    "encode_holds",
    "encode_traffic",
    "hear",
    "holds_of",
    "keep_worker",
    "learned_line",
    "listener_limits",
    "metrics_app",
    "parse_learned",
    "private_unix_listener",
    "send_line",
    "serve_http",
    "serve_hypercorn",
    "serve_relay",
    "share_via_relay",
    "tell",
]
