"""ldd's output in plain words (the recorded fixtures), and the --version proof
against real processes: one that answers, one that fails, one that hangs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio
from helpers import FIXTURES
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent._ldd import LibraryProblem, ProofError, check, problems, prove_version

LIBGOMP = (FIXTURES / "ldd-libgomp-not-found-llamacpp.txt").read_text()
GLIBCXX = (FIXTURES / "ldd-loader-glibcxx-3.4.30-glibc-2.34-not-found.txt").read_text()


def test_libgomp_not_found_is_said_once_with_the_family_package() -> None:
    assert LIBGOMP.count("libgomp.so.1 => not found") == 2
    assert problems(LIBGOMP, "debian") == [
        LibraryProblem(
            "libgomp.so.1",
            "needs libgomp.so.1 (install libgomp1)",
            {"debian": "libgomp1", "rhel": "libgomp", "suse": "libgomp1"},
        )
    ]
    assert [p.message for p in problems(LIBGOMP, "rhel")] == [
        "needs libgomp.so.1 (install libgomp)"
    ]
    assert [p.message for p in problems(LIBGOMP)] == [
        "needs libgomp.so.1 (packages: debian: libgomp1, rhel: libgomp, suse: libgomp1)"
    ]


def test_glibcxx_too_old_is_said_once_per_library() -> None:
    assert [(p.library, p.message, dict(p.packages)) for p in problems(GLIBCXX, "debian")] == [
        ("libstdc++.so.6", "libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)", {}),
        ("libc.so.6", "libc.so.6 is too old (needs GLIBC_2.34)", {}),
    ]


def test_plain_ldd_lines_and_cuda_and_unknown_libraries() -> None:
    out = (
        "\tlinux-vdso.so.1 (0x00007ffd)\n"
        "\tlibcudart.so.12 => not found\n"
        "\tlibcublas.so.12 => not found\n"
        "\tlibfoo.so.7 => not found\n"
        "\tlibssl.so.3 => not found\n"
        "/lib64/libc.so.6: version `GLIBC_2.38' not found (required by ./llama-server)\n"
        "\tlibcudart.so.12 => not found\n"
    )
    assert [p.message for p in problems(out, "suse")] == [
        "needs libcudart.so.12 (from the CUDA runtime)",
        "needs libcublas.so.12 (from the CUDA runtime)",
        "needs libfoo.so.7",
        "needs libssl.so.3 (install libopenssl3)",
        "libc.so.6 is too old (needs GLIBC_2.38)",
    ]


def test_a_healthy_ldd_has_no_problems() -> None:
    healthy = "\n".join(line for line in LIBGOMP.splitlines() if "not found" not in line)
    assert problems(healthy, "debian") == []
    assert problems("\tstatically linked\n") == []


@given(st.text())
def test_problems_never_raises_and_says_each_library_once(text: str) -> None:
    found = problems(text, "debian")
    assert len({p.library for p in found}) == len(found)


@given(st.lists(st.sampled_from(LIBGOMP.splitlines() + GLIBCXX.splitlines()), max_size=30))
def test_any_mix_of_recorded_lines_says_each_once(lines: list[str]) -> None:
    found = problems("\n".join(lines), "debian")
    said = {
        "libgomp.so.1": "libgomp.so.1 => not found",
        "libstdc++.so.6": "libstdc++.so.6: version `",
        "libc.so.6": "libc.so.6: version `",
    }
    expected = {lib for lib, words in said.items() if any(words in line for line in lines)}
    assert sorted(p.library for p in found) == sorted(expected)


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


async def test_a_real_binary_passes(tmp_path: Path) -> None:
    true = shutil.which("true")
    assert true is not None
    ok = script(
        tmp_path,
        "llama-server",
        f'{true} || exit 9\necho\necho "version: 6123 (abc)" >&2\necho built\n',
    )
    assert await prove_version(ok) == "version: 6123 (abc)"
    assert await check(Path(true), family="debian") == []


async def test_version_that_exits_3_is_refused_with_its_last_line(tmp_path: Path) -> None:
    bad = script(tmp_path, "llama-server", 'echo "loading"\necho "error: no backend" >&2\nexit 3\n')
    with pytest.raises(ProofError) as info:
        await prove_version(bad)
    assert str(info.value) == f"{bad} --version exited 3: error: no backend"


async def test_version_not_run_and_killed_and_silent(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ProofError, match=r"nope --version could not be run: No such file"):
        await prove_version(missing)
    killed = script(tmp_path, "k", "kill -9 $$\n")
    with pytest.raises(ProofError, match=r"k --version was killed by signal 9 \(SIGKILL\)$"):
        await prove_version(killed)
    silent = script(tmp_path, "s", "exit 0\n")
    with pytest.raises(ProofError, match=r"s --version exited 0 but printed nothing$"):
        await prove_version(silent)


async def test_version_that_hangs_is_killed_at_the_bound(tmp_path: Path) -> None:
    pid_file = tmp_path / "sleep.pid"
    hang = script(
        tmp_path, "llama-server", f"echo starting\nsleep 30 &\necho $! > {pid_file}\nwait\n"
    )
    start = trio.current_time()
    with pytest.raises(ProofError) as info:
        await prove_version(hang, timeout_s=0.5)
    took = trio.current_time() - start
    assert str(info.value) == f"{hang} --version did not answer within 0.5 s"
    assert 0.5 <= took < 5
    # The whole process group went, the script's child included.
    sleeper = int(pid_file.read_text())
    with trio.fail_after(5):
        while _alive(sleeper):
            await trio.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_env_is_the_whole_environment(tmp_path: Path) -> None:
    show = script(tmp_path, "e", 'echo "[$LLMGW_PROBE][$HOME]"\n')
    assert await prove_version(show, env={"LLMGW_PROBE": "yes", "PATH": os.defpath}) == "[yes][]"


async def test_check_reads_a_fake_ldd_and_none_without_ldd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fixture = FIXTURES / "ldd-libgomp-not-found-llamacpp.txt"
    script(bin_dir, "ldd", f'{shutil.which("cat")} "{fixture}"\n')
    monkeypatch.setenv("PATH", str(bin_dir))
    found = await check(tmp_path / "llama-server", family="debian")
    assert found is not None and [p.message for p in found] == [
        "needs libgomp.so.1 (install libgomp1)"
    ]
    # ldd failing without a line we read is unknown, not fine.
    script(bin_dir, "ldd", "echo 'ldd: ./x: No such file or directory' >&2\nexit 1\n")
    assert await check(tmp_path / "x") is None
    script(bin_dir, "ldd", f"{shutil.which('sleep')} 30\n")
    assert await check(tmp_path / "x", timeout_s=0.3) is None
    (bin_dir / "ldd").unlink()
    assert await check(tmp_path / "x") is None


async def test_the_real_llama_server_unpacked_is_checked_and_proven(tmp_path: Path) -> None:
    # The three building blocks together on the real thing: pack llama-server as
    # llama.cpp's releases are shaped, unpack it with the extractor, then ldd and
    # --version from where it landed (its libraries found through RUNPATH $ORIGIN).
    from helpers import llama_server_binary

    from llmgw.agent._extract import extract_tar
    from llmgw.testing.engine_archive import pack

    binary = Path(llama_server_binary())
    packed = pack(tmp_path / "mirror", "b0000", binary=binary)
    dest = tmp_path / "engines" / "llama-server" / "b0000.partial"
    written = await trio.to_thread.run_sync(extract_tar, packed.path, dest)
    unpacked = dest / packed.top / "llama-server"
    assert written >= unpacked.stat().st_size > 0
    assert await check(unpacked, family="debian") == []
    line = await prove_version(unpacked, timeout_s=30)
    assert line.startswith("version: "), line
