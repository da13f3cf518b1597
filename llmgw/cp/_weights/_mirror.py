"""The weights mirror: the bytes under one directory, and nothing else, over HTTP/1.1.

llmgw-cp serves `mirror.dir` (server.yaml) with it on its own listener
(llmgw/cp/_main.py). An operator copies weights in by hand; the mirror keeps
no record of them beyond an in-memory cache of hashes.

- `GET`/`HEAD /a/b.gguf`: the file, with `Content-Length`, a strong `ETag`
  (`"<size>-<mtime_ns>"`), `Last-Modified` and `Accept-Ranges: bytes`. One
  `Range` (`bytes=a-b`, `a-`, `-n`) answers 206; an unsatisfiable one 416 with
  `Content-Range: bytes */size`. A Range this server does not take (another
  unit, bad syntax, several ranges) is ignored: 200 with the whole file, as
  RFC 9110 allows. `If-Range` is honoured only with an ETag (a date never
  matches, so the answer is the whole file: always correct, never mixed).
- `GET`/`HEAD /a/` (a version: a directory, with its trailing slash): the JSON
  manifest `{"files": [{"name", "size", "sha256"}]}` of the directory's regular
  files, sorted by name; not recursive (subdirectories are not listed). The
  sha256 is computed in a thread, one file at a time, and cached by
  (path, size, mtime_ns). A directory without its slash is a 404 that says so
  (no redirect: nothing here echoes the client's target back). A file that
  changes while it is hashed (still being copied in) answers 503.
- `GET`/`HEAD /simple/` and `/simple/<project>/`: a Python package index of the
  wheels (and sdists) an operator puts in `<root>/simple/<project>/` (PEP 503's
  layout; a directory's name is normalized as PEP 503 says, so `My_Pkg/` is the
  project `my-pkg`): PEP 691 JSON when the client's Accept names
  `application/vnd.pypi.simple.v1+json` (pip >= 22.2 asks for it first), else
  the minimal PEP 503 HTML page, every name escaped (the only HTML this server
  writes). Each file's link carries its sha256 from the hash cache; the files
  themselves are the plain files under the root. A project name that is not a
  valid one (PEP 508) is a 404; no `<root>/simple/` is an empty index.
- Names beginning with a dot are neither served nor listed: rsync's
  temporaries (`.a.gguf.Xy12`) and editors' files are not weights yet.

The peer is hostile: the target is decoded segment by segment and refused
(400) if a segment is empty, `.`, `..`, or holds a separator, a backslash, NUL
or a control character once percent-decoded; an absolute-form target is a 400.
The path is then resolved and must stay under the resolved root, so a symlink
that leads out is a 404, and the file is opened without following a last
symlink and without blocking (a FIFO is not a regular file: 404). Only GET and
HEAD (405 with `Allow`); a method with a lowercase letter is no method (400:
methods are case-sensitive); a request with a body is a 400, and one with a
transfer coding but chunked a 501 (h11 refuses it). The head must fit in
`max_head_bytes` (431) and arrive within `head_timeout_s` of its first byte
(408); an idle connection is closed after `keepalive_s`; every write must
complete within `send_timeout_s`; beyond `max_connections` a new connection is closed at
once (these bounds: `MIRROR_LIMITS`, an `llmgw.web.limits.ListenerLimits`). A refusal
says `connection: close`.

Every answered request is one INFO line on the logger "llmgw.cp.mirror" (the
access log): `GET '/tiny/a.gguf' 206 1048576 bytes to 10.0.0.5:41234`: the
method, the target as the client sent it (quoted and escaped, so a hostile
target cannot forge a line), the status, the body bytes sent and the peer;
` (cut)` ends the line of an answer that did not complete. A head that cannot
be read as a request logs `- '-'` for its method and target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import ssl
import stat
from email.utils import formatdate
from pathlib import Path

import attrs
import h11
import trio

from llmgw.cp._weights._paths import (
    DIST_SUFFIXES,
    SIMPLE_JSON,
    Refusal,
    Unsatisfiable,
    _show,
    etag,
    is_project_name,
    normalize,
    parse_range,
    parse_target,
    project_list,
    project_page,
    wants_json,
)
from llmgw.web.limits import ListenerLimits

log = logging.getLogger("llmgw.cp.mirror")

READ_SIZE = 65536
ALLOW = b"GET, HEAD"
_REASONS = {
    400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 416: "Range Not Satisfiable",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable",
}  # fmt: skip


# The client-side bounds of the mirror's listener. It takes no request body, so
# body_timeout_s and discard_bytes are not read. Connections beyond
# max_connections are closed at once: a node needs a few, and a peer that opens
# thousands must not take the control plane's file descriptors.
MIRROR_LIMITS = ListenerLimits(
    head_timeout_s=10.0,
    keepalive_s=30.0,
    send_timeout_s=60.0,
    handshake_timeout_s=10.0,
    max_head_bytes=16384,
    max_connections=256,
)
# A file is read (pread, in a thread) and written in pieces of this size: how the
# mirror moves its own bytes, not a bound on the client, so not in MIRROR_LIMITS.
CHUNK_BYTES = 1 << 20


# --- the manifest's hashes ----------------------------------------------------------------


@attrs.frozen
class ManifestCacheStats:
    entries: int
    hashed: int  # files read and hashed since start
    hits: int  # hashes answered from the cache


class _Changed(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _unhashable(where: str, exc: _Changed | OSError) -> Refusal:
    """The 503 for a directory whose files could not be hashed: one still being copied
    in (ask again soon), or one that cannot be read."""
    if isinstance(exc, _Changed):
        return Refusal(
            503,
            f"{where.rstrip('/')}/{exc.name} changed while it was hashed (still being copied "
            "in?); ask again once it is complete",
            ((b"retry-after", b"5"),),
        )
    return Refusal(503, f"{where.rstrip('/')}/: cannot read a file: {exc}")


class ManifestCache:
    """sha256 of each file, by (path, size, mtime_ns): a file is hashed again only if it changed.

    One entry per path (a changed file replaces its entry), so the cache is
    bounded by the files under the root. Hashing is one file at a time: it is
    disk-bound, and two manifests asked together must not read the same
    15 GB twice.
    """

    def __init__(self) -> None:
        self._hashes: dict[str, tuple[int, int, str]] = {}
        self._hashing = trio.Lock()
        self._hashed = 0
        self._hits = 0

    def statistics(self) -> ManifestCacheStats:
        return ManifestCacheStats(len(self._hashes), self._hashed, self._hits)

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<ManifestCache entries={s.entries} hashed={s.hashed} hits={s.hits}>"

    async def sha256(self, name: str, path: str, size: int, mtime_ns: int) -> str:
        async with self._hashing:
            known = self._hashes.get(path)
            if known is not None and known[:2] == (size, mtime_ns):
                self._hits += 1
                return known[2]
            digest, after = await trio.to_thread.run_sync(_hash_file, path)
            self._hashed += 1
            if after != (size, mtime_ns):
                self._hashes.pop(path, None)
                raise _Changed(name)
            self._hashes[path] = (size, mtime_ns, digest)
            return digest


def _hash_file(path: str) -> tuple[str, tuple[int, int]]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        st = os.fstat(f.fileno())
    return digest, (st.st_size, st.st_mtime_ns)


# --- filesystem, in threads ---------------------------------------------------------------


def _contained(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip("/") + "/")


def _locate(root: str, segments: tuple[str, ...]) -> str | None:
    """The real path of segments under root, or None if it resolves outside root."""
    real = os.path.realpath(os.path.join(root, *segments))
    return real if _contained(real, root) else None


def _open_file(real: str) -> tuple[int, os.stat_result] | str:
    """An open regular file and its stat, or what it is instead."""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        return "directory"
    except OSError as exc:
        return exc.strerror or "cannot be opened"
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        return exc.strerror or "cannot be opened"
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        return "directory"
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return "special"
    return fd, st


def _list_directory(real: str, root: str) -> list[tuple[str, str, int, int]] | None:
    """(name, real path, size, mtime_ns) of each regular file directly in `real`, sorted."""
    try:
        if not stat.S_ISDIR(os.stat(real).st_mode):
            return None
        entries = list(os.scandir(real))
    except OSError:
        return None
    out = []
    for entry in entries:
        name = entry.name
        if name.startswith("."):
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            continue  # not a name a URL can carry
        path = entry.path
        try:
            if entry.is_symlink():
                path = os.path.realpath(path)
                if not _contained(path, root):
                    continue
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((name, path, st.st_size, st.st_mtime_ns))
    out.sort()
    return out


def _list_projects(root: str) -> dict[str, list[str]]:
    """normalized project -> the directory names under <root>/simple/ that hold it."""
    simple = _locate(root, ("simple",))
    out: dict[str, list[str]] = {}
    if simple is None:
        return out
    try:
        entries = list(os.scandir(simple))
    except OSError:
        return out
    for entry in entries:
        name = entry.name
        if name.startswith(".") or not is_project_name(name):
            continue
        real = _locate(root, ("simple", name))
        if real is not None and os.path.isdir(real):
            out.setdefault(normalize(name), []).append(name)
    for dirs in out.values():
        dirs.sort()
    return out


# --- the connection ---------------------------------------------------------------------


class _Cut(Exception):
    """The connection cannot go on (a write too slow, a file that shrank): close it."""


@attrs.define
class _Tally:
    """What one connection's current answer has sent: for the access log."""

    status: int = 0
    sent: int = 0


def _peer_of(stream: trio.abc.Stream) -> str:
    sock_stream = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if not isinstance(sock_stream, trio.SocketStream):
        return "-"
    try:
        peer = sock_stream.socket.getpeername()
    except OSError:
        return "-"
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = f"[{peer[0]}]" if ":" in str(peer[0]) else str(peer[0])
        return f"{host}:{peer[1]}"
    return str(peer) or "-"


def _access(method: bytes, target: bytes, status: int, sent: int, peer: str, done: bool) -> None:
    # h11 admits only a token as a method: never a space or a line break.
    log.info(
        "%s %s %d %d bytes to %s%s",
        method.decode("ascii", "replace")[:16],
        _show(target, 200),
        status,
        sent,
        peer,
        "" if done else " (cut)",
    )


class _Mirror:
    def __init__(self, root: str, limits: ListenerLimits, cache: ManifestCache) -> None:
        self.root = root
        self.limits = limits
        self.cache = cache
        # Each open connection's current answer, by its h11 state machine.
        self._tallies: dict[h11.Connection, _Tally] = {}

    async def connection(self, stream: trio.abc.Stream, peer: str = "-") -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_bytes)
        try:
            while True:
                got = await self._next_request(stream, conn)
                if got is None:
                    return
                if isinstance(got, Refusal):
                    await self._refuse(stream, got, peer)
                    return
                tally = self._tallies[conn] = _Tally()
                try:
                    await self._answer(stream, conn, got)
                finally:
                    del self._tallies[conn]
                    if tally.status:
                        done = conn.our_state in (h11.DONE, h11.MUST_CLOSE)
                        _access(got.method, got.target, tally.status, tally.sent, peer, done)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (_Cut, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:
            # One connection's bug must not end the listener (serve_listeners' nursery).
            log.exception("the mirror failed on a connection; closing it")
        finally:
            await trio.aclose_forcefully(stream)

    async def _next_request(
        self, stream: trio.abc.Stream, conn: h11.Connection
    ) -> h11.Request | Refusal | None:
        """The next request head; None when the client closes or idles out."""
        limits = self.limits
        # h11 bounds only a head still incomplete; one that arrives whole in a read is
        # measured here: what was fed, less what it has not parsed yet.
        fed = len(conn.trailing_data[0])
        started = bool(fed)
        deadline = trio.current_time() + (limits.head_timeout_s if started else limits.keepalive_s)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if exc.error_status_hint == 501:  # h11: a transfer coding but chunked
                    return Refusal(501, f"{exc}: no other transfer coding is applied here")
                return Refusal(exc.error_status_hint, f"the request head is malformed: {exc}")
            if event is h11.NEED_DATA:
                with trio.move_on_at(deadline) as timer:
                    data = await stream.receive_some(READ_SIZE)
                if timer.cancelled_caught:
                    if not started:
                        return None
                    return Refusal(
                        408,
                        f"the request head did not arrive within {limits.head_timeout_s:g} s "
                        "(head_timeout_s)",
                    )
                if not data:
                    return None
                if not started:
                    started = True
                    deadline = trio.current_time() + limits.head_timeout_s
                conn.receive_data(bytes(data))
                fed += len(data)
                continue
            if isinstance(event, h11.Request):
                size = fed - len(conn.trailing_data[0])
                if size > limits.max_head_bytes:
                    return Refusal(
                        431,
                        f"the request head has {size} bytes, at most {limits.max_head_bytes} "
                        "(max_head_bytes)",
                    )
                return self._admit(conn, event)
            return None  # ConnectionClosed (anything else cannot come before a Request)

    def _admit(self, conn: h11.Connection, request: h11.Request) -> h11.Request | Refusal:
        if request.method != request.method.upper():
            # h11 takes any token; methods are case-sensitive (RFC 9110 §9.1), and a
            # lowercase one is no method: 400, as llhttp says on the router's listener.
            return Refusal(
                400,
                f"{request.method.decode('latin-1')} is not a method; methods are "
                "case-sensitive (GET, not get)",
            )
        if request.method not in (b"GET", b"HEAD"):
            return Refusal(
                405,
                f"{request.method.decode('latin-1')} is not served here: only GET and HEAD",
                ((b"allow", ALLOW),),
            )
        for name, value in request.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return Refusal(400, "a GET or HEAD to the mirror carries no body")
        try:
            end = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return Refusal(400, f"the request is malformed: {exc}")
        if not isinstance(end, h11.EndOfMessage):
            return Refusal(400, "a GET or HEAD to the mirror carries no body")
        return request

    async def _refuse(self, stream: trio.abc.Stream, refusal: Refusal, peer: str) -> None:
        """Answer what cannot be read as a request, then end our side (the caller closes)."""
        body = f"{_REASONS.get(refusal.status, 'error').lower()}: {refusal.reason}\n".encode()
        head = [
            b"HTTP/1.1 %d %s\r\n" % (refusal.status, _REASONS.get(refusal.status, "").encode()),
            b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n",
            b"content-length: %d\r\n" % len(body),
            *(b"%s: %s\r\n" % h for h in refusal.headers),
            b"\r\n",
        ]
        log.debug("refused a request: %d %s", refusal.status, refusal.reason)
        sent = False
        with (
            trio.move_on_after(1),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
        ):
            try:
                await stream.send_all(b"".join(head) + body)
                sent = True
            finally:
                _access(b"-", b"-", refusal.status, len(body) if sent else 0, peer, sent)
            # Read and drop what the client still sends (briefly, boundedly): closing
            # with unread bytes resets the connection, which can destroy the answer.
            if isinstance(stream, trio.SocketStream):
                stream.socket.shutdown(trio.socket.SHUT_WR)
            dropped = 0
            while dropped < (1 << 20):
                data = await stream.receive_some(READ_SIZE)
                if not data:
                    break
                dropped += len(data)

    async def _send(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        event: h11.Response | h11.Data | h11.EndOfMessage,
    ) -> None:
        data = conn.send(event)
        if not data:
            return
        with trio.move_on_after(self.limits.send_timeout_s) as timer:
            await stream.send_all(data)
        tally = self._tallies.get(conn)
        if tally is not None and not timer.cancelled_caught:
            if isinstance(event, h11.Response):
                tally.status = event.status_code
            elif isinstance(event, h11.Data):
                tally.sent += len(event.data)
        if timer.cancelled_caught:
            log.info(
                "a mirror client stopped reading for %g s (send_timeout_s); closing",
                self.limits.send_timeout_s,
            )
            raise _Cut()

    async def _simple(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        await self._send(
            stream,
            conn,
            h11.Response(
                status_code=status,
                headers=[*headers, (b"content-length", b"%d" % len(body))],
                reason=_REASONS.get(status, "").encode(),
            ),
        )
        if body and request.method != b"HEAD":
            await self._send(stream, conn, h11.Data(data=body))
        await self._send(stream, conn, h11.EndOfMessage())

    async def _error(
        self, stream: trio.abc.Stream, conn: h11.Connection, request: h11.Request, r: Refusal
    ) -> None:
        body = f"{_REASONS.get(r.status, 'error').lower()}: {r.reason}\n".encode()
        headers = [(b"content-type", b"text/plain; charset=utf-8"), *r.headers]
        await self._simple(stream, conn, request, r.status, body, headers)

    async def _answer(
        self, stream: trio.abc.Stream, conn: h11.Connection, request: h11.Request
    ) -> None:
        target = parse_target(request.target)
        if isinstance(target, Refusal):
            # A malformed path is the client's; the connection can go on.
            await self._error(stream, conn, request, target)
            return
        shown = "/" + "/".join(target.segments) + ("/" if target.directory else "")
        real = await trio.to_thread.run_sync(_locate, self.root, target.segments)
        if real is None:
            await self._error(stream, conn, request, Refusal(404, f"{shown}: not found"))
            return
        if target.directory and target.segments[:1] == ("simple",) and len(target.segments) <= 2:
            await self._simple_index(stream, conn, request, target.segments[1:])
        elif target.directory:
            await self._manifest(stream, conn, request, real, shown)
        else:
            await self._file(stream, conn, request, real, shown)

    async def _simple_index(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        project: tuple[str, ...],
    ) -> None:
        accept = next((v for k, v in request.headers if k == b"accept"), None)
        as_json = wants_json(accept)
        projects = await trio.to_thread.run_sync(_list_projects, self.root)
        if not project:
            body = project_list(list(projects), as_json)
        else:
            asked = project[0]
            if not is_project_name(asked) or normalize(asked) not in projects:
                shown = _show(asked.encode("utf-8", "replace"))
                await self._error(
                    stream, conn, request, Refusal(404, f"no project {shown} in /simple/")
                )
                return
            name = normalize(asked)
            files: list[tuple[str, str, str]] = []
            try:
                for d in projects[name]:
                    real = await trio.to_thread.run_sync(_locate, self.root, ("simple", d))
                    listed = (
                        await trio.to_thread.run_sync(_list_directory, real, self.root)
                        if real is not None
                        else None
                    )
                    for fname, path, size, mtime_ns in listed or []:
                        if fname.endswith(DIST_SUFFIXES):
                            digest = await self.cache.sha256(fname, path, size, mtime_ns)
                            files.append((fname, f"simple/{d}/{fname}", digest))
            except (_Changed, OSError) as exc:
                await self._error(stream, conn, request, _unhashable(f"/simple/{name}/", exc))
                return
            files.sort()
            body = project_page(name, files, as_json)
        kind = SIMPLE_JSON.encode() if as_json else b"text/html; charset=utf-8"
        headers = [(b"content-type", kind), (b"cache-control", b"no-cache"), (b"vary", b"accept")]
        await self._simple(stream, conn, request, 200, body, headers)

    async def _manifest(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        real: str,
        shown: str,
    ) -> None:
        listed = await trio.to_thread.run_sync(_list_directory, real, self.root)
        if listed is None:
            await self._error(stream, conn, request, Refusal(404, f"{shown}: not a directory here"))
            return
        files = []
        try:
            for name, path, size, mtime_ns in listed:
                digest = await self.cache.sha256(name, path, size, mtime_ns)
                files.append({"name": name, "size": size, "sha256": digest})
        except (_Changed, OSError) as exc:
            await self._error(stream, conn, request, _unhashable(shown, exc))
            return
        body = json.dumps({"files": files}, separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-cache")]
        await self._simple(stream, conn, request, 200, body, headers)

    async def _file(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        real: str,
        shown: str,
    ) -> None:
        opened = await trio.to_thread.run_sync(_open_file, real)
        if isinstance(opened, str):
            reason = {
                "directory": f"{shown} is a directory: a version is asked for as {shown}/",
                "special": f"{shown} is not a regular file",
            }.get(opened, f"{shown}: {opened.lower()}")
            await self._error(stream, conn, request, Refusal(404, reason))
            return
        fd, st = opened
        try:
            await self._send_file(stream, conn, request, fd, st)
        finally:
            os.close(fd)

    async def _send_file(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        fd: int,
        st: os.stat_result,
    ) -> None:
        size = st.st_size
        tag = etag(size, st.st_mtime_ns)
        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"etag", tag),
            (b"last-modified", formatdate(st.st_mtime, usegmt=True).encode()),
            (b"accept-ranges", b"bytes"),
        ]
        fields = {name: value for name, value in request.headers}
        asked = fields.get(b"range")
        if asked is not None and b"if-range" in fields and fields[b"if-range"].strip() != tag:
            asked = None  # the client's copy is another version: send this one whole
        span = parse_range(asked, size)
        if isinstance(span, Unsatisfiable):
            await self._error(
                stream,
                conn,
                request,
                Refusal(
                    416,
                    f"the range {_show(asked or b'')} lies outside the file's {size} bytes",
                    ((b"content-range", b"bytes */%d" % size), *headers[1:]),
                ),
            )
            return
        if span is None:
            status, start, length = 200, 0, size
        else:
            status, start, length = 206, span[0], span[1] - span[0] + 1
            headers.append((b"content-range", b"bytes %d-%d/%d" % (span[0], span[1], size)))
        headers.append((b"content-length", b"%d" % length))
        await self._send(
            stream,
            conn,
            h11.Response(
                status_code=status,
                headers=headers,
                reason=b"Partial Content" if status == 206 else b"OK",
            ),
        )
        if request.method != b"HEAD":
            offset, end = start, start + length
            chunk = CHUNK_BYTES
            while offset < end:
                data = await trio.to_thread.run_sync(os.pread, fd, min(chunk, end - offset), offset)
                if not data:
                    log.info("a file shrank while it was sent (at %d of %d bytes)", offset, end)
                    raise _Cut()  # the client sees a short body, never a complete-looking one
                await self._send(stream, conn, h11.Data(data=data))
                offset += len(data)
        await self._send(stream, conn, h11.EndOfMessage())


async def serve_mirror(
    root: Path,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    limits: ListenerLimits | None = None,
    cache: ManifestCache | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the files under `root` on host:port until cancelled; `task_status.started(port)`.

    `port` 0 binds a free port; the one bound is what `started` gives.
    `ssl_context`: a server context (the control plane's certificate) to speak
    TLS; plain HTTP without it. `limits`: the listener's bounds, `MIRROR_LIMITS`
    when not given.
    """
    real_root = await trio.to_thread.run_sync(os.path.realpath, os.fspath(root))
    if not await trio.to_thread.run_sync(os.path.isdir, real_root):
        raise NotADirectoryError(f"the mirror's root {root} is not a directory")
    lim = limits or MIRROR_LIMITS
    mirror = _Mirror(real_root, lim, cache or ManifestCache())
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = int(listeners[0].socket.getsockname()[1])

    active = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal active
        if lim.max_connections is not None and active >= lim.max_connections:
            log.info("mirror at %d connections (max_connections): closing a new one", active)
            await trio.aclose_forcefully(stream)
            return
        active += 1
        try:
            peer = _peer_of(stream)
            if ssl_context is None:
                await mirror.connection(stream, peer)
                return
            tls = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
            try:
                with trio.fail_after(lim.handshake_timeout_s):
                    await tls.do_handshake()
            except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
                log.debug("a TLS handshake with a mirror client failed or took too long")
                await trio.aclose_forcefully(tls)
                return
            await mirror.connection(tls, peer)
        finally:
            active -= 1

    log.info("weights mirror serving %s on %s:%d", real_root, host, bound)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(bound)
