"""Mutual TLS over real loopback sockets, with certificates from `llmgw ctl cert`.

Each test runs a stdlib ssl server in a thread that accepts connections until
the test ends and records, per connection, the peer's common name or the
exception its handshake raised.
"""

from __future__ import annotations

import datetime as dt
import os
import queue
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.ctl._cert import init_ca, issue_agent, issue_server
from llmgw.errors import ConfigError
from llmgw.rpc._tls import (
    check_files,
    client_context,
    describe_tls_failure,
    fetch_server_certificate,
    peer_common_name,
    server_context,
)

TIMEOUT = 3.0

# X509_V_ERR_* as the server sees them when refusing a client certificate.
UNABLE_TO_GET_ISSUER_CERT_LOCALLY = 20
CERT_HAS_EXPIRED = 10
INVALID_PURPOSE = 26


@attrs.frozen
class Accepted:
    common_name: str | None


Outcome = Accepted | BaseException


class TlsServer:
    """Accepts TLS connections on `host` in a thread; answers b"ok" after a handshake."""

    def __init__(self, ctx: ssl.SSLContext, host: str, reply: bytes | None = None) -> None:
        self._ctx = ctx
        self._reply = reply
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.05)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._outcomes: queue.Queue[Outcome] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tls-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(TIMEOUT)
            if self._reply is not None:  # not TLS at all
                with conn:
                    conn.sendall(self._reply)
                continue
            try:
                with self._ctx.wrap_socket(conn, server_side=True) as tls:
                    self._outcomes.put(Accepted(peer_common_name(tls.getpeercert())))
                    tls.sendall(b"ok")
            except (OSError, ValueError) as e:
                conn.close()
                self._outcomes.put(e)

    def outcome(self) -> Outcome:
        """What the next connection's handshake came to, on the server's side."""
        return self._outcomes.get(timeout=TIMEOUT)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=TIMEOUT)
        self._listener.close()
        assert not self._thread.is_alive()


@pytest.fixture
def serve() -> Iterator[Callable[..., TlsServer]]:
    servers: list[TlsServer] = []

    def start(
        ctx: ssl.SSLContext, host: str = "127.0.0.1", reply: bytes | None = None
    ) -> TlsServer:
        server = TlsServer(ctx, host, reply)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def dial(ctx: ssl.SSLContext, port: int, host: str = "127.0.0.1") -> bytes:
    """Connect, handshake and read the server's b"ok".

    With TLS 1.3 the server refuses a client certificate only after the
    client's handshake has completed, so a refusal surfaces on this read.
    """
    with (
        socket.create_connection((host, port), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        return tls.recv(2)


def refused(ctx: ssl.SSLContext, server: TlsServer) -> BaseException:
    with pytest.raises((ssl.SSLError, OSError)) as info:
        dial(ctx, server.port, server.host)
    return info.value


@attrs.frozen
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def pair(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.crt", self.dir / f"{name}.key"

    def server(self) -> ssl.SSLContext:
        return server_context(self.ca, *self.pair("server"))

    def client(self, name: str = "agent-n1", *, signed_by: Pki | None = None) -> ssl.SSLContext:
        return client_context(self.ca, *(signed_by or self).pair(name))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    d = tmp_path / "pki"
    init_ca(d)
    issue_server(d, ["127.0.0.1", "localhost"])
    issue_agent(d, "n1")
    return Pki(d)


@pytest.fixture
def other(tmp_path: Path) -> Pki:
    """A second, unrelated CA with its own server and agent certificates."""
    d = tmp_path / "other"
    init_ca(d)
    issue_server(d, ["127.0.0.1", "localhost"])
    issue_agent(d, "n1")
    return Pki(d)


@pytest.fixture(params=[ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls12", "tls13"])
def version(request: pytest.FixtureRequest) -> ssl.TLSVersion:
    v: ssl.TLSVersion = request.param
    return v


def capped(ctx: ssl.SSLContext, version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx.maximum_version = version
    return ctx


def past(days_ago_start: int, days_ago_end: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    return now - dt.timedelta(days=days_ago_start), now - dt.timedelta(days=days_ago_end)


# --- accepted -----------------------------------------------------------------


def test_good_agent_connects_and_server_sees_its_node_id(
    pki: Pki, serve: Callable[..., TlsServer], version: ssl.TLSVersion
) -> None:
    server = serve(pki.server())
    ctx = capped(pki.client(), version)
    with (
        socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.recv(2) == b"ok"
        assert tls.version() == {ssl.TLSVersion.TLSv1_2: "TLSv1.2"}.get(version, "TLSv1.3")
        assert peer_common_name(tls.getpeercert()) == "127.0.0.1"
    assert server.outcome() == Accepted("n1")


def test_dialling_a_dns_name_the_cert_holds_connects(
    pki: Pki, serve: Callable[..., TlsServer]
) -> None:
    server = serve(pki.server())
    assert dial(pki.client(), server.port, "localhost") == b"ok"
    assert server.outcome() == Accepted("n1")


def test_certificates_pass_x509_strict_verification(
    pki: Pki, serve: Callable[..., TlsServer]
) -> None:
    # Python 3.13's ssl.create_default_context() sets VERIFY_X509_STRICT; a
    # certificate missing e.g. its authority key identifier would fail there.
    sctx, cctx = pki.server(), pki.client()
    for ctx in (sctx, cctx):
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    server = serve(sctx)
    assert dial(cctx, server.port) == b"ok"
    assert server.outcome() == Accepted("n1")


def test_contexts_require_tls12_and_verification(pki: Pki) -> None:
    sctx, cctx = pki.server(), pki.client()
    assert sctx.minimum_version == cctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert sctx.verify_mode == cctx.verify_mode == ssl.CERT_REQUIRED
    assert cctx.check_hostname is True


# --- refused by the server --------------------------------------------------------


def test_no_client_certificate_is_refused_at_handshake(
    pki: Pki, serve: Callable[..., TlsServer], version: ssl.TLSVersion
) -> None:
    server = serve(pki.server())
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(pki.ca)
    exc = refused(capped(bare, version), server)

    seen = server.outcome()
    assert isinstance(seen, ssl.SSLError)
    assert seen.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE"
    message = describe_tls_failure(exc, "127.0.0.1", server.port)
    if version is ssl.TLSVersion.TLSv1_3:
        assert message == (
            f"the control plane at 127.0.0.1:{server.port} requires a client certificate "
            "and this agent sent none; issue one with `llmgw ctl cert agent NODE` and configure it"
        )
    else:
        assert message.startswith(f"127.0.0.1:{server.port} ended the TLS handshake")
        assert "client certificate this agent did not send" in message


def test_agent_cert_from_another_ca_is_refused(
    pki: Pki, other: Pki, serve: Callable[..., TlsServer], version: ssl.TLSVersion
) -> None:
    server = serve(pki.server())
    cert_path = other.pair("agent-n1")[0]
    exc = refused(capped(pki.client(signed_by=other), version), server)

    seen = server.outcome()
    assert isinstance(seen, ssl.SSLCertVerificationError)
    assert seen.verify_code == UNABLE_TO_GET_ISSUER_CERT_LOCALLY
    assert describe_tls_failure(exc, "127.0.0.1", server.port, cert_path=cert_path, node="n1") == (
        f"the control plane at 127.0.0.1:{server.port} refused this agent's certificate "
        f"{cert_path}: it is not signed by the CA the control plane trusts (unknown ca); "
        "on the control plane run `llmgw ctl cert agent n1` and copy the agent-n1.crt "
        "and .key it writes, with its ca.crt, to this agent"
    )


def test_expired_agent_cert_is_refused(
    pki: Pki, serve: Callable[..., TlsServer], version: ssl.TLSVersion
) -> None:
    start, end = past(10, 1)
    issue_agent(pki.dir, "old", not_before=start, not_after=end)
    server = serve(pki.server())
    exc = refused(capped(pki.client("agent-old"), version), server)

    seen = server.outcome()
    assert isinstance(seen, ssl.SSLCertVerificationError)
    assert seen.verify_code == CERT_HAS_EXPIRED
    message = describe_tls_failure(
        exc, "127.0.0.1", server.port, cert_path=pki.pair("agent-old")[0], node="old"
    )
    assert message == (
        f"the control plane at 127.0.0.1:{server.port} refused this agent's certificate "
        f"{pki.pair('agent-old')[0]}: it expired on {end.strftime('%Y-%m-%d %H:%M UTC')} "
        "(certificate expired); on the control plane run `llmgw ctl cert agent old --force` "
        "and copy the new agent-old.crt and .key to this agent"
    )


def test_server_certificate_is_refused_as_a_client_certificate(
    pki: Pki, serve: Callable[..., TlsServer]
) -> None:
    # Without the clientAuth-only EKU, anyone holding the control plane's key
    # could register as a node named after its address.
    server = serve(pki.server())
    exc = refused(pki.client("server"), server)
    seen = server.outcome()
    assert isinstance(seen, ssl.SSLCertVerificationError)
    assert seen.verify_code == INVALID_PURPOSE
    assert "refused this agent's certificate" in describe_tls_failure(exc, "127.0.0.1", 1)


# --- refused by the client --------------------------------------------------------


def test_server_cert_not_naming_the_dialled_address_is_refused(
    pki: Pki, serve: Callable[..., TlsServer], version: ssl.TLSVersion
) -> None:
    # Linux routes all of 127/8 to lo; the certificate names 127.0.0.1 and
    # localhost only, and the server listens on 127.0.0.2.
    server = serve(pki.server(), host="127.0.0.2")
    exc = refused(capped(pki.client(), version), server)
    assert isinstance(exc, ssl.SSLCertVerificationError)
    assert isinstance(server.outcome(), ssl.SSLError)  # the client's alert

    message = describe_tls_failure(exc, "127.0.0.2", server.port)
    assert message.startswith(
        f"the certificate of 127.0.0.2:{server.port} does not name 127.0.0.2, the address dialled"
    )
    assert "`llmgw ctl cert server --host 127.0.0.2 --force`" in message

    # With the server's certificate in hand, the message says what it names and
    # the fix keeps those names.
    der = fetch_server_certificate(
        "127.0.0.2",
        server.port,
        cert=pki.pair("agent-n1")[0],
        key=pki.pair("agent-n1")[1],
        timeout=TIMEOUT,
    )
    assert der is not None
    assert server.outcome() == Accepted("n1")
    message = describe_tls_failure(exc, "127.0.0.2", server.port, server_cert=der)
    assert "(it names 127.0.0.1, localhost)" in message
    assert (
        "`llmgw ctl cert server --host 127.0.0.1 --host localhost --host 127.0.0.2 --force`"
        in message
    )


def test_server_cert_from_another_ca_is_refused(
    pki: Pki, other: Pki, serve: Callable[..., TlsServer], version: ssl.TLSVersion
) -> None:
    server = serve(other.server())
    exc = refused(capped(pki.client(), version), server)
    assert isinstance(exc, ssl.SSLCertVerificationError)
    assert describe_tls_failure(exc, "127.0.0.1", server.port, ca_path=pki.ca) == (
        f"the certificate of 127.0.0.1:{server.port} is not signed by the CA in {pki.ca}; "
        f"copy the control plane's ca.crt to {pki.ca}, "
        "or issue the control plane's certificate from this CA"
    )


def test_expired_server_cert_is_refused_saying_when(
    pki: Pki, serve: Callable[..., TlsServer]
) -> None:
    start, end = past(30, 2)
    issue_server(pki.dir, ["127.0.0.1"], force=True, not_before=start, not_after=end)
    server = serve(pki.server())
    exc = refused(pki.client(), server)
    assert isinstance(exc, ssl.SSLCertVerificationError)

    assert describe_tls_failure(exc, "127.0.0.1", server.port) == (
        f"the certificate of 127.0.0.1:{server.port} expired; on the control plane run "
        "`llmgw ctl cert server --host NAME --force` and restart it"
    )
    agent_cert, agent_key = pki.pair("agent-n1")
    der = fetch_server_certificate("127.0.0.1", server.port, cert=agent_cert, key=agent_key)
    assert der is not None
    when = end.strftime("%Y-%m-%d %H:%M UTC")
    message = describe_tls_failure(exc, "127.0.0.1", server.port, server_cert=der)
    assert f"expired on {when};" in message


def test_agent_certificate_is_refused_as_a_server_certificate(
    pki: Pki, serve: Callable[..., TlsServer]
) -> None:
    # An agent's key must not let it impersonate the control plane.
    issue_agent(pki.dir, "127.0.0.1")
    server = serve(server_context(pki.ca, *pki.pair("agent-127.0.0.1")))
    exc = refused(pki.client(), server)
    assert isinstance(exc, ssl.SSLCertVerificationError)
    assert "is not a server certificate (it lacks serverAuth)" in describe_tls_failure(
        exc, "127.0.0.1", server.port
    )


# --- not TLS, not there -----------------------------------------------------------


def test_connection_refused_in_plain_words(pki: Pki) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(ConnectionRefusedError) as info:
        dial(pki.client(), port)
    assert describe_tls_failure(info.value, "127.0.0.1", port) == (
        f"connection to 127.0.0.1:{port} refused: nothing listens there; "
        "check the control plane is running and the address and port are right"
    )


def test_connection_reset_in_plain_words(pki: Pki) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset() -> None:
        conn, _ = listener.accept()
        # Linger 0: close() sends RST instead of FIN.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.recv(1)  # wait for the ClientHello
        conn.close()

    t = threading.Thread(target=reset, daemon=True)
    t.start()
    try:
        with pytest.raises(OSError) as info:
            dial(pki.client(), port)
    finally:
        t.join(TIMEOUT)
        listener.close()
    assert isinstance(info.value, ConnectionResetError | BrokenPipeError)
    assert describe_tls_failure(info.value, "127.0.0.1", port).startswith(
        f"connection to 127.0.0.1:{port} was reset during the TLS handshake"
    )


def test_a_port_that_does_not_speak_tls(pki: Pki, serve: Callable[..., TlsServer]) -> None:
    server = serve(pki.server(), reply=b"HTTP/1.1 400 Bad Request\r\n\r\n")
    exc = refused(pki.client(), server)
    assert describe_tls_failure(exc, "127.0.0.1", server.port) == (
        f"127.0.0.1:{server.port} does not speak TLS; "
        "check the port is the control plane's RPC port"
    )


def test_wrapped_causes_are_found(pki: Pki, serve: Callable[..., TlsServer]) -> None:
    server = serve(pki.server(), host="127.0.0.2")
    exc = refused(pki.client(), server)
    direct = describe_tls_failure(exc, "127.0.0.2", server.port)

    # As trio raises it: BrokenResourceError from the ssl error.
    try:
        raise RuntimeError("SSL handshake failed") from exc
    except RuntimeError as wrapper:
        assert describe_tls_failure(wrapper, "127.0.0.2", server.port) == direct
    group = BaseExceptionGroup("nursery", [ValueError("other"), exc])
    assert describe_tls_failure(group, "127.0.0.2", server.port) == direct
    assert describe_tls_failure(ValueError("odd"), "::1", 9) == (
        "TLS connection to [::1]:9 failed: ValueError: odd"
    )


def test_timeouts_and_unknown_hosts_in_plain_words() -> None:
    assert describe_tls_failure(TimeoutError(), "10.0.0.9", 7000).startswith(
        "no answer from 10.0.0.9:7000 in time"
    )
    gai = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert describe_tls_failure(gai, "cp.invalid", 7000) == (
        "cannot resolve 'cp.invalid': Name or service not known; check the address"
    )


def verify_error(code: int, message: str) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
    exc.verify_code = code
    exc.verify_message = message
    return exc


def test_verify_failures_without_a_real_handshake() -> None:
    # Cases a loopback test cannot stage cheaply: a certificate from the future,
    # an unknown issuer when the CA path is not known, an unexpected code.
    assert describe_tls_failure(verify_error(9, "certificate is not yet valid"), "cp", 7) == (
        "the certificate of cp:7 is not valid yet; check the clocks of this machine "
        "and of the machine that issued it"
    )
    assert describe_tls_failure(
        verify_error(20, "unable to get local issuer certificate"), "cp", 7
    ) == (
        "the certificate of cp:7 is not signed by the CA this agent trusts; copy the "
        "control plane's ca.crt to this agent's CA file, or issue the control plane's "
        "certificate from this CA"
    )
    assert describe_tls_failure(verify_error(23, "certificate revoked"), "cp", 7) == (
        "the certificate of cp:7 failed verification: certificate revoked"
    )


def test_fetch_server_certificate_of_nothing_is_none() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert fetch_server_certificate("127.0.0.1", port, timeout=TIMEOUT) is None


# --- peer_common_name ---------------------------------------------------------------


def test_peer_common_name_shapes() -> None:
    subject = ((("organizationName", "llmgw"),), (("commonName", "n1"),))
    assert peer_common_name({"subject": subject}) == "n1"
    assert peer_common_name(None) is None
    assert peer_common_name({}) is None  # getpeercert() of an unverified peer
    assert peer_common_name({"subject": ((("organizationName", "llmgw"),),)}) is None
    two = ((("commonName", "n1"),), (("commonName", "n2"),))
    assert peer_common_name({"subject": two}) is None


# --- check_files ------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["ca.crt", "agent-n1.crt", "agent-n1.key"])
def test_check_files_names_the_missing_file(pki: Pki, missing: str) -> None:
    (pki.dir / missing).unlink()
    with pytest.raises(ConfigError, match="does not exist") as info:
        check_files(pki.ca, *pki.pair("agent-n1"))
    assert str(pki.dir / missing) in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        pki.client()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_check_files_names_an_unreadable_key(pki: Pki) -> None:
    key = pki.pair("agent-n1")[1]
    key.chmod(0)
    with pytest.raises(ConfigError, match="not readable") as info:
        check_files(pki.ca, *pki.pair("agent-n1"))
    assert str(key) in str(info.value)


def test_check_files_names_a_directory_in_place_of_a_file(pki: Pki) -> None:
    cert = pki.pair("agent-n1")[0]
    cert.unlink()
    cert.mkdir()
    with pytest.raises(ConfigError) as info:
        check_files(pki.ca, *pki.pair("agent-n1"))
    assert str(info.value) == f"cannot read certificate {cert}: Is a directory"


def test_check_files_refuses_a_key_of_another_cert(pki: Pki) -> None:
    cert = pki.pair("agent-n1")[0]
    key = pki.pair("server")[1]
    with pytest.raises(ConfigError, match="does not belong to certificate") as info:
        check_files(pki.ca, cert, key)
    assert f"private key {key} does not belong to certificate {cert}" in str(info.value)
    with pytest.raises(ConfigError, match="does not belong"):
        server_context(pki.ca, cert, key)


def test_check_files_refuses_garbage(pki: Pki) -> None:
    cert, key = pki.pair("agent-n1")
    cert.write_text("hello")
    with pytest.raises(
        ConfigError, match=re.escape(f"certificate {cert} is not a PEM certificate")
    ):
        check_files(pki.ca, cert, key)
    with pytest.raises(
        ConfigError, match=re.escape(f"CA certificate {key} holds no PEM certificate")
    ):
        check_files(key, *pki.pair("server"))
    with pytest.raises(ConfigError, match="is not a PEM private key"):
        check_files(pki.ca, pki.pair("server")[0], pki.ca)


def test_check_files_refuses_an_encrypted_key(pki: Pki) -> None:
    cert, key_path = pki.pair("agent-n1")
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(ConfigError, match="is encrypted"):
        check_files(pki.ca, cert, key_path)
