"""How an inventory reads to a person (`llmgw-agent inventory`) and as JSON.

Unknown values print as `-`, never as 0: an operator must be able to tell "the
probe could not say" from "there is none".
"""

from __future__ import annotations

from typing import Any

import cattrs

from llmgw.core import bytes_text
from llmgw.model import Filesystem, Gpu, Inventory

_converter = cattrs.Converter()
_DASH = "-"


def inventory_to_json(inv: Inventory) -> dict[str, Any]:
    """The inventory as plain JSON-ready data; None stays null, tuples become lists."""
    data = _converter.unstructure(inv)
    assert isinstance(data, dict)
    return data


def _v(value: object, unit: str = "") -> str:
    if value is None:
        return _DASH
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{text}{unit}"


def _bytes(n: int | None) -> str:
    return _DASH if n is None else bytes_text(n)


def _gpu_line(g: Gpu) -> str:
    mig = ""
    if g.mig_mode is not None:
        mig = f"  mig {g.mig_mode}" + (f" (next reset: {g.mig_pending})" if g.mig_pending else "")
    instances = "".join(
        f"\n     MIG {d.profile}  {d.uuid}  gi {_v(d.gpu_instance)}  ci {_v(d.compute_instance)}"
        f"  mem {_v(d.memory_mib, ' MiB')}"
        for d in g.mig_devices
    )
    return (
        f"  {g.index}  {g.gpu_class}  {g.name}  bus {_v(g.pci_bus_id)}"
        f"  mem {_v(g.memory_used_mib)}/{_v(g.memory_total_mib)} MiB"
        f"  util {_v(g.utilization_pct, '%')}  cc {_v(g.compute_capability)}"
        f"  ecc {_v(g.ecc_uncorrected)}  foreign {_v(g.foreign_memory_mib, ' MiB')}"
        f"  numa {_v(g.numa_node)}  cpus {_v(g.cpu_affinity)}{mig}{instances}"
    )


def _fs_line(fs: Filesystem) -> str:
    shared = "  shared (not counted as the node's own)" if fs.shared else ""
    return (
        f"  {fs.mount}  {fs.fstype}  free {_bytes(fs.free_bytes)} of {_bytes(fs.total_bytes)}"
        f"  for {', '.join(fs.paths)}{shared}"
    )


def format_inventory(inv: Inventory) -> str:
    """A page of text: host, GPUs, topology, RDMA, storage, weights, engines, warnings."""
    h, u = inv.host, inv.usage
    os_name = " ".join(x for x in (h.os_id, h.os_version) if x) or _DASH
    like = f" (like {', '.join(h.os_like)})" if h.os_like else ""
    lines = [
        f"host        {h.hostname}  {os_name}{like}  {_v(h.arch)}",
        f"cpu         {_v(h.cpu_model)}  {_v(h.cpu_count)} logical"
        f"  {' '.join(h.cpu_flags) or _DASH}",
        f"driver      {_v(h.driver_version)}  cuda {_v(h.cuda_version)}",
        f"memory      total {_bytes(u.memory_total_bytes)}"
        f"  available {_bytes(u.memory_available_bytes)}",
        f"load        {_v(u.load1)} {_v(u.load5)} {_v(u.load15)}  cpu {_v(u.cpu_util_pct, '%')}",
    ]
    if inv.gpus is None:
        lines.append(f"gpus        {_DASH} (could not tell)")
    else:
        lines.append(f"gpus        {len(inv.gpus) or 'none'}")
        lines.extend(_gpu_line(g) for g in inv.gpus)
    if inv.topology is not None:
        nv = "  ".join(f"{n.a}-{n.b} NV{n.links}" for n in inv.topology.nvlinks)
        lines.append(f"nvlink      {nv or 'none'}")
        by_gpu: dict[int, list[str]] = {}
        for d in inv.topology.nic_distances:
            by_gpu.setdefault(d.gpu, []).append(f"{d.nic} {d.distance}")
        for gpu, nics in sorted(by_gpu.items()):
            lines.append(f"  GPU{gpu} nics  {', '.join(nics)}")
    lines.append(f"rdma        {len(inv.ib_adapters) or 'none'}")
    for a in inv.ib_adapters:
        ports = "; ".join(
            f"port {p.number} {p.state} {p.phys_state} {_v(p.rate_gbps, ' Gb/s')} {p.link_layer}"
            for p in a.ports
        )
        lines.append(f"  {a.name}  {_v(a.hca_type)}  fw {_v(a.fw_ver)}  {ports or 'no ports'}")
    lines.append(f"fabrics     {len(inv.fabrics) or 'none'}")
    for f in inv.fabrics:
        lines.append(f"  {f.name}  {', '.join(f.adapters)}  {_v(f.rate_gbps, ' Gb/s')}")
    lines.append(f"storage     {len(u.filesystems) or 'none'}")
    lines.extend(_fs_line(fs) for fs in u.filesystems)
    if inv.weights is None:
        lines.append(f"weights     {_DASH}")
    else:
        total = sum(f.size_bytes for f in inv.weights.files)
        lines.append(
            f"weights     {len(inv.weights.files)} files, {_bytes(total)}"
            f"  fingerprint {inv.weights.fingerprint[:16]}"
        )
    if inv.engines is None:
        lines.append(f"engines     {_DASH}")
    else:
        found = "; ".join(f"{e.name} {e.path}" for e in inv.engines.found)
        lines.append(f"engines     {found or 'none'}")
    if inv.warnings:
        lines.append("warnings")
        lines.extend(f"  - {w}" for w in inv.warnings)
    return "\n".join(lines) + "\n"
