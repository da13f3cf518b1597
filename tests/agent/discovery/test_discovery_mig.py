"""MIG mode and instances, from recorded nvidia-smi output and from NVML fed the same recording.

The recordings are one H100 80GB HBM3 with MIG enabled and four instances
(tests/data/INDEX.md: nvidia_gpu_exporter's h100-mig capture, driver 590.48.01).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import FIXTURES

from llmgw.agent.discovery import (
    COMPUTE_APPS_FIELDS,
    GPU_QUERY_FIELDS,
    MIG_MODE_FIELDS,
    ListedMig,
    QueriedMig,
    RunResult,
    collect_inventory,
    format_inventory,
    parse_mig_modes,
    parse_smi_list,
    parse_smi_q_mig,
    probe_gpus,
)
from llmgw.errors import ParseError
from llmgw.model import MigDevice


class Recorded:
    """A runner answering from a table of argv -> result; anything else is not found."""

    def __init__(self, answers: dict[tuple[str, ...], RunResult]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        self.calls.append(tuple(argv))
        found = self.answers.get(tuple(argv))
        return found or RunResult(127, "", f"{argv[0]}: not found", missing=True)


SMI_L = FIXTURES / "smil-h100-mig-4migdevs-drv590.txt"
SMI_Q = FIXTURES / "q-h100-mig-enabled-4migdevs-load-drv590.txt"
CSV_ALL = FIXTURES / "csv-h100-mig-allfields-load-drv590.txt"
CSV_APPS = FIXTURES / "csv-compute-apps-h100-mig-load-drv590.txt"
CSV_MODES = FIXTURES / "csv-mig-mode-current-pending-4gpu-1enabled.txt"
TABLE = FIXTURES / "smi-h100-mig-enabled-4migdevs-processes-drv590.txt"

GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"
BUS = "00000000:00:09.0"
# Every instance exactly as recorded: -L gives profile and UUID, -q ids and memory.
EXPECTED = (
    MigDevice("MIG-00000000-0000-0000-0000-000000000000", "3g.40gb", 40448, 2, 0),
    MigDevice("MIG-00000001-0000-0000-0000-000000000001", "2g.20gb", 20096, 3, 0),
    MigDevice("MIG-00000002-0000-0000-0000-000000000002", "1g.10gb", 9984, 9, 0),
    MigDevice("MIG-00000003-0000-0000-0000-000000000003", "1g.10gb", 9984, 10, 0),
)


def test_smi_list_names_each_instance_under_its_card() -> None:
    listed = parse_smi_list(SMI_L.read_text())
    assert listed == tuple(
        ListedMig(0, GPU_UUID, i, d.profile, d.uuid) for i, d in enumerate(EXPECTED)
    )
    # A card without MIG lists no instances; text that is not -L is refused.
    assert parse_smi_list("GPU 0: NVIDIA L40S (UUID: GPU-a)\n") == ()
    with pytest.raises(ParseError, match="no 'GPU <n>"):
        parse_smi_list("No devices were found\n")


def test_smi_q_gives_instance_ids_and_memory() -> None:
    assert parse_smi_q_mig(SMI_Q.read_text()) == {
        BUS: (
            QueriedMig(0, 2, 0, 40448),
            QueriedMig(1, 3, 0, 20096),
            QueriedMig(2, 9, 0, 9984),
            QueriedMig(3, 10, 0, 9984),
        )
    }
    # A card with MIG disabled has no sections (the recorded H200).
    assert parse_smi_q_mig((FIXTURES / "q-h200-full-idle-drv590.txt").read_text()) == {}


def test_mig_modes_from_both_recorded_csvs() -> None:
    assert parse_mig_modes(CSV_MODES.read_text()) == {
        "GPU-ec845691-fb46-e16d-abfb-b135308cb39f": ("enabled", "enabled"),
        "GPU-91672fbd-4bc1-0434-a653-77a9501c84de": ("disabled", "disabled"),
        "GPU-b4199570-ed3c-2a6b-646a-af77be93eac5": ("disabled", "disabled"),
        "GPU-1a4dff29-ab6d-9f64-f125-8b7cebdaac4a": ("disabled", "disabled"),
    }
    assert parse_mig_modes(CSV_ALL.read_text()) == {GPU_UUID: ("enabled", "enabled")}
    # The L40S has no MIG: [N/A] is unknown, not "disabled".
    l40s = parse_mig_modes((FIXTURES / "csv-l40s-allfields-idle-drv595.txt").read_text())
    assert list(l40s.values()) == [(None, None)]


def smi_runner(modes: str | None = None) -> Recorded:
    """nvidia-smi answering every query discovery makes from the H100 MIG recording.

    The mode query is answered with the all-fields CSV (its header names the
    columns, so the extra ones are ignored) unless `modes` replaces it.
    """
    ok = lambda path: RunResult(0, path.read_text(), "")  # noqa: E731
    gpu_query = f"--query-gpu={','.join(GPU_QUERY_FIELDS)}"
    apps_query = f"--query-compute-apps={','.join(COMPUTE_APPS_FIELDS)}"
    mode_query = f"--query-gpu={','.join(MIG_MODE_FIELDS)}"
    return Recorded(
        {
            ("nvidia-smi", gpu_query, "--format=csv,noheader,nounits"): ok(CSV_ALL),
            ("nvidia-smi", apps_query, "--format=csv,noheader,nounits"): ok(CSV_APPS),
            ("nvidia-smi", mode_query, "--format=csv"): RunResult(0, modes, "")
            if modes is not None
            else ok(CSV_ALL),
            ("nvidia-smi", "-L"): ok(SMI_L),
            ("nvidia-smi", "-q"): ok(SMI_Q),
            ("nvidia-smi",): ok(TABLE),
        }
    )


def test_nvidia_smi_path_reports_every_instance_as_recorded() -> None:
    runner = smi_runner()
    probe = probe_gpus(runner, nvml=None)
    assert probe.source == "nvidia-smi" and probe.gpus is not None
    (gpu,) = probe.gpus
    assert (gpu.uuid, gpu.gpu_class, gpu.mig_mode, gpu.mig_pending) == (
        GPU_UUID,
        "h100-80g",
        "enabled",
        None,
    )
    assert gpu.mig_devices == EXPECTED
    assert not any("MIG" in w for w in probe.warnings)
    # The per-heartbeat probe does not ask about MIG: instances change only by hand.
    heartbeat = smi_runner()
    (hb,) = probe_gpus(heartbeat, nvml=None, topology=False).gpus or ()
    assert hb.mig_mode is None and ("nvidia-smi", "-L") not in heartbeat.calls


def test_a_card_without_mig_enabled_is_not_asked_for_instances() -> None:
    modes = f"uuid, mig.mode.current, mig.mode.pending\n{GPU_UUID}, Disabled, Disabled\n"
    runner = smi_runner(modes)
    (gpu,) = probe_gpus(runner, nvml=None).gpus or ()
    assert (gpu.mig_mode, gpu.mig_pending, gpu.mig_devices) == ("disabled", None, ())
    assert ("nvidia-smi", "-L") not in runner.calls and ("nvidia-smi", "-q") not in runner.calls


class RecordedMigNvml:
    """pynvml answering from the same H100 MIG recording (the card from the all-fields
    CSV, instances from -L and -q, read here with plain regexes, not llmgw's parsers).

    MIG handles are ("mig", i); a MIG device's NVML name is its card's with
    " MIG <profile>" appended (an assumption: no NVML name of a MIG device is recorded).
    """

    NVML_DEVICE_MIG_ENABLE = 1
    NVML_DEVICE_MIG_DISABLE = 0

    def __init__(self, pending: int = 1) -> None:
        header, row = CSV_ALL.read_text().splitlines()[:2]
        card = dict(
            zip((h.split(" [")[0] for h in header.split(", ")), row.split(", "), strict=True)
        )
        self.card = card
        self.pending = pending
        self.listed = re.findall(
            r"MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)", SMI_L.read_text()
        )
        q = SMI_Q.read_text()
        self.ids = [
            (int(gi), int(ci), int(total))
            for gi, ci, total in re.findall(
                r"GPU Instance ID\s+: (\d+)\n\s+Compute Instance ID\s+: (\d+)\n"
                r"(?:.*\n)*?\s+Shared FB Memory Usage\n\s+Total\s+: (\d+) MiB",
                q,
            )
        ]
        self.mib = 2**20

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return ("gpu", i)

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self.card["uuid"] if h[0] == "gpu" else self.listed[h[1]][2]

    def nvmlDeviceGetName(self, h: Any) -> str:
        name = self.card["name"]
        return name if h[0] == "gpu" else f"{name} MIG {self.listed[h[1]][0]}"

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        return type("Pci", (), {"busId": self.card["pci.bus_id"]})()

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        total = int(self.card["memory.total"].split()[0]) if h[0] == "gpu" else self.ids[h[1]][2]
        return type("Mem", (), {"total": total * self.mib, "used": 0})()

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        return [1, self.pending]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        return 7  # an H100 holds up to seven; indexes past the four made answer NOT_FOUND

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, i: int) -> Any:
        if i >= len(self.listed):
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return ("mig", i)

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> int:
        return self.ids[h[1]][0]

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> int:
        return self.ids[h[1]][1]


def test_nvml_path_reports_the_same_instances_as_nvidia_smi() -> None:
    runner = Recorded({})
    nvml_probe = probe_gpus(runner, nvml=RecordedMigNvml)
    assert nvml_probe.source == "nvml" and nvml_probe.gpus is not None
    (via_nvml,) = nvml_probe.gpus
    assert (via_nvml.mig_mode, via_nvml.mig_pending) == ("enabled", None)
    assert via_nvml.mig_devices == EXPECTED
    (via_smi,) = probe_gpus(smi_runner(), nvml=None).gpus or ()
    assert via_nvml.mig_devices == via_smi.mig_devices
    assert (via_nvml.mig_mode, via_nvml.mig_pending) == (via_smi.mig_mode, via_smi.mig_pending)


def test_a_pending_mode_change_is_a_node_warning_and_nothing_is_reset(tmp_path: Path) -> None:
    warning = "gpu 0: MIG mode change pending a GPU reset (enabled -> disabled)"
    # nvidia-smi: the recorded mode row, its pending column changed as a reset would show it.
    modes = CSV_MODES.read_text().replace("Enabled, Enabled", "Enabled, Disabled")
    modes = modes.replace("GPU-ec845691-fb46-e16d-abfb-b135308cb39f", GPU_UUID)
    runner = smi_runner(modes)
    inv = collect_inventory(
        root=tmp_path,
        runner=runner,
        nvml=None,
        hostname="h",
        with_weights=False,
        with_engines=False,
    )
    assert inv.gpus is not None
    (gpu,) = inv.gpus
    assert (gpu.mig_mode, gpu.mig_pending) == ("enabled", "disabled")
    assert gpu.mig_devices == EXPECTED  # still enabled until the reset: the instances are real
    assert warning in inv.warnings
    text = format_inventory(inv)
    assert "mig enabled (next reset: disabled)" in text
    assert (
        "MIG 3g.40gb  MIG-00000000-0000-0000-0000-000000000000  gi 2  ci 0  mem 40448 MiB" in text
    )
    assert warning in text
    # NVML: the same.
    inv = collect_inventory(
        root=tmp_path,
        runner=Recorded({}),
        nvml=lambda: RecordedMigNvml(pending=0),
        hostname="h",
        with_weights=False,
        with_engines=False,
    )
    assert warning in inv.warnings
    # Reported, not acted on: nothing resets the card or changes its mode.
    acting = [c for c in runner.calls if {"-r", "--gpu-reset", "-mig"} & set(c) or "mig" in c]
    assert acting == []


def test_fake_nvidia_smi_answers_the_recorded_mig_lines(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LLMGW_FAKE_GPUS": "1xh100-80g,1xh100-80g,1xl40s-45g",
        "LLMGW_FAKE_SMI_L_FILE": str(SMI_L),
        "LLMGW_FAKE_SMI_MIG_PENDING": "1:Enabled",
    }
    smi = [sys.executable, "-m", "llmgw.testing.fake_nvidia_smi"]
    listed = subprocess.run([*smi, "-L"], env=env, capture_output=True, text=True, check=True)
    recorded = SMI_L.read_text().splitlines()
    lines = listed.stdout.splitlines()
    # Card 0 carries the recording's instances, byte for byte; the others none.
    assert lines[1:5] == recorded[1:5] and len(lines) == 7
    modes = subprocess.run(
        [*smi, f"--query-gpu={','.join(MIG_MODE_FIELDS)}", "--format=csv"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert [tuple(v) for v in parse_mig_modes(modes.stdout).values()] == [
        ("enabled", "enabled"),
        ("disabled", "enabled"),  # a change waiting for the reset
        (None, None),  # an L40S has no MIG: [N/A]
    ]


def test_instances_nvidia_smi_cannot_list_are_a_warning_and_ids_it_cannot_query_unknown() -> None:
    # -L fails: the card is still MIG-enabled, its instances unknown, and the node says so.
    runner = smi_runner()
    runner.answers[("nvidia-smi", "-L")] = RunResult(9, "", "Unable to determine the device handle")
    probe = probe_gpus(runner, nvml=None)
    (gpu,) = probe.gpus or ()
    assert (gpu.mig_mode, gpu.mig_devices) == ("enabled", ())
    assert [w for w in probe.warnings if "MIG" in w] == [
        "gpu 0: MIG enabled, instances unknown: nvidia-smi -L failed (exit status 9: "
        "Unable to determine the device handle)"
    ]
    # -q fails: the instances from -L, with their ids and memory unknown (not 0).
    runner = smi_runner()
    runner.answers[("nvidia-smi", "-q")] = RunResult(2, "Invalid combination", "")
    (gpu,) = probe_gpus(runner, nvml=None).gpus or ()
    assert gpu.mig_devices == tuple(
        MigDevice(d.uuid, d.profile, None, None, None) for d in EXPECTED
    )
