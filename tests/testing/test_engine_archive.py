from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from pathlib import Path

from helpers import FIXTURES, llama_server_binary

from llmgw.testing import engine_archive


def test_local_libraries_are_those_resolved_inside_the_binary_dir() -> None:
    # A recorded ldd over llama.cpp's build/bin: libggml-base resolves there, libgomp
    # is not found, the rest are the system's.
    text = (FIXTURES / "ldd-libgomp-not-found-llamacpp.txt").read_text()
    assert engine_archive.local_libraries(text, Path("/root/build/bin")) == {
        "libggml-base.so": Path("/root/build/bin/libggml-base.so")
    }
    assert engine_archive.local_libraries(text, Path("/lib/x86_64-linux-gnu")).keys() == {
        "libstdc++.so.6",
        "libm.so.6",
        "libgcc_s.so.1",
        "libc.so.6",
    }


def test_the_packed_llama_server_runs_from_where_it_is_unpacked(tmp_path: Path) -> None:
    binary = Path(llama_server_binary())
    packed = engine_archive.pack(tmp_path / "out", "b1234", "cpu-x86_64", binary=binary)
    assert packed.path == tmp_path / "out" / "llama-b1234-bin-cpu-x86_64.tar.gz"
    assert packed.sha256 == hashlib.sha256(packed.path.read_bytes()).hexdigest()
    assert packed.size == packed.path.stat().st_size
    path, sha = engine_archive.pack_llama_server(tmp_path / "out", "b1234", binary=binary)
    assert (path, sha) == (packed.path, packed.sha256)  # the same bytes again (mtime 0)

    with tarfile.open(packed.path) as tar:
        names = tar.getnames()
        links = {m.name: m.linkname for m in tar.getmembers() if m.issym()}
        assert not [m for m in tar.getmembers() if m.islnk() or m.isdev() or m.mode & 0o6000]
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert names[0] == "llama-b1234" and all(n.startswith("llama-b1234/") for n in names[1:])
    assert "llama-b1234/llama-server" in names
    # Soname links point beside themselves (no "/"), as llama.cpp's build/bin has them.
    assert links and all("/" not in target for target in links.values()), links
    assert links["llama-b1234/libllama.so.0"].startswith("libllama.so.0.")

    # Only libraries from the binary's own directory went in, each the loader asks for.
    local = engine_archive.local_libraries(
        subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout,
        binary.parent,
    )
    assert {"libllama.so.0", "libggml-base.so.0"} <= local.keys() <= set(packed.members)
    assert not [m for m in packed.members if m.startswith(("libstdc++", "libc.", "libgomp"))]

    # Unpacked elsewhere, with no LD_LIBRARY_PATH, it finds every one of them there
    # ($ORIGIN in its RUNPATH), and runs.
    home = tmp_path / "unpacked" / "llama-b1234"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    ldd = subprocess.run(
        ["ldd", str(home / "llama-server")], capture_output=True, text=True, env=env
    ).stdout
    assert "not found" not in ldd, ldd
    assert engine_archive.local_libraries(ldd, home).keys() == local.keys()
    assert str(binary.parent) not in ldd
    assert packed.runpath_origin is True
    done = subprocess.run(
        [str(home / "llama-server"), "--version"], capture_output=True, text=True, env=env,
        timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "version:" in done.stdout + done.stderr
