"""The weights a node holds: the configured directories and the agent's weights
directory walked, fetched cache entries counted only when complete (the rest listed as
unfinished), and a fingerprint so the agent sends the list only when it changes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from llmgw.core import MARKER, is_cache_name
from llmgw.model import WeightFile, Weights

logger = logging.getLogger("llmgw.agent.discovery")

# Suffixes of files still being written: by llmgw's fetcher (.partial) and by
# huggingface_hub (.incomplete).
PARTIAL_SUFFIXES: tuple[str, ...] = (".partial", ".incomplete")


def _is_partial(name: str) -> bool:
    return name.endswith(PARTIAL_SUFFIXES)


def scan_weights(dirs: Iterable[str | Path], *, weights_dir: str | Path | None = None) -> Weights:
    """The model files under the configured directories, and a fingerprint of them.

    A file still being written (`*.partial`, `*.incomplete`, or anything under
    a directory so named) is not a model; an empty directory holds no file,
    so it is no model either. Symbolic links to files (the Hugging Face cache
    layout) count with their target's size; linked directories are not
    followed, so a loop cannot trap the scan. The fingerprint is a hash of
    sorted (path, size) pairs: it changes when a model arrives or goes, and the
    agent sends the list only then.

    `weights_dir` (the agent's, where fetched sources live) is scanned from its
    real path: a top-level entry with a cache name counts only once its
    completion marker is valid (see `complete_entry`), and then only the files
    the marker names, never the marker, a partial or an ETag beside one; any
    other entry (an operator's own) is scanned like a model directory.
    `Weights.dir` is that real path. A cache entry not complete is listed in
    `Weights.unfinished` with the bytes in it; the fingerprint counts its path,
    not its size, so a download that grows sends no new list.
    """
    files: dict[str, int] = {}
    for d in dirs:
        _walk_into(files, str(d))
    real: str | None = None
    unfinished: dict[str, int] | None = None
    if weights_dir is not None:
        real = os.path.realpath(weights_dir)
        unfinished = {}
        _scan_weights_dir(files, real, unfinished)
    digest = hashlib.sha256()
    for path, size in sorted(files.items()):
        digest.update(f"{path}\0{size}\n".encode(errors="surrogateescape"))
    if real is not None:
        digest.update(f"dir\0{real}\n".encode(errors="surrogateescape"))
    for path in sorted(unfinished or ()):
        digest.update(f"unfinished\0{path}\n".encode(errors="surrogateescape"))
    return Weights(
        fingerprint=digest.hexdigest(),
        files=tuple(WeightFile(p, s) for p, s in sorted(files.items())),
        dir=real,
        unfinished=(
            None
            if unfinished is None
            else tuple(WeightFile(p, s) for p, s in sorted(unfinished.items()))
        ),
    )


def _walk_into(files: dict[str, int], top: str) -> None:
    if not os.path.isdir(top):
        return
    for dirpath, dirnames, filenames in os.walk(top, onerror=_walk_error):
        dirnames[:] = [n for n in dirnames if not _is_partial(n)]
        for name in filenames:
            if not _is_partial(name):
                _add_file(files, os.path.join(dirpath, name))


def _add_file(files: dict[str, int], path: str) -> None:
    try:
        st = os.stat(path)  # follows a link: the target's size
    except OSError:
        return  # a dangling link, or removed while we looked
    if os.path.isfile(path):
        files[path] = st.st_size


def _scan_weights_dir(files: dict[str, int], real: str, unfinished: dict[str, int]) -> None:
    try:
        names = sorted(os.listdir(real))
    except FileNotFoundError:
        return
    except OSError as e:
        _walk_error(e)
        return
    for name in names:
        path = os.path.join(real, name)
        if is_cache_name(name):
            if os.path.islink(path):
                continue  # a cache entry is a directory the fetcher made, never a link
            entry = complete_entry(Path(path))
            if entry is None:
                if os.path.isdir(path):
                    unfinished[path] = _bytes_in(path)
                continue
            for file_name, size in entry:
                files[os.path.join(path, file_name)] = size
        elif os.path.isdir(path):
            if not _is_partial(name):
                _walk_into(files, path)
        elif not _is_partial(name):
            _add_file(files, path)


def _bytes_in(directory: str) -> int:
    """The bytes of the regular files directly in a cache entry (the fetcher nests none)."""
    total = 0
    try:
        with os.scandir(directory) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass  # gone or unreadable while we looked: what was counted
    return total


def complete_entry(directory: Path) -> list[tuple[str, int]] | None:
    """The (name, size) of each file of a complete cache entry, in the marker's order:
    its marker is there and every file it names is there at its size; else None."""
    try:
        doc = json.loads((directory / MARKER).read_bytes())
        files = [(str(f["name"]), int(f["size"])) for f in doc["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not files:
        return None
    for name, size in files:
        if not name or "/" in name or name in (".", ".."):
            return None  # the fetcher never writes such a name
        try:
            if (directory / name).stat().st_size != size:
                return None
        except OSError:
            return None
    return files


def _walk_error(e: OSError) -> None:
    logger.warning("weights: cannot read %s: %s", e.filename, e.strerror or e)
