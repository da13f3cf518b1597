"""GPUs through NVML (pynvml), the driver's own library.

NVML answers what nvidia-smi does without a process per query, but what it
can say differs by driver, card and pynvml version: every call is wrapped, and
a call that fails leaves its value unknown rather than failing the probe. Only
the card list itself (count, UUID, name) must come through; without it the
probe falls back to nvidia-smi.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from typing import Any

import attrs

from llmgw.model import Gpu, MigDevice, NvLink

from ._smi import ComputeApp, gpu_class

logger = logging.getLogger("llmgw.agent.discovery")

NvmlLoader = Callable[[], Any]

_MIB = 1024 * 1024
# NVML's enum values, used when the module does not name them.
_NVML_FEATURE_ENABLED = 1
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_NVML_NVLINK_MAX_LINKS = 18
_NVML_DEVICE_MIG_ENABLE = 1
_NVML_DEVICE_MIG_DISABLE = 0
# A MIG device's name is its card's with the profile appended: "... MIG 3g.40gb".
_MIG_PROFILE_IN_NAME = re.compile(r"\bMIG\s+(\S+)\s*$")


class NvmlUnavailable(Exception):
    """NVML cannot list the cards; the message says why (shown to the operator)."""


def load_pynvml() -> Any:
    """Import pynvml. The 'pynvml' distribution warns on import that it is
    deprecated in favour of nvidia-ml-py (which ships the same module); that
    is not the operator's concern, and with warnings as errors it would abort."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pynvml

    return pynvml


@attrs.frozen
class NvmlReading:
    gpus: tuple[Gpu, ...]
    nvlinks: tuple[NvLink, ...]
    driver_version: str | None
    cuda_version: str | None
    # Per card UUID: the processes holding memory; None where NVML could not say.
    apps: dict[str, tuple[ComputeApp, ...] | None]


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    text = str(value).strip()
    return text or None


def _bus_key(bus_id: str) -> tuple[int, str] | None:
    # NVML prints the domain with 8 digits for the device and sometimes 4 for
    # a remote end; compare the number, not the text.
    domain, sep, rest = bus_id.strip().lower().partition(":")
    try:
        return (int(domain, 16), rest) if sep else None
    except ValueError:
        return None


def read_nvml(nvml: Any, *, with_nvlinks: bool = True) -> NvmlReading:
    """Everything NVML says about the cards. Raises NvmlUnavailable when it cannot list them."""

    def call(name: str, *args: Any) -> Any:
        fn = getattr(nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # pynvml raises NVMLError subclasses, ctypes errors, ...
            logger.debug("NVML %s%r: %s", name, args, e)
            return None

    try:
        nvml.nvmlInit()
    except Exception as e:
        raise NvmlUnavailable(f"nvmlInit failed: {e}") from e
    try:
        count = call("nvmlDeviceGetCount")
        if not isinstance(count, int):
            raise NvmlUnavailable("nvmlDeviceGetCount gave no answer")
        driver = _text(call("nvmlSystemGetDriverVersion"))
        cuda_int = call("nvmlSystemGetCudaDriverVersion_v2")
        if not isinstance(cuda_int, int):
            cuda_int = call("nvmlSystemGetCudaDriverVersion")
        cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}" if isinstance(cuda_int, int) else None

        handles: list[Any] = []
        gpus: list[Gpu] = []
        apps: dict[str, tuple[ComputeApp, ...] | None] = {}
        for i in range(count):
            h = call("nvmlDeviceGetHandleByIndex", i)
            uuid = _text(call("nvmlDeviceGetUUID", h)) if h is not None else None
            name = _text(call("nvmlDeviceGetName", h)) if h is not None else None
            if uuid is None or name is None:
                raise NvmlUnavailable(f"NVML gave no handle, UUID or name for GPU {i}")
            pci = call("nvmlDeviceGetPciInfo", h)
            mem = call("nvmlDeviceGetMemoryInfo", h)
            total = getattr(mem, "total", None)
            used = getattr(mem, "used", None)
            total_mib = total // _MIB if isinstance(total, int) else None
            cc = call("nvmlDeviceGetCudaComputeCapability", h)
            util = call("nvmlDeviceGetUtilizationRates", h)
            util_gpu = getattr(util, "gpu", None)
            uncorrected = getattr(
                nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", _NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            )
            volatile = getattr(nvml, "NVML_VOLATILE_ECC", _NVML_VOLATILE_ECC)
            ecc = call("nvmlDeviceGetTotalEccErrors", h, uncorrected, volatile)
            mode, pending, mig_devices = _mig(nvml, call, h)
            gpus.append(
                Gpu(
                    index=i,
                    uuid=uuid,
                    name=name,
                    gpu_class=gpu_class(name, total_mib),
                    pci_bus_id=_text(getattr(pci, "busId", None)),
                    memory_total_mib=total_mib,
                    memory_used_mib=used // _MIB if isinstance(used, int) else None,
                    compute_capability=f"{cc[0]}.{cc[1]}"
                    if isinstance(cc, tuple) and len(cc) == 2
                    else None,
                    ecc_uncorrected=ecc if isinstance(ecc, int) else None,
                    utilization_pct=float(util_gpu) if isinstance(util_gpu, int | float) else None,
                    mig_mode=mode,
                    mig_pending=pending,
                    mig_devices=mig_devices,
                )
            )
            handles.append(h)
            apps[uuid] = _apps(call("nvmlDeviceGetComputeRunningProcesses", h), uuid)
        nvlinks = _nvlinks(nvml, call, handles, gpus) if with_nvlinks else ()
        return NvmlReading(tuple(gpus), nvlinks, driver, cuda, apps)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as e:
            logger.debug("nvmlShutdown: %s", e)


def _mig(
    nvml: Any, call: Callable[..., Any], h: Any
) -> tuple[str | None, str | None, tuple[MigDevice, ...]]:
    """The card's MIG mode, its pending mode when that differs, and its instances.

    A card without MIG (or a driver that cannot say) is (None, None, ()). An
    instance whose UUID or profile NVML does not give is left out, with a
    debug line: without them it cannot be named in CUDA_VISIBLE_DEVICES.
    """
    modes = call("nvmlDeviceGetMigMode", h)
    if not isinstance(modes, list | tuple) or len(modes) != 2:
        return None, None, ()
    enable = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", _NVML_DEVICE_MIG_ENABLE)
    disable = getattr(nvml, "NVML_DEVICE_MIG_DISABLE", _NVML_DEVICE_MIG_DISABLE)
    names = {enable: "enabled", disable: "disabled"}
    current, pending = names.get(modes[0]), names.get(modes[1])
    pending = pending if pending is not None and pending != current else None
    if current != "enabled":
        return current, pending, ()
    count = call("nvmlDeviceGetMaxMigDeviceCount", h)
    devices: list[MigDevice] = []
    for i in range(count if isinstance(count, int) else 0):
        mh = call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
        if mh is None:
            continue  # no instance at this index (the driver answers NOT_FOUND)
        uuid = _text(call("nvmlDeviceGetUUID", mh))
        m = _MIG_PROFILE_IN_NAME.search(_text(call("nvmlDeviceGetName", mh)) or "")
        if uuid is None or m is None:
            logger.debug("NVML MIG device %d: no UUID or no profile in its name; left out", i)
            continue
        total = getattr(call("nvmlDeviceGetMemoryInfo", mh), "total", None)
        gi = call("nvmlDeviceGetGpuInstanceId", mh)
        ci = call("nvmlDeviceGetComputeInstanceId", mh)
        devices.append(
            MigDevice(
                uuid=uuid,
                profile=m.group(1),
                memory_mib=total // _MIB if isinstance(total, int) else None,
                gpu_instance=gi if isinstance(gi, int) else None,
                compute_instance=ci if isinstance(ci, int) else None,
            )
        )
    return current, pending, tuple(devices)


def _apps(procs: Any, uuid: str) -> tuple[ComputeApp, ...] | None:
    if procs is None:
        return None
    result: list[ComputeApp] = []
    try:
        for p in procs:
            pid = getattr(p, "pid", None)
            if not isinstance(pid, int):
                return None
            used = getattr(p, "usedGpuMemory", None)
            result.append(ComputeApp(uuid, pid, used // _MIB if isinstance(used, int) else None))
    except TypeError:
        return None
    return tuple(result)


def _nvlinks(
    nvml: Any, call: Callable[..., Any], handles: list[Any], gpus: list[Gpu]
) -> tuple[NvLink, ...]:
    """GPU pairs joined by NVLink, counted link by link from each card's side.

    Links to an NVSwitch (HGX H100/H200) have a switch at the far end, not a
    GPU, so they give no pair here; `topo -m` reports those.
    """
    by_bus = {_bus_key(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", _NVML_FEATURE_ENABLED)
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", _NVML_NVLINK_MAX_LINKS)
    counts: dict[tuple[int, int], int] = {}
    for gpu, h in zip(gpus, handles, strict=True):
        for link in range(max_links):
            if call("nvmlDeviceGetNvLinkState", h, link) != enabled:
                continue
            remote = call("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            bus = _text(getattr(remote, "busId", None))
            peer = by_bus.get(_bus_key(bus)) if bus else None
            if peer is None or peer == gpu.index:
                continue
            if gpu.index < peer:
                counts[(gpu.index, peer)] = counts.get((gpu.index, peer), 0) + 1
    return tuple(NvLink(a, b, n) for (a, b), n in sorted(counts.items()))
