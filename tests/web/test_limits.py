"""The one set of listener bounds: each listener keeps the values it had."""

from __future__ import annotations

import attrs
import pytest

from llmgw.cp._weights._mirror import MIRROR_LIMITS
from llmgw.router import RouterConfig, listener_limits
from llmgw.web.limits import ListenerLimits

# What the two listeners applied before they shared ListenerLimits (router/_server.py's
# Limits and cp/_weights/_mirror.py's MirrorLimits); a changed default must change here.
ROUTER = {
    "head_timeout_s": 60.0,
    "body_timeout_s": 60.0,
    "send_timeout_s": 60.0,
    "keepalive_s": 75.0,
    "max_head_bytes": 32768,
    "discard_bytes": 64 << 20,
    "max_connections": None,
}
MIRROR = {
    "head_timeout_s": 10.0,
    "keepalive_s": 30.0,
    "send_timeout_s": 60.0,
    "handshake_timeout_s": 10.0,
    "max_head_bytes": 16384,
    "max_connections": 256,
}


def test_the_defaults_are_the_router_listeners() -> None:
    defaults = attrs.asdict(ListenerLimits())
    assert {name: defaults[name] for name in ROUTER} == ROUTER


def test_the_router_config_gives_the_same_defaults() -> None:
    assert listener_limits(RouterConfig()) == ListenerLimits()


def test_the_mirror_keeps_its_own_bounds() -> None:
    mirror = attrs.asdict(MIRROR_LIMITS)
    assert {name: mirror[name] for name in MIRROR} == MIRROR


def test_the_router_config_sets_each_bound() -> None:
    cfg = RouterConfig(
        client_head_timeout_s=1.5,
        client_body_timeout_s=2.5,
        idle_timeout_s=3.5,
        client_keepalive_s=4.5,
        max_head_bytes=5000,
        max_body_bytes=128 << 20,
    )
    assert listener_limits(cfg) == ListenerLimits(
        head_timeout_s=1.5,
        body_timeout_s=2.5,
        send_timeout_s=3.5,
        keepalive_s=4.5,
        max_head_bytes=5000,
        discard_bytes=128 << 20,
    )


@pytest.mark.parametrize(
    "field",
    [f.name for f in attrs.fields(ListenerLimits)],
)
@pytest.mark.parametrize("value", [0, -1])
def test_a_bound_is_positive(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        ListenerLimits(**{field: value})
