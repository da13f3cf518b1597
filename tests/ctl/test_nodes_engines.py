"""`ctl nodes`: the ENGINES column, and what `--json` (the admin API's nodes) carries."""

from __future__ import annotations

import json

from helpers import register

from llmgw import core, model
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.ctl._tables import format_engines, format_nodes

AVX2 = "CPU without AVX2: llama-server's CPU builds need it"


def _engine_inventory(node: str) -> model.Inventory:
    return model.Inventory(model.Host(node), warnings=(AVX2,))


async def test_the_admin_json_carries_found_and_pending_and_the_table_reads_them() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 100.0, wall=lambda: 1000.0)
    _, _, session = await register(registry, "n1", inventory=_engine_inventory("n1"))
    await register(registry, "n2")  # never reported engines: unknown, not "none"
    engines = model.Engines(
        found=(
            model.Engine("llama-server", "/s/engines/llama-server/b6123/llama-server",
                         "b6123", "installed"),
            model.Engine("sglang", "/opt/sglang/bin/python", None, "configured"),
        ),
        pending=(
            model.EngineStatus("vllm", "installing",
                               "downloading vllm-0.9.2-cp311-linux_x86_64.whl (400 MB, 40 %)",
                               "0.9.2"),
        ),
    )  # fmt: skip
    await session.heartbeat(model.Heartbeat(seq=1, engines=engines))
    status, body = await AdminApp(registry, "key")._fleet.nodes()
    assert status == 200
    nodes = json.loads(body)["nodes"]
    got = nodes[0]["inventory"]["engines"]
    assert got == {
        "found": [
            {"name": "llama-server", "path": "/s/engines/llama-server/b6123/llama-server",
             "version": "b6123", "state": "installed"},
            {"name": "sglang", "path": "/opt/sglang/bin/python", "version": None,
             "state": "configured"},
        ],
        "pending": [
            {"name": "vllm", "state": "installing",
             "detail": "downloading vllm-0.9.2-cp311-linux_x86_64.whl (400 MB, 40 %)",
             "version": "0.9.2"},
        ],
    }  # fmt: skip
    assert nodes[1]["inventory"]["engines"] is None
    table = format_nodes(nodes, now=1000.0).splitlines()
    header = table[0]
    col = header.index("ENGINES")
    shards = header.index("SHARDS")
    assert table[1][col:shards].strip() == (
        "llama-server b6123, sglang (configured), vllm 0.9.2 installing (40 %)"
    )
    assert table[2][col:shards].strip() == "-"
    # The CPU-without-AVX2 warning stays where it was.
    assert table[1][header.index("WARN") :].strip() == AVX2


def test_the_engines_cell() -> None:
    assert format_engines(None) == "-"
    assert format_engines({"found": [], "pending": []}) == "none"
    assert format_engines({"found": [], "pending": [
        {"name": "sglang", "state": "failed", "detail": "no matching distribution for "
         "sglang==0.4.9 (50 %)", "version": "0.4.9"},
        {"name": "llama-server", "state": "waiting", "detail": "for another apt-get to finish",
         "version": "b6123"},
    ]}) == "llama-server b6123 waiting, sglang 0.4.9 failed"  # fmt: skip
    assert format_engines({"found": [
        {"name": "llama-server", "path": "/x", "version": None, "state": "installed"},
    ], "pending": [
        {"name": "vllm", "state": "installing", "detail": "creating the virtualenv",
         "version": None},
    ]}) == "llama-server, vllm installing"  # fmt: skip
