"""An adapter's source is wanted by the catalog like a model's (llmgw/cp/_admin/_weights.py,
Catalog.weight_sources): `GET /api/v1/weights` names it as wanted by `NAME (adapter of
BASE)`, reclaim never collects it, and once the adapter leaves server.yaml it is
collected. Through the real AdminApp as ASGI, then a real llmgw-cp and llmgw-agent."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

from helpers import FakeAgent, register
from helpers import asgi_call as asgi

from llmgw import core, model
from llmgw.agent._fetch import _write_marker
from llmgw.core import cache_name
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._catalog import Catalog, CatalogAdapter, CatalogModel
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.ctl._weights import format_weights
from llmgw.testing.cluster import LocalCluster, wait_for

WD = "/var/lib/llmgw-weights"
BASE = "mirror:/llama-8b/"
SQL = "mirror:/loras/sql/"
GONE = "mirror:/loras/old.gguf"


class ReclaimingAgent(FakeAgent):
    """Removes whatever it is asked to (the real agent's own checks are tested with it)."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.asked: list[tuple[str, ...]] = []

    async def reclaim(self, epoch: int, paths: tuple[str, ...], dry_run: bool) -> model.Reclaimed:
        self.asked.append(paths)
        return model.Reclaimed(paths, 10 * len(paths), ())


def _inventory(files: list[tuple[str, int]]) -> model.Inventory:
    return model.Inventory(
        model.Host("h"),
        weights=model.Weights("fp", tuple(model.WeightFile(p, s) for p, s in files), dir=WD),
    )


async def test_an_adapters_source_is_wanted_and_never_collected() -> None:
    registry = NodeRegistry(core.LivenessPolicy(), clock=lambda: 1.0, wall=lambda: 2.0)
    base, sql, gone = (f"{WD}/{core.cache_name(s)}" for s in (BASE, SQL, GONE))
    files = [(f"{base}/m.safetensors", 1000), (f"{sql}/adapter_model.safetensors", 30),
             (f"{gone}/old.gguf", 10)]  # fmt: skip
    agent = ReclaimingAgent("a")
    await register(registry, "a", inventory=_inventory(files), agent=agent)
    catalog = Catalog(
        models=(CatalogModel(name="llama-8b", source=BASE, profiles=[]),),
        adapters=(CatalogAdapter(name="sql-lora", base="llama-8b", source=SQL),),
    )
    app = AdminApp(registry, "key", catalog=types.SimpleNamespace(catalog=catalog))  # type: ignore[arg-type]
    status, data = await asgi(app, "GET", "/api/v1/weights")
    assert status == 200
    (node,) = data["nodes"]
    assert [(h["path"], h["wanted_by"]) for h in node["held"]] == sorted([
        (base, ["llama-8b"]), (sql, ["sql-lora (adapter of llama-8b)"]), (gone, []),
    ])  # fmt: skip
    assert node["reclaimable"] == [{"path": gone, "size_bytes": 10}]
    text = format_weights(data["nodes"])
    line = next(x for x in text.splitlines() if core.cache_name(SQL) in x)
    assert line.split()[1:] == ["fetched", "(1", "file)", "30", "B", "sql-lora", "(adapter",
                                "of", "llama-8b)"]  # fmt: skip

    status, data = await asgi(app, "POST", "/api/v1/weights/collect", {})
    assert status == 200 and agent.asked == [(gone,)]
    # Named by hand it is refused by the control plane, the agent not asked.
    body = {"node": "a", "paths": [sql, gone]}
    status, data = await asgi(app, "POST", "/api/v1/weights/collect", body)
    assert status == 200 and agent.asked[-1] == (gone,)
    assert data["nodes"][0]["refused"] == [{
        "path": sql, "reason": "still wanted by the catalog",
        "detail": f"{sql}: still wanted by the catalog (sql-lora (adapter of llama-8b)); "
                  "remove the adapter from the catalog first",
    }]  # fmt: skip


# --- a real control plane and agent ---------------------------------------------------


def _entry(weights: Path, source: str, name: str, data: bytes) -> Path:
    """A complete cache entry, as the agent's fetcher leaves one."""
    entry = weights / cache_name(source)
    entry.mkdir(parents=True)
    (entry / name).write_bytes(data)
    _write_marker(entry, [(name, len(data))])
    return entry


def _view(cluster: LocalCluster) -> dict[str, Any]:
    return dict(json.loads(cluster.ctl("weights", "--json").stdout)["nodes"][0])


def test_ctl_weights_keeps_an_adapter_until_it_leaves_the_catalog(cluster: LocalCluster) -> None:
    # The base wants a GPU no node has here: nothing starts; the adapter's entry is kept
    # only because server.yaml names it.
    cluster.models = [{"name": "llama-8b", "source": BASE, "replicas": 1, "profiles": [
        {"engine": "vllm", "gpu_class": "h100-80g", "max_adapters": 2}]}]  # fmt: skip
    cluster.server_extra["adapters"] = [{"name": "sql-lora", "base": "llama-8b", "source": SQL}]
    cluster.setup(["n1"])
    weights = Path(os.path.realpath(cluster.root / "n1-weights"))
    sql = _entry(weights, SQL, "sql.gguf", b"GGUF" + b"\0" * 46)
    gone = _entry(weights, GONE, "old.gguf", b"GGUF" + b"\1" * 96)
    cluster.start_cp()
    cluster.start_agent("n1")
    view = wait_for("n1's weights", lambda: (v := _view(cluster))["reported"] and v, 30)
    held = {h["path"]: h["wanted_by"] for h in view["held"]}
    assert held == {str(sql): ["sql-lora (adapter of llama-8b)"], str(gone): []}
    assert view["reclaimable"] == [{"path": str(gone), "size_bytes": 100}]
    assert "sql-lora (adapter of llama-8b)" in cluster.ctl("weights").stdout

    done = cluster.ctl("weights", "--collect")
    # (what is freed counts the entry's completion marker too)
    assert done.stdout.startswith("asked to remove 1 file (100 B); removed 1 ("), done.stdout
    assert not gone.exists() and (sql / "sql.gguf").is_file()
    refused = cluster.ctl("weights", "--collect", "--node", "n1", "--path", str(sql), check=False)
    assert refused.returncode == 1
    assert refused.stdout.splitlines() == [
        "asked to remove 1 file (50 B); removed 0 (0 B); n1 refused 1: still wanted by the catalog",
        f"  n1: {sql}: still wanted by the catalog (sql-lora (adapter of llama-8b)); remove the "
        "adapter from the catalog first",
    ]
    assert (sql / "sql.gguf").is_file()

    # The adapter leaves server.yaml (reloaded as it changes): its entry is collectable.
    cluster.server_extra["adapters"] = []
    cluster.write_server_config()
    wait_for("the adapter's entry unwanted",
             lambda: _view(cluster)["reclaimable"] == [{"path": str(sql), "size_bytes": 50}], 30)  # fmt: skip
    cluster.ctl("weights", "--collect")
    assert not sql.exists()
