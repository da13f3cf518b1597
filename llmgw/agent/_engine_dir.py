"""An installed engine's directory, `<state>/engines/<name>/<version>/`, and its marker.

What both ways of installing (an archive, a virtualenv) share: the marker,
removing a leftover, and `InstallError`, the one line a failed pass reports.
The marker (`.llmgw-installed`, JSON: version, what it was installed from,
the binary relative to the directory) is written last, whole, by a rename: a
directory without one is an earlier pass's leftover and is removed before the
next pass fills it again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MARKER = ".llmgw-installed"


class InstallError(Exception):
    """One pass failed; the message is the one line the node reports."""


def read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(directory: Path, data: Mapping[str, Any]) -> None:
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps(dict(data), indent=2, sort_keys=True) + "\n")
    tmp.replace(directory / MARKER)


def rmtree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
