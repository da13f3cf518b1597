"""The agent's fetcher: a source's bytes into the weights directory, once, never half-visible.

Called by the supervisor's sources (`llmgw.agent._sources`) before a shard's
first process. `Fetcher.fetch(url, kind)` brings one source into
`<weights_dir>/<cache_name>/` and returns what to hand the engine: the file (a
file source) or the directory (a version, a URL ending in `/`, whose mirror
manifest lists the files).

- **Single flight.** One download per cache name per Fetcher, however many
  callers wait; every waiter gets the same outcome (the path, or an error with
  the same message). A waiter cancelled leaves the others' download alone;
  when the last waiter goes, the download is cancelled (its partial stays, to
  be resumed). Downloads are tasks in the nursery `run` holds, at most
  `max_concurrent` at once (a `trio.CapacityLimiter`).
- **Never half-visible.** Bytes go to `<name>.partial`, are renamed to `<name>`
  once complete (and verified against the manifest's sha256, when it has one),
  and the completion marker `.llmgw-complete` is written last. A marker whose
  files are all there at their sizes means nothing is fetched.
- **Resumable.** A partial continues with `Range: bytes=N-` and `If-Range`
  with the ETag stored beside it (`<name>.partial.etag`). A 200 instead of 206
  (a server that ignores Range, or a file that changed) truncates and starts
  from 0, never appends; a 206 with another ETag, or from another offset, also
  starts again; a 416 whose `bytes */N` is the size already there is done.
  Without a strong ETag a partial cannot be resumed safely and starts from 0.
- **Errors** are `FetchError`, one line naming the URL or the file: an HTTP
  status, a hash mismatch (the partial is removed), disk full (the partial is
  removed: it holds the space the node needs), permission denied, a manifest
  `check_manifest` refuses (before anything is written), a version whose
  manifest, or a file whose Content-Length, says more than the weights disk has
  free (before its first byte; what is already there counts), a connection refused
  or broken, no answer within the connect or read deadline, a body longer
  than the manifest says (cut at the size, the partial removed).
- A sha256 is checked by reading the finished partial once more (in a thread)
  before the rename: simple, and a resumed file is hashed whole.
- **Progress** goes to `progress(cache_name, bytes_done, bytes_total)` at most
  once a second by `clock`; `bytes_total` is None when no one said the length.

HTTP is h11 over trio streams, one connection per request (a download is
long; a pool buys nothing): every wait has its deadline at the edge (connect and
TLS handshake within `connect_timeout_s`, the answer's head and then each read
within `read_timeout_s`), the head is bounded by h11, and nothing is left to
an async generator's finalizer. Bodies are asked for with
`Accept-Encoding: identity`; redirects are not followed. A body framed by
Content-Length is read straight from the stream once h11 has the head (1 MiB
reads, gathered 4 MiB per write in a thread), and TLS is `llmgw.web.h1.TlsClient`, which
decrypts every record that has arrived per read: measured with bench/fetch.py
on 2 GiB over loopback, h11's body buffer and trio.SSLStream's record-at-a-time
reads held the Fetcher to 65 % (HTTP) and 82 % (TLS) of curl; without them it
matched or passed curl in both.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Literal, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import attrs
import h11
import trio

from llmgw.agent.discovery import complete_entry
from llmgw.core import (
    MARKER,
    PARTIAL_SUFFIX,
    Manifest,
    ManifestError,
    bytes_text,
    cache_name,
    check_manifest,
)
from llmgw.errors import LlmgwError
from llmgw.web.h1 import (
    RECEIVE_BYTES,
    Broken,
    Quiet,
    TlsClient,
    body_length,
    one_line,
    read_head,
    receive,
)

log = logging.getLogger("llmgw.agent.fetch")

ETAG_SUFFIX = ".etag"  # beside the partial: <name>.partial.etag
WRITE_BYTES = 4 << 20  # bytes gathered before one write in a thread
PROGRESS_INTERVAL_S = 1.0
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
_UNSATISFIED = re.compile(r"bytes\s+\*/(\d+)")

_T = TypeVar("_T")
Kind = Literal["file", "version"]
Progress = Callable[[str, int, int | None], None]


class FetchError(LlmgwError):
    """A source could not be fetched; the message names the URL or file and why, in one line."""


@attrs.frozen
class FetcherStats:
    in_flight: int  # downloads running or waiting for the limiter
    downloads: int  # downloads started (a marker already there starts none)
    completed: int
    failed: int
    bytes_received: int


@attrs.define
class _Flight:
    name: str
    waiters: int = 0
    done: trio.Event = attrs.Factory(trio.Event)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    path: Path | None = None
    error: str | None = None


class _Restart(Exception):
    """The partial cannot be continued: truncate it and ask for the whole file."""


class Fetcher:
    def __init__(
        self,
        weights_dir: Path,
        *,
        max_concurrent: int = 2,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 30.0,
        max_manifest_bytes: int = 1 << 20,
        max_manifest_files: int = 4096,
        progress: Progress | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent {max_concurrent}: at least 1")
        self.weights_dir = weights_dir
        self._limiter = trio.CapacityLimiter(max_concurrent)
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._ssl_context = ssl_context
        self._max_manifest = (max_manifest_bytes, max_manifest_files)
        self._progress = progress
        self._clock = clock
        self._flights: dict[str, _Flight] = {}
        # A flight cancelled (its last waiter gone) may still be cleaning up when a new
        # one for the same name starts: one lock per name keeps them off the same partial.
        self._locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._downloads = self._completed = self._failed = self._bytes = 0

    def statistics(self) -> FetcherStats:
        return FetcherStats(
            len(self._flights), self._downloads, self._completed, self._failed, self._bytes
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Fetcher {self.weights_dir} in_flight={s.in_flight} downloads={s.downloads} "
            f"completed={s.completed} failed={s.failed}>"
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the downloads' nursery until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    # --- the waiters' side ------------------------------------------------------------

    async def fetch(
        self,
        url: str,
        kind: Kind,
        *,
        source: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Path:
        """The fetched file (kind "file") or directory (kind "version") of `url`.

        `source` is the catalog's text it is cached under (a `mirror:/x/` resolved to
        a URL keeps the name of what the catalog wrote); the URL itself by default.
        `ssl_context` is this fetch's TLS (the mirror's: the cluster CA and the agent's
        client certificate); the Fetcher's own by default. A flight already under way
        keeps the context it started with.
        """
        name = cache_name(source if source is not None else url)
        target = self._check_url(url, kind)
        if self._nursery is None:
            raise RuntimeError("Fetcher.fetch called while Fetcher.run is not running")
        flight = self._flights.get(name)
        if flight is None:
            flight = _Flight(name)
            self._flights[name] = flight
            context = ssl_context or self._ssl_context
            self._nursery.start_soon(self._fly, flight, url, kind, target, context)
        flight.waiters += 1
        try:
            await flight.done.wait()
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.done.is_set():
                flight.scope.cancel()
                if self._flights.get(name) is flight:
                    del self._flights[name]
        if flight.error is not None:
            raise FetchError(flight.error)
        assert flight.path is not None
        return flight.path

    def _check_url(self, url: str, kind: Kind) -> str | None:
        """The file name a file URL is saved under (None for a version)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise FetchError(f"{url}: only http:// and https:// URLs are fetched")
        if kind == "version":
            if not parts.path.endswith("/"):
                raise FetchError(f"{url}: a version's URL ends in / (its manifest)")
            return None
        if parts.path.endswith("/"):
            raise FetchError(f"{url}: ends in /, a version; a file's URL names the file")
        base = unquote(parts.path.rsplit("/", 1)[-1])
        # A file's name obeys exactly the rules of a manifest's names.
        probe = json.dumps({"files": [{"name": base, "size": 0}]}).encode()
        checked = check_manifest(probe, max_bytes=len(probe), max_files=1)
        if isinstance(checked, ManifestError):
            raise FetchError(f"{url}: cannot be saved under its name: {checked.message}")
        return base

    # --- the download -------------------------------------------------------------------

    def in_flight(self) -> frozenset[str]:
        """The cache names being fetched now (reclaim must leave them alone)."""
        return frozenset(self._flights)

    async def _fly(
        self,
        flight: _Flight,
        url: str,
        kind: Kind,
        base: str | None,
        context: ssl.SSLContext | None,
    ) -> None:
        lock = self._locks.setdefault(flight.name, trio.Lock())
        try:
            with flight.scope:
                async with lock, self._limiter:
                    flight.path = await self._fetch(flight.name, url, base, context)
        except FetchError as exc:
            flight.error = str(exc)
        except Exception as exc:  # a bug: every waiter hears of it; the service goes on
            flight.error = f"{url}: fetch failed: {type(exc).__name__}: {one_line(exc)}"
            log.exception("fetching %s failed", url)
        finally:
            if flight.path is None and flight.error is None:
                flight.error = f"{url}: the fetch was cancelled"
            if self._flights.get(flight.name) is flight:
                del self._flights[flight.name]
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._locks.pop(flight.name, None)
            if flight.error is None:
                self._completed += 1
            else:
                self._failed += 1
                log.info("fetch failed: %s", flight.error)
            flight.done.set()

    async def _fetch(
        self, name: str, url: str, base: str | None, context: ssl.SSLContext | None
    ) -> Path:
        directory = self.weights_dir / name
        done = await trio.to_thread.run_sync(_complete, directory)
        if done is not None:
            return directory / done[0] if base is not None else directory
        self._downloads += 1
        meter = _Meter(name, self._progress, self._clock)
        files: list[tuple[str, int | None, str | None]]
        if base is None:
            manifest = await self._manifest(url, context)
            files = [(f.name, f.size_bytes, f.sha256) for f in manifest.files]
            meter.total, meter.per_file = manifest.total_bytes, False
            # Before the first byte: a version the disk cannot hold is refused now, not
            # after it has filled the disk (what is already here, whole or partial, counts).
            await _os(url, _check_room, self.weights_dir, directory, files, url)
        else:
            files = [(base, None, None)]
        await _os(url, _mkdir, directory)
        sizes = []
        for file_name, size, digest in files:
            file_url = _beside(url, file_name) if base is None else url
            got = await self._file(file_url, directory, file_name, size, digest, meter, context)
            sizes.append((file_name, got))
        await _os(url, _write_marker, directory, sizes)
        return directory / files[0][0] if base is not None else directory

    async def _manifest(self, url: str, context: ssl.SSLContext | None) -> Manifest:
        limit, max_files = self._max_manifest
        async with self._request(url, {}, context) as response:
            if response.status_code != 200:
                raise FetchError(await _status_error(url, response))
            data = bytearray()
            with self._reading(url, lambda: len(data), None):
                while len(data) <= limit and (chunk := await response.next_chunk()):
                    data += chunk
        checked = check_manifest(bytes(data), max_bytes=limit, max_files=max_files)
        if isinstance(checked, ManifestError):
            raise FetchError(f"{url}: {checked.message}")
        return checked

    async def _file(
        self,
        url: str,
        directory: Path,
        name: str,
        size: int | None,
        digest: str | None,
        meter: _Meter,
        context: ssl.SSLContext | None,
    ) -> int:
        final = directory / name
        partial = directory / (name + PARTIAL_SUFFIX)
        tag_path = directory / (name + PARTIAL_SUFFIX + ETAG_SUFFIX)
        have = await _os(url, _existing, final, partial, size, digest)
        if have is not None:  # already there, right size (and hash)
            meter.add(have)
            return have
        for _ in range(3):
            try:
                got = await self._transfer(url, partial, tag_path, size, meter, context)
            except _Restart:
                await _os(url, _discard, partial, tag_path)
                continue
            break
        else:
            raise FetchError(f"{url}: the server's answers kept contradicting the partial")
        if size is not None and got != size:
            await _os(url, _discard, partial, tag_path)
            raise FetchError(f"{url}: got {got} bytes, the manifest says {size}")
        if digest is not None:
            actual = await _os(url, _sha256, partial)
            if actual != digest:
                await _os(url, _discard, partial, tag_path)
                raise FetchError(
                    f"{url}: sha256 is {actual}, the manifest says {digest}; "
                    "the partial was removed"
                )
        await _os(url, _finish, partial, final)
        return got

    async def _transfer(
        self,
        url: str,
        partial: Path,
        tag_path: Path,
        size: int | None,
        meter: _Meter,
        context: ssl.SSLContext | None,
    ) -> int:
        """Bring the partial to its full length; its length. Raises _Restart."""
        offset, tag = await _os(url, _resume_point, partial, tag_path, size)
        headers = {"range": f"bytes={offset}-", "if-range": tag} if offset and tag else {}
        if not headers:
            offset = 0
        async with self._request(url, headers, context) as response:
            status = response.status_code
            their_tag = _strong_etag(response)
            if status == 416 and headers:
                m = _UNSATISFIED.fullmatch(response.headers.get("content-range", "").strip())
                if m is not None and int(m.group(1)) == offset and their_tag == tag:
                    meter.add(offset)
                    return offset
                raise _Restart()
            if status == 206 and headers:
                m = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", "").strip())
                if m is None or int(m.group(1)) != offset or their_tag != tag:
                    raise _Restart()
                total = None if m.group(3) == "*" else int(m.group(3))
                if total is not None and int(m.group(2)) != total - 1:
                    raise _Restart()  # a range that stops short: not what was asked
                mode = "r+b"
            elif status == 200:
                offset = 0
                length = response.headers.get("content-length")
                total = int(length) if length is not None and length.isdigit() else None
                mode = "w+b"  # truncate: never append a whole file to a partial
            else:
                raise FetchError(await _status_error(url, response))
            if size is not None and total is not None and total != size:
                raise FetchError(f"{url}: the server has {total} bytes, the manifest says {size}")
            if meter.per_file and total is not None:
                # A file source: its length is known from the head, before its first byte.
                await _os(url, _room_for, self.weights_dir, total - offset, url, partial.parent)
            if meter.per_file:
                meter.total = total
            await _os(url, _write_tag, tag_path, their_tag)
            meter.add(offset)
            bound = size if size is not None else total
            return await self._receive(url, response, partial, mode, offset, bound, meter)

    async def _receive(
        self,
        url: str,
        response: _Response,
        partial: Path,
        mode: str,
        offset: int,
        total: int | None,
        meter: _Meter,
    ) -> int:
        f = await _os(url, _open, partial, mode, offset)
        written = offset
        # Chunks gathered for one write: a list, not a growing buffer, so that each
        # byte is copied once on its way to the file (measured: bench/fetch.py).
        chunks: list[bytes] = []
        gathered = 0
        over = False

        async def flush() -> None:
            nonlocal written, gathered
            data, n = chunks[:], gathered
            chunks.clear()  # a failed write leaves a true prefix; never write it twice
            gathered = 0
            await _os(url, _write, partial, f, data)
            written += n

        try:
            try:
                with self._reading(url, lambda: written + gathered, total):
                    while chunk := await response.next_chunk():
                        if total is not None and written + gathered + len(chunk) > total:
                            # A body without a length that runs on: the manifest's size
                            # bounds it, not the disk; what came is not trusted.
                            chunks.clear()
                            gathered = 0
                            over = True
                            raise FetchError(
                                f"{url}: sent more than the {total} bytes expected; "
                                "the partial was removed"
                            )
                        chunks.append(chunk)
                        gathered += len(chunk)
                        meter.add(len(chunk))
                        self._bytes += len(chunk)
                        if gathered >= WRITE_BYTES:
                            await flush()
            finally:
                # What arrived before a break is kept, so the next fetch resumes after it.
                with trio.CancelScope(shield=True):
                    try:
                        if chunks:
                            await flush()
                    finally:
                        await _os(url, _sync_close, partial, f)
        except FetchError as exc:
            if over or _disk_full(exc):
                with trio.CancelScope(shield=True):
                    await _os(url, _discard, partial, _tag_path(partial))
            if _disk_full(exc):
                raise FetchError(f"{exc}; the partial was removed") from exc
            raise
        if total is not None and written != total:
            raise FetchError(f"{url}: got {written} bytes of {total}; fetching again resumes")
        return written

    def _request(
        self, url: str, headers: dict[str, str], context: ssl.SSLContext | None
    ) -> _Request:
        return _Request(url, headers, self._timeouts, context)

    @contextlib.contextmanager
    def _reading(self, url: str, done: Callable[[], int], total: int | None) -> Iterator[None]:
        """A body that stops, or breaks, as FetchError saying how far it got."""
        try:
            yield
        except Quiet as exc:
            raise FetchError(
                f"{url}: no data for {self._timeouts[1]:g} s after {_of(done(), total)}; "
                "fetching again resumes"
            ) from exc
        except Broken as exc:
            raise FetchError(
                f"{url}: the connection broke after {_of(done(), total)} ({one_line(exc)}); "
                "fetching again resumes"
            ) from exc


@attrs.define
class _Response:
    status_code: int
    reason_phrase: str
    headers: dict[str, str]  # names lower-cased; a repeated one: the last
    _stream: trio.abc.Stream
    _conn: h11.Connection
    _read_timeout_s: float
    # A body framed by Content-Length (which h11 has checked): once h11's buffer is
    # drained, the rest is read straight from the stream, bypassing h11's buffer and
    # its copies; the connection is never reused, so h11 need not see it.
    _length: int | None = None
    _seen: int = 0  # body bytes h11 handed out
    _left: int | None = None  # body bytes still to read straight from the stream

    async def next_chunk(self) -> bytes:
        """The next piece of the body; b"" once it is complete. Raises Quiet, Broken."""
        if self._left is not None:
            return await self._raw_chunk()
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise Broken(str(exc)) from exc
            if event is h11.NEED_DATA:
                if self._length is not None:
                    self._left = self._length - self._seen
                    return await self._raw_chunk()
                self._conn.receive_data(await receive(self._stream, self._read_timeout_s))
            elif isinstance(event, h11.Data):
                self._seen += len(event.data)
                return bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return b""

    async def _raw_chunk(self) -> bytes:
        assert self._left is not None and self._length is not None
        if self._left <= 0:
            return b""
        data = await receive(self._stream, self._read_timeout_s, min(self._left, RECEIVE_BYTES))
        if not data:
            raise Broken(
                "peer closed connection without sending complete message body (received "
                f"{self._length - self._left} bytes, expected {self._length})"
            )
        self._left -= len(data)
        return data


class _Request:
    """`async with` one GET on its own connection: the answer's head, its body to read."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        timeouts: tuple[float, float],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.url, self.headers, self.timeouts = url, headers, timeouts
        self.ssl_context = ssl_context
        self.stream: trio.abc.Stream | None = None

    async def _connect(self, host: str, port: int, tls: bool) -> trio.abc.Stream:
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        self.stream = stream
        if tls:
            context = self.ssl_context or ssl.create_default_context()
            tls_stream = TlsClient(stream, context, host)
            self.stream = tls_stream
            await tls_stream.do_handshake()
            stream = tls_stream
        return stream

    async def __aenter__(self) -> _Response:
        try:
            return await self._open()
        except BaseException:
            if self.stream is not None:
                await trio.aclose_forcefully(self.stream)
            raise

    async def _open(self) -> _Response:
        url, (connect_s, read_s) = self.url, self.timeouts
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or ""
        try:
            port = parts.port or (443 if tls else 80)
        except ValueError as exc:
            raise FetchError(f"{url}: {exc}") from None
        try:
            with trio.fail_after(connect_s):
                self.stream = await self._connect(host, port, tls)
        except trio.TooSlowError:
            raise FetchError(f"{url}: could not connect within {connect_s:g} s") from None
        except (OSError, trio.BrokenResourceError) as exc:
            raise FetchError(f"{url}: cannot connect: {one_line(exc)}") from exc
        conn = h11.Connection(h11.CLIENT)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = h11.Request(
            method="GET",
            target=target,
            headers=[
                ("host", parts.netloc.rpartition("@")[2]),
                ("accept-encoding", "identity"),
                ("user-agent", "llmgw-agent"),
                ("connection", "close"),
                *self.headers.items(),
            ],
        )
        try:
            with trio.fail_after(read_s):
                await self.stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
                event = await read_head(conn, self.stream, read_s)
        except (trio.TooSlowError, Quiet):
            raise FetchError(f"{url}: no answer within {read_s:g} s") from None
        except (Broken, h11.RemoteProtocolError, trio.BrokenResourceError, OSError) as exc:
            raise FetchError(f"{url}: {one_line(exc)}") from exc
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
        return _Response(
            event.status_code,
            event.reason.decode("latin-1"),
            headers,
            self.stream,
            conn,
            read_s,
            body_length(event.status_code, headers),
        )

    async def __aexit__(self, *exc: object) -> None:
        if self.stream is not None:
            await trio.aclose_forcefully(self.stream)


class _Meter:
    """Bytes done of a source, reported at most once per PROGRESS_INTERVAL_S."""

    def __init__(self, name: str, progress: Progress | None, clock: Callable[[], float]) -> None:
        self.name, self.progress, self.clock = name, progress, clock
        self.done = 0
        self.total: int | None = None
        self.per_file = True  # a file source learns its total from the response
        self.last = -math.inf

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is None or n == 0:
            return
        now = self.clock()
        if now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            self.progress(self.name, self.done, self.total)


# --- small pieces ---------------------------------------------------------------------


def _beside(version_url: str, name: str) -> str:
    """The URL of a manifest's file: the version's path and the name, quoted."""
    parts = urlsplit(version_url)
    return urlunsplit(parts._replace(path=parts.path + quote(name, safe=""), query=""))


def _strong_etag(response: _Response) -> str | None:
    tag: str | None = response.headers.get("etag")
    if tag is None or tag.startswith("W/") or not tag.startswith('"'):
        return None  # a weak ETag cannot be used with If-Range
    return tag


def _of(done: int, total: int | None) -> str:
    return f"{done} of {total} bytes" if total is not None else f"{done} bytes"


async def _status_error(url: str, response: _Response) -> str:
    """One line for an answer that is not the bytes: the status and the start of its body."""
    body = b""
    try:
        with trio.move_on_after(2):
            while len(body) < 200 and (chunk := await response.next_chunk()):
                body += chunk
    except (Quiet, Broken):
        pass
    text = " ".join(body[:200].decode("utf-8", "replace").split())
    said = f": {text}" if text and not text.lstrip().startswith("<") else ""
    return f"{url}: HTTP {response.status_code} {response.reason_phrase}{said}"


def _disk_full(exc: FetchError) -> bool:
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)


async def _os(url: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Run a filesystem step in a thread, its OSError as one line naming the file."""
    try:
        return await trio.to_thread.run_sync(fn, *args)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else args[0]
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            what = "the disk is full"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            what = "permission denied"
        else:
            what = exc.strerror or type(exc).__name__
        raise FetchError(f"{where}: {what} (fetching {url})") from exc


def _check_room(
    weights_dir: Path, directory: Path, files: list[tuple[str, int | None, str | None]], url: str
) -> None:
    """FetchError when the files still to fetch are more than the disk has free."""
    here = 0
    for name, size, _ in files:
        for path in (directory / name, directory / (name + PARTIAL_SUFFIX)):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                here += min(path.stat().st_size, size or 0)
                break
    _room_for(weights_dir, sum(size or 0 for _, size, _ in files) - here, url)


def _room_for(weights_dir: Path, needed: int, url: str, empty: Path | None = None) -> None:
    """FetchError when `needed` bytes are more than the disk has free; `empty`, the entry
    made for the fetch, is removed with the refusal when nothing is in it."""
    st = os.statvfs(weights_dir)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        if empty is not None:
            with contextlib.suppress(OSError):
                empty.rmdir()  # only when empty: a partial from before stays
        raise FetchError(
            f"{url}: needs {bytes_text(needed)} more in {weights_dir}, which has "
            f"{bytes_text(free)} free; nothing was fetched"
        )


def _complete(directory: Path) -> list[str] | None:
    """The file names of a complete cache entry (its marker, files at their sizes), else None.

    The same test the weights scan makes (`discovery.complete_entry`): what the scan
    reports is exactly what the fetcher would not fetch again."""
    entry = complete_entry(directory)
    return None if entry is None else [name for name, _ in entry]


def _mkdir(directory: Path) -> None:
    directory.mkdir(exist_ok=True)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _existing(final: Path, partial: Path, size: int | None, digest: str | None) -> int | None:
    """The size of a final file that is already right; otherwise make way for the partial."""
    try:
        st = final.stat()
    except FileNotFoundError:
        return None
    if size is None:
        # A file source renamed but not yet marked: back to a partial; a Range from its
        # length then answers 416 (complete) or the rest.
        if not partial.exists():
            os.replace(final, partial)
        else:
            final.unlink()
        return None
    if st.st_size == size and (digest is None or _sha256(final) == digest):
        return size
    final.unlink()
    return None


def _resume_point(partial: Path, tag_path: Path, size: int | None) -> tuple[int, str | None]:
    try:
        offset = partial.stat().st_size
    except FileNotFoundError:
        return 0, None
    try:
        tag = tag_path.read_text().strip() or None
    except FileNotFoundError:
        tag = None
    if size is not None and offset > size:
        return 0, None
    return offset, tag


def _write_tag(tag_path: Path, tag: str | None) -> None:
    if tag is None:
        tag_path.unlink(missing_ok=True)  # no ETag: this partial cannot be resumed safely
    else:
        tag_path.write_text(tag)


def _open(partial: Path, mode: str, offset: int) -> IO[bytes]:
    if mode == "r+b" and not partial.exists():
        mode = "w+b"
    f = open(partial, mode)  # noqa: SIM115 - closed by _sync_close
    f.seek(offset)
    f.truncate()  # whatever lay beyond the offset is not the server's
    return f


def _write(partial: Path, f: IO[bytes], chunks: list[bytes]) -> None:
    f.writelines(chunks)


def _tag_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ETAG_SUFFIX)


def _sync_close(partial: Path, f: IO[bytes]) -> None:
    try:
        f.flush()
        os.fsync(f.fileno())
    finally:
        f.close()


def _discard(partial: Path, tag_path: Path) -> None:
    partial.unlink(missing_ok=True)
    tag_path.unlink(missing_ok=True)


def _finish(partial: Path, final: Path) -> None:
    # The ETag stays until the marker is written: a file renamed but not yet marked
    # goes back to a partial and is confirmed by a 416 (see _existing).
    os.replace(partial, final)


def _write_marker(directory: Path, sizes: list[tuple[str, int]]) -> None:
    body = json.dumps({"files": [{"name": n, "size": s} for n, s in sizes]}).encode()
    tmp = directory / (MARKER + PARTIAL_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MARKER)
    for name, _ in sizes:
        (directory / (name + PARTIAL_SUFFIX + ETAG_SUFFIX)).unlink(missing_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the renames before the marker, and the marker, reach the disk
    finally:
        os.close(fd)
