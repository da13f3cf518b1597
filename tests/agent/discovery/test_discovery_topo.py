"""`nvidia-smi topo -m`: every recorded layout parses to the values it shows."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

from llmgw.agent.discovery import GpuAffinity, TopoMatrix, parse_topo
from llmgw.errors import ParseError
from llmgw.model import NicDistance, NvLink


def topo(name: str) -> TopoMatrix:
    return parse_topo((FIXTURES / name).read_text())


def test_h100_sxm_nic_legend_layout() -> None:
    m = topo("topo-h100sxm-8gpu-nv18-8nics-niclegend-gpunumaid-drv570.txt")
    # NVSwitch: every pair of the 8 GPUs at NV18.
    assert m.topology.nvlinks == tuple(NvLink(a, b, 18) for a in range(8) for b in range(a + 1, 8))
    d = {(x.gpu, x.nic): x.distance for x in m.topology.nic_distances}
    assert len(d) == 64
    assert d[(0, "mlx5_0")] == "PIX"
    assert d[(0, "mlx5_1")] == "NODE"
    assert d[(0, "mlx5_4")] == "SYS"
    assert d[(5, "mlx5_5")] == "PIX"
    assert d[(7, "mlx5_3")] == "SYS"
    assert m.affinity[0] == GpuAffinity(0, "0-47,96-143", 0)
    assert m.affinity[4] == GpuAffinity(4, "48-95,144-191", 1)
    assert [a.numa_node for a in m.affinity] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_h100_pcie_single_gpu_kvm() -> None:
    m = topo("topo-h100pcie-1gpu-1nic-kvm-drv575.txt")
    assert m.topology.nvlinks == ()
    assert m.topology.nic_distances == (NicDistance(0, "mlx5_0", "PHB"),)
    assert m.affinity == (GpuAffinity(0, "0-251", 0),)


def test_rtx6000ada_pcie_no_nvlink() -> None:
    m = topo("topo-rtx6000ada-4gpu-pcie-4nics-niclegend-gpunumaid.txt")
    assert m.topology.nvlinks == ()
    d = {(x.gpu, x.nic): x.distance for x in m.topology.nic_distances}
    assert d == {
        (0, "mlx5_0"): "NODE", (0, "mlx5_1"): "NODE", (0, "mlx5_2"): "SYS", (0, "mlx5_3"): "SYS",
        (1, "mlx5_0"): "NODE", (1, "mlx5_1"): "NODE", (1, "mlx5_2"): "SYS", (1, "mlx5_3"): "SYS",
        (2, "mlx5_0"): "SYS", (2, "mlx5_1"): "SYS", (2, "mlx5_2"): "NODE", (2, "mlx5_3"): "NODE",
        (3, "mlx5_0"): "SYS", (3, "mlx5_1"): "SYS", (3, "mlx5_2"): "NODE", (3, "mlx5_3"): "NODE",
    }  # fmt: skip
    assert [(a.cpu_affinity, a.numa_node) for a in m.affinity] == [
        ("0-31", 0), ("0-31", 0), ("32-63", 1), ("32-63", 1)
    ]  # fmt: skip


def test_v100_drv470_adapter_columns_tabs_and_hand_aligned_x() -> None:
    m = topo("topo-v100sxm2-drv470-mlx5cols-numa.txt")
    links = {(n.a, n.b): n.links for n in m.topology.nvlinks}
    # Hybrid cube mesh: each GPU has 4 peers with NV1/NV2; 16 pairs in all.
    assert len(links) == 16
    assert links[(0, 1)] == 1 and links[(0, 2)] == 2 and links[(0, 3)] == 1 and links[(0, 7)] == 2
    assert links[(4, 7)] == 1 and links[(5, 6)] == 1 and links[(6, 7)] == 1
    assert (0, 4) not in links
    d = {(x.gpu, x.nic): x.distance for x in m.topology.nic_distances}
    assert d[(2, "mlx5_0")] == "PIX" and d[(0, "mlx5_0")] == "NODE" and d[(0, "mlx5_1")] == "SYS"
    assert d[(7, "mlx5_1")] == "PIX"
    assert m.affinity[0] == GpuAffinity(0, "0-23,48-71", 0)
    assert m.affinity[7] == GpuAffinity(7, "24-47,72-95", 1)


def test_v100_drv440_cpu_affinity_only() -> None:
    m = topo("topo-v100sxm2-dgx1like-drv440-cpuaffinity-only.txt")
    links = {(n.a, n.b): n.links for n in m.topology.nvlinks}
    assert len(links) == 16
    assert links[(0, 3)] == 2 and links[(0, 4)] == 2 and links[(1, 5)] == 2 and links[(3, 7)] == 1
    d = {(x.gpu, x.nic): x.distance for x in m.topology.nic_distances}
    assert d == {
        (0, "mlx5_0"): "NODE", (1, "mlx5_0"): "NODE", (2, "mlx5_0"): "PIX", (3, "mlx5_0"): "PIX",
        (4, "mlx5_0"): "SYS", (5, "mlx5_0"): "SYS", (6, "mlx5_0"): "SYS", (7, "mlx5_0"): "SYS",
    }  # fmt: skip
    # An old driver prints no NUMA column: unknown, not node 0.
    assert [a.numa_node for a in m.affinity] == [None] * 8
    assert m.affinity[4].cpu_affinity == "12-23,36-47"


def test_a100_della_two_numa_nodes() -> None:
    m = topo("topo-a100pcie-2gpu-mlx5cols-della.txt")
    assert m.topology.nvlinks == ()
    assert m.topology.nic_distances == (
        NicDistance(0, "mlx5_0", "NODE"),
        NicDistance(0, "mlx5_1", "SYS"),
        NicDistance(1, "mlx5_0", "SYS"),
        NicDistance(1, "mlx5_1", "NODE"),
    )
    assert m.affinity == (GpuAffinity(0, "0-63", 0), GpuAffinity(1, "64-127", 1))


def test_tabs_and_spaces_read_the_same() -> None:
    text = (FIXTURES / "topo-a100pcie-2gpu-mlx5cols-della.txt").read_text()
    assert parse_topo(text.replace("\t", "    ")) == parse_topo(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nothing here\n",
        "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\n",  # a short GPU row
        "\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n",  # not a link kind
        "\tGPU0\tCPU Affinity\nGPU0\t X \tzero\n",  # not a CPU list
        "\tGPU0\tCPU Affinity\nGPU9\t X \t0-3\n",  # a row the header does not name
        "\tGPU0\tCPU Affinity\tGPU1\nGPU0\t X \t0-3\tNV1\n",  # affinity not last
    ],
)
def test_unreadable_matrices_raise_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        parse_topo(text)
