"""nvidia-smi CSV, compute apps, versions and the GPU class rule, on real samples."""

from __future__ import annotations

import re

import pytest
from helpers import FIXTURES

from llmgw.agent.discovery import (
    GPU_QUERY_FIELDS,
    ComputeApp,
    foreign_memory_mib,
    gpu_class,
    invalid_query_field,
    parse_compute_apps,
    parse_gpu_csv,
    parse_smi_csv,
    parse_smi_versions,
)
from llmgw.errors import ParseError


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_h100_mig_all_fields_with_header_and_units() -> None:
    (gpu,) = parse_gpu_csv(fixture("csv-h100-mig-allfields-load-drv590.txt"))
    assert gpu.index == 0
    assert gpu.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.gpu_class == "h100-80g"
    assert gpu.pci_bus_id == "00000000:00:09.0"
    assert gpu.memory_total_mib == 81559
    assert gpu.memory_used_mib == 11125
    assert gpu.compute_capability == "9.0"
    assert gpu.ecc_uncorrected == 0
    # MIG mode: the driver prints [N/A] for utilisation; unknown, not 0.
    assert gpu.utilization_pct is None


def test_l40s_all_fields() -> None:
    (gpu,) = parse_gpu_csv(fixture("csv-l40s-allfields-idle-drv595.txt"))
    assert (gpu.name, gpu.gpu_class, gpu.memory_total_mib, gpu.memory_used_mib) == (
        "NVIDIA L40S",
        "l40s-45g",
        46068,
        0,
    )
    assert gpu.compute_capability == "8.9"
    assert gpu.utilization_pct == 100.0
    assert gpu.pci_bus_id == "00000000:01:00.0"


def test_not_supported_and_na_are_unknown() -> None:
    rows = parse_smi_csv(fixture("csv-gtx650-utilization-gpu-not-supported-drv410.txt"))
    assert rows == ({"utilization.gpu": None},)
    rows = parse_smi_csv(
        fixture("csv-noheader-nounits-fanspeed-NA-newer-driver.txt"),
        [
            "memory.total",
            "memory.free",
            "memory.used",
            "temperature.gpu",
            "fan.speed",
            "utilization.gpu",
            "utilization.memory",
        ],
    )
    assert rows == (
        {
            "memory.total": "2004",
            "memory.free": "2004",
            "memory.used": "0",
            "temperature.gpu": "44",
            "fan.speed": None,
            "utilization.gpu": "0",
            "utilization.memory": "0",
        },
    )


def test_mig_mode_table() -> None:
    rows = parse_smi_csv(fixture("csv-mig-mode-current-pending-4gpu-1enabled.txt"))
    assert [r["mig.mode.current"] for r in rows] == ["Enabled", "Disabled", "Disabled", "Disabled"]
    assert rows[0]["uuid"] == "GPU-ec845691-fb46-e16d-abfb-b135308cb39f"
    assert rows[3]["mig.mode.pending"] == "Disabled"


def test_noheader_rows_and_short_old_driver_rows_keep_the_cards() -> None:
    full = (
        "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559, 1024, 9.0, 0, 37\n"
        "1, GPU-bbbb, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559, 0, 9.0, [N/A], [N/A]\n"
    )
    a, b = parse_gpu_csv(full)
    assert (a.index, a.uuid, a.memory_used_mib, a.utilization_pct) == (0, "GPU-aaaa", 1024, 37.0)
    assert (b.ecc_uncorrected, b.utilization_pct) == (None, None)
    # An older driver: no compute_cap asked, and the last column cut off.
    fields = [f for f in GPU_QUERY_FIELDS if f != "compute_cap"]
    short = "0, GPU-cccc, Tesla V100-SXM2-32GB, 00000000:06:00.0, 32510, 0, 0\n"
    (old,) = parse_gpu_csv(short, fields)
    assert old.uuid == "GPU-cccc"
    assert old.gpu_class == "v100-sxm2-32g"
    assert old.compute_capability is None
    assert old.utilization_pct is None
    assert old.ecc_uncorrected == 0


@pytest.mark.parametrize(
    "text",
    [
        "No devices were found\n",
        "0, GPU-a, NVIDIA L40S, 0:1:0.0, lots, 0, 8.9, 0, 0\n",
        "0, GPU-a, NVIDIA L40S, 0:1:0.0, 46068, 0, 8.9, 0, 0, 1\n",  # a column too many
        "0, GPU-a, NVIDIA L40S\n0, GPU-b, NVIDIA L40S\n",  # index twice
        "x\n",
    ],
)
def test_unreadable_gpu_rows_raise_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        parse_gpu_csv(text)


def test_error_outputs_are_not_cards() -> None:
    for name in (
        "smi-error-no-devices-were-found.txt",
        "smi-error-failed-to-communicate-with-driver.txt",
    ):
        with pytest.raises(ParseError):
            parse_gpu_csv(fixture(name))


def test_compute_apps_and_foreign_memory() -> None:
    apps = parse_compute_apps(fixture("csv-compute-apps-h100-mig-load-drv590.txt"))
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    assert apps == (
        ComputeApp(uuid, 21180, 2296),
        ComputeApp(uuid, 21181, 1272),
        ComputeApp(uuid, 21198, 7484),
    )
    assert foreign_memory_mib(apps, [uuid], llmgw_pids=()) == {uuid: 2296 + 1272 + 7484}
    assert foreign_memory_mib(apps, [uuid, "GPU-other"], llmgw_pids={21198}) == {
        uuid: 2296 + 1272,
        "GPU-other": 0,
    }
    unknown = (*apps, ComputeApp(uuid, 4, None))
    assert foreign_memory_mib(unknown, [uuid], llmgw_pids=()) == {uuid: None}
    assert foreign_memory_mib(unknown, [uuid], llmgw_pids={4}) == {uuid: 11052}


def test_compute_apps_noheader() -> None:
    text = "GPU-a, 100, 2048\nGPU-b, 200, [N/A]\n"
    assert parse_compute_apps(text) == (
        ComputeApp("GPU-a", 100, 2048),
        ComputeApp("GPU-b", 200, None),
    )
    assert parse_compute_apps("") == ()


def test_invalid_field_message() -> None:
    out = 'Field "compute_cap" is not a valid field to query.\n\n'
    assert invalid_query_field(out) == "compute_cap"
    assert invalid_query_field("0, GPU-a, NVIDIA L40S\n") is None


@pytest.mark.parametrize(
    ("name", "driver", "cuda"),
    [
        ("smi-rtx6000ada-4gpu-drv575-noprocs.txt", "575.51.03", "12.9"),
        ("smi-h100-mig-enabled-4migdevs-processes-drv590.txt", "590.48.01", "13.1"),
        ("q-h200-full-idle-drv590.txt", "590.48.01", "13.1"),
        ("q-l40s-full-idle-drv595.txt", "595.80", "13.2"),
    ],
)
def test_versions(name: str, driver: str, cuda: str) -> None:
    v = parse_smi_versions(fixture(name))
    assert (v.driver, v.cuda) == (driver, cuda)


def test_versions_missing_raise() -> None:
    with pytest.raises(ParseError):
        parse_smi_versions(fixture("smi-error-no-devices-were-found.txt"))


def _q_card(name: str) -> tuple[str, int]:
    text = fixture(name)
    product = re.search(r"Product Name\s*:\s*(.+)", text)
    total = re.search(r"FB Memory Usage\s*\n\s*Total\s*:\s*(\d+) MiB", text)
    assert product and total
    return product.group(1).strip(), int(total.group(1))


def _table_cards(name: str) -> list[tuple[str, int]]:
    text = fixture(name)
    names = re.findall(r"^\|\s+\d+\s+(NVIDIA .+?)\s{2,}\S+\s+\|", text, re.M)
    totals = re.findall(r"/\s*(\d+)MiB \|", text)
    return list(zip(names, (int(t) for t in totals), strict=False))


def test_gpu_class_on_every_fixture_card() -> None:
    cards = {
        _q_card("q-h200-full-idle-drv590.txt"): "h200-140g",
        _q_card("q-l40s-full-idle-drv595.txt"): "l40s-45g",
        ("NVIDIA H100 80GB HBM3", 81559): "h100-80g",  # csv-h100-mig-allfields
        ("NVIDIA L40S", 46068): "l40s-45g",  # csv-l40s-allfields
    }
    (h100_table,) = _table_cards("smi-h100-mig-enabled-4migdevs-processes-drv590.txt")
    assert h100_table == ("NVIDIA H100 80GB HBM3", 81559)
    cards[h100_table] = "h100-80g"
    rtx = _table_cards("smi-rtx6000ada-4gpu-drv575-noprocs.txt")
    assert len(rtx) == 4 and rtx[0] == ("NVIDIA RTX 6000 Ada Gene...", 49140)
    # The table truncates the name; the driver's full name (per INDEX.md) is used.
    cards[("NVIDIA RTX 6000 Ada Generation", 49140)] = "rtx-6000-ada-48g"
    for (name, mib), expected in cards.items():
        assert gpu_class(name, mib) == expected, (name, mib)


@pytest.mark.parametrize(
    ("name", "mib", "expected"),
    [
        ("Tesla V100-SXM2-16GB", 16160, "v100-sxm2-16g"),
        ("NVIDIA A100-PCIE-40GB", 40536, "a100-pcie-40g"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-sxm4-80g"),
        ("NVIDIA H100 PCIe", 81559, "h100-pcie-80g"),
        ("NVIDIA H100 NVL", 95830, "h100-nvl-94g"),
        ("GeForce GTX 650", 981, "gtx-650-1g"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090-24g"),
        ("NVIDIA H100 80GB HBM3", None, "h100"),
        ("NVIDIA", 1024, "gpu-1g"),
    ],
)
def test_gpu_class_rule(name: str, mib: int | None, expected: str) -> None:
    assert gpu_class(name, mib) == expected
