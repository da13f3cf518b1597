"""What each node holds of the catalog's weights, what could be reclaimed, and per fabric.

Pure: the admin API (`GET /api/v1/weights`, the status answer) feeds it the nodes'
reported inventories and the catalog's (model, source) pairs. Everything here is
read from what the agents reported: an agent reports only complete cache entries
(a `.partial` or an unmarked version never appears), so a cache entry listed here is
whole. Whether a path may really be deleted is the agent's decision, made again on
its own disk with `llmgw.core.may_delete`; the list here is what to ask for.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence

import attrs

from llmgw import core, model
from llmgw.errors import ConfigError


@attrs.frozen
class Held:
    """One entry a node holds: a cache entry, or a file or directory an operator put there."""

    path: str  # absolute, as the node reported it
    kind: str  # "cache" (a fetched source), "dir" or "file" (an operator's)
    size_bytes: int
    files: int
    wanted_by: tuple[str, ...]  # catalog models, by name

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)


@attrs.frozen
class NodeWeights:
    node_id: str
    weights_dir: str | None  # None: the node reports none (an old agent, or no inventory)
    reported: bool  # False: the node has sent no list of its weights
    held: tuple[Held, ...] = ()
    reclaimable: tuple[core.Reclaimable, ...] = ()  # cache entries no catalog model wants
    # Cache entries not complete (a download under way, or given up); None: not reported.
    unfinished: tuple[Held, ...] | None = None


def _normal(path: str) -> str | None:
    """An absolute path in normal form, or None for what is not one."""
    if not path.startswith("/"):
        return None
    out = posixpath.normpath(path)
    return "/" + out.lstrip("/")  # normpath keeps a leading "//"


def _local(source: str) -> str | None:
    """A local catalog source as a normal absolute path; None for any other kind."""
    try:
        kind = core.classify_source(source).kind
    except ConfigError:
        return None
    return _normal(source) if kind is core.SourceKind.LOCAL else None


def _fetched_name(source: str) -> str | None:
    try:
        return core.classify_source(source).cache_name
    except ConfigError:
        return None


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _with_parents(paths: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for p in paths:
        while p not in out and p not in ("", "/"):
            out.add(p)
            p = posixpath.dirname(p)
    return out


def weights_dir(weights: model.Weights | None) -> str | None:
    """The node's weights directory, when it reports one that is absolute and normal."""
    if weights is None or weights.dir is None:
        return None
    normal = _normal(weights.dir)
    return normal if normal == weights.dir.rstrip("/") or normal == weights.dir else None


def node_weights(
    node_id: str, weights: model.Weights | None, models: Sequence[tuple[str, str]]
) -> NodeWeights:
    """What `weights` (a node's report) holds, and who wants it. `models`: (name, source).

    Under the weights directory, each top-level entry is one: a cache name is a fetched
    source (wanted by the models whose source has that cache name, or whose local path
    points into it); anything else there is an operator's. Outside it, a file the
    catalog names by a local path (the file, or a directory above it) is grouped under
    that path; any other file is its own entry. An operator's entry is wanted by the
    models whose local path is one of its files or a directory of them, as placement
    matches local paths.
    """
    if weights is None:
        return NodeWeights(node_id, None, False)
    base = weights_dir(weights)
    local = sorted({(p, name) for name, src in models if (p := _local(src)) is not None})
    fetched: dict[str, list[str]] = {}
    for name, src in models:
        cache = _fetched_name(src)
        if cache is not None:
            fetched.setdefault(cache, []).append(name)
    groups: dict[str, tuple[str, list[model.WeightFile]]] = {}  # entry path -> kind, files
    for f in weights.files:
        path = _normal(f.path)
        if path is None:
            continue
        if base is not None and path.startswith(base.rstrip("/") + "/"):
            top = path[len(base.rstrip("/")) + 1 :].split("/", 1)[0]
            entry = base.rstrip("/") + "/" + top
            kind = "cache" if core.is_cache_name(top) else ("file" if entry == path else "dir")
        else:
            covering = [p for p, _n in local if _under(path, p)]
            entry = min(covering, key=len) if covering else path
            kind = "file" if entry == path else "dir"
        groups.setdefault(entry, (kind, []))[1].append(f)
    held = []
    for entry, (kind, files) in sorted(groups.items()):
        paths = _with_parents(_normal(f.path) or "" for f in files)
        wanted = {n for p, n in local if p in paths}
        if kind == "cache":
            wanted.update(fetched.get(posixpath.basename(entry), ()))
        held.append(
            Held(entry, kind, sum(f.size_bytes for f in files), len(files), tuple(sorted(wanted)))
        )
    unfinished: tuple[Held, ...] | None = None
    if weights.unfinished is not None:
        unfinished = tuple(
            Held(
                path,
                "cache",
                f.size_bytes,
                0,
                tuple(sorted(fetched.get(posixpath.basename(path), ()))),
            )
            for f in weights.unfinished
            if (path := _normal(f.path)) is not None
        )
    reclaimable: tuple[core.Reclaimable, ...] = ()
    if base is not None:
        keep = core.wanted_cache_names([src for _n, src in models], weights_dir=base)
        # An unfinished entry goes too when no catalog model wants it; the agent
        # decides again and keeps one it is fetching now.
        reclaimable = tuple(
            core.Reclaimable(h.path, h.size_bytes)
            for h in (*held, *(unfinished or ()))
            if h.kind == "cache" and h.name not in keep
        )
    return NodeWeights(node_id, base, True, tuple(held), reclaimable, unfinished)


WANTED = "still wanted by the catalog"  # as llmgw.core's reclaim reason reads


def catalog_wants(path: str, base: str | None, models: Sequence[tuple[str, str]]) -> list[str]:
    """The catalog models that want the cache entry `path` lies in (under the weights
    directory `base`): reclaim must not be asked for it, whatever an operator names. The
    agent cannot tell: it knows only what its own shards and fetches use."""
    normal = _normal(path)
    if base is None or normal is None or not normal.startswith(base.rstrip("/") + "/"):
        return []
    top = normal[len(base.rstrip("/")) + 1 :].split("/", 1)[0]
    entry = base.rstrip("/") + "/" + top
    out = []
    for name, source in models:
        local = _local(source)
        if _fetched_name(source) == top or (local is not None and _under(local, entry)):
            out.append(name)
    return sorted(set(out))


Holds = dict[str, dict[tuple[str, str], int]]  # model -> (who counts it, path) -> size


def node_holds(node_id: str, inv: model.Inventory, models: Sequence[tuple[str, str]]) -> Holds:
    """Per catalog model, the files of its weights on this node, each keyed by who counts
    it: the node, or (for a file on a shared filesystem) the mount, so that a file several
    nodes see on one filer counts once. One pass over the node's files."""
    if inv.weights is None:
        return {}
    base = weights_dir(inv.weights)
    local = {name: p for name, src in models if (p := _local(src)) is not None}
    by_top: dict[str, list[model.WeightFile]] = {}
    by_dir: dict[str, list[model.WeightFile]] = {}  # a path and each directory above it
    for f in inv.weights.files:
        path = _normal(f.path)
        if path is None:
            continue
        if base is not None and path.startswith(base.rstrip("/") + "/"):
            by_top.setdefault(path[len(base.rstrip("/")) + 1 :].split("/", 1)[0], []).append(f)
        if local:
            for d in _with_parents([path]):
                by_dir.setdefault(d, []).append(f)
    out: Holds = {}
    for name, source in models:
        cache = _fetched_name(source)
        if cache is not None:
            files = by_top.get(cache, [])
        elif name in local:
            files = by_dir.get(local[name], [])
        else:
            files = []  # a hub id: the engine's own cache, which no agent reports
        if files:
            counted: dict[tuple[str, str], int] = {}
            for f in files:
                mount = _shared_mount(f.path, inv.usage.filesystems)
                counted[("shared:" + mount if mount is not None else node_id, f.path)] = (
                    f.size_bytes
                )
            out[name] = counted
    return out


def _shared_mount(path: str, filesystems: Sequence[model.Filesystem]) -> str | None:
    """The mount of the filesystem `path` lives on, when that filesystem is shared."""
    best: model.Filesystem | None = None
    for fs in filesystems:
        if _under(path, fs.mount) and (best is None or len(fs.mount) > len(best.mount)):
            best = fs
    return best.mount if best is not None and best.shared else None


@attrs.frozen
class ModelHeld:
    model: str
    size_bytes: int  # a file on a shared filesystem held by several nodes counts once
    nodes: tuple[str, ...]  # the nodes holding some of it


@attrs.frozen
class FabricHoldings:
    fabric: str | None  # None: the nodes that report no fabric
    nodes: tuple[str, ...]
    models: tuple[ModelHeld, ...]


def fabric_holdings(
    inventories: Mapping[str, model.Inventory],
    models: Sequence[tuple[str, str]],
    holds: Mapping[str, Holds] | None = None,
) -> list[FabricHoldings]:
    """Per fabric (by the fabrics each node's inventory reports; a node on two is in
    both, a node on none is under None), the catalog models some node on it holds.
    `holds`: `node_holds` of each node, when the caller computed them already."""
    if holds is None:
        holds = {n: node_holds(n, inv, models) for n, inv in inventories.items()}
    members: dict[str | None, list[str]] = {}
    for node_id, inv in sorted(inventories.items()):
        names: list[str | None] = [*sorted({f.name for f in inv.fabrics})]
        for fabric in names or [None]:
            members.setdefault(fabric, []).append(node_id)
    out = []
    for fabric in sorted(members, key=lambda f: (f is None, f or "")):
        held = []
        for name, _source in models:
            counted: dict[tuple[str, str], int] = {}
            holders = []
            for node_id in members[fabric]:
                mine = holds.get(node_id, {}).get(name)
                if mine:
                    holders.append(node_id)
                    counted.update(mine)
            if holders:
                held.append(ModelHeld(name, sum(counted.values()), tuple(holders)))
        out.append(FabricHoldings(fabric, tuple(members[fabric]), tuple(held)))
    return out
