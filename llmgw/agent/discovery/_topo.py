"""Parser for `nvidia-smi topo -m`.

The matrix has a header row of column names, then one row per GPU and per
network adapter. Two layouts exist:

- newer drivers name adapters NIC0, NIC1... and map them to device names in a
  "NIC Legend:" section after the matrix ("NIC0: mlx5_0");
- older drivers use the device names (mlx5_0) as the columns directly.

Cells are separated by tabs in the real output and by runs of spaces in every
paste that went through a web page, so cells are split on whitespace. No cell
holds a space; the only column names that do ("CPU Affinity", "NUMA Affinity",
"GPU NUMA ID") are known and are matched before splitting. Old drivers
(440 and before) print only "CPU Affinity", with no NUMA column.
"""

from __future__ import annotations

import re

import attrs

from llmgw.errors import ParseError
from llmgw.model import NicDistance, NvLink, Topology

_SOURCE = "nvidia-smi topo -m"
_MULTIWORD = {
    "GPU NUMA ID": "GPU_NUMA_ID",
    "CPU Affinity": "CPU_Affinity",
    "NUMA Affinity": "NUMA_Affinity",
}
_GPU = re.compile(r"GPU(\d+)")
_NV = re.compile(r"NV(\d+)")
# X is self; NV# is bonded NVLinks; the rest are PCIe path kinds (SOC was
# the name of SYS before driver 384).
_CELL = re.compile(r"X|NV\d+|SYS|NODE|PHB|PXB|PIX|SOC")
_LEGEND_ENTRY = re.compile(r"\s*(NIC\d+)\s*:\s*(\S+)\s*")


@attrs.frozen
class GpuAffinity:
    """Where one GPU sits: the CPUs and NUMA node closest to it (None: not shown)."""

    index: int
    cpu_affinity: str | None
    numa_node: int | None


@attrs.frozen
class TopoMatrix:
    topology: Topology
    affinity: tuple[GpuAffinity, ...]


def _header_cells(line: str) -> list[str]:
    for words, token in _MULTIWORD.items():
        line = re.sub(r"\s+".join(words.split()), token, line)
    return line.split()


def parse_topo(text: str, *, source: str = _SOURCE) -> TopoMatrix:
    """NVLink pairs, GPU-to-adapter distances and per-GPU affinity from `topo -m`."""
    lines = [ln.rstrip("\r") for ln in text.splitlines()]
    try:
        start = next(i for i, ln in enumerate(lines) if "GPU0" in ln.split())
    except StopIteration:
        raise ParseError(source, "no header row naming GPU0") from None
    columns = _header_cells(lines[start])
    if columns[0] != "GPU0":
        raise ParseError(source, f"header row does not start with GPU0: {lines[start]!r}")
    if len(set(columns)) != len(columns):
        raise ParseError(source, f"a column is named twice: {columns}")
    legend = _nic_legend(lines[start + 1 :])

    matrix_rows: list[list[str]] = []
    for ln in lines[start + 1 :]:
        if not ln.strip() or ln.strip().startswith("Legend"):
            break
        matrix_rows.append(ln.split())
    if not matrix_rows:
        raise ParseError(source, "header row but no GPU rows")

    device_cols = [c for c in columns if c not in _MULTIWORD.values()]
    attr_cols = [c for c in columns if c in _MULTIWORD.values()]
    if columns != device_cols + attr_cols:
        raise ParseError(source, f"affinity columns are not last: {columns}")

    nvlinks: dict[tuple[int, int], int] = {}
    distances: list[NicDistance] = []
    affinity: list[GpuAffinity] = []
    for cells in matrix_rows:
        label, values = cells[0], cells[1:]
        if label not in device_cols:
            raise ParseError(source, f"row {label!r} is not a column of the header {columns}")
        if len(values) > len(columns):
            raise ParseError(
                source, f"row {label} has {len(values)} cells for {len(columns)} columns"
            )
        row_gpu = _GPU.fullmatch(label)
        if row_gpu is None:
            # An adapter's own row repeats what the GPU rows said.
            continue
        if len(values) < len(device_cols):
            raise ParseError(
                source, f"row {label} has {len(values)} cells for {len(device_cols)} devices"
            )
        a = int(row_gpu.group(1))
        for col, cell in zip(device_cols, values, strict=False):
            if not _CELL.fullmatch(cell):
                raise ParseError(source, f"row {label}, column {col}: {cell!r} is not a link")
            col_gpu = _GPU.fullmatch(col)
            if col_gpu is not None:
                b = int(col_gpu.group(1))
                nv = _NV.fullmatch(cell)
                if nv is not None and a != b:
                    nvlinks.setdefault((min(a, b), max(a, b)), int(nv.group(1)))
            elif cell != "X":
                distances.append(NicDistance(gpu=a, nic=legend.get(col, col), distance=cell))
        attrs_here = dict(zip(attr_cols, values[len(device_cols) :], strict=False))
        affinity.append(
            GpuAffinity(
                index=a,
                cpu_affinity=_affinity(attrs_here.get("CPU_Affinity"), label, source),
                numa_node=_numa(attrs_here.get("NUMA_Affinity"), label, source),
            )
        )
    if not affinity:
        raise ParseError(source, "no GPU rows")
    return TopoMatrix(
        topology=Topology(
            nvlinks=tuple(NvLink(a, b, n) for (a, b), n in sorted(nvlinks.items())),
            nic_distances=tuple(distances),
        ),
        affinity=tuple(affinity),
    )


def _nic_legend(lines: list[str]) -> dict[str, str]:
    legend: dict[str, str] = {}
    in_legend = False
    for ln in lines:
        if ln.strip() == "NIC Legend:":
            in_legend = True
            continue
        if not in_legend or not ln.strip():
            continue
        m = _LEGEND_ENTRY.fullmatch(ln)
        if m is None:
            # Whatever a wrapper printed after the legend (check_env goes on
            # with ulimits) is not ours to judge.
            break
        legend[m.group(1)] = m.group(2)
    return legend


def _affinity(value: str | None, row: str, source: str) -> str | None:
    if value is None or value == "N/A":
        return None
    if not re.fullmatch(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*", value):
        raise ParseError(source, f"row {row}: CPU Affinity {value!r} is not a CPU list")
    return value


def _numa(value: str | None, row: str, source: str) -> int | None:
    if value is None or value == "N/A":
        return None
    if value.isdecimal():
        return int(value)
    # A GPU close to several nodes prints a range ("0-1"): no single node.
    if re.fullmatch(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*", value):
        return None
    raise ParseError(source, f"row {row}: NUMA Affinity {value!r} is not a node number")
