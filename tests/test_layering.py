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
NEVER_WITH_PURE = sorted(IO_MODULES - {"os", "pathlib"} | {"cattrs", "ruamel", "prometheus_client", "h11"})


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
