"""A stand-in for `nvidia-smi`, for tests, demos and benchmarks on machines without GPUs.

Run it as `python -m llmgw.testing.fake_nvidia_smi ARGS...`; tests put a shell
wrapper named `nvidia-smi` that execs this on PATH (see `install`). It answers
the queries llmgw's discovery makes, with the real tool's messages and exit
statuses:

- `nvidia-smi` (no arguments): the table header with Driver and CUDA versions;
- `--query-gpu=F1,F2,... --format=csv[,noheader][,nounits]`;
- `--query-compute-apps=gpu_uuid,pid,used_memory --format=csv[,...]`;
- `topo -m`: the matrix, NIC columns with a NIC legend;
- `-L`: one line per card (and its MIG instances, from a recording).

Environment variables:

LLMGW_FAKE_GPUS
    The cards: comma-separated `<N>x<class>` groups, e.g. `8xh100-80g` or
    `2xl40s-45g,1xa100-80g`. Classes: h100-80g, h200-140g, a100-80g, a100-40g,
    l40s-45g, rtx-6000-ada-48g, v100-sxm2-32g. Unset, empty or `0`: prints
    "No devices were found" and exits 6, as the real one does.
LLMGW_FAKE_SMI_OLD_DRIVER=1
    Behave like a driver from before compute_cap existed: a query naming
    compute_cap fails with 'Field "compute_cap" is not a valid field to
    query.' (exit 2), and rows come back without their last field (no
    utilization.gpu column), as the shorter rows older drivers return.
LLMGW_FAKE_SMI_FAIL=driver
    Every command prints "NVIDIA-SMI has failed because it couldn't
    communicate with the NVIDIA driver..." and exits 9.
LLMGW_FAKE_SMI_MEM_USED_MIB, LLMGW_FAKE_SMI_UTIL
    memory.used (MiB, default 0) and utilization.gpu (%, default 0) of every card.
LLMGW_FAKE_SMI_APPS
    Processes holding memory: `<gpu index>:<pid>:<MiB>` comma-separated.
LLMGW_FAKE_SMI_APPS_SPEC_FILE
    A file holding the same form, read at each call when it exists (it wins over
    LLMGW_FAKE_SMI_APPS): a test names processes it starts after the agent.
LLMGW_FAKE_SMI_APPS_FILE
    A recorded `--query-compute-apps` output (CSV with its header, in any
    column order, units or not) whose rows are answered instead, each field
    asked for taken from its column. Recordings mask their GPU UUIDs, so each
    distinct UUID in the file stands for the next fake card in order (the
    first for card 0); pids are answered as recorded, so a test rewrites a row
    to carry the pid it wants.
LLMGW_FAKE_SMI_BUS_IDS
    PCI bus ids of the cards in order, comma-separated (`00000000:A1:00.0,...`), so
    a recorded kernel-log line (`NVRM: Xid (PCI:0000:a1:00): 79, ...`) names a card
    of the fake node; cards past the list keep the made-up ids.
LLMGW_FAKE_SMI_ECC
    Uncorrected volatile ECC counts: `<gpu index>:<count>` comma-separated (default 0).
LLMGW_FAKE_SMI_Q_FILE
    A recorded `nvidia-smi -q` output answered to `-q` (with any `-d`); unset,
    `-q` is refused as an invalid combination of arguments (exit 2).
LLMGW_FAKE_SMI_L_FILE
    A recorded `nvidia-smi -L` output whose `MIG <profile> Device <n>: (UUID:
    MIG-...)` lines are answered to `-L` under the fake cards: the recording's
    first GPU's instances under card 0, and so on. A card with instances
    there has `mig.mode.current` Enabled; other cards of a class that has MIG
    (h100, h200, a100) Disabled; the rest `[N/A]`, as the real one prints.
    With it, also set LLMGW_FAKE_SMI_Q_FILE to the same card's `-q` (whose
    `MIG Device` sections carry the instance ids and memory) and
    LLMGW_FAKE_SMI_BUS_IDS to the bus id that recording names.
LLMGW_FAKE_SMI_MIG_PENDING
    `mig.mode.pending` where it differs: `<gpu index>:<Enabled|Disabled>`
    comma-separated (a mode change waiting for a GPU reset).
LLMGW_FAKE_SMI_DRIVER, LLMGW_FAKE_SMI_CUDA
    Versions in the table header (default 550.54.15 and 12.4).
LLMGW_FAKE_NICS
    Number of mlx5 adapters in `topo -m` (default 0). Adapter k is PIX to the
    GPUs k*G/N .. (k+1)*G/N-1 and NODE/SYS to the rest.

Cards of an SXM class (h100, h200, a100, v100-sxm2) are joined all-to-all by
NVLink (NV18 for h100/h200, NV12 for a100, NV2 for v100); the others by PCIe
(NODE within a half of the cards, SYS across). The first half of the cards
is on NUMA node 0, the rest on node 1.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

__all__ = [
    "APP_FIELDS",
    "CLASSES",
    "DRIVER_FAILED",
    "GPU_FIELDS",
    "MIG_CLASSES",
    "NO_DEVICES",
    "UNITS",
    "Card",
    "cards",
    "install",
    "main",
    "query_apps",
    "query_gpu",
    "table",
    "topo",
]

# class -> (name, memory.total MiB, compute_cap, NVLinks between two cards or 0)
CLASSES: dict[str, tuple[str, int, str, int]] = {
    "h100-80g": ("NVIDIA H100 80GB HBM3", 81559, "9.0", 18),
    "h200-140g": ("NVIDIA H200", 143771, "9.0", 18),
    "a100-80g": ("NVIDIA A100-SXM4-80GB", 81920, "8.0", 12),
    "a100-40g": ("NVIDIA A100-SXM4-40GB", 40960, "8.0", 12),
    "l40s-45g": ("NVIDIA L40S", 46068, "8.9", 0),
    "rtx-6000-ada-48g": ("NVIDIA RTX 6000 Ada Generation", 49140, "8.9", 0),
    "v100-sxm2-32g": ("Tesla V100-SXM2-32GB", 32768, "7.0", 2),
}
NO_DEVICES = "No devices were found"
DRIVER_FAILED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
GPU_FIELDS = (
    "index",
    "uuid",
    "gpu_uuid",
    "name",
    "gpu_name",
    "pci.bus_id",
    "gpu_bus_id",
    "memory.total",
    "memory.used",
    "memory.free",
    "compute_cap",
    "ecc.errors.uncorrected.volatile.total",
    "utilization.gpu",
    "driver_version",
    "count",
    "mig.mode.current",
    "mig.mode.pending",
)
MIG_CLASSES = ("h100-80g", "h200-140g", "a100-80g", "a100-40g")
APP_FIELDS = ("gpu_uuid", "pid", "used_memory", "used_gpu_memory", "process_name")
UNITS = {"memory.total": "MiB", "memory.used": "MiB", "memory.free": "MiB",
         "utilization.gpu": "%", "used_memory": "MiB", "used_gpu_memory": "MiB"}  # fmt: skip


class Card:
    def __init__(self, index: int, cls: str) -> None:
        self.index = index
        self.cls = cls
        self.name, self.total, self.cc, self.nvlinks = CLASSES[cls]
        # Stable across invocations (hash() is salted per process).
        self.uuid = f"GPU-{zlib.crc32(cls.encode()):08x}-{index:04x}-4000-8000-{index:012x}"
        self.bus = f"00000000:{0x18 + 0x10 * index:02X}:00.0"
        given = [b.strip() for b in os.environ.get("LLMGW_FAKE_SMI_BUS_IDS", "").split(",")]
        if index < len(given) and given[index]:
            self.bus = given[index]
        ecc = dict(
            e.split(":", 1) for e in os.environ.get("LLMGW_FAKE_SMI_ECC", "").split(",") if ":" in e
        )
        self.ecc = ecc.get(str(index), "0").strip()


def cards() -> list[Card]:
    spec = os.environ.get("LLMGW_FAKE_GPUS", "").strip()
    result: list[Card] = []
    if spec in ("", "0"):
        return result
    for group in spec.split(","):
        count, _, cls = group.strip().partition("x")
        if cls not in CLASSES or not count.isdigit():
            sys.exit(f"fake nvidia-smi: LLMGW_FAKE_GPUS group {group!r} is not <N>x<class>")
        base = len(result)
        result.extend(Card(base + i, cls) for i in range(int(count)))
    return result


def _old_driver() -> bool:
    return os.environ.get("LLMGW_FAKE_SMI_OLD_DRIVER") == "1"


def _gpu_value(card: Card, field: str, n: int) -> str:
    used = int(os.environ.get("LLMGW_FAKE_SMI_MEM_USED_MIB", "0"))
    values = {
        "index": str(card.index),
        "uuid": card.uuid,
        "gpu_uuid": card.uuid,
        "name": card.name,
        "gpu_name": card.name,
        "pci.bus_id": card.bus,
        "gpu_bus_id": card.bus,
        "memory.total": str(card.total),
        "memory.used": str(used),
        "memory.free": str(card.total - used),
        "compute_cap": card.cc,
        "ecc.errors.uncorrected.volatile.total": card.ecc,
        "utilization.gpu": os.environ.get("LLMGW_FAKE_SMI_UTIL", "0"),
        "driver_version": os.environ.get("LLMGW_FAKE_SMI_DRIVER", "550.54.15"),
        "count": str(n),
    }
    if field.startswith("mig.mode."):
        return _mig_mode(card, field)
    return values[field]


def _recorded_migs() -> list[list[str]]:
    """The MIG lines of LLMGW_FAKE_SMI_L_FILE, grouped by the GPU line above them."""
    recorded = os.environ.get("LLMGW_FAKE_SMI_L_FILE")
    groups: list[list[str]] = []
    for line in Path(recorded).read_text().splitlines() if recorded else ():
        if line.startswith("GPU "):
            groups.append([])
        elif line.strip().startswith("MIG ") and groups:
            groups[-1].append(line)
    return groups


def _mig_mode(card: Card, field: str) -> str:
    if card.cls not in MIG_CLASSES:
        return "[N/A]"
    groups = _recorded_migs()
    current = "Enabled" if card.index < len(groups) and groups[card.index] else "Disabled"
    if field == "mig.mode.current":
        return current
    pending = dict(
        p.split(":", 1)
        for p in os.environ.get("LLMGW_FAKE_SMI_MIG_PENDING", "").split(",")
        if ":" in p
    )
    return pending.get(str(card.index), current).strip()


def _csv(fields: list[str], rows: list[list[str]], fmt: str) -> str:
    opts = set(fmt.split(","))
    if "csv" not in opts:
        return ""
    out = []
    if "noheader" not in opts:
        out.append(", ".join(f + (f" [{UNITS[f]}]" if f in UNITS and "nounits" not in opts
                                  else "") for f in fields))  # fmt: skip
    for row in rows:
        if "nounits" not in opts:
            row = [f"{v} {UNITS[f]}" if f in UNITS else v for f, v in zip(fields, row, strict=True)]
        out.append(", ".join(row))
    return "".join(line + "\n" for line in out)


def _invalid(field: str) -> int:
    # The real one prints this on stdout, followed by a blank line, and exits 2.
    sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
    return 2


def query_gpu(fields: list[str], fmt: str) -> int:
    known = [f for f in GPU_FIELDS if not (_old_driver() and f == "compute_cap")]
    for f in fields:
        if f not in known:
            return _invalid(f)
    found = cards()
    if not found:
        print(NO_DEVICES)
        return 6
    rows = [[_gpu_value(c, f, len(found)) for f in fields] for c in found]
    if _old_driver():
        # An older driver returns a shorter row: the last column is missing.
        fields = fields[:-1]
        rows = [r[:-1] for r in rows]
    sys.stdout.write(_csv(fields, rows, fmt))
    return 0


def query_apps(fields: list[str], fmt: str) -> int:
    for f in fields:
        if f not in APP_FIELDS:
            return _invalid(f)
    found = cards()
    if not found:
        print(NO_DEVICES)
        return 6
    recorded = os.environ.get("LLMGW_FAKE_SMI_APPS_FILE")
    if recorded:
        sys.stdout.write(_csv(fields, _recorded_apps(Path(recorded), fields, found), fmt))
        return 0
    rows = []
    spec = os.environ.get("LLMGW_FAKE_SMI_APPS", "").strip()
    live = os.environ.get("LLMGW_FAKE_SMI_APPS_SPEC_FILE")
    if live and os.path.exists(live):  # the same form, read at each call: a test's processes
        spec = Path(live).read_text().strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        gpu, pid, mib = item.split(":")
        card = found[int(gpu)]
        values = {"gpu_uuid": card.uuid, "pid": pid, "used_memory": mib,
                  "used_gpu_memory": mib, "process_name": "python3"}  # fmt: skip
        rows.append([values[f] for f in fields])
    sys.stdout.write(_csv(fields, rows, fmt))
    return 0


def _recorded_apps(path: Path, fields: list[str], found: list[Card]) -> list[list[str]]:
    """Rows of a recorded compute-apps CSV, as `fields`, on the fake cards."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    header = [h.strip().split(" [", 1)[0] for h in lines[0].split(",")]
    aliases = {"used_memory": "used_gpu_memory", "gpu_uuid": "gpu_uuid"}
    uuids: dict[str, str] = {}
    rows = []
    for line in lines[1:]:
        values = {
            name: value.strip().split(" ", 1)[0] if name in UNITS else value.strip()
            for name, value in zip(header, line.split(","), strict=False)
        }
        recorded_uuid = values.get("gpu_uuid", "")
        if recorded_uuid not in uuids:
            if len(uuids) >= len(found):
                sys.exit(f"fake nvidia-smi: {path} names more GPUs than LLMGW_FAKE_GPUS has")
            uuids[recorded_uuid] = found[len(uuids)].uuid
        values["gpu_uuid"] = uuids[recorded_uuid]
        rows.append([values.get(f, values.get(aliases.get(f, f), "[N/A]")) for f in fields])
    return rows


def table() -> int:
    found = cards()
    if not found:
        print(NO_DEVICES)
        return 6
    driver = os.environ.get("LLMGW_FAKE_SMI_DRIVER", "550.54.15")
    cuda = os.environ.get("LLMGW_FAKE_SMI_CUDA", "12.4")
    bar = "+" + "-" * 89 + "+"
    print("Mon Jan  1 00:00:00 2025")
    print(bar)
    print(f"| NVIDIA-SMI {driver:<22} Driver Version: {driver:<14} CUDA Version: {cuda:<9}|")
    print(bar)
    for c in found:
        print(f"| {c.index:>3}  {c.name[:26]:<26} | {c.bus} |  {c.total}MiB |")
    print(bar)
    return 0


def topo() -> int:
    found = cards()
    if not found:
        print(NO_DEVICES)
        return 6
    n = len(found)
    nics = int(os.environ.get("LLMGW_FAKE_NICS", "0"))
    half = max(1, (n + 1) // 2)

    def socket_of(i: int) -> int:
        return 0 if i < half else 1

    def pcie(a: int, b: int) -> str:
        return "NODE" if socket_of(a) == socket_of(b) else "SYS"

    def nic_gpus(k: int) -> range:
        return range(k * n // nics, (k + 1) * n // nics) if nics else range(0)

    names = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(nics)]
    lines = ["\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i, c in enumerate(found):
        cells = []
        for j, d in enumerate(found):
            if i == j:
                cells.append(" X ")
            elif c.nvlinks and d.nvlinks and c.cls == d.cls:
                cells.append(f"NV{c.nvlinks}")
            else:
                cells.append(pcie(i, j))
        for k in range(nics):
            cells.append("PIX" if i in nic_gpus(k) else pcie(i, nic_gpus(k).start))
        cpus = "0-31" if socket_of(i) == 0 else "32-63"
        lines.append(f"GPU{i}\t" + "\t".join(cells) + f"\t{cpus}\t{socket_of(i)}\t\tN/A")
    for k in range(nics):
        cells = []
        for i in range(n):
            cells.append("PIX" if i in nic_gpus(k) else pcie(i, nic_gpus(k).start))
        for m in range(nics):
            cells.append(" X " if m == k else pcie(nic_gpus(k).start, nic_gpus(m).start))
        lines.append(f"NIC{k}\t" + "\t".join(cells))
    lines += ["", "Legend:", "", "  X    = Self", "  NV#  = Connection traversing a bonded set "
              "of # NVLinks"]  # fmt: skip
    if nics:
        lines += ["", "NIC Legend:", ""] + [f"  NIC{k}: mlx5_{k}" for k in range(nics)]
    print("\n".join(lines))
    return 0


def main(argv: list[str]) -> int:
    if os.environ.get("LLMGW_FAKE_SMI_FAIL") == "driver":
        print(DRIVER_FAILED)
        return 9
    if not argv:
        return table()
    if argv[:2] == ["topo", "-m"]:
        return topo()
    if argv == ["-L"]:
        found = cards()
        if not found:
            print(NO_DEVICES)
            return 6
        groups = _recorded_migs()
        for c in found:
            print(f"GPU {c.index}: {c.name} (UUID: {c.uuid})")
            for line in groups[c.index] if c.index < len(groups) else ():
                print(line)
        return 0
    recorded_q = os.environ.get("LLMGW_FAKE_SMI_Q_FILE")
    if argv[:1] == ["-q"] and recorded_q:
        sys.stdout.write(Path(recorded_q).read_text())
        return 0
    fmt = ""
    query: tuple[str, list[str]] | None = None
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "--format":
            fmt = value
        elif key in ("--query-gpu", "--query-compute-apps"):
            query = (key, [f.strip() for f in value.split(",") if f.strip()])
        else:
            print(f"Invalid combination of input arguments: {arg}. Please run 'nvidia-smi -h'.")
            return 2
    if query is None or not fmt.startswith("csv"):
        print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
        return 2
    if query[0] == "--query-gpu":
        return query_gpu(query[1], fmt)
    return query_apps(query[1], fmt)


def install(bin_dir: Path, python: str = sys.executable) -> Path:
    """Write an executable `nvidia-smi` in `bin_dir` that runs this module; return its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-smi"
    path.write_text(f'#!/bin/sh\nexec "{python}" -m llmgw.testing.fake_nvidia_smi "$@"\n')
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
