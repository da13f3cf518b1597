"""Probes driven by a fake nvidia-smi on PATH, a fake NVML, recorded output and fake trees."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import FIXTURES

from llmgw.agent.discovery import (
    RunResult,
    SubprocessRunner,
    UsageSampler,
    collect_inventory,
    format_inventory,
    inventory_to_json,
    parse_cpuinfo,
    parse_mountinfo,
    probe_engines,
    probe_filesystems,
    probe_gpus,
    read_mounts,
    scan_weights,
)
from llmgw.agent.discovery._runner import EXIT_NOT_FOUND
from llmgw.model import Fabric, Gpu, NicDistance, NvLink
from llmgw.testing import fake_nvidia_smi

LOGGER = "llmgw.agent.discovery"


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """nvidia-smi on PATH is the fake; the tests set its LLMGW_FAKE_* variables."""
    fake_nvidia_smi.install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for var in list(os.environ):
        if var.startswith("LLMGW_FAKE_"):
            monkeypatch.delenv(var)
    yield monkeypatch


class Recorded:
    """A runner answering from a table of argv -> results (a list is used in order)."""

    def __init__(self, answers: dict[tuple[str, ...], RunResult | list[RunResult]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        key = tuple(argv)
        self.calls.append(key)
        answer = self.answers.get(key)
        if answer is None:
            return RunResult(EXIT_NOT_FOUND, "", f"{argv[0]}: not found", missing=True)
        if isinstance(answer, list):
            return answer.pop(0)
        return answer


def no_nvml() -> Any:
    raise ImportError("libnvidia-ml.so.1: cannot open shared object file")


# --- GPUs through the fake nvidia-smi -----------------------------------------------------


def test_eight_h100_with_nvlink_and_nics(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("LLMGW_FAKE_GPUS", "8xh100-80g")
    fake_smi.setenv("LLMGW_FAKE_NICS", "4")
    fake_smi.setenv("LLMGW_FAKE_SMI_MEM_USED_MIB", "1000")
    fake_smi.setenv("LLMGW_FAKE_SMI_UTIL", "37")
    fake_smi.setenv("LLMGW_FAKE_SMI_APPS", "0:4242:600,0:5000:400,3:6000:100")
    probe = probe_gpus(SubprocessRunner(), nvml=None, llmgw_pids={5000})
    assert probe.warnings == ()
    assert probe.source == "nvidia-smi"
    assert probe.gpus is not None and len(probe.gpus) == 8
    g0 = probe.gpus[0]
    assert (g0.index, g0.name, g0.gpu_class) == (0, "NVIDIA H100 80GB HBM3", "h100-80g")
    assert (g0.memory_total_mib, g0.memory_used_mib, g0.utilization_pct) == (81559, 1000, 37.0)
    assert (g0.compute_capability, g0.ecc_uncorrected) == ("9.0", 0)
    # pid 5000 is llmgw's own: only 4242's 600 MiB is foreign on GPU 0.
    assert [g.foreign_memory_mib for g in probe.gpus] == [600, 0, 0, 100, 0, 0, 0, 0]
    assert [g.numa_node for g in probe.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert probe.gpus[5].cpu_affinity == "32-63"
    assert (probe.driver_version, probe.cuda_version) == ("550.54.15", "12.4")
    assert probe.topology is not None
    assert probe.topology.nvlinks == tuple(
        NvLink(a, b, 18) for a in range(8) for b in range(a + 1, 8)
    )
    d = {(x.gpu, x.nic): x.distance for x in probe.topology.nic_distances}
    assert d[(0, "mlx5_0")] == "PIX" and d[(1, "mlx5_0")] == "PIX" and d[(2, "mlx5_0")] == "NODE"
    assert d[(7, "mlx5_3")] == "PIX" and d[(0, "mlx5_3")] == "SYS"


def test_old_driver_short_rows_and_no_compute_cap(
    fake_smi: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_smi.setenv("LLMGW_FAKE_GPUS", "2xl40s-45g")
    fake_smi.setenv("LLMGW_FAKE_SMI_OLD_DRIVER", "1")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        probe = probe_gpus(SubprocessRunner(), nvml=None)
    assert probe.gpus is not None
    assert [(g.index, g.gpu_class) for g in probe.gpus] == [(0, "l40s-45g"), (1, "l40s-45g")]
    assert all(g.utilization_pct is None for g in probe.gpus)
    assert all(g.compute_capability is None for g in probe.gpus)
    assert all(g.memory_total_mib == 46068 for g in probe.gpus)
    assert any("compute_cap" in r.getMessage() for r in caplog.records)


def test_driver_not_loaded_is_unknown_with_a_warning(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("LLMGW_FAKE_GPUS", "2xh100-80g")
    fake_smi.setenv("LLMGW_FAKE_SMI_FAIL", "driver")
    probe = probe_gpus(SubprocessRunner(), nvml=None)
    assert probe.gpus is None
    assert len(probe.warnings) == 1
    assert "exit status 9" in probe.warnings[0]
    assert "couldn't communicate with the NVIDIA driver" in probe.warnings[0]


def test_no_devices_is_no_cards(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("LLMGW_FAKE_GPUS", "0")
    probe = probe_gpus(SubprocessRunner(), nvml=None)
    assert probe.gpus == ()
    assert probe.warnings == ()


def test_nvml_fallback_is_a_warning(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("LLMGW_FAKE_GPUS", "1xh200-140g")
    probe = probe_gpus(SubprocessRunner(), nvml=no_nvml)
    assert probe.gpus is not None and probe.gpus[0].gpu_class == "h200-140g"
    assert probe.warnings == (
        "NVML unavailable (ImportError: libnvidia-ml.so.1: cannot open shared object file): "
        "GPUs read with nvidia-smi",
    )


def test_no_nvidia_smi_is_no_cards_and_no_warning(tmp_path: Path) -> None:
    runner = SubprocessRunner(env={"PATH": str(tmp_path)})
    r = runner(["nvidia-smi"], 5)
    assert r.missing and r.returncode == EXIT_NOT_FOUND
    probe = probe_gpus(runner, nvml=no_nvml)
    assert probe.gpus == ()
    assert probe.warnings == ()
    assert probe.topology is None


def test_compute_cap_retry_from_recorded_output() -> None:
    full = "nvidia-smi --query-gpu=" + ",".join(
        ["index", "uuid", "name", "pci.bus_id", "memory.total", "memory.used", "compute_cap",
         "ecc.errors.uncorrected.volatile.total", "utilization.gpu"]
    )  # fmt: skip
    without = full.replace(",compute_cap", "")
    fmt = "--format=csv,noheader,nounits"
    runner = Recorded(
        {
            (*full.split(), fmt): RunResult(
                2, 'Field "compute_cap" is not a valid field to query.\n\n', ""
            ),
            (*without.split(), fmt): RunResult(
                0, "0, GPU-x, Tesla V100-SXM2-32GB, 00000000:06:00.0, 32510, 5, 0\n", ""
            ),
        }
    )
    probe = probe_gpus(runner, nvml=None)
    assert probe.gpus == (
        Gpu(
            index=0,
            uuid="GPU-x",
            name="Tesla V100-SXM2-32GB",
            gpu_class="v100-sxm2-32g",
            pci_bus_id="00000000:06:00.0",
            memory_total_mib=32510,
            memory_used_mib=5,
            ecc_uncorrected=0,
        ),
    )
    assert runner.calls[0][1].endswith("utilization.gpu")
    assert "compute_cap" not in runner.calls[1][1]
    # compute apps, versions and topo were asked and not found: unknown, with a warning for topo.
    assert probe.topology is None
    assert probe.gpus[0].foreign_memory_mib is None


# --- GPUs through a fake NVML ----------------------------------------------------------------


class FakeNvml:
    """Enough of pynvml for two cards joined by NVLink, with some calls failing."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4

    class Error(Exception):
        pass

    def __init__(self) -> None:
        self.shutdown = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.133.20"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 12080

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-nvml-{h}".encode()  # old pynvml returns bytes

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA A100-SXM4-80GB"

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return type("Pci", (), {"busId": f"00000000:{0x10 + h:02X}:00.0"})()

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return type("Mem", (), {"total": 81920 * 2**20, "used": 2048 * 2**20})()

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return (8, 0)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        raise self.Error("Not Supported")

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return 3 if h == 1 else 0

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        if h == 1:
            raise self.Error("Insufficient Permissions")
        proc = type("P", (), {"pid": 77, "usedGpuMemory": 512 * 2**20})()
        return [proc]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        return 1 if link < 3 else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return type("Pci", (), {"busId": f"0000:{0x10 + (1 - h):02X}:00.0"})()


def test_nvml_path_with_thin_answers_and_nvlinks_winning() -> None:
    nvml = FakeNvml()
    topo = (
        "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV12\tPXB\t0-15\t0\n"
        "GPU1\tNV12\t X \tSYS\t16-31\t1\n"
        "NIC0\tPXB\tSYS\t X \n\nNIC Legend:\n\n  NIC0: mlx5_0\n"
    )
    runner = Recorded({("nvidia-smi", "topo", "-m"): RunResult(0, topo, "")})
    probe = probe_gpus(runner, nvml=lambda: nvml)
    assert nvml.shutdown
    assert probe.source == "nvml" and probe.warnings == ()
    assert (probe.driver_version, probe.cuda_version) == ("570.133.20", "12.8")
    assert probe.gpus is not None
    g0, g1 = probe.gpus
    assert (g0.uuid, g0.gpu_class, g0.memory_total_mib, g0.memory_used_mib) == (
        "GPU-nvml-0",
        "a100-sxm4-80g",
        81920,
        2048,
    )
    assert g0.utilization_pct is None  # the call failed: unknown, not 0
    assert (g0.compute_capability, g0.ecc_uncorrected, g1.ecc_uncorrected) == ("8.0", 0, 3)
    assert (g0.foreign_memory_mib, g1.foreign_memory_mib) == (512, None)
    assert (g0.numa_node, g1.numa_node, g1.cpu_affinity) == (0, 1, "16-31")
    assert probe.topology is not None
    # NVML counted 3 links between the two; the matrix said NV12: NVML wins.
    assert probe.topology.nvlinks == (NvLink(0, 1, 3),)
    assert probe.topology.nic_distances == (
        NicDistance(0, "mlx5_0", "PXB"),
        NicDistance(1, "mlx5_0", "SYS"),
    )
    # NVML answered, so nvidia-smi was only asked for the topology.
    assert runner.calls == [("nvidia-smi", "topo", "-m")]


def test_nvml_that_cannot_list_cards_falls_back(fake_smi: pytest.MonkeyPatch) -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetUUID(self, h: int) -> bytes:
            raise self.Error("Unknown Error")

    fake_smi.setenv("LLMGW_FAKE_GPUS", "1xa100-80g")
    probe = probe_gpus(SubprocessRunner(), nvml=Broken)
    assert probe.source == "nvidia-smi"
    assert probe.gpus is not None and probe.gpus[0].name == "NVIDIA A100-SXM4-80GB"
    assert probe.warnings == (
        "NVML unavailable (NVML gave no handle, UUID or name for GPU 0): GPUs read with nvidia-smi",
    )


# --- Storage, weights, engines ----------------------------------------------------------------


def test_filesystems_grouped_by_device_shared_never_merged(tmp_path: Path) -> None:
    devs = {"/data/nfs": 20, "/data/local": 10, "/data/local/b": 10}

    def fake_stat(path: str) -> os.stat_result:
        for prefix, dev in sorted(devs.items(), key=lambda kv: -len(kv[0])):
            if path == prefix or path.startswith(prefix + "/"):
                if path in ("/data/local/missing",):
                    break
                return os.stat_result((0o40755, 0, dev, 1, 0, 0, 0, 0, 0, 0))
        if path in ("/", "/data"):
            return os.stat_result((0o40755, 0, 10, 1, 0, 0, 0, 0, 0, 0))
        raise FileNotFoundError(2, "No such file or directory", path)

    def fake_statvfs(path: str) -> os.statvfs_result:
        blocks = 1000 if path.startswith("/data/nfs") else 100
        return os.statvfs_result((4096, 4096, blocks, blocks // 2, blocks // 4, 0, 0, 0, 0, 255, 0))

    mounts = parse_mountinfo(
        "20 1 8:1 / / rw - ext4 /dev/sda1 rw\n30 20 0:99 / /data/nfs rw - nfs4 server:/export rw\n"
    )
    found = probe_filesystems(
        ["/data/local/a", "/data/local/b", "/data/nfs/models", "/data/local/missing"],
        mounts,
        stat=fake_stat,
        statvfs=fake_statvfs,
    )
    by_mount = {fs.mount: fs for fs in found}
    assert set(by_mount) == {"/", "/data/nfs"}
    local, nfs = by_mount["/"], by_mount["/data/nfs"]
    assert local.paths == ("/data/local/a", "/data/local/b")
    assert (local.fstype, local.shared, local.total_bytes, local.free_bytes) == (
        "ext4",
        False,
        100 * 4096,
        25 * 4096,
    )
    assert nfs.paths == ("/data/nfs/models",)
    assert (nfs.fstype, nfs.shared, nfs.total_bytes) == ("nfs4", True, 1000 * 4096)


def test_filesystems_on_this_machine(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    found = probe_filesystems([tmp_path / "a", tmp_path / "b", tmp_path / "gone"], read_mounts())
    assert len(found) == 1
    (fs,) = found
    assert fs.paths == (str(tmp_path / "a"), str(tmp_path / "b"))
    vfs = os.statvfs(tmp_path)
    assert fs.total_bytes == vfs.f_blocks * vfs.f_frsize
    assert fs.free_bytes is not None and fs.free_bytes > 0
    part = next(
        p for p in sorted(psutil.disk_partitions(all=True), key=lambda p: -len(p.mountpoint))
        if str(tmp_path).startswith(p.mountpoint.rstrip("/") + "/")
    )  # fmt: skip
    assert (fs.mount, fs.fstype) == (part.mountpoint, part.fstype)


def test_weights_skip_partial_and_empty_and_fingerprint_changes(tmp_path: Path) -> None:
    models, fetch = tmp_path / "models", tmp_path / "fetch"
    (models / "llama" / "sub").mkdir(parents=True)
    (models / "empty").mkdir()
    (models / "llama" / "model.safetensors").write_bytes(b"x" * 100)
    (models / "llama" / "sub" / "config.json").write_bytes(b"{}")
    (models / "llama" / "big.safetensors.partial").write_bytes(b"y" * 50)
    (fetch / "abc.partial").mkdir(parents=True)
    (fetch / "abc.partial" / "w.bin").write_bytes(b"z" * 10)
    (fetch / "blob").write_bytes(b"b" * 7)
    (fetch / "link.bin").symlink_to(fetch / "blob")
    (fetch / "dangling").symlink_to(fetch / "nowhere")
    w = scan_weights([models, fetch, tmp_path / "absent"])
    assert [(Path(f.path).relative_to(tmp_path).as_posix(), f.size_bytes) for f in w.files] == [
        ("fetch/blob", 7),
        ("fetch/link.bin", 7),
        ("models/llama/model.safetensors", 100),
        ("models/llama/sub/config.json", 2),
    ]
    assert scan_weights([models, fetch]).fingerprint == w.fingerprint
    (models / "llama" / "sub" / "config.json").write_bytes(b"{ }")
    assert scan_weights([models, fetch]).fingerprint != w.fingerprint
    empty = scan_weights([tmp_path / "absent"])
    assert empty.files == () and empty.fingerprint != w.fingerprint


def test_unfinished_cache_entries_are_listed_with_their_bytes(tmp_path: Path) -> None:
    from llmgw.core import MARKER, cache_name

    wd = tmp_path / "w"
    going, given_up = wd / cache_name("mirror:/a/"), wd / cache_name("mirror:/b.gguf")
    going.mkdir(parents=True)
    (going / "m.safetensors.partial").write_bytes(b"x" * 30)
    (going / "m.safetensors.partial.etag").write_bytes(b'"e"')
    given_up.mkdir()  # an empty leftover
    done = wd / cache_name("mirror:/c.gguf")
    done.mkdir()
    (done / "c.gguf").write_bytes(b"c" * 5)
    (done / MARKER).write_text('{"files": [{"name": "c.gguf", "size": 5}]}')
    w = scan_weights([], weights_dir=wd)
    assert [(f.path, f.size_bytes) for f in w.files] == [(str(done / "c.gguf"), 5)]
    assert w.unfinished is not None
    assert sorted((f.path, f.size_bytes) for f in w.unfinished) == sorted(
        [(str(going), 33), (str(given_up), 0)]
    )
    # The list is sent again when an entry appears or goes, not as one grows.
    (going / "m.safetensors.partial").write_bytes(b"x" * 60)
    assert scan_weights([], weights_dir=wd).fingerprint == w.fingerprint
    given_up.rmdir()
    assert scan_weights([], weights_dir=wd).fingerprint != w.fingerprint
    # No weights directory: nothing to say (None), not "none" (()).
    assert scan_weights([tmp_path]).unfinished is None


def test_engines_configured_never_run_and_never_from_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "ran"
    vllm = bin_dir / "vllm"
    vllm.write_text(f"#!/bin/sh\ntouch {marker}\n")
    vllm.chmod(0o755)
    llama = bin_dir / "llama-server"
    llama.write_text("#!/bin/sh\n")  # not executable: not an engine
    runner = Recorded({("/opt/py/bin/python", "-c", "import sglang"): RunResult(0, "", "")})
    paths = {"vllm": str(vllm), "llama-server": str(llama), "python3": "/usr/bin/python3"}
    engines = probe_engines(runner, sglang_python="/opt/py/bin/python", engine_paths=paths)
    assert [(e.name, e.path, e.version, e.state) for e in engines.found] == [
        ("sglang", "/opt/py/bin/python", None, "configured"),
        ("vllm", str(vllm), None, "configured"),
    ]
    assert not marker.exists()
    assert runner.calls == [("/opt/py/bin/python", "-c", "import sglang")]
    # Executables on PATH with the engines' names are not engines.
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}:{old}"
    try:
        assert probe_engines(runner).found == ()
    finally:
        os.environ["PATH"] = old
    # A Python without sglang: exit status 1, not found.
    real = probe_engines(SubprocessRunner(), sglang_python=sys.executable)
    assert real.found == ()


# --- Usage -------------------------------------------------------------------------------------


def test_usage_sampler_shards_and_rates(tmp_path: Path) -> None:
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<5: pass"]
    )
    try:
        sampler = UsageSampler(dirs=[tmp_path], nvml=None, runner=Recorded({}))
        first = sampler.sample(shards={"s1": [busy.pid], "gone": [2**22 + 7]})
        assert first.cpu_util_pct is None  # one sample cannot give a rate
        s1, gone = first.shards
        assert s1.shard_id == "s1" and s1.rss_bytes is not None and s1.rss_bytes > 1_000_000
        assert s1.cpu_cores is None
        assert (gone.cpu_cores, gone.rss_bytes) == (None, None)
        time.sleep(0.4)
        second = sampler.sample(shards={"s1": [busy.pid]})
        (s1,) = second.shards
        assert s1.cpu_cores is not None and 0.05 < s1.cpu_cores < 1.5
        assert second.cpu_util_pct is not None and 0 < second.cpu_util_pct <= 100
        assert second.memory_total_bytes == psutil.virtual_memory().total
        assert second.gpus == ()  # no nvidia-smi, no NVML
        assert [fs.paths for fs in second.filesystems] == [(str(tmp_path),)]
        assert "samples=2" in repr(sampler)
    finally:
        busy.kill()
        busy.wait()


# --- The whole inventory ------------------------------------------------------------------------


def _nvidia_smi_says() -> tuple[str | None, int]:
    """What this machine's own nvidia-smi reports: (driver version, GPUs); (None, 0) without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, 0
    done = subprocess.run(
        [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = (
        [r.strip() for r in done.stdout.splitlines() if r.strip()] if done.returncode == 0 else []
    )
    return (rows[0] if rows else None), len(rows)


def test_collect_inventory_on_this_machine(tmp_path: Path) -> None:
    """Holds with and without an NVIDIA driver: the GPU expectation is what nvidia-smi
    itself says here (NVML is left out, so nvidia-smi is the one source)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"g" * 64)
    inv = collect_inventory(
        model_dirs=[tmp_path / "models"], weights_dir=tmp_path / "weights", nvml=None
    )
    driver, gpus = _nvidia_smi_says()
    assert inv.gpus is not None and len(inv.gpus) == gpus
    assert inv.host.driver_version == driver
    if gpus == 0:
        assert inv.topology is None
    assert inv.usage.memory_total_bytes == psutil.virtual_memory().total
    cpuinfo = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    assert inv.host.cpu_flags == cpuinfo.flags
    raw = next(
        ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
    )
    for flag in ("avx2", "avx512f", "sse4_2"):
        assert (flag in inv.host.cpu_flags) == (flag in raw.split())
    assert inv.host.cpu_count == sum(
        1 for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("processor")
    )
    assert inv.host.arch == os.uname().machine
    assert inv.weights is not None
    assert [(f.path, f.size_bytes) for f in inv.weights.files] == [
        (str(tmp_path / "models" / "m.gguf"), 64)
    ]
    assert [fs.paths for fs in inv.usage.filesystems] == [(str(tmp_path / "models"),)]
    assert inv.engines is not None
    text = format_inventory(inv)
    assert f"host        {inv.host.hostname}" in text
    assert f"driver      {driver or '-'}  cuda " in text
    data = inventory_to_json(inv)
    assert data["host"]["driver_version"] == driver
    assert data["usage"]["cpu_util_pct"] is None
    assert json.loads(json.dumps(data)) == data


def test_collect_inventory_on_a_fake_root(fake_smi: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "proc" / "meminfo").write_text("MemTotal: 2048 kB\nMemAvailable: 1024 kB\n")
    (root / "proc" / "loadavg").write_text("1.00 2.00 3.00 1/1 1\n")
    shutil.copy(
        FIXTURES / "cpu-proc-cpuinfo-qemu-virtual-cpu-no-avx.txt", root / "proc" / "cpuinfo"
    )
    shutil.copy(FIXTURES / "osrelease-rhel-9.6.txt", root / "etc" / "os-release")
    ib = root / "sys" / "class" / "infiniband"
    shutil.copytree(FIXTURES / "sysfs-infiniband-h100-ndr400-plus-bf3-roce-bond", ib)
    (ib / "mlx5_1" / "ports" / "1" / "state").chmod(0o644)
    (ib / "mlx5_1" / "ports" / "1" / "state").write_text("2: INIT\n")
    fake_smi.setenv("LLMGW_FAKE_GPUS", "2xh100-80g")
    inv = collect_inventory(
        root=root,
        runner=SubprocessRunner(),
        fabrics={"ib": ["mlx5_0", "mlx5_1", "mlx5_2"]},
        nvml=None,
        hostname="gpu-01",
    )
    assert inv.host.hostname == "gpu-01"
    assert (inv.host.os_id, inv.host.os_like, inv.host.os_version) == ("rhel", ("fedora",), "9.6")
    assert inv.host.cpu_model == "QEMU Virtual CPU version 2.5+"
    assert (inv.usage.memory_total_bytes, inv.usage.memory_available_bytes) == (
        2048 * 1024,
        1024 * 1024,
    )
    assert (inv.usage.load1, inv.usage.load15) == (1.0, 3.0)
    assert inv.gpus is not None and [g.gpu_class for g in inv.gpus] == ["h100-80g", "h100-80g"]
    assert inv.topology is not None and inv.topology.nvlinks == (NvLink(0, 1, 18),)
    assert inv.host.driver_version == "550.54.15"
    assert len(inv.ib_adapters) == 9
    assert inv.fabrics == (Fabric("ib", ("mlx5_0",), 400.0),)
    assert inv.warnings == (
        "CPU has no AVX2 (QEMU Virtual CPU version 2.5+): inference will be several times "
        "slower; set the VM CPU type to host",
        "fabric ib: adapter mlx5_1 has no ACTIVE port (port 1 INIT)",
        "fabric ib: adapter mlx5_2 not present",
    )
    text = format_inventory(inv)
    assert "  ib  mlx5_0  400 Gb/s" in text
    assert "  - fabric ib: adapter mlx5_2 not present" in text


def test_a_probe_that_raises_leaves_its_part_unknown(tmp_path: Path) -> None:
    def exploding(argv: Sequence[str], timeout: float) -> RunResult:
        raise RuntimeError("boom")

    root = tmp_path
    (root / "proc").mkdir()
    (root / "proc" / "meminfo").write_text("MemTotal: 4096 kB\n")
    inv = collect_inventory(root=root, runner=exploding, nvml=None, hostname="h")
    assert inv.gpus is None
    assert inv.usage.memory_total_bytes == 4096 * 1024
    assert inv.usage.memory_available_bytes is None
    assert inv.host.hostname == "h"
    assert any(w.startswith("GPU unknown: probe failed (RuntimeError: boom)") for w in inv.warnings)
    assert "gpus        - (could not tell)" in format_inventory(inv)


def test_fake_nvidia_smi_speaks_like_the_real_one(fake_smi: pytest.MonkeyPatch) -> None:
    run = SubprocessRunner()
    fake_smi.setenv("LLMGW_FAKE_GPUS", "1xl40s-45g")
    fake_smi.setenv("LLMGW_FAKE_SMI_OLD_DRIVER", "1")
    r = run(["nvidia-smi", "--query-gpu=index,compute_cap", "--format=csv"], 30)
    assert (r.returncode, r.stdout) == (2, 'Field "compute_cap" is not a valid field to query.\n\n')
    r = run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv"], 30)
    assert (r.returncode, r.stdout) == (0, "index, name\n0, NVIDIA L40S\n")
    fake_smi.setenv("LLMGW_FAKE_GPUS", "")
    r = run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], 30)
    assert (r.returncode, r.stdout) == (6, "No devices were found\n")


def test_usage_probe_skips_topology_and_versions(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("LLMGW_FAKE_GPUS", "2xh100-80g")
    fake_smi.setenv("LLMGW_FAKE_SMI_MEM_USED_MIB", "70000")
    calls: list[tuple[str, ...]] = []
    real = SubprocessRunner()

    def spy(argv: Sequence[str], timeout: float) -> RunResult:
        calls.append(tuple(argv))
        return real(argv, timeout)

    usage = UsageSampler(runner=spy, nvml=None).sample()
    assert [(g.index, g.memory_used_mib, g.foreign_memory_mib) for g in usage.gpus] == [
        (0, 70000, 0),
        (1, 70000, 0),
    ]
    assert [c[1].split("=")[0] for c in calls] == ["--query-gpu", "--query-compute-apps"]


def test_each_shard_s_gpu_memory_is_its_process_group_s_from_the_same_reading(
    fake_smi: pytest.MonkeyPatch,
) -> None:
    """A shard's GPU memory: its processes' (its engine and the engine's children) summed
    per card, the card where it holds most; read from the one compute-apps query the GPU
    probe already makes."""
    code = (
        "import subprocess,sys,time\n"
        "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)'])\n"
        "print(p.pid,flush=True)\ntime.sleep(30)"
    )
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert engine.stdout is not None
        child = int(engine.stdout.readline())
        fake_smi.setenv("LLMGW_FAKE_GPUS", "2xh100-80g")
        # The engine 1000 MiB on card 0, its child 3000 on card 0 and 500 on card 1; a
        # process llmgw did not start 7000 on card 1.
        apps = f"0:{engine.pid}:1000,0:{child}:3000,1:{child}:500,1:{2**22 + 9}:7000"
        fake_smi.setenv("LLMGW_FAKE_SMI_APPS", apps)
        calls: list[tuple[str, ...]] = []
        real = SubprocessRunner()

        def spy(argv: Sequence[str], timeout: float) -> RunResult:
            calls.append(tuple(argv))
            return real(argv, timeout)

        sampler = UsageSampler(runner=spy, nvml=None)
        shards = {"eng": [engine.pid], "idle": [idle.pid], "gone": [2**22 + 7]}
        usage = sampler.sample(shards=shards, llmgw_pids=[engine.pid, idle.pid])
        held = {s.shard_id: s.gpu_memory_mib for s in usage.shards}
        assert held == {"eng": 4000, "idle": 0, "gone": None}
        assert [g.foreign_memory_mib for g in usage.gpus] == [0, 7000]
        assert [c[1].split("=")[0] for c in calls] == ["--query-gpu", "--query-compute-apps"]
        # No GPU reading: unknown, never 0.
        blind = UsageSampler(runner=spy, nvml=None).sample(shards=shards, gpus=False)
        assert {s.shard_id: s.gpu_memory_mib for s in blind.shards} == dict.fromkeys(shards)
        fake_smi.setenv("LLMGW_FAKE_GPUS", "")  # no cards: nothing to hold memory on
        none = UsageSampler(runner=spy, nvml=None).sample(shards=shards)
        assert {s.shard_id: s.gpu_memory_mib for s in none.shards} == dict.fromkeys(shards)
    finally:
        for kid in psutil.Process(engine.pid).children():
            kid.kill()
        for p in (engine, idle):
            p.kill()
            p.wait()
        if engine.stdout is not None:
            engine.stdout.close()
