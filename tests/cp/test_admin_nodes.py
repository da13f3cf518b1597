"""GET /api/v1/nodes (llmgw/cp/_admin/_fleet.py): the same JSON, without stalling the heartbeats."""

from __future__ import annotations

import json

import trio
from helpers import register

from llmgw import config, core
from llmgw.cp._admin import _NODES_PER_SLICE, AdminApp
from llmgw.cp._fleet._registry import NodeRegistry


async def test_the_node_list_is_rendered_in_slices_other_tasks_run_between() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 100.0, wall=lambda: 1000.0)
    slices = 6
    count = (slices - 1) * _NODES_PER_SLICE + 5
    for i in range(count):
        await register(registry, f"n{i:03d}")
    app = AdminApp(registry, "key")
    turns = 0

    async def heartbeats() -> None:
        # Stands for the heartbeat servants: each turn is a chance they got.
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeats)
        await trio.lowlevel.checkpoint()  # it has started
        before = turns
        status, body = await app._fleet.nodes()
        during = turns - before
        nursery.cancel_scope.cancel()
    assert status == 200
    # One slice per _NODES_PER_SLICE nodes, each followed by a checkpoint. trio may
    # run the two tasks of a batch in either order, so the first and last turns
    # can fall outside the window; rendered in one piece it would get at most 1.
    assert during >= slices - 2
    # Byte for byte what one json.dumps of the whole list writes.
    expected = json.dumps({"nodes": [config.unstructure(v) for v in registry.views()]}).encode()
    assert body == expected
    assert [n["node_id"] for n in json.loads(body)["nodes"]] == [f"n{i:03d}" for i in range(count)]
