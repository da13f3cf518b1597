"""Parsers for what the host says about itself: CPU, memory, load.

Pure functions from the text of /proc files and `lscpu` to values. Every input
that cannot be read raises `ParseError(source, problem)`. The OS (os-release) is
parsed by `llmgw.host.os_release`, which the control plane uses too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

from llmgw.errors import ParseError

# --- CPU ---------------------------------------------------------------------------

# Vector instruction sets an inference engine's kernels are chosen by. Every
# other flag (fpu, tsc, cqm_llc...) says nothing about inference speed.
_VECTOR_FLAG = re.compile(
    r"mmx|sse|sse2|ssse3|sse4_1|sse4_2|sse4a|avx|avx2|fma|fma4|f16c|xop"
    r"|avx\w*|amx\w*"
    # aarch64 (/proc/cpuinfo "Features", lscpu "Flags")
    r"|asimd\w*|sve\w*|sme(?!p)\w*|i8mm|bf16|fphp|neon"
)


def vector_flags(flags: Iterable[str]) -> tuple[str, ...]:
    """The vector-related flags among `flags`, in their order, once each."""
    seen: dict[str, None] = {}
    for f in flags:
        if _VECTOR_FLAG.fullmatch(f):
            seen.setdefault(f, None)
    return tuple(seen)


@attrs.frozen
class CpuInfo:
    model: str | None
    count: int | None  # logical CPUs
    flags: tuple[str, ...] | None  # vector extensions only; None: not reported
    arch: str | None = None
    hypervisor: bool | None = None  # the `hypervisor` flag: we run in a VM


def _is_x86(cpu: CpuInfo) -> bool:
    if cpu.arch is not None:
        return cpu.arch in ("x86_64", "i686", "i386", "amd64")
    return cpu.flags is not None and "sse2" in cpu.flags


def cpu_warnings(cpu: CpuInfo) -> tuple[str, ...]:
    """What an operator should fix about this CPU.

    Without AVX2 llama.cpp and the CPU paths of the others fall back to scalar
    code. It is nearly always a VM whose CPU type hides the host's features
    (QEMU's default qemu64), so the fix is named.
    """
    if cpu.flags is None or not _is_x86(cpu) or "avx2" in cpu.flags:
        return ()
    model = cpu.model or "unknown model"
    advice = (
        "set the VM CPU type to host" if cpu.hypervisor is not False else ("use a CPU with AVX2")
    )
    return (f"CPU has no AVX2 ({model}): inference will be several times slower; {advice}",)


def parse_cpuinfo(text: str, *, source: str = "/proc/cpuinfo") -> CpuInfo:
    """CPU model, logical CPU count and vector flags from /proc/cpuinfo.

    The count is the number of `processor` entries (one per online logical
    CPU). x86 names the model "model name" and the flags "flags"; aarch64
    says "Features" and often has no model name at all.
    """
    count = 0
    model: str | None = None
    raw_flags: list[str] | None = None
    for ln in text.splitlines():
        if not ln.strip():
            continue
        if ":" not in ln:
            raise ParseError(source, f"line is not 'key : value': {ln[:80]!r}")
        key, _, value = ln.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key == "processor":
            if not value.isdecimal():
                # s390x prints "processor 0: version = ..." lines; not ours.
                raise ParseError(source, f"processor is {value[:40]!r}, not a number")
            count += 1
        elif key in ("model name", "cpu model") and model is None and value:
            model = value
        elif key in ("flags", "features") and raw_flags is None:
            raw_flags = value.split()
    if count == 0 and model is None and raw_flags is None:
        raise ParseError(source, "no processor, model name or flags line")
    return CpuInfo(
        model=model,
        count=count or None,
        flags=None if raw_flags is None else vector_flags(raw_flags),
        hypervisor=None if raw_flags is None else "hypervisor" in raw_flags,
    )


_LSCPU_KEY = re.compile(r"(\s*)([A-Za-z][^:]*):(\s*)(.*)")


def lscpu_fields(text: str, *, source: str = "lscpu") -> dict[str, str]:
    """Every `Key: value` of `lscpu`, with wrapped values joined again.

    lscpu run on a terminal wraps the Flags value at the terminal's width, in
    the middle of a word ("a" / "md_lbr_v2"). A continuation line has no colon
    and is indented to the value column; it is joined to the previous value
    without adding a space, so a word cut in two is whole again, and a wrap
    that fell between words keeps its leading space.
    """
    values: dict[str, str] = {}
    last_key: str | None = None
    value_col = 0
    for ln in text.splitlines():
        if not ln.strip():
            last_key = None
            continue
        if last_key is not None and _is_continuation(ln, value_col):
            values[last_key] = values[last_key] + ln[value_col:].rstrip()
            continue
        m = _LSCPU_KEY.fullmatch(ln.rstrip())
        if m is None:
            raise ParseError(
                source, f"line is neither 'Key: value' nor a wrapped value: {ln[:80]!r}"
            )
        key = m.group(2).strip()
        value_col = len(m.group(1)) + len(m.group(2)) + 1 + len(m.group(3))
        values.setdefault(key, m.group(4))
        last_key = key
    if not values:
        raise ParseError(source, "no 'Key: value' lines")
    return values


def parse_lscpu(text: str, *, source: str = "lscpu") -> CpuInfo:
    """CPU model, logical CPU count, architecture and vector flags from `lscpu`."""
    values = lscpu_fields(text, source=source)
    count_text = values.get("CPU(s)")
    count: int | None = None
    if count_text is not None:
        if not count_text.strip().isdecimal():
            raise ParseError(source, f"CPU(s) is {count_text!r}, not a number")
        count = int(count_text)
    raw_flags = values["Flags"].split() if "Flags" in values else None
    hypervisor: bool | None
    if "Hypervisor vendor" in values:
        hypervisor = True
    elif raw_flags is not None:
        hypervisor = "hypervisor" in raw_flags
    else:
        hypervisor = None
    return CpuInfo(
        model=values.get("Model name") or None,
        count=count,
        flags=None if raw_flags is None else vector_flags(raw_flags),
        arch=values.get("Architecture") or None,
        hypervisor=hypervisor,
    )


def _is_continuation(line: str, value_col: int) -> bool:
    # Only a flag list wraps, and flags never hold a colon.
    return (
        value_col > 0 and ":" not in line and len(line) > value_col and not line[:value_col].strip()
    )


# --- Memory, load, CPU time ---------------------------------------------------------------


@attrs.frozen
class MemInfo:
    total_bytes: int | None
    available_bytes: int | None  # None before Linux 3.14, which had no MemAvailable


_MEMINFO_LINE = re.compile(r"([A-Za-z0-9_()]+):\s*(\d+)(?:\s*(kB))?")


def parse_meminfo(text: str, *, source: str = "/proc/meminfo") -> MemInfo:
    values: dict[str, int] = {}
    for ln in text.splitlines():
        if not ln.strip():
            continue
        m = _MEMINFO_LINE.fullmatch(ln.strip())
        if m is None:
            raise ParseError(source, f"line is not 'Key: N kB': {ln[:80]!r}")
        values[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    if "MemTotal" not in values:
        raise ParseError(source, "no MemTotal line")
    return MemInfo(values["MemTotal"], values.get("MemAvailable"))


@attrs.frozen
class LoadAvg:
    load1: float
    load5: float
    load15: float


def parse_loadavg(text: str, *, source: str = "/proc/loadavg") -> LoadAvg:
    """`0.52 0.58 0.59 1/467 12345` -> the three load averages."""
    parts = text.split()
    if len(parts) < 3:
        raise ParseError(source, f"expected three load averages, got {text.strip()[:80]!r}")
    try:
        return LoadAvg(float(parts[0]), float(parts[1]), float(parts[2]))
    except ValueError:
        raise ParseError(source, f"load averages are not numbers: {text.strip()[:80]!r}") from None


@attrs.frozen
class CpuTimes:
    """Cumulative jiffies of all CPUs: busy (not idle or iowait) and total."""

    busy: int
    total: int


def parse_proc_stat(text: str, *, source: str = "/proc/stat") -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat."""
    for ln in text.splitlines():
        parts = ln.split()
        if parts and parts[0] == "cpu":
            if len(parts) < 5 or not all(p.isdecimal() for p in parts[1:]):
                raise ParseError(source, f"cpu line is not numbers: {ln[:120]!r}")
            # user nice system idle iowait irq softirq steal guest guest_nice;
            # guest time is already counted in user, so it is left out of the total.
            n = [int(p) for p in parts[1:9]]
            idle = n[3] + (n[4] if len(n) > 4 else 0)
            total = sum(n)
            return CpuTimes(busy=total - idle, total=total)
    raise ParseError(source, "no aggregate 'cpu' line")


def cpu_util_pct(before: CpuTimes, after: CpuTimes) -> float | None:
    """Percent of all CPUs busy between two samples; None when it cannot tell."""
    total = after.total - before.total
    busy = after.busy - before.busy
    if total <= 0 or busy < 0:
        return None
    return min(100.0, 100.0 * busy / total)
