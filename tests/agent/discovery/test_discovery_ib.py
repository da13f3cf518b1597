"""RDMA adapters from sysfs, and which declared fabrics are advertised."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from helpers import FIXTURES

from llmgw.agent.discovery import (
    advertise_fabrics,
    parse_ib_phys_state,
    parse_ib_rate,
    parse_ib_state,
    parse_ibstatus,
    read_ib_adapters,
)
from llmgw.errors import ParseError
from llmgw.model import Fabric, IbAdapter, IbPort

SYSFS = FIXTURES / "sysfs-infiniband-h100-ndr400-plus-bf3-roce-bond"


def ndr(name: str) -> IbAdapter:
    return IbAdapter(
        name=name,
        ports=(IbPort(1, "ACTIVE", "LinkUp", 400.0, "InfiniBand"),),
        hca_type="MT4129",
        fw_ver="28.41.1000",
    )


def test_sysfs_fixture_without_trailing_newlines() -> None:
    adapters, warnings = read_ib_adapters(SYSFS)
    assert warnings == ()
    names = [a.name for a in adapters]
    # Natural order, and mlx5_2/3 are absent in this machine's numbering.
    assert names == [f"mlx5_{i}" for i in (0, 1, 4, 5, 6, 7, 8, 9)] + ["mlx5_bond_0"]
    assert adapters[0] == ndr("mlx5_0")
    assert adapters[-1] == IbAdapter(
        name="mlx5_bond_0",
        ports=(IbPort(1, "ACTIVE", "LinkUp", 200.0, "Ethernet"),),
        hca_type="MT41692",
        fw_ver="32.38.3056",
    )


def test_sysfs_with_trailing_newlines_reads_the_same(tmp_path: Path) -> None:
    copy = tmp_path / "infiniband"
    shutil.copytree(SYSFS, copy)
    for f in copy.rglob("*"):
        if f.is_file():
            f.chmod(0o644)
            f.write_text(f.read_text() + "\n")
    assert read_ib_adapters(copy) == read_ib_adapters(SYSFS)


def test_no_infiniband_directory_is_no_adapters(tmp_path: Path) -> None:
    assert read_ib_adapters(tmp_path / "absent") == ((), ())


def make_adapter(root: Path, name: str, state: str, phys: str, rate: str, layer: str) -> None:
    port = root / name / "ports" / "1"
    port.mkdir(parents=True)
    (root / name / "hca_type").write_text("MT4129\n")
    (port / "state").write_text(state + "\n")
    (port / "phys_state").write_text(phys + "\n")
    (port / "rate").write_text(rate + "\n")
    (port / "link_layer").write_text(layer + "\n")


def test_fabric_with_missing_and_init_adapters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "sys" / "class" / "infiniband"
    make_adapter(root, "mlx5_0", "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand")
    make_adapter(root, "mlx5_1", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand")
    make_adapter(root, "mlx5_2", "2: INIT", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand")
    make_adapter(root, "mlx5_4", "1: DOWN", "3: Disabled", "40 Gb/sec (4X QDR)", "InfiniBand")
    adapters, warnings = read_ib_adapters(root)
    assert warnings == ()
    assert [a.ports[0].state for a in adapters] == ["ACTIVE", "ACTIVE", "INIT", "DOWN"]
    assert adapters[3].ports[0].phys_state == "Disabled"

    declared = {
        "ib-a": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"],
        "ib-b": ["mlx5_2", "mlx5_4"],
    }
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.discovery"):
        fabrics, why = advertise_fabrics(declared, adapters)
    # The slowest active link sets the fabric's rate; INIT and absent adapters are left out.
    assert fabrics == (Fabric("ib-a", ("mlx5_0", "mlx5_1"), 200.0),)
    assert why == (
        "fabric ib-a: adapter mlx5_2 has no ACTIVE port (port 1 INIT)",
        "fabric ib-a: adapter mlx5_3 not present",
        "fabric ib-b: adapter mlx5_2 has no ACTIVE port (port 1 INIT)",
        "fabric ib-b: adapter mlx5_4 has no ACTIVE port (port 1 DOWN)",
        "fabric ib-b: not advertised, none of its adapters is usable",
    )
    logged = [r.getMessage() for r in caplog.records]
    assert logged == list(why)


def test_fabric_on_the_fixture_host() -> None:
    adapters, _ = read_ib_adapters(SYSFS)
    fabrics, warnings = advertise_fabrics(
        {"ndr": [f"mlx5_{i}" for i in (0, 1, 4, 5)], "roce": ["mlx5_bond_0"]},
        adapters,
        {"ndr": "ib0"},  # agent.yaml's fabrics.ndr.interface; roce names none
    )
    assert fabrics == (
        Fabric("ndr", ("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5"), 400.0, "ib0"),
        Fabric("roce", ("mlx5_bond_0",), 200.0, None),
    )
    assert warnings == ()


def test_a_broken_adapter_is_left_out_with_a_warning(tmp_path: Path) -> None:
    make_adapter(tmp_path, "mlx5_0", "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand")
    make_adapter(tmp_path, "mlx5_1", "garbage!", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand")
    adapters, warnings = read_ib_adapters(tmp_path)
    assert [a.name for a in adapters] == ["mlx5_0"]
    assert len(warnings) == 1 and "mlx5_1" in warnings[0] and "garbage!" in warnings[0]


def test_ibstatus_fixture() -> None:
    adapters = parse_ibstatus((FIXTURES / "ib-ibstatus-a100-azure-hdr200-active.txt").read_text())
    assert [a.name for a in adapters] == [f"mlx5_{i}" for i in range(9)]
    for a in adapters[:8]:
        assert a.ports == (IbPort(1, "ACTIVE", "LinkUp", 200.0, "InfiniBand"),)
    assert adapters[8].ports == (IbPort(1, "ACTIVE", "LinkUp", 40.0, "Ethernet"),)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4: ACTIVE", "ACTIVE"), ("4: ACTIVE\n", "ACTIVE"), ("2: INIT", "INIT"), ("DOWN", "DOWN")],
)
def test_state(text: str, value: str) -> None:
    assert parse_ib_state(text) == value


def test_phys_state_and_rate() -> None:
    assert parse_ib_phys_state("5: LinkUp\n") == "LinkUp"
    assert parse_ib_phys_state("7: Phy Test") == "Phy Test"
    assert parse_ib_rate("400 Gb/sec (4X NDR)") == 400.0
    assert parse_ib_rate("2.5 Gb/sec (1X SDR)\n") == 2.5
    assert parse_ib_rate("200 Gb/sec (2X NDR)") == 200.0
    for bad in ("", "fast", "400", "4: ACTIVE"):
        with pytest.raises(ParseError):
            parse_ib_rate(bad)
    with pytest.raises(ParseError):
        parse_ib_state("four: active")
