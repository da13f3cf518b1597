"""GPU faults: what an Xid means, whose fault it is, and what llmgw does about it.

Pure: a kernel-log line or an Xid number in, values out. The agent reads the
lines (llmgw/agent/_gpu_faults.py) and NVML's events; the control plane acts on
the health the agent reports (llmgw/core/_facts.py `gpu_drains`, placement).

The table follows NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors):

| Xid | meaning                                         | whose       | llmgw      |
|-----|-------------------------------------------------|-------------|------------|
| 13  | Graphics Engine Exception                       | application | reported   |
| 31  | GPU memory page fault                           | application | reported   |
| 43  | GPU stopped processing                          | application | reported   |
| 45  | Preemptive cleanup, due to previous errors      | application | reported   |
| 48  | Double Bit ECC Error                            | hardware    | unusable   |
| 61  | Internal micro-controller breakpoint/warning    | driver      | reported   |
| 62  | Internal micro-controller halt                  | hardware    | unusable   |
| 63  | ECC page retirement or row remapping recorded   | hardware    | reported   |
| 64  | ECC page retirement or row remapping failure    | hardware    | unusable   |
| 74  | NVLink Error                                    | hardware    | unusable   |
| 79  | GPU has fallen off the bus                      | hardware    | unusable   |
| 92  | High single-bit ECC error rate                  | hardware    | reported   |
| 94  | Contained ECC error                             | hardware    | reported   |
| 95  | Uncontained ECC error                           | hardware    | unusable   |
| 119 | GSP RPC timeout                                 | driver      | unusable   |
| 120 | GSP error                                       | driver      | unusable   |
| 140 | Unrecovered ECC error                           | hardware    | unusable   |

"unusable": the card is marked unhealthy, placement leaves it out and its
replicas are replaced elsewhere, then stopped (a drain of that card only).
"reported": an event, nothing moves. An Xid not in the table is reported
("unknown Xid 999"): a number llmgw does not know must not empty a node.
An uncorrected ECC count above zero since the driver loaded (nvidia-smi's
`ecc.errors.uncorrected.volatile.total`, NVML's volatile uncorrected count)
is unusable too: the card needs a reset before its memory is trusted again;
so are rows waiting to be remapped, a failed remapping and retired pages
waiting for a reset (`nvidia-smi -q`'s Remapped Rows and Retired Pages).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final

import attrs

from llmgw.model import GpuFault, GpuHealth

APPLICATION = "application"
HARDWARE = "hardware"
DRIVER = "driver"

FAULTS_KEPT: Final = 8  # per card: the newest few, the first unusable one always among them


@attrs.frozen
class XidClass:
    meaning: str
    whose: str  # application | hardware | driver
    unusable: bool  # the card is taken out; False: reported only


XID_CLASSES: Final[dict[int, XidClass]] = {
    13: XidClass("Graphics Engine Exception", APPLICATION, False),
    31: XidClass("GPU memory page fault", APPLICATION, False),
    43: XidClass("GPU stopped processing", APPLICATION, False),
    45: XidClass("Preemptive cleanup, due to previous errors", APPLICATION, False),
    48: XidClass("Double Bit ECC Error", HARDWARE, True),
    61: XidClass("Internal micro-controller breakpoint/warning", DRIVER, False),
    62: XidClass("Internal micro-controller halt", HARDWARE, True),
    63: XidClass("ECC page retirement or row remapping recorded", HARDWARE, False),
    64: XidClass("ECC page retirement or row remapping failure", HARDWARE, True),
    74: XidClass("NVLink Error", HARDWARE, True),
    79: XidClass("GPU has fallen off the bus", HARDWARE, True),
    92: XidClass("High single-bit ECC error rate", HARDWARE, False),
    94: XidClass("Contained ECC error", HARDWARE, False),
    95: XidClass("Uncontained ECC error", HARDWARE, True),
    119: XidClass("GSP RPC timeout", DRIVER, True),
    120: XidClass("GSP error", DRIVER, True),
    140: XidClass("Unrecovered ECC error", HARDWARE, True),
}


def classify_xid(xid: int) -> XidClass:
    """What an Xid means; one not in the table is reported, never acted on."""
    return XID_CLASSES.get(xid) or XidClass(f"unknown Xid {xid}", "unknown", False)


# `NVRM: Xid (PCI:0000:a1:00): 79, pid=..., GPU has fallen off the bus.` after any prefix
# (dmesg's `[  12.3]`, dmesg -T's `[Fri Apr  5 ...]`, syslog's `Dec  2 ... kernel: `,
# /dev/kmsg's `6,1234,5678,-;`). Older drivers print the bus without `PCI:`.
_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.\d)?)\)"
    r":? (?P<xid>\d{1,5})(?:,\s*(?P<rest>.*))?$"
)


@attrs.frozen
class XidLine:
    bus: str  # normalised as `pci_key` does: "0000:a1:00"
    xid: int
    text: str  # the driver's words after the number


def pci_key(bus_id: str) -> str | None:
    """A PCI address as `DDDD:BB:DD`, lower case, without the function: the kernel log
    prints `0000:a1:00`, nvidia-smi `00000000:A1:00.0`, NVML the same. None: not one."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) != 3:
        return None
    domain, bus, dev = parts
    dev = dev.split(".", 1)[0]
    try:
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}"
    except ValueError:
        return None


def parse_xid_line(line: str) -> XidLine | None:
    """The Xid a kernel-log line reports, or None for any other line."""
    m = _XID_LINE.search(line.rstrip("\r\n"))
    if m is None:
        return None
    bus = pci_key(m.group("bus"))
    if bus is None:
        return None
    return XidLine(bus, int(m.group("xid")), (m.group("rest") or "").strip())


def xid_fault(
    xid: int, at: float, *, source: str | None = None, line: str | None = None
) -> GpuFault:
    c = classify_xid(xid)
    return GpuFault("xid", c.meaning, c.unusable, at, xid=xid, source=source, line=line)


def ecc_fault(count: int, at: float, source: str | None = None) -> GpuFault:
    """A card that counts uncorrected ECC errors since the driver loaded."""
    s = "s" if count != 1 else ""
    meaning = f"{count} uncorrected ECC error{s} since the driver loaded"
    return GpuFault("ecc", meaning, True, at, source=source)


# What `nvidia-smi -q` (or NVML) says of a card's memory that takes it out until a reset.
REMAP_PENDING = "row remapping pending: the card needs a reset"
REMAP_FAILED = "row remapping failed: the card cannot hide its bad memory"
RETIRED_PENDING = "retired pages pending: the card needs a reset"


def memory_faults(
    at: float,
    *,
    remap_pending: bool | None,
    remap_failed: bool | None,
    retired_pending: bool | None,
    source: str | None = None,
) -> tuple[GpuFault, ...]:
    """The faults a card's memory-error state makes; unknown (None) makes none."""
    said = ((remap_failed, REMAP_FAILED), (remap_pending, REMAP_PENDING),
            (retired_pending, RETIRED_PENDING))  # fmt: skip
    return tuple(GpuFault("memory", words, True, at, source=source) for flag, words in said if flag)


def fault_words(fault: GpuFault) -> str:
    """`Xid 79 (GPU has fallen off the bus)`, or the ECC words."""
    if fault.xid is not None:
        return f"Xid {fault.xid} ({fault.meaning})"
    return fault.meaning


def gpu_health(faults: Iterable[GpuFault]) -> GpuHealth:
    return GpuHealth.UNHEALTHY if any(f.unusable for f in faults) else GpuHealth.OK


def first_unusable(faults: Sequence[GpuFault] | None) -> GpuFault | None:
    return next((f for f in faults or () if f.unusable), None)


def unhealthy_words(index: int, faults: Sequence[GpuFault] | None) -> str:
    """`gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus)`: what refusals and drains say."""
    f = first_unusable(faults)
    return f"gpu {index} unhealthy" + (f": {fault_words(f)}" if f is not None else "")


def keep_faults(faults: Sequence[GpuFault], new: GpuFault) -> tuple[GpuFault, ...]:
    """The card's faults with `new` added: at most FAULTS_KEPT, the newest, but the first
    unusable one stays (it is why the card is out, however many reports follow)."""
    out = [*faults, new]
    if len(out) <= FAULTS_KEPT:
        return tuple(out)
    # By position, not by value: an equal fault later on is not the one that took it out.
    first = next((i for i, f in enumerate(out) if f.unusable), None)
    if first is not None and first < len(out) - FAULTS_KEPT:
        return (out[first], *out[-(FAULTS_KEPT - 1) :])
    return tuple(out[-FAULTS_KEPT:])
