"""Source sizes (llmgw/cp/_weights/_sizes.py): the mirror's directory read directly, HEAD and
manifests against the real mirror on loopback, and what leaves a size unknown."""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
import trio
import trustme

from llmgw.cp._weights._mirror import serve_mirror
from llmgw.cp._weights._sizes import SourceSizes, Unknown, mirror_size

PART_A = b"a" * 10240
PART_B = b"b" * 1600
HUGE = 8 << 40  # 8 TiB, sparse (ext4 allows 16 TiB at most): only ever stat'ed


def mirror_tree(root: Path, outside: Path) -> None:
    (root / "tiny" / "sub").mkdir(parents=True)
    (root / "tiny" / "a.gguf").write_bytes(PART_A)
    (root / "tiny" / "b.gguf").write_bytes(PART_B)
    (root / "tiny" / "sub" / "deep.bin").write_bytes(b"not listed")  # not recursive
    (root / "tiny" / ".a.gguf.Xy12").write_bytes(b"rsync temporary")  # not listed
    (root / "empty").mkdir()
    (root / ".hidden.gguf").write_bytes(b"not served")
    with open(root / "huge.gguf", "wb") as f:
        f.truncate(HUGE)
    outside.write_bytes(b"outside the root")
    (root / "out.gguf").symlink_to(outside)
    os.mkfifo(root / "fifo.gguf")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "mirror"
    mirror_tree(root, tmp_path / "secret.gguf")
    return root


@pytest.fixture
async def mirror_url(root: Path) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mirror, root, "127.0.0.1", 0))
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def measure(sizes: SourceSizes, source: str) -> int | Unknown:
    async with sizes.client() as client:
        return await sizes.measure(client, source)


# --- the mirror's directory, read directly ------------------------------------------------


def test_the_mirror_dir_is_read_by_the_mirrors_own_rules(root: Path) -> None:
    real = os.path.realpath(root)
    assert mirror_size(real, "/tiny/a.gguf") == len(PART_A)
    assert mirror_size(real, "/huge.gguf") == HUGE  # stat'ed, never read
    # A version: the files the mirror lists, summed (no dot-names, no subdirectories).
    assert mirror_size(real, "/tiny/") == len(PART_A) + len(PART_B)
    assert mirror_size(real, "/tiny/a%2Egguf") == len(PART_A)  # decoded as the mirror does

    def why(path: str) -> str:
        got = mirror_size(real, path)
        assert isinstance(got, Unknown), (path, got)
        return got.reason

    assert why("/nope.gguf") == f"{real}/nope.gguf: no such file or directory"
    assert why("/.hidden.gguf").startswith("the mirror would refuse it (404): ")
    assert why("/tiny/../secret.gguf").startswith("the mirror would refuse it (400): ")
    assert why("/out.gguf") == f"not under mirror.dir {real} (a link that leads out?)"
    assert why("/tiny") == f"{real}/tiny is a directory: a version is named with a trailing /"
    assert why("/fifo.gguf") == f"{real}/fifo.gguf is not a regular file"
    assert why("/empty/") == f"{real}/empty holds no file the mirror would list"
    assert why("/tiny/a.gguf/") == f"{real}/tiny/a.gguf is not a directory in mirror.dir"


async def test_mirror_sources_come_from_disk_not_http(root: Path) -> None:
    sizes = SourceSizes(lambda: (), root)
    assert await measure(sizes, "mirror:/huge.gguf") == HUGE
    assert await measure(sizes, "mirror:/tiny/") == len(PART_A) + len(PART_B)
    nomirror = SourceSizes(lambda: (), None)
    got = await measure(nomirror, "mirror:/huge.gguf")
    assert isinstance(got, Unknown) and "no mirror.dir" in got.reason


# --- over HTTP, against the real mirror ---------------------------------------------------


async def test_head_and_manifest_against_the_real_mirror(root: Path, mirror_url: str) -> None:
    sizes = SourceSizes(lambda: (), None)
    assert await measure(sizes, f"{mirror_url}/tiny/a.gguf") == len(PART_A)
    assert await measure(sizes, f"{mirror_url}/huge.gguf") == HUGE  # a HEAD reads nothing
    assert await measure(sizes, f"{mirror_url}/tiny/") == len(PART_A) + len(PART_B)
    missing = await measure(sizes, f"{mirror_url}/nope.gguf")
    assert missing == Unknown(f"HEAD {mirror_url}/nope.gguf answered 404 Not Found, not 200")
    no_version = await measure(sizes, f"{mirror_url}/nope/")
    assert no_version == Unknown(f"GET {mirror_url}/nope/ answered 404 Not Found, not 200")


async def test_an_https_source_is_checked_against_the_systems_default_trust(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mirror, root, "127.0.0.1", 0, ssl_context=server))
        url = f"https://127.0.0.1:{port}/tiny/a.gguf"
        sizes = SourceSizes(lambda: (), None)
        # A CA the system does not trust: refused, the reason says so.
        got = await measure(sizes, url)
        assert isinstance(got, Unknown) and "CERTIFICATE_VERIFY_FAILED" in got.reason, got
        # The system's trust store (here through OpenSSL's SSL_CERT_FILE) holds it: known.
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
        assert await measure(sizes, url) == len(PART_A)
        nursery.cancel_scope.cancel()


async def serve_fixed(answer: bytes | None, task_status: trio.TaskStatus[int]) -> None:
    """A server that reads a request head and sends `answer`, or (None) never answers."""

    async def handler(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(65536)
            if not data:
                return
            head += data
        if answer is None:
            await trio.sleep_forever()
        await stream.send_all(answer)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(port)


async def test_a_server_that_never_answers_is_unknown_after_the_deadline() -> None:
    sizes = SourceSizes(lambda: (), None, deadline_s=0.3)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_fixed, None)
        started = trio.current_time()
        got = await measure(sizes, f"http://127.0.0.1:{port}/model.gguf")
        waited = trio.current_time() - started
        assert got == Unknown("no answer within 0.3 s (the deadline of a size check)")
        assert 0.3 <= waited < 1.0
        # A version's manifest too.
        got = await measure(sizes, f"http://127.0.0.1:{port}/v/")
        assert got == Unknown("no answer within 0.3 s (the deadline of a size check)")
        nursery.cancel_scope.cancel()


async def test_an_html_page_where_a_manifest_was_expected_is_named() -> None:
    page = b"<!DOCTYPE html><html><body><a href='a.gguf'>a.gguf</a></body></html>"
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (len(page), page)
    )
    sizes = SourceSizes(lambda: (), None)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_fixed, answer)
        url = f"http://127.0.0.1:{port}/models/qwen/"
        got = await measure(sizes, url)
        assert got == Unknown(
            f"{url}: got an HTML page where a manifest was expected"
            " — that server is not an llmgw mirror"
        )
        nursery.cancel_scope.cancel()


# --- the task: cached, refreshed, logged once, pokes on change ----------------------------


async def test_the_task_refreshes_logs_once_and_pokes_on_change(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.cp.sizes")
    sources = ["mirror:/tiny/a.gguf", "mirror:/nope.gguf", "Qwen/Qwen2.5-7B", "/models/x.gguf"]
    pokes = 0

    def poked() -> None:
        nonlocal pokes
        pokes += 1

    sizes = SourceSizes(lambda: sources, root, on_change=poked, refresh_s=3600)

    async def refreshed(after: int) -> None:
        with trio.fail_after(10):
            while sizes.statistics()["refreshes"] <= after:
                await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        await nursery.start(sizes.run)
        await refreshed(0)
        assert sizes("mirror:/tiny/a.gguf") == len(PART_A)
        assert sizes("mirror:/nope.gguf") is None  # unknown, never 0
        assert sizes("Qwen/Qwen2.5-7B") is None and sizes("/models/x.gguf") is None
        assert pokes == 1
        # The same again (a poke, as a catalog change does): no change, no poke, no new line.
        sizes.poke()
        await refreshed(1)
        assert pokes == 1
        # The file grows: a new size, one poke.
        (root / "tiny" / "a.gguf").write_bytes(PART_A * 2)
        sources.append("mirror:/huge.gguf")
        sizes.poke()
        await refreshed(2)
        assert (sizes("mirror:/tiny/a.gguf"), sizes("mirror:/huge.gguf")) == (2 * len(PART_A), HUGE)
        assert pokes == 2
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.cp.sizes"]
    unknown = [line for line in lines if line.startswith("mirror:/nope.gguf")]
    assert unknown == [
        f"mirror:/nope.gguf: size unknown (placement will not check disk): "
        f"{os.path.realpath(root)}/nope.gguf: no such file or directory"
    ]
    assert f"mirror:/tiny/a.gguf: {len(PART_A)} bytes" in lines
    assert f"mirror:/tiny/a.gguf: {2 * len(PART_A)} bytes" in lines
