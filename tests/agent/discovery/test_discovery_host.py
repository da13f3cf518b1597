"""CPU, OS, memory, load and mount tables, on real samples."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FIXTURES

from llmgw.agent.discovery import (
    CpuInfo,
    CpuTimes,
    LoadAvg,
    MemInfo,
    Mount,
    cpu_util_pct,
    cpu_warnings,
    is_shared_fstype,
    lscpu_fields,
    parse_cpuinfo,
    parse_loadavg,
    parse_lscpu,
    parse_meminfo,
    parse_mount_output,
    parse_mountinfo,
    parse_proc_stat,
)
from llmgw.errors import ParseError


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


EPYC_VECTOR_FLAGS = (
    "mmx", "sse", "sse2", "ssse3", "fma", "sse4_1", "sse4_2", "avx", "f16c", "sse4a", "avx2",
    "avx512f", "avx512dq", "avx512ifma", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16",
    "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq",
)  # fmt: skip


def test_lscpu_epyc_wrapped_flags() -> None:
    text = fixture("cpu-lscpu-amd-epyc9374f-avx512.txt")
    cpu = parse_lscpu(text)
    assert cpu == CpuInfo(
        model="AMD EPYC 9374F 32-Core Processor",
        count=64,
        flags=EPYC_VECTOR_FLAGS,
        arch="x86_64",
        hypervisor=False,
    )
    assert cpu_warnings(cpu) == ()
    # The wrap fell mid-word: "a" + "md_lbr_v2", "cmp_l" + "egacy", "hw_ps" + "tate".
    flags = lscpu_fields(text)["Flags"].split()
    for whole in ("amd_lbr_v2", "cmp_legacy", "hw_pstate", "vgif", "fsrm", "clwb", "avx512cd"):
        assert whole in flags
    for piece in ("a", "md_lbr_v2", "cmp_l", "egacy", "vg", "if", "f", "srm"):
        assert piece not in flags
    assert len(flags) == len(set(flags))


def test_cpuinfo_qemu_without_avx_warns() -> None:
    cpu = parse_cpuinfo(fixture("cpu-proc-cpuinfo-qemu-virtual-cpu-no-avx.txt"))
    # The sample is one processor's block (processor 7): one entry, one CPU.
    assert cpu == CpuInfo(
        model="QEMU Virtual CPU version 2.5+",
        count=1,
        flags=("mmx", "sse", "sse2"),
        hypervisor=True,
    )
    assert cpu_warnings(cpu) == (
        "CPU has no AVX2 (QEMU Virtual CPU version 2.5+): inference will be several times "
        "slower; set the VM CPU type to host",
    )


def test_cpuinfo_aarch64_has_no_avx2_warning() -> None:
    text = (
        "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve sve2 bf16 i8mm\nCPU part\t: 0xd4f\n"
    )
    cpu = parse_cpuinfo(text)
    assert cpu.flags == ("asimd", "sve", "sve2", "bf16", "i8mm")
    assert cpu.model is None
    assert cpu_warnings(attrs_evolve_arch(cpu, "aarch64")) == ()


def attrs_evolve_arch(cpu: CpuInfo, arch: str) -> CpuInfo:
    return CpuInfo(cpu.model, cpu.count, cpu.flags, arch, cpu.hypervisor)


def test_meminfo_loadavg_stat() -> None:
    mem = "MemTotal:       16318108 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\nHugePages_Total: 0\n"
    assert parse_meminfo(mem) == MemInfo(16318108 * 1024, 12000000 * 1024)
    # Before Linux 3.14 there is no MemAvailable: unknown, not 0.
    assert parse_meminfo("MemTotal: 1024 kB\nMemFree: 10 kB\n") == MemInfo(1024 * 1024, None)
    assert parse_loadavg("0.52 0.58 0.59 1/467 12345\n") == LoadAvg(0.52, 0.58, 0.59)
    before = parse_proc_stat("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3 4\nintr 5\n")
    after = parse_proc_stat("cpu  150 0 150 900 0 0 0 0 0 0\n")
    assert before == CpuTimes(busy=200, total=1000)
    assert cpu_util_pct(before, after) == 50.0
    assert cpu_util_pct(after, after) is None
    for fn, bad in ((parse_meminfo, "MemFree: 1 kB\n"), (parse_loadavg, "a b c"),
                    (parse_proc_stat, "cpu x y\n"), (parse_meminfo, "MemTotal: lots\n")):  # fmt: skip
        with pytest.raises(ParseError):
            fn(bad)


def test_digits_int_cannot_read_are_parse_errors() -> None:
    # "²".isdigit() is True but int("²") raises ValueError: found by fuzzing.
    with pytest.raises(ParseError):
        parse_proc_stat("cpu  1 2 3 \u00b2 5\n")
    with pytest.raises(ParseError):
        parse_cpuinfo("processor\t: \u00b2\n")
    with pytest.raises(ParseError):
        parse_mountinfo("1 2 \u00b2:0 / / rw - ext4 /dev/sda rw\n")


def test_real_proc_files_parse() -> None:
    mem = parse_meminfo(Path("/proc/meminfo").read_text())
    assert mem.total_bytes is not None and mem.total_bytes > 0
    assert parse_proc_stat(Path("/proc/stat").read_text()).total > 0
    assert len(parse_mountinfo(Path("/proc/self/mountinfo").read_text())) > 0


def test_mountinfo_nfs() -> None:
    mounts = parse_mountinfo(fixture("mounts-nfs-v3-mountinfo-excerpt-cesga.txt"))
    assert len(mounts) == 5
    assert mounts[0] == Mount(
        mount_point="/mnt/netapp2/Store_ulcqfjrg",
        fstype="nfs",
        source="10.117.49.202:/Store_ulcqfjrg",
        dev=(0, 173),
    )
    assert [m.dev for m in mounts] == [(0, 173), (0, 174), (0, 175), (0, 176), (0, 177)]
    assert all(is_shared_fstype(m.fstype) for m in mounts)


def test_mountinfo_escapes_and_errors() -> None:
    line = "36 35 98:0 /mnt1 /my\\040disk rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
    (m,) = parse_mountinfo(line)
    assert (m.mount_point, m.fstype, m.source, m.dev) == ("/my disk", "ext3", "/dev/root", (98, 0))
    for bad in (
        "36 35 98:0 /mnt1 /mnt2 rw ext3 /dev/root rw\n",
        "1 2 x:y / / rw - ext4 /dev/sda rw\n",
    ):
        with pytest.raises(ParseError):
            parse_mountinfo(bad)


def test_mount_output_lustre() -> None:
    mounts = parse_mount_output(fixture("mounts-lustre-azure-managed-lustre-mount-output.txt"))
    point = (
        "/var/lib/kubelet/pods/6632349a-05fd-466f-bc8a-8946617089ce/volumes/"
        "kubernetes.io~csi/pvc-841498d9-fa63-418c-8cc7-d94ec27f2ee2/mount"
    )
    # The source lists each mount twice; both lines are kept as printed.
    assert mounts == (Mount(point, "lustre", "172.18.8.12@tcp:/lustrefs"),) * 2
    assert is_shared_fstype("lustre")


@pytest.mark.parametrize(
    ("fstype", "shared"),
    [
        ("nfs4", True), ("ceph", True), ("gpfs", True), ("beegfs", True), ("cifs", True),
        ("9p", True), ("virtiofs", True), ("fuse.sshfs", True), ("fuse.juicefs", True),
        ("ext4", False), ("xfs", False), ("btrfs", False), ("zfs", False), ("overlay", False),
        ("tmpfs", False), ("fuse.lxcfs", False), ("fuse", False),
    ],
)  # fmt: skip
def test_shared_fstypes(fstype: str, shared: bool) -> None:
    assert is_shared_fstype(fstype) is shared


def test_no_discovery_module_imports_trio_or_capnp() -> None:
    import ast

    import llmgw.agent.discovery as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert not imported & {"trio", "capnp", "httpx"}, path.name
