"""An offline private certificate authority for llmgw's mutual TLS.

The control plane and every node agent trust one CA made here: the control
plane presents a server certificate naming the addresses agents dial, and each
agent presents a client certificate whose common name is its node id. The CA
key never has to leave the machine the operator runs `llmgw ctl cert` on.

Keys are EC P-256, signatures SHA-256. Every file is written to a temporary
name and renamed into place, so a crash leaves either the old file or the new
one, never half a key; keys are created with mode 0600 and never exist with a
wider mode, even for an instant.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import UsageError

PKI_DIR_ENV = "LLMGW_PKI_DIR"
DEFAULT_PKI_DIR = Path("/etc/llmgw/pki")
CA_CERT = "ca.crt"
CA_KEY = "ca.key"

KEY_MODE = 0o600
CERT_MODE = 0o644

# Node ids become file names and certificate common names (at most 64 chars).
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,63}")
_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Certificates start a little in the past so a node whose clock runs a few
# minutes behind the CA's machine does not refuse a certificate issued just now.
_CLOCK_SKEW = dt.timedelta(minutes=5)
_CN_MAX = 64

_CaKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def init_ca(pki_dir: Path, *, force: bool = False, days: int = 3650) -> Path:
    """Make a new CA in `pki_dir` (`ca.crt`, `ca.key`); return the certificate's path."""
    _check_days(days)
    cert_path, key_path = pki_dir / CA_CERT, pki_dir / CA_KEY
    _refuse_existing((cert_path, key_path), force=force)
    pki_dir.mkdir(parents=True, exist_ok=True)

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            # A random suffix makes every CA's name distinct, so a certificate
            # from another llmgw CA fails as "unknown issuer", not as a
            # confusing signature failure against a same-named CA.
            x509.NameAttribute(NameOID.COMMON_NAME, f"llmgw CA {secrets.token_hex(4)}"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_pair(cert_path, key_path, cert, key, force=force)
    return cert_path


def issue_server(
    pki_dir: Path,
    hosts: Sequence[str],
    *,
    force: bool = False,
    days: int = 825,
    name: str = "server",
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> tuple[Path, Path]:
    """Issue the control plane's certificate for `hosts` (DNS names or IP addresses).

    Writes `<name>.crt` and `<name>.key`; returns `(cert_path, key_path)`.
    Agents verify the address they dial against the certificate's names, so
    every name or address an agent may use must be listed.
    """
    _check_name(name, "--name")
    if isinstance(hosts, str):
        # A bare string is a Sequence[str] of its characters; never what was meant.
        hosts = [hosts]
    if not hosts:
        raise UsageError("a server certificate needs at least one --host NAME")
    names: list[x509.GeneralName] = []
    plain: list[str] = []
    for host in hosts:
        san, text = _san_for(host)
        if san not in names:
            names.append(san)
            plain.append(text)
    nb, na = _validity(days, not_before, not_after)
    cert_path, key_path = pki_dir / f"{name}.crt", pki_dir / f"{name}.key"
    _refuse_existing((cert_path, key_path), force=force)
    ca_cert, ca_key = _load_ca(pki_dir)

    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw")]
    if len(plain[0]) <= _CN_MAX:
        # Verifiers use the SAN; the CN is for people reading the certificate.
        subject.append(x509.NameAttribute(NameOID.COMMON_NAME, plain[0]))
    builder = (
        _leaf_builder(x509.Name(subject), key, ca_cert, ca_key, nb, na)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    )
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_pair(cert_path, key_path, cert, key, force=force)
    return cert_path, key_path


def issue_agent(
    pki_dir: Path,
    node_id: str,
    *,
    force: bool = False,
    days: int = 825,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> tuple[Path, Path]:
    """Issue node `node_id`'s client certificate; return `(cert_path, key_path)`.

    The control plane takes the node id from the certificate's common name, so
    an agent cannot claim another node's id without that node's key.
    `not_before`/`not_after` override `days` (tests use them to make an
    expired certificate).
    """
    _check_name(node_id, "node id")
    nb, na = _validity(days, not_before, not_after)
    cert_path, key_path = pki_dir / f"agent-{node_id}.crt", pki_dir / f"agent-{node_id}.key"
    _refuse_existing((cert_path, key_path), force=force)
    ca_cert, ca_key = _load_ca(pki_dir)

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, node_id),
        ]
    )
    cert = (
        _leaf_builder(subject, key, ca_cert, ca_key, nb, na)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_pair(cert_path, key_path, cert, key, force=force)
    return cert_path, key_path


# --- command line ----------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `cert {init,server,agent}` to the `llmgw ctl` sub-commands."""
    cert = subparsers.add_parser(
        "cert",
        help="make the CA and certificates for mutual TLS",
        description=(
            "Run the private CA that the control plane and the node agents trust. "
            "Copy ca.crt to every machine; keep ca.key where you run this command."
        ),
    )
    sub = cert.add_subparsers(dest="cert_command", required=True, metavar="{init,server,agent}")

    p = sub.add_parser("init", help="make a new CA (ca.crt, ca.key)")
    _add_common(p, days=3650)
    p.set_defaults(func=_cmd_init)

    p = sub.add_parser("server", help="issue the control plane's server certificate")
    p.add_argument(
        "--host",
        dest="hosts",
        action="append",
        required=True,
        metavar="NAME",
        help="a DNS name or IP address agents dial; repeat for each",
    )
    _add_common(p, days=825)
    p.set_defaults(func=_cmd_server)

    p = sub.add_parser("agent", help="issue a node agent's client certificate")
    p.add_argument("node", metavar="NODE", help="the node id (letters, digits, . _ -)")
    _add_common(p, days=825)
    p.set_defaults(func=_cmd_agent)


def default_pki_dir() -> Path:
    """`$LLMGW_PKI_DIR` when set and non-empty, else /etc/llmgw/pki."""
    env = os.environ.get(PKI_DIR_ENV)
    return Path(env) if env else DEFAULT_PKI_DIR


def _add_common(p: argparse.ArgumentParser, *, days: int) -> None:
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"the PKI directory (default: ${PKI_DIR_ENV}, else {DEFAULT_PKI_DIR})",
    )
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.add_argument(
        "--days",
        type=_positive_int,
        default=days,
        help=f"validity in days (default: {days})",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of days") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _cmd_init(args: argparse.Namespace) -> int:
    def act(pki_dir: Path) -> list[tuple[Path, str]]:
        cert = init_ca(pki_dir, force=args.force, days=args.days)
        return [
            (cert, f"CA certificate, valid until {_until(cert)}; copy it to every node"),
            (pki_dir / CA_KEY, "CA private key (mode 0600); keep it here, off the nodes"),
        ]

    return _run(args, act)


def _cmd_server(args: argparse.Namespace) -> int:
    def act(pki_dir: Path) -> list[tuple[Path, str]]:
        cert, key = issue_server(pki_dir, args.hosts, force=args.force, days=args.days)
        hosts = ", ".join(args.hosts)
        return [
            (cert, f"server certificate for {hosts}, valid until {_until(cert)}"),
            (key, "server private key (mode 0600)"),
        ]

    return _run(args, act)


def _cmd_agent(args: argparse.Namespace) -> int:
    def act(pki_dir: Path) -> list[tuple[Path, str]]:
        cert, key = issue_agent(pki_dir, args.node, force=args.force, days=args.days)
        return [
            (cert, f"agent certificate for node {args.node}, valid until {_until(cert)}"),
            (key, f"agent private key for node {args.node} (mode 0600)"),
        ]

    return _run(args, act)


def _run(args: argparse.Namespace, act: Callable[[Path], list[tuple[Path, str]]]) -> int:
    pki_dir = args.dir if args.dir is not None else default_pki_dir()
    try:
        written = act(pki_dir)
    except UsageError as e:
        print(f"llmgw ctl cert: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = e.filename if e.filename is not None else pki_dir
        print(f"llmgw ctl cert: cannot write {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    for path, what in written:
        print(f"{path}: {what}")
    return 0


def _until(cert_path: Path) -> str:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.not_valid_after_utc.strftime("%Y-%m-%d")


# --- helpers -----------------------------------------------------------------


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _check_days(days: int) -> None:
    if days < 1:
        raise UsageError(f"--days must be at least 1, got {days}")


def _check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise UsageError(
            f"{what} {value!r} is not valid: use 1 to 63 letters, digits, '.', '_' or '-'"
        )


def _validity(
    days: int, not_before: dt.datetime | None, not_after: dt.datetime | None
) -> tuple[dt.datetime, dt.datetime]:
    _check_days(days)
    now = _now()
    nb = not_before if not_before is not None else now - _CLOCK_SKEW
    na = not_after if not_after is not None else now + dt.timedelta(days=days)
    if na <= nb:
        raise UsageError(f"the certificate would end ({na}) before it starts ({nb})")
    return nb, na


def _san_for(host: str) -> tuple[x509.GeneralName, str]:
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]  # "[::1]" as written in a URL
    try:
        return x509.IPAddress(ipaddress.ip_address(text)), text
    except ValueError:
        pass
    labels = text.split(".")
    if labels and labels[0] == "*":
        labels = labels[1:]
    if (
        not text
        or len(text) > 253
        or not labels
        or not all(_LABEL_RE.fullmatch(label) for label in labels)
        # "10.0.0.300" is a mistyped address, not a host name.
        or labels[-1].isdigit()
    ):
        raise UsageError(
            f"--host {host!r} is neither an IP address nor a DNS name "
            "(like cp.example.com, 10.0.0.5 or ::1)"
        )
    return x509.DNSName(text), text


def _load_ca(pki_dir: Path) -> tuple[x509.Certificate, _CaKey]:
    cert_path, key_path = pki_dir / CA_CERT, pki_dir / CA_KEY
    for path in (cert_path, key_path):
        if not path.exists():
            raise UsageError(
                f"no CA in {pki_dir} ({path.name} is missing); "
                f"run `llmgw ctl cert init --dir {pki_dir}` first"
            )
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError:
        raise UsageError(f"{cert_path} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise UsageError(f"{key_path} is not an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise UsageError(f"{key_path} holds a {type(key).__name__}; the CA key must be EC or RSA")
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if cert.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        raise UsageError(f"{key_path} is not the key of {cert_path}")
    return cert, key


def _leaf_builder(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: _CaKey,
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        # Strict verifiers (Python 3.13's default X509_STRICT) require the AKI.
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )


def _refuse_existing(paths: Sequence[Path], *, force: bool) -> None:
    if force:
        return
    for path in paths:
        if path.exists() or path.is_symlink():
            raise UsageError(f"{path} exists; pass --force to replace it")


def _write_pair(
    cert_path: Path,
    key_path: Path,
    cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    *,
    force: bool,
) -> None:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    # Checked again here, just before writing, so a file that appeared while the
    # key was generated is still not replaced without --force.
    _refuse_existing((cert_path, key_path), force=force)
    _write_atomic(key_path, key_pem, KEY_MODE)
    _write_atomic(cert_path, cert_pem, CERT_MODE)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        # The umask can only have narrowed `mode`; set it exactly (a 0644
        # certificate under umask 077 would otherwise be unreadable to others)
        # before any byte is written.
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
