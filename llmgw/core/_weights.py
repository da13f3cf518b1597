"""Weights: what a catalog source is, what a mirror's manifest may name, what reclaim may delete.

Three pure decisions for the fetcher and reclaim (issue 12); the agent and the
control plane do the I/O around them.

**Sources.** `classify_source` tells a catalog source's kind from its text:

| source                          | kind             | what the agent does             |
|---------------------------------|------------------|---------------------------------|
| `/abs/path`, `./rel`, `../rel`  | `local`          | checks it exists; fetches nothing |
| `http(s)://host/…/file`         | `url-file`       | fetches one file                |
| `http(s)://host/…/dir/`         | `url-version`    | fetches every file of its manifest |
| `mirror:/path/file`             | `mirror-file`    | the same, from the control plane's mirror |
| `mirror:/path/dir/`             | `mirror-version` | the same, from the control plane's mirror |
| anything else (`Qwen/Qwen2.5-7B`) | `hub`          | nothing: the engine resolves it |

**The cache layout.** What is fetched lives in one directory per source,
`<weights_dir>/<cache_name(source)>/`, named by a hash of the source as
written (so `mirror:/tiny/` has one name whichever control plane serves it).
Its `.partial` files and its completion marker live inside it, so one
top-level entry is the whole of a source and reclaim deletes it whole. A
manifest may therefore not name a file that ends in `.partial` or that starts
with `.llmgw` (the marker's prefix).

**Manifests.** `check_manifest` parses a mirror's
`{"files": [{"name", "size", "sha256"?}]}` and refuses, in one line, anything
that could write outside the version's directory or collide inside it.
Unknown keys are ignored (a newer mirror may say more).

**Reclaim.** `may_delete` decides about one path given a description of the
disk (`Tree`: relative path -> `TreeFile`/`TreeDir`/`TreeLink`, built by the agent
without following links). It allows only a path strictly inside the weights
directory whose top-level entry is a cache name the catalog does not want, with
no `..`, not a symlink, not reached through one, holding none, and not anything
a symlink in the tree leads to (nor a directory holding such a thing). The weights
directory itself is taken as already resolved (the agent passes its real
path); links outside it are not seen. `plan_reclaim` picks every deletable
top-level entry, with its size.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import attrs

from llmgw.errors import ConfigError

CACHE_PREFIX = "src-"
PARTIAL_SUFFIX = ".partial"
MARKER = ".llmgw-complete"
RESERVED_PREFIX = ".llmgw"
MAX_NAME_BYTES = 255  # NAME_MAX on Linux filesystems
_CACHE_NAME = re.compile(r"src-[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_MAX_LINK_HOPS = 40  # as Linux's MAXSYMLINKS


# --- sources -------------------------------------------------------------------------------


class SourceKind(enum.Enum):
    LOCAL = "local"
    URL_FILE = "url-file"
    URL_VERSION = "url-version"
    MIRROR_FILE = "mirror-file"
    MIRROR_VERSION = "mirror-version"
    HUB = "hub"


@attrs.frozen
class Source:
    kind: SourceKind
    text: str  # the source as written in the catalog

    @property
    def fetched(self) -> bool:
        """The agent downloads it into the weights directory."""
        return self.kind not in (SourceKind.LOCAL, SourceKind.HUB)

    @property
    def version(self) -> bool:
        """A directory of several files, described by a manifest."""
        return self.kind in (SourceKind.URL_VERSION, SourceKind.MIRROR_VERSION)

    @property
    def cache_name(self) -> str | None:
        """The directory it is fetched into; None for what is not fetched."""
        return cache_name(self.text) if self.fetched else None


def _control(text: str) -> bool:
    return any(unicodedata.category(c) == "Cc" for c in text)


def classify_source(source: str) -> Source:
    """The kind of a catalog source; raises ConfigError for a source that cannot be right."""
    if not source or source != source.strip():
        raise ConfigError(f"source {source!r}: empty or surrounded by spaces")
    if _control(source):
        raise ConfigError(f"source {source!r}: holds a control character")
    if source.startswith(("/", "./", "../")):
        return Source(SourceKind.LOCAL, source)
    scheme, sep, rest = source.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        host, slash, _ = rest.partition("/")
        if not host or not slash:
            raise ConfigError(
                f"source {source!r}: a URL needs a host and a path, e.g. https://host/model.gguf"
            )
        path = re.split(r"[?#]", rest, maxsplit=1)[0]
        version = path.endswith("/")
        return Source(SourceKind.URL_VERSION if version else SourceKind.URL_FILE, source)
    if source.startswith("mirror:"):
        path = source[len("mirror:") :]
        parts = path.split("/")
        if not path.startswith("/") or path == "/":
            raise ConfigError(
                f"source {source!r}: a mirror source is mirror:/path (a file) "
                "or mirror:/path/ (a version)"
            )
        inner = parts[1:-1] if path.endswith("/") else parts[1:]
        bad = [p for p in inner if p in ("", ".", "..") or "\\" in p]
        if bad:
            raise ConfigError(
                f"source {source!r}: path part {bad[0]!r} is not allowed; "
                "name files under mirror.dir with plain names"
            )
        version = path.endswith("/")
        return Source(SourceKind.MIRROR_VERSION if version else SourceKind.MIRROR_FILE, source)
    return Source(SourceKind.HUB, source)


def cache_name(source: str) -> str:
    """The weights directory entry a source is fetched into: stable across nodes and restarts."""
    data = source.encode("utf-8", "surrogatepass")  # total: any str has a name
    return CACHE_PREFIX + hashlib.sha256(data).hexdigest()[:32]


def is_cache_name(name: str) -> bool:
    return _CACHE_NAME.fullmatch(name) is not None


def wanted_cache_names(sources: Iterable[str], *, weights_dir: str) -> frozenset[str]:
    """The cache names a catalog still wants: its fetched sources, and any cache entry a
    local source points into (an operator may name a fetched file directly)."""
    wanted: set[str] = set()
    base = _base(weights_dir)
    for text in sources:
        try:
            src = classify_source(text)
        except ConfigError:
            continue  # the catalog refuses it elsewhere; it wants nothing here
        if src.fetched:
            wanted.add(cache_name(text))
        elif src.kind is SourceKind.LOCAL and text.startswith("/"):
            parts = _lexical(text)  # wanting too much is safe; too little is not
            if parts[: len(base)] == base and len(parts) > len(base):
                wanted.add(parts[len(base)])
    return frozenset(wanted)


# --- manifests -----------------------------------------------------------------------------


@attrs.frozen
class ManifestFile:
    name: str
    size_bytes: int
    sha256: str | None  # lower-case hex; None when the mirror did not say


@attrs.frozen
class Manifest:
    files: tuple[ManifestFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)


@attrs.frozen
class ManifestError:
    """Why a manifest was refused, in one line (the caller prefixes where it came from)."""

    message: str


HTML_PAGE = "got an HTML page where a manifest was expected — that server is not an llmgw mirror"


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str):
        return f"a name must be a string, got {type(name).__name__}"
    if name == "":
        return "an empty name"
    if "\x00" in name:
        return "holds a NUL byte"
    if _control(name):
        return "holds a control character"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if name.startswith(("/", "\\")):
        return "is an absolute path; a manifest names files inside one directory"
    if "/" in name or "\\" in name:
        return "holds a path separator; a manifest names files inside one directory"
    if name in (".", ".."):
        return "is not a file name; a manifest names files inside one directory"
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes long, at most {MAX_NAME_BYTES}"
    if name.endswith(PARTIAL_SUFFIX) or name.startswith(RESERVED_PREFIX):
        return (
            f"ends in {PARTIAL_SUFFIX} or starts with {RESERVED_PREFIX}: "
            "names the fetcher keeps for itself"
        )
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_manifest(data: bytes, *, max_bytes: int, max_files: int) -> Manifest | ManifestError:
    """Parse a mirror's manifest, or say in one line why it is refused. Never raises."""
    head = data[:512].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith(b"<"):
        return ManifestError(HTML_PAGE)
    if len(data) > max_bytes:
        return ManifestError(f"the manifest is over {max_bytes} bytes; a mirror's is smaller")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ManifestError(f"the manifest is not UTF-8 (byte {exc.start}); a mirror answers JSON")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return ManifestError(f"the manifest is not JSON ({exc}); a mirror answers JSON")
    except RecursionError:
        return ManifestError("the manifest is not JSON a mirror sends: it nests too deep")
    except ValueError:  # an integer of more digits than Python converts
        return ManifestError("the manifest is not JSON a mirror sends: a number too long to read")
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        return ManifestError('the manifest is not {"files": [...]}, got ' + _short(doc))
    files = doc["files"]
    if not files:
        return ManifestError("the manifest lists no files; a version needs at least one")
    if len(files) > max_files:
        return ManifestError(f"the manifest lists {len(files)} files, at most {max_files}")
    seen: set[str] = set()
    out: list[ManifestFile] = []
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            return ManifestError(f'file {i}: not {{"name", "size"}}, got {_short(entry)}')
        name = entry.get("name")
        problem = _name_problem(name)
        if problem is not None:
            return ManifestError(f"file {i}: name {_short(name)} {problem}")
        assert isinstance(name, str)
        if name in seen:
            return ManifestError(f"file {i}: name {name!r} is listed twice")
        seen.add(name)
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return ManifestError(
                f"file {i} ({name!r}): size {_short(size)} is not a whole number of bytes >= 0"
            )
        digest = entry.get("sha256")
        if digest is not None and (not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
            return ManifestError(
                f"file {i} ({name!r}): sha256 {_short(digest)} is not 64 hex digits"
            )
        out.append(ManifestFile(name, size, digest.lower() if digest is not None else None))
    return Manifest(tuple(out))


# --- reclaim -------------------------------------------------------------------------------


@attrs.frozen
class TreeFile:
    size_bytes: int


@attrs.frozen
class TreeDir:
    pass


@attrs.frozen
class TreeLink:
    target: str  # as readlink says: absolute, or relative to the link's directory


Entry = TreeFile | TreeDir | TreeLink


def _tree_key_problem(key: str, entries: Mapping[str, Entry]) -> str | None:
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "is not a normalised relative path"
    parent = "/".join(parts[:-1])
    if parent and not isinstance(entries.get(parent), TreeDir):
        return f"has no directory {parent!r} in the tree"
    return None


def _check_entries(_instance: object, _attribute: object, entries: Mapping[str, Entry]) -> None:
    for key in entries:
        problem = _tree_key_problem(key, entries)
        if problem is not None:
            raise ValueError(f"tree entry {key!r} {problem}")


@attrs.frozen
class Tree:
    """What is under the weights directory: relative path ("src-…/model.gguf") -> entry.

    Every parent of an entry is a `TreeDir` in it; links are described, never followed.
    Anything else on disk (a fifo, a socket) is described as a `TreeFile`.
    """

    entries: Mapping[str, Entry] = attrs.field(factory=dict, validator=_check_entries)


NOT_ABSOLUTE = "not an absolute path"
TRAVERSES = "traverses out with '..'"
OUTSIDE = "outside the weights directory"
THE_DIRECTORY = "the weights directory itself"
NOT_A_CACHE_NAME = "not a cache name"
WANTED = "still wanted by the catalog"
NOT_ON_DISK = "not on disk"
A_SYMLINK = "a symlink"
THROUGH_A_SYMLINK = "reached through a symlink"
LINKED = "a symlink leads to it"
HOLDS_A_SYMLINK = "holds a symlink"


@attrs.frozen
class Verdict:
    allowed: bool
    reason: str | None = None  # one of the constants above: stable, for counting refusals
    detail: str | None = None  # one line for the operator: the path and what would be right

    def __bool__(self) -> bool:
        return self.allowed


ALLOWED = Verdict(True)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _lexical(path: str) -> list[str]:
    out: list[str] = []
    for part in _parts(path):
        if part != "..":
            out.append(part)
        elif out:
            out.pop()
    return out


def _base(weights_dir: str) -> list[str]:
    parts = _parts(weights_dir)
    if not weights_dir.startswith("/") or ".." in parts:
        raise ValueError(f"weights_dir {weights_dir!r}: must be an absolute, resolved path")
    return parts


def _resolve(start: list[str], target: str, base: list[str], tree: Tree) -> list[str] | None:
    """The absolute components a link at `start` (its directory's components) leads to,
    following links inside the tree; None for a loop."""
    current = [] if target.startswith("/") else list(start)
    pending = list(reversed(_parts(target)))
    hops = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if current:
                current.pop()
            continue
        current.append(part)
        if current[: len(base)] != base or len(current) == len(base):
            continue  # outside the tree (or the weights directory itself): a plain directory
        entry = tree.entries.get("/".join(current[len(base) :]))
        if isinstance(entry, TreeLink):
            hops += 1
            if hops > _MAX_LINK_HOPS:
                return None
            current.pop()
            if entry.target.startswith("/"):
                current = []
            pending.extend(reversed(_parts(entry.target)))
    return current


def _link_targets(base: list[str], tree: Tree) -> dict[str, tuple[str, list[str]]]:
    """For each link in the tree, its target as written and the relative components inside
    the weights directory it leads to ([] for the directory itself, or one above it, which
    leads to all of it); links that lead elsewhere (or nowhere, a loop) are left out."""
    out: dict[str, tuple[str, list[str]]] = {}
    for key, entry in tree.entries.items():
        if isinstance(entry, TreeLink):
            where = _resolve(base + key.split("/")[:-1], entry.target, base, tree)
            if where is None:
                continue
            if where[: len(base)] == base:
                out[key] = (entry.target, where[len(base) :])
            elif base[: len(where)] == where:  # a directory above: it leads to all of it
                out[key] = (entry.target, [])
    return out


def _decide(
    path: str,
    base: list[str],
    wanted: frozenset[str],
    tree: Tree,
    targets: Mapping[str, tuple[str, list[str]]],
) -> Verdict:
    def no(reason: str, why: str) -> Verdict:
        return Verdict(False, reason, f"{path}: {reason}{why}")

    if not path.startswith("/"):
        return no(NOT_ABSOLUTE, "; reclaim takes absolute paths")
    raw = path.split("/")
    if ".." in raw:
        return no(TRAVERSES, "; reclaim takes paths as the node reported them")
    parts = _parts(path)
    if parts[: len(base)] != base:
        return no(OUTSIDE, f" /{'/'.join(base)}")
    rel = parts[len(base) :]
    if not rel:
        return no(THE_DIRECTORY, "; only the cache entries in it are reclaimed")
    if not is_cache_name(rel[0]):
        return no(
            NOT_A_CACHE_NAME,
            f" ({rel[0]!r} is not src-<32 hex digits>); files an operator put there "
            "are never reclaimed",
        )
    if rel[0] in wanted:
        return no(WANTED, "")
    for depth in range(1, len(rel) + 1):
        key = "/".join(rel[:depth])
        entry = tree.entries.get(key)
        if entry is None:
            return no(NOT_ON_DISK, "")
        if isinstance(entry, TreeLink):
            if depth == len(rel):
                return no(A_SYMLINK, f" (to {entry.target!r}); links are never reclaimed")
            return no(THROUGH_A_SYMLINK, f" ({key} -> {entry.target!r})")
        if isinstance(entry, TreeFile) and depth < len(rel):
            return no(NOT_ON_DISK, f" ({key} is a file)")
    inside = "/".join(rel) + "/"
    for key, entry in sorted(tree.entries.items()):
        # A link inside would go with it; deleting it is safe only with an rmtree that does
        # not follow links. Refusing costs an operator one link removed by hand.
        if isinstance(entry, TreeLink) and key.startswith(inside):
            return no(HOLDS_A_SYMLINK, f" ({key} -> {entry.target!r})")
    for link, (written, target) in sorted(targets.items()):
        # Deleting the target, anything under it, or a directory holding it breaks the link.
        n = min(len(target), len(rel))
        if target[:n] == rel[:n]:
            return no(LINKED, f" ({link} -> {written!r})")
    return ALLOWED


def may_delete(path: str, *, weights_dir: str, wanted: frozenset[str], tree: Tree) -> Verdict:
    """May the agent delete `path`? `weights_dir` is absolute and already resolved."""
    base = _base(weights_dir)
    return _decide(path, base, wanted, tree, _link_targets(base, tree))


class Reclaimable(NamedTuple):
    path: str
    size_bytes: int


def _size(tree: Tree, top: str) -> int:
    prefix = top + "/"
    return sum(
        e.size_bytes
        for k, e in tree.entries.items()
        if isinstance(e, TreeFile) and (k == top or k.startswith(prefix))
    )


def plan_reclaim(weights_dir: str, tree: Tree, wanted: frozenset[str]) -> list[Reclaimable]:
    """Every top-level cache entry that may be deleted, by name, with its size."""
    base = _base(weights_dir)
    targets = _link_targets(base, tree)
    root = "/" + "/".join(base) if base else ""
    out = []
    for key in sorted(k for k in tree.entries if "/" not in k):
        path = f"{root}/{key}"
        if _decide(path, base, wanted, tree, targets):
            out.append(Reclaimable(path, _size(tree, key)))
    return out
