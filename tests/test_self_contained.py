"""A fresh clone with nothing beside it runs every test: nothing reads outside the repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from helpers import FIXTURES, REPO

SCANNED = ("tests", "fuzz", "bench", "llmgw")
# Ways a path escapes the checkout: a parent of the repository, a `..` segment,
# the session's shared/ directory beside it, an absolute path into /work.
ESCAPES = [
    re.compile(p)
    for p in (
        r"\.\./shared",
        r"""["']shared["']\s*/\s*["']fixtures["']""",
        r"""/\s*["']\.\.["']""",
        r"parents\[\d+\]\s*\.\s*parent\b",
        r"\bREPO\s*\.\s*parent\b",
        r"""["']/work/""",
    )
]


def _sources() -> list[Path]:
    me = Path(__file__).resolve()
    files = [
        p
        for top in SCANNED
        for p in sorted((REPO / top).rglob("*"))
        if p.suffix in (".py", ".sh", ".yaml", ".toml", ".cfg") and p.resolve() != me
    ]
    return [*files, REPO / "Makefile", REPO / "pyproject.toml"]


def test_the_patterns_catch_what_the_old_code_did() -> None:
    # The lines the suite had before the samples moved in: each must be caught. SIB is the
    # name of the directory beside the checkout on a development machine, spelled in two
    # parts so that this file's own text does not look like such a read to a plain grep.
    sib = "sha" + "red"
    old = [
        t.replace("SIB", sib)
        for t in (
            'FIXTURES = Path(__file__).resolve().parents[3] / ".." / "SIB" / "fixtures"',
            'FIXTURES = REPO.parent / "SIB" / "fixtures"',
            'FIXTURES = Path(__file__).resolve().parents[1].parent / "SIB" / "fixtures"',
        )
    ]
    for line in old:
        assert any(p.search(line) for p in ESCAPES), line
    assert not any(p.search('FIXTURES = REPO / "tests" / "data"') for p in ESCAPES)


def test_nothing_reads_outside_the_repository() -> None:
    sources = _sources()
    assert len(sources) > 50  # the scan saw the tree, not an empty glob
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sources
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if any(p.search(line) for p in ESCAPES)
    ]
    assert found == [], "reads outside the repository:\n" + "\n".join(found)


def test_one_fixtures_constant() -> None:
    # Only tests/helpers.py and fuzz/targets.py (which runs without pytest) say where the samples are.
    defining = sorted(
        str(p.relative_to(REPO))
        for p in _sources()
        if re.search(r"^FIXTURES\s*=", p.read_text(errors="replace"), re.M)
    )
    assert defining == ["fuzz/targets.py", "tests/helpers.py"]
    spec = importlib.util.spec_from_file_location(
        "llmgw_fuzz_targets_check", REPO / "fuzz" / "targets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.FIXTURES == FIXTURES


def test_every_sample_is_inside_and_indexed() -> None:
    assert FIXTURES.resolve().is_relative_to(REPO)
    index = (FIXTURES / "INDEX.md").read_text()
    samples = sorted(p.name for p in FIXTURES.iterdir() if p.name != "INDEX.md")
    assert len(samples) >= 30
    assert [s for s in samples if s not in index] == []
    # No link out of the tree either (a symlink to a directory beside it would pass the grep).
    assert [p for p in FIXTURES.rglob("*") if p.is_symlink()] == []


def test_hypothesis_has_no_deadline_on_shared_machines() -> None:
    # tests/conftest.py loads the "shared" profile unless told otherwise: a property
    # that is slow once on a busy 2-core machine is not a failure.
    import os

    from hypothesis import settings

    if os.environ.get("HYPOTHESIS_PROFILE", "shared") == "shared":
        assert settings().deadline is None
    assert settings.get_profile("shared").deadline is None
