"""The node's package manager: the family from os-release, and fake managers on
PATH fed with apt-get's real recorded lock output (tests/data/apt-get-*.txt)."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES
from hypothesis import given
from hypothesis import strategies as st

from llmgw.host.os_release import parse_os_release
from llmgw.host.packages import (
    FAMILIES,
    MANAGERS,
    PackageError,
    PackageInstaller,
    family,
    last_meaningful_line,
    only_lock,
)


def recorded(name: str) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, stderr) of a recorded fixture (format: its header)."""
    raw = (FIXTURES / name).read_bytes()
    body = b"".join(line for line in raw.splitlines(keepends=True) if not line.startswith(b"# "))
    head, rest = body.split(b"\n--- stdout\n", 1)
    stdout, stderr = rest.split(b"--- stderr\n", 1)
    assert head.startswith(b"exit status: ")
    return int(head.removeprefix(b"exit status: ")), stdout, stderr


LOCK = recorded("apt-get-lock-frontend-held.txt")
LISTS_LOCK = recorded("apt-get-update-lists-lock-held.txt")


def fake_manager(
    tmp_path: Path, name: str, fails: int, failure: tuple[int, bytes, bytes]
) -> tuple[Path, Path]:
    """A `name` on PATH that fails `fails` times as recorded (-1: always), then succeeds.

    Returns (bin dir, calls file): each call appends its argv and DEBIAN_FRONTEND.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / f"{name}.calls"
    status, out, err = failure
    (tmp_path / f"{name}.out").write_bytes(out)
    (tmp_path / f"{name}.err").write_bytes(err)
    script = bin_dir / name
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"calls = {str(calls)!r}\n"
        "n = sum(1 for _ in open(calls)) + 1 if os.path.exists(calls) else 1\n"
        "with open(calls, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv, 'frontend': os.environ.get('DEBIAN_FRONTEND')}) + '\\n')\n"
        f"if {fails} < 0 or n <= {fails}:\n"
        f"    sys.stdout.buffer.write(open({str(tmp_path / f'{name}.out')!r}, 'rb').read())\n"
        f"    sys.stderr.buffer.write(open({str(tmp_path / f'{name}.err')!r}, 'rb').read())\n"
        f"    sys.exit({status})\n"
        "print('Setting up libgomp1 (12.2.0-14+deb12u1) ...')\n"
    )
    script.chmod(0o755)
    return bin_dir, calls


def env_with(bin_dir: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', os.defpath)}"}


def calls_of(calls: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def test_the_recorded_outputs_are_lock_only() -> None:
    status, out, err = LOCK
    assert status == 100 and out == b""
    assert err.startswith(
        b"E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process "
    )
    assert only_lock("debian", (out + err).decode())
    assert only_lock("debian", (LISTS_LOCK[1] + LISTS_LOCK[2]).decode())
    # A lock line beside another error is not "only a lock".
    other = (err + b"E: Unable to locate package libgomp9\n").decode()
    assert not only_lock("debian", other)
    assert last_meaningful_line(other) == "E: Unable to locate package libgomp9"


async def test_apt_lock_held_three_times_then_installed(tmp_path: Path) -> None:
    bin_dir, calls = fake_manager(tmp_path, "apt-get", 3, LOCK)
    waits: list[str] = []
    installer = PackageInstaller("debian", retry_s=0.01, env=env_with(bin_dir))
    await installer.install(["libgomp1"], on_wait=waits.append)
    assert waits == ["waiting for another apt-get to finish"]
    seen = calls_of(calls)
    assert len(seen) == 4 and installer.attempts == 4
    for call in seen:
        assert call["argv"] == [
            str(bin_dir / "apt-get"),
            "install",
            "-y",
            "--no-install-recommends",
            "libgomp1",
        ]
        assert call["frontend"] == "noninteractive"


async def test_apt_lock_never_freed_is_named_after_lock_wait(tmp_path: Path) -> None:
    bin_dir, calls = fake_manager(tmp_path, "apt-get", -1, LOCK)
    waits: list[str] = []
    installer = PackageInstaller("debian", lock_wait_s=0.2, retry_s=0.02, env=env_with(bin_dir))
    with pytest.raises(PackageError) as info:
        await installer.install(["libgomp1"], on_wait=waits.append)
    assert str(info.value) == "apt-get: the package lock was held for 0.2 s"
    assert waits == ["waiting for another apt-get to finish"]
    assert len(calls_of(calls)) >= 3


async def test_lock_wait_is_measured_by_the_clock(tmp_path: Path) -> None:
    bin_dir, calls = fake_manager(tmp_path, "apt-get", -1, LOCK)
    ticks = itertools.count(0, 200)  # each look at the clock: 200 s later
    installer = PackageInstaller(
        "debian", retry_s=0, env=env_with(bin_dir), clock=lambda: float(next(ticks))
    )
    with pytest.raises(PackageError, match=r"^apt-get: the package lock was held for 10 min$"):
        await installer.install(["libgomp1"])
    assert len(calls_of(calls)) == 4  # at 0, 200, 400 and 600 s


async def test_rhel_node_gets_dnf_install_libgomp(tmp_path: Path) -> None:
    osr = parse_os_release((FIXTURES / "osrelease-rhel-9.6.txt").read_text())
    fam = family(osr.id, osr.id_like)
    assert fam == "rhel"
    bin_dir, calls = fake_manager(tmp_path, "dnf", 0, (1, b"", b""))
    await PackageInstaller(fam, env=env_with(bin_dir)).install(["libgomp"])
    assert [c["argv"] for c in calls_of(calls)] == [
        [str(bin_dir / "dnf"), "install", "-y", "libgomp"]
    ]


async def test_rhel_without_dnf_falls_back_to_yum(tmp_path: Path) -> None:
    bin_dir, calls = fake_manager(tmp_path, "yum", 0, (1, b"", b""))
    await PackageInstaller("rhel", env={"PATH": str(bin_dir)}).install(["libgomp"])
    assert [c["argv"] for c in calls_of(calls)] == [
        [str(bin_dir / "yum"), "install", "-y", "libgomp"]
    ]


async def test_a_failure_that_is_not_a_lock_names_the_last_line(tmp_path: Path) -> None:
    out = b"Reading package lists...\nBuilding dependency tree...\n"
    err = b"E: Unable to locate package libgomp9\n"
    bin_dir, calls = fake_manager(tmp_path, "apt-get", -1, (100, out, err))
    waits: list[str] = []
    with pytest.raises(PackageError) as info:
        await PackageInstaller("debian", retry_s=0.01, env=env_with(bin_dir)).install(
            ["libgomp9"], on_wait=waits.append
        )
    # Not found even after `apt-get update` (tried once): the install's own last line,
    # and what the update said.
    assert str(info.value) == (
        "apt-get install libgomp9 exited 100: E: Unable to locate package libgomp9; "
        "apt-get update did not help: E: Unable to locate package libgomp9"
    )
    argvs = [c["argv"][1] for c in calls_of(calls)]
    assert argvs == ["install", "update"]
    assert waits == ["apt-get knows no such package: running apt-get update"]


async def test_a_fresh_image_without_package_lists_is_updated_once_then_installed(
    tmp_path: Path,
) -> None:
    """A cloud image or container ships no apt lists: the first install finds nothing
    ("Unable to locate package"); `apt-get update` runs once and the install again."""
    err = b"E: Unable to locate package libgomp1\n"
    bin_dir, calls = fake_manager(tmp_path, "apt-get", 1, (100, b"", err))
    waits: list[str] = []
    installer = PackageInstaller("debian", retry_s=0.01, env=env_with(bin_dir))
    await installer.install(["libgomp1"], on_wait=waits.append)
    argvs = [c["argv"][1:] for c in calls_of(calls)]
    assert argvs == [
        ["install", "-y", "--no-install-recommends", "libgomp1"],
        ["update"],
        ["install", "-y", "--no-install-recommends", "libgomp1"],
    ]
    assert waits == ["apt-get knows no such package: running apt-get update"]


async def test_not_root_is_refused_with_the_command_to_run(tmp_path: Path) -> None:
    bin_dir, calls = fake_manager(tmp_path, "apt-get", 0, LOCK)
    installer = PackageInstaller("debian", env=env_with(bin_dir), euid=lambda: 1000)
    with pytest.raises(PackageError) as info:
        await installer.install(["libgomp1"])
    assert str(info.value) == "installing libgomp1 needs root; run: apt-get install libgomp1"
    assert calls_of(calls) == []


async def test_no_manager_on_path_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        PackageError, match=r"^installing libgomp1 needs zypper, which is not on PATH$"
    ):
        await PackageInstaller("suse", env={"PATH": str(empty)}).install(["libgomp1"])


async def test_a_manager_that_hangs_is_killed_at_the_bound(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "zypper").write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    (bin_dir / "zypper").chmod(0o755)
    with pytest.raises(
        PackageError, match=r"^zypper install libgomp1 did not finish within 0.3 s$"
    ):
        await PackageInstaller("suse", timeout_s=0.3, env={"PATH": str(bin_dir)}).install(
            ["libgomp1"]
        )


@pytest.mark.parametrize(
    ("os_id", "os_like", "expected"),
    [
        ("ubuntu", ("debian",), "debian"),
        ("debian", (), "debian"),
        ("rocky", ("rhel", "centos", "fedora"), "rhel"),
        ("almalinux", ("rhel", "centos", "fedora"), "rhel"),
        ("centos", ("rhel", "fedora"), "rhel"),
        ("fedora", (), "rhel"),
        ("amzn", ("fedora",), "rhel"),
        ("rhel", ("fedora",), "rhel"),
        ("opensuse-leap", ("suse", "opensuse"), "suse"),
        ("opensuse-tumbleweed", (), "suse"),
        ("sles", (), "suse"),
        ("pop", ("ubuntu", "debian"), "debian"),
        ("somethingnew", ("ubuntu", "debian"), "debian"),
        ("arch", (), None),
        (None, (), None),
    ],
)
def test_family(os_id: str | None, os_like: tuple[str, ...], expected: str | None) -> None:
    assert family(os_id, os_like) == expected


@given(st.one_of(st.none(), st.text(max_size=12)), st.lists(st.text(max_size=12), max_size=4))
def test_family_is_a_known_one_or_none_and_id_decides(
    os_id: str | None, os_like: list[str]
) -> None:
    got = family(os_id, os_like)
    assert got is None or got in FAMILIES
    if family(os_id, ()) is not None:
        assert got == family(os_id, ())
    assert set(MANAGERS) == set(FAMILIES)
