"""What the agent knows of its node, and what it sends of it.

Registration carries the whole inventory; each heartbeat carries what
changes: usage always (left out when more than a minute old, never repeated
stale), weights only when their fingerprint changed, engines and warnings only
when they changed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw import config, model
from llmgw.agent import discovery

log = logging.getLogger("llmgw.agent.node")

STALE_AFTER_S = 60.0
WEIGHTS_EVERY = 6  # samples between weight scans (30 s at the default interval)
ENGINES_EVERY = 12


class Node:
    def __init__(
        self,
        cfg: config.AgentConfig | None,
        *,
        root: Path = Path("/"),
        runner: discovery.Runner | None = None,
    ) -> None:
        self.cfg = cfg
        self._root = root
        self._runner = runner or discovery.SubprocessRunner()
        self.llmgw_pids: Callable[[], set[int]] = set
        self.shard_pids: Callable[[], Mapping[str, set[int]]] = dict
        dirs = [*self._model_dirs(), *self._storage_dirs()]
        self._sampler = discovery.UsageSampler(root=root, runner=self._runner, dirs=dirs)
        self._usage: model.Usage | None = None
        self._usage_at: float | None = None
        self._weights: model.Weights | None = None
        self._engines: model.Engines | None = None
        self._warnings: tuple[str, ...] = ()
        self._sent_weights: str | None = None
        self._sent_engines: model.Engines | None = None
        self._sent_warnings: tuple[str, ...] | None = None

    def __repr__(self) -> str:
        return f"<Node usage_at={self._usage_at} weights={self._sent_weights}>"

    def _model_dirs(self) -> list[Path]:
        if self.cfg is None:
            return []
        return [*self.cfg.model_dirs, *([self.cfg.fetch_dir] if self.cfg.fetch_dir else [])]

    def _storage_dirs(self) -> list[Path]:
        """Where the agent itself writes; without a config, the root filesystem."""
        return [self.cfg.state_dir] if self.cfg is not None else [Path("/")]

    # blocking probes (run in a worker thread) ---------------------------------------

    def collect_inventory(self) -> model.Inventory:
        cfg = self.cfg
        inventory = discovery.collect_inventory(
            root=self._root,
            runner=self._runner,
            model_dirs=cfg.model_dirs if cfg else (),
            fetch_dir=cfg.fetch_dir if cfg else None,
            fabrics={name: decl.adapters for name, decl in cfg.fabrics.items()} if cfg else None,
            sglang_python=cfg.sglang_python if cfg else None,
            llmgw_pids=self.llmgw_pids(),
            storage_dirs=self._storage_dirs(),
        )
        labels = tuple(model.Label(k, v) for k, v in sorted((cfg.labels if cfg else {}).items()))
        return attrs.evolve(
            inventory, engines=self._with_configured(inventory.engines), labels=labels
        )

    def _with_configured(self, engines: model.Engines | None) -> model.Engines | None:
        """Engines named in agent.yaml's engine_paths count when they exist and are executable."""
        if self.cfg is None or not self.cfg.engine_paths:
            return engines
        found = {e.name: e for e in (engines.found if engines else ())}
        for name, path in self.cfg.engine_paths.items():
            if name in ("vllm", "llama-server") and os.access(path, os.X_OK):
                found[name] = model.Engine(name=name, path=path)
        return model.Engines(found=tuple(found[n] for n in sorted(found)))

    def collect_usage(self) -> model.Usage:
        return self._sampler.sample(shards=self.shard_pids(), llmgw_pids=self.llmgw_pids())

    def _rescan(self, weights: bool, engines: bool) -> None:
        if weights:
            self._weights = discovery.scan_weights(self._model_dirs())
        if engines:
            probed = discovery.probe_engines(
                self._runner, sglang_python=self.cfg.sglang_python if self.cfg else None
            )
            self._engines = self._with_configured(probed)

    # session hooks ---------------------------------------------------------------------

    async def hello_inventory(self) -> model.Inventory:
        inventory = await trio.to_thread.run_sync(self.collect_inventory)
        self._sent_weights = inventory.weights.fingerprint if inventory.weights else None
        self._sent_engines = inventory.engines
        self._sent_warnings = inventory.warnings
        self._weights, self._engines = inventory.weights, inventory.engines
        self._warnings = inventory.warnings
        return inventory

    async def heartbeat(self, seq: int) -> model.Heartbeat:
        fresh = self._usage_at is not None and trio.current_time() - self._usage_at <= STALE_AFTER_S
        usage = self._usage if self._usage is not None and fresh else model.Usage()
        weights = None
        if self._weights is not None and self._weights.fingerprint != self._sent_weights:
            weights = self._weights
            self._sent_weights = weights.fingerprint
        engines = None
        if self._engines is not None and self._engines != self._sent_engines:
            engines = self._sent_engines = self._engines
        warnings = None
        if self._warnings != self._sent_warnings:
            warnings = self._sent_warnings = self._warnings
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
