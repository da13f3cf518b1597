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
