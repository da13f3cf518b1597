"""Parsers for nvidia-smi's CSV queries and its version header.

Pure functions from text to values; nothing here runs a command. Every input
that cannot be read raises `ParseError(source, problem)`.

nvidia-smi's CSV is not quoted (no GPU name or field holds a comma), values are
separated by ", ", and a value nvidia-smi cannot give is printed in brackets:
`[N/A]`, `[Not Supported]` (older drivers), `[Unknown Error]`,
`[Requested functionality has been deprecated]`. Every bracketed value is read
as unknown (None), never as 0.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence

import attrs

from llmgw.errors import ParseError
from llmgw.model import Gpu

#: What the probe asks for, in this order. utilization.gpu is last on purpose:
#: an older driver that returns a shorter row loses only that column.
GPU_QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "memory.total",
    "memory.used",
    "compute_cap",
    "ecc.errors.uncorrected.volatile.total",
    "utilization.gpu",
)
#: A row without these is not a card.
GPU_REQUIRED_FIELDS: frozenset[str] = frozenset({"index", "uuid", "name"})

COMPUTE_APPS_FIELDS: tuple[str, ...] = ("gpu_uuid", "pid", "used_memory")

# nvidia-smi accepts several names for one property and prints the long one in
# its header (`--query-compute-apps=used_memory` prints `used_gpu_memory`).
_ALIASES: Mapping[str, str] = {
    "gpu_uuid": "uuid",
    "gpu_name": "name",
    "gpu_bus_id": "pci.bus_id",
    "gpu_serial": "serial",
    "used_gpu_memory": "used_memory",
    "utilization.gpu": "utilization.gpu",
}

_HEADER_CELL = re.compile(r"[a-z][A-Za-z0-9_.]*")
_UNIT_SUFFIX = re.compile(r"\s*\[[^\]]*\]$")
_NUMBER = re.compile(r"(-?\d+(?:\.\d+)?)(?:\s*(?:[KMGT]i?B|%|W|MHz|C))?")
_INVALID_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
_NO_PROCESSES = "No running processes found"


def canonical_field(name: str) -> str:
    """The name a field is keyed by, whichever alias asked for or printed it."""
    bare = _UNIT_SUFFIX.sub("", name.strip())
    return _ALIASES.get(bare, bare)


def invalid_query_field(output: str) -> str | None:
    """The field nvidia-smi refused ('Field "compute_cap" is not a valid field to query.')."""
    m = _INVALID_FIELD.search(output)
    return m.group(1) if m else None


def _value(cell: str) -> str | None:
    v = cell.strip()
    if not v or (v.startswith("[") and v.endswith("]")) or v in ("N/A", "Not Supported"):
        return None
    return v


def _is_header(cells: Sequence[str]) -> bool:
    return all(_HEADER_CELL.fullmatch(_UNIT_SUFFIX.sub("", c.strip())) for c in cells)


def parse_smi_csv(
    text: str,
    fields: Sequence[str] | None = None,
    *,
    source: str = "nvidia-smi --format=csv",
) -> tuple[dict[str, str | None], ...]:
    """Rows of a `--format=csv` answer, keyed by canonical field name.

    With a header line (plain `csv`, with or without units) the header names
    the columns; without one (`noheader`) `fields` does, and is required. A row
    shorter than its columns leaves the missing trailing ones unknown: an older
    driver drops the columns it does not know from the end. Units ("81559 MiB",
    "100 %") are left on the value; `smi_int`/`smi_float` read through them.
    """
    return _parse_table(text, fields, source)[1]


def _parse_table(
    text: str, fields: Sequence[str] | None, source: str
) -> tuple[list[str], tuple[dict[str, str | None], ...]]:
    lines = [ln.rstrip("\r") for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        return [canonical_field(f) for f in fields or ()], ()
    first = lines[0].split(",")
    if _is_header(first):
        columns = [canonical_field(c) for c in first]
        body = lines[1:]
    elif fields is not None:
        columns = [canonical_field(f) for f in fields]
        body = lines
    else:
        raise ParseError(source, f"no header line and no field list: {lines[0][:80]!r}")
    if len(set(columns)) != len(columns):
        raise ParseError(source, f"a column is named twice in {columns}")
    rows: list[dict[str, str | None]] = []
    for ln in body:
        if ln.strip() == _NO_PROCESSES:
            continue
        cells = ln.split(",")
        if len(cells) > len(columns):
            raise ParseError(
                source, f"row has {len(cells)} values for {len(columns)} columns: {ln[:120]!r}"
            )
        row: dict[str, str | None] = dict.fromkeys(columns)
        for col, cell in zip(columns, cells, strict=False):
            row[col] = _value(cell)
        rows.append(row)
    return columns, tuple(rows)


def _require(columns: Sequence[str], required: Iterable[str], source: str) -> None:
    missing = sorted(set(required) - set(columns))
    if missing:
        raise ParseError(source, f"no {', '.join(missing)} column among {list(columns)}")


def smi_int(value: str | None, *, source: str, field: str) -> int | None:
    """An integer value ("81559", "81559 MiB"); None stays None."""
    if value is None:
        return None
    m = _NUMBER.fullmatch(value.strip())
    if m is None or "." in m.group(1):
        raise ParseError(source, f"{field} is {value!r}, not a whole number")
    return int(m.group(1))


def smi_float(value: str | None, *, source: str, field: str) -> float | None:
    """A number ("37", "37.5 %"); None stays None."""
    if value is None:
        return None
    m = _NUMBER.fullmatch(value.strip())
    if m is None:
        raise ParseError(source, f"{field} is {value!r}, not a number")
    return float(m.group(1))


# --- GPU class ------------------------------------------------------------------

_VENDOR_WORDS = frozenset({"nvidia", "geforce", "tesla", "generation"})
_SIZE_WORD = re.compile(r"\d+(?:\.\d+)?(?:gb|g|gib)")
_MEMORY_TYPE_WORD = re.compile(r"(?:hbm\d*e?|gddr\d+x?)")


def gpu_class(name: str, memory_total_mib: int | None) -> str:
    """The class placement matches cards by: `<model>-<GiB>g`.

    The rule, applied to the product name and memory.total as the driver
    reports them:

    1. lowercase; split into words at spaces, '-' and '_';
    2. drop vendor and filler words: "NVIDIA", "GeForce", "Tesla",
       "Generation" (the driver prints "NVIDIA RTX 6000 Ada Generation");
    3. drop words that state a memory size or type ("80GB", "32GB", "HBM3",
       "HBM2e", "GDDR6X"): the size comes from memory.total instead, so the
       same card with more memory is a different class, and two spellings of
       one card are one class;
    4. join the rest with '-', and append '-<N>g' where N is memory.total in
       MiB divided by 1024, rounded to the nearest whole GiB (half up).
       Drivers report a little less than the marketed size (the L40S's
       48 GB is 46068 MiB = 44.99 GiB; the H100's 80 GB is 81559 MiB =
       79.6 GiB), so rounding rather than flooring keeps 79.6 at 80.

    Examples: "NVIDIA H100 80GB HBM3", 81559 -> "h100-80g"; "NVIDIA L40S",
    46068 -> "l40s-45g"; "NVIDIA H200", 143771 -> "h200-140g";
    "Tesla V100-SXM2-32GB", 32768 -> "v100-sxm2-32g"; "NVIDIA H100 PCIe",
    81559 -> "h100-pcie-80g". When memory.total is unknown the class is the
    model words alone ("h100"); a name with no model word is "gpu".
    """
    words = [w for w in re.split(r"[\s\-_]+", name.lower()) if w]
    kept = [
        w
        for w in words
        if w not in _VENDOR_WORDS
        and not _SIZE_WORD.fullmatch(w)
        and not _MEMORY_TYPE_WORD.fullmatch(w)
    ]
    model = "-".join(re.sub(r"[^a-z0-9.+]", "", w) for w in kept).strip("-") or "gpu"
    model = re.sub(r"-{2,}", "-", model)
    if memory_total_mib is None:
        return model
    gib = (memory_total_mib * 2 + 1024) // 2048  # round half up, in integers
    return f"{model}-{gib}g"


# --- --query-gpu ------------------------------------------------------------------


def parse_gpu_csv(
    text: str,
    fields: Sequence[str] = GPU_QUERY_FIELDS,
    *,
    source: str = "nvidia-smi --query-gpu",
) -> tuple[Gpu, ...]:
    """Cards from `--query-gpu=<fields> --format=csv[,noheader][,nounits]`.

    index, uuid and name are required per row; everything else is optional and
    unknown when absent, bracketed, or cut off the end of a short row.
    """
    gpus: list[Gpu] = []
    columns, rows = _parse_table(text, fields, source)
    if rows or text.strip():
        _require(columns, GPU_REQUIRED_FIELDS, source)
    for row in rows:
        missing = sorted(f for f in GPU_REQUIRED_FIELDS if row.get(f) is None)
        if missing:
            raise ParseError(source, f"a row has no {', '.join(missing)}: {row}")
        index = smi_int(row["index"], source=source, field="index")
        assert index is not None  # checked above; narrows for mypy
        name = row["name"] or ""
        total = smi_int(row.get("memory.total"), source=source, field="memory.total")
        gpus.append(
            Gpu(
                index=index,
                uuid=row["uuid"] or "",
                name=name,
                gpu_class=gpu_class(name, total),
                pci_bus_id=row.get("pci.bus_id"),
                memory_total_mib=total,
                memory_used_mib=smi_int(row.get("memory.used"), source=source, field="memory.used"),
                compute_capability=_compute_cap(row.get("compute_cap"), source),
                ecc_uncorrected=smi_int(
                    row.get("ecc.errors.uncorrected.volatile.total"),
                    source=source,
                    field="ecc.errors.uncorrected.volatile.total",
                ),
                utilization_pct=smi_float(
                    row.get("utilization.gpu"), source=source, field="utilization.gpu"
                ),
            )
        )
    indexes = [g.index for g in gpus]
    if len(set(indexes)) != len(indexes):
        raise ParseError(source, f"a GPU index appears twice: {indexes}")
    return tuple(gpus)


def _compute_cap(value: str | None, source: str) -> str | None:
    if value is None:
        return None
    if not re.fullmatch(r"\d+\.\d+", value):
        raise ParseError(source, f"compute_cap is {value!r}, not major.minor")
    return value


# --- --query-compute-apps ------------------------------------------------------------


@attrs.frozen
class ComputeApp:
    """A process holding memory on a card. `used_memory_mib` None: not reported."""

    gpu_uuid: str
    pid: int
    used_memory_mib: int | None


def parse_compute_apps(
    text: str,
    fields: Sequence[str] = COMPUTE_APPS_FIELDS,
    *,
    source: str = "nvidia-smi --query-compute-apps",
) -> tuple[ComputeApp, ...]:
    """Processes from `--query-compute-apps=gpu_uuid,pid,used_memory --format=csv`."""
    apps: list[ComputeApp] = []
    columns, rows = _parse_table(text, fields, source)
    if rows:
        _require(columns, ("uuid", "pid"), source)
    for row in rows:
        uuid = row.get("uuid")
        pid = smi_int(row.get("pid"), source=source, field="pid")
        if uuid is None or pid is None:
            raise ParseError(source, f"a process row has no gpu_uuid or pid: {row}")
        used = smi_int(row.get("used_memory"), source=source, field="used_memory")
        apps.append(ComputeApp(uuid, pid, used))
    return tuple(apps)


def foreign_memory_mib(
    apps: Iterable[ComputeApp], gpu_uuids: Iterable[str], llmgw_pids: Collection[int]
) -> dict[str, int | None]:
    """Memory per card held by processes llmgw did not start.

    A card with no such process holds 0 (the query answered, and it listed
    none). A card where one of them has no reported size is unknown (None):
    part of an unknown is unknown.
    """
    result: dict[str, int | None] = dict.fromkeys(gpu_uuids, 0)
    for app in apps:
        if app.pid in llmgw_pids or app.gpu_uuid not in result:
            continue
        held = result[app.gpu_uuid]
        if held is None or app.used_memory_mib is None:
            result[app.gpu_uuid] = None
        else:
            result[app.gpu_uuid] = held + app.used_memory_mib
    return result


# --- Versions -------------------------------------------------------------------------

_DRIVER_VERSION = re.compile(r"Driver Version\s*:\s*([0-9][0-9.]*)")
_CUDA_VERSION = re.compile(r"CUDA Version\s*:\s*([0-9][0-9.]*)")


@attrs.frozen
class SmiVersions:
    driver: str | None
    cuda: str | None


def parse_smi_versions(text: str, *, source: str = "nvidia-smi") -> SmiVersions:
    """Driver and CUDA versions from plain `nvidia-smi` or `nvidia-smi -q`.

    Both print "Driver Version: 575.51.03" and "CUDA Version: 12.9" (the table
    on one line, -q with aligned colons). Raises when neither is there: that
    is not nvidia-smi's output.
    """
    d = _DRIVER_VERSION.search(text)
    c = _CUDA_VERSION.search(text)
    if d is None and c is None:
        raise ParseError(source, "no 'Driver Version' or 'CUDA Version' in the output")
    return SmiVersions(d.group(1) if d else None, c.group(1) if c else None)
