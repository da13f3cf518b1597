"""docs/configuration.md names every key each config file takes, and only those.

The loaders refuse unknown keys (cattrs, forbid_extra_keys), so a key the reference
lists but the code lacks is one an operator is told to write and is then refused
for; a key the code takes but the reference leaves out is one nobody can find.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path

import attrs
import pytest
from helpers import REPO

from llmgw import config
from llmgw.cp._fleet import _catalog, _engines, _traffic
from llmgw.router._main import RouterFile
from llmgw.router._router import RouterConfig

DOC = REPO / "docs" / "configuration.md"


def sections() -> dict[str, str]:
    """Heading text -> its body, for every heading of the document."""
    parts = re.split(r"^#+ (.*)$", DOC.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def keys(heading_start: str) -> set[str]:
    """The top-level keys of one section's table: its rows' first column, each name
    in backticks (`tls.ca`, `tls.cert` is the key `tls`)."""
    (body,) = [b for h, b in sections().items() if h.startswith(heading_start)]
    out = set()
    for line in body.splitlines():
        first = re.match(r"^\| (`[^|]*`) \|", line)
        if first is not None:
            for name in re.findall(r"`([^`]+)`", first.group(1)):
                out.add(name.split(".", 1)[0])
    return out


def fields(cls: type) -> set[str]:
    return {f.name for f in attrs.fields(cls)}


@pytest.mark.parametrize(
    ("heading", "cls"),
    [
        ("agent.yaml", config.AgentConfig),
        ("server.yaml", config.ServerConfig),
        ("Router settings", RouterConfig),
        ("router.yaml", RouterFile),
        ("ctl.yaml", config.CtlConfig),
    ],
)
def test_the_reference_lists_exactly_the_keys_the_loader_takes(heading: str, cls: type) -> None:
    documented, taken = keys(heading), fields(cls)
    assert documented - taken == set(), f"{heading}: documented, but refused as unknown"
    assert taken - documented == set(), f"{heading}: taken, but not in the reference"


def test_nested_keys_are_the_nested_classes_fields() -> None:
    (server,) = [b for h, b in sections().items() if h.startswith("server.yaml")]
    mirror = set(re.findall(r"`mirror\.([a-z_]+)`", server))
    assert mirror == fields(config.MirrorConfig)
    for heading in ("agent.yaml", "server.yaml"):
        (body,) = [b for h, b in sections().items() if h.startswith(heading)]
        assert set(re.findall(r"`tls\.([a-z_]+)`", body)) == fields(config.TlsFiles), heading


# --- every key reaches code -----------------------------------------------------------------

LIBRARY = REPO / "llmgw"


@functools.cache
def _library() -> tuple[tuple[Path, ast.Module, frozenset[str]], ...]:
    """Each library file but llmgw/config.py (the loaders and their validators), parsed
    once for the whole module: (its resolved path, its tree, the attribute names it
    reads, `x.name` in a load context)."""
    out = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.resolve() == (LIBRARY / "config.py").resolve():
            continue
        tree = ast.parse(path.read_text(), str(path))
        loads = frozenset(
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
        )
        out.append((path.resolve(), tree, loads))
    return tuple(out)


def _reads(skip: ast.ClassDef | None, home: Path) -> set[str]:
    """The attribute names library code reads (`x.name`, in a load context), leaving out
    llmgw/config.py (the loaders and their validators) and, in `home`, the body of the
    class `skip` itself."""
    out: set[str] = set()
    for path, tree, loads in _library():
        if skip is None or path != home:
            out |= loads
            continue
        inside: set[int] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and n.name == skip.name:
                inside = {id(x) for x in ast.walk(n)}
        out |= {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and id(n) not in inside
        }
    return out


# The classes a config file is loaded into, top level and nested: what docs/configuration.md
# documents, field by field (the test above holds the two lists equal).
LOADED = [
    config.AgentConfig,
    config.TlsFiles,
    config.FabricDecl,
    config.ServerConfig,
    config.MirrorConfig,
    RouterConfig,
    RouterFile,
    config.CtlConfig,
    _engines.EngineConfig,
    _engines.ArchiveConfig,
    _catalog.CatalogModel,
    _catalog.Autoscale,
    _catalog.AutoscaleTarget,
    _catalog.Profile,
    _catalog.CatalogAdapter,
    _traffic.TrafficEntry,
]


@pytest.mark.parametrize("cls", LOADED, ids=lambda c: c.__name__)
def test_every_documented_key_is_read_by_code_outside_its_loader(cls: type) -> None:
    """A key the loader takes and no code reads is accepted and does nothing (as
    `fabrics.<name>.interface` once was): each field of each loaded class is read as an
    attribute by library code other than its loader and its own class body. What
    each key then changes is pinned by the tests of its feature (for `interface`:
    tests/deploy/test_examples.py, the two-node engine's NCCL_SOCKET_IFNAME)."""
    home = Path(inspect.getfile(cls)).resolve()
    tree = ast.parse(home.read_text())
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    reads = _reads(node, home)
    unread = sorted(f.name for f in attrs.fields(cls) if f.name not in reads)
    assert unread == [], f"{cls.__name__}: read by no library code outside its declaration"
