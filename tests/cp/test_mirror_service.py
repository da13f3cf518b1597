"""The weights mirror as `llmgw-cp` serves it: `mirror.dir` in server.yaml, a real process.

tests/cp/test_mirror.py tests the server itself (ranges, manifests, hostile
targets); this file tests that the control plane starts it where the config
says, with its own certificate, and that its port holds nothing but bytes.
"""

from __future__ import annotations

import hashlib
import os
import ssl
from pathlib import Path

import httpx
import pytest

from llmgw.testing.cluster import LocalCluster, free_port, wait_for

pytestmark = pytest.mark.slow


def _weights(root: Path) -> dict[str, bytes]:
    """A version directory `tiny/` of two parts, and its bytes by name."""
    files = {
        "tiny-00001-of-00002.gguf": os.urandom(3 << 20),
        "tiny-00002-of-00002.gguf": b"x" * 1000,
    }
    (root / "tiny").mkdir(parents=True)
    for name, data in files.items():
        (root / "tiny" / name).write_bytes(data)
    return files


def _start(
    cluster: LocalCluster, tmp_path: Path, *, tls: bool
) -> tuple[int, Path, dict[str, bytes]]:
    mirror_dir = tmp_path / "mirror"
    files = _weights(mirror_dir)
    port = free_port()
    cluster.server_extra["mirror"] = {
        "dir": str(mirror_dir),
        "listen": f"127.0.0.1:{port}",
        "tls": tls,
    }
    cluster.setup(["n1"])  # n1: an agent's certificate for the client; no agent is started
    cluster.start_cp()
    assert cluster.cp is not None
    cp = cluster.cp
    scheme = "https" if tls else "http"
    wanted = f"weights mirror on {scheme}://127.0.0.1:{port}/ serving {mirror_dir}"
    wait_for("the mirror's start-up line", lambda: wanted in cp.output(), 10)
    return port, mirror_dir, files


def _agent_tls(cluster: LocalCluster, *, client_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))
    if client_cert:
        ctx.load_cert_chain(str(cluster.pki / "agent-n1.crt"), str(cluster.pki / "agent-n1.key"))
    return ctx


def test_over_tls_a_file_and_a_manifest_with_the_agents_ca(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    port, _, files = _start(cluster, tmp_path, tls=True)
    base = f"https://127.0.0.1:{port}"
    with httpx.Client(verify=_agent_tls(cluster), timeout=10) as client:
        first = "tiny-00001-of-00002.gguf"
        r = client.get(f"{base}/tiny/{first}")
        assert r.status_code == 200
        assert r.content == files[first]
        assert r.headers["content-length"] == str(len(files[first]))
        assert r.headers["accept-ranges"] == "bytes"

        part = client.get(f"{base}/tiny/{first}", headers={"range": "bytes=1000-1999"})
        assert part.status_code == 206
        assert part.content == files[first][1000:2000]

        manifest = client.get(f"{base}/tiny/")
        assert manifest.status_code == 200
        assert manifest.headers["content-type"] == "application/json"
        assert manifest.json() == {
            "files": [
                {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                for name, data in sorted(files.items())
            ]
        }

        # Bytes only: the admin API is not behind this port, with or without a key.
        headers = {"authorization": f"Bearer {cluster.admin_key}"}
        for path in ("/api/v1/nodes", "/healthz", "/v1/models"):
            assert client.get(base + path, headers=headers).status_code == 404, path


def test_over_tls_a_client_without_the_clusters_certificate_is_refused(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    port, _, _ = _start(cluster, tmp_path, tls=True)
    url = f"https://127.0.0.1:{port}/tiny/tiny-00002-of-00002.gguf"
    # Mutual TLS, as on the RPC listener: a client that trusts the CA but has no
    # certificate of its own gets no bytes.
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(url, verify=_agent_tls(cluster, client_cert=False), timeout=10)
    # A client that does not trust the cluster's CA refuses the server.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url, timeout=10)
    # Plain HTTP on a TLS port is not answered with a file.
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout)):
        httpx.get(f"http://127.0.0.1:{port}/tiny/tiny-00002-of-00002.gguf", timeout=5)
    # And the one with the certificate does get them: the refusals above were about TLS.
    ok = httpx.get(url, verify=_agent_tls(cluster), timeout=10)
    assert ok.content == b"x" * 1000


def test_with_tls_false_plain_http(cluster: LocalCluster, tmp_path: Path) -> None:
    port, mirror_dir, files = _start(cluster, tmp_path, tls=False)
    base = f"http://127.0.0.1:{port}"
    second = "tiny-00002-of-00002.gguf"
    r = httpx.get(f"{base}/tiny/{second}", timeout=10)
    assert r.status_code == 200
    assert r.content == files[second]
    # Copied in by hand after the start: served, with nothing to tell the control plane.
    (mirror_dir / "later.bin").write_bytes(b"copied in by hand")
    assert httpx.get(f"{base}/later.bin", timeout=10).content == b"copied in by hand"
    names = [f["name"] for f in httpx.get(f"{base}/tiny/", timeout=10).json()["files"]]
    assert names == sorted(files)
    assert httpx.get(f"{base}/api/v1/nodes", timeout=10).status_code == 404


def test_no_mirror_unless_configured(cluster: LocalCluster) -> None:
    cluster.setup([])
    cluster.start_cp()
    assert cluster.cp is not None
    cp = cluster.cp
    wait_for("the start-up line", lambda: "control plane ready" in cp.output(), 10)
    assert "weights mirror" not in cp.output()
