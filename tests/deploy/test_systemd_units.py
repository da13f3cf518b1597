"""deploy/systemd/ (issue 16): both units pass `systemd-analyze verify` with no warning,
and the settings that keep engines alive and the control plane confined are there.

`systemd-analyze verify` refuses a unit whose ExecStart binary does not exist, and
/opt/llmgw/venv/bin/... exists only on an installed node. So each unit is verified as a
copy in tmp_path whose one change is the ExecStart binary's directory, /opt/llmgw/venv/bin/
replaced by a tmp directory holding executables of those names; the test asserts the
copy differs from the unit in exactly that prefix, so every other byte verified is the
unit's own. (`verify --root=DIR` would avoid the copy, but systemd 252 then wants a whole
unit tree under DIR, sysinit.target included.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, require

UNITS = REPO / "deploy" / "systemd"
PREFIX = "/opt/llmgw/venv/bin/"


def parse(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections -> key -> every value given (systemd allows repeats)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{line!r} before any [Section]"
        key, sep, value = line.partition("=")
        assert sep, f"not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    return parse((UNITS / name).read_text())


def verify(text: str, name: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` on `text` as unit `name`, its ExecStart under tmp."""
    tool = shutil.which("systemd-analyze")
    require(tool is not None, "systemd-analyze (Debian's systemd package) is not installed")
    assert tool is not None
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for exe in ("llmgw-agent", "llmgw-cp"):
        (bin_dir / exe).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / exe).chmod(0o755)
    copy = tmp / name
    copy.write_text(text.replace(PREFIX, f"{bin_dir}/"))
    return subprocess.run(
        [tool, "verify", str(copy)], capture_output=True, text=True, timeout=60, cwd=tmp
    )


@pytest.mark.parametrize("name", ["llmgw-agent.service", "llmgw-cp.service"])
def test_systemd_analyze_verify_passes_without_a_warning(name: str, tmp_path: Path) -> None:
    text = (UNITS / name).read_text()
    assert text.count(PREFIX) == 1, f"{name}: ExecStart should run from {PREFIX}"
    done = verify(text, name, tmp_path)
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"
    # An unknown or misspelt key is only a warning to systemd: none may be printed.
    assert done.stdout + done.stderr == "", f"{name}: {done.stdout}{done.stderr}"
    copied = (tmp_path / name).read_text()
    assert copied.replace(f"{tmp_path}/bin/", PREFIX) == text  # only the prefix differs


def test_verify_catches_what_the_check_is_for(tmp_path: Path) -> None:
    """The check above would see a misspelt key and a missing binary."""
    text = (UNITS / "llmgw-agent.service").read_text()
    typo = verify(text.replace("KillMode=process", "KilMode=process"), "a.service", tmp_path)
    assert "Unknown key 'KilMode'" in typo.stderr
    gone = verify(text.replace("llmgw-agent run", "llmgw-agnt run"), "b.service", tmp_path)
    assert gone.returncode != 0 and "llmgw-agnt" in gone.stderr


def test_agent_unit_keeps_engines_and_leaves_them_their_devices_and_tmp() -> None:
    service = unit("llmgw-agent.service")["Service"]
    assert service["ExecStart"] == [
        "/opt/llmgw/venv/bin/llmgw-agent run --config /etc/llmgw/agent.yaml"
    ]
    assert service["KillMode"] == ["process"]  # engines outlive the agent; it adopts them
    assert service["Restart"] == ["on-failure"]
    assert 1 <= float(service["RestartSec"][0]) <= 30
    assert service["RestartPreventExitStatus"] == ["2"]  # a refused agent.yaml stays failed
    assert service["StandardOutput"] == service["StandardError"] == ["journal"]
    assert service["LimitMEMLOCK"] == ["infinity"]  # RDMA pins memory
    for breaks_engines in (
        "PrivateTmp",
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "MemoryDenyWriteExecute",
        "ProtectHome",
        "ProtectKernelModules",
        "RestrictNamespaces",
        "SystemCallFilter",
        "User",
        "DynamicUser",
    ):
        assert breaks_engines not in service, f"the agent unit sets {breaks_engines}"
    # /usr and /etc read-only; /var (state_dir, weights_dir) stays writable.
    assert service["ProtectSystem"] == ["full"]
    assert service["NoNewPrivileges"] == ["yes"]


def test_every_setting_of_the_agent_unit_says_why() -> None:
    """Each [Service] setting has a comment in the lines above it (its reason)."""
    lines = (UNITS / "llmgw-agent.service").read_text().splitlines()
    start = lines.index("[Service]")
    end = lines.index("[Install]")
    unexplained = []
    for i in range(start + 1, end):
        if not lines[i] or lines[i].startswith("#"):
            continue
        j = i - 1
        while j > start and lines[j] and not lines[j].startswith("#"):
            j -= 1  # a group of settings under one comment
        if j == start or not lines[j].startswith("#"):
            unexplained.append(lines[i])
    assert unexplained == []


def test_cp_unit_is_confined_more_than_the_agent() -> None:
    service = unit("llmgw-cp.service")["Service"]
    assert service["ExecStart"] == ["/opt/llmgw/venv/bin/llmgw-cp --config /etc/llmgw/server.yaml"]
    assert service["Restart"] == ["on-failure"]
    assert service["RestartPreventExitStatus"] == ["2"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]  # the catalog reloads
    assert service["StateDirectory"] == ["llmgw"]  # server.yaml's default state_dir
    for key, want in {
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "NoNewPrivileges": "yes",
        "ProtectKernelModules": "yes",
        "RestrictNamespaces": "yes",
        "SystemCallFilter": "@system-service",
    }.items():
        assert service.get(key) == [want], f"llmgw-cp.service {key}: {service.get(key)}"
    agent = unit("llmgw-agent.service")["Service"]
    assert len(service) > len(agent)
