"""The engine installer: real archives from the real mirror on loopback, the real
llama-server proven by --version, real virtualenvs filled by real pip; fake `ldd` and
`apt-get` on PATH only where the node's libraries are the point."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio
from helpers import llama_server_binary
from hypothesis import given
from hypothesis import strategies as st

from llmgw import config, model
from llmgw.agent._engines import MARKER, Installer, Placement, pip_failure, size_words, variant
from llmgw.agent._fetch import Fetcher
from llmgw.agent._node import Node
from llmgw.agent._servant import AgentServant
from llmgw.agent._sources import ControlPlane
from llmgw.agent._supervisor import Supervisor
from llmgw.agent.discovery import RunResult, probe_engines
from llmgw.cp._weights._mirror import serve_mirror
from llmgw.errors import StaleEpoch
from llmgw.host.packages import PackageInstaller

DATA = Path(__file__).resolve().parent.parent / "data"
CPU = Placement(arch="x86_64", nvidia=False, family="debian")


class Watch:
    """on_change, awaited: wait for a state, not a sleep."""

    def __init__(self) -> None:
        self.changes = 0
        self._event = trio.Event()

    def __call__(self) -> None:
        self.changes += 1
        self._event.set()

    async def until(self, what: str, check: Callable[[], bool], timeout: float = 120) -> None:
        with trio.fail_after(timeout):
            while True:
                event = self._event = trio.Event()
                if check():
                    return
                await event.wait()


class Rig:
    """The mirror on loopback (plain HTTP), a Fetcher, an Installer."""

    def __init__(self, tmp_path: Path, nursery: trio.Nursery) -> None:
        self.tmp = tmp_path
        self.nursery = nursery
        self.mirror = tmp_path / "mirror"
        self.mirror.mkdir(parents=True)
        self.state = tmp_path / "state"
        self.watch = Watch()

    async def start(self, placement: Placement = CPU, **kw: object) -> Installer:
        port = await self.nursery.start(partial(serve_mirror, self.mirror, "127.0.0.1", 0))
        settings = model.Settings(heartbeat_interval_s=1, epoch=1, mirror_port=port)
        weights = self.tmp / "weights"
        weights.mkdir()
        self.fetcher = Fetcher(weights, read_timeout_s=10, connect_timeout_s=5, progress=self._p)
        await self.nursery.start(self.fetcher.run)
        self.installer = Installer(
            self.state,
            fetcher=self.fetcher,
            placement=lambda: placement,
            control_plane=lambda: ControlPlane("127.0.0.1", 7070, settings),
            on_change=self.watch,
            retry_initial_s=3600,  # one pass each: a test waits for its outcome
            **kw,  # type: ignore[arg-type]
        )
        await self.nursery.start(self.installer.run)
        return self.installer

    def _p(self, name: str, done: int, total: int | None) -> None:
        self.installer.progress(name, done, total)

    def put(self, name: str, data: bytes) -> str:
        (self.mirror / name).write_bytes(data)
        return hashlib.sha256(data).hexdigest()

    def status(self, name: str) -> model.EngineStatus | None:
        return next((s for s in self.installer.pending() if s.name == name), None)

    def failed(self, name: str) -> Callable[[], bool]:
        return lambda: (s := self.status(name)) is not None and s.state == "failed"

    def installed(self, name: str) -> Callable[[], bool]:
        return lambda: self.installer.path_of(name) is not None


def llama_decl(version: str, sha256: str, name: str = "llama.tar.gz") -> model.EngineDecls:
    archive = model.EngineArchive("cpu-x86_64", f"mirror:/{name}", sha256)
    decl = model.EngineDecl("llama-server", version, archives=(archive,))
    return model.EngineDecls(fingerprint=f"{version}-{sha256[:8]}", engines=(decl,))


def real_llama_archive() -> bytes:
    """The real llama-server and the shared libraries ldd says it loads from its own
    directory, under a top directory as llama.cpp's release archives have them."""
    binary = Path(llama_server_binary())
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
    libs = [
        Path(line.split("=>")[1].split("(")[0].strip())
        for line in out.stdout.splitlines()
        if "=>" in line and str(binary.parent) in line
    ]
    # libggml-cpu is loaded by libggml at run time, not linked: ldd does not name it.
    libs += sorted(binary.parent.glob("libggml-cpu.so.0"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1, dereference=True) as tf:
        tf.add(binary, arcname="llama-b0-bin/bin/llama-server")
        for lib in dict.fromkeys(libs):
            tf.add(lib, arcname=f"llama-b0-bin/bin/{lib.name}")
    return buf.getvalue()


def script_archive(body: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = f"#!/bin/sh\n{body}\n".encode()
        info = tarfile.TarInfo("build/bin/llama-server")
        info.size, info.mode = len(data), 0o755
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# --- llama-server: archives ------------------------------------------------------------------


async def test_real_llama_server_installed_proven_reported(tmp_path: Path) -> None:
    data = await trio.to_thread.run_sync(real_llama_archive)
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        sha = rig.put("llama-b0-bin-ubuntu-x64.tar.gz", data)
        installer = await rig.start()
        assert installer.found() == () and installer.pending() == ()
        installer.declare(llama_decl("b0", sha, "llama-b0-bin-ubuntu-x64.tar.gz"))
        seen: list[str] = []
        await rig.watch.until(
            "installed",
            lambda: seen.extend(s.detail for s in installer.pending()) or bool(installer.found()),
        )
        final = rig.state / "engines" / "llama-server" / "b0"
        binary = final / "llama-b0-bin" / "bin" / "llama-server"
        assert installer.found() == (model.Engine("llama-server", str(binary), "b0", "installed"),)
        assert installer.pending() == ()
        assert installer.path_of("llama-server") == str(binary)
        assert installer.path_of("vllm") is None
        marker = json.loads((final / MARKER).read_text())
        assert marker == {
            "version": "b0",
            "variant": "cpu-x86_64",
            "sha256": sha,
            "binary": "llama-b0-bin/bin/llama-server",
        }
        assert not (final.parent / "b0.partial").exists()
        assert seen[0] == "downloading llama-b0-bin-ubuntu-x64.tar.gz"
        assert "checking libraries" in seen
        # The same declaration again: nothing changes, nothing runs again.
        changes, passes = rig.watch.changes, installer.passes
        installer.declare(llama_decl("b0", sha, "llama-b0-bin-ubuntu-x64.tar.gz"))
        await trio.sleep(0.2)  # a no-op has no event to wait for
        assert (rig.watch.changes, installer.passes) == (changes, passes)
        nursery.cancel_scope.cancel()

    # A new agent finds the marker, proves it again (no download), and reports it.
    (rig.mirror / "llama-b0-bin-ubuntu-x64.tar.gz").unlink()
    async with trio.open_nursery() as nursery:
        again = Rig(tmp_path / "again", nursery)
        again.state = rig.state
        installer = await again.start()
        installer.declare(llama_decl("b0", sha, "llama-b0-bin-ubuntu-x64.tar.gz"))
        await again.watch.until("installed", again.installed("llama-server"), 60)
        assert installer.path_of("llama-server") == str(binary)
        nursery.cancel_scope.cancel()


async def test_wrong_sha256_failed_naming_both_nothing_installed(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        real = rig.put("llama.tar.gz", script_archive("echo version: 1"))
        installer = await rig.start()
        wrong = "0" * 64
        installer.declare(llama_decl("b1", wrong))
        await rig.watch.until("failed", rig.failed("llama-server"))
        status = rig.status("llama-server")
        assert status is not None
        assert status.detail == f"llama.tar.gz: sha256 {real} is not the declared {wrong}"
        assert status.version == "b1"
        assert installer.found() == () and installer.path_of("llama-server") is None
        assert not (rig.state / "engines" / "llama-server" / "b1").exists()
        # The download is removed: a retry fetches it again.
        assert list((tmp_path / "weights").iterdir()) == []
        # The control plane declares nothing any more: nothing is said of llama-server.
        installer.declare(None)
        await rig.watch.until("forgotten", lambda: installer.pending() == ())
        assert installer.found() == ()
        nursery.cancel_scope.cancel()


async def test_version_that_fails_is_not_installed(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        sha = rig.put("llama.tar.gz", script_archive("echo broken >&2; exit 1"))
        installer = await rig.start(env={"PATH": "/usr/bin:/bin"})
        installer.declare(llama_decl("b2", sha))
        await rig.watch.until("failed", rig.failed("llama-server"))
        status = rig.status("llama-server")
        assert status is not None and "--version exited 1" in status.detail, status
        assert "broken" in status.detail
        assert installer.found() == ()
        # Nothing of it is left, not even the unpacked partial (before: one per version).
        assert list((rig.state / "engines" / "llama-server").iterdir()) == []
        nursery.cancel_scope.cancel()


async def test_no_archive_for_the_variant(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        installer = await rig.start(Placement(arch="aarch64", nvidia=True, family="debian"))
        installer.declare(llama_decl("b3", "0" * 64))
        await rig.watch.until("failed", rig.failed("llama-server"))
        status = rig.status("llama-server")
        assert status is not None
        assert status.detail == (
            "no llama-server archive declared for cuda12-aarch64 (declared: cpu-x86_64)"
        )
        nursery.cancel_scope.cancel()


async def test_missing_library_installed_then_recheck_fails_when_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    have = tmp_path / "libgomp-installed"
    calls = tmp_path / "apt-get.calls"
    # ldd as recorded on a node without libgomp1, until apt-get has run.
    fixture = DATA / "ldd-libgomp-not-found-llamacpp.txt"
    ldd = bin_dir / "ldd"
    ldd.write_text(
        f"#!/bin/sh\nif [ -e {have} ]; then echo '\tlibc.so.6 => /lib/libc.so.6 (0x1)';"
        f" else grep -v '^#' {fixture}; fi\n"
    )
    apt = bin_dir / "apt-get"
    apt.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        f'if [ "$(wc -l < {calls})" -gt 1 ]; then '
        "echo \"E: Package 'libgomp1' has no installation candidate\" >&2; exit 100; fi\n"
        f"touch {have}\n"
    )
    for f in (ldd, apt):
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        sha = rig.put("llama.tar.gz", script_archive("echo version: 7"))
        installer = await rig.start(recheck_s=0.2)
        installer.declare(llama_decl("b4", sha))
        seen: list[str] = []
        await rig.watch.until(
            "installed",
            lambda: (
                seen.extend(s.detail for s in installer.pending())
                or rig.installed("llama-server")()
            ),
        )
        assert calls.read_text().split("\n")[0].split() == [
            "install",
            "-y",
            "--no-install-recommends",
            "libgomp1",
        ]
        assert "installing libgomp1" in seen
        # Proven again every recheck_s: it stays installed meanwhile, nothing changes.
        changes, passes = rig.watch.changes, installer.passes
        with trio.fail_after(10):
            while installer.passes < passes + 3:
                await trio.sleep(0.05)
        assert rig.watch.changes == changes and installer.pending() == ()
        # The library goes (an upgrade removed it): the recheck finds it, apt-get cannot help.
        have.unlink()
        await rig.watch.until("failed", rig.failed("llama-server"), 30)
        status = rig.status("llama-server")
        assert status is not None and "no installation candidate" in status.detail, status
        assert installer.path_of("llama-server") is None and installer.found() == ()
        nursery.cancel_scope.cancel()


async def test_a_held_package_lock_is_reported_waiting_then_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # apt-get as recorded with dpkg's frontend lock held (tests/data), three times, then
    # it installs: the engine is reported "waiting" meanwhile, then installed.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    have = tmp_path / "libgomp-installed"
    calls = tmp_path / "apt-get.calls"
    recorded = (DATA / "apt-get-lock-frontend-held.txt").read_text()
    stderr = tmp_path / "lock.stderr"
    stderr.write_text(recorded.split("--- stderr\n", 1)[1])
    status = int(recorded.split("exit status: ", 1)[1].split("\n", 1)[0])
    fixture = DATA / "ldd-libgomp-not-found-llamacpp.txt"
    ldd = bin_dir / "ldd"
    ldd.write_text(
        f"#!/bin/sh\nif [ -e {have} ]; then echo '\tlibc.so.6 => /lib/libc.so.6 (0x1)';"
        f" else grep -v '^#' {fixture}; fi\n"
    )
    apt = bin_dir / "apt-get"
    apt.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        f'if [ "$(wc -l < {calls})" -le 3 ]; then cat {stderr} >&2; exit {status}; fi\n'
        f"touch {have}\n"
    )
    for f in (ldd, apt):
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        sha = rig.put("llama.tar.gz", script_archive("echo version: 7"))
        installer = await rig.start(
            packages=lambda fam: PackageInstaller(fam, retry_s=0.05, euid=lambda: 0)
        )
        installer.declare(llama_decl("b4", sha))
        states: list[tuple[str, str]] = []
        await rig.watch.until(
            "installed",
            lambda: (
                states.extend((s.state, s.detail) for s in installer.pending())
                or rig.installed("llama-server")()
            ),
        )
        assert ("waiting", "waiting for another apt-get to finish") in states
        assert len(calls.read_text().splitlines()) == 4  # three refusals, then the install
        assert installer.pending() == ()
        nursery.cancel_scope.cancel()


# --- vLLM: a virtualenv per version ------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(directory: Path, name: str, version: str) -> Path:
    """A real wheel: package `name` with a console script `name` that prints its version."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": (
            f"__version__ = {version!r}\n\ndef main():\n    print('{name}', __version__)\n"
        ),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: llmgw-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{dist}/entry_points.txt": f"[console_scripts]\n{name} = {name}:main\n",
    }
    path = directory / f"{name}-{version}-py3-none-any.whl"
    record = [f"{p},{_record_hash(b.encode())},{len(b.encode())}" for p, b in files.items()]
    record.append(f"{dist}/RECORD,,")
    with zipfile.ZipFile(path, "w") as zf:
        for p, body in files.items():
            zf.writestr(p, body)
        zf.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def vllm_decl(version: str, index: str | None = None) -> model.EngineDecls:
    decl = model.EngineDecl("vllm", version, requirement=f"vllm=={version}", index_url=index)
    return model.EngineDecls(fingerprint=f"vllm-{version}", engines=(decl,))


@pytest.mark.slow
async def test_vllm_venv_filled_by_pip_proven_by_import(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        # The mirror's simple index (PEP 503) of the wheels put under simple/<project>/;
        # no index_url declared: the control plane's mirror is the index.
        (rig.mirror / "simple" / "vllm").mkdir(parents=True)
        build_wheel(rig.mirror / "simple" / "vllm", "vllm", "0.0.1")
        installer = await rig.start()
        installer.declare(vllm_decl("0.0.1"))
        seen: list[str] = []
        await rig.watch.until(
            "installed",
            lambda: seen.extend(s.detail for s in installer.pending()) or rig.installed("vllm")(),
            240,
        )
        venv = rig.state / "engines" / "vllm" / "0.0.1"
        assert installer.found() == (
            model.Engine("vllm", str(venv / "bin" / "vllm"), "0.0.1", "installed"),
        )
        assert "creating a virtualenv" in seen and "pip install vllm==0.0.1" in seen
        assert json.loads((venv / MARKER).read_text())["requirement"] == "vllm==0.0.1"
        # The console script is the venv's, and runs the wheel's code.
        out = subprocess.run([str(venv / "bin" / "vllm")], capture_output=True, text=True)
        assert out.stdout.strip() == "vllm 0.0.1"
        # A version the index does not have: pip's words, in one line.
        installer.declare(vllm_decl("0.0.2"))
        await rig.watch.until("failed", rig.failed("vllm"), 240)
        status = rig.status("vllm")
        assert status is not None
        assert status.detail == "no matching distribution for vllm==0.0.2"
        assert installer.path_of("vllm") is None
        nursery.cancel_scope.cancel()


# --- nothing from PATH --------------------------------------------------------------------------


def test_binary_on_path_is_not_an_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("llama-server", "vllm"):
        (bin_dir / name).write_text("#!/bin/sh\necho 1\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def runner(argv: list[str], timeout: float) -> RunResult:
        raise AssertionError(f"nothing is run: {argv}")

    assert probe_engines(runner).found == ()
    # Named in agent.yaml on purpose: configured, the operator's word, no version.
    configured = probe_engines(runner, engine_paths={"llama-server": str(bin_dir / "llama-server")})
    assert configured.found == (
        model.Engine("llama-server", str(bin_dir / "llama-server"), None, "configured"),
    )


# --- pure words -------------------------------------------------------------------------------


def test_variant_and_words() -> None:
    assert variant(Placement("x86_64", False, None)) == "cpu-x86_64"
    assert variant(Placement("aarch64", True, "rhel")) == "cuda12-aarch64"
    assert size_words(6_500_000, 16_000_000) == "16 MB, 40 %"
    assert size_words(3_200_000, None) == "3.2 MB so far"
    out = (
        "Looking in indexes: http://x/simple/\n"
        "ERROR: Could not find a version that satisfies the requirement vllm==9 "
        "(from versions: 0.0.1)\nERROR: No matching distribution found for vllm==9\n"
    )
    assert pip_failure(out, "vllm==9") == "no matching distribution for vllm==9"
    assert pip_failure("ERROR: boom\n", "vllm==9") == "pip install vllm==9: boom"


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 40))
def test_size_words_percent_bounded(done: int, total: int) -> None:
    words = size_words(done, total)
    pct = int(words.rsplit(", ", 1)[1].removesuffix(" %"))
    assert 0 <= pct <= 100 and "\n" not in words
    assert size_words(done, None).endswith(" so far")


# --- the node reports them ------------------------------------------------------------------------


async def test_node_reports_configured_over_installed_and_sends_changes(tmp_path: Path) -> None:
    exe = tmp_path / "my-llama"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    cfg = config.AgentConfig(
        node_id="n1",
        servers=[config.HostPort("127.0.0.1:1")],
        tls=config.TlsFiles(ca=tmp_path / "ca", cert=tmp_path / "c", key=tmp_path / "k"),
        state_dir=tmp_path / "state",
        weights_dir=tmp_path / "weights",
        engine_paths={"llama-server": str(exe)},
    )
    installed = model.Engines()
    node = Node(cfg, nvml=None, installed_engines=lambda: installed)
    assert (await node.heartbeat(1)).engines is None  # not probed yet: unknown, not none
    await node.discover()
    configured = model.Engine("llama-server", str(exe), None, "configured")
    first = await node.hello_inventory()
    assert first.engines == model.Engines(found=(configured,))
    assert (await node.heartbeat(2)).engines is None  # unchanged: not sent again
    # The installer works on vllm, then has it; its llama-server loses to the operator's.
    installing = model.EngineStatus("vllm", "installing", "pip install vllm==1", "1")
    installed = model.Engines(
        found=(model.Engine("llama-server", "/x/llama-server", "b1", "installed"),),
        pending=(installing,),
    )
    assert (await node.heartbeat(3)).engines == model.Engines((configured,), (installing,))
    vllm = model.Engine("vllm", "/v/bin/vllm", "1", "installed")
    installed = model.Engines(found=(vllm,))
    assert (await node.heartbeat(4)).engines == model.Engines((configured, vllm))
    assert (await node.heartbeat(5)).engines is None


def test_supervisor_runs_the_installed_engine_unless_the_operator_named_one(
    tmp_path: Path,
) -> None:
    installed = {"vllm": "/i/vllm", "llama-server": "/i/llama-server", "sglang": "/i/bin/python"}
    sup = Supervisor(tmp_path, engine_paths={"vllm": "/op/vllm"}, path_of=installed.get)
    assert sup._launcher.resolve(["vllm", "serve", "m"], "vllm") == ["/op/vllm", "serve", "m"]
    assert sup._launcher.resolve(["llama-server", "-m", "x"], "llama-server") == [
        "/i/llama-server",
        "-m",
        "x",
    ]
    assert (
        sup._launcher.resolve(["python3", "-m", "sglang.launch_server"], "sglang")[0]
        == "/i/bin/python"
    )
    # Only the engine's own program is replaced; nothing installed: as written.
    assert sup._launcher.resolve(["sh", "-c", "true"], "llama-server") == ["sh", "-c", "true"]
    bare = Supervisor(tmp_path)
    assert bare._launcher.resolve(["llama-server"], "llama-server") == ["llama-server"]


async def test_servant_declare_engines_fenced_by_epoch(tmp_path: Path) -> None:
    declared: list[model.EngineDecls] = []
    servant = AgentServant(Node(None, nvml=None), Supervisor(tmp_path), declare=declared.append)
    decls = llama_decl("b9", "0" * 64)
    await servant.declare_engines(3, decls)
    assert declared == [decls]
    with pytest.raises(StaleEpoch, match="command from epoch 2 refused: epoch 3"):
        await servant.declare_engines(2, llama_decl("b8", "1" * 64))
    assert declared == [decls]


def test_pip_failure_says_the_index_could_not_be_read() -> None:
    out = (
        "WARNING: Retrying (Retry(total=0)) after connection broken by 'SSLError(...)': /s/\n"
        "Could not fetch URL https://10.0.0.1:8082/simple/vllm/: There was a problem "
        "confirming the ssl certificate: HTTPSConnectionPool(host='10.0.0.1', port=8082): "
        "Max retries exceeded (Caused by SSLError(...)) - skipping\n"
        "ERROR: No matching distribution found for vllm==1\n"
    )
    assert pip_failure(out, "vllm==1") == (
        "pip install vllm==1: could not read the index https://10.0.0.1:8082/simple/vllm/: "
        "There was a problem confirming the ssl certificate: "
        "HTTPSConnectionPool(host='10.0.0.1', port=8082): Max retries exceeded"
    )
