"""Whether an engine's binary can run here: `ldd` in plain words, then `--version`.

- `problems(ldd_output, family)` is pure: ldd's text in, what is wrong out,
  each library said once however many lines (or ldd blocks) repeat it:
  "libgomp.so.1 => not found" is `needs libgomp.so.1 (install libgomp1)` on a
  Debian-family node (the package named for `family`, see
  `llmgw.host.packages.family`; all families' names when it is None), and
  "version `GLIBCXX_3.4.30' not found (required by …)" is
  `libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)` (the highest version
  asked of the first symbol set named for that library). `packages` is what
  installing would fix (family -> package); it is empty for a library that is
  too old (the node's own package is already the newest it has) and for CUDA's
  libraries (`from the CUDA runtime`) or libraries not in the table.
- `check(binary, family=, timeout_s=)` runs `ldd <binary>` (found on PATH) and
  returns `problems` of its output; None when it cannot say (no ldd, ldd did
  not answer in time, or it failed without a line we read): unknown, which is
  neither fine nor a refusal; the `--version` proof still decides. ldd may
  run the binary's loader, so only a binary that is about to be run anyway
  is given to it.
- `prove_version(binary, timeout_s=, env=)` runs `<binary> --version` (stdout
  and stderr together, stdin empty, in its own process group) and returns the
  first non-empty line; `ProofError` otherwise, one line: "<path> --version
  exited 127: <its last line>", "… was killed by signal 9", "… did not answer
  within 30 s" (the process group is killed), "… could not be run: …",
  "… printed nothing". `env` is the whole environment (None: the agent's).
  Output past 64 KiB is not kept.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
from collections.abc import Mapping
from pathlib import Path

import attrs

from llmgw.errors import LlmgwError
from llmgw.host.run import run_bounded

log = logging.getLogger("llmgw.agent.ldd")


class ProofError(LlmgwError):
    """An engine's binary did not prove it runs; one line naming the binary and what it did."""


@attrs.frozen
class LibraryProblem:
    library: str  # "libgomp.so.1"
    message: str  # "needs libgomp.so.1 (install libgomp1)"
    packages: Mapping[
        str, str
    ]  # family -> the package that provides it; empty when none would fix it


_CUDA = "from the CUDA runtime"

# soname (or a prefix ending in ".so", for any version) -> family -> package.
# Debian names are bookworm's (Ubuntu 24.04 renamed a few with a t64 suffix).
_PACKAGES: Mapping[str, Mapping[str, str]] = {
    "libgomp.so.1": {"debian": "libgomp1", "rhel": "libgomp", "suse": "libgomp1"},
    "libstdc++.so.6": {"debian": "libstdc++6", "rhel": "libstdc++", "suse": "libstdc++6"},
    "libgcc_s.so.1": {"debian": "libgcc-s1", "rhel": "libgcc", "suse": "libgcc_s1"},
    "libatomic.so.1": {"debian": "libatomic1", "rhel": "libatomic", "suse": "libatomic1"},
    "libssl.so.3": {"debian": "libssl3", "rhel": "openssl-libs", "suse": "libopenssl3"},
    "libcrypto.so.3": {"debian": "libssl3", "rhel": "openssl-libs", "suse": "libopenssl3"},
    "libcurl.so.4": {"debian": "libcurl4", "rhel": "libcurl", "suse": "libcurl4"},
    "libnuma.so.1": {"debian": "libnuma1", "rhel": "numactl-libs", "suse": "libnuma1"},
    "libvulkan.so.1": {"debian": "libvulkan1", "rhel": "vulkan-loader", "suse": "libvulkan1"},
}
_CUDA_PREFIXES = (
    "libcudart.so",
    "libcublas.so",
    "libcublasLt.so",
    "libcuda.so",
    "libnccl.so",
    "libcudnn.so",
)

_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$")
_VERSION = re.compile(r"(?:^|:\s)([^\s:]+): version `([^']+)' not found")


def _not_found(library: str, family: str | None) -> LibraryProblem:
    if library.startswith(_CUDA_PREFIXES):
        return LibraryProblem(library, f"needs {library} ({_CUDA})", {})
    packages = _PACKAGES.get(library, {})
    if not packages:
        return LibraryProblem(library, f"needs {library}", {})
    if family is not None and family in packages:
        return LibraryProblem(library, f"needs {library} (install {packages[family]})", packages)
    names = ", ".join(f"{fam}: {pkg}" for fam, pkg in packages.items())
    return LibraryProblem(library, f"needs {library} (packages: {names})", packages)


def _version_key(version: str) -> tuple[str, tuple[int, ...]]:
    prefix, _, number = version.rpartition("_")
    if not prefix:
        return version, ()
    try:
        return prefix, tuple(int(p) for p in number.split("."))
    except ValueError:
        return version, ()


def problems(ldd_output: str, family: str | None = None) -> list[LibraryProblem]:
    """What ldd's output says is missing or too old, each library once, in the order first named."""
    order: list[str] = []
    missing: set[str] = set()
    versions: dict[str, list[str]] = {}
    for line in ldd_output.splitlines():
        if m := _NOT_FOUND.match(line):
            library = m.group(1)
            if library not in missing and library not in versions:
                order.append(library)
            missing.add(library)
            continue
        for m in _VERSION.finditer(line):
            library = os.path.basename(m.group(1))
            if library not in missing and library not in versions:
                order.append(library)
            versions.setdefault(library, []).append(m.group(2))
    out: list[LibraryProblem] = []
    for library in order:
        if library in missing:
            out.append(_not_found(library, family))
            continue
        asked = versions[library]
        first = _version_key(asked[0])[0]
        same = [v for v in asked if _version_key(v)[0] == first]
        needed = max(same, key=lambda v: _version_key(v)[1])
        out.append(LibraryProblem(library, f"{library} is too old (needs {needed})", {}))
    return out


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


async def check(
    binary: Path, *, family: str | None = None, timeout_s: float = 10.0
) -> list[LibraryProblem] | None:
    """`problems` of `ldd <binary>`; None when that cannot be known (see the module)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        log.info("no ldd on PATH: the libraries of %s are not checked", binary)
        return None
    try:
        status, output = await run_bounded([ldd, str(binary)], timeout_s)
    except OSError as exc:
        log.warning("ldd %s could not be run: %s", binary, exc)
        return None
    if status is None:
        log.warning("ldd %s did not answer within %s s", binary, _seconds(timeout_s))
        return None
    found = problems(output, family)
    if status != 0 and not found:
        last = (_lines(output) or ["no output"])[-1]
        log.warning("ldd %s exited %s: %s", binary, status, last)
        return None
    return found


def _seconds(timeout_s: float) -> str:
    return str(int(timeout_s)) if math.isclose(timeout_s, round(timeout_s)) else f"{timeout_s:g}"


async def prove_version(
    binary: Path, *, timeout_s: float = 30.0, env: Mapping[str, str] | None = None
) -> str:
    """The first non-empty line of `<binary> --version` once it exits 0 in time; else ProofError."""
    what = f"{binary} --version"
    try:
        status, output = await run_bounded([str(binary), "--version"], timeout_s, env=env)
    except OSError as exc:
        raise ProofError(f"{what} could not be run: {exc.strerror or exc}") from None
    lines = _lines(output)
    if status is None:
        raise ProofError(f"{what} did not answer within {_seconds(timeout_s)} s")
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "?"
        raise ProofError(f"{what} was killed by signal {-status} ({name})")
    if status != 0:
        last = lines[-1] if lines else "no output"
        raise ProofError(f"{what} exited {status}: {last}")
    if not lines:
        raise ProofError(f"{what} exited 0 but printed nothing")
    return lines[0]
