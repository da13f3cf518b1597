"""GPU faults on this node: Xid events and uncorrected ECC counts, per card.

Two sources of Xids, whichever work here:

- the kernel log (`gpu_fault_log` in agent.yaml, /dev/kmsg by default; any file a
  syslog appends to works too, e.g. /var/log/kern.log): every `NVRM: Xid` line,
  then followed. /dev/kmsg is read from its start, which is this boot (an Xid
  since boot still counts: a card that fell off the bus stays off until the node
  reboots); a syslog file holds earlier boots too, so it is read from where it
  ends when the agent starts (a restarted agent forgets the Xids before). /dev/kmsg needs
  CAP_SYSLOG where `kernel.dmesg_restrict` is 1; a log that cannot be read is a
  warning in the inventory, not a failure;
- NVML's event API (`nvmlEventTypeXidCriticalError`), in a thread of its own,
  where pynvml loads and the card supports it (`gpu_fault_nvml_events`).

The same Xid seen by both within a few seconds is one fault. The volatile
uncorrected ECC count every usage sample reads (NVML or nvidia-smi) is the
third: above zero, the card is unusable until reset. The fourth, every
MEMORY_EVERY samples: `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER`'s
rows waiting to be remapped, failed remappings and retired pages waiting for
a reset (older drivers without ROW_REMAPPER are asked without it).

What a fault means and whether it takes the card out is llmgw.core's table
(`classify_xid`); this module only reads, maps the kernel log's PCI address to a
card index through the inventory, and annotates each usage sample with every
card's health and its newest faults. Nothing here imports trio: the sampler
calls `poll` and `annotate` from its worker thread; the NVML watcher is a thread.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from llmgw import core, model
from llmgw.agent.discovery import Runner, parse_smi_q_memory
from llmgw.errors import ParseError

log = logging.getLogger("llmgw.agent.gpu_faults")

SAME_FAULT_S = 10.0  # one Xid seen by NVML and in the kernel log within this: one fault
READ_CHUNK = 65536
MAX_READ_PER_POLL = 16 * 1024 * 1024  # a huge old log is read over several polls
NVML_WAIT_MS = 1000  # the NVML thread checks for its stop this often
MEMORY_EVERY = 6  # samples between `nvidia-smi -q` memory checks (30 s at the default interval)
MEMORY_QUERY = ("ECC,PAGE_RETIREMENT,ROW_REMAPPER", "ECC,PAGE_RETIREMENT")
SMI_Q_TIMEOUT_S = 30.0


class KernelLog:
    """New lines of a kernel log: /dev/kmsg (a record per read) or an appended file.

    Opened non-blocking, so a poll reads what is there and returns; a file that
    shrinks (rotated, truncated) is read again from its start."""

    def __init__(self, path: Path, *, from_start: bool | None = None) -> None:
        """`from_start`: read what the log already holds; None: a device (/dev/kmsg, this
        boot's records) from its start, a regular file (earlier boots too) from its end."""
        self.path = path
        self.from_start = from_start
        self._fd: int | None = None
        self._pos = 0
        self._tail = b""
        self.error: str | None = None
        self.lines_read = 0

    def __repr__(self) -> str:
        return f"<KernelLog {self.path} lines={self.lines_read} error={self.error!r}>"

    def _open(self) -> int | None:
        if self._fd is not None:
            return self._fd
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            why = f"cannot read {self.path} ({e.strerror or e})"
            if why != self.error:
                log.warning("GPU faults: %s: Xids are not read from the kernel log", why)
            self.error = why
            return None
        self.error = None
        self._pos = 0
        from_start = self.from_start
        if from_start is None:
            from_start = not os.path.isfile(self.path)
        if not from_start:
            self._pos = os.lseek(self._fd, 0, os.SEEK_END)
            self.from_start = True  # a file that is replaced later is read from its start
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read_new(self) -> list[str]:
        fd = self._open()
        if fd is None:
            return []
        try:
            st = os.fstat(fd)
            if os.path.isfile(self.path) and st.st_size < self._pos:
                os.lseek(fd, 0, os.SEEK_SET)  # truncated or replaced: from its start
                self._pos, self._tail = 0, b""
        except OSError:
            pass
        data = bytearray()
        while len(data) < MAX_READ_PER_POLL:
            try:
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                break  # /dev/kmsg: nothing more for now
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # /dev/kmsg: records overwritten before we read them
                log.warning("GPU faults: reading %s: %s", self.path, e)
                self.close()
                break
            if not chunk:
                break
            self._pos += len(chunk)
            data += chunk
        text = self._tail + bytes(data)
        *lines, self._tail = text.split(b"\n")
        self.lines_read += len(lines)
        return [line.decode(errors="replace") for line in lines]


@attrs.frozen
class _Seen:
    xid: int
    at: float
    source: str


class GpuFaultWatch:
    """Every card's faults since the agent started, and the health they make."""

    def __init__(
        self,
        kernel_log: Path | None,
        *,
        wall: Callable[[], float] = time.time,
        from_start: bool | None = None,
    ) -> None:
        self.kernel_log = (
            KernelLog(kernel_log, from_start=from_start) if kernel_log is not None else None
        )
        self._wall = wall
        self._lock = threading.Lock()  # the NVML thread adds faults too
        self._faults: dict[int, tuple[model.GpuFault, ...]] = {}
        self._recent: dict[int, list[_Seen]] = {}
        self._ecc: dict[int, int] = {}
        self._memory: set[tuple[int, str]] = set()  # (card, words) already recorded
        self._polls = 0
        self.unmapped = 0  # Xid lines naming a PCI address no card of the inventory has
        self.nvml_error: str | None = None

    def __repr__(self) -> str:
        return (
            f"<GpuFaultWatch cards={sorted(self._faults)} unmapped={self.unmapped} "
            f"log={self.kernel_log!r} nvml_error={self.nvml_error!r}>"
        )

    def warnings(self) -> tuple[str, ...]:
        if self.kernel_log is not None and self.kernel_log.error is not None:
            return (
                f"GPU faults: {self.kernel_log.error}; Xids are read from NVML's events only "
                "where it runs (agent.yaml gpu_fault_log)",
            )
        return ()

    def faults(self) -> dict[int, tuple[model.GpuFault, ...]]:
        with self._lock:
            return dict(self._faults)

    def note_xid(self, index: int, xid: int, *, source: str, line: str | None = None) -> bool:
        """Record an Xid on card `index`; False when it is the same one another source
        already reported a moment ago."""
        now = self._wall()
        with self._lock:
            recent = [s for s in self._recent.get(index, []) if now - s.at < SAME_FAULT_S]
            if any(s.xid == xid and s.source != source for s in recent):
                self._recent[index] = recent
                return False
            recent.append(_Seen(xid, now, source))
            self._recent[index] = recent
            fault = core.xid_fault(xid, now, source=source, line=line)
            self._faults[index] = core.keep_faults(self._faults.get(index, ()), fault)
        level = logging.ERROR if fault.unusable else logging.WARNING
        log.log(level, "GPU %d: %s (%s)", index, core.fault_words(fault), source)
        return True

    def poll(self, gpus: Sequence[model.Gpu] | None) -> int:
        """Read the kernel log's new lines; returns the Xids recorded. Without the
        inventory's cards nothing is read yet (a line could not be given its card)."""
        if self.kernel_log is None or not gpus:
            return 0
        by_bus = {core.pci_key(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
        found = 0
        for line in self.kernel_log.read_new():
            x = core.parse_xid_line(line)
            if x is None:
                continue
            index = by_bus.get(x.bus)
            if index is None:
                self.unmapped += 1
                log.warning("GPU faults: Xid %d names PCI %s, no card here has it", x.xid, x.bus)
                continue
            found += self.note_xid(index, x.xid, source=str(self.kernel_log.path), line=line)
        return found

    def check_memory(self, runner: Runner, gpus: Sequence[model.Gpu] | None) -> int:
        """Every MEMORY_EVERY calls (the first included): ask `nvidia-smi -q` about each
        card's memory and record what takes a card out; returns the faults recorded."""
        self._polls += 1
        if not gpus or (self._polls - 1) % MEMORY_EVERY:
            return 0
        for what in MEMORY_QUERY:
            r = runner(["nvidia-smi", "-q", "-d", what], SMI_Q_TIMEOUT_S)
            if r.ok or r.missing:
                break
        if not r.ok:
            log.debug("GPU faults: nvidia-smi -q -d %s: %s", what, r.describe())
            return 0
        try:
            found = parse_smi_q_memory(r.stdout, source=f"nvidia-smi -q -d {what}")
        except ParseError as e:
            log.info("GPU faults: %s", e)
            return 0
        by_bus = {core.pci_key(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
        now, added = self._wall(), 0
        for bus, state in found.items():
            index = by_bus.get(core.pci_key(bus)) if bus is not None else None
            if index is None and bus is None and len(gpus) == 1:
                index = gpus[0].index
            if index is None:
                continue
            for fault in core.memory_faults(
                now,
                remap_pending=state.remap_pending,
                remap_failed=state.remap_failed,
                retired_pending=state.retired_pending,
                source="nvidia-smi",
            ):
                with self._lock:
                    if (index, fault.meaning) in self._memory:
                        continue
                    self._memory.add((index, fault.meaning))
                    self._faults[index] = core.keep_faults(self._faults.get(index, ()), fault)
                log.error("GPU %d: %s", index, fault.meaning)
                added += 1
        return added

    def annotate(self, usage: model.Usage, source: str | None = None) -> model.Usage:
        """The sample with every card's health and faults; an uncorrected ECC count that
        rose since the last sample is a fault of its own."""
        now = self._wall()
        with self._lock:
            for g in usage.gpus:
                count = g.ecc_uncorrected
                if count is not None and count > self._ecc.get(g.index, 0):
                    fault = core.ecc_fault(count, now, source)
                    self._faults[g.index] = core.keep_faults(self._faults.get(g.index, ()), fault)
                    log.error("GPU %d: %s", g.index, fault.meaning)
                if count is not None:
                    self._ecc[g.index] = max(count, self._ecc.get(g.index, 0))
            faults = dict(self._faults)
        gpus = tuple(
            attrs.evolve(
                g,
                health=core.gpu_health(faults.get(g.index, ())).value,
                faults=faults.get(g.index, ()),
            )
            for g in usage.gpus
        )
        return attrs.evolve(usage, gpus=gpus)

    # NVML's event API ------------------------------------------------------------------

    def watch_nvml(self, nvml: Any, stop: threading.Event) -> None:
        """Wait for NVML's Xid events until `stop` is set; runs in a thread of its own.

        Returns at once, with `nvml_error` saying why, where NVML does not load or no
        card accepts the registration (a driver without events, a card in a VM)."""
        try:
            nvml.nvmlInit()
        except Exception as e:
            self.nvml_error = f"nvmlInit failed: {e}"
            log.info("GPU faults: NVML events not watched (%s)", self.nvml_error)
            return
        try:
            self._nvml_loop(nvml, stop)
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception as e:
                log.debug("nvmlShutdown: %s", e)

    def _nvml_loop(self, nvml: Any, stop: threading.Event) -> None:
        kind = getattr(nvml, "nvmlEventTypeXidCriticalError", 0x8)
        try:
            events = nvml.nvmlEventSetCreate()
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            self.nvml_error = f"nvmlEventSetCreate failed: {e}"
            log.info("GPU faults: NVML events not watched (%s)", self.nvml_error)
            return
        registered = 0
        for i in range(count):
            try:
                nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(i), kind, events)
                registered += 1
            except Exception as e:
                log.info("GPU faults: GPU %d does not report NVML Xid events (%s)", i, e)
        if not registered:
            self.nvml_error = "no card accepts NVML Xid event registration"
            return
        # nvidia-ml-py before 11.5 has only the first version of the wait.
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        try:
            while not stop.is_set():
                try:
                    data = wait(events, NVML_WAIT_MS)
                except Exception as e:
                    if "Timeout" in type(e).__name__ or "Timeout" in str(e):
                        continue
                    self.nvml_error = f"nvmlEventSetWait failed: {e}"
                    log.warning("GPU faults: NVML events stopped (%s)", self.nvml_error)
                    return
                if getattr(data, "eventType", kind) != kind:
                    continue
                try:
                    index = nvml.nvmlDeviceGetIndex(data.device)
                except Exception as e:
                    log.warning("GPU faults: NVML Xid %s on a card without an index: %s",
                                data.eventData, e)  # fmt: skip
                    continue
                self.note_xid(int(index), int(data.eventData), source="nvml")
        finally:
            try:
                nvml.nvmlEventSetFree(events)
            except Exception as e:
                log.debug("nvmlEventSetFree: %s", e)
