"""Unpack an engine archive into its install directory, and nowhere else.

`extract_tar(archive, dest)` reads a .tar, .tar.gz, .tar.xz or .tar.bz2 (one
pass, tarfile's streaming mode) and writes its members under `dest`, which may
already exist (a second archive into the same directory is allowed). It is
blocking: the installer runs it in a thread (`trio.to_thread.run_sync`). It
returns the bytes written (regular files' contents).

`dest`'s parents are made as needed (and left); `dest` itself is removed
on failure only when this call made it. Every write stays inside `dest`.
Each member is checked before anything of it is written, and refused
(`ExtractError`, one line naming the archive, the member and why) when it
is, or would need:

- an absolute path or a `..` component;
- a path through a symlink, whether the archive made it or it was already in
  `dest`: every component is opened with O_NOFOLLOW|O_DIRECTORY from the
  directory fd above it, so no link is ever followed;
- a symlink whose target leaves `dest`. A relative target may only climb
  (`../` first) as far as the link's own directory is deep and then descend
  (no `..` after a name, which a symlink met on the way could turn into an
  escape); an absolute target must name a path under `dest` (it then breaks
  if the directory is moved: llama.cpp's archives use relative ones);
- a hardlink whose target is not a regular file this call extracted;
- a device node, a FIFO, or any other kind that is not a file, directory,
  symlink or hardlink;
- a setuid, setgid or sticky bit (refused, not stripped: an engine archive
  has no reason to carry one);
- an entry that already exists (files are created with O_EXCL|O_NOFOLLOW;
  an existing real directory is entered, never changed);
- more than `max_members` members, or more than `max_bytes` of contents in
  all (refused at the member whose declared size crosses the bound, before
  its first byte is written; what is read is counted too).

Modes are not taken from the archive: directories are 0o755, files 0o755 when
the archive gives them any executable bit and 0o644 otherwise; no owner is
set. On any refusal or error, everything this call created is removed (files,
links, directories, and `dest` itself if this call made it), and nothing it
did not create is touched.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import lzma
import os
import stat
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import attrs

from llmgw.errors import LlmgwError

log = logging.getLogger("llmgw.agent.extract")

_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ExtractError(LlmgwError):
    """An archive was refused or could not be unpacked; one line naming the member and why."""


class _Refused(Exception):
    """A member is refused: `why` in words; turned into ExtractError with the archive's name."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@attrs.define
class _Created:
    """What this call made, in order, so a failure removes exactly that."""

    # (components relative to dest, is_dir)
    entries: list[tuple[tuple[str, ...], bool]] = attrs.Factory(list)
    files: set[tuple[str, ...]] = attrs.Factory(set)


def _components(name: str) -> tuple[str, ...]:
    """A member's path as components under dest; raises _Refused for `/…` or `..`."""
    if name.startswith("/"):
        raise _Refused("is an absolute path")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise _Refused("has a '..' component")
    return parts


def _link_stays_inside(where: tuple[str, ...], target: str, dest_abs: tuple[str, ...]) -> bool:
    """Whether a symlink at dest/`where` with `target` can only resolve inside dest.

    Pure and lexical, made safe by refusing `..` after a name: the link's own
    directory is a real directory (members are never written through links),
    so climbing from it is exact, and descending from inside stays inside even
    when a component met later is itself a link (each was checked the same way).
    """
    if not target:
        return False
    if target.startswith("/"):
        parts = [p for p in target.split("/") if p not in ("", ".")]
        return ".." not in parts and tuple(parts[: len(dest_abs)]) == dest_abs
    parts = [p for p in target.split("/") if p not in ("", ".")]
    climbs = 0
    while climbs < len(parts) and parts[climbs] == "..":
        climbs += 1
    if ".." in parts[climbs:]:
        return False
    return climbs <= len(where) - 1


def _mode(member: tarfile.TarInfo) -> int:
    return 0o755 if member.mode & 0o111 else 0o644


class _Dest:
    """dest opened once; components walked with O_NOFOLLOW from directory fds."""

    def __init__(self, dest: Path, created: _Created) -> None:
        self.created = created
        self.made_dest = False
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(dest, 0o755)
            self.made_dest = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise ExtractError(
                f"{dest}: cannot make the install directory: {exc.strerror or exc}"
            ) from None
        try:
            self.fd = os.open(dest, _DIR_FLAGS)
        except OSError as exc:
            if self.made_dest:
                os.rmdir(dest)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ExtractError(
                    f"{dest}: the install directory is not a directory (a symlink or a file)"
                ) from None
            raise ExtractError(
                f"{dest}: cannot open the install directory: {exc.strerror}"
            ) from None
        if self.made_dest:
            os.fchmod(self.fd, 0o755)
        self.path = dest

    def close(self) -> None:
        os.close(self.fd)

    def _open_dir(self, parent_fd: int, name: str, shown: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                except OSError:
                    raise _Refused(f"goes through {shown!r}, which is not a directory") from None
                if stat.S_ISLNK(st.st_mode):
                    raise _Refused(f"goes through the symlink {shown!r}") from None
                raise _Refused(f"goes through {shown!r}, which is not a directory") from None
            raise

    def parent(self, parts: tuple[str, ...], *, create: bool) -> int:
        """An fd of dest/parts[:-1] (the caller closes it); made as needed when `create`."""
        fd = os.dup(self.fd)
        try:
            for i, name in enumerate(parts[:-1]):
                shown = "/".join(parts[: i + 1])
                try:
                    nxt = self._open_dir(fd, name, shown)
                except FileNotFoundError:
                    if not create:
                        raise _Refused(
                            f"needs {shown!r}, which this archive did not make"
                        ) from None
                    os.mkdir(name, 0o755, dir_fd=fd)
                    self.created.entries.append((parts[: i + 1], True))
                    nxt = self._open_dir(fd, name, shown)
                    os.fchmod(nxt, 0o755)
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def remove_created(self) -> None:
        """Remove what this call made, newest first; never follows a link, never raises."""
        for parts, is_dir in reversed(self.created.entries):
            try:
                fd = self.parent(parts, create=False)
            except (OSError, _Refused) as exc:
                log.warning(
                    "%s: could not reach %s to remove it: %s", self.path, "/".join(parts), exc
                )
                continue
            try:
                if is_dir:
                    os.rmdir(parts[-1], dir_fd=fd)
                else:
                    os.unlink(parts[-1], dir_fd=fd)
            except OSError as exc:
                log.warning("%s: could not remove %s: %s", self.path, "/".join(parts), exc)
            finally:
                os.close(fd)
        self.created.entries.clear()


def _members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while True:
        with _reading():
            member = tf.next()
        if member is None:
            return
        yield member


class _Unreadable(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """Errors of the archive's own bytes (a bad header, a truncated or corrupt stream)."""
    try:
        yield
    except _Refused:
        raise
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
        raise _Unreadable(str(exc) or type(exc).__name__) from None
    except OSError as exc:
        if exc.errno is None:  # gzip's and bz2's "invalid data stream" carry no errno
            raise _Unreadable(str(exc)) from None
        raise


def extract_tar(
    archive: Path, dest: Path, *, max_bytes: int = 8 << 30, max_members: int = 50_000
) -> int:
    """Unpack `archive` under `dest`; the bytes written. Refuses what would leave dest."""
    created = _Created()
    target = _Dest(dest, created)
    dest_abs = tuple(p for p in os.path.abspath(dest).split("/") if p)
    dest_real = tuple(p for p in os.path.realpath(dest).split("/") if p)
    written = 0
    count = 0
    name = "(before the first member)"
    ok = False
    try:
        try:
            with _reading(), tarfile.open(archive, mode="r|*") as tf:
                for member in _members(tf):
                    count += 1
                    name = member.name
                    if count > max_members:
                        raise _Refused(
                            f"is member {count}: the archive has more than {max_members} members"
                        )
                    written += _one(tf, member, target, dest_abs, dest_real, max_bytes - written)
        except _Refused as exc:
            raise ExtractError(
                f"{archive.name}: member {name!r} {exc.why}; nothing was installed"
            ) from None
        except _Unreadable as exc:
            raise ExtractError(
                f"{archive.name}: not a readable tar archive ({exc.why}) at member {name!r}"
            ) from None
        except OSError as exc:
            what = exc.strerror or str(exc)
            raise ExtractError(
                f"{archive.name}: member {name!r} could not be written to {dest}: {what}"
            ) from None
        ok = True
        return written
    finally:
        try:
            if not ok:
                target.remove_created()
        finally:
            target.close()
            if not ok and target.made_dest:
                try:
                    os.rmdir(dest)
                except OSError as exc:
                    log.warning("%s: could not remove the install directory: %s", dest, exc)


def _one(
    tf: tarfile.TarFile,
    member: tarfile.TarInfo,
    target: _Dest,
    dest_abs: tuple[str, ...],
    dest_real: tuple[str, ...],
    budget: int,
) -> int:
    """Write one member (after every check); the bytes it wrote."""
    if member.ischr() or member.isblk():
        raise _Refused("is a device node")
    if member.isfifo():
        raise _Refused("is a FIFO")
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise _Refused(f"is of a kind that is not installed (tar type {member.type!r})")
    if member.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
        bits = [
            n
            for b, n in (
                (stat.S_ISUID, "setuid"),
                (stat.S_ISGID, "setgid"),
                (stat.S_ISVTX, "sticky"),
            )
            if member.mode & b
        ]
        raise _Refused(f"has the {'/'.join(bits)} bit (mode {member.mode:o})")
    parts = _components(member.name)
    if not parts:
        if member.isdir():
            return 0  # "./": dest itself
        raise _Refused("names the install directory itself")
    if member.issym() and not (
        _link_stays_inside(parts, member.linkname, dest_abs)
        or _link_stays_inside(parts, member.linkname, dest_real)
    ):
        raise _Refused(f"is a symlink to {member.linkname!r}, which leaves the install directory")
    link_parts: tuple[str, ...] = ()
    if member.islnk():
        try:
            link_parts = _components(member.linkname)
        except _Refused as exc:
            raise _Refused(f"is a hardlink to {member.linkname!r}, which {exc.why}") from None
        if link_parts not in target.created.files:
            raise _Refused(
                f"is a hardlink to {member.linkname!r}, which is not a file this archive extracted"
            )
    if member.isreg() and member.size > budget:
        raise _Refused(
            f"is {member.size} bytes, past the bound on the archive's contents "
            f"({budget} bytes were left)"
        )

    parent = target.parent(parts, create=True)
    leaf = parts[-1]
    try:
        if member.isdir():
            try:
                os.mkdir(leaf, 0o755, dir_fd=parent)
            except FileExistsError:
                # An existing real directory is entered as it is; a link or a file there is refused.
                os.close(target._open_dir(parent, leaf, "/".join(parts)))
                return 0
            target.created.entries.append((parts, True))
            fd = target._open_dir(parent, leaf, "/".join(parts))
            os.fchmod(fd, 0o755)
            os.close(fd)
            return 0
        if member.issym():
            try:
                os.symlink(member.linkname, leaf, dir_fd=parent)
            except FileExistsError:
                raise _Refused("already exists in the install directory") from None
            target.created.entries.append((parts, False))
            return 0
        if member.islnk():
            src_parent = target.parent(link_parts, create=False)
            try:
                os.link(
                    link_parts[-1],
                    leaf,
                    src_dir_fd=src_parent,
                    dst_dir_fd=parent,
                    follow_symlinks=False,
                )
            except FileExistsError:
                raise _Refused("already exists in the install directory") from None
            finally:
                os.close(src_parent)
            target.created.entries.append((parts, False))
            return 0
        # A regular file.
        try:
            fd = os.open(leaf, _FILE_FLAGS, 0o600, dir_fd=parent)
        except FileExistsError:
            raise _Refused("already exists in the install directory") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Refused("already exists in the install directory (as a symlink)") from None
            raise
        target.created.entries.append((parts, False))
        n = 0
        try:
            with _reading():
                src = tf.extractfile(member)
            if src is None:
                raise _Refused("has no contents to read")
            while chunk := _read(src, min(_CHUNK, member.size - n + 1)):
                n += len(chunk)
                if n > member.size or n > budget:
                    raise _Refused(f"holds more than its declared {member.size} bytes")
                _write_all(fd, chunk)
            if n != member.size:
                raise _Refused(f"ended after {n} of its {member.size} bytes")
            os.fchmod(fd, _mode(member))
        finally:
            os.close(fd)
        target.created.files.add(parts)
        return n
    finally:
        os.close(parent)


def _read(src: IO[bytes], n: int) -> bytes:
    with _reading():
        return src.read(n)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        done = os.write(fd, view)
        view = view[done:]
