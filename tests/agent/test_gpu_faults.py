"""The agent's GPU-fault watch (llmgw/agent/_gpu_faults.py): the kernel log followed,
recorded Xid lines given their card by PCI address, ECC counts, NVML's events."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import attrs
import pytest

from llmgw import model
from llmgw.agent._gpu_faults import MEMORY_EVERY, GpuFaultWatch, KernelLog
from llmgw.agent.discovery import MemoryErrors, RunResult, parse_smi_q_memory
from llmgw.errors import ParseError
from tests.helpers import FIXTURES

XID79 = FIXTURES / "kernlog-xid79-fallen-off-bus-dmesg-T-drv535.txt"  # PCI 0000:a1:00
XID13 = FIXTURES / "kernlog-xid13-graphics-exception-dmesg-ctime.txt"  # PCI 0000:cb:00

CARDS = (
    model.Gpu(0, "GPU-0", "NVIDIA H100 80GB HBM3", "h100-80g", pci_bus_id="00000000:CB:00.0"),
    model.Gpu(1, "GPU-1", "NVIDIA H100 80GB HBM3", "h100-80g", pci_bus_id="00000000:A1:00.0"),
)
USAGE = model.Usage(gpus=(model.GpuUsage(0, ecc_uncorrected=0), model.GpuUsage(1)))


def test_the_log_is_read_from_its_start_then_followed(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text("one\ntwo\npart")
    log = KernelLog(path, from_start=True)  # as /dev/kmsg is read: this boot's records
    assert log.read_new() == ["one", "two"]  # a line not ended yet waits for its end
    with path.open("a") as f:
        f.write("ial\nthree\n")
    assert log.read_new() == ["partial", "three"]
    assert log.read_new() == []
    path.write_text("new\n")  # rotated: shorter than what was read, so read from the start
    assert log.read_new() == ["new"]


def test_a_syslog_file_is_followed_from_where_it_ends(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text(XID79.read_text())  # an earlier boot's Xid: not this card's news
    watch = GpuFaultWatch(path)
    assert watch.poll(CARDS) == 0
    with path.open("a") as f:
        f.write(XID13.read_text())
    assert watch.poll(CARDS) == 4
    assert [g.health for g in watch.annotate(USAGE).gpus] == ["ok", "ok"]


def test_a_log_that_cannot_be_read_is_a_warning(tmp_path: Path) -> None:
    watch = GpuFaultWatch(tmp_path / "missing")
    assert watch.poll(CARDS) == 0
    (warning,) = watch.warnings()
    assert warning.startswith(f"GPU faults: cannot read {tmp_path / 'missing'} (No such file")
    assert "gpu_fault_log" in warning


def test_recorded_xids_go_to_the_card_with_that_pci_address(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text("")
    watch = GpuFaultWatch(path, wall=lambda: 1000.0, from_start=True)
    assert watch.poll(None) == 0  # no inventory yet: nothing read, nothing lost
    path.write_text(XID13.read_text())
    assert watch.poll(CARDS) == 4
    usage = watch.annotate(USAGE)
    card0, card1 = usage.gpus
    assert card0.health == "ok" and [f.xid for f in card0.faults or ()] == [13, 13, 13, 109]
    assert card1.health == "ok" and card1.faults == ()
    with path.open("a") as f:
        f.write(XID79.read_text())
    assert watch.poll(CARDS) == 1
    card0, card1 = watch.annotate(USAGE).gpus
    assert card0.health == "ok"
    assert card1.health == "unhealthy"
    (fault,) = card1.faults or ()
    assert (fault.xid, fault.meaning, fault.unusable) == (79, "GPU has fallen off the bus", True)
    assert fault.line == XID79.read_text().splitlines()[1]
    assert fault.source == str(path)


def test_a_line_for_a_card_this_node_lacks_is_counted_not_given(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text(XID79.read_text())
    watch = GpuFaultWatch(path, from_start=True)
    assert watch.poll(CARDS[:1]) == 0
    assert watch.unmapped == 1
    assert all(g.faults == () for g in watch.annotate(USAGE).gpus)


def test_an_uncorrected_ecc_count_takes_the_card_out(tmp_path: Path) -> None:
    watch = GpuFaultWatch(None, wall=lambda: 5.0)
    assert watch.annotate(USAGE).gpus[0].health == "ok"
    sick = model.Usage(gpus=(model.GpuUsage(0, ecc_uncorrected=2), model.GpuUsage(1)))
    card0, card1 = watch.annotate(sick).gpus
    assert card0.health == "unhealthy"
    assert [f.meaning for f in card0.faults or ()] == [
        "2 uncorrected ECC errors since the driver loaded"
    ]
    assert card1.health == "ok"  # its count unknown: not a fault
    again = watch.annotate(sick).gpus[0]
    assert len(again.faults or ()) == 1  # the same count is not a new fault


class FakeNvml:
    """pynvml's event calls, as far as the watcher uses them: one Xid on card 1."""

    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.queue: list[Any] = [type("D", (), {"eventType": 0x8, "eventData": 79, "device": 1})]
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlEventSetFree(self, events: str) -> None:
        self.calls.append("free")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceRegisterEvents(self, handle: int, kind: int, events: str) -> None:
        self.calls.append(f"register {handle} {kind}")

    def nvmlEventSetWait_v2(self, events: str, ms: int) -> Any:
        if self.queue:
            return self.queue.pop()
        self.stop.set()
        raise TimeoutError("NVMLError_Timeout")

    def nvmlDeviceGetIndex(self, device: int) -> int:
        return device


def test_an_older_pynvml_waits_with_the_first_version(tmp_path: Path) -> None:
    stop = threading.Event()

    class Older(FakeNvml):
        nvmlEventSetWait = FakeNvml.nvmlEventSetWait_v2
        nvmlEventSetWait_v2 = None

    watch = GpuFaultWatch(None, wall=lambda: 1.0)
    watch.watch_nvml(Older(stop), stop)
    assert [f.xid for f in watch.faults()[1]] == [79]
    assert watch.nvml_error is None


def test_nvml_events_and_the_kernel_log_make_one_fault(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text(XID79.read_text())
    watch = GpuFaultWatch(path, wall=lambda: 50.0, from_start=True)
    stop = threading.Event()
    nvml = FakeNvml(stop)
    watch.watch_nvml(nvml, stop)
    assert nvml.calls == ["init", "register 0 8", "register 1 8", "free", "shutdown"]
    assert watch.poll(CARDS) == 0  # the same Xid from the log, a moment later: one fault
    card1 = watch.annotate(USAGE).gpus[1]
    assert card1.health == "unhealthy"
    assert [(f.xid, f.source) for f in card1.faults or ()] == [(79, "nvml")]


Q_H200 = FIXTURES / "q-h200-full-idle-drv590.txt"  # GPU 00000000:83:00.0, healthy
Q_PENDING = FIXTURES / "smiq-remapped-rows-pending-yes-fragment.txt"


def test_smi_q_memory_sections() -> None:
    h200 = parse_smi_q_memory(Q_H200.read_text())
    assert h200 == {
        "00000000:83:00.0": MemoryErrors(
            remap_pending=False, remap_failed=False, retired_pending=None
        )
    }
    assert parse_smi_q_memory(Q_PENDING.read_text()) == {None: MemoryErrors(remap_pending=True)}
    with pytest.raises(ParseError, match="no 'Retired Pages' or 'Remapped Rows' section"):
        parse_smi_q_memory("GPU 00000000:83:00.0\n    Product Name : NVIDIA H200\n")


class Recorded:
    """A runner answering `nvidia-smi -q -d ...` with a recorded output."""

    def __init__(self, text: str, refuse: str | None = None) -> None:
        self.text, self.refuse = text, refuse
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout: float) -> RunResult:
        self.calls.append(argv)
        if self.refuse is not None and self.refuse in argv[-1]:
            return RunResult(2, "Invalid combination of input arguments.", "")
        return RunResult(0, self.text, "")


def test_rows_waiting_for_a_reset_take_the_card_out() -> None:
    one = (attrs.evolve(CARDS[1], index=0),)
    watch = GpuFaultWatch(None, wall=lambda: 7.0)
    # An older driver refuses ROW_REMAPPER: asked again without it.
    runner = Recorded(Q_PENDING.read_text(), refuse="ROW_REMAPPER")
    assert watch.check_memory(runner, one) == 1
    assert [c[-1] for c in runner.calls] == [
        "ECC,PAGE_RETIREMENT,ROW_REMAPPER",
        "ECC,PAGE_RETIREMENT",
    ]
    card = watch.annotate(model.Usage(gpus=(model.GpuUsage(0),))).gpus[0]
    assert card.health == "unhealthy"
    assert [f.meaning for f in card.faults or ()] == [
        "row remapping pending: the card needs a reset"
    ]
    # Asked again only every MEMORY_EVERY samples, and the same state is not a new fault.
    for _ in range(MEMORY_EVERY):
        watch.check_memory(runner, one)
    assert len(runner.calls) == 4
    assert len(watch.faults()[0]) == 1


def test_a_healthy_q_output_takes_nothing_out() -> None:
    card = model.Gpu(0, "GPU-0", "NVIDIA H200", "h200-140g", pci_bus_id="00000000:83:00.0")
    watch = GpuFaultWatch(None)
    assert watch.check_memory(Recorded(Q_H200.read_text()), (card,)) == 0
    assert watch.annotate(model.Usage(gpus=(model.GpuUsage(0),))).gpus[0].health == "ok"
