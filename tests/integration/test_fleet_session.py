"""Issue 2: a real control plane and real agents, on loopback, with real mutual TLS."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.testing.cluster import LocalCluster, wait_for

NODES = ("node-a", "node-b", "node-c")


@pytest.mark.slow
def test_agents_survive_each_side_restarting(cluster: LocalCluster) -> None:
    cluster.setup(NODES)
    cluster.start_cp()
    for node in NODES:
        cluster.start_agent(node)
    cluster.wait_states(dict.fromkeys(NODES, "ready"), timeout=10)

    # kill -9 one agent: unreachable within 15 s; started again: ready.
    cluster.agents["node-b"].kill9()
    cluster.wait_states({"node-b": "unreachable"}, timeout=15)
    assert cluster.states() == {"node-a": "ready", "node-b": "unreachable", "node-c": "ready"}
    cluster.start_agent("node-b")
    cluster.wait_states({"node-b": "ready"}, timeout=15)

    # kill -9 the control plane and start it again: all ready within 15 s, no agent restarted.
    pids = {n: p.pid for n, p in cluster.agents.items()}
    assert cluster.cp is not None
    cluster.cp.kill9()
    restarted_at = time.monotonic()
    cluster.start_cp()
    cluster.wait_states(
        dict.fromkeys(NODES, "ready"), timeout=15 - (time.monotonic() - restarted_at)
    )
    assert {n: p.pid for n, p in cluster.agents.items()} == pids
    assert all(p.alive() for p in cluster.agents.values())
    for node in NODES:
        assert "registered with" in cluster.agents[node].output()

    # SIGTERM to each: exit 0 within 5 s.
    for proc in [*cluster.agents.values(), cluster.cp]:
        rc, took = proc.terminate(timeout=5)
        assert (proc.name, rc) == (proc.name, 0), proc.output()[-2000:]
        assert took < 5


@pytest.mark.slow
def test_agent_stops_on_sigterm_while_cp_is_unreachable(cluster: LocalCluster) -> None:
    """Blocked on a dead stream or in backoff, SIGTERM still ends the agent within 5 s."""
    cluster.setup(["node-a"])
    cluster.start_cp()
    agent = cluster.start_agent("node-a")
    cluster.wait_states({"node-a": "ready"}, timeout=10)
    assert cluster.cp is not None
    cluster.cp.popen.send_signal(19)  # SIGSTOP: the connection stays open and silent
    try:
        time.sleep(1.5)
        rc, took = agent.terminate(timeout=5)
    finally:
        cluster.cp.popen.send_signal(18)  # SIGCONT
    assert rc == 0 and took < 5


@pytest.mark.slow
def test_certificate_for_another_node_is_refused_and_logged(cluster: LocalCluster) -> None:
    cluster.setup(["node-a"])
    cluster.write_agent_config("node-b", cert_node="node-a")
    cluster.start_cp()
    impostor = cluster.start_agent("node-b")
    assert cluster.cp is not None
    wait_for(
        "refusal in the control plane's log",
        lambda: "refused registration" in cluster.cp.output(),
        15,
    )
    line = next(x for x in cluster.cp.output().splitlines() if "refused registration" in x)
    assert "'node-a'" in line and "'node-b'" in line
    wait_for("refusal in the agent's log", lambda: "refused registration" in impostor.output(), 15)
    assert "node-b" not in cluster.nodes()


@pytest.mark.slow
def test_no_client_certificate_is_refused(cluster: LocalCluster) -> None:
    cluster.setup([])
    cluster.start_cp()
    ctx = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))
    with (
        socket.create_connection(("127.0.0.1", cluster.rpc_port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        # TLS 1.3: the client's half of the handshake completes before the server
        # has looked at the (absent) client certificate; the refusal comes on the
        # first read, as an alert or as the connection closing. Never as data.
        assert tls.version() == "TLSv1.3"
        me = f"127.0.0.1:{tls.getsockname()[1]}"
        try:
            got: bytes | str = tls.recv(1)
        except ssl.SSLError as exc:
            got = str(exc.reason)
        except ConnectionResetError:
            got = "reset"
    assert got in (b"", "reset", "TLSV13_ALERT_CERTIFICATE_REQUIRED"), got
    # The control plane says who and why, once, with what to do.
    wait_for("the refusal in the control plane's log", lambda: me in cluster.cp.output(), 10)
    line = next(x for x in cluster.cp.output().splitlines() if me in x)
    assert "refused agent connection" in line and "sent no client certificate" in line, line
    assert "llmgw ctl cert agent" in line
    assert cluster.nodes() == {}  # and registered nothing


@pytest.mark.slow
def test_agent_refuses_a_control_plane_whose_certificate_names_another_address(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(tmp_path / "c", rpc_host="127.0.0.2", server_names=["127.0.0.1"])
    try:
        cluster.setup(["node-a"])
        cluster.start_cp()
        agent = cluster.start_agent("node-a")
        wait_for(
            "the agent's complaint",
            lambda: "127.0.0.2" in agent.output() and "--host" in agent.output(),
            15,
        )
        complaint = next(x for x in agent.output().splitlines() if "--host" in x)
        assert "SSL" not in complaint.split("ERROR", 1)[-1][:40]
        assert "node-a" not in cluster.nodes()
    finally:
        cluster.stop_all()


def test_ctl_with_control_plane_down_says_one_line(tmp_path: Path) -> None:
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "nodes"],
        env={"LLMGW_ADMIN_URL": url, "LLMGW_ADMIN_KEY": "k", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0
    assert "cannot reach the control plane" in done.stderr and url in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_admin_api_needs_the_admin_key(cluster: LocalCluster) -> None:
    import httpx

    cluster.setup([])
    cluster.start_cp()
    key_file = cluster.root / "cp" / "admin.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    url = cluster.admin_url + "/api/v1/nodes"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(url, headers={"Authorization": f"Bearer {cluster.admin_key}"})
    assert ok.status_code == 200 and ok.json() == {"nodes": []}
