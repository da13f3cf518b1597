"""TLS for llmgw's RPC: contexts for both ends, and failures in plain words.

Both ends authenticate: the control plane presents a certificate naming the
addresses agents dial, and each agent presents one whose common name is its
node id, both issued by the CA of `llmgw ctl cert`. Everything that can be
decided before a socket exists (files present, key matching certificate) is
checked by `check_files` and reported as `ConfigError`; what goes wrong at the
handshake is turned into a sentence by `describe_tls_failure`, so that an
operator reads "the control plane's certificate does not name 10.0.0.7" rather
than "[SSL: CERTIFICATE_VERIFY_FAILED]".
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
from collections.abc import Iterator, Mapping
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from llmgw.errors import ConfigError

__all__ = [
    "check_files",
    "client_context",
    "describe_client_refusal",
    "describe_tls_failure",
    "fetch_server_certificate",
    "format_peer",
    "peer_common_name",
    "probe_refusal",
    "server_context",
]

# OpenSSL X509_V_ERR_* codes (include/openssl/x509_vfy.h) that
# ssl.SSLCertVerificationError.verify_code carries.
_V_UNABLE_TO_GET_ISSUER_CERT = 2
_V_CERT_SIGNATURE_FAILURE = 7
_V_CERT_NOT_YET_VALID = 9
_V_CERT_HAS_EXPIRED = 10
_V_DEPTH_ZERO_SELF_SIGNED_CERT = 18
_V_SELF_SIGNED_CERT_IN_CHAIN = 19
_V_UNABLE_TO_GET_ISSUER_CERT_LOCALLY = 20
_V_UNABLE_TO_VERIFY_LEAF_SIGNATURE = 21
_V_INVALID_PURPOSE = 26
_V_HOSTNAME_MISMATCH = 62
_V_IP_ADDRESS_MISMATCH = 64

_UNKNOWN_ISSUER = frozenset(
    {
        _V_UNABLE_TO_GET_ISSUER_CERT,
        _V_CERT_SIGNATURE_FAILURE,
        _V_DEPTH_ZERO_SELF_SIGNED_CERT,
        _V_SELF_SIGNED_CERT_IN_CHAIN,
        _V_UNABLE_TO_GET_ISSUER_CERT_LOCALLY,
        _V_UNABLE_TO_VERIFY_LEAF_SIGNATURE,
    }
)

# TLS alerts a server sends when it will not accept the client's certificate.
_CLIENT_CERT_ALERTS = frozenset(
    {
        "bad certificate",
        "certificate unknown",
        "certificate expired",
        "certificate revoked",
        "unsupported certificate",
        "unknown ca",
        "access denied",
    }
)


# --- contexts ------------------------------------------------------------------


def server_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS 1.2+ server context that requires a client certificate issued by `ca`.

    A client with no certificate, one from another CA or an expired one is
    refused at the handshake; the node id is then `peer_common_name(...)`.
    """
    check_files(ca, cert, key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _configure(ctx, ca, cert, key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS 1.2+ client context that presents `cert` and verifies the server by `ca`.

    Host names are checked: wrap with `server_hostname` set to the address that
    was dialled, a DNS name or a bare IP address, which the server's
    certificate must name.
    """
    check_files(ca, cert, key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _configure(ctx, ca, cert, key)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _configure(ctx: ssl.SSLContext, ca: Path, cert: Path, key: Path) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"cannot use {ca} as the CA certificate: {_reason(e)}") from e
    try:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"cannot use certificate {cert} with key {key}: {_reason(e)}") from e


def check_files(ca: Path, cert: Path, key: Path) -> None:
    """Check the three files exist, parse, and that `key` belongs to `cert`.

    Raises ConfigError naming the file at fault and how to make a right one.
    """
    ca_pem = _read(ca, "CA certificate", "`llmgw ctl cert init`")
    cert_pem = _read(cert, "certificate", "`llmgw ctl cert server` or `llmgw ctl cert agent`")
    key_pem = _read(key, "private key", "`llmgw ctl cert server` or `llmgw ctl cert agent`")
    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError:
        raise ConfigError(f"CA certificate {ca} holds no PEM certificate") from None
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise ConfigError(f"certificate {cert} is not a PEM certificate") from None
    try:
        private_key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise ConfigError(
            f"private key {key} is encrypted; llmgw needs it unencrypted (mode 0600)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(f"private key {key} is not a PEM private key") from None
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if certificate.public_key().public_bytes(der, spki) != private_key.public_key().public_bytes(
        der, spki
    ):
        raise ConfigError(
            f"private key {key} does not belong to certificate {cert}; "
            "use the .key written together with that .crt, or issue both again with --force"
        )


def _read(path: Path, what: str, made_by: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; it is made by {made_by}") from None
    except PermissionError:
        raise ConfigError(
            f"{what} {path} is not readable by this user (permission denied)"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None


# --- peers ---------------------------------------------------------------------


def peer_common_name(peercert: Mapping[str, object] | None) -> str | None:
    """The subject common name in `SSLObject.getpeercert()` output, or None.

    None when there is no (verified) certificate, it has no common name, or it
    has several different ones: an identity must not be ambiguous.
    """
    if not peercert:
        return None
    subject = peercert.get("subject")
    if not isinstance(subject, tuple):
        return None
    names: set[str] = set()
    for rdn in subject:
        if not isinstance(rdn, tuple):
            continue
        for attribute in rdn:
            if (
                isinstance(attribute, tuple)
                and len(attribute) == 2
                and attribute[0] == "commonName"
                and isinstance(attribute[1], str)
            ):
                names.add(attribute[1])
    return names.pop() if len(names) == 1 else None


def fetch_server_certificate(
    host: str,
    port: int,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    timeout: float = 5.0,
) -> bytes | None:
    """The DER certificate the server at host:port presents, unverified; None if unreachable.

    Blocking (run it in a worker thread). Only for explaining a failure that
    already happened: it lets `describe_tls_failure` say which names the
    server's certificate holds and when it expired. `cert`/`key` are presented
    so that a server requiring a client certificate completes the handshake.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        if cert is not None and key is not None:
            ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
        with (
            socket.create_connection((host, port), timeout=timeout) as sock,
            ctx.wrap_socket(sock, server_hostname=host) as tls,
        ):
            return tls.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return None


def probe_refusal(
    host: str, port: int, ctx: ssl.SSLContext, *, timeout: float = 3.0
) -> BaseException | None:
    """Why the server at host:port refuses this client, by one more handshake; None if it does not.

    Blocking (run it in a worker thread). With TLS 1.3 a server refuses a
    client certificate only after the client's side of the handshake is done,
    with an alert the client reads next; an RPC connection that has already
    written may see only the reset that follows the alert. This handshake
    writes nothing after it, so the alert is what it reads.
    """
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as sock,
            ctx.wrap_socket(sock, server_hostname=host) as tls,
        ):
            tls.recv(1)  # the server sends nothing unprompted but session tickets
    except (ssl.SSLError, ConnectionError) as exc:
        return exc
    except OSError:  # a timeout: the server accepted us and waits for the RPC
        return None
    return None


def format_peer(peer: object) -> str:
    """host:port of a socket address ([v6]:port), or "unknown"."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return _hostport(str(peer[0]), int(peer[1]))
    return "unknown"


def describe_client_refusal(exc: BaseException) -> str:
    """The control plane's side: why an agent's TLS handshake failed, and what to run."""
    cause = _cause(exc)
    if isinstance(cause, ssl.SSLCertVerificationError):
        code: object = getattr(cause, "verify_code", None)
        message = str(getattr(cause, "verify_message", None) or _reason(cause))
        if code in _UNKNOWN_ISSUER:
            return (
                f"its certificate is not signed by this control plane's CA ({message}); "
                "issue the agent's certificate from this CA with `llmgw ctl cert agent NODE`"
            )
        if code == _V_CERT_HAS_EXPIRED:
            return (
                f"its certificate has expired ({message}); issue a new one with "
                "`llmgw ctl cert agent NODE --force`"
            )
        if code == _V_CERT_NOT_YET_VALID:
            return (
                f"its certificate is not valid yet ({message}); check the clocks of the "
                "agent, of this machine and of the machine that issued it"
            )
        if code == _V_INVALID_PURPOSE:
            return (
                f"its certificate is not a client certificate ({message}); "
                "issue one with `llmgw ctl cert agent NODE`"
            )
        return f"its certificate failed verification: {message}"
    if isinstance(cause, ssl.SSLError):
        reason = _reason(cause)
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return (
                "it sent no client certificate; issue one with `llmgw ctl cert agent NODE` "
                "and set tls.cert and tls.key in the agent's config"
            )
        alert = _alert(reason)
        if alert in ("unknown ca", "bad certificate", "certificate unknown"):
            return (
                f"it refused this control plane's certificate ({alert}); copy this control "
                "plane's ca.crt to the agent's tls.ca"
            )
        if alert == "certificate expired":
            return (
                "it refused this control plane's certificate (certificate expired); run "
                "`llmgw ctl cert server --host NAME --force` and restart llmgw-cp"
            )
        if alert is not None:
            return f"it ended the TLS handshake with the alert {alert!r}"
        upper = reason.upper()
        if "WRONG_VERSION_NUMBER" in upper or "HTTP_REQUEST" in upper or "UNEXPECTED" in upper:
            return f"it does not speak TLS ({reason})"
        return f"TLS handshake failed: {reason}"
    if isinstance(cause, ConnectionError | EOFError):
        return "it closed the connection during the TLS handshake"
    if isinstance(cause, TimeoutError):
        return "it did not finish the TLS handshake in time"
    return f"TLS handshake failed: {type(exc).__name__}: {exc}"


# --- failures ------------------------------------------------------------------


def describe_tls_failure(
    exc: BaseException,
    host: str,
    port: int,
    *,
    cert_path: Path | None = None,
    ca_path: Path | None = None,
    server_cert: bytes | None = None,
    node: str | None = None,
) -> str:
    """Say why a TLS connection to host:port failed, and what to change.

    `exc` may be the ssl/socket exception itself or one wrapping it (a
    trio.BrokenResourceError, an exception group). `cert_path` is this side's
    certificate and `ca_path` the CA it trusts, named in the advice when given.
    `server_cert` is the server's DER certificate if it could be had (see
    `fetch_server_certificate`); it tells which names the certificate holds and
    when it expired. `node` is this agent's node id, named in the commands to run.
    """
    where = _hostport(host, port)
    cause = _cause(exc)
    if isinstance(cause, ssl.SSLCertVerificationError):
        return _describe_verify(cause, host, where, ca_path, _parse(server_cert))
    if isinstance(cause, ssl.SSLError):
        return _describe_ssl(cause, where, cert_path, node or "NODE")
    if isinstance(cause, ConnectionRefusedError):
        return (
            f"connection to {where} refused: nothing listens there; "
            "check the control plane is running and the address and port are right"
        )
    if isinstance(cause, ConnectionResetError | ConnectionAbortedError | BrokenPipeError):
        return (
            f"connection to {where} was reset during the TLS handshake: "
            "the peer closed it; check the control plane's log for why it dropped this agent"
        )
    if isinstance(cause, TimeoutError):
        return (
            f"no answer from {where} in time: check the address and that no firewall "
            "drops the traffic"
        )
    if isinstance(cause, socket.gaierror):
        return f"cannot resolve {host!r}: {cause.strerror or cause}; check the address"
    if isinstance(cause, OSError):
        return f"cannot connect to {where}: {cause.strerror or cause}"
    return f"TLS connection to {where} failed: {type(exc).__name__}: {exc}"


def _describe_verify(
    exc: ssl.SSLCertVerificationError,
    host: str,
    where: str,
    ca_path: Path | None,
    server_cert: x509.Certificate | None,
) -> str:
    code: object = getattr(exc, "verify_code", None)
    message = str(getattr(exc, "verify_message", None) or _reason(exc))
    lowered = message.lower()
    subject = f"the certificate of {where}"

    if code in (_V_HOSTNAME_MISMATCH, _V_IP_ADDRESS_MISMATCH) or "mismatch" in lowered:
        held = _names(server_cert) if server_cert is not None else None
        if held:
            # Keep the names it holds (and its first name, the CN) and add the missing one.
            fix = " ".join(f"--host {h}" for h in [*held, host])
            holds = f"it names {', '.join(held)}"
            also = ""
        else:
            fix = f"--host {host}"
            holds = "which names it holds is unknown here"
            also = " with a --host for every other name agents dial"
        return (
            f"{subject} does not name {host}, the address dialled ({holds}); "
            f"on the control plane run `llmgw ctl cert server {fix} --force`{also} "
            "and restart it, or dial a name the certificate holds"
        )
    if code == _V_CERT_HAS_EXPIRED or "expired" in lowered:
        when = f" on {_when(server_cert.not_valid_after_utc)}" if server_cert is not None else ""
        return (
            f"{subject} expired{when}; on the control plane run "
            "`llmgw ctl cert server --host NAME --force` and restart it"
        )
    if code == _V_CERT_NOT_YET_VALID or "not yet valid" in lowered:
        when = (
            f" until {_when(server_cert.not_valid_before_utc)}" if server_cert is not None else ""
        )
        return (
            f"{subject} is not valid yet{when}; check the clocks of this machine "
            "and of the machine that issued it"
        )
    if code in _UNKNOWN_ISSUER or "issuer" in lowered or "self-signed" in lowered:
        if ca_path is None:
            return (
                f"{subject} is not signed by the CA this agent trusts; copy the control "
                "plane's ca.crt to this agent's CA file, or issue the control plane's "
                "certificate from this CA"
            )
        return (
            f"{subject} is not signed by the CA in {ca_path}; copy the control plane's "
            f"ca.crt to {ca_path}, or issue the control plane's certificate from this CA"
        )
    if code == _V_INVALID_PURPOSE or "purpose" in lowered:
        return (
            f"{subject} is not a server certificate (it lacks serverAuth); "
            "issue one with `llmgw ctl cert server --host NAME`"
        )
    return f"{subject} failed verification: {message}"


def _describe_ssl(exc: ssl.SSLError, where: str, cert_path: Path | None, node: str) -> str:
    reason = _reason(exc)
    alert = _alert(reason)
    mine = f" {cert_path}" if cert_path is not None else ""
    own = _own_certificate(cert_path)
    refused = f"the control plane at {where} refused this agent's certificate{mine}"
    if alert == "certificate required":
        return (
            f"the control plane at {where} requires a client certificate and this agent "
            f"sent none; issue one with `llmgw ctl cert agent {node}` and configure it"
        )
    if alert == "unknown ca":
        return (
            f"{refused}: it is not signed by the CA the control plane trusts (unknown ca); "
            f"on the control plane run `llmgw ctl cert agent {node}` and copy the "
            f"agent-{node}.crt and .key it writes, with its ca.crt, to this agent"
        )
    if alert == "certificate expired":
        when = f" on {_when(own.not_valid_after_utc)}" if own is not None else ""
        return (
            f"{refused}: it expired{when} (certificate expired); on the control plane run "
            f"`llmgw ctl cert agent {node} --force` and copy the new agent-{node}.crt and "
            ".key to this agent"
        )
    if own is not None and own.not_valid_before_utc > dt.datetime.now(dt.UTC):
        # OpenSSL sends "bad certificate" for a certificate not valid yet.
        return (
            f"{refused}: it is not valid until {_when(own.not_valid_before_utc)} "
            f"({alert or reason}); check the clocks of this machine and of the machine "
            f"that issued it, or issue it again with `llmgw ctl cert agent {node} --force`"
        )
    if alert in _CLIENT_CERT_ALERTS:
        return (
            f"{refused} ({alert}); check it was issued by the same CA with "
            f"`llmgw ctl cert agent {node}` and has not expired"
        )
    if alert == "handshake failure":
        return (
            f"{where} ended the TLS handshake (handshake failure): it may require a client "
            "certificate this agent did not send, or share no TLS version or cipher with it"
        )
    if alert is not None:
        return f"{where} ended the TLS handshake with the alert {alert!r}"
    upper = reason.upper()
    if "WRONG_VERSION_NUMBER" in upper or "HTTP_REQUEST" in upper or "PACKET_LENGTH" in upper:
        return f"{where} does not speak TLS; check the port is the control plane's RPC port"
    if isinstance(exc, ssl.SSLEOFError) or "EOF" in upper:
        return (
            f"{where} closed the connection during the TLS handshake; "
            "check the control plane's log for why it refused this agent"
        )
    return f"TLS handshake with {where} failed: {reason}"


def _cause(exc: BaseException) -> BaseException:
    """The most telling exception in `exc`'s chain: an ssl one, else an OSError."""
    chain = list(_chain(exc))
    for kind in (ssl.SSLError, OSError):
        for e in chain:
            if isinstance(e, kind):
                return e
    return exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                todo.append(linked)


def _reason(exc: BaseException) -> str:
    """The OpenSSL reason ('SSLV3_ALERT_BAD_CERTIFICATE') or the message."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return reason
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _alert(reason: str) -> str | None:
    # OpenSSL names a received alert "<VERSION>_ALERT_<NAME>",
    # e.g. SSLV3_ALERT_CERTIFICATE_UNKNOWN or TLSV13_ALERT_CERTIFICATE_REQUIRED.
    head, sep, name = reason.upper().partition("_ALERT_")
    if not sep or not head.startswith(("SSL", "TLS")):
        return None
    return name.lower().replace("_", " ")


def _own_certificate(path: Path | None) -> x509.Certificate | None:
    if path is None:
        return None
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _parse(der: bytes | None) -> x509.Certificate | None:
    if der is None:
        return None
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError:
        return None


def _names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n.value) for n in san if isinstance(n, x509.DNSName | x509.IPAddress)]


def _when(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
