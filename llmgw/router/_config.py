"""The router's configuration: one frozen value, each field bounded where it is declared.

`RouterConfig` is what router.yaml's top level (router-only mode) and server.yaml's
`router:` section load into (llmgw/router/_main.py, llmgw/cp/_main.py); docs/configuration.md
is held to its fields by tests/test_config_docs.py.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from llmgw.config import BoundError, between, positive
from llmgw.core import POLICIES, AdmissionConfig, Band

# Above this the C decoder may meet the interpreter's recursion limit, whose
# headroom depends on how deep the serving task's stack already is.
MAX_JSON_DEPTH = 512
MAX_WORKERS = 64


DEFAULT_BANDS = (Band("interactive", 0, 30.0), Band("batch", 1, 120.0))


def _default_bands() -> list[Band]:
    return list(DEFAULT_BANDS)


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise BoundError(attribute.name, f"must be > 0 (got {value})")


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise BoundError(attribute.name, f"must be ≥ 0 (got {value})")


def _policy(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in POLICIES:
        raise BoundError(attribute.name, f"must be one of {', '.join(POLICIES)} (got {value!r})")


@attrs.define(kw_only=True, frozen=True)
class RouterConfig:
    max_body_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=_positive)
    # Nesting of arrays and objects a request body may have (400 beyond it), checked
    # before the body is parsed; a tool's JSON schema nests a dozen levels or so.
    max_json_depth: int = attrs.field(default=128, validator=between(1, MAX_JSON_DEPTH))
    retries: int = attrs.field(default=2, validator=_non_negative)
    connect_timeout_s: float = attrs.field(default=5.0, validator=positive(300))
    # Request sent -> response head. A non-streamed completion's head comes only
    # once it is generated, so this bounds the longest non-streamed generation.
    first_byte_timeout_s: float = attrs.field(default=600.0, validator=positive(86400))
    idle_timeout_s: float = attrs.field(default=60.0, validator=positive(3600))
    # An endpoint whose requests in flight have had no byte for this long, while another
    # of its model's makes progress, is quarantined as wedged (llmgw/core/_wedge.py);
    # raised for a long prefill the router can estimate. Quarantined, it gets nothing
    # for wedge_quarantine_s (or until it sends a byte again, or leaves the list).
    wedge_after_s: float = attrs.field(default=10.0, validator=positive(3600))
    wedge_quarantine_s: float = attrs.field(default=300.0, validator=positive(86400))
    scrape_interval_s: float = attrs.field(default=1.0, validator=between(0.1, 300))
    stale_after_intervals: float = attrs.field(default=3.0, validator=_positive)
    unhealthy_after_misses: int = attrs.field(default=3, validator=_positive)
    bands: list[Band] = attrs.field(factory=_default_bands)
    queue_limit: int = attrs.field(default=1024, validator=_non_negative)
    # Per model; None: the sum of its endpoints' slots (slots_per_endpoint when unknown).
    concurrency: int | None = attrs.field(default=None, validator=_positive)
    slots_per_endpoint: int = attrs.field(default=64, validator=_positive)
    affinity_header: str | None = None
    # How an endpoint is chosen (llmgw/core/_scoring.py): expected cost with the
    # prefix cache counted, the same without it, or plain rotation (a baseline).
    policy: str = attrs.field(default="prefix", validator=_policy)
    # The hot-spot guard: no endpoint takes a request that puts its count over
    # ceil((1 + epsilon) x (total + 1) / endpoints). Wide: the cost decides spills.
    load_bound_epsilon: float = attrs.field(default=1.0, validator=between(0, 10))
    # The prefix index (llmgw/core/_prefix.py): block size, blocks kept per endpoint
    # (about 100 bytes each), and the half-life of a match's credit.
    prefix_block_bytes: int = attrs.field(default=256, validator=between(16, 1 << 20))
    prefix_blocks_per_endpoint: int = attrs.field(default=8192, validator=between(1, 1 << 24))
    prefix_half_life_s: float = attrs.field(default=300.0, validator=positive(86400))
    # With workers > 1: each worker tells the others what its index learned
    # (llmgw/core/_prefix_share.py), so a prompt keeps one home whichever worker takes it.
    prefix_sharing: bool = True
    breaker_failures: int = attrs.field(default=5, validator=_positive)
    breaker_open_s: float = attrs.field(default=10.0, validator=positive(3600))
    key_cache_ttl_s: float = attrs.field(default=30.0, validator=positive(86400))
    upstream_keepalive_s: float = attrs.field(default=4.0, validator=positive(3600))
    # The client side of the router's listener (llmgw/router/_server.py); each write to
    # a client is bounded by idle_timeout_s (a client that stops reading is cut).
    client_head_timeout_s: float = attrs.field(default=60.0, validator=positive(3600))
    client_body_timeout_s: float = attrs.field(default=60.0, validator=positive(86400))
    client_keepalive_s: float = attrs.field(default=75.0, validator=positive(3600))
    max_head_bytes: int = attrs.field(default=32768, validator=between(1024, 1 << 20))
    # Processes serving the router listener (SO_REUSEPORT, the kernel spreads the
    # connections); each admits its share of every limit (`share`). Inside llmgw-cp
    # the control plane itself is worker 0 (llmgw/cp/_workers.py).
    workers: int = attrs.field(default=1, validator=between(1, MAX_WORKERS))
    # How often counted usage goes to the store (the UsageSink), and once more at shutdown:
    # a worker killed outright loses what it counted since its last flush. 1 s: one
    # transaction a second per worker while requests flow (10 rows: 1.3 ms of CPU on
    # PostgreSQL, 0.6 ms on SQLite, measured), none while idle.
    usage_flush_s: float = attrs.field(default=1.0, validator=positive(3600))

    def __attrs_post_init__(self) -> None:
        AdmissionConfig(
            concurrency=1,
            queue_limit=self.queue_limit,
            bands=tuple(self.bands),
        )
