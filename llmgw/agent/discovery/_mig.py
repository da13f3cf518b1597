"""MIG (Multi-Instance GPU): a card's mode and its instances, from nvidia-smi.

nvidia-smi says it in three places, none of which has all of it:

- `--query-gpu=uuid,mig.mode.current,mig.mode.pending --format=csv`: the mode
  now and after the next GPU reset, per card (`[N/A]` on a card without MIG);
- `nvidia-smi -L`: each instance's profile and UUID, under its card:

      GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)
        MIG 3g.40gb     Device  0: (UUID: MIG-...)

- `nvidia-smi -q`: each instance's GPU and compute instance ids and memory,
  by the same device index, under the card's bus id (`MIG Device` /
  `Index`, `GPU Instance ID`, `Compute Instance ID`, `Shared FB Memory Usage`
  / `Total`; drivers before 525 print `FB Memory Usage`).

Pure functions from text to values; each raises `ParseError` on text that is
not its command's output. `join_mig` puts the two lists together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from llmgw.errors import ParseError
from llmgw.model import Gpu, MigDevice

from ._smi import parse_smi_csv, smi_int

#: The --query-gpu fields the MIG mode is read from (asked with a header, as recorded).
MIG_MODE_FIELDS: tuple[str, ...] = ("uuid", "mig.mode.current", "mig.mode.pending")

_LIST_GPU = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*\(UUID:\s*(GPU-[^)\s]+)\)\s*$")
_LIST_MIG = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID:\s*(MIG-[^)\s]+)\)\s*$")
_Q_GPU = re.compile(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_Q_FIELD = re.compile(r"^(?P<key>[^:]+?)\s*:\s*(?P<value>.*?)\s*$")


def mig_mode(value: str | None) -> str | None:
    """ "Enabled" -> "enabled", "Disabled" -> "disabled"; anything else (N/A) unknown."""
    v = (value or "").strip().lower()
    return v if v in ("enabled", "disabled") else None


def parse_mig_modes(
    text: str, *, source: str = "nvidia-smi --query-gpu=uuid,mig.mode.current,mig.mode.pending"
) -> dict[str, tuple[str | None, str | None]]:
    """Card UUID -> (current mode, pending mode), each "enabled"/"disabled" or None."""
    result: dict[str, tuple[str | None, str | None]] = {}
    for row in parse_smi_csv(text, MIG_MODE_FIELDS, source=source):
        uuid = row.get("uuid")
        if uuid is None:
            raise ParseError(source, f"a row has no uuid: {row}")
        result[uuid] = (
            mig_mode(row.get("mig.mode.current")),
            mig_mode(row.get("mig.mode.pending")),
        )
    return result


@attrs.frozen
class ListedMig:
    """One `MIG <profile> Device <n>: (UUID: MIG-...)` line of `nvidia-smi -L`."""

    gpu_index: int
    gpu_uuid: str
    device: int  # the MIG device index, as `-q` numbers it too
    profile: str
    uuid: str


def parse_smi_list(text: str, *, source: str = "nvidia-smi -L") -> tuple[ListedMig, ...]:
    """The MIG instances `nvidia-smi -L` lists, each under its card."""
    found: list[ListedMig] = []
    card: tuple[int, str] | None = None
    seen_card = False
    for line in text.splitlines():
        if not line.strip():
            continue
        g = _LIST_GPU.match(line)
        if g is not None:
            card = (int(g.group(1)), g.group(3))
            seen_card = True
            continue
        m = _LIST_MIG.match(line)
        if m is not None:
            if card is None:
                raise ParseError(source, f"a MIG line before any GPU line: {line.strip()!r}")
            found.append(ListedMig(card[0], card[1], int(m.group(2)), m.group(1), m.group(3)))
    if not seen_card:
        raise ParseError(source, "no 'GPU <n>: <name> (UUID: GPU-...)' line")
    return tuple(found)


@attrs.frozen
class QueriedMig:
    """One `MIG Device` section of `nvidia-smi -q`; None: not said."""

    device: int
    gpu_instance: int | None = None
    compute_instance: int | None = None
    memory_mib: int | None = None


def parse_smi_q_mig(
    text: str, *, source: str = "nvidia-smi -q"
) -> dict[str | None, tuple[QueriedMig, ...]]:
    """Bus id as printed (`00000000:00:09.0`) -> the card's `MIG Device` sections.

    Sections nest by indentation (tabs or spaces, only the order counts). A
    card without MIG devices is absent. Raises when there is no `GPU <bus id>`
    line: that is not this command's output.
    """
    result: dict[str | None, list[dict[str, int | None]]] = {}
    gpu: str | None = None
    seen_gpu = False
    stack: list[tuple[int, str]] = []
    for raw in text.splitlines():
        line = raw.expandtabs(4).rstrip()
        if not line.strip():
            continue
        g = _Q_GPU.match(line)
        if g is not None:
            gpu, seen_gpu, stack = g.group(1), True, []
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        f = _Q_FIELD.match(line.strip())
        path = [h for _, h in stack]
        if f is None:
            stack.append((indent, line.strip()))
            if line.strip() == "MIG Device" and len(path) == 0:
                result.setdefault(gpu, []).append({})
            continue
        if not path or path[0] != "MIG Device" or gpu not in result:
            continue
        key, value = f.group("key"), f.group("value")
        where = f"{source} GPU {gpu} MIG Device"
        entry = result[gpu][-1]
        if path == ["MIG Device"]:
            names = {"Index": "device", "GPU Instance ID": "gi", "Compute Instance ID": "ci"}
            if key in names:
                entry[names[key]] = _int(value, where, key)
        elif path[1:] in (["Shared FB Memory Usage"], ["FB Memory Usage"]) and key == "Total":
            entry["memory"] = _int(value, where, "Total")
    if not seen_gpu:
        raise ParseError(source, "no 'GPU <bus id>' line")
    out: dict[str | None, tuple[QueriedMig, ...]] = {}
    for bus, entries in result.items():
        devices = []
        for e in entries:
            if e.get("device") is None:
                raise ParseError(source, f"GPU {bus}: a MIG Device section without an Index")
            devices.append(QueriedMig(e["device"] or 0, e.get("gi"), e.get("ci"), e.get("memory")))
        out[bus] = tuple(devices)
    return out


def _int(value: str, source: str, field: str) -> int | None:
    if value.strip() in ("N/A", "") or value.strip().startswith("["):
        return None
    return smi_int(value, source=source, field=field)


def join_mig(
    listed: tuple[ListedMig, ...], queried: Mapping[str | None, tuple[QueriedMig, ...]], gpu: Gpu
) -> tuple[MigDevice, ...]:
    """`gpu`'s instances: profile and UUID from `-L`, the rest from `-q` by device index.

    An instance `-q` does not describe keeps its ids and memory unknown.
    """
    by_device = {q.device: q for q in queried.get(gpu.pci_bus_id, ())}
    devices = []
    for m in sorted((m for m in listed if m.gpu_uuid == gpu.uuid), key=lambda m: m.device):
        q = by_device.get(m.device)
        devices.append(
            MigDevice(
                uuid=m.uuid,
                profile=m.profile,
                memory_mib=q.memory_mib if q else None,
                gpu_instance=q.gpu_instance if q else None,
                compute_instance=q.compute_instance if q else None,
            )
        )
    return tuple(devices)


def mig_warnings(gpus: tuple[Gpu, ...]) -> tuple[str, ...]:
    """One warning per card whose MIG mode changes at its next reset (llmgw does not reset)."""
    return tuple(
        f"gpu {g.index}: MIG mode change pending a GPU reset ({g.mig_mode or 'unknown'} -> "
        f"{g.mig_pending})"
        for g in gpus
        if g.mig_pending is not None
    )


def pending_of(current: str | None, pending: str | None) -> str | None:
    """The pending mode worth reporting: only a known one that differs from the current."""
    return pending if pending is not None and pending != current else None
