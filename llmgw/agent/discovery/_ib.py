"""InfiniBand / RoCE adapters from sysfs, and which declared fabrics to advertise.

The kernel exposes every RDMA adapter under /sys/class/infiniband/<name>/, with
one directory per port under ports/<n>/ holding `state` ("4: ACTIVE"),
`phys_state` ("5: LinkUp"), `rate` ("400 Gb/sec (4X NDR)") and `link_layer`
("InfiniBand" or "Ethernet" for RoCE). Real sysfs values end with a newline;
copies of them (test fixtures, `ibstatus` output) often do not: both are read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmgw.errors import ParseError
from llmgw.model import Fabric, IbAdapter, IbPort

logger = logging.getLogger("llmgw.agent.discovery")

_STATE = re.compile(r"(?:(\d+):\s*)?([A-Z][A-Z_]*)")
_PHYS_STATE = re.compile(r"(?:(\d+):\s*)?([A-Za-z][A-Za-z ]*[A-Za-z])")
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*Gb/sec(?:\s*\([^)]*\))?")
_LINK_LAYER = re.compile(r"[A-Za-z][A-Za-z0-9 ]*")


def parse_ib_state(text: str, *, source: str = "state") -> str:
    """`4: ACTIVE` -> `ACTIVE` (a bare `ACTIVE` is read too)."""
    m = _STATE.fullmatch(text.strip())
    if m is None:
        raise ParseError(source, f"{text.strip()[:80]!r} is not a port state like '4: ACTIVE'")
    return m.group(2)


def parse_ib_phys_state(text: str, *, source: str = "phys_state") -> str:
    """`5: LinkUp` -> `LinkUp`; `7: Phy Test` -> `Phy Test`."""
    m = _PHYS_STATE.fullmatch(text.strip())
    if m is None:
        raise ParseError(source, f"{text.strip()[:80]!r} is not a physical state like '5: LinkUp'")
    return m.group(2)


def parse_ib_rate(text: str, *, source: str = "rate") -> float:
    """`400 Gb/sec (4X NDR)` -> 400.0; `2.5 Gb/sec (1X SDR)` -> 2.5."""
    m = _RATE.fullmatch(text.strip())
    if m is None:
        raise ParseError(source, f"{text.strip()[:80]!r} is not a rate like '400 Gb/sec (4X NDR)'")
    return float(m.group(1))


def parse_ib_link_layer(text: str, *, source: str = "link_layer") -> str:
    value = text.strip()
    if not _LINK_LAYER.fullmatch(value):
        raise ParseError(source, f"{value[:80]!r} is not a link layer like 'InfiniBand'")
    return value


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def read_ib_adapter(adapter_dir: Path) -> IbAdapter:
    """One adapter's directory (…/infiniband/mlx5_0). Raises ParseError, naming the file."""
    ports: list[IbPort] = []
    ports_dir = adapter_dir / "ports"
    try:
        port_dirs = sorted(
            (p for p in ports_dir.iterdir() if p.name.isdecimal()), key=lambda p: int(p.name)
        )
    except OSError:
        port_dirs = []
    for port_dir in port_dirs:
        state_text = _read(port_dir / "state")
        phys_text = _read(port_dir / "phys_state")
        if state_text is None or phys_text is None:
            raise ParseError(str(port_dir), "port has no readable state or phys_state")
        rate_text = _read(port_dir / "rate")
        layer_text = _read(port_dir / "link_layer")
        ports.append(
            IbPort(
                number=int(port_dir.name),
                state=parse_ib_state(state_text, source=str(port_dir / "state")),
                phys_state=parse_ib_phys_state(phys_text, source=str(port_dir / "phys_state")),
                # A down port's rate can be unreadable (EINVAL) on some drivers.
                rate_gbps=None
                if rate_text is None
                else parse_ib_rate(rate_text, source=str(port_dir / "rate")),
                # Kernels before 2.6.37 had no link_layer: all of them were InfiniBand.
                link_layer="InfiniBand"
                if layer_text is None
                else parse_ib_link_layer(layer_text, source=str(port_dir / "link_layer")),
            )
        )
    hca = _read(adapter_dir / "hca_type")
    fw = _read(adapter_dir / "fw_ver")
    return IbAdapter(
        name=adapter_dir.name,
        ports=tuple(ports),
        hca_type=hca.strip() or None if hca is not None else None,
        fw_ver=fw.strip() or None if fw is not None else None,
    )


def read_ib_adapters(class_dir: Path) -> tuple[tuple[IbAdapter, ...], tuple[str, ...]]:
    """Every adapter under `class_dir` (normally /sys/class/infiniband).

    An adapter that cannot be read is left out with a warning saying why, so
    one broken adapter does not hide the others. No directory: no adapters.
    """
    try:
        entries = sorted(class_dir.iterdir(), key=lambda p: _natural(p.name))
    except OSError:
        return (), ()
    adapters: list[IbAdapter] = []
    warnings: list[str] = []
    for entry in entries:
        try:
            adapters.append(read_ib_adapter(entry))
        except ParseError as e:
            logger.warning("RDMA adapter %s left out: %s", entry.name, e)
            warnings.append(f"RDMA adapter {entry.name} left out: {e}")
    return tuple(adapters), tuple(warnings)


def _natural(name: str) -> tuple[object, ...]:
    # mlx5_2 before mlx5_10
    return tuple(int(p) if p.isdecimal() else p for p in re.split(r"(\d+)", name))


_IBSTATUS_HEAD = re.compile(r"Infiniband device '([^']+)' port (\d+) status:")
_IBSTATUS_LINE = re.compile(r"\s+([a-z_ ]+?):\s*(.*)")


def parse_ibstatus(text: str, *, source: str = "ibstatus") -> tuple[IbAdapter, ...]:
    """Adapters from `ibstatus`, which prints the sysfs strings of each port."""
    blocks: list[tuple[str, int, dict[str, str]]] = []
    for ln in text.splitlines():
        if not ln.strip():
            continue
        head = _IBSTATUS_HEAD.fullmatch(ln.strip())
        if head is not None:
            blocks.append((head.group(1), int(head.group(2)), {}))
            continue
        m = _IBSTATUS_LINE.fullmatch(ln.rstrip())
        if m is None or not blocks:
            raise ParseError(source, f"unexpected line {ln[:80]!r}")
        blocks[-1][2][m.group(1)] = m.group(2)
    ports: dict[str, list[IbPort]] = {}
    for name, number, kv in blocks:
        if "state" not in kv or "phys state" not in kv:
            raise ParseError(source, f"{name} port {number} has no state or phys state")
        rate = kv.get("rate")
        ports.setdefault(name, []).append(
            IbPort(
                number=number,
                state=parse_ib_state(kv["state"], source=source),
                phys_state=parse_ib_phys_state(kv["phys state"], source=source),
                rate_gbps=None if rate is None else parse_ib_rate(rate, source=source),
                link_layer=parse_ib_link_layer(kv.get("link_layer", "InfiniBand"), source=source),
            )
        )
    return tuple(IbAdapter(name=n, ports=tuple(p)) for n, p in ports.items())


def advertise_fabrics(
    declared: Mapping[str, Sequence[str]],
    adapters: Sequence[IbAdapter],
    interfaces: Mapping[str, str] | None = None,
) -> tuple[tuple[Fabric, ...], tuple[str, ...]]:
    """The declared fabrics this node can really use, and why the rest are not advertised.

    An adapter joins its fabric only if it is present and has an ACTIVE port: a
    replica placed for a fabric whose link is down would fall back to TCP
    silently and run many times slower. A fabric's rate is its slowest active
    link (collectives go at the pace of the slowest rail). A fabric left with
    no adapter is not advertised. `interfaces` names, per fabric, the socket
    interface its engines' NCCL/Gloo bootstrap should use (agent.yaml's
    `fabrics.<name>.interface`); it travels with the fabric to the control plane,
    which puts it in a multi-node shard's environment.
    """
    by_name = {a.name: a for a in adapters}
    fabrics: list[Fabric] = []
    warnings: list[str] = []

    def warn(message: str) -> None:
        logger.warning("%s", message)
        warnings.append(message)

    for fabric, names in declared.items():
        usable: list[str] = []
        rates: list[float] = []
        for name in names:
            adapter = by_name.get(name)
            if adapter is None:
                warn(f"fabric {fabric}: adapter {name} not present")
                continue
            active = [p for p in adapter.ports if p.state == "ACTIVE"]
            if not active:
                seen = ", ".join(f"port {p.number} {p.state}" for p in adapter.ports)
                warn(f"fabric {fabric}: adapter {name} has no ACTIVE port ({seen or 'no ports'})")
                continue
            usable.append(name)
            rates.extend(p.rate_gbps for p in active if p.rate_gbps is not None)
        if not usable:
            warn(f"fabric {fabric}: not advertised, none of its adapters is usable")
            continue
        slowest = min(rates, default=None)
        interface = (interfaces or {}).get(fabric)
        fabrics.append(
            Fabric(name=fabric, adapters=tuple(usable), rate_gbps=slowest, interface=interface)
        )
    return tuple(fabrics), tuple(warnings)
