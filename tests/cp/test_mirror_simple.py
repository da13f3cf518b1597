"""The mirror's simple index (PEP 503 / PEP 691): real pip against real sockets on loopback."""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import ssl
import sys
import zipfile
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from hypothesis import given
from hypothesis import strategies as st

from llmgw.cp._weights._mirror import ManifestCache, serve_mirror
from llmgw.cp._weights._paths import (
    SIMPLE_JSON,
    is_project_name,
    normalize,
    project_list,
    project_page,
    wants_json,
)

PIP_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html; q=0.1, "
    "text/html; q=0.01"
)  # what pip 23 sends


def build_wheel(directory: Path, dist: str, version: str) -> Path:
    """A minimal, valid pure-Python wheel (METADATA, WHEEL, RECORD), built with zipfile."""
    name = f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n").encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={hashlib.sha256(data).hexdigest()},{len(data)}\n"
        for path, data in files.items()
    )
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / name, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return directory / name


@pytest.fixture
async def index(tmp_path: Path) -> AsyncIterator[tuple[str, Path, ManifestCache]]:
    root = tmp_path / "mirror"
    # An operator's un-normalized directory name: the project is tiny-engine.
    build_wheel(root / "simple" / "Tiny_Engine", "tiny_engine", "1.0")
    build_wheel(root / "simple" / "Tiny_Engine", "tiny_engine", "1.1")
    (root / "simple" / "Tiny_Engine" / "notes.txt").write_text("not a distribution")
    (root / "simple" / "Tiny_Engine" / ".tiny_engine-2.0-py3-none-any.whl.part").write_bytes(b"x")
    (root / "simple" / ".hidden").mkdir()
    (root / "tiny").mkdir()
    (root / "tiny" / "a.gguf").write_bytes(b"weights")
    cache = ManifestCache()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mirror, root, "127.0.0.1", 0, cache=cache))
        yield f"http://127.0.0.1:{port}", root, cache
        nursery.cancel_scope.cancel()


async def pip_download(
    url: str, requirement: str, dest: Path, *extra: str
) -> trio.CompletedProcess[bytes]:
    # Only what the test says: no PIP_* setting of this machine (find-links, a CA), and
    # no CA bundle variable, which requests lets win over pip's --cert.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") and k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
    }
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--no-input",
            "--index-url", f"{url}/simple/", *extra, requirement, "-d", str(dest)]  # fmt: skip
    with trio.fail_after(120):
        return await trio.run_process(argv, env=env, capture_stdout=True, capture_stderr=True,
                                      check=False)  # fmt: skip


@pytest.mark.slow
async def test_real_pip_downloads_a_wheel_and_a_missing_version_fails(
    index: tuple[str, Path, ManifestCache], tmp_path: Path
) -> None:
    url, root, _ = index
    dest = tmp_path / "dl"
    done = await pip_download(url, "tiny-engine==1.0", dest)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = dest / "tiny_engine-1.0-py3-none-any.whl"
    wheel = root / "simple" / "Tiny_Engine" / got.name
    assert got.read_bytes() == wheel.read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == [got.name]

    missing = await pip_download(url, "tiny-engine==9.9", tmp_path / "dl2")
    assert missing.returncode != 0
    err = missing.stderr.decode()
    assert "No matching distribution found for tiny-engine==9.9" in err
    assert "from versions: 1.0, 1.1" in err  # it read the index, and found what is there


@pytest.mark.slow
async def test_real_pip_over_tls_with_a_client_certificate(tmp_path: Path) -> None:
    """As llmgw-cp serves it by default (mirror.tls): the client must hold a certificate."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(server_ctx)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client = ca.issue_cert("node-1")
    client.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    root = tmp_path / "mirror"
    build_wheel(root / "simple" / "vllm", "vllm", "0.9.2")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(serve_mirror, root, "127.0.0.1", 0, ssl_context=server_ctx)
        )
        url = f"https://127.0.0.1:{port}"
        cert = ("--cert", str(tmp_path / "ca.pem"))
        done = await pip_download(url, "vllm==0.9.2", tmp_path / "dl", *cert,
                                  "--client-cert", str(tmp_path / "client.pem"))  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        assert [p.name for p in (tmp_path / "dl").iterdir()] == ["vllm-0.9.2-py3-none-any.whl"]
        # Without a client certificate the handshake is refused: pip finds nothing.
        refused = await pip_download(url, "vllm==0.9.2", tmp_path / "dl2", *cert, "--retries", "0")
        assert refused.returncode != 0
        assert "No matching distribution found for vllm==0.9.2" in refused.stderr.decode()
        nursery.cancel_scope.cancel()


async def test_json_and_html_pages_with_hashes(index: tuple[str, Path, ManifestCache]) -> None:
    url, root, cache = index
    wheels = sorted((root / "simple" / "Tiny_Engine").glob("*.whl"))
    digests = {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in wheels}
    async with httpx.AsyncClient(base_url=url) as client:
        top = await client.get("/simple/", headers={"accept": PIP_ACCEPT})
        assert top.headers["content-type"] == SIMPLE_JSON
        assert top.json() == {"meta": {"api-version": "1.0"}, "projects": [{"name": "tiny-engine"}]}
        page = await client.get("/simple/tiny-engine/", headers={"accept": PIP_ACCEPT})
        assert page.status_code == 200 and page.headers["vary"] == "accept"
        assert page.json() == {
            "meta": {"api-version": "1.0"},
            "name": "tiny-engine",
            "files": [
                {
                    "filename": name,
                    "url": f"/simple/Tiny_Engine/{name}",
                    "hashes": {"sha256": digests[name]},
                }
                for name in sorted(digests)
            ],
        }
        # The link is a plain file of the mirror.
        first = page.json()["files"][0]
        body = await client.get(first["url"])
        assert hashlib.sha256(body.content).hexdigest() == first["hashes"]["sha256"]
        # Any spelling of the name finds the project.
        same = await client.get("/simple/TINY.engine/", headers={"accept": SIMPLE_JSON})
        assert same.json() == page.json()

        # No JSON in Accept (an old pip, a browser): PEP 503's HTML.
        old = await client.get("/simple/tiny-engine/", headers={"accept": "text/html"})
        assert old.headers["content-type"] == "text/html; charset=utf-8"
        assert _links(old.text) == [
            (f"/simple/Tiny_Engine/{n}#sha256={digests[n]}", n) for n in sorted(digests)
        ]
        top_html = await client.get("/simple/")
        assert _links(top_html.text) == [("/simple/tiny-engine/", "tiny-engine")]

        # Everything else stays: a directory elsewhere is the JSON manifest.
        manifest = await client.get("/tiny/")
        assert manifest.headers["content-type"] == "application/json"
        assert [f["name"] for f in manifest.json()["files"]] == ["a.gguf"]
    assert cache.statistics().hashed == 3  # two wheels and a.gguf, each read once


async def test_hostile_and_unknown_project_names(index: tuple[str, Path, ManifestCache]) -> None:
    url, _, _ = index
    async with httpx.AsyncClient(base_url=url) as client:
        for target, status in [
            ("/simple/%2e%2e/", 400),
            ("/simple/..%2Fetc/", 400),
            ("/simple/a%00b/", 400),
            ("/simple/.hidden/", 404),
            ("/simple/-bad-/", 404),
            ("/simple/%3Cscript%3E/", 404),
            ("/simple/nothing-here/", 404),
        ]:
            got = await client.get(target, headers={"accept": PIP_ACCEPT})
            assert got.status_code == status, target
            # Never HTML: a name echoed in a refusal is plain text.
            assert got.headers["content-type"] == "text/plain; charset=utf-8", target


async def test_no_simple_directory_is_an_empty_index(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mirror, tmp_path / "m", "127.0.0.1", 0))
        async with httpx.AsyncClient() as client:
            got = await client.get(f"http://127.0.0.1:{port}/simple/",
                                   headers={"accept": SIMPLE_JSON})  # fmt: skip
        assert got.json() == {"meta": {"api-version": "1.0"}, "projects": []}
        nursery.cancel_scope.cancel()


def test_accept_negotiation() -> None:
    assert wants_json(PIP_ACCEPT.encode())
    assert wants_json(SIMPLE_JSON.encode())
    assert not wants_json(None)
    assert not wants_json(b"text/html")
    assert not wants_json(b"application/vnd.pypi.simple.v1+json; q=0, text/html")
    assert not wants_json(b"application/vnd.pypi.simple.v1+json; q=x")


def test_normalize_as_pep_503() -> None:
    assert normalize("Friendly-Bard") == normalize("FRIENDLY-BARD") == "friendly-bard"
    assert normalize("friendly.bard") == normalize("friendly_bard") == "friendly-bard"
    assert normalize("Friendly--._Bard") == "friendly-bard"
    assert is_project_name("a") and is_project_name("A.b_c-1")
    assert not any(is_project_name(n) for n in ["", "-a", "a-", "a b", "<a>", "a/b", "é"])


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((self._href, data))
            self._href = None


def _links(text: str) -> list[tuple[str, str]]:
    parser = _Anchors()
    parser.feed(text)
    return parser.links


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_every_name_in_the_html_is_escaped(name: str, filename: str) -> None:
    digest = "0" * 64
    page = project_page(name, [(filename, f"simple/{name}/{filename}", digest)], False).decode()
    top = project_list([name], False).decode()
    for text in (page, top):
        body = text.split("<body>", 1)[1]
        # Nothing but the anchors are markup: no name can open a tag or an attribute.
        assert body.count("<") == body.count(">") == 2 * body.count("<a ") + 2
    assert _links(page) == [(f"/simple/{_q(name)}/{_q(filename)}#sha256={digest}", filename)]
    assert (
        json.loads(project_page(name, [(filename, "p", digest)], True))["files"][0]["filename"]
        == filename
    )


def _q(s: str) -> str:
    from urllib.parse import quote

    return quote(s)
