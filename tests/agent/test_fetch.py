"""The agent's fetcher against the real mirror on loopback, a proxy that drops the
connection, and tiny raw servers that misbehave on purpose."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import ssl
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import pytest
import trio
import trustme
from helpers import require

from llmgw.agent._fetch import ETAG_SUFFIX, MARKER, Fetcher, FetchError
from llmgw.core import cache_name
from llmgw.cp._weights._mirror import serve_mirror

MiB = 1 << 20


def blob(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(weights: Path) -> list[str]:
    """Everything under the weights directory that is not a final file or the marker."""
    return sorted(
        str(p.relative_to(weights))
        for p in weights.rglob("*")
        if p.name.endswith((".partial", ETAG_SUFFIX))
    )


async def start_mirror(nursery: trio.Nursery, root: Path, **kw: Any) -> int:
    port: int = await nursery.start(partial(serve_mirror, root, "127.0.0.1", 0, **kw))
    return port


async def start_fetcher(nursery: trio.Nursery, weights: Path, **kw: Any) -> Fetcher:
    weights.mkdir(parents=True, exist_ok=True)
    kw.setdefault("read_timeout_s", 5.0)
    kw.setdefault("connect_timeout_s", 5.0)
    fetcher = Fetcher(weights, **kw)
    await nursery.start(fetcher.run)
    return fetcher


class DropProxy:
    """Forwards to 127.0.0.1:upstream; connection i passes budgets[i] response bytes
    (head included) and is then closed; None passes everything. `delay_s` between
    16 KiB pieces makes a slow link."""

    def __init__(self, upstream: int, budgets: list[int | None] | None = None) -> None:
        self.upstream = upstream
        self.budgets = list(budgets or [])
        self.delay_s = 0.0
        self.conns: list[dict[str, Any]] = []

    def gets(self) -> int:
        return sum(c["up"].count(b"GET ") for c in self.conns)

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1"))
        return int(listeners[0].socket.getsockname()[1])

    async def handle(self, client: trio.SocketStream) -> None:
        budget = self.budgets.pop(0) if self.budgets else None
        rec: dict[str, Any] = {"up": b"", "down": 0, "closed_by_client": False}
        self.conns.append(rec)
        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async with upstream, client, trio.open_nursery() as nursery:

                async def up() -> None:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        async for data in client:
                            rec["up"] += data
                            await upstream.send_all(data)
                    rec["closed_by_client"] = True
                    nursery.cancel_scope.cancel()

                async def down() -> None:
                    async for data in upstream:
                        view = bytes(data)
                        while view:
                            piece = view[: 16384 if self.delay_s else len(view)]
                            view = view[len(piece) :]
                            if budget is not None:
                                piece = piece[: budget - rec["down"]]
                            await client.send_all(piece)
                            rec["down"] += len(piece)
                            if budget is not None and rec["down"] >= budget:
                                nursery.cancel_scope.cancel()
                                return
                            if self.delay_s:
                                await trio.sleep(self.delay_s)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(up)
                nursery.start_soon(down)
            await trio.aclose_forcefully(client)


Route = tuple[int, dict[str, str], bytes]


class RawServer:
    """One request per connection; answers routes[target] (status, headers, body) whole,
    always 200-style: it ignores Range. `no_length`: the body is delimited by the close."""

    def __init__(self, routes: dict[str, Route], no_length: bool = False) -> None:
        self.routes = routes
        self.no_length = no_length
        self.requests: list[tuple[str, dict[str, str]]] = []

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1"))
        return int(listeners[0].socket.getsockname()[1])

    async def handle(self, stream: trio.SocketStream) -> None:
        buf = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in buf and len(buf) < 65536:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
        lines = buf.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        target = lines[0].split(" ")[1]
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        self.requests.append((target, headers))
        status, extra, body = self.routes.get(target, (404, {}, b"no such thing\n"))
        head = f"HTTP/1.1 {status} X\r\nconnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
        if not self.no_length:
            head += f"content-length: {len(body)}\r\n"
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(head.encode() + b"\r\n" + body)
        await stream.aclose()


# --- plain fetches --------------------------------------------------------------------


async def test_file_then_marker_means_no_second_request(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    data = blob(3 * MiB + 17, 1)
    (root / "model.gguf").write_bytes(data)
    async with trio.open_nursery() as nursery:
        proxy = DropProxy(await start_mirror(nursery, root))
        port = await proxy.start(nursery)
        fetcher = await start_fetcher(nursery, tmp_path / "w")
        url = f"http://127.0.0.1:{port}/model.gguf"
        path = await fetcher.fetch(url, "file", source="mirror:/model.gguf")
        assert path == tmp_path / "w" / cache_name("mirror:/model.gguf") / "model.gguf"
        assert sha(path.read_bytes()) == sha(data)
        assert (path.parent / MARKER).exists()
        assert leftovers(tmp_path / "w") == []
        assert proxy.gets() == 1
        again = await fetcher.fetch(url, "file", source="mirror:/model.gguf")
        assert again == path
        assert proxy.gets() == 1  # the marker and the size: nothing asked
        assert fetcher.statistics().downloads == 1
        nursery.cancel_scope.cancel()


async def test_a_file_renamed_but_unmarked_is_confirmed_by_a_416(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    data = blob(MiB, 15)
    (root / "r.bin").write_bytes(data)
    async with trio.open_nursery() as nursery:
        proxy = DropProxy(await start_mirror(nursery, root))
        port = await proxy.start(nursery)
        fetcher = await start_fetcher(nursery, tmp_path / "w")
        url = f"http://127.0.0.1:{port}/r.bin"
        path = await fetcher.fetch(url, "file")
        # As after a crash between the rename and the marker: the ETag file still there.
        (path.parent / MARKER).unlink()
        (path.parent / ("r.bin.partial" + ETAG_SUFFIX)).write_text(mirror_etag(root / "r.bin"))
        assert await fetcher.fetch(url, "file") == path
        assert f"range: bytes={len(data)}-".encode() in proxy.conns[-1]["up"].lower()
        assert proxy.conns[-1]["down"] < 1000  # a 416, no body
        assert sha(path.read_bytes()) == sha(data)
        assert (path.parent / MARKER).exists() and leftovers(tmp_path / "w") == []
        nursery.cancel_scope.cancel()


def mirror_etag(file: Path) -> str:
    st = file.stat()
    return f'"{st.st_size}-{st.st_mtime_ns}"'  # the mirror's ETag


async def test_version_fetches_every_file_into_one_directory(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    (root / "tiny").mkdir(parents=True)
    parts = {"tiny-00001-of-00002.gguf": blob(700_000, 2), "tiny-00002-of-00002.gguf": blob(5, 3)}
    for name, data in parts.items():
        (root / "tiny" / name).write_bytes(data)
    async with trio.open_nursery() as nursery:
        port = await start_mirror(nursery, root)
        fetcher = await start_fetcher(nursery, tmp_path / "w")
        path = await fetcher.fetch(f"http://127.0.0.1:{port}/tiny/", "version")
        assert path == tmp_path / "w" / cache_name(f"http://127.0.0.1:{port}/tiny/")
        assert sorted(os.listdir(path)) == sorted([*parts, MARKER])
        for name, data in parts.items():
            assert sha((path / name).read_bytes()) == sha(data)
        # A file truncated behind the marker's back is fetched again, the rest is not.
        (path / "tiny-00002-of-00002.gguf").write_bytes(b"xy")
        assert await fetcher.fetch(f"http://127.0.0.1:{port}/tiny/", "version") == path
        assert (path / "tiny-00002-of-00002.gguf").read_bytes() == parts["tiny-00002-of-00002.gguf"]
        nursery.cancel_scope.cancel()


async def test_https_with_the_ca_and_refused_without(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    data = blob(200_000, 4)
    (root / "a.bin").write_bytes(data)
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with trio.open_nursery() as nursery:
        port = await start_mirror(nursery, root, ssl_context=server_ctx)
        good = await start_fetcher(nursery, tmp_path / "w1", ssl_context=client_ctx)
        path = await good.fetch(f"https://127.0.0.1:{port}/a.bin", "file")
        assert path.read_bytes() == data
        other = ssl.create_default_context()
        trustme.CA().configure_trust(other)
        bad = await start_fetcher(nursery, tmp_path / "w2", ssl_context=other)
        url = f"https://127.0.0.1:{port}/a.bin"
        with pytest.raises(FetchError) as info:
            await bad.fetch(url, "file")
        assert str(info.value).startswith(url + ": cannot connect")
        assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)
        nursery.cancel_scope.cancel()


# --- resume -------------------------------------------------------------------------


async def test_cut_at_twenty_offsets_every_resumed_file_is_right(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    size = MiB + 4321
    data = blob(size, 5)
    (root / "w.bin").write_bytes(data)
    offsets = [0, 1, 60, 200, 400] + [size * k // 16 for k in range(1, 16)]
    assert len(offsets) == 20
    resumed = 0
    async with trio.open_nursery() as nursery:
        mirror = await start_mirror(nursery, root)
        for i, cut in enumerate(offsets):
            proxy = DropProxy(mirror, [cut])
            port = await proxy.start(nursery)
            weights = tmp_path / f"w{i}"
            fetcher = await start_fetcher(nursery, weights)
            url = f"http://127.0.0.1:{port}/w.bin"
            with pytest.raises(FetchError) as info:
                await fetcher.fetch(url, "file")
            assert str(info.value).startswith(url + ": "), str(info.value)
            partial_file = weights / cache_name(url) / "w.bin.partial"
            had = partial_file.stat().st_size if partial_file.exists() else 0
            assert had < size
            path = await fetcher.fetch(url, "file")
            assert sha(path.read_bytes()) == sha(data), f"cut at {cut}"
            assert leftovers(weights) == []
            second = proxy.conns[-1]
            if had:
                resumed += 1
                assert f"range: bytes={had}-".encode() in second["up"].lower()
                assert second["down"] < size - had + 1000  # only the rest came
            else:
                assert b"range:" not in second["up"].lower()
        nursery.cancel_scope.cancel()
    assert resumed >= 15


async def test_tls_cut_mid_body_is_an_error_then_resumes_right(tmp_path: Path) -> None:
    # The TLS client reads a bare EOF as the end (as trio's https_compatible does):
    # only the body's length tells a cut from the whole, so each cut must fail, and
    # what came must be resumed to the right bytes.
    root = tmp_path / "mirror"
    root.mkdir()
    size = 3 * MiB + 17
    data = blob(size, 9)
    (root / "t.bin").write_bytes(data)
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with trio.open_nursery() as nursery:
        mirror = await start_mirror(nursery, root, ssl_context=server_ctx)
        for i, cut in enumerate([5000, MiB, 2 * MiB + 3]):
            proxy = DropProxy(mirror, [cut])
            port = await proxy.start(nursery)
            weights = tmp_path / f"w{i}"
            fetcher = await start_fetcher(nursery, weights, ssl_context=client_ctx)
            url = f"https://127.0.0.1:{port}/t.bin"
            with pytest.raises(FetchError, match="connection broke after"):
                await fetcher.fetch(url, "file")
            partial_file = weights / cache_name(url) / "t.bin.partial"
            had = partial_file.stat().st_size if partial_file.exists() else 0
            assert had < size
            assert had > 0 or cut < MiB  # a cut inside the handshake leaves nothing
            path = await fetcher.fetch(url, "file")
            assert sha(path.read_bytes()) == sha(data), f"cut at {cut}"
            if had:
                assert proxy.conns[-1]["down"] < size - had + 100_000  # only the rest came
        nursery.cancel_scope.cancel()


async def test_server_ignoring_range_truncates_never_appends(tmp_path: Path) -> None:
    data = blob(MiB, 6)
    server = RawServer({"/m.bin": (200, {"etag": '"v1"'}, data)})
    async with trio.open_nursery() as nursery:
        port = await server.start(nursery)
        url = f"http://127.0.0.1:{port}/m.bin"
        weights = tmp_path / "w"
        directory = weights / cache_name(url)
        directory.mkdir(parents=True)
        (directory / "m.bin.partial").write_bytes(b"x" * 300_000)  # not the server's bytes
        (directory / ("m.bin.partial" + ETAG_SUFFIX)).write_text('"v1"')
        fetcher = await start_fetcher(nursery, weights)
        path = await fetcher.fetch(url, "file")
        assert sha(path.read_bytes()) == sha(data)
        assert server.requests[0][1]["range"] == "bytes=300000-"
        assert server.requests[0][1]["if-range"] == '"v1"'
        assert leftovers(weights) == []
        nursery.cancel_scope.cancel()


async def test_etag_change_midway_restarts_from_zero(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    size = MiB
    old, new = blob(size, 7), blob(size, 8)
    (root / "e.bin").write_bytes(old)
    async with trio.open_nursery() as nursery:
        proxy = DropProxy(await start_mirror(nursery, root), [size // 2])
        port = await proxy.start(nursery)
        fetcher = await start_fetcher(nursery, tmp_path / "w")
        url = f"http://127.0.0.1:{port}/e.bin"
        with pytest.raises(FetchError):
            await fetcher.fetch(url, "file")
        st = (root / "e.bin").stat()
        (root / "e.bin").write_bytes(new)
        os.utime(root / "e.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        path = await fetcher.fetch(url, "file")
        assert sha(path.read_bytes()) == sha(new)
        second = proxy.conns[-1]
        assert b"if-range:" in second["up"].lower()
        assert second["down"] > size  # the whole file again, not the rest
        nursery.cancel_scope.cancel()


# --- single flight ----------------------------------------------------------------------


async def test_eight_waiters_one_download(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    (root / "v").mkdir(parents=True)
    data = blob(2 * MiB, 9)
    (root / "v" / "a.gguf").write_bytes(data)
    (root / "big.bin").write_bytes(data)
    async with trio.open_nursery() as nursery:
        proxy = DropProxy(await start_mirror(nursery, root))
        port = await proxy.start(nursery)
        fetcher = await start_fetcher(nursery, tmp_path / "w", max_concurrent=1)
        results: list[Path] = []

        async def one(url: str, kind: Any) -> None:
            results.append(await fetcher.fetch(url, kind))

        async with trio.open_nursery() as waiters:
            for _ in range(8):
                waiters.start_soon(one, f"http://127.0.0.1:{port}/v/", "version")
                waiters.start_soon(one, f"http://127.0.0.1:{port}/big.bin", "file")
        assert len(results) == 16 and len(set(results)) == 2
        assert proxy.gets() == 3  # one manifest and one file for the version, one file
        assert fetcher.statistics().downloads == 2
        nursery.cancel_scope.cancel()


async def test_eight_waiters_one_error_the_same_message(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    async with trio.open_nursery() as nursery:
        proxy = DropProxy(await start_mirror(nursery, root))
        port = await proxy.start(nursery)
        fetcher = await start_fetcher(nursery, tmp_path / "w")
        url = f"http://127.0.0.1:{port}/missing.gguf"
        errors: list[str] = []

        async def one() -> None:
            try:
                await fetcher.fetch(url, "file")
            except FetchError as exc:
                errors.append(str(exc))

        async with trio.open_nursery() as waiters:
            for _ in range(8):
                waiters.start_soon(one)
        assert len(errors) == 8 and len(set(errors)) == 1
        assert errors[0].startswith(url + ": HTTP 404")
        assert "not found: /missing.gguf: no such file" in errors[0]  # the mirror's words
        assert "\n" not in errors[0]
        assert proxy.gets() == 1
        nursery.cancel_scope.cancel()


async def test_a_cancelled_waiter_leaves_the_download_the_last_one_ends_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    data = blob(MiB, 10)
    (root / "s.bin").write_bytes(data)
    async with trio.open_nursery() as nursery:
        proxy = DropProxy(await start_mirror(nursery, root))
        proxy.delay_s = 0.01  # 16 KiB per 10 ms: about 0.6 s for the file
        port = await proxy.start(nursery)
        fetcher = await start_fetcher(nursery, tmp_path / "w")
        url = f"http://127.0.0.1:{port}/s.bin"

        # Two waiters; one gives up: the other still gets the file.
        got: list[Path] = []

        async def keeps() -> None:
            got.append(await fetcher.fetch(url, "file"))

        async with trio.open_nursery() as waiters:
            waiters.start_soon(keeps)
            with trio.move_on_after(0.15):
                await fetcher.fetch(url, "file")
        assert sha(got[0].read_bytes()) == sha(data)
        assert proxy.gets() == 1

        # One waiter, which gives up: the download ends, its partial stays, resumable.
        url2 = f"http://127.0.0.1:{port}/s.bin?2"
        with trio.move_on_after(0.2):
            await fetcher.fetch(url2, "file")
        for _ in range(100):
            if fetcher.statistics().in_flight == 0 and proxy.conns[-1]["closed_by_client"]:
                break
            await trio.sleep(0.01)
        assert fetcher.statistics().in_flight == 0
        assert proxy.conns[-1]["closed_by_client"]
        had = (tmp_path / "w" / cache_name(url2) / "s.bin.partial").stat().st_size
        assert 0 < had < len(data)
        proxy.delay_s = 0.0
        path = await fetcher.fetch(url2, "file")
        assert sha(path.read_bytes()) == sha(data)
        assert f"range: bytes={had}-".encode() in proxy.conns[-1]["up"].lower()
        nursery.cancel_scope.cancel()


# --- refusals -----------------------------------------------------------------------


HOSTILE = [
    (b'{"files":[{"name":"../evil","size":3}]}', "holds a path separator"),
    (b'{"files":[{"name":"..","size":3}]}', "is not a file name"),
    (b'{"files":[{"name":"a/b","size":3}]}', "holds a path separator"),
    (b'{"files":[{"name":"/etc/passwd","size":3}]}', "is an absolute path"),
    (b'{"files":[{"name":"a\\u0000b","size":3}]}', "holds a NUL byte"),
    (json.dumps({"files": [{"name": "x" * 300, "size": 3}]}).encode(), "at most 255"),
    (b"<!DOCTYPE html><html><body><a href='a.gguf'>a.gguf</a></body></html>", "HTML page"),
    (b'{"files":[{"name":"a","size":3}],"pad":"' + b"p" * 5000 + b'"}', "over 4096 bytes"),
    (b'{"files":[{"name":".llmgw-complete","size":3}]}', "names the fetcher keeps"),
]


async def test_hostile_manifests_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    routes: dict[str, Route] = {f"/v{i}/": (200, {}, body) for i, (body, _) in enumerate(HOSTILE)}
    routes.update({f"/v{i}/{n}": (200, {}, b"bad") for i in range(len(HOSTILE)) for n in "ab"})
    server = RawServer(routes)
    async with trio.open_nursery() as nursery:
        port = await server.start(nursery)
        weights = tmp_path / "w"
        fetcher = await start_fetcher(nursery, weights, max_manifest_bytes=4096)
        for i, (_, words) in enumerate(HOSTILE):
            url = f"http://127.0.0.1:{port}/v{i}/"
            with pytest.raises(FetchError) as info:
                await fetcher.fetch(url, "version")
            message = str(info.value)
            assert message.startswith(url + ": ") and words in message, message
            assert "\n" not in message
            assert os.listdir(weights) == []
        assert [t for t, _ in server.requests] == [f"/v{i}/" for i in range(len(HOSTILE))]
        nursery.cancel_scope.cancel()


BIGGER_THAN_THE_DISK = {
    # A version whose manifest says 1 PiB: refused before a byte of its file is asked for.
    "version": (
        "/v/",
        {"/v/": (200, {}, json.dumps({"files": [{"name": "a.safetensors", "size": 1 << 50}]})
                 .encode()), "/v/a.safetensors": (200, {}, b"x" * 64)},
        "1\\.0 PiB",
    ),
    # A file whose Content-Length says 1 TiB: refused from its head, before its body.
    "file": ("/big.gguf", {"/big.gguf": (200, {"content-length": str(1 << 40)}, b"")}, "1\\.0 TiB"),
}  # fmt: skip


@pytest.mark.parametrize("kind", ["version", "file"])
async def test_a_source_bigger_than_the_disk_is_refused_before_its_first_byte(
    tmp_path: Path, kind: Literal["version", "file"]
) -> None:
    target, routes, size = BIGGER_THAN_THE_DISK[kind]
    server = RawServer(routes, no_length=kind == "file")
    async with trio.open_nursery() as nursery:
        port = await server.start(nursery)
        weights = tmp_path / "w"
        fetcher = await start_fetcher(nursery, weights)
        url = f"http://127.0.0.1:{port}{target}"
        with pytest.raises(FetchError) as info:
            await fetcher.fetch(url, kind)
        message = str(info.value)
        assert re.fullmatch(
            rf"{re.escape(url)}: needs {size} more in {re.escape(str(weights))}, which has "
            r"[0-9.]+ [KMGT]iB free; nothing was fetched",
            message,
        ), message
        assert [t for t, _ in server.requests] == [target]  # no byte of the file's body
        assert os.listdir(weights) == []  # not even the entry's empty directory
        nursery.cancel_scope.cancel()


async def test_hash_mismatch_removes_the_partial(tmp_path: Path) -> None:
    body = blob(100_000, 11)
    manifest = json.dumps({"files": [{"name": "a.bin", "size": len(body), "sha256": "0" * 64}]})
    server = RawServer({"/v/": (200, {}, manifest.encode()), "/v/a.bin": (200, {}, body)})
    async with trio.open_nursery() as nursery:
        port = await server.start(nursery)
        weights = tmp_path / "w"
        fetcher = await start_fetcher(nursery, weights)
        url = f"http://127.0.0.1:{port}/v/"
        with pytest.raises(FetchError) as info:
            await fetcher.fetch(url, "version")
        message = str(info.value)
        assert message.startswith(url + "a.bin: sha256 is " + sha(body))
        assert "the manifest says " + "0" * 64 in message and "partial was removed" in message
        assert os.listdir(weights / cache_name(url)) == []  # no partial, no file, no marker
        nursery.cancel_scope.cancel()


async def test_a_body_longer_than_the_manifest_says_is_cut_and_removed(tmp_path: Path) -> None:
    body = blob(50_000, 16)
    manifest = json.dumps({"files": [{"name": "a.bin", "size": 10_000}]})
    server = RawServer({"/v/": (200, {}, manifest.encode()), "/v/a.bin": (200, {}, body)})
    server.no_length = True
    async with trio.open_nursery() as nursery:
        port = await server.start(nursery)
        weights = tmp_path / "w"
        fetcher = await start_fetcher(nursery, weights)
        url = f"http://127.0.0.1:{port}/v/"
        with pytest.raises(FetchError) as info:
            await fetcher.fetch(url, "version")
        assert str(info.value) == (
            f"{url}a.bin: sent more than the 10000 bytes expected; the partial was removed"
        )
        assert os.listdir(weights / cache_name(url)) == []
        nursery.cancel_scope.cancel()


async def test_connection_refused_and_no_answer_name_the_url(tmp_path: Path) -> None:
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    closed = sock.getsockname()[1]
    sock.close()

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        quiet = listeners[0].socket.getsockname()[1]
        fetcher = await start_fetcher(nursery, tmp_path / "w", read_timeout_s=0.3)
        url = f"http://127.0.0.1:{closed}/a.gguf"
        with pytest.raises(FetchError, match=re.escape(url) + ": cannot connect"):
            await fetcher.fetch(url, "file")
        url = f"http://127.0.0.1:{quiet}/a.gguf"
        with trio.fail_after(5):
            with pytest.raises(FetchError) as info:
                await fetcher.fetch(url, "file")
        assert str(info.value) == f"{url}: no answer within 0.3 s"
        nursery.cancel_scope.cancel()


async def test_permission_denied_names_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    (root / "a.bin").write_bytes(b"abc")
    weights = tmp_path / "w"
    weights.mkdir()
    if os.geteuid() == 0:
        if (
            shutil.which("chattr") is None
            or subprocess.run(["chattr", "+i", str(weights)], capture_output=True).returncode
        ):
            pytest.skip("root ignores modes and chattr +i is not available here")
        undo = ["chattr", "-i", str(weights)]
    else:
        weights.chmod(0o500)
        undo = ["chmod", "700", str(weights)]
    try:
        async with trio.open_nursery() as nursery:
            port = await start_mirror(nursery, root)
            fetcher = await start_fetcher(nursery, weights)
            url = f"http://127.0.0.1:{port}/a.bin"
            with pytest.raises(FetchError) as info:
                await fetcher.fetch(url, "file")
            assert str(info.value) == (
                f"{weights / cache_name(url)}: permission denied (fetching {url})"
            )
            nursery.cancel_scope.cancel()
    finally:
        subprocess.run(undo, check=True)


async def test_disk_full_fails_naming_it_and_leaves_no_partial(tmp_path: Path) -> None:
    weights = tmp_path / "small"
    weights.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(weights)], capture_output=True
    )
    # The issue asks for a real small filesystem; under CI its absence fails the test.
    require(
        mounted.returncode == 0,
        "cannot mount a small tmpfs here: " + mounted.stderr.decode().strip(),
    )
    try:
        root = tmp_path / "mirror"
        root.mkdir()
        (root / "big.bin").write_bytes(blob(3 * MiB, 12))
        async with trio.open_nursery() as nursery:
            # The mirror says the length: refused from the head, before the first byte.
            port = await start_mirror(nursery, root)
            fetcher = await start_fetcher(nursery, weights)
            url = f"http://127.0.0.1:{port}/big.bin"
            with pytest.raises(FetchError) as info:
                await fetcher.fetch(url, "file")
            assert str(info.value).startswith(f"{url}: needs 3.0 MiB more in {weights}, "), info
            assert os.listdir(weights) == []
            # A server that says no length: the disk fills, and the partial is removed.
            raw = RawServer({"/big.bin": (200, {}, blob(3 * MiB, 12))}, no_length=True)
            url = f"http://127.0.0.1:{await raw.start(nursery)}/big.bin"
            with pytest.raises(FetchError) as info:
                await fetcher.fetch(url, "file")
            partial_file = weights / cache_name(url) / "big.bin.partial"
            assert str(info.value) == (
                f"{partial_file}: the disk is full (fetching {url}); the partial was removed"
            )
            assert os.listdir(weights / cache_name(url)) == []
            nursery.cancel_scope.cancel()
    finally:
        subprocess.run(["umount", str(weights)], check=True)


async def test_wrong_kind_and_bad_names_refused_before_any_request(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        fetcher = await start_fetcher(nursery, tmp_path / "w")
        with pytest.raises(FetchError, match="a version's URL ends in /"):
            await fetcher.fetch("http://127.0.0.1:1/v", "version")
        with pytest.raises(FetchError, match="ends in /, a version"):
            await fetcher.fetch("http://127.0.0.1:1/v/", "file")
        with pytest.raises(FetchError, match="names the fetcher keeps"):
            await fetcher.fetch("http://127.0.0.1:1/x.partial", "file")
        with pytest.raises(FetchError, match="is not a file name"):
            await fetcher.fetch("http://127.0.0.1:1/a/%2e%2e", "file")
        with pytest.raises(FetchError, match="only http:// and https://"):
            await fetcher.fetch("ftp://127.0.0.1/a", "file")
        assert os.listdir(tmp_path / "w") == []
        nursery.cancel_scope.cancel()


# --- progress -----------------------------------------------------------------------


def ticking() -> tuple[Callable[[], float], list[int]]:
    """A clock a quarter second later at every look, and how often it was looked at."""
    looks = [0]

    def clock() -> float:
        looks[0] += 1
        return looks[0] * 0.25

    return clock, looks


async def test_progress_at_most_once_a_second_with_the_real_total(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    root.mkdir()
    size = 16 * MiB  # a body read up to 1 MiB at a time: enough reads to tick through
    (root / "p.bin").write_bytes(blob(size, 13))
    clock, looks = ticking()
    calls: list[tuple[str, int, int | None, float]] = []
    async with trio.open_nursery() as nursery:
        port = await start_mirror(nursery, root)
        fetcher = await start_fetcher(
            nursery,
            tmp_path / "w",
            clock=clock,
            progress=lambda n, d, t: calls.append((n, d, t, looks[0] * 0.25)),
        )
        url = f"http://127.0.0.1:{port}/p.bin"
        await fetcher.fetch(url, "file")
        nursery.cancel_scope.cancel()
    assert len(calls) >= 3
    assert len(calls) <= looks[0] // 4 + 1  # one in four looks at most: rate-limited
    assert {c[0] for c in calls} == {cache_name(url)}
    assert {c[2] for c in calls} == {size}
    done = [c[1] for c in calls]
    assert done == sorted(done) and 0 < done[-1] <= size
    times = [c[3] for c in calls]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(times))


async def test_progress_invents_no_total_when_the_length_is_unknown(tmp_path: Path) -> None:
    size = 2 * MiB
    body = blob(size, 14)
    server = RawServer({"/u.bin": (200, {}, body)}, no_length=True)
    clock, _ = ticking()
    calls: list[tuple[int, int | None]] = []
    async with trio.open_nursery() as nursery:
        port = await server.start(nursery)
        fetcher = await start_fetcher(
            nursery, tmp_path / "w", clock=clock, progress=lambda n, d, t: calls.append((d, t))
        )
        path = await fetcher.fetch(f"http://127.0.0.1:{port}/u.bin", "file")
        assert sha(path.read_bytes()) == sha(body)
        nursery.cancel_scope.cancel()
    assert len(calls) >= 2
    assert {t for _, t in calls} == {None}
