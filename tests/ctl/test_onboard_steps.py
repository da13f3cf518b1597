"""`ctl onboard`'s pieces without ssh: the remote file write run by a real sh, the
certificate reuse rule, the mirror derived from --cp."""

from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path

from llmgw.ctl import _cert, _onboard


def put(path: Path, data: bytes, mode: int) -> str:
    done = subprocess.run(
        ["sh", "-c", _onboard.put_command(str(path), mode)],
        input=data,
        capture_output=True,
        timeout=30,
        check=True,
    )
    return done.stdout.decode().strip()


def test_put_writes_once_then_says_unchanged_and_keeps_the_mtime(tmp_path: Path) -> None:
    target = tmp_path / "opt" / "llmgw" / "onboard" / "agent-n1.key"
    assert put(target, b"secret", 0o600) == "written"
    assert target.read_bytes() == b"secret"
    assert target.stat().st_mode & 0o777 == 0o600
    assert target.parent.stat().st_mode & 0o777 == 0o700
    mtime = target.stat().st_mtime_ns
    assert put(target, b"secret", 0o600) == "unchanged"
    assert target.stat().st_mtime_ns == mtime
    assert not (target.parent / "agent-n1.key.tmp").exists()
    assert put(target, b"other", 0o600) == "written"
    assert target.read_bytes() == b"other"


def test_a_certificate_is_reused_only_when_valid_for_this_node_and_ca(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    pki = tmp_path / "pki"
    _cert.init_ca(pki)
    cert, _ = _cert.issue_agent(pki, "n1")
    ca = pki / "ca.crt"
    assert _onboard.cert_is_reusable(cert, ca, "n1", now=now)
    assert not _onboard.cert_is_reusable(cert, ca, "n2", now=now)  # another node's name
    assert not _onboard.cert_is_reusable(pki / "missing.crt", ca, "n1", now=now)
    _cert.issue_agent(pki, "n1", force=True, not_after=now + dt.timedelta(hours=2))
    assert not _onboard.cert_is_reusable(cert, ca, "n1", now=now)  # expires within a day
    other = tmp_path / "other"
    _cert.init_ca(other)
    _cert.issue_agent(other, "n1")
    assert not _onboard.cert_is_reusable(other / "agent-n1.crt", ca, "n1", now=now)


def test_the_mirror_defaults_to_the_first_control_plane_on_8082() -> None:
    assert _onboard.mirror_from_cp(["cp1:7070", "cp2:7070"]) == "https://cp1:8082/"
    assert _onboard.mirror_from_cp(["[::1]:7070"]) == "https://[::1]:8082/"
