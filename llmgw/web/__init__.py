"""HTTP as llmgw does it, once, for every llmgw HTTP app and client.

`llmgw.web.asgi`: the ASGI types, the lifespan loop, a JSON answer and one HTTP
error value, for the admin API, the pages, the router and router-only mode.
`llmgw.web.limits`: the client-side bounds every llmgw listener holds.
`llmgw.web.h1`: the HTTP/1.1 client (an h11 connection over a trio stream, and
the TLS client stream) used by the router's upstream pool and the agent's fetcher.

It imports nothing of llmgw above llmgw.errors (tests/test_layering.py).
"""

__all__: list[str] = []
