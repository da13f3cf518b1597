"""TLS refusals named on both sides, through the real listener and the real dialler.

For each way an agent's certificate is refused (another CA, expired, not yet
valid, none at all), the agent's error says which and what to run, and the
control plane logs the peer's address and the reason, once per peer IP per
minute however often the agent retries.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import ssl
from pathlib import Path

import pytest
import trio
from helpers import NullSession

from llmgw import model
from llmgw.ctl import _cert
from llmgw.errors import TlsRefused
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo, _gate, _tls

HELLO = model.Hello(
    node_id="n1", agent_version="t", inventory=model.Inventory(host=model.Host("n1"))
)
NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)


class Registry:
    def __init__(self) -> None:
        self.registered: list[str] = []

    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        self.registered.append(hello.node_id)
        return NullSession(), model.Settings(heartbeat_interval_s=60, epoch=1)


class Agent:
    async def inventory(self) -> model.Inventory:
        return HELLO.inventory


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    _cert.init_ca(d)
    _cert.issue_server(d, ["127.0.0.1"])
    _cert.issue_agent(d, "n1")
    _cert.issue_agent(
        d, "old", not_before=NOW - dt.timedelta(days=10), not_after=NOW - dt.timedelta(days=1)
    )
    _cert.issue_agent(
        d, "early", not_before=NOW + dt.timedelta(days=2), not_after=NOW + dt.timedelta(days=9)
    )
    other = tmp_path / "other"
    _cert.init_ca(other)
    _cert.issue_agent(other, "n1")
    return d


def when(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def client(pki: Path, cert: Path | None) -> ssl.SSLContext:
    if cert is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(pki / "ca.crt")
        return ctx
    return _tls.client_context(pki / "ca.crt", cert, cert.with_suffix(".key"))


CASES = {
    # case: (certificate, agent's message after "the control plane at HOST:PORT ", CP's reason)
    "another-ca": (
        "../other/agent-n1.crt",
        "refused this agent's certificate {cert}: it is not signed by the CA the control "
        "plane trusts (unknown ca); on the control plane run `llmgw ctl cert agent n1` and "
        "copy the agent-n1.crt and .key it writes, with its ca.crt, to this agent",
        "its certificate is not signed by this control plane's CA (unable to get local "
        "issuer certificate); issue the agent's certificate from this CA with "
        "`llmgw ctl cert agent NODE`",
    ),
    "expired": (
        "agent-old.crt",
        "refused this agent's certificate {cert}: it expired on "
        + when(NOW - dt.timedelta(days=1))
        + " (certificate expired); on the control plane run `llmgw ctl cert agent n1 "
        "--force` and copy the new agent-n1.crt and .key to this agent",
        "its certificate has expired (certificate has expired); issue a new one with "
        "`llmgw ctl cert agent NODE --force`",
    ),
    "not-yet-valid": (
        "agent-early.crt",
        "refused this agent's certificate {cert}: it is not valid until "
        + when(NOW + dt.timedelta(days=2))
        + " (bad certificate); check the clocks of this machine and of the machine that "
        "issued it, or issue it again with `llmgw ctl cert agent n1 --force`",
        "its certificate is not valid yet (certificate is not yet valid); check the clocks "
        "of the agent, of this machine and of the machine that issued it",
    ),
    "no-certificate": (
        None,
        "requires a client certificate and this agent sent none; issue one with "
        "`llmgw ctl cert agent n1` and configure it",
        "it sent no client certificate; issue one with `llmgw ctl cert agent NODE` and "
        "set tls.cert and tls.key in the agent's config",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_refused_certificate_is_named_on_both_sides(
    pki: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    cert_name, agent_says, cp_says = CASES[case]
    cert = (pki / cert_name).resolve() if cert_name else None
    caplog.set_level(logging.INFO, logger="llmgw.rpc.listener")
    registry = Registry()
    server = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server, registry)
        # An agent retries: three tries, one line on the control plane.
        for _ in range(3):
            with pytest.raises(TlsRefused) as info:
                async with bridge.connect(
                    "127.0.0.1",
                    port,
                    client(pki, cert),
                    agent=Agent(),
                    cert_path=cert,
                    node="n1",
                ) as conn:
                    await conn.register(HELLO)
            assert str(info.value) == f"the control plane at 127.0.0.1:{port} " + agent_says.format(
                cert=cert
            )
        nursery.cancel_scope.cancel()
    assert registry.registered == []
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "llmgw.rpc.listener" and r.levelno >= logging.WARNING
    ]
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"refused agent connection from 127\.0\.0\.1:\d+: "
        + re.escape(cp_says)
        + re.escape(" (logged once a minute per address)"),
        lines[0],
    ), lines[0]


async def test_the_right_certificate_still_registers_after_refusals(pki: Path) -> None:
    registry = Registry()
    server = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server, registry)
        with pytest.raises(TlsRefused):
            async with bridge.connect(
                "127.0.0.1", port, client(pki, pki / "agent-old.crt"), agent=Agent()
            ) as conn:
                await conn.register(HELLO)
        async with bridge.connect(
            "127.0.0.1", port, client(pki, pki / "agent-n1.crt"), agent=Agent()
        ) as conn:
            await conn.register(HELLO)
        assert registry.registered == ["n1"]
        assert bridge.statistics()["handshake_refused_tls"] >= 1
        assert bridge.statistics()["handshake_authenticated"] == 1
        nursery.cancel_scope.cancel()


def test_refusals_are_logged_once_per_peer_per_minute() -> None:
    now = [1000.0]
    limit = _gate.RateLimit(60.0, clock=lambda: now[0])
    assert limit.allow("10.0.0.7") == (True, 0)
    for _ in range(5):
        now[0] += 10  # retries every 10 s
        assert limit.allow("10.0.0.7") == (False, 0)
    # Another peer is not held back by the first.
    assert limit.allow("10.0.0.8") == (True, 0)
    now[0] += 10.0  # 60 s after the first line: logged again, saying how many were not
    assert limit.allow("10.0.0.7") == (True, 5)
    assert limit.allow("10.0.0.7") == (False, 0)


def test_the_rate_limit_forgets_old_peers_when_full() -> None:
    now = [0.0]
    limit = _gate.RateLimit(60.0, clock=lambda: now[0], max_keys=3)
    for ip in ("a", "b", "c"):
        assert limit.allow(ip)[0]
    now[0] = 61.0
    assert limit.allow("d") == (True, 0)
    assert len(limit._last) == 1
