"""How many bytes each fetched catalog source is: what placement checks a node's disk against.

A task of llmgw-cp (never inside a reconciler pass) measures every fetched
source of the catalog, every `refresh_s` and whenever the catalog changes,
and pokes the reconciler when a size changes:

| source                    | measured by                                               |
|---------------------------|-----------------------------------------------------------|
| `mirror:/a/b.gguf`        | the file in this control plane's own `mirror.dir`, stat'ed |
| `mirror:/a/v/`            | the files the mirror would list for that directory, summed |
| `http(s)://…/file`        | a HEAD: its `Content-Length`                              |
| `http(s)://…/dir/`        | its manifest (a bounded GET, `check_manifest`): `total_bytes` |

The mirror is read from disk, by the mirror's own rules (`llmgw/cp/_weights/_mirror.py`:
the target decoded and refused as the mirror would, the path kept under the
root, dot-names neither served nor listed): a file the mirror would not serve
has no size. An https source elsewhere is checked against the system's
default trust. Every measurement has a deadline (`deadline_s`, the request and
a disk read alike); redirects are not followed (the agent's fetcher does not
follow them either).

A size that cannot be learned is unknown (None), never 0: placement never
refuses on it. Why is logged once per source per distinct reason. A source
not yet measured at all (the catalog just named it, or the control plane just
started) is `MEASURING`: the reconciler places nothing for it until the round
that measures it ends, and that round pokes the reconciler, so a model whose
weights no node has room for is never started (and fetched) in the moment
before its size is known.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import httpx
import trio

from llmgw import core
from llmgw.cp._weights import _mirror, _paths
from llmgw.errors import ConfigError

log = logging.getLogger("llmgw.cp.sizes")

DEADLINE_S = 5.0
REFRESH_S = 60.0
MAX_MANIFEST_BYTES = 1 << 20  # as the agent's fetcher
MAX_MANIFEST_FILES = 4096
MAX_CONCURRENT = 8


class Measuring:
    """The size of a source the task has not measured yet (`MEASURING`)."""

    def __repr__(self) -> str:
        return "MEASURING"


MEASURING = Measuring()


@attrs.frozen
class Unknown:
    """Why a source's size is not known, in one line."""

    reason: str


# --- the mirror's directory, blocking (run in a thread) ------------------------------------


def mirror_size(root: str, path: str) -> int | Unknown:
    """The bytes the mirror under the resolved `root` serves for `path` (`/a/b.gguf`,
    or `/a/v/` for a version: its listed files summed)."""
    target = _paths.parse_target(path.encode("utf-8", "surrogateescape"))
    if isinstance(target, _paths.Refusal):
        return Unknown(f"the mirror would refuse it ({target.status}): {target.reason}")
    real = _mirror._locate(root, target.segments)
    if real is None:
        return Unknown(f"not under mirror.dir {root} (a link that leads out?)")
    if target.directory:
        listed = _mirror._list_directory(real, root)
        if listed is None:
            return Unknown(f"{real} is not a directory in mirror.dir")
        if not listed:
            return Unknown(f"{real} holds no file the mirror would list")
        return sum(size for _name, _path, size, _mtime in listed)
    opened = _mirror._open_file(real)
    if isinstance(opened, str):
        what = {
            "directory": f"{real} is a directory: a version is named with a trailing /",
            "special": f"{real} is not a regular file",
        }
        return Unknown(what.get(opened, f"{real}: {opened.lower()}"))
    fd, st = opened
    os.close(fd)
    return st.st_size


# --- over HTTP ----------------------------------------------------------------------------


async def head_size(client: httpx.AsyncClient, url: str) -> int | Unknown:
    """A file's size by a HEAD: its Content-Length."""
    try:
        r = await client.head(url, headers={"accept-encoding": "identity"})
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        return Unknown(f"HEAD {url}: {_http_error(exc)}")
    if r.status_code != 200:
        return Unknown(f"HEAD {url} answered {r.status_code} {r.reason_phrase}, not 200")
    length = r.headers.get("content-length", "")
    if not length.isdigit():
        return Unknown(f"HEAD {url} answered without a Content-Length")
    return int(length)


async def manifest_size(
    client: httpx.AsyncClient, url: str, *, max_bytes: int, max_files: int
) -> int | Unknown:
    """A version's size: the total of its manifest's files (a GET of at most `max_bytes`)."""
    try:
        async with client.stream("GET", url, headers={"accept-encoding": "identity"}) as r:
            if r.status_code != 200:
                return Unknown(f"GET {url} answered {r.status_code} {r.reason_phrase}, not 200")
            data = bytearray()
            async for chunk in r.aiter_raw():
                data += chunk
                if len(data) > max_bytes:
                    break
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        return Unknown(f"GET {url}: {_http_error(exc)}")
    checked = core.check_manifest(bytes(data), max_bytes=max_bytes, max_files=max_files)
    if isinstance(checked, core.ManifestError):
        return Unknown(f"{url}: {checked.message}")
    return checked.total_bytes


def _http_error(exc: BaseException) -> str:
    """The first words in the chain of causes (httpx over trio often wraps an empty one)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if str(seen):
            return str(seen) if seen is exc else f"{type(exc).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


# --- the task -----------------------------------------------------------------------------


class SourceSizes:
    """The sizes of the catalog's fetched sources, kept current; `sizes(source)` is
    the size in bytes, None (unknown, or not fetched: a local path, a hub id), or
    `MEASURING` (fetched, and no round has measured it yet)."""

    def __init__(
        self,
        sources: Callable[[], Iterable[str]],
        mirror_dir: Path | None,
        *,
        on_change: Callable[[], None] | None = None,
        refresh_s: float = REFRESH_S,
        deadline_s: float = DEADLINE_S,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
        max_manifest_files: int = MAX_MANIFEST_FILES,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._sources = sources
        self._mirror_dir = mirror_dir
        self._root: str | None = None  # mirror_dir resolved, once
        self.on_change = on_change
        self.refresh_s = refresh_s
        self.deadline_s = deadline_s
        self._max_manifest = (max_manifest_bytes, max_manifest_files)
        self._ssl = ssl_context
        self._sizes: dict[str, int] = {}
        self._measured: frozenset[str] = frozenset()  # what the last round measured
        self._logged: dict[str, set[str]] = {}  # source -> reasons already logged
        self._wake = trio.Event()
        self._refreshes = 0

    def __call__(self, source: str) -> int | Measuring | None:
        if source in self._sizes:
            return self._sizes[source]
        if source not in self._measured and _fetched(source):
            return MEASURING
        return None

    def __repr__(self) -> str:
        return f"<SourceSizes known={len(self._sizes)} refreshes={self._refreshes}>"

    def statistics(self) -> dict[str, int]:
        """`refreshes`: completed rounds; a test that waits for one more knows the
        sizes reflect what it just changed."""
        return {"known": len(self._sizes), "refreshes": self._refreshes}

    def poke(self) -> None:
        """The catalog changed: measure again now."""
        self._wake.set()

    def client(self, ssl_context: ssl.SSLContext | None = None) -> httpx.AsyncClient:
        """The HTTP client `refresh` measures with. Its own timeouts are a little
        longer than `deadline_s`, so the deadline `measure` keeps is the one that ends
        a request that gets no answer, and the reason reads the same every time."""
        return httpx.AsyncClient(
            verify=ssl_context or self._ssl or ssl.create_default_context(),
            timeout=httpx.Timeout(self.deadline_s + 1.0),
            follow_redirects=False,  # as the agent's fetcher
            trust_env=False,  # no proxy from the environment
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # The system's default trust (not certifi's): loaded from disk once, in a thread.
        ctx = self._ssl or await trio.to_thread.run_sync(ssl.create_default_context)
        async with self.client(ctx) as client:
            task_status.started()
            while True:
                self._wake = trio.Event()
                await self.refresh(client)
                with trio.move_on_after(self.refresh_s):
                    await self._wake.wait()

    async def refresh(self, client: httpx.AsyncClient) -> None:
        """Measure every fetched source once; poke `on_change` if a size changed."""
        wanted = sorted({s for s in self._sources() if _fetched(s)})
        results: dict[str, int | Unknown] = {}
        limit = trio.CapacityLimiter(MAX_CONCURRENT)

        async def one(source: str) -> None:
            async with limit:
                try:
                    results[source] = await self.measure(client, source)
                except Exception as exc:  # one odd source must not end the control plane
                    log.debug("measuring %s", source, exc_info=True)
                    results[source] = Unknown(f"could not be measured: {type(exc).__name__}: {exc}")

        async with trio.open_nursery() as nursery:
            for source in wanted:
                nursery.start_soon(one, source)
        before = dict(self._sizes)
        newly = set(results) - self._measured
        self._sizes = {s: v for s, v in results.items() if isinstance(v, int)}
        self._measured = frozenset(results)
        self._logged = {s: r for s, r in self._logged.items() if s in results}
        for source, got in sorted(results.items()):
            if isinstance(got, Unknown):
                seen = self._logged.setdefault(source, set())
                if got.reason not in seen:
                    seen.add(got.reason)
                    log.warning("%s: size unknown (placement will not check disk): %s",
                                source, got.reason)  # fmt: skip
            elif before.get(source) != got:
                log.info("%s: %d bytes", source, got)
        self._refreshes += 1
        # A new size, or a source measured for the first time (even as unknown): the
        # reconciler may now place what waited for it.
        if (self._sizes != before or newly) and self.on_change is not None:
            self.on_change()

    async def measure(self, client: httpx.AsyncClient, source: str) -> int | Unknown:
        """One source's size, within `deadline_s`."""
        kind = core.classify_source(source).kind
        with trio.move_on_after(self.deadline_s):
            if kind in (core.SourceKind.MIRROR_FILE, core.SourceKind.MIRROR_VERSION):
                return await self._from_mirror(source)
            if kind is core.SourceKind.URL_VERSION:
                limit, files = self._max_manifest
                return await manifest_size(client, source, max_bytes=limit, max_files=files)
            return await head_size(client, source)
        return Unknown(f"no answer within {self.deadline_s:g} s (the deadline of a size check)")

    async def _from_mirror(self, source: str) -> int | Unknown:
        if self._mirror_dir is None:
            return Unknown(
                "server.yaml sets no mirror.dir: this control plane serves no mirror: source"
            )
        if self._root is None:
            self._root = await trio.to_thread.run_sync(
                os.path.realpath, os.fspath(self._mirror_dir), abandon_on_cancel=True
            )
        path = source[len("mirror:") :]
        return await trio.to_thread.run_sync(mirror_size, self._root, path, abandon_on_cancel=True)


def _fetched(source: str) -> bool:
    try:
        return core.classify_source(source).fetched
    except ConfigError:
        return False
