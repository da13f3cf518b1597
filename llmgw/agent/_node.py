"""What the agent knows of its node, and what it sends of it.

Registration carries the whole inventory; each heartbeat carries what
changes. A measurement more than a minute old is left out, not repeated.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
from typing import Any

import attrs
import psutil
import trio

from llmgw import config, model

log = logging.getLogger("llmgw.agent.node")

STALE_AFTER_S = 60.0


class Node:
    def __init__(self, cfg: config.AgentConfig | None) -> None:
        self.cfg = cfg
        self._usage: model.Usage | None = None
        self._usage_at: float | None = None
        self._sent_weights: str | None = None
        self._sent_engines: model.Engines | None = None
        self._sent_warnings: tuple[str, ...] | None = None
        self._latest: model.Inventory | None = None

    def __repr__(self) -> str:
        return f"<Node usage_at={self._usage_at}>"

    # blocking probes (run in a worker thread) ---------------------------------------

    def collect_inventory(self) -> model.Inventory:
        mem = psutil.virtual_memory()  # first: nothing below may stop memory from being known
        host = model.Host(
            hostname=socket.gethostname(),
            arch=platform.machine() or None,
            cpu_count=os.cpu_count(),
        )
        return model.Inventory(
            host=host,
            usage=model.Usage(memory_total_bytes=mem.total, memory_available_bytes=mem.available),
        )

    def collect_usage(self) -> model.Usage:
        mem = psutil.virtual_memory()
        load1, load5, load15 = os.getloadavg()
        return model.Usage(
            memory_total_bytes=mem.total,
            memory_available_bytes=mem.available,
            load1=load1,
            load5=load5,
            load15=load15,
        )

    # session hooks ---------------------------------------------------------------------

    async def hello_inventory(self) -> model.Inventory:
        inventory = await trio.to_thread.run_sync(self.collect_inventory)
        self._latest = inventory
        self._sent_weights = inventory.weights.fingerprint if inventory.weights else None
        self._sent_engines = inventory.engines
        self._sent_warnings = inventory.warnings
        return inventory

    async def heartbeat(self, seq: int) -> model.Heartbeat:
        usage = model.Usage()
        fresh = self._usage_at is not None and trio.current_time() - self._usage_at <= STALE_AFTER_S
        if self._usage is not None and fresh:
            usage = self._usage
        return model.Heartbeat(seq=seq, usage=usage)

    async def sample_forever(self) -> None:
        interval = self.cfg.sample_interval_s if self.cfg else 5.0
        while True:
            try:
                self._usage = await trio.to_thread.run_sync(self.collect_usage)
                self._usage_at = trio.current_time()
            except Exception:
                log.exception("sampling the node failed; its figures will go stale")
            await trio.sleep(interval)

    # output ----------------------------------------------------------------------------

    def inventory_json(self, inventory: model.Inventory) -> Any:
        return config.unstructure(inventory)

    def format_inventory(self, inventory: model.Inventory) -> str:
        return json.dumps(attrs.asdict(inventory), indent=2)
