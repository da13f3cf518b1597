"""What the agent knows of its node, and what it sends of it.

The hardware inventory (host, GPUs, topology, RDMA, filesystems) is taken
once per agent process, at start, within `discovery_timeout_s`; weights and
engines are probed beside it and then refreshed by the sampler, as usage is.
A probe that overruns is a warning, not a hang: the agent registers with what
is known (what is not stays unknown, never zero), and the rest follows when
it arrives (weights and engines in a heartbeat, the hardware at the next
registration). Every registration after the first, on each reconnect, sends
what is known plus a fresh usage sample: nothing is probed again.

Registration carries the whole inventory; each heartbeat carries what
changes: usage always (left out when more than a minute old, never repeated
stale), weights only when their fingerprint changed, engines and warnings only
when they changed.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw import config, model
from llmgw.agent import discovery
from llmgw.agent._gpu_faults import GpuFaultWatch

log = logging.getLogger("llmgw.agent.node")

STALE_AFTER_S = 60.0
WEIGHTS_EVERY = 6  # samples between weight scans (30 s at the default interval)
ENGINES_EVERY = 12
DISCOVERY_TIMEOUT_S = 60.0
HELLO_USAGE_TIMEOUT_S = 10.0  # a registration waits this long for its fresh usage sample


class Node:
    def __init__(
        self,
        cfg: config.AgentConfig | None,
        *,
        root: Path = Path("/"),
        runner: discovery.Runner | None = None,
        nvml: discovery.NvmlLoader | None = discovery.load_pynvml,
        installed_engines: Callable[[], model.Engines] = model.Engines,
        llmgw_pids: Callable[[], set[int]] = set,
        shard_pids: Callable[[], Mapping[str, set[int]]] = dict,
    ) -> None:
        self.cfg = cfg
        self._root = root
        self._runner = runner or discovery.SubprocessRunner()
        self._nvml = nvml
        # What the engine installer has installed and proven, and is working on
        # (llmgw.agent._engines.Installer), read at every heartbeat; none by default.
        self.installed_engines = installed_engines
        self.discovery_timeout_s = cfg.discovery_timeout_s if cfg else DISCOVERY_TIMEOUT_S
        # The supervisor's processes, whose usage each sample attributes.
        self.llmgw_pids = llmgw_pids
        self.shard_pids = shard_pids
        dirs = [*self._model_dirs(), *self._storage_dirs()]
        self._sampler = discovery.UsageSampler(root=root, runner=self._runner, dirs=dirs, nvml=nvml)
        # Xids and ECC counts per card (llmgw/agent/_gpu_faults.py); every sample carries them.
        self.gpu_faults = GpuFaultWatch(cfg.gpu_fault_log if cfg else None)
        # The sampler keeps rates between samples: one caller at a time, and a
        # worker thread abandoned past its deadline still holds it until done.
        self._sampling = threading.Lock()
        # Written by worker threads when their probe finishes (late ones too).
        self._hardware: model.Inventory | None = None
        self._weights: model.Weights | None = None
        self._engines: model.Engines | None = None
        self._discovery_started = False
        self._discovered = trio.Event()
        self._overran = False
        self.hardware_probes = 0
        self.software_probes = 0
        self.hellos = 0
        self._usage: model.Usage | None = None
        self._usage_at: float | None = None
        self._sent_weights: str | None = None
        self._sent_engines: model.Engines | None = None
        self._sent_warnings: tuple[str, ...] | None = None

    def __repr__(self) -> str:
        return (
            f"<Node hardware_probes={self.hardware_probes} hellos={self.hellos} "
            f"usage_at={self._usage_at} weights={self._sent_weights}>"
        )

    def statistics(self) -> dict[str, int]:
        """How often each probe ran: the hardware once per process, whatever the reconnects."""
        return {
            "hardware_probes": self.hardware_probes,
            "software_probes": self.software_probes,
            "usage_samples": self._sampler.samples,
            "hellos": self.hellos,
        }

    def _model_dirs(self) -> list[Path]:
        if self.cfg is None:
            return []
        return list(self.cfg.model_dirs)

    def _weights_dir(self) -> Path | None:
        return self.cfg.weights_dir if self.cfg is not None else None

    def _storage_dirs(self) -> list[Path]:
        """Where the agent itself writes (its state, the fetched weights); without a
        config, the root filesystem."""
        if self.cfg is None:
            return [Path("/")]
        return [self.cfg.state_dir, self.cfg.weights_dir]

    async def rescan_weights(self) -> None:
        """Scan the weights again now (a fetch finished, a reclaim deleted): the next
        heartbeat carries the change."""
        await trio.to_thread.run_sync(self._rescan, True, False)

    # blocking probes (run in a worker thread) ---------------------------------------

    def collect_inventory(self) -> model.Inventory:
        """Everything, probed now (`llmgw-agent inventory`, and an explicit ask)."""
        return self._inventory(with_software=True)

    def _inventory(self, *, with_software: bool) -> model.Inventory:
        cfg = self.cfg
        inventory = discovery.collect_inventory(
            root=self._root,
            runner=self._runner,
            model_dirs=cfg.model_dirs if cfg else (),
            weights_dir=cfg.weights_dir if cfg else None,
            fabrics={name: decl.adapters for name, decl in cfg.fabrics.items()} if cfg else None,
            fabric_interfaces=(
                {n: d.interface for n, d in cfg.fabrics.items() if d.interface} if cfg else None
            ),
            sglang_python=cfg.sglang_python if cfg else None,
            llmgw_pids=self.llmgw_pids(),
            nvml=self._nvml,
            engine_paths=cfg.engine_paths if cfg else None,
            storage_dirs=self._storage_dirs(),
            with_weights=with_software,
            with_engines=with_software,
        )
        labels = tuple(model.Label(k, v) for k, v in sorted((cfg.labels if cfg else {}).items()))
        engines = self._merged(inventory.engines) if with_software else None
        return attrs.evolve(inventory, engines=engines, labels=labels)

    @property
    def hardware(self) -> model.Inventory | None:
        """The hardware inventory once probed (host, GPUs); None before."""
        return self._hardware

    def _merged(self, configured: model.Engines | None) -> model.Engines | None:
        """The configured engines (agent.yaml: the operator's word wins) and the
        installed ones; None until the first probe finished ("not probed")."""
        if configured is None:
            return None
        installed = self.installed_engines()
        found = {e.name: e for e in installed.found}
        found.update({e.name: e for e in configured.found})
        pending = tuple(p for p in installed.pending if p.name not in found)
        return model.Engines(found=tuple(found[n] for n in sorted(found)), pending=pending)

    def collect_usage(self) -> model.Usage:
        with self._sampling:
            usage = self._sampler.sample(shards=self.shard_pids(), llmgw_pids=self.llmgw_pids())
            gpus = self._hardware.gpus if self._hardware is not None else None
            self.gpu_faults.poll(gpus)
            self.gpu_faults.check_memory(self._runner, gpus)
            return self.gpu_faults.annotate(usage)

    async def watch_nvml_faults(self) -> None:
        """NVML's Xid events, in a thread, for as long as the agent runs (where NVML loads
        and agent.yaml's gpu_fault_nvml_events allows); the kernel log is read per sample."""
        if self._nvml is None or (self.cfg is not None and not self.cfg.gpu_fault_nvml_events):
            return
        try:
            nvml = self._nvml()
        except Exception as e:  # no library: a node without an NVIDIA driver
            log.debug("GPU faults: NVML does not load (%s)", e)
            return
        stop = threading.Event()
        try:
            await trio.to_thread.run_sync(
                self.gpu_faults.watch_nvml, nvml, stop, abandon_on_cancel=True
            )
        finally:
            stop.set()

    def _probe_hardware(self) -> None:
        inventory = self._inventory(with_software=False)
        self.hardware_probes += 1
        self._hardware = inventory

    def _probe_software(self) -> None:
        self._rescan(weights=True, engines=True)
        self.software_probes += 1

    def _rescan(self, weights: bool, engines: bool) -> None:
        if weights:
            self._weights = discovery.scan_weights(
                self._model_dirs(), weights_dir=self._weights_dir()
            )
        if engines:
            self._engines = discovery.probe_engines(
                self._runner,
                sglang_python=self.cfg.sglang_python if self.cfg else None,
                engine_paths=self.cfg.engine_paths if self.cfg else None,
            )

    # discovery, once -----------------------------------------------------------------

    async def discover(self) -> None:
        """Take the inventory, once per process, within `discovery_timeout_s`.

        A second call waits for the first. Probes still running at the
        deadline go on in their worker threads and fill in what they find.
        """
        if self._discovery_started:
            await self._discovered.wait()
            return
        self._discovery_started = True
        try:
            with trio.move_on_after(self.discovery_timeout_s):
                async with trio.open_nursery() as nursery:
                    for probe in (self._probe_hardware, self._probe_software):
                        nursery.start_soon(_in_thread, probe)
            if self._hardware is None or self._engines is None:
                self._overran = True
                for line in self._overrun_warnings():
                    log.warning("%s", line)
        finally:
            self._discovered.set()

    def _overrun_warnings(self) -> list[str]:
        if not self._overran:
            return []
        t = f"{self.discovery_timeout_s:g} s"
        out = []
        if self._hardware is None:
            out.append(
                f"discovery: the hardware probe (GPUs, topology, RDMA, storage) did not finish "
                f"within {t} (discovery_timeout_s); registered without it, it is sent at the "
                "next registration once it finishes"
            )
        if self._engines is None:
            out.append(
                f"discovery: the engine and weights probes did not finish within {t} "
                "(discovery_timeout_s); they are sent when they finish"
            )
        return out

    def _warnings(self) -> tuple[str, ...]:
        found = self._hardware.warnings if self._hardware is not None else ()
        return (*found, *self._overrun_warnings(), *self.gpu_faults.warnings())

    # session hooks ---------------------------------------------------------------------

    async def hello_inventory(self) -> model.Inventory:
        """What a registration carries: the inventory as known, with fresh usage."""
        await self.discover()
        usage: model.Usage | None = None
        with trio.move_on_after(HELLO_USAGE_TIMEOUT_S):
            usage = await trio.to_thread.run_sync(self.collect_usage, abandon_on_cancel=True)
        if usage is not None:
            self._usage, self._usage_at = usage, trio.current_time()
        else:
            log.warning(
                "the usage sample for registering took over %g s; sending the last one",
                HELLO_USAGE_TIMEOUT_S,
            )
        hardware = self._hardware
        if hardware is None:
            hardware = model.Inventory(host=model.Host(hostname=socket.gethostname()))
        fresh = self._fresh_usage()
        inventory = attrs.evolve(
            hardware,
            usage=fresh if fresh is not None else hardware.usage,
            gpus=_with_usage(hardware.gpus, fresh),
            weights=self._weights,
            engines=self._merged(self._engines),
            warnings=self._warnings(),
        )
        self._sent_weights = inventory.weights.fingerprint if inventory.weights else None
        self._sent_engines = inventory.engines
        self._sent_warnings = inventory.warnings
        self.hellos += 1
        return inventory

    def _fresh_usage(self) -> model.Usage | None:
        if self._usage_at is None or trio.current_time() - self._usage_at > STALE_AFTER_S:
            return None
        return self._usage

    async def heartbeat(self, seq: int) -> model.Heartbeat:
        fresh = self._fresh_usage()
        usage = fresh if fresh is not None else model.Usage()
        weights = None
        if self._weights is not None and self._weights.fingerprint != self._sent_weights:
            weights = self._weights
            self._sent_weights = weights.fingerprint
        engines = None
        now = self._merged(self._engines)
        if now is not None and now != self._sent_engines:
            engines = self._sent_engines = now
        warnings = None
        current = self._warnings()
        if current != self._sent_warnings:
            warnings = self._sent_warnings = current
        return model.Heartbeat(
            seq=seq, usage=usage, weights=weights, engines=engines, warnings=warnings
        )

    async def sample_forever(self) -> None:
        interval = self.cfg.sample_interval_s if self.cfg else 5.0
        n = 0
        while True:
            try:
                self._usage = await trio.to_thread.run_sync(self.collect_usage)
                self._usage_at = trio.current_time()
                n += 1
                if n % WEIGHTS_EVERY == 0 or n % ENGINES_EVERY == 0:
                    await trio.to_thread.run_sync(
                        self._rescan, n % WEIGHTS_EVERY == 0, n % ENGINES_EVERY == 0
                    )
            except Exception:
                log.exception("sampling the node failed; its figures will go stale")
            await trio.sleep(interval)

    # output ----------------------------------------------------------------------------

    def inventory_json(self, inventory: model.Inventory) -> Any:
        return discovery.inventory_to_json(inventory)

    def format_inventory(self, inventory: model.Inventory) -> str:
        return discovery.format_inventory(inventory)


async def _in_thread(probe: Callable[[], None]) -> None:
    # Abandoned at the deadline: the probe finishes in its thread and stores
    # what it found; its commands have their own timeouts.
    try:
        await trio.to_thread.run_sync(probe, abandon_on_cancel=True)
    except Exception:
        log.exception("discovery probe %s failed", getattr(probe, "__name__", probe))


def _with_usage(
    gpus: tuple[model.Gpu, ...] | None, usage: model.Usage | None
) -> tuple[model.Gpu, ...] | None:
    """The cards as discovered, with the figures that change taken from a fresh sample."""
    if gpus is None or usage is None:
        return gpus
    by_index = {u.index: u for u in usage.gpus}
    out = []
    for g in gpus:
        u = by_index.get(g.index)
        if u is not None:
            g = attrs.evolve(
                g,
                memory_used_mib=u.memory_used_mib,
                utilization_pct=u.utilization_pct,
                foreign_memory_mib=u.foreign_memory_mib,
                ecc_uncorrected=u.ecc_uncorrected,
            )
        out.append(g)
    return tuple(out)
