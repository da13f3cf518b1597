"""`llmgw ctl onboard` end to end: a real sshd on loopback, a control plane whose mirror
serves a release built by scripts/dist, and a "node" that is a directory (`--node-root`),
so nothing is written outside tmp_path. The agent is started the way its unit would
(`--no-systemd`: there is no systemd to run it here; the unit itself is verified by
tests/deploy)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Sshd, require_sshd, sshd

from llmgw.testing.cluster import LocalCluster, wait_for

REPO = Path(__file__).resolve().parents[2]
# The interpreter the node's venv is made with: the one the wheelhouse was built for.
NODE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def build_release(tmp: Path) -> Path:
    dist = tmp / "dist"
    done = subprocess.run(
        [str(REPO / "scripts" / "dist")],
        # pip's cache too stays in tmp: nothing is written outside it.
        env={
            **os.environ,
            "DIST": str(dist),
            "PYTHON": sys.executable,
            "PIP_CACHE_DIR": str(tmp / "pip-cache"),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"scripts/dist: rc={done.returncode}\n{done.stderr[-3000:]}"
    return dist


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One release for the module's tests; each copies it into its own mirror (one
    tampers with its copy)."""
    require_sshd()
    return build_release(tmp_path_factory.mktemp("release"))


@contextlib.contextmanager
def fleet(tmp_path: Path, dist: Path) -> Iterator[tuple[LocalCluster, Sshd]]:
    require_sshd()
    cluster = LocalCluster(tmp_path / "fleet")
    cluster.mirror_dir = tmp_path / "mirror"
    shutil.copytree(dist, cluster.mirror_dir / "llmgw")  # as `ctl release publish` lays it out
    cluster.setup([])
    cluster.start_cp()
    try:
        with sshd(tmp_path / "ssh") as server:
            yield cluster, server
    finally:
        cluster.stop_all()


def onboard(
    cluster: LocalCluster, server: Sshd, node: str, root: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "llmgw", "ctl", "onboard", node, "--ssh", "root@127.0.0.1"]
    for option in server.options:
        argv += ["--ssh-option", option]
    argv += ["--cp", f"127.0.0.1:{cluster.rpc_port}"]
    argv += ["--mirror", f"https://127.0.0.1:{cluster.mirror_port}/"]
    argv += ["--pki-dir", str(cluster.pki), "--node-root", str(root), "--no-systemd"]
    argv += ["--python", NODE_PYTHON, "--wait-s", "90", *extra]
    env = {
        **cluster.env,
        "LLMGW_ADMIN_URL": cluster.admin_url,
        "LLMGW_ADMIN_KEY": cluster.admin_key,
    }
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


def files_under(*dirs: Path) -> dict[str, int]:
    out = {}
    for d in dirs:
        for dirpath, _, names in os.walk(d):
            for name in names:
                p = Path(dirpath) / name
                out[str(p)] = p.lstat().st_mtime_ns
    return out


def kill_agent(root: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.kill(int((root / "var/lib/llmgw-agent/agent.pid").read_text()), signal.SIGTERM)


@pytest.mark.slow
def test_onboard_installs_from_the_mirror_starts_the_agent_and_twice_changes_nothing(
    tmp_path: Path, release: Path
) -> None:
    root = tmp_path / "node-41"
    with fleet(tmp_path, release) as (cluster, server):
        try:
            dry = onboard(cluster, server, "node-41", root, "--label", "rack=r1", "--dry-run")
            assert dry.returncode == 0, dry.stdout + dry.stderr
            steps = [line.split(":")[0] for line in dry.stdout.splitlines()]
            assert sorted(set(steps)) == [
                "step cert", "step copy", "step install-agent", "step install-llmgw", "step wait"
            ], dry.stdout  # fmt: skip
            assert "would run: ssh -o BatchMode=yes" in dry.stdout
            assert "--label rack=r1 --root" in dry.stdout
            assert not root.exists() and not (cluster.pki / "agent-node-41.crt").exists()

            first = onboard(cluster, server, "node-41", root, "--label", "rack=r1")
            assert first.returncode == 0, first.stdout + first.stderr
            out = first.stdout
            assert f"step cert: {cluster.pki / 'agent-node-41.crt'}: issued" in out
            assert out.count("step copy: ") == 4 and "written" in out
            assert "step wait: node-41 is ready" in out
            assert "labels: rack=r1" in out

            # Installed from the mirror's release, into the node's root only.
            agent_bin = root / "opt/llmgw/venv/bin/llmgw-agent"
            assert agent_bin.exists()
            probe = (
                "import importlib.metadata as m, llmgw; print(m.version('llmgw'), llmgw.__file__)"
            )
            shown = subprocess.run(
                [str(root / "opt/llmgw/venv/bin/python"), "-c", probe],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=tmp_path,
            )
            wheel = next((cluster.mirror_dir or tmp_path).glob("llmgw/llmgw-*.whl")).name
            version, where = shown.stdout.split()
            assert version == wheel.split("-")[1]
            assert where.startswith(str(root / "opt/llmgw/venv/")), where  # not the source tree
            assert (root / "etc/llmgw/pki/agent-node-41.key").stat().st_mode & 0o777 == 0o600
            # The installed wheel carries the unit: with systemd, install would write it.
            unit = subprocess.run(
                [str(agent_bin), "install", "--node", "node-41", "--servers", "cp:7070",
                 "--ca", str(root / "etc/llmgw/pki/ca.crt"),
                 "--cert", str(root / "etc/llmgw/pki/agent-node-41.crt"),
                 "--key", str(root / "etc/llmgw/pki/agent-node-41.key"),
                 "--root", str(root), "--dry-run"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert unit.returncode == 0, unit.stderr
            assert f"{root}/etc/systemd/system/llmgw-agent.service: would write" in unit.stdout
            assert "systemctl enable --now llmgw-agent.service (dry run)" in unit.stdout
            pid = int((root / "var/lib/llmgw-agent/agent.pid").read_text())
            os.kill(pid, 0)  # alive, detached from the ssh session that started it

            node = cluster.nodes()["node-41"]
            assert node["state"] == "ready"
            assert node["inventory"]["labels"] == [{"key": "rack", "value": "r1"}]

            before = files_under(root / "etc", root / "opt/llmgw/onboard")
            before[str(agent_bin)] = agent_bin.lstat().st_mtime_ns
            second = onboard(cluster, server, "node-41", root, "--label", "rack=r1")
            assert second.returncode == 0, second.stdout + second.stderr
            again = second.stdout
            assert f"step cert: {cluster.pki / 'agent-node-41.crt'}: unchanged" in again
            assert again.count(": unchanged") >= 1 + 4 + 4, again  # cert, copies, files
            assert "written" not in again and "issued" not in again
            assert f"agent running (pid {pid}): unchanged" in again
            assert "already installed" in again
            after = files_under(root / "etc", root / "opt/llmgw/onboard")
            after[str(agent_bin)] = agent_bin.lstat().st_mtime_ns
            assert after == before  # not one file rewritten
            assert int((root / "var/lib/llmgw-agent/agent.pid").read_text()) == pid
            os.kill(pid, 0)
            assert cluster.nodes()["node-41"]["state"] == "ready"
        finally:
            kill_agent(root)


@pytest.mark.slow
def test_a_tampered_wheel_in_the_mirror_is_refused_naming_it(tmp_path: Path, release: Path) -> None:
    root = tmp_path / "node-42"
    with fleet(tmp_path, release) as (cluster, server):
        assert cluster.mirror_dir is not None
        victim = sorted((cluster.mirror_dir / "llmgw" / "wheelhouse").glob("*.whl"))[0]
        with victim.open("ab") as f:
            f.write(b"tampered")
        try:
            done = onboard(cluster, server, "node-42", root)
        finally:
            kill_agent(root)
        assert done.returncode != 0, done.stdout
        assert "step install-llmgw failed on node-42" in done.stderr, done.stderr
        assert f"wheelhouse/{victim.name}: sha256 mismatch" in done.stderr, done.stderr
        assert "refusing to install" in done.stderr
        assert not (root / "opt/llmgw/venv/bin/llmgw-agent").exists()
        assert not (root / "etc/llmgw/agent.yaml").exists()
        assert "node-42" not in cluster.nodes()


@pytest.mark.slow
def test_install_from_the_mirror_on_the_node_itself_without_ssh(
    tmp_path: Path, release: Path
) -> None:
    """For fleets provisioned by their own tooling (cloud-init, Ansible): the node holds
    its certificate and runs `llmgw-agent install --from https://CP:PORT/` itself; the
    release is installed from the mirror and that installation writes the configuration
    and starts the agent, which registers with its labels."""
    require_sshd()  # not used here; the fleet fixture starts one
    root = tmp_path / "node-43"
    with fleet(tmp_path, release) as (cluster, _server):
        from llmgw.ctl import _cert

        _cert.issue_agent(cluster.pki, "node-43")
        argv = [sys.executable, "-m", "llmgw.agent", "install"]
        argv += ["--from", f"https://127.0.0.1:{cluster.mirror_port}/"]
        argv += ["--node", "node-43", "--servers", f"127.0.0.1:{cluster.rpc_port}"]
        argv += ["--ca", str(cluster.pki / "ca.crt")]
        argv += ["--cert", str(cluster.pki / "agent-node-43.crt")]
        argv += ["--key", str(cluster.pki / "agent-node-43.key")]
        argv += ["--label", "rack=r3", "--root", str(root), "--no-systemd", "--start"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "step install: llmgw" in done.stdout, done.stdout
            assert "step start: agent started" in done.stdout, done.stdout
            # The agent runs from the node's new venv, not from this tree's.
            execs = [ln for ln in done.stdout.splitlines() if ln.startswith("step exec:")]
            assert execs and str(root / "opt/llmgw/venv/bin/llmgw-agent") in execs[0], execs
            node = wait_for(
                "node-43 ready",
                lambda: (n := cluster.nodes().get("node-43")) and n["state"] == "ready" and n,
                90,
            )
            assert node["inventory"]["labels"] == [{"key": "rack", "value": "r3"}]
        finally:
            kill_agent(root)
