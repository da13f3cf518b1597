"""Each public package and module of llmgw exports exactly its public names (trio's test_exports).

The rule, per public module M (no `_private` part in its dotted name; not `__main__`):

- M declares `__all__`, a list or tuple of distinct strings, and every name in it
  resolves (`getattr(M, name)`);
- a package's `__init__` exists to say what the package offers, so every public
  (non-underscore) attribute it has is in `__all__`, except its submodules and
  `from __future__` features: whatever it imports or defines for itself is private;
- a plain module's own public names are those its top-level statements define
  (def, class, assignment, also inside a top-level `if`/`try`, but not under
  `if TYPE_CHECKING:` or `if __name__ == "__main__":`); each is in `__all__`,
  except a `TypeVar` and the module's logger, which are its plumbing, not its
  surface. What a plain module imports is its own business and may stay out.
"""

from __future__ import annotations

import ast
import importlib
import logging
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmgw"

# What the design names; the walk below must find at least these, so a rename
# that hid a package from it would fail here rather than check nothing.
NAMED = {
    "llmgw.agent",
    "llmgw.core",
    "llmgw.cp",
    "llmgw.ctl",
    "llmgw.engines",
    "llmgw.host",
    "llmgw.router",
    "llmgw.rpc",
    "llmgw.store",
    "llmgw.config",
    "llmgw.errors",
    "llmgw.keys",
    "llmgw.model",
}


def _dotted(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def public_modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _dotted(path)
        if path.stem == "__main__" or any(_private(part) for part in name.split(".")):
            continue
        found[name] = path
    return found


MODULES = public_modules()
# The root package holds only __version__ and its subpackages; it is not a surface.
CHECKED = sorted(set(MODULES) - {"llmgw"})


def test_the_walk_finds_every_named_surface() -> None:
    assert set(CHECKED) >= NAMED


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


def _targets(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def defined(body: list[ast.stmt]) -> list[str]:
    """The names a module's top-level statements define (imports excluded)."""
    names: list[str] = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [n for target in node.targets for n in _targets(target)]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            names += _targets(node.target)
        elif isinstance(node, ast.If):
            if not (_is_type_checking(node.test) or _is_main_guard(node.test)):
                names += defined(node.body) + defined(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                names += defined(block)
    return names


def _plumbing(value: object) -> bool:
    return isinstance(value, TypeVar | logging.Logger)


def own_public_names(module: ModuleType, path: Path) -> set[str]:
    if path.name == "__init__.py":
        return {
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and not (
                isinstance(value, ModuleType) and value.__name__ == f"{module.__name__}.{name}"
            )
            and type(value).__module__ != "__future__"  # `from __future__ import ...`
        }
    return {
        name
        for name in defined(ast.parse(path.read_text()).body)
        if not name.startswith("_") and not _plumbing(getattr(module, name, None))
    }


def problems(module: ModuleType, path: Path) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is None:
        return ["declares no __all__"]
    if not isinstance(exported, list | tuple) or not all(isinstance(n, str) for n in exported):
        return [f"__all__ is not a list of strings: {exported!r}"]
    found = []
    if len(set(exported)) != len(exported):
        found.append(
            f"__all__ names twice: {sorted({n for n in exported if exported.count(n) > 1})}"
        )
    if missing := sorted(n for n in exported if not hasattr(module, n)):
        found.append(f"__all__ names what is not there: {missing}")
    if unlisted := sorted(own_public_names(module, path) - set(exported)):
        found.append(f"public but not in __all__: {unlisted}")
    return found


@pytest.mark.parametrize("name", CHECKED)
def test_exports_exactly_its_public_names(name: str) -> None:
    module = importlib.import_module(name)
    assert problems(module, MODULES[name]) == []


# The rule must be able to fail: each of these is a way a surface goes wrong.


def _fake(tmp_path: Path, name: str, source: str) -> tuple[ModuleType, Path]:
    path = tmp_path / name
    path.write_text(source)
    module = ModuleType(path.stem)
    exec(compile(source, str(path), "exec"), vars(module))
    return module, path


def test_a_module_without_all_fails(tmp_path: Path) -> None:
    assert problems(*_fake(tmp_path, "m.py", "def f(): pass\n")) == ["declares no __all__"]


def test_a_name_defined_but_not_listed_fails_and_plumbing_does_not(tmp_path: Path) -> None:
    source = (
        "import logging\nfrom typing import TypeVar\nimport os\n"
        "__all__ = ['f']\nT = TypeVar('T')\nlog = logging.getLogger('x')\n"
        "def f(): pass\nLIMIT = 3\n_hidden = 1\n"
        "try:\n    FAST = True\nexcept ImportError:\n    FAST = False\n"
        "if __name__ == '__main__':\n    ran = True\n"
    )
    assert problems(*_fake(tmp_path, "m.py", source)) == [
        "public but not in __all__: ['FAST', 'LIMIT']"
    ]


def test_a_package_must_list_what_it_imports(tmp_path: Path) -> None:
    source = "from __future__ import annotations\nfrom os.path import join\n__all__ = []\n"
    assert problems(*_fake(tmp_path, "__init__.py", source)) == [
        "public but not in __all__: ['join']"
    ]


def test_a_listed_name_that_is_not_there_fails(tmp_path: Path) -> None:
    source = "__all__ = ['f', 'gone', 'f']\ndef f(): pass\n"
    assert problems(*_fake(tmp_path, "m.py", source)) == [
        "__all__ names twice: ['f']",
        "__all__ names what is not there: ['gone']",
    ]
