"""Build a wheel named `vllm` that runs llmgw's fake engine as vLLM.

Tests put it into the control plane's mirror (`<mirror dir>/simple/vllm/`, the
PEP 503 layout the mirror's simple index serves) and declare `vllm: {version:
X}`, so an agent creates a virtualenv and fills it with real pip, as it would
for the real vLLM.

The wheel holds a package `vllm` (`vllm.__version__ == X`, so the installer's
proof by import sees the declared version) and a console script `vllm`. pip
writes that script into the venv's bin/ with the venv's Python; it execs the
Python that built the wheel (where llmgw is importable, which the bare venv
is not) with the fake engine's entry point and the venv script's own path as
the program name: the fake takes the engine from that name ("vllm"), and the
adapter's argv[0] stays the venv's `bin/vllm`.

Nothing in it is a network or a build backend: the wheel is a zip written by
hand, with its RECORD, as the wheel spec (PEP 427) has it.
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

from llmgw.testing._fake_engine_cli import VERSIONS

__all__ = ["DEFAULT_VERSION", "build_vllm_wheel", "wheel_name"]

DEFAULT_VERSION = VERSIONS["vllm"]  # what the fake's `vllm --version` prints

_CLI = '''\
"""The `vllm` console script: llmgw's fake engine as vLLM, in the Python that built this."""

import os
import sys

PYTHON = {python!r}
CODE = (
    "import sys; from llmgw.testing.fake_engine import main; "
    "sys.exit(main(sys.argv[2:], prog=sys.argv[1]))"
)


def main() -> None:
    os.execv(PYTHON, [PYTHON, "-c", CODE, sys.argv[0], *sys.argv[1:]])
'''


def wheel_name(version: str) -> str:
    return f"vllm-{version}-py3-none-any.whl"


def build_vllm_wheel(
    dest_dir: Path, version: str = DEFAULT_VERSION, *, python: str = sys.executable
) -> Path:
    """Write `dest_dir/vllm-<version>-py3-none-any.whl`; returns its path."""
    dist_info = f"vllm-{version}.dist-info"
    files: dict[str, bytes] = {
        "vllm/__init__.py": f'"""llmgw\'s fake vLLM."""\n\n__version__ = {version!r}\n'.encode(),
        "vllm/_fake_cli.py": _CLI.format(python=python).encode(),
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: llmgw's fake engine as vLLM, for tests\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: llmgw.testing.fake_wheel\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{dist_info}/entry_points.txt": b"[console_scripts]\nvllm = vllm._fake_cli:main\n",
        f"{dist_info}/top_level.txt": b"vllm\n",
    }
    record = [f"{name},{_hash(data)},{len(data)}" for name, data in files.items()]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / wheel_name(version)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            whl.writestr(info, data, zipfile.ZIP_DEFLATED)
    tmp.replace(out)
    return out


def _hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()
