"""Reclaim on the node: delete what the control plane asks, only where `may_delete` allows.

The control plane plans from what the node reported; the agent decides again
from the disk as it is now, with the same pure function
(`llmgw.core.may_delete`), and refuses what fails. Blocking: the servant runs
`reclaim` in a worker thread.

- The weights directory is described with `lstat` only: a link is described
  (its target as written), never followed, so a link cannot lead the walk, or
  a delete, outside. Past `MAX_ENTRIES` entries the description is refused as
  a whole and so is every path: deciding from part of the tree is not safe.
- Wanted: the cache names of the sources of every shard the agent holds that
  is not stopped, and every fetch in flight.
- A directory is deleted with `shutil.rmtree`, whose fd-based walk (Linux)
  never follows a link, even one swapped in while it runs; a file with
  `os.unlink`, which removes a link itself, never its target.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Iterable

from llmgw import model
from llmgw.core import Tree, TreeDir, TreeFile, TreeLink, may_delete, wanted_cache_names

log = logging.getLogger("llmgw.agent.reclaim")

# An rmtree that follows a link swapped in mid-walk could delete outside the directory
# (not an assert: `python -O` would drop it).
if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - Linux has the fd-based walk
    raise ImportError("reclaim needs the fd-based shutil.rmtree, which this platform lacks")

MAX_ENTRIES = 200_000
TOO_MANY = "too many entries to check"
DELETE_FAILED = "delete failed"


class _TooMany(Exception):
    pass


def describe(real_dir: str, max_entries: int = MAX_ENTRIES) -> Tree:
    """What is under `real_dir` (already resolved), links described, never followed.

    Raises _TooMany past `max_entries`. An absent directory holds nothing."""
    entries: dict[str, TreeFile | TreeDir | TreeLink] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            it = os.scandir(os.path.join(real_dir, rel) if rel else real_dir)
        except (FileNotFoundError, NotADirectoryError):
            continue  # gone while we looked: nothing there to allow
        with it:
            for entry in it:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if len(entries) >= max_entries:
                    raise _TooMany()
                try:
                    st = entry.stat(follow_symlinks=False)
                    target = os.readlink(entry.path) if stat.S_ISLNK(st.st_mode) else ""
                except FileNotFoundError:
                    continue  # removed while we looked
                if stat.S_ISLNK(st.st_mode):
                    entries[key] = TreeLink(target)
                elif stat.S_ISDIR(st.st_mode):
                    entries[key] = TreeDir()
                    pending.append(key)
                else:
                    entries[key] = TreeFile(st.st_size)
    return Tree(entries)


def _size(tree: Tree, rel: str) -> int:
    entry = tree.entries.get(rel)
    if isinstance(entry, TreeFile):
        return entry.size_bytes
    prefix = rel + "/"
    return sum(
        e.size_bytes
        for k, e in tree.entries.items()
        if isinstance(e, TreeFile) and k.startswith(prefix)
    )


def reclaim(
    weights_dir: str | os.PathLike[str],
    paths: Iterable[str],
    *,
    sources: Iterable[str],
    in_flight: frozenset[str] = frozenset(),
    dry_run: bool = False,
    max_entries: int = MAX_ENTRIES,
) -> model.Reclaimed:
    """Delete each of `paths` that may be deleted (none in a dry run); refuse the rest."""
    paths = list(paths)
    real = os.path.realpath(weights_dir)
    try:
        tree = describe(real, max_entries)
    except _TooMany:
        detail = (
            f"{real} holds more than {max_entries} entries; reclaim decides from the whole "
            "tree or not at all: remove some by hand"
        )
        log.warning("reclaim refused: %s", detail)
        return model.Reclaimed(
            refused=tuple(model.Refusal(p, TOO_MANY, f"{p}: {detail}") for p in paths)
        )
    wanted = wanted_cache_names(sources, weights_dir=real) | in_flight
    removed: list[str] = []
    refused: list[model.Refusal] = []
    freed = 0
    done: set[str] = set()
    base = real.rstrip("/")
    depth = len([p for p in real.split("/") if p])
    for path in paths:
        verdict = may_delete(path, weights_dir=real, wanted=wanted, tree=tree)
        if not verdict:
            assert verdict.reason is not None and verdict.detail is not None
            refused.append(model.Refusal(path, verdict.reason, verdict.detail))
            log.warning("reclaim refused %s", verdict.detail)
            continue
        rel = "/".join([p for p in path.split("/") if p not in ("", ".")][depth:])
        if rel in done or any(rel.startswith(d + "/") for d in done):
            continue  # asked twice, or inside what was just removed
        size = _size(tree, rel)
        target = f"{base}/{rel}"
        if not dry_run:
            try:
                if isinstance(tree.entries[rel], TreeDir):
                    shutil.rmtree(target)
                else:
                    os.unlink(target)
            except FileNotFoundError:
                continue  # gone already: nothing freed by us
            except OSError as exc:
                detail = f"{path}: {DELETE_FAILED}: {exc.strerror or exc}"
                refused.append(model.Refusal(path, DELETE_FAILED, detail))
                log.warning("reclaim: %s", detail)
                continue
            log.info("reclaim removed %s (%d bytes)", target, size)
        done.add(rel)
        removed.append(path)
        freed += size
    return model.Reclaimed(removed=tuple(removed), freed_bytes=freed, refused=tuple(refused))
