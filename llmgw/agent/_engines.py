"""Engines installed on this node from the control plane's declaration, and proven.

One `Installer` per agent. The control plane declares per engine a pinned
version (`model.EngineDecls`, at registration and by `declare_engines`); the
installer converges each one in its own task and says, in the node's words,
where it is: installing "downloading llama-….tar.gz (16 MB, 40 %)", waiting
"waiting for another apt-get to finish", failed "<one line>". Only an engine
installed *and proven* is reported in `found()`; nothing is taken from PATH.

llama-server comes as an archive per variant (`cuda12-<arch>` when an NVIDIA
driver is loaded, else `cpu-<arch>`): fetched with the agent's Fetcher, checked
against the declared sha256, unpacked by `extract_tar` into
`<state>/engines/llama-server/<version>.partial/`, proven (`ldd` made readable,
a missing library installed from the node's package manager, then
`llama-server --version` exiting 0 within a bound) and only then renamed to
`<version>/` with a marker (`.llmgw-installed`). vLLM and SGLang get one
virtualenv per version under `<state>/engines/<name>/<version>/` (created in
place: a venv's scripts name their directory, so it cannot be renamed), filled
by pip from the declared index or the control plane's mirror `/simple/`, and
proven by importing the package, never by running the server; the marker is
written last (`_engine_venv`; the marker and its directory: `_engine_dir`).

An installed marker found at start is proven again before it is reported, and
again every `recheck_s` (an upgrade can remove a library); a failed proof moves
the engine to failed with its words. A failed pass is retried after
`retry_initial_s`, doubling up to `retry_max_s`. Other versions on disk are
left alone and not reported.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from llmgw import model
from llmgw.agent import _extract, _ldd
from llmgw.agent._engine_dir import MARKER as MARKER
from llmgw.agent._engine_dir import InstallError, read_marker, rmtree, write_marker
from llmgw.agent._engine_venv import PIP_ENGINES, VenvInstaller
from llmgw.agent._engine_venv import PipTls as PipTls
from llmgw.agent._engine_venv import pip_failure as pip_failure
from llmgw.agent._fetch import Fetcher, FetchError
from llmgw.agent._sources import MIRROR_PREFIX, ControlPlane, SourceError, mirror_url
from llmgw.core import cache_name
from llmgw.host.packages import PackageError, PackageInstaller

log = logging.getLogger("llmgw.agent.engines")

RECHECK_S = 600.0
RETRY_INITIAL_S = 60.0
RETRY_MAX_S = 600.0
VERSION_TIMEOUT_S = 30.0  # llama-server --version
LDD_TIMEOUT_S = 30.0
MAX_ARCHIVE_BYTES = 8 << 30  # unpacked
MAX_ARCHIVE_MEMBERS = 20_000


@attrs.frozen
class Placement:
    """What only the node knows that decides what it installs."""

    arch: str | None  # platform.machine(): x86_64, aarch64
    nvidia: bool  # an NVIDIA driver is loaded
    family: str | None  # the package family (llmgw.host.packages.family): debian, rhel, suse


def variant(where: Placement) -> str:
    """The archive variant for this node: `cuda12-<arch>` with an NVIDIA driver, else cpu."""
    arch = where.arch or "unknown"
    return f"{'cuda12' if where.nvidia else 'cpu'}-{arch}"


def size_words(done: int, total: int | None) -> str:
    """ "16 MB, 40 %" with a length; "3 MB so far" without one (no percentage then)."""
    if total is None or total <= 0:
        return f"{_mb(done)} so far"
    pct = min(100, done * 100 // total)
    return f"{_mb(total)}, {pct} %"


def _mb(n: int) -> str:
    if n >= 10_000_000:
        return f"{n // 1_000_000} MB"
    if n >= 1_000_000:
        return f"{n / 1_000_000:.1f} MB"
    return f"{max(1, n // 1000) if n else 0} kB"


def _base_name(url: str) -> str:
    path = url[len(MIRROR_PREFIX) :] if url.startswith(MIRROR_PREFIX) else urlsplit(url).path
    return path.rstrip("/").rsplit("/", 1)[-1] or url


def find_binary(root: Path, name: str = "llama-server") -> Path | None:
    """The first regular, executable file called `name` anywhere under `root`."""
    for here, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        if name in files:
            p = Path(here) / name
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                return p
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Installer:
    def __init__(
        self,
        state_dir: Path,
        *,
        fetcher: Fetcher | None,
        placement: Callable[[], Placement],
        control_plane: Callable[[], ControlPlane | None] = lambda: None,
        client_tls: ssl.SSLContext | None = None,
        pip_tls: PipTls | None = None,
        on_change: Callable[[], None] = lambda: None,
        python: str | None = None,
        packages: Callable[[str], Any] | None = None,
        recheck_s: float = RECHECK_S,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
        version_timeout_s: float = VERSION_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = state_dir / "engines"
        self._fetcher = fetcher
        self._placement = placement
        self._control_plane = control_plane
        self._client_tls = client_tls
        self._on_change = on_change
        # family -> a PackageInstaller; a parameter so a test can hand in its own.
        self._packages = packages or (lambda fam: PackageInstaller(fam))
        self.recheck_s = recheck_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.version_timeout_s = version_timeout_s
        self._env = dict(env) if env is not None else None  # the proofs' environment
        self._venv = VenvInstaller(
            self.root,
            state_dir,
            python=python or getattr(sys, "_base_executable", None) or "python3",
            env=self._env,
            control_plane=control_plane,
            pip_tls=pip_tls,
            status=self._status,
            checking=self._checking,
        )
        self._decls: model.EngineDecls | None = None
        self._declared = trio.Event()
        self._found: dict[str, model.Engine] = {}
        self._pending: dict[str, model.EngineStatus] = {}
        self._downloads: dict[str, tuple[str, str, str]] = {}  # cache name -> engine, version, file
        self.passes = 0

    def __repr__(self) -> str:
        fp = self._decls.fingerprint if self._decls is not None else None
        return f"<Installer declared={fp} found={sorted(self._found)} passes={self.passes}>"

    # what the node reports ----------------------------------------------------------

    # Read from worker threads too (the servant's inventory): one C-level copy each.
    def found(self) -> tuple[model.Engine, ...]:
        return tuple(sorted(self._found.values(), key=lambda e: e.name))

    def pending(self) -> tuple[model.EngineStatus, ...]:
        return tuple(sorted(self._pending.values(), key=lambda s: s.name))

    def path_of(self, name: str) -> str | None:
        """What the supervisor runs for engine `name`: installed and proven, else None."""
        engine = self._found.get(name)
        return engine.path if engine is not None else None

    def declare(self, decls: model.EngineDecls | None) -> None:
        """Converge on `decls`; the same fingerprint again changes nothing. None (the
        control plane declares nothing) is an empty declaration: nothing installed is
        reported, nothing is deleted."""
        if decls is None:
            decls = model.EngineDecls(fingerprint="")
        if self._decls is not None and self._decls.fingerprint == decls.fingerprint:
            return
        log.info(
            "engines declared (%s): %s",
            decls.fingerprint,
            ", ".join(f"{d.name} {d.version}" for d in decls.engines) or "none",
        )
        self._decls = decls
        self._declared.set()

    def progress(self, name: str, done: int, total: int | None) -> None:
        """The Fetcher's progress, by cache name: a download of ours becomes its words."""
        got = self._downloads.get(name)
        if got is not None:
            engine, version, file = got
            self._status(
                engine, "installing", f"downloading {file} ({size_words(done, total)})", version
            )

    # state -----------------------------------------------------------------------------

    def _status(self, name: str, state: str, detail: str, version: str | None) -> None:
        status = model.EngineStatus(name=name, state=state, detail=detail, version=version)
        changed = self._pending.get(name) != status or name in self._found
        self._pending[name] = status
        self._found.pop(name, None)
        if changed:
            if state == "failed":
                log.warning("engine %s %s: failed: %s", name, version, detail)
            else:
                log.info("engine %s %s: %s: %s", name, version, state, detail)
            self._on_change()

    def _checking(self, name: str, detail: str, version: str | None) -> None:
        """A step of a proof: said while installing, but an installed engine being
        proven again stays installed (and placeable) until the proof fails."""
        if name not in self._found:
            self._status(name, "installing", detail, version)

    def _installed(self, engine: model.Engine) -> None:
        changed = self._found.get(engine.name) != engine or engine.name in self._pending
        self._found[engine.name] = engine
        self._pending.pop(engine.name, None)
        if changed:
            log.info("engine %s %s: installed at %s", engine.name, engine.version, engine.path)
            self._on_change()

    def _forget(self, names: set[str]) -> None:
        gone = [n for n in (*self._found, *self._pending) if n not in names]
        for n in gone:
            self._found.pop(n, None)
            self._pending.pop(n, None)
        if gone:
            self._on_change()

    # the loop -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._declared.wait()
            self._declared = trio.Event()
            decls = self._decls
            assert decls is not None
            self._forget({d.name for d in decls.engines})
            async with trio.open_nursery() as nursery:
                for decl in decls.engines:
                    nursery.start_soon(self._keep, decl)
                await self._declared.wait()  # a new declaration: start over
                nursery.cancel_scope.cancel()

    async def _keep(self, decl: model.EngineDecl) -> None:
        delay = self.retry_initial_s
        while True:
            self.passes += 1
            try:
                engine = await self.converge(decl)
            except Exception as exc:  # one engine's pass must never stop the agent
                if not isinstance(exc, InstallError):
                    log.exception("engine %s %s: the pass broke", decl.name, decl.version)
                words = (
                    str(exc) if isinstance(exc, InstallError) else f"{type(exc).__name__}: {exc}"
                )
                self._status(
                    decl.name, "failed", words.splitlines()[0] if words else "?", decl.version
                )
                await trio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            self._installed(engine)
            delay = self.retry_initial_s
            await trio.sleep(self.recheck_s)

    async def converge(self, decl: model.EngineDecl) -> model.Engine:
        """One pass: the engine installed and proven at the declared version, or InstallError."""
        if decl.name == "llama-server":
            return await self._archive(decl)
        if decl.name in PIP_ENGINES:
            return await self._venv.install(decl)
        raise InstallError(f"unknown engine {decl.name!r}; known: llama-server, vllm, sglang")

    # llama-server: archives ---------------------------------------------------------------

    async def _archive(self, decl: model.EngineDecl) -> model.Engine:
        where = self._placement()
        want = variant(where)
        archive = next((a for a in decl.archives if a.variant == want), None)
        if archive is None:
            have = ", ".join(a.variant for a in decl.archives) or "none"
            raise InstallError(f"no llama-server archive declared for {want} (declared: {have})")
        final = self.root / decl.name / decl.version
        marker = await trio.to_thread.run_sync(read_marker, final)
        if (
            marker is not None
            and marker.get("version") == decl.version
            and marker.get("sha256") == archive.sha256.lower()
            and isinstance(marker.get("binary"), str)
        ):
            binary = final / marker["binary"]
            await self._prove_binary(decl, binary, where)
            return model.Engine(decl.name, str(binary), decl.version, "installed")

        path = await self._download(decl, archive)
        self._status(decl.name, "installing", f"checking {path.name}", decl.version)
        got = await trio.to_thread.run_sync(_sha256, path)
        if got != archive.sha256.lower():
            # The Fetcher's entry for it, whole (file and marker): a retry fetches again.
            entry = path.parent if path.parent.name == cache_name(archive.url) else path
            await trio.to_thread.run_sync(rmtree, entry)
            raise InstallError(
                f"{_base_name(archive.url)}: sha256 {got} is not the declared {archive.sha256}"
            )
        partial = final.with_name(final.name + ".partial")
        self._status(decl.name, "installing", f"unpacking {_base_name(archive.url)}", decl.version)
        try:
            try:
                await trio.to_thread.run_sync(self._unpack, path, partial)
            except _extract.ExtractError as exc:
                raise InstallError(f"{_base_name(archive.url)}: {exc}") from None
            binary = await trio.to_thread.run_sync(find_binary, partial)
            if binary is None:
                raise InstallError(
                    f"{_base_name(archive.url)}: no executable file named llama-server "
                    "in the archive"
                )
            rel = binary.relative_to(partial)
            await self._prove_binary(decl, binary, where)
        except BaseException:
            # A version refused (or a pass cancelled) leaves no half-made directory behind.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(rmtree, partial)
            raise

        def finish() -> None:
            rmtree(final)  # an unmarked leftover of an earlier pass
            partial.rename(final)
            data = {"version": decl.version, "variant": want, "sha256": got, "binary": str(rel)}
            write_marker(final, data)

        await trio.to_thread.run_sync(finish)
        return model.Engine(decl.name, str(final / rel), decl.version, "installed")

    def _unpack(self, archive: Path, dest: Path) -> None:
        rmtree(dest)
        dest.mkdir(parents=True)
        _extract.extract_tar(
            archive, dest, max_bytes=MAX_ARCHIVE_BYTES, max_members=MAX_ARCHIVE_MEMBERS
        )

    async def _download(self, decl: model.EngineDecl, archive: model.EngineArchive) -> Path:
        if self._fetcher is None:
            raise InstallError(f"{archive.url}: this agent fetches nothing (no weights_dir)")
        context: ssl.SSLContext | None = None
        url = archive.url
        if url.startswith(MIRROR_PREFIX):
            try:
                url, context = mirror_url(self._control_plane(), archive.url, self._client_tls)
            except SourceError as exc:
                raise InstallError(str(exc)) from None
        file = _base_name(archive.url)
        name = cache_name(archive.url)
        self._downloads[name] = (decl.name, decl.version, file)
        self._status(decl.name, "installing", f"downloading {file}", decl.version)
        try:
            return await self._fetcher.fetch(url, "file", source=archive.url, ssl_context=context)
        except FetchError as exc:
            raise InstallError(str(exc)) from None
        finally:
            self._downloads.pop(name, None)

    async def _prove_binary(self, decl: model.EngineDecl, binary: Path, where: Placement) -> None:
        """ldd made readable, a missing library installed once, then `--version`."""
        self._checking(decl.name, "checking libraries", decl.version)
        problems = await _ldd.check(binary, family=where.family, timeout_s=LDD_TIMEOUT_S)
        if problems:
            fam = where.family
            packages = [p.packages.get(fam) for p in problems] if fam is not None else []
            if fam is None or not all(packages):
                raise InstallError(f"{binary.name}: " + "; ".join(p.message for p in problems))
            unique = list(dict.fromkeys(p for p in packages if p))
            self._status(decl.name, "installing", f"installing {' '.join(unique)}", decl.version)

            def on_wait(detail: str) -> None:
                self._status(decl.name, "waiting", detail, decl.version)

            try:
                await self._packages(fam).install(unique, on_wait=on_wait)
            except PackageError as exc:
                raise InstallError(str(exc)) from None
            self._status(decl.name, "installing", "checking libraries", decl.version)
            problems = await _ldd.check(binary, family=fam, timeout_s=LDD_TIMEOUT_S)
            if problems:
                raise InstallError(f"{binary.name}: " + "; ".join(p.message for p in problems))
        try:
            await _ldd.prove_version(binary, timeout_s=self.version_timeout_s, env=self._env)
        except _ldd.ProofError as exc:
            raise InstallError(str(exc)) from None
