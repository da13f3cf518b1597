"""A shard's source made ready before launch: real supervisors, real processes, the real
mirror on loopback (through a proxy that counts GETs and can be slowed)."""

from __future__ import annotations

import json
import os
import random
import re
import ssl
import subprocess
import sys
from functools import partial
from pathlib import Path

import trio
import trustme
from helpers import CountingProxy as Proxy
from helpers import loopback_pki, require

from llmgw import config, model
from llmgw.agent._fetch import MARKER, Fetcher
from llmgw.agent._main import make_weights_dir
from llmgw.agent._node import Node
from llmgw.agent._sources import ControlPlane, Sources
from llmgw.agent._supervisor import Supervisor
from llmgw.agent.discovery import scan_weights
from llmgw.core import cache_name
from llmgw.cp._weights._mirror import serve_mirror
from llmgw.testing.cluster import free_port

PY = sys.executable
SLEEPER = "import time; print('up', flush=True); time.sleep(3600)"
MiB = 1 << 20


def blob(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def spec(
    shard_id: str, source: str | None, *, engine: str = "vllm", argv_source: str | None = None
) -> model.ShardSpec:
    shown = argv_source if argv_source is not None else source
    argv = (PY, "-c", SLEEPER, "--model", shown or "none")
    return model.ShardSpec(
        shard_id=shard_id,
        model="m",
        engine=engine,
        processes=(model.ProcessSpec(name="engine", argv=argv),),
        serves_http=False,
        source=source,
    )


async def wait_state(sup: Supervisor, shard_id: str, *states: str) -> model.ShardReport:
    with trio.fail_after(30):
        while True:
            for report in sup.reports():
                if report.shard_id == shard_id and report.state in states:
                    return report
            await trio.sleep(0.02)


def version(root: Path) -> dict[str, bytes]:
    """A two-part GGUF version under the mirror: tiny/ with its parts (and a note)."""
    files = {
        "tiny-00001-of-00002.gguf": blob(300_000, 1),
        "tiny-00002-of-00002.gguf": blob(200_000, 2),
    }
    (root / "tiny").mkdir(parents=True)
    for name, data in files.items():
        (root / "tiny" / name).write_bytes(data)
    return files


class Rig:
    """A mirror (behind a counting proxy), a Fetcher, Sources and a Supervisor."""

    def __init__(self, tmp_path: Path, nursery: trio.Nursery) -> None:
        self.tmp = tmp_path
        self.nursery = nursery
        self.weights = tmp_path / "weights"
        self.weights.mkdir(exist_ok=True)
        self.root = tmp_path / "mirror"
        self.root.mkdir(exist_ok=True)
        self.progress: list[model.Progress] = []
        self.rescans = 0
        self.mirror_port: int | None = None
        self.mirror_tls = False
        self.proxy: Proxy | None = None

    async def start(
        self,
        *,
        mirror: bool = True,
        delay_s: float = 0.0,
        server_tls: ssl.SSLContext | None = None,
        client_tls: ssl.SSLContext | None = None,
    ) -> Supervisor:
        if mirror:
            port = await self.nursery.start(
                partial(serve_mirror, self.root, "127.0.0.1", 0, ssl_context=server_tls)
            )
            if server_tls is None:
                self.proxy = Proxy(port, delay_s)
                port = await self.proxy.start(self.nursery)
            self.mirror_port, self.mirror_tls = port, server_tls is not None

        async def rescan() -> None:
            self.rescans += 1

        self.fetcher = Fetcher(
            self.weights,
            read_timeout_s=10,
            connect_timeout_s=5,
            progress=lambda n, d, t: self.sources.progress(n, d, t),
        )
        await self.nursery.start(self.fetcher.run)
        settings = model.Settings(
            heartbeat_interval_s=1,
            epoch=1,
            mirror_port=self.mirror_port,
            mirror_tls=self.mirror_tls,
        )
        self.sources = Sources(
            self.fetcher,
            node_id="node-a",
            control_plane=lambda: ControlPlane("127.0.0.1", 7070, settings),
            client_tls=client_tls,
            on_fetched=rescan,
            notify_progress=self.progress.append,
        )
        return await self.supervisor()

    async def supervisor(self) -> Supervisor:
        sup = Supervisor(self.tmp / "state", grace_s=2, node_id="node-a", sources=self.sources)
        await self.nursery.start(sup.run)
        return sup


async def test_local_absent_fails_at_once_present_and_hub_start_untouched(tmp_path: Path) -> None:
    present = tmp_path / "here.gguf"
    present.write_bytes(b"gguf")
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        sup = await rig.start(mirror=False)
        with trio.fail_after(5):  # at once: no engine ran, nothing waited
            await sup.start(spec("absent", "/models/x.gguf"))
            failed = await wait_state(sup, "absent", "failed")
        assert failed.reason == "model source /models/x.gguf: no such file or directory on node-a"
        assert failed.pids == ()
        await sup.start(spec("local", str(present)))
        await sup.start(spec("hub", "Qwen/Qwen2.5-7B-Instruct"))
        for shard_id, source in (("local", str(present)), ("hub", "Qwen/Qwen2.5-7B-Instruct")):
            ready = await wait_state(sup, shard_id, "loading", "ready")
            (pid,) = ready.pids
            assert cmdline(pid)[-2:] == ["--model", source]
        assert rig.sources.fetches == 0 and os.listdir(rig.weights) == []
        for shard_id in ("absent", "local", "hub"):
            await sup.stop(shard_id)
        nursery.cancel_scope.cancel()


async def test_mirror_version_fetched_once_for_two_shards_dir_or_first_part(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        files = version(rig.root)
        sup = await rig.start(delay_s=0.002)  # slow enough that both wait on one download
        source = "mirror:/tiny/"
        await sup.start(spec("vllm-0", source, engine="vllm"))
        await sup.start(spec("llama-0", source, engine="llama-server"))
        entry = rig.weights / cache_name(source)
        first = str(entry / "tiny-00001-of-00002.gguf")
        a = await wait_state(sup, "vllm-0", "loading", "ready")
        b = await wait_state(sup, "llama-0", "loading", "ready")
        assert cmdline(a.pids[0])[-2:] == ["--model", str(entry)]
        assert cmdline(b.pids[0])[-2:] == ["--model", first]
        # One download: the manifest and each part asked for once, by both shards.
        assert rig.proxy is not None
        assert sorted(rig.proxy.gets()) == [
            "/tiny/",
            "/tiny/tiny-00001-of-00002.gguf",
            "/tiny/tiny-00002-of-00002.gguf",
        ]
        assert rig.fetcher.statistics().downloads == 1
        assert sorted(os.listdir(entry)) == sorted([*files, MARKER])
        for name, data in files.items():
            assert (entry / name).read_bytes() == data
        assert rig.rescans == 2  # each waiter's fetch finished: the weights are scanned again
        # run.json holds the argv as run, so an agent restart's adoption matches it.
        run = json.loads((tmp_path / "state" / "shards" / "llama-0" / "run.json").read_text())
        assert run["procs"][0]["argv"][-1] == first
        # The scan reports the entry's files (never the marker) and the directory.
        scanned = scan_weights([], weights_dir=rig.weights)
        assert scanned.dir == str(rig.weights.resolve())
        assert [(f.path, f.size_bytes) for f in scanned.files] == [
            (str(entry / n), len(d)) for n, d in sorted(files.items())
        ]
        for shard_id in ("vllm-0", "llama-0"):
            await sup.stop(shard_id)
        nursery.cancel_scope.cancel()


async def test_restarted_agent_adopts_a_fetched_shard_and_fetches_nothing(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as outer:
        rig = Rig(tmp_path, outer)
        version(rig.root)
        await rig.start()
        source = "mirror:/tiny/"
        async with trio.open_nursery() as first:
            sup = Supervisor(tmp_path / "state", grace_s=2, sources=rig.sources)
            await first.start(sup.run)
            await sup.start(spec("s", source, engine="llama-server"))
            pid = (await wait_state(sup, "s", "ready")).pids[0]
            first.cancel_scope.cancel()  # the agent goes; the engine stays
        fetches = rig.sources.fetches
        again = Supervisor(tmp_path / "state", grace_s=2, sources=rig.sources)
        await outer.start(again.run)
        adopted = await wait_state(again, "s", "ready")
        assert adopted.pids == (pid,)
        assert rig.sources.fetches == fetches  # an adopted shard fetches nothing
        await again.stop("s")
        outer.cancel_scope.cancel()


async def test_mirror_over_tls_with_the_agents_client_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    ca.configure_trust(server_tls)
    server_tls.verify_mode = ssl.CERT_REQUIRED  # the mirror requires a client certificate
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    ca.issue_cert("node-a").configure_cert(client_tls)
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        (rig.root / "one.gguf").write_bytes(blob(50_000, 3))
        sup = await rig.start(server_tls=server_tls, client_tls=client_tls)
        await sup.start(spec("s", "mirror:/one.gguf", engine="llama-server"))
        ready = await wait_state(sup, "s", "loading", "ready")
        local = rig.weights / cache_name("mirror:/one.gguf") / "one.gguf"
        assert cmdline(ready.pids[0])[-1] == str(local)
        assert local.read_bytes() == blob(50_000, 3)
        await sup.stop("s")
        nursery.cancel_scope.cancel()


async def test_no_mirror_in_settings_fails_naming_the_control_plane(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        sup = await rig.start(mirror=False)
        await sup.start(spec("s", "mirror:/tiny/"))
        failed = await wait_state(sup, "s", "failed")
        assert failed.reason == (
            "mirror:/tiny/: the control plane at 127.0.0.1:7070 serves no weights mirror "
            "(server.yaml mirror.dir)"
        )
        assert failed.pids == ()
        nursery.cancel_scope.cancel()


async def test_progress_by_source_while_starting_and_stop_cancels_the_fetch(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as nursery:
        rig = Rig(tmp_path, nursery)
        (rig.root / "big.bin").write_bytes(blob(4 * MiB, 5))
        sup = await rig.start(delay_s=0.01)  # 16 KiB per 10 ms: about 1.6 MB/s
        source = "mirror:/big.bin"
        await sup.start(spec("s", source))
        with trio.fail_after(20):
            while len(rig.progress) < 2:
                await trio.sleep(0.05)
        assert {p.source for p in rig.progress} == {source}
        assert all(p.total_bytes == 4 * MiB for p in rig.progress)
        assert 0 < rig.progress[0].done_bytes < rig.progress[1].done_bytes < 4 * MiB
        (report,) = sup.reports()
        assert report.state == "starting" and report.pids == ()  # progress is not state
        assert rig.fetcher.in_flight() == {cache_name(source)}
        stopped = await sup.stop("s")
        assert stopped.state == "stopped"
        assert rig.fetcher.in_flight() == frozenset()
        with trio.fail_after(5):  # the download is cancelled with its only waiter
            while rig.fetcher.statistics().failed != 1:
                await trio.sleep(0.02)
        got = rig.fetcher.statistics().bytes_received
        await trio.sleep(0.3)
        assert rig.fetcher.statistics().bytes_received == got < 4 * MiB  # nothing more comes
        entry = rig.weights / cache_name(source)
        # Never half-visible: only the partial (kept, to be resumed), no final name, no marker.
        assert sorted(os.listdir(entry)) == ["big.bin.partial", "big.bin.partial.etag"]
        nursery.cancel_scope.cancel()


async def test_a_source_bigger_than_the_disk_fails_the_shard_before_its_first_byte(
    tmp_path: Path,
) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(weights)], capture_output=True
    )
    # The issue asks for a real small filesystem; under CI its absence fails the test.
    require(
        mounted.returncode == 0,
        "cannot mount a small tmpfs here: " + mounted.stderr.decode().strip(),
    )
    try:
        async with trio.open_nursery() as nursery:
            rig = Rig(tmp_path, nursery)
            (rig.root / "big.gguf").write_bytes(blob(3 * MiB, 6))
            sup = await rig.start()
            source = "mirror:/big.gguf"
            await sup.start(spec("s", source, engine="llama-server"))
            failed = await wait_state(sup, "s", "failed")
            assert failed.reason is not None
            # The mirror says the length: refused from its head, naming both sizes
            # (filling the disk and removing the partial: tests/agent/test_fetch.py).
            assert re.fullmatch(
                rf"model source mirror:/big\.gguf: http://\S+/big\.gguf: needs 3\.0 MiB more in "
                rf"{re.escape(str(weights))}, "
                r"which has [0-9.]+ (KiB|MiB) free; nothing was fetched",
                failed.reason,
            ), failed.reason
            assert failed.pids == ()
            assert os.listdir(weights) == []  # nothing under the final name, nor a partial
            nursery.cancel_scope.cancel()
    finally:
        subprocess.run(["umount", str(weights)], check=True)


def test_scan_reports_only_marked_entries_and_an_operators_files(tmp_path: Path) -> None:
    w = tmp_path / "w"
    done, unmarked, short = (w / cache_name(s) for s in ("mirror:/a/", "mirror:/b/", "mirror:/c/"))
    for d in (done, unmarked, short):
        d.mkdir(parents=True)
        (d / "x.gguf").write_bytes(b"x" * 10)
    (done / "y.gguf.partial").write_bytes(b"p")
    (done / "y.gguf.partial.etag").write_text('"e"')
    (done / MARKER).write_text(json.dumps({"files": [{"name": "x.gguf", "size": 10}]}))
    (short / MARKER).write_text(json.dumps({"files": [{"name": "x.gguf", "size": 11}]}))
    (w / "mine.gguf").write_bytes(b"m" * 3)
    (w / "mine.gguf.partial").write_bytes(b"m")
    (w / "operator").mkdir()
    (w / "operator" / "z.safetensors").write_bytes(b"z" * 4)
    link = tmp_path / "link"
    link.symlink_to(w)
    scanned = scan_weights([], weights_dir=link)  # scanned from its real path
    assert scanned.dir == str(w.resolve())
    assert [(f.path, f.size_bytes) for f in scanned.files] == [
        (str(w / "mine.gguf"), 3),
        (str(w / "operator" / "z.safetensors"), 4),
        (str(done / "x.gguf"), 10),
    ]
    # Marking the unmarked entry changes the fingerprint (the heartbeat then carries it).
    (unmarked / MARKER).write_text(json.dumps({"files": [{"name": "x.gguf", "size": 10}]}))
    assert scan_weights([], weights_dir=w).fingerprint != scanned.fingerprint
    assert scan_weights([], weights_dir=tmp_path / "absent").files == ()


def agent_yaml(tmp_path: Path, weights_dir: Path) -> Path:
    loopback_pki(tmp_path, "node-a")
    path = tmp_path / "agent.yaml"
    path.write_text(
        json.dumps(
            {
                "node_id": "node-a",
                "servers": [f"127.0.0.1:{free_port()}"],
                "tls": {
                    "ca": str(tmp_path / "ca.crt"),
                    "cert": str(tmp_path / "agent-node-a.crt"),
                    "key": str(tmp_path / "agent-node-a.key"),
                },
                "state_dir": str(tmp_path / "state"),
                "weights_dir": str(weights_dir),
            }
        )
    )
    return path


def test_an_agent_that_cannot_make_its_weights_dir_ends_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    weights = tmp_path / "a-file" / "weights"
    done = subprocess.run(
        [PY, "-m", "llmgw.agent", "run", "--config", str(agent_yaml(tmp_path, weights))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"llmgw-agent: weights_dir {weights}: cannot be created (Not a directory); "
        "name a directory this agent may write in agent.yaml"
    )


def test_the_weights_dir_is_made_with_its_parents_and_its_disk_reported(tmp_path: Path) -> None:
    weights = tmp_path / "deep" / "er" / "weights"
    cfg = config.load(agent_yaml(tmp_path, weights), config.AgentConfig)
    make_weights_dir(cfg)
    assert weights.is_dir()
    usage = Node(cfg, nvml=None).collect_usage()
    (fs,) = [f for f in usage.filesystems if str(weights) in f.paths]
    assert fs.free_bytes is not None and fs.free_bytes > 0
