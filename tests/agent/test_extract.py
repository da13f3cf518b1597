"""The engine-archive extractor against hostile archives built here with tarfile.

Each hostile archive is refused with nothing written outside the install
directory (a sentinel directory beside it is compared before and after) and
nothing left of what the call created; a normal archive is unpacked exactly.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent._extract import ExtractError, _link_stays_inside, extract_tar


def _info(
    name: str, kind: bytes = tarfile.REGTYPE, *, mode: int = 0o644, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.linkname = link
    return info


Member = tuple[tarfile.TarInfo, bytes | None]


def file(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    return _info(name, mode=mode, size=len(data)), data


def directory(name: str, mode: int = 0o755) -> Member:
    return _info(name, tarfile.DIRTYPE, mode=mode), None


def symlink(name: str, target: str) -> Member:
    return _info(name, tarfile.SYMTYPE, mode=0o777, link=target), None


def hardlink(name: str, target: str) -> Member:
    return _info(name, tarfile.LNKTYPE, link=target), None


def write_tar(path: Path, members: Iterable[Member], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str | None]]:
    """Every entry under root: kind and contents (files) or target (links)."""
    out: dict[str, tuple[str, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", None)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


@pytest.fixture
def place(tmp_path: Path) -> tuple[Path, Path]:
    """(dest, outside): an install directory and a sentinel directory beside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"sentinel\n")
    return tmp_path / "install", outside


def refused(archive: Path, dest: Path, outside: Path, needle: str, **bounds: int) -> str:
    before = snapshot(outside)
    existed = dest.exists()
    before_dest = snapshot(dest) if existed else None
    with pytest.raises(ExtractError) as info:
        extract_tar(archive, dest, **bounds)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert snapshot(outside) == before
    if existed:
        assert snapshot(dest) == before_dest  # only what this call made is gone
    else:
        assert not dest.exists()
    return message


def test_dot_dot_member_is_refused(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    archive = write_tar(
        tmp_path / "a.tar.gz",
        [directory("bin/"), file("bin/ok", b"ok"), file("../outside/evil", b"pwn")],
    )
    message = refused(archive, dest, outside, "has a '..' component")
    assert "'../outside/evil'" in message and "a.tar.gz" in message


def test_absolute_member_is_refused(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    archive = write_tar(tmp_path / "a.tar", [file(f"{outside}/evil", b"pwn")], mode="w")
    refused(archive, dest, outside, "is an absolute path")


@pytest.mark.parametrize(
    "target", ["/etc", "OUTSIDE", "../outside", "bin/../../outside", "a/../.."]
)
def test_symlink_out_then_write_through_it_is_refused(
    tmp_path: Path, place: tuple[Path, Path], target: str
) -> None:
    dest, outside = place
    target = target.replace("OUTSIDE", str(outside))
    archive = write_tar(
        tmp_path / "a.tar.xz",
        [directory("bin/"), file("bin/x", b"1"), symlink("esc", target), file("esc/evil", b"pwn")],
        mode="w:xz",
    )
    refused(archive, dest, outside, "which leaves the install directory")


def test_member_through_an_inside_symlink_is_refused(
    tmp_path: Path, place: tuple[Path, Path]
) -> None:
    dest, outside = place
    archive = write_tar(
        tmp_path / "a.tar",
        [directory("real/"), symlink("via", "real"), file("via/f", b"1")],
        mode="w",
    )
    refused(archive, dest, outside, "goes through the symlink 'via'")


def test_symlink_already_in_dest_is_never_followed(
    tmp_path: Path, place: tuple[Path, Path]
) -> None:
    dest, outside = place
    dest.mkdir()
    (dest / "lib").symlink_to(outside)
    archive = write_tar(tmp_path / "a.tar.bz2", [file("lib/evil", b"pwn")], mode="w:bz2")
    refused(archive, dest, outside, "goes through the symlink 'lib'")
    assert (dest / "lib").is_symlink()  # not ours: left as it was


def test_two_archives_the_first_plants_a_symlink_the_second_writes_through_it(
    tmp_path: Path, place: tuple[Path, Path]
) -> None:
    dest, outside = place
    first = write_tar(tmp_path / "1.tar.gz", [directory("sub/"), symlink("link", "sub")])
    assert extract_tar(first, dest) == 0
    second = write_tar(tmp_path / "2.tar.gz", [file("ok", b"ok"), file("link/evil", b"pwn")])
    refused(second, dest, outside, "goes through the symlink 'link'")
    assert sorted(os.listdir(dest)) == ["link", "sub"] and os.listdir(dest / "sub") == []


def test_hardlink_to_a_file_outside_is_refused(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    for link in (str(outside / "keep.txt"), "../outside/keep.txt", "never-extracted"):
        archive = write_tar(tmp_path / "a.tar.gz", [file("a", b"1"), hardlink("h", link)])
        refused(archive, dest, outside, "is a hardlink to")
    assert (outside / "keep.txt").stat().st_nlink == 1


def test_hardlink_to_a_directory_or_symlink_in_the_archive_is_refused(
    tmp_path: Path, place: tuple[Path, Path]
) -> None:
    dest, outside = place
    archive = write_tar(
        tmp_path / "a.tar", [directory("d/"), symlink("s", "d"), hardlink("h", "s")], mode="w"
    )
    refused(archive, dest, outside, "which is not a file this archive extracted")


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        (tarfile.CHRTYPE, "is a device node"),
        (tarfile.BLKTYPE, "is a device node"),
        (tarfile.FIFOTYPE, "is a FIFO"),
    ],
)
def test_device_nodes_and_fifos_are_refused(
    tmp_path: Path, place: tuple[Path, Path], kind: bytes, needle: str
) -> None:
    dest, outside = place
    info = _info("dev/null", kind, mode=0o666)
    info.devmajor, info.devminor = 1, 3
    archive = write_tar(tmp_path / "a.tar.gz", [file("bin", b"1"), (info, None)])
    refused(archive, dest, outside, needle)


@pytest.mark.parametrize(
    ("mode", "bit"),
    [(0o4755, "setuid"), (0o2755, "setgid"), (0o1777, "sticky"), (0o6755, "setuid/setgid")],
)
def test_setuid_setgid_sticky_are_refused_not_stripped(
    tmp_path: Path, place: tuple[Path, Path], mode: int, bit: str
) -> None:
    dest, outside = place
    archive = write_tar(
        tmp_path / "a.tar.gz", [file("bin/ok", b"1"), file("bin/su", b"#!/bin/sh\n", mode=mode)]
    )
    message = refused(archive, dest, outside, f"has the {bit} bit")
    assert f"mode {mode:o}" in message


def test_member_count_bomb_stops_at_the_bound(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    archive = write_tar(tmp_path / "a.tar.gz", [file(f"f{i}", b"") for i in range(200)])
    message = refused(archive, dest, outside, "more than 50 members", max_members=50)
    assert "'f50'" in message  # the 51st member, not the last one


def test_size_bomb_is_refused_before_its_bytes_are_written(
    tmp_path: Path, place: tuple[Path, Path]
) -> None:
    dest, outside = place
    big = 64 << 20
    archive = tmp_path / "bomb.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.addfile(_info("small", size=1000), io.BytesIO(b"a" * 1000))
        tf.addfile(_info("zeros", size=big), io.BytesIO(bytes(big)))
    assert archive.stat().st_size < big // 100  # it compresses small
    message = refused(archive, dest, outside, f"is {big} bytes, past the bound", max_bytes=1 << 20)
    assert "'zeros'" in message


def test_size_bound_counts_all_members(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    archive = write_tar(tmp_path / "a.tar.gz", [file(f"f{i}", bytes(400)) for i in range(10)])
    message = refused(archive, dest, outside, "past the bound", max_bytes=1000)
    assert "'f2'" in message and "(200 bytes were left)" in message


def test_existing_file_is_not_overwritten(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    dest.mkdir()
    (dest / "bin").mkdir()
    (dest / "bin" / "x").write_bytes(b"theirs")
    archive = write_tar(
        tmp_path / "a.tar.gz", [directory("bin/"), file("bin/new", b"1"), file("bin/x", b"ours")]
    )
    refused(archive, dest, outside, "already exists")
    assert (dest / "bin" / "x").read_bytes() == b"theirs" and not (dest / "bin" / "new").exists()


def test_not_a_tar_is_one_line(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"\x1f\x8b" + os.urandom(200))
    refused(junk, dest, outside, "junk.tar.gz: not a readable tar archive")


@pytest.mark.parametrize("mode", ["w:gz", "w:xz", "w:bz2", "w"])
def test_a_truncated_archive_removes_what_it_wrote(
    tmp_path: Path, place: tuple[Path, Path], mode: str
) -> None:
    dest, outside = place
    whole = write_tar(
        tmp_path / "whole",
        [file("bin/first", b"1" * 5000), file("bin/second", os.urandom(300_000))],
        mode,
    )
    cut = tmp_path / "cut"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    refused(cut, dest / "deeper", outside, "cut: not a readable tar archive")
    assert os.listdir(dest) == []  # the parent it made stays; all it unpacked is gone


def test_a_normal_archive_is_extracted_exactly(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    binary = b"\x7fELF" + bytes(range(256)) * 40
    archive = write_tar(
        tmp_path / "llama.tar.gz",
        [
            directory("./"),
            directory("build/", mode=0o700),
            directory("build/bin/"),
            file("build/bin/llama-server", binary, mode=0o775),
            file("build/bin/libggml.so.0.0.1", b"lib", mode=0o600),
            symlink("build/bin/libggml.so.0", "libggml.so.0.0.1"),
            symlink("build/bin/libggml.so", "./libggml.so.0"),
            symlink("build/lib", "bin"),
            symlink("build/bin/up", "../bin/libggml.so"),
            hardlink("build/bin/llama-cli", "build/bin/llama-server"),
            file("LICENSE", b"MIT\n", mode=0o664),
            file("implicit/parent/f", b"deep"),
        ],
    )
    written = extract_tar(archive, dest)
    assert written == len(binary) + 3 + 4 + 4
    b = dest / "build" / "bin"
    assert (b / "llama-server").read_bytes() == binary
    assert stat.S_IMODE((b / "llama-server").stat().st_mode) == 0o755
    assert stat.S_IMODE((b / "libggml.so.0.0.1").stat().st_mode) == 0o644
    assert stat.S_IMODE((dest / "LICENSE").stat().st_mode) == 0o644
    assert stat.S_IMODE((dest / "build").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "implicit" / "parent").stat().st_mode) == 0o755
    assert os.readlink(b / "libggml.so") == "./libggml.so.0"
    assert (b / "libggml.so").read_bytes() == b"lib"
    assert (dest / "build" / "lib" / "libggml.so.0").read_bytes() == b"lib"
    assert (b / "up").read_bytes() == b"lib"
    assert os.stat(b / "llama-cli").st_ino == os.stat(b / "llama-server").st_ino
    assert (dest / "implicit" / "parent" / "f").read_bytes() == b"deep"
    assert snapshot(outside) == {"keep.txt": ("file", b"sentinel\n")}
    # A second archive into the same directory adds beside what is there.
    more = write_tar(
        tmp_path / "more.tar", [directory("build/"), file("build/extra", b"e")], mode="w"
    )
    assert extract_tar(more, dest) == 1
    assert (dest / "build" / "extra").read_bytes() == b"e" and (b / "llama-server").exists()


def test_a_failure_keeps_what_a_first_archive_made(
    tmp_path: Path, place: tuple[Path, Path]
) -> None:
    dest, outside = place
    assert extract_tar(write_tar(tmp_path / "1.tar", [file("bin/a", b"a")], mode="w"), dest) == 1
    second = write_tar(
        tmp_path / "2.tar",
        [file("bin/b", b"b"), directory("new/"), file("new/c", b"c"), file("/abs", b"")],
        "w",
    )
    refused(second, dest, outside, "is an absolute path")
    assert snapshot(dest) == {"bin": ("dir", None), "bin/a": ("file", b"a")}


def test_dest_that_is_a_symlink_is_refused(tmp_path: Path, place: tuple[Path, Path]) -> None:
    dest, outside = place
    dest.symlink_to(outside)
    with pytest.raises(ExtractError, match="is not a directory"):
        extract_tar(write_tar(tmp_path / "a.tar", [file("f", b"1")], mode="w"), dest)
    assert snapshot(outside) == {"keep.txt": ("file", b"sentinel\n")}


_name = st.sampled_from(["a", "b", "..", ".", "c"])


@given(
    where=st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=4).map(tuple),
    target=st.lists(_name, min_size=1, max_size=6).map("/".join),
)
def test_an_accepted_relative_link_resolves_inside(where: tuple[str, ...], target: str) -> None:
    # Resolved lexically from the link's directory (real directories all the way),
    # an accepted target never climbs above the root.
    if not _link_stays_inside(where, target, ("d",)):
        return
    depth = len(where) - 1
    for part in target.split("/"):
        if part == "..":
            depth -= 1
        elif part not in ("", "."):
            depth += 1
        assert depth >= 0
