"""Each parser's fuzz target, briefly: parse or raise ParseError (fuzz/targets.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load_targets() -> ModuleType:
    # fuzz/ is not a package on sys.path under pytest; load the file itself.
    spec = importlib.util.spec_from_file_location(
        "llmgw_fuzz_targets", REPO / "fuzz" / "targets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


targets = _load_targets()
NAMES = sorted(targets.TARGETS)


def test_every_target_has_seeds() -> None:
    assert targets.FIXTURES.is_dir(), f"fixtures not found at {targets.FIXTURES}"
    for name in NAMES:
        assert targets.TARGETS[name].seeds, name


@pytest.mark.parametrize("name", NAMES)
def test_target(name: str) -> None:
    target = targets.TARGETS[name]
    # The seeds themselves parse (they are real samples).
    for seed in target.seeds:
        target.parse(seed)
    # Every line's end and every 7th length (the whole of it, every length, is the fuzz
    # command's: `python fuzz/targets.py`; a 48 KB recording cut at every length costs
    # 15 s of a run's CPU).
    targets.check_prefixes(target, every=7)
    targets.fuzz(target, max_examples=120)


def test_the_cuts_take_every_lines_end_and_every_nth_length() -> None:
    seed = "ab\ncdefgh\nij"
    assert targets.cuts(seed) == list(range(len(seed) + 1))
    assert targets.cuts(seed, every=5) == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12]


def test_the_property_catches_a_foreign_exception() -> None:
    def broken(text: str) -> object:
        return text.split(",")[3]  # IndexError on short input

    bad = targets.Target("broken", broken, ("a,b,c,d",))
    with pytest.raises(IndexError):
        targets.check_prefixes(bad)
