"""`llmgw-agent install --root DIR`: the files it writes, their modes, and that a second
run writes nothing; agent.yaml loads through the agent's own code path."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw import config
from llmgw.agent import _install
from llmgw.agent._main import load_config
from llmgw.agent._main import main as agent_main
from llmgw.ctl import _cert
from llmgw.errors import ConfigError


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "ca"
    _cert.init_ca(d)
    _cert.issue_agent(d, "node-41")
    return d


def install(pki: Path, root: Path, *extra: str) -> int:
    return agent_main(
        [
            "install",
            "--node", "node-41",
            "--servers", "cp1:7070,cp2:7070",
            "--ca", str(pki / "ca.crt"),
            "--cert", str(pki / "agent-node-41.crt"),
            "--key", str(pki / "agent-node-41.key"),
            "--root", str(root),
            "--no-systemd",
            *extra,
        ]
    )  # fmt: skip


def written(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root: (mode, mtime_ns)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = (Path(dirpath) / name).stat()
            out[str((Path(dirpath) / name).relative_to(root))] = (
                st.st_mode & 0o777,
                st.st_mtime_ns,
            )
    return out


def test_install_writes_pki_and_config_under_root_and_twice_is_unchanged(
    pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "node"
    assert install(pki, root, "--label", "rack=r1", "--fabric", "ib-a=mlx5_0,mlx5_1") == 0
    out = capsys.readouterr().out
    files = written(root)
    assert {k: v[0] for k, v in files.items()} == {
        "etc/llmgw/pki/ca.crt": 0o644,
        "etc/llmgw/pki/agent-node-41.crt": 0o644,
        "etc/llmgw/pki/agent-node-41.key": 0o600,
        "etc/llmgw/agent.yaml": 0o644,
    }
    assert (root / "etc/llmgw/pki/agent-node-41.key").read_bytes() == (
        pki / "agent-node-41.key"
    ).read_bytes()
    assert out.count(": written") == 4
    cfg_path = root / "etc/llmgw/agent.yaml"
    assert (
        f"ExecStart={shlex.join([*_install._program(), 'run', '--config', str(cfg_path)])}" in out
    )
    cfg = load_config(cfg_path)  # the agent's own loader, TLS files checked
    assert cfg.node_id == "node-41"
    assert cfg.addresses == [("cp1", 7070), ("cp2", 7070)]
    assert cfg.labels == {"rack": "r1"}
    assert cfg.fabrics == {"ib-a": config.FabricDecl(adapters=["mlx5_0", "mlx5_1"])}
    assert cfg.tls.key == root / "etc/llmgw/pki/agent-node-41.key"
    # Nothing the node sees by default outside the root.
    assert cfg.state_dir == root / "var/lib/llmgw-agent"
    assert cfg.weights_dir == root / "var/lib/llmgw-weights"

    assert install(pki, root, "--label", "rack=r1", "--fabric", "ib-a=mlx5_0,mlx5_1") == 0
    again = capsys.readouterr().out
    assert again.count(": unchanged") == 4 and ": written" not in again
    assert written(root) == files  # not one mtime moved

    # A changed override rewrites agent.yaml only.
    assert install(pki, root, "--label", "rack=r2") == 0
    third = capsys.readouterr().out
    assert f"{cfg_path}: written" in third and third.count(": unchanged") == 3
    assert load_config(cfg_path).labels == {"rack": "r2"}


def test_dry_run_writes_nothing(
    pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "node"
    assert install(pki, root, "--dry-run") == 0
    assert capsys.readouterr().out.count(": would write") == 4
    assert not root.exists()


def test_refusals_name_the_flag_and_value(
    pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "node"
    assert install(pki, root, "--label", "rack") == 2
    assert "--label: not key=value (got 'rack')" in capsys.readouterr().err
    assert install(pki, root, "--fabric", "ib-a") == 2
    assert "--fabric: not NAME=dev,dev (got 'ib-a')" in capsys.readouterr().err
    (pki / "agent-node-41.key").unlink()
    assert install(pki, root) == 2
    err = capsys.readouterr().err
    assert f"--key {pki / 'agent-node-41.key'}: cannot read: No such file" in err
    assert not root.exists()


def test_systemd_plan_has_the_unit_and_a_drop_in_only_when_paths_differ(tmp_path: Path) -> None:
    options = _install.Options(
        node="n1", servers=("cp:7070",), ca=Path("ca"), cert=Path("c"), key=Path("k")
    )
    unit = (
        "[Service]\nExecStart=/opt/llmgw/venv/bin/llmgw-agent run --config /etc/llmgw/agent.yaml\n"
    )
    pki = (b"ca", b"cert", b"key")
    same = _install.plan(
        options, pki=pki, unit=unit, program=["/opt/llmgw/venv/bin/llmgw-agent"], systemd=True
    )
    assert [str(f.path) for f in same][-1] == "/etc/systemd/system/llmgw-agent.service"
    other = _install.plan(
        options, pki=pki, unit=unit, program=["/srv/venv/bin/llmgw-agent"], systemd=True
    )
    drop_in = other[-1]
    assert drop_in.path == Path("/etc/systemd/system/llmgw-agent.service.d/10-llmgw-install.conf")
    assert drop_in.data.decode().endswith(
        "ExecStart=\nExecStart=/srv/venv/bin/llmgw-agent run --config /etc/llmgw/agent.yaml\n"
    )
    with pytest.raises(ConfigError, match=r"llmgw/deploy/llmgw-agent\.service: not in this"):
        _install.plan(options, pki=pki, unit=None, program=["x"], systemd=True)


_key = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)
_value = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)


@given(st.dictionaries(_key, _value, max_size=4))
def test_labels_round_trip_through_agent_yaml(labels: dict[str, str]) -> None:
    parsed = tuple(_install.parse_label(f"{k}={v}") for k, v in labels.items())
    options = _install.Options(
        node="n1", servers=("cp:7070",), ca=Path("ca"), cert=Path("c"), key=Path("k"), labels=parsed
    )
    body = _install.agent_config(options)
    cfg = config.structure(body, config.AgentConfig, "agent.yaml")
    assert cfg.labels == labels


def test_the_shipped_unit_runs_the_default_install_so_it_needs_no_drop_in() -> None:
    unit = _install._unit_text()  # llmgw/deploy/llmgw-agent.service, the wheel's package data
    assert unit is not None
    options = _install.Options(
        node="n1", servers=("cp:7070",), ca=Path("ca"), cert=Path("c"), key=Path("k")
    )
    files = _install.plan(
        options,
        pki=(b"ca", b"cert", b"key"),
        unit=unit,
        program=["/opt/llmgw/venv/bin/llmgw-agent"],
        systemd=True,
    )
    assert files[-1].path == Path("/etc/systemd/system/llmgw-agent.service")
    assert files[-1].data == unit.encode()
