"""`llmgw ctl release publish DIST --mirror DIR`: put a `make dist` release in the mirror.

The control plane serves `<mirror.dir>/llmgw/` to nodes (bootstrap.py installs
from it, checked against its SHA256SUMS). Publishing checks DIST first, every
file against SHA256SUMS and nothing beside them, so a release that would be
refused on every node is refused here, once, on the operator's machine. The copy
is made in a dot-named directory beside `llmgw/` (the mirror serves no
dot-names) and renamed into place: a node sees the old release or the new one,
never half of one (between the two renames there is a moment, milliseconds,
with no `llmgw/`: a bootstrap then is told 404 and is run again).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import attrs

from llmgw import _bootstrap
from llmgw.errors import LlmgwError

RELEASE_DIR = "llmgw"
SUMS = "SHA256SUMS"


class ReleaseError(LlmgwError):
    """A release directory that does not verify, or a mirror it cannot be copied into."""


@attrs.frozen
class Published:
    version: str
    files: int
    bytes: int
    where: Path
    unchanged: bool


def verify(dist: Path) -> tuple[str, dict[str, str]]:
    """The release's version and sums, once every file matches and none is unlisted."""
    sums_file = dist / SUMS
    if not sums_file.is_file():
        raise ReleaseError(f"{sums_file}: not found; is {dist} the output of `make dist`?")
    # The same reading of SHA256SUMS as the node's bootstrap: what passes here passes there.
    try:
        sums = _bootstrap.parse_sums(sums_file.read_text(), str(sums_file))
        version = _bootstrap.release_version(sums, str(sums_file))
    except _bootstrap.Refused as exc:
        raise ReleaseError(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise ReleaseError(f"{sums_file} is not UTF-8 text") from exc
    if "bootstrap.py" not in sums:
        raise ReleaseError(f"{sums_file} does not list bootstrap.py; run `make dist` again")
    present = {
        p.relative_to(dist).as_posix() for p in dist.rglob("*") if p.is_file() or p.is_symlink()
    } - {SUMS}
    unlisted = sorted(present - set(sums))
    if unlisted:
        raise ReleaseError(f"{dist}/{unlisted[0]}: not in {SUMS}; a release holds only its files")
    for path, want in sums.items():
        file = dist / path
        if file.is_symlink() or not file.is_file():
            raise ReleaseError(f"{file}: listed in {SUMS} but not a regular file here")
        got = _bootstrap.file_sha256(file)
        if got != want:
            raise ReleaseError(f"{file}: sha256 mismatch (expected {want}, got {got})")
    return version, sums


def publish(dist: Path, mirror: Path) -> Published:
    """Verify `dist`, then make it `<mirror>/llmgw/` in one rename."""
    version, sums = verify(dist)
    if not mirror.is_dir():
        raise ReleaseError(f"the mirror {mirror} is not a directory (server.yaml's mirror.dir)")
    target = mirror / RELEASE_DIR
    size = sum((dist / p).stat().st_size for p in sums)
    if (target / SUMS).is_file() and (target / SUMS).read_bytes() == (dist / SUMS).read_bytes():
        try:
            verify(target)
        except ReleaseError:
            pass  # the published copy was damaged: publish again
        else:
            return Published(version, len(sums), size, target, unchanged=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{RELEASE_DIR}.new.", dir=mirror))
    old = None
    try:
        for path in [*sums, SUMS]:
            dest = staging / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dist / path, dest)
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would keep the mirror's reader out
        if target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{RELEASE_DIR}.old.", dir=mirror))
            os.rename(target, old / RELEASE_DIR)
        os.rename(staging, target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and not target.exists():
            os.rename(old / RELEASE_DIR, target)
        raise ReleaseError(f"cannot publish into {target}: {exc}") from exc
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return Published(version, len(sums), size, target, unchanged=False)


# --- the command ---------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `release publish` to the `llmgw ctl` sub-commands."""
    release = subparsers.add_parser(
        "release",
        help="put a `make dist` release in the mirror, for nodes to install from",
        description="Nodes install llmgw from their control plane's mirror, from "
        "<mirror.dir>/llmgw/, checked against its SHA256SUMS (bootstrap.py).",
    )
    sub = release.add_subparsers(dest="release_command", required=True, metavar="{publish}")
    p = sub.add_parser(
        "publish",
        help="verify DIST against its SHA256SUMS, then make it <mirror>/llmgw/ in one rename",
    )
    p.add_argument("dist", type=Path, metavar="DIST", help="the output of `make dist`")
    p.add_argument(
        "--mirror", type=Path, required=True, metavar="DIR", help="server.yaml's mirror.dir"
    )
    p.set_defaults(func=_cmd_publish)


def _cmd_publish(args: argparse.Namespace) -> int:
    done = publish(args.dist, args.mirror)
    what = "unchanged" if done.unchanged else "published"
    print(
        f"llmgw {done.version}: {what} in {done.where} "
        f"({done.files} files, {done.bytes / 1e6:.1f} MB); nodes fetch it as mirror:/llmgw/"
    )
    return 0
