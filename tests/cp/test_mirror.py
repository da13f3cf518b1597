"""The weights mirror (llmgw/cp/_weights/_mirror.py), through real sockets on loopback."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import attrs
import h11
import httpx
import pytest
import trio
import trustme
from hypothesis import given
from hypothesis import strategies as st

from llmgw.cp._weights._mirror import MIRROR_LIMITS, ManifestCache, serve_mirror
from llmgw.cp._weights._paths import UNSATISFIABLE, Refusal, Target, parse_range, parse_target

PART_A = bytes(range(256)) * 40  # 10240 bytes
PART_B = b"the second part\n" * 100


class Mirror:
    def __init__(self, port: int, root: Path, cache: ManifestCache) -> None:
        self.port = port
        self.root = root
        self.cache = cache
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture
async def mirror(tmp_path: Path) -> AsyncIterator[Mirror]:
    root = tmp_path / "mirror"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "a.gguf").write_bytes(PART_A)
    (root / "tiny" / "b.gguf").write_bytes(PART_B)
    (root / "tiny" / "sub").mkdir()
    (root / "tiny" / "sub" / "deep.bin").write_bytes(b"not listed")
    (root / "tiny" / ".a.gguf.Xy12").write_bytes(b"rsync temporary")
    (tmp_path / "secret").write_bytes(b"outside the root")
    cache = ManifestCache()
    limits = attrs.evolve(MIRROR_LIMITS, head_timeout_s=0.5, keepalive_s=5.0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(serve_mirror, root, "127.0.0.1", 0, limits=limits, cache=cache)
        )
        yield Mirror(port, root, cache)
        nursery.cancel_scope.cancel()


async def raw(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send exact bytes (no client normalises the path) and read one response."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    client = h11.Connection(h11.CLIENT)
    # h11 refuses to send such targets itself: feed it the request so it tracks the response.
    client.send(h11.Request(method=request.split(b" ")[0], target=b"/", headers=[(b"host", b"x")]))
    client.send(h11.EndOfMessage())
    await stream.send_all(request)
    body = b""
    response: h11.Response | None = None
    with trio.fail_after(5):
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    await stream.aclose()
    assert response is not None
    return response.status_code, dict(response.headers), body


def get(path: bytes, *headers: bytes) -> bytes:
    return (
        b"GET "
        + path
        + b" HTTP/1.1\r\nhost: x\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"\r\n"
    )


# --- files ----------------------------------------------------------------------------


async def test_get_and_head_of_a_file(mirror: Mirror) -> None:
    st_ = (mirror.root / "tiny" / "a.gguf").stat()
    tag = f'"{st_.st_size}-{st_.st_mtime_ns}"'
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        r = await client.get("/tiny/a.gguf")
        h = await client.head("/tiny/a.gguf")
    assert r.status_code == 200
    assert r.content == PART_A
    assert r.headers["content-length"] == str(len(PART_A))
    assert r.headers["etag"] == tag
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["content-type"] == "application/octet-stream"
    assert "last-modified" in r.headers
    assert h.status_code == 200
    assert h.content == b""
    assert h.headers["content-length"] == str(len(PART_A))
    assert h.headers["etag"] == tag


async def test_ranges(mirror: Mirror) -> None:
    size = len(PART_A)
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        tag = (await client.head("/tiny/a.gguf")).headers["etag"]

        async def ask(*pairs: tuple[str, str]) -> httpx.Response:
            return await client.get("/tiny/a.gguf", headers=dict(pairs))

        r = await ask(("range", "bytes=10-19"))
        assert (r.status_code, r.content) == (206, PART_A[10:20])
        assert r.headers["content-range"] == f"bytes 10-19/{size}"
        assert r.headers["content-length"] == "10"

        r = await ask(("range", "bytes=10000-"))
        assert (r.status_code, r.content) == (206, PART_A[10000:])
        assert r.headers["content-range"] == f"bytes 10000-{size - 1}/{size}"

        r = await ask(("range", "bytes=-100"))
        assert (r.status_code, r.content) == (206, PART_A[-100:])

        r = await ask(("range", f"bytes=100-{size * 2}"))  # an end past the file is clipped
        assert (r.status_code, r.content) == (206, PART_A[100:])

        r = await ask(("range", f"bytes={size}-"))
        assert r.status_code == 416
        assert r.headers["content-range"] == f"bytes */{size}"

        r = await ask(("range", "bytes=0-9, 20-29"))  # several ranges: the whole file
        assert (r.status_code, r.content) == (200, PART_A)

        r = await ask(("range", "bytes=100-"), ("if-range", tag))
        assert (r.status_code, r.content) == (206, PART_A[100:])

        r = await ask(("range", "bytes=100-"), ("if-range", '"10240-1"'))
        assert (r.status_code, r.content) == (200, PART_A)
        assert "content-range" not in r.headers

        # The connection was reused throughout: the 416 did not close it either.
        r = await ask(("range", "bytes=0-0"))
        assert (r.status_code, r.content) == (206, PART_A[:1])


def model_range(header: str, size: int) -> object:
    """RFC 9110's single byte range, written plainly, to check the parser against."""
    if not header.startswith("bytes=") or "," in header:
        return None
    first, sep, last = header[6:].partition("-")
    if not sep or not (first.isdigit() or first == "") or not (last.isdigit() or last == ""):
        return None
    if first == "":
        if last == "":
            return None
        return (
            UNSATISFIABLE if int(last) == 0 or size == 0 else (max(0, size - int(last)), size - 1)
        )
    if last and int(last) < int(first):
        return None
    if int(first) >= size:
        return UNSATISFIABLE
    return (int(first), size - 1 if last == "" else min(int(last), size - 1))


@given(
    st.integers(0, 1 << 40),
    st.one_of(st.none(), st.integers(0, 1 << 41)),
    st.one_of(st.none(), st.integers(0, 1 << 41)),
)
def test_parse_range_matches_the_rfc(size: int, first: int | None, last: int | None) -> None:
    header = f"bytes={'' if first is None else first}-{'' if last is None else last}"
    got = parse_range(header.encode(), size)
    assert got == model_range(header, size)
    if isinstance(got, tuple):
        assert 0 <= got[0] <= got[1] < size


@given(st.binary(max_size=40), st.integers(0, 1000))
def test_parse_range_never_fails_on_garbage(header: bytes, size: int) -> None:
    got = parse_range(header, size)
    assert got is None or got is UNSATISFIABLE or (0 <= got[0] <= got[1] < size)  # type: ignore[index]


# --- manifests ------------------------------------------------------------------------


async def test_manifest_lists_the_regular_files_with_their_sha256(mirror: Mirror) -> None:
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        r = await client.get("/tiny/")
        h = await client.head("/tiny/")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert json.loads(r.content) == {
        "files": [
            {"name": "a.gguf", "size": len(PART_A), "sha256": hashlib.sha256(PART_A).hexdigest()},
            {"name": "b.gguf", "size": len(PART_B), "sha256": hashlib.sha256(PART_B).hexdigest()},
        ]
    }  # not sub/ (not recursive), not the dot-file (an rsync temporary)
    assert h.status_code == 200 and h.content == b""
    assert h.headers["content-length"] == str(len(r.content))


async def test_manifest_hashes_are_cached_until_the_file_changes(mirror: Mirror) -> None:
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        first = (await client.get("/tiny/")).json()
        assert mirror.cache.statistics().hashed == 2
        again = (await client.get("/tiny/")).json()
        assert again == first
        stats = mirror.cache.statistics()
        assert (stats.hashed, stats.hits, stats.entries) == (2, 2, 2)
        # A file replaced in place (new size and mtime) is hashed again; the other is not.
        (mirror.root / "tiny" / "b.gguf").write_bytes(b"new contents")
        changed = (await client.get("/tiny/")).json()
    assert changed["files"][1] == {
        "name": "b.gguf",
        "size": 12,
        "sha256": hashlib.sha256(b"new contents").hexdigest(),
    }
    stats = mirror.cache.statistics()
    assert (stats.hashed, stats.hits, stats.entries) == (3, 3, 2)


async def test_a_directory_without_its_slash_and_a_file_with_one_are_404(mirror: Mirror) -> None:
    status, _, body = await raw(mirror.port, get(b"/tiny"))
    assert status == 404
    assert b"/tiny/" in body  # says how to ask for it
    status, _, _ = await raw(mirror.port, get(b"/tiny/a.gguf/"))
    assert status == 404
    status, _, body = await raw(mirror.port, get(b"/tiny/nope.gguf"))
    assert (status, body) == (404, b"not found: /tiny/nope.gguf: no such file or directory\n")


async def test_a_file_that_changes_while_hashed_is_503_and_not_cached(
    mirror: Mirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw.cp._weights import _mirror

    real_hash = _mirror._hash_file

    def hash_then_append(path: str) -> tuple[str, tuple[int, int]]:
        if path.endswith("b.gguf"):
            with open(path, "ab") as f:  # the operator's copy is still going
                f.write(b"more")
        return real_hash(path)

    monkeypatch.setattr(_mirror, "_hash_file", hash_then_append)
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        r = await client.get("/tiny/")
        assert r.status_code == 503
        assert "/tiny/b.gguf changed while it was hashed" in r.text
        assert r.headers["retry-after"] == "5"
        monkeypatch.setattr(_mirror, "_hash_file", real_hash)
        r = await client.get("/tiny/")
    assert r.json()["files"][1]["sha256"] == hashlib.sha256(PART_B + b"more").hexdigest()


# --- hostile peers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        b"/tiny/../../secret",
        b"/tiny/%2e%2e/%2e%2e/secret",
        b"/%2E%2E/secret",
        b"/tiny/..%2f..%2fsecret",
        b"/tiny/a.gguf%00",
        b"/..\\secret",
        b"/tiny%5c..%5c..%5csecret",
        b"//etc/passwd",
        b"http://x/../secret",
        b"/tiny/%ff",
    ],
)
async def test_traversal_is_refused(mirror: Mirror, target: bytes) -> None:
    status, _, body = await raw(mirror.port, get(target))
    assert status in (400, 404), (target, status)
    assert b"outside the root" not in body


async def test_a_symlink_out_of_the_root_is_404_and_unlisted(mirror: Mirror) -> None:
    secret = mirror.root.parent / "secret"
    (mirror.root / "tiny" / "escape.gguf").symlink_to(secret)
    (mirror.root / "out").symlink_to(mirror.root.parent)
    (mirror.root / "tiny" / "inside.gguf").symlink_to(mirror.root / "tiny" / "a.gguf")
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        assert (await client.get("/tiny/escape.gguf")).status_code == 404
        assert (await client.get("/out/secret")).status_code == 404
        assert (await client.get("/out/")).status_code == 404
        inside = await client.get("/tiny/inside.gguf")  # a link that stays inside is served
        names = [f["name"] for f in (await client.get("/tiny/")).json()["files"]]
    assert (inside.status_code, inside.content) == (200, PART_A)
    assert names == ["a.gguf", "b.gguf", "inside.gguf"]


async def test_a_fifo_is_not_opened_as_a_file(mirror: Mirror) -> None:
    os.mkfifo(mirror.root / "tiny" / "pipe")
    with trio.fail_after(5):  # opening it for reading would block forever
        status, _, _ = await raw(mirror.port, get(b"/tiny/pipe"))
    assert status == 404


@given(st.binary(max_size=60))
def test_parse_target_yields_only_plain_names(target: bytes) -> None:
    got = parse_target(b"/" + target)
    if isinstance(got, Target):
        for seg in got.segments:
            assert seg and seg not in (".", "..") and not seg.startswith(".")
            assert "/" not in seg and "\\" not in seg and "\x00" not in seg
        assert os.path.normpath(os.path.join("/root", *got.segments)).startswith("/root")
    else:
        assert isinstance(got, Refusal) and got.status in (400, 404)


async def test_only_get_and_head(mirror: Mirror) -> None:
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        for method in ("POST", "PUT", "DELETE", "OPTIONS"):
            r = await client.request(method, "/tiny/a.gguf", content=b"x" * 10)
            assert r.status_code == 405, method
            assert r.headers["allow"] == "GET, HEAD"
            assert r.headers["connection"] == "close"
    assert (mirror.root / "tiny" / "a.gguf").read_bytes() == PART_A


async def test_a_body_on_get_is_refused(mirror: Mirror) -> None:
    status, _, _ = await raw(mirror.port, get(b"/tiny/a.gguf", b"content-length: 3") + b"abc")
    assert status == 400


async def test_an_oversized_head_is_refused(mirror: Mirror) -> None:
    status, headers, _ = await raw(mirror.port, get(b"/tiny/a.gguf", b"x-pad: " + b"a" * 20000))
    assert status == 431
    assert headers[b"connection"] == b"close"
    # Slowly, so that h11 sees it incomplete and its own bound answers.
    stream = await trio.open_tcp_stream("127.0.0.1", mirror.port)
    await stream.send_all(b"GET /tiny/a.gguf HTTP/1.1\r\nx-pad: " + b"a" * 10000)
    await trio.sleep(0.05)
    await stream.send_all(b"a" * 10000)
    got = b""
    with trio.fail_after(5):
        while data := await stream.receive_some(65536):
            got += data
    await stream.aclose()
    assert got.startswith(b"HTTP/1.1 431 ")
    # A head under the bound (16 KiB here) is served.
    status, _, body = await raw(mirror.port, get(b"/tiny/a.gguf", b"x-pad: " + b"a" * 12000))
    assert (status, body) == (200, PART_A)


async def test_a_slow_loris_is_cut_at_the_head_deadline(mirror: Mirror) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", mirror.port)
    await stream.send_all(b"GET /tiny/a.gguf HTTP/1.1\r\nhost: x\r\n")  # half a head
    started = time.monotonic()
    got = b""
    with trio.fail_after(5):
        while data := await stream.receive_some(65536):
            got += data
    elapsed = time.monotonic() - started
    await stream.aclose()
    assert got.startswith(b"HTTP/1.1 408 ")
    assert b"head_timeout_s" in got
    assert 0.4 <= elapsed < 3, elapsed  # head_timeout_s=0.5 in the fixture


async def test_keepalive_serves_several_requests_on_one_connection(mirror: Mirror) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", mirror.port)
    await stream.send_all(get(b"/tiny/b.gguf") * 2)  # pipelined
    got = b""
    with trio.fail_after(5):
        while got.count(PART_B) < 2:
            got += await stream.receive_some(65536)
    await stream.aclose()
    assert got.count(b"HTTP/1.1 200 ") == 2


async def test_connections_beyond_the_bound_are_closed(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(PART_B)
    limits = attrs.evolve(MIRROR_LIMITS, max_connections=1)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mirror, tmp_path, "127.0.0.1", 0, limits=limits))
        # The first connection holds the one slot (kept alive after its answer).
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(get(b"/w.bin"))
        got = b""
        with trio.fail_after(5):
            while not got.endswith(PART_B):
                got += await first.receive_some(65536)
        second = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(5):
            assert await second.receive_some(65536) == b""  # closed at once, unanswered
        await second.aclose()
        await first.aclose()
        # Once the first is gone its slot is free again.
        with trio.fail_after(5):
            while True:
                try:
                    status, _, body = await raw(port, get(b"/w.bin"))
                    break
                except (h11.RemoteProtocolError, trio.BrokenResourceError, AssertionError):
                    await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert (status, body) == (200, PART_B)


# --- big files and TLS ----------------------------------------------------------------


async def test_a_large_sparse_file_streams_whole(mirror: Mirror) -> None:
    size = 64 << 20
    path = mirror.root / "big.bin"
    with open(path, "wb") as f:
        f.truncate(size)
        for offset in (0, size // 2 + 7, size - 1024):  # not only zeros
            f.seek(offset)
            f.write(os.urandom(1024))
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    received = 0
    async with (
        httpx.AsyncClient(base_url=mirror.url, timeout=30) as client,
        client.stream("GET", "/big.bin") as r,
    ):
        assert r.headers["content-length"] == str(size)
        async for chunk in r.aiter_raw():
            digest.update(chunk)
            received += len(chunk)
    assert received == size
    assert digest.hexdigest() == expected


async def test_tls(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    (tmp_path / "w.bin").write_bytes(PART_B)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(serve_mirror, tmp_path, "127.0.0.1", 0, ssl_context=server_ctx)
        )
        async with httpx.AsyncClient(verify=client_ctx) as client:
            r = await client.get(f"https://127.0.0.1:{port}/w.bin", headers={"range": "bytes=-16"})
        nursery.cancel_scope.cancel()
    assert (r.status_code, r.content) == (206, PART_B[-16:])


# --- the access log -----------------------------------------------------------------------


async def test_each_answer_is_one_access_log_line(
    mirror: Mirror, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.cp.mirror")
    async with httpx.AsyncClient(base_url=mirror.url) as client:
        assert (await client.get("/tiny/a.gguf")).status_code == 200
        assert (
            await client.get("/tiny/a.gguf", headers={"range": "bytes=10-19"})
        ).status_code == 206
        assert (await client.head("/tiny/b.gguf")).status_code == 200
        missing = await client.get("/tiny/nothing.gguf")
        assert missing.status_code == 404
        manifest = await client.get("/tiny/")
    # A target that decodes to a line break, and a head that is not HTTP at all.
    status, _, _ = await raw(mirror.port, get(b"/tiny/a%0d%0aGET%20'/forged'"))
    assert status == 400
    status, _, _ = await raw(mirror.port, b"GET /tiny/a.gguf HTTP/1.1\r\nbad header\r\n\r\n")
    assert status == 400
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.cp.mirror"]
    access = [line for line in lines if " bytes to 127.0.0.1:" in line]
    assert all("\n" not in line and "\r" not in line for line in lines)
    assert [line.split(" bytes to ")[0] for line in access] == [
        f"GET '/tiny/a.gguf' 200 {len(PART_A)}",
        "GET '/tiny/a.gguf' 206 10",
        "HEAD '/tiny/b.gguf' 200 0",
        f"GET '/tiny/nothing.gguf' 404 {len(missing.content)}",
        f"GET '/tiny/' 200 {len(manifest.content)}",
        f"GET \"/tiny/a%0d%0aGET%20'/forged'\" 400 {access[5].split()[3]}",
        f"- '-' 400 {access[6].split()[3]}",
    ]
    assert int(access[5].split()[3]) > 0 and int(access[6].split()[3]) > 0
    # The peer is the client's address and port, and no answer was cut.
    assert all(line.rsplit(":", 1)[1].isdigit() for line in access), access


async def test_an_answer_the_client_walks_away_from_is_logged_as_cut(
    mirror: Mirror, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.cp.mirror")
    size = 64 << 20
    with open(mirror.root / "big.bin", "wb") as f:
        f.truncate(size)
    stream = await trio.open_tcp_stream("127.0.0.1", mirror.port)
    await stream.send_all(get(b"/big.bin"))
    with trio.fail_after(5):
        assert await stream.receive_some(65536)
    await trio.aclose_forcefully(stream)

    def cut() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().endswith(" (cut)")]

    with trio.fail_after(10):
        while not cut():
            await trio.sleep(0.05)
    [line] = cut()
    assert line.startswith("GET '/big.bin' 200 ")
    assert 0 <= int(line.split()[3]) < size
