"""The design's rules about who may import what, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmgw"
IO_MODULES = {
    "trio",
    "capnp",
    "httpx",
    "hypercorn",
    "quart_trio",
    "asyncio",
    "socket",
    "subprocess",
    "os",
    "pathlib",
    "shutil",
    "psutil",
    "pynvml",
    "ssl",
}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_rpc_boundary_imports_capnp() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "capnp" in imports(p) and p.parent.name != "rpc"
    ]
    assert offenders == []


def test_pure_core_does_no_io() -> None:
    core = list((PACKAGE / "core").rglob("*.py"))
    assert core, "llmgw/core is where the pure decisions live"
    offenders = {str(p.relative_to(PACKAGE)): sorted(imports(p) & IO_MODULES) for p in core}
    assert {k: v for k, v in offenders.items() if v} == {}


# What the source says is not all: an import of a sibling that imports trio
# brings trio in too. Import each pure package alone and look at what came with it.
NEVER_WITH_PURE = sorted(
    IO_MODULES - {"os", "pathlib"} | {"cattrs", "ruamel", "prometheus_client", "h11"}
)


def _loaded_with(package: str) -> list[str]:
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        f"import {package}\n"
        f"print(json.dumps(sorted(m for m in {NEVER_WITH_PURE!r} if m in sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PACKAGE.parent,
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_the_check_sees_a_transitive_import() -> None:
    # llmgw.router's __init__ names no I/O module; its submodules bring trio and
    # socket in. The subprocess check must see them, or it proves nothing.
    assert {"trio", "socket"} <= set(_loaded_with("llmgw.router"))


def test_core_brings_no_io_module_with_it() -> None:
    assert _loaded_with("llmgw.core") == []


def test_engines_bring_no_io_module_with_them() -> None:
    assert _loaded_with("llmgw.engines") == []


def test_the_store_sits_below_the_control_plane_and_the_router() -> None:
    # Router-only mode keeps its keys in the store, so the store imports neither.
    offenders = {
        str(p.relative_to(PACKAGE)): sorted(
            n
            for n in _llmgw_imports(p)
            if n.startswith(("llmgw.cp", "llmgw.router", "llmgw.agent", "llmgw.ctl"))
        )
        for p in (PACKAGE / "store").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    # ... nor brings them in through a module it imports.
    import subprocess
    import sys

    code = (
        "import sys, llmgw.store\n"
        "print(sorted(m for m in sys.modules if m.startswith(('llmgw.cp', 'llmgw.router'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PACKAGE.parent,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def _llmgw_imports(path: Path) -> set[str]:
    """The llmgw modules `path` imports from, relative imports resolved."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
    home = list(rel[:-1])  # the package the module is in (its own, for an __init__)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = home[: len(home) - (node.level - 1)] if node.level else []
            names.add(".".join(base + ([node.module] if node.module else [])))
    return {n for n in names if n.startswith("llmgw.")}


def test_the_os_release_parser_brings_no_io_module_with_it() -> None:
    # Why llmgw/host/__init__.py imports nothing: the agent's discovery parses
    # os-release with it and brings in no trio (llmgw.host.packages and .run do).
    assert _loaded_with("llmgw.host.os_release") == []


def _declared(extra: str | None = None) -> set[str]:
    import re
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    specs = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {re.split(r"[<>=!~ \[;]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_every_imported_distribution_is_declared() -> None:
    """h11 was imported by the router and installed only because hypercorn needs it."""
    import sys
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    runtime, test = _declared(), _declared() | _declared("test")
    missing: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        # llmgw.testing and the demo run from a checkout with the test extras (make test/demo).
        rel = path.relative_to(PACKAGE)
        allowed = test if rel.parts[0] in ("testing", "demo.py") else runtime
        for name in imports(path) - set(sys.stdlib_module_names) - {"llmgw"}:
            dists = {d.lower().replace("_", "-") for d in owners.get(name, [name])}
            if not dists & allowed:
                missing.setdefault(name, set()).add(str(path.relative_to(PACKAGE)))
    assert missing == {}


# Only public names cross packages (trio's test_exports checks this for trio): an
# import of llmgw.X._y, or of a private name `from llmgw.X import _y`, is allowed only
# from inside package llmgw.X (its subpackages included). Every import counts:
# function-local, under TYPE_CHECKING, relative. llmgw/testing is held to it too: it
# ships in the wheel, and what it imports from elsewhere is what a user of it can.
# tests/, bench/ and fuzz/ are not library code and may reach in.


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports(module: str, is_package: bool, source: str) -> list[str]:
    """`line: private module or name` for each import in `source` (the text of
    `module`) that reaches into another package's private module or name."""
    me = module.split(".")
    home = me if is_package else me[:-1]  # the package the module is inside
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = home[: len(home) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] != "llmgw":
                continue
            for i, part in enumerate(parts):
                if _is_private(part):
                    owner = parts[:i]
                    if home[: len(owner)] != owner:
                        found.append(f"{node.lineno}: {'.'.join(parts[: i + 1])}")
                    break
    return sorted(set(found), key=lambda s: (int(s.split(":")[0]), s))


def test_no_library_module_imports_another_package_private_module() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        is_package = path.name == "__init__.py"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        if found := private_imports(module, is_package, path.read_text()):
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert offenders == {}


def test_the_private_import_check_sees_every_form() -> None:
    source = (
        "from llmgw.router._keys import ApiKey\n"  # another package's private module
        "import llmgw.core._placement as placement\n"
        "from llmgw.agent import _procfs\n"  # a private module by name
        "from ..router import _main\n"  # relative, from llmgw.cp: llmgw.router._main
        "def f():\n"
        "    from llmgw.rpc._tls import check_files\n"  # function-local
        "from llmgw.cp._store import Store\n"  # our own package: allowed
        "from . import _events\n"  # ours, relative: allowed
        "from llmgw._process import run_service\n"  # llmgw's own, we are inside: allowed
        "from llmgw.router import Router\n"  # public: allowed
        "import llmgw.agent.__main__\n"  # dunder, not private: allowed
    )
    assert private_imports("llmgw.cp._x", False, source) == [
        "1: llmgw.router._keys",
        "2: llmgw.core._placement",
        "3: llmgw.agent._procfs",
        "4: llmgw.router._main",
        "6: llmgw.rpc._tls",
    ]
    # A package's __init__ is inside itself; a subpackage may use its parent's privates.
    assert private_imports("llmgw.cp", True, "from ._store import Store\n") == []
    assert private_imports("llmgw.cp._pages._app", False, "from llmgw.cp._store import S\n") == []
    assert private_imports("llmgw.testing.cluster", False, "from llmgw.ctl import _cert\n") == [
        "1: llmgw.ctl._cert"
    ]


# The control plane's wings (docs/architecture.md): which of llmgw.cp's parts each may import.
CP_WINGS: dict[str, set[str]] = {
    "_weights": set(),
    "_observe": set(),
    "_fleet": {"_weights", "_observe"},
    "_admin": {"_fleet", "_weights", "_observe"},
    "_pages": {"_fleet", "_weights", "_observe"},
}


def _cp_part(name: str) -> str | None:
    """`llmgw.cp._fleet._registry` -> `_fleet`; None outside llmgw.cp's parts."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["llmgw", "cp"] and len(parts) > 2 else None


def test_the_control_plane_wings_import_only_down() -> None:
    cp = PACKAGE / "cp"
    assert {p.name for p in cp.iterdir() if (p / "__init__.py").exists()} == set(CP_WINGS)
    offenders = {}
    for wing, allowed in CP_WINGS.items():
        for path in (cp / wing).rglob("*.py"):
            reached = {_cp_part(n) for n in _llmgw_imports(path)} - {None, wing}
            if bad := sorted(str(r) for r in reached - allowed):
                offenders[str(path.relative_to(PACKAGE))] = bad
    assert offenders == {}


def test_the_web_package_sits_below_every_service() -> None:
    """llmgw.web is shared by the router, the control plane and the agent: it imports none."""
    offenders = {
        str(p.relative_to(PACKAGE)): sorted(
            n for n in _llmgw_imports(p) if not n.startswith(("llmgw.web", "llmgw.errors"))
        )
        for p in (PACKAGE / "web").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


MAX_CLASS_LINES = 400  # issue 22: a class past this is more than one idea; split it


def long_classes(source: str, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_class_in_the_package_is_over_400_lines() -> None:
    offenders = [
        f"{p.relative_to(PACKAGE)}: {name} ({lines} lines)"
        for p in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_classes(p.read_text())
    ]
    assert offenders == [], offenders


def test_the_class_length_check_counts_a_class_whole() -> None:
    body = "class Big:\n" + "    x = 1\n" * 400
    assert long_classes(body) == [("Big", 401)]
    assert long_classes("class Small:\n    pass\n") == []
