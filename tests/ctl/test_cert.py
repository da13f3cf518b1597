"""The offline CA: files, modes, certificate contents, refusals and the CLI."""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.ctl import _cert
from llmgw.ctl._cert import init_ca, issue_agent, issue_server, register
from llmgw.errors import UsageError


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def cn(cert: x509.Certificate) -> str:
    (attr,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attr.value)


def eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


@pytest.fixture
def umask() -> Iterator[None]:
    """A permissive umask, so a key mode of 0600 proves os.open's mode, not the umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    init_ca(d)
    return d


# --- CA -------------------------------------------------------------------------


@pytest.mark.usefixtures("umask")
def test_init_writes_ca_cert_0644_and_key_0600(tmp_path: Path) -> None:
    d = tmp_path / "new" / "pki"
    path = init_ca(d)
    assert path == d / "ca.crt"
    assert sorted(p.name for p in d.iterdir()) == ["ca.crt", "ca.key"]
    assert mode(d / "ca.key") == 0o600
    assert mode(d / "ca.crt") == 0o644


def test_cert_mode_is_0644_even_under_a_strict_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        init_ca(tmp_path)
    finally:
        os.umask(old)
    assert mode(tmp_path / "ca.crt") == 0o644
    assert mode(tmp_path / "ca.key") == 0o600


def test_ca_is_a_p256_sha256_ca_with_a_random_name(tmp_path: Path) -> None:
    a = load(init_ca(tmp_path / "a"))
    b = load(init_ca(tmp_path / "b"))
    assert cn(a).startswith("llmgw CA ")
    assert cn(a) != cn(b)
    assert a.issuer == a.subject
    bc = a.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca is True
    ku = a.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign and not ku.digital_signature
    assert isinstance(a.signature_hash_algorithm, hashes.SHA256)
    public = a.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert public.curve.name == "secp256r1"
    a.verify_directly_issued_by(a)
    key = serialization.load_pem_private_key((tmp_path / "a" / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert key.public_key().public_bytes(*spki) == public.public_bytes(*spki)


def test_ca_days_sets_validity(tmp_path: Path) -> None:
    cert = load(init_ca(tmp_path, days=10))
    now = dt.datetime.now(dt.UTC)
    assert abs(cert.not_valid_after_utc - (now + dt.timedelta(days=10))) < dt.timedelta(minutes=1)
    assert cert.not_valid_before_utc < now


# --- server -----------------------------------------------------------------------


@pytest.mark.usefixtures("umask")
def test_server_cert_sans_cn_eku_and_modes(pki: Path) -> None:
    hosts = ["127.0.0.1", "localhost", "::1", "127.0.0.2", "cp.example.com", "[fe80::1]"]
    cert_path, key_path = issue_server(pki, hosts)
    assert (cert_path, key_path) == (pki / "server.crt", pki / "server.key")
    assert mode(key_path) == 0o600
    assert mode(cert_path) == 0o644
    cert = load(cert_path)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
        ipaddress.ip_address("127.0.0.2"),
        ipaddress.ip_address("fe80::1"),
    ]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "cp.example.com"]
    assert cn(cert) == "127.0.0.1"
    assert eku(cert) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    cert.verify_directly_issued_by(load(pki / "ca.crt"))


def test_server_cert_dedupes_hosts(pki: Path) -> None:
    cert_path, _ = issue_server(pki, ["localhost", "127.0.0.1", "localhost"])
    san = load(cert_path).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert [str(n.value) for n in san.value] == ["localhost", "127.0.0.1"]


@pytest.mark.parametrize("host", ["", "bad host", "-x.example", "a..b", "10.0.0.300", "ä.example"])
def test_server_rejects_a_host_that_is_neither_name_nor_address(pki: Path, host: str) -> None:
    with pytest.raises(UsageError, match="neither an IP address nor a DNS name") as info:
        issue_server(pki, ["localhost", host])
    assert repr(host) in str(info.value)
    assert not (pki / "server.crt").exists()


def test_server_needs_a_host(pki: Path) -> None:
    with pytest.raises(UsageError, match="at least one --host"):
        issue_server(pki, [])


# --- agent ------------------------------------------------------------------------


@pytest.mark.usefixtures("umask")
def test_agent_cert_cn_eku_and_modes(pki: Path) -> None:
    cert_path, key_path = issue_agent(pki, "gpu-01.rack_2")
    assert cert_path == pki / "agent-gpu-01.rack_2.crt"
    assert key_path == pki / "agent-gpu-01.rack_2.key"
    assert mode(key_path) == 0o600
    assert mode(cert_path) == 0o644
    cert = load(cert_path)
    assert cn(cert) == "gpu-01.rack_2"
    assert eku(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert.verify_directly_issued_by(load(pki / "ca.crt"))
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)


def test_agent_explicit_validity_makes_an_expired_cert(pki: Path) -> None:
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    start, end = now - dt.timedelta(days=10), now - dt.timedelta(days=1)
    cert = load(issue_agent(pki, "old", not_before=start, not_after=end)[0])
    assert cert.not_valid_before_utc == start
    assert cert.not_valid_after_utc == end


def test_agent_validity_must_not_end_before_it_starts(pki: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    with pytest.raises(UsageError, match="before it starts"):
        issue_agent(pki, "n1", not_before=now, not_after=now - dt.timedelta(days=1))


@pytest.mark.parametrize("node_id", ["", "a/b", "../x", "a b", "n" * 64, "nöde", "x\n"])
def test_invalid_node_id_is_refused_naming_it(pki: Path, node_id: str) -> None:
    with pytest.raises(UsageError, match="node id") as info:
        issue_agent(pki, node_id)
    assert repr(node_id) in str(info.value)
    assert sorted(p.name for p in pki.iterdir()) == ["ca.crt", "ca.key"]


def test_longest_node_id_is_accepted(pki: Path) -> None:
    cert_path, _ = issue_agent(pki, "n" * 63)
    assert cn(load(cert_path)) == "n" * 63


# --- refusals ---------------------------------------------------------------------


def test_issuing_without_a_ca_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=re.escape(f"run `llmgw ctl cert init --dir {tmp_path}`")):
        issue_agent(tmp_path, "n1")
    with pytest.raises(UsageError, match=re.escape(f"run `llmgw ctl cert init --dir {tmp_path}`")):
        issue_server(tmp_path, ["localhost"])
    assert list(tmp_path.iterdir()) == []


def _issue(kind: str, pki: Path, force: bool) -> None:
    if kind == "ca":
        init_ca(pki, force=force)
    elif kind == "server":
        issue_server(pki, ["localhost"], force=force)
    else:
        issue_agent(pki, "n1", force=force)


@pytest.mark.parametrize(
    ("kind", "files"),
    [
        ("ca", ("ca.crt", "ca.key")),
        ("server", ("server.crt", "server.key")),
        ("agent", ("agent-n1.crt", "agent-n1.key")),
    ],
)
def test_never_overwrites_without_force_and_replaces_with_it(
    pki: Path, kind: str, files: tuple[str, str]
) -> None:
    if kind != "ca":
        _issue(kind, pki, force=False)
    before = {name: (pki / name).read_bytes() for name in files}

    with pytest.raises(UsageError, match="exists; pass --force to replace it") as info:
        _issue(kind, pki, force=False)
    assert str(pki / files[0]) in str(info.value)
    assert {name: (pki / name).read_bytes() for name in files} == before

    _issue(kind, pki, force=True)
    for name in files:
        assert (pki / name).read_bytes() != before[name]
    assert mode(pki / files[1]) == 0o600


def test_an_existing_key_alone_blocks_issuing(pki: Path) -> None:
    (pki / "agent-n1.key").write_bytes(b"precious")
    with pytest.raises(UsageError, match=r"agent-n1\.key exists"):
        issue_agent(pki, "n1")
    assert (pki / "agent-n1.key").read_bytes() == b"precious"
    assert not (pki / "agent-n1.crt").exists()


def test_a_failed_write_leaves_neither_half_a_key_nor_a_temp_file(
    pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="No space left"):
        issue_agent(pki, "n1")
    assert sorted(p.name for p in pki.iterdir()) == ["ca.crt", "ca.key"]


@pytest.mark.usefixtures("umask")
def test_key_bytes_are_never_in_a_file_wider_than_0600(
    pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int]] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            seen.append((st.st_size, stat.S_IMODE(st.st_mode)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    _, key_path = issue_agent(pki, "n1")
    key_size = key_path.stat().st_size
    # The key's bytes were on disk (fsync) with mode 0600 before the rename.
    assert (key_size, 0o600) in seen
    assert all(m in (0o600, 0o644) for _, m in seen)


def test_no_temp_files_are_left_behind(pki: Path) -> None:
    issue_server(pki, ["localhost"])
    issue_agent(pki, "n1")
    issue_agent(pki, "n1", force=True)
    assert sorted(p.name for p in pki.iterdir()) == [
        "agent-n1.crt",
        "agent-n1.key",
        "ca.crt",
        "ca.key",
        "server.crt",
        "server.key",
    ]


# --- command line ----------------------------------------------------------------


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    parser = argparse.ArgumentParser(prog="llmgw ctl")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def test_cli_init_server_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path)
    rc, out, err = cli(["cert", "init", "--dir", d], capsys)
    assert (rc, err) == (0, "")
    assert len(out) == 2
    assert out[0].startswith(f"{tmp_path / 'ca.crt'}: CA certificate")
    assert out[1].startswith(f"{tmp_path / 'ca.key'}: CA private key")

    rc, out, err = cli(
        ["cert", "server", "--host", "127.0.0.1", "--host", "cp.local", "--dir", d], capsys
    )
    assert (rc, err) == (0, "")
    assert out[0].startswith(f"{tmp_path / 'server.crt'}: server certificate for 127.0.0.1, cp")
    assert out[1].startswith(f"{tmp_path / 'server.key'}: server private key")
    assert len(out) == 2

    rc, out, err = cli(["cert", "agent", "n1", "--dir", d, "--days", "7"], capsys)
    assert (rc, err) == (0, "")
    assert out[0].startswith(f"{tmp_path / 'agent-n1.crt'}: agent certificate for node n1")
    assert out[1].startswith(f"{tmp_path / 'agent-n1.key'}: agent private key for node n1")
    cert = load(tmp_path / "agent-n1.crt")
    expected_end = dt.datetime.now(dt.UTC) + dt.timedelta(days=7)
    assert abs(cert.not_valid_after_utc - expected_end) < dt.timedelta(minutes=1)


def test_cli_refuses_overwrite_with_exit_2_and_force_replaces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path)
    assert cli(["cert", "init", "--dir", d], capsys)[0] == 0
    before = (tmp_path / "ca.key").read_bytes()

    rc, out, err = cli(["cert", "init", "--dir", d], capsys)
    assert (rc, out) == (2, [])
    assert err == f"llmgw ctl cert: {tmp_path / 'ca.crt'} exists; pass --force to replace it\n"
    assert (tmp_path / "ca.key").read_bytes() == before

    rc, out, err = cli(["cert", "init", "--dir", d, "--force"], capsys)
    assert (rc, err, len(out)) == (0, "", 2)
    assert (tmp_path / "ca.key").read_bytes() != before


def test_cli_invalid_node_and_missing_ca_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(["cert", "agent", "n1", "--dir", str(tmp_path)], capsys)
    assert (rc, out) == (2, [])
    assert err.startswith("llmgw ctl cert: no CA in")
    assert f"llmgw ctl cert init --dir {tmp_path}" in err

    init_ca(tmp_path)
    rc, out, err = cli(["cert", "agent", "a/b", "--dir", str(tmp_path)], capsys)
    assert (rc, out) == (2, [])
    assert err.startswith("llmgw ctl cert: node id 'a/b' is not valid")


def test_cli_dir_defaults_to_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_PKI_DIR", str(tmp_path / "env"))
    rc, out, _ = cli(["cert", "init"], capsys)
    assert rc == 0
    assert (tmp_path / "env" / "ca.key").exists()
    assert out[0].startswith(str(tmp_path / "env" / "ca.crt"))


def test_default_dir_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_PKI_DIR", raising=False)
    assert _cert.default_pki_dir() == Path("/etc/llmgw/pki")
    monkeypatch.setenv("LLMGW_PKI_DIR", "")
    assert _cert.default_pki_dir() == Path("/etc/llmgw/pki")


def test_cli_unwritable_dir_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc, out, err = cli(["cert", "init", "--dir", str(blocker / "pki")], capsys)
    assert (rc, out) == (1, [])
    assert err.startswith(f"llmgw ctl cert: cannot write {blocker / 'pki'}")


@pytest.mark.parametrize(
    "argv",
    [
        ["cert"],
        ["cert", "server", "--dir", "x"],
        ["cert", "agent"],
        ["cert", "init", "--days", "0"],
        ["cert", "init", "--days", "soon"],
    ],
)
def test_cli_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="llmgw ctl")
    register(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err
