"""LoRA adapters through real processes: llmgw-cp with its router and weights mirror, an
agent, a real llama-server serving the tiny GGUF, and three adapter GGUFs the test writes
(llmgw.testing.tiny_lora) served by the mirror.

One replica of `tiny` holds at most 2 adapters (`max_adapters: 2`). llama-server loads
adapters only at launch, so each load is a relaunch of the replica with its new list
(llmgw/cp/_fleet/_adapters.py); every answer below is at temperature 0, so an adapter's
answer is the same every time and differs from the base's.

1. `/v1/models` lists each adapter with its base as `parent`.
2. 20 concurrent first requests for `sql` (held by none) cause one load, and all 20 get
   the same answer, the adapter's, through the openai SDK; the agent fetched it from the
   mirror; the base through the same replica still answers as before.
3. `support` fills the second slot; `sql` is used again; `poet` evicts `support` (the
   least recently used, nothing in flight), and `ctl adapters` says so.
4. A tenant that `poet` does not allow gets 403 in the API's shape.
5. `ctl usage` counts each adapter apart from the base.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import llama_server_binary

from llmgw.core import cache_name
from llmgw.testing.cluster import LocalCluster, wait_for
from llmgw.testing.tiny_lora import write_lora

TIMEOUT = 120
PROMPT = "tell me about the fleet"


def chat(client: openai.OpenAI, model: str, prompt: str = PROMPT) -> str:
    done = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0,
    )
    content = done.choices[0].message.content
    assert isinstance(content, str) and content
    return content


def adapters(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    rows = json.loads(cluster.ctl("adapters", "--json").stdout)
    return {r["name"]: r for r in rows}


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value in Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def usage_by_model(cluster: LocalCluster, tenant: str) -> dict[str, int]:
    data = json.loads(cluster.ctl("usage", "--tenant", tenant, "--since", "24h", "--json").stdout)
    out: dict[str, int] = {}
    for r in data["rows"]:
        out[r["model"]] = out.get(r["model"], 0) + r["requests"]
    return out


@pytest.mark.slow(seconds=60)
def test_adapters_load_on_demand_evict_lru_and_are_routed_by_name(
    cluster: LocalCluster, tiny_model: Path
) -> None:
    binary = llama_server_binary()
    cluster.mirror_dir = cluster.root / "mirror"
    for seed, name in enumerate(("sql", "support", "poet"), start=1):
        write_lora(cluster.mirror_dir / "adapters" / f"{name}.gguf", tiny_model, seed=seed)
    cluster.models = [
        {
            "name": "tiny",
            "source": str(tiny_model),
            "replicas": 1,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "max_adapters": 2,
                    "engine_args": ["--ctx-size", "1024", "--parallel", "4", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.server_extra = {
        "adapters": [
            {"name": "sql", "base": "tiny", "source": "mirror:/adapters/sql.gguf"},
            {"name": "support", "base": "tiny", "source": "mirror:/adapters/support.gguf"},
            {
                "name": "poet",
                "base": "tiny",
                "source": "mirror:/adapters/poet.gguf",
                "tenants": ["team-a"],
            },
        ]
    }
    cluster.setup(["a1"])
    cluster.write_agent_config("a1", engine_paths={"llama-server": binary})
    cluster.start_cp()
    cluster.start_agent("a1")
    wait_for(
        "tiny ready",
        lambda: any(s["state"] == "ready" for n in cluster.nodes().values() for s in n["shards"]),
        TIMEOUT,
    )
    key, other = cluster.api_key("team-a"), cluster.api_key("team-b")
    client = openai.OpenAI(base_url=cluster.router_url, api_key=key, timeout=TIMEOUT)

    # 1. Listed with their parent (team-b does not see poet); tiny once the router has
    # read its engine.
    def listing() -> dict[str, str | None] | None:
        got = {m.id: getattr(m, "parent", None) for m in client.models.list()}
        return got if "tiny" in got else None

    listed = wait_for("tiny listed", listing, TIMEOUT)
    assert listed == {"tiny": None, "sql": "tiny", "support": "tiny", "poet": "tiny"}
    theirs = httpx.get(
        cluster.router_url + "/models", headers={"Authorization": f"Bearer {other}"}
    ).json()
    assert sorted(m["id"] for m in theirs["data"]) == ["sql", "support", "tiny"]
    base = chat(client, "tiny")
    assert adapters(cluster)["sql"]["held_by"] == []

    # 2. 20 concurrent first requests for sql: one load, 20 equal answers.
    answers: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            answers.append(chat(client, "sql"))
        except BaseException as exc:
            errors.append(exc)

    burst = [threading.Thread(target=one) for _ in range(20)]
    for t in burst:
        t.start()
    for t in burst:
        t.join(TIMEOUT + 30)
    assert not errors, errors
    assert len(answers) == 20 and len(set(answers)) == 1, answers
    tuned = answers[0]
    assert tuned != base
    sql = adapters(cluster)["sql"]
    assert sql["loads"] == 1 and sql["failures"] == 0, sql
    assert sql["draw"] > 0, sql  # the burst's requests, averaged: what loads spread by
    assert [h["node"] for h in sql["held_by"]] == ["a1"]
    # Fetched once from the mirror, into the node's weights cache.
    fetched = re.compile(r"llmgw\.cp\.mirror: GET '/adapters/sql\.gguf' (200|206) ")
    log = (cluster.root / "cp.log").read_text(errors="replace").splitlines()
    assert len([line for line in log if fetched.search(line)]) == 1
    assert (cluster.root / "a1-weights" / cache_name("mirror:/adapters/sql.gguf")).exists()
    # The base through the replica that now holds sql: unaffected.
    assert chat(client, "tiny") == base
    assert chat(client, "sql") == tuned

    # 3. support fills the second slot; sql is used again; poet evicts support.
    support = chat(client, "support")
    assert support not in (base, tuned)
    assert chat(client, "sql") == tuned
    poet = chat(client, "poet")
    assert poet not in (base, tuned)
    rows = adapters(cluster)
    assert [h["node"] for h in rows["poet"]["held_by"]] == ["a1"]
    assert rows["support"]["held_by"] == [] and rows["support"]["evictions"] == 1, rows
    assert rows["sql"]["evictions"] == 0 and rows["sql"]["held_by"], rows
    assert chat(client, "sql") == tuned and chat(client, "tiny") == base
    table = cluster.ctl("adapters").stdout
    assert "support" in table and "EVICTIONS" in table and "DRAW" in table

    # 4. team-b may not use poet: 403 in the API's shape.
    r = httpx.post(
        cluster.router_url + "/chat/completions",
        headers={"Authorization": f"Bearer {other}"},
        json={"model": "poet", "messages": [{"role": "user", "content": "hi"}]},
        timeout=TIMEOUT,
    )
    assert r.status_code == 403, r.text
    assert r.json()["error"]["type"] == "permission_error", r.text
    assert "poet" in r.json()["error"]["message"]

    # 5. Usage per adapter, apart from the base.
    def counted() -> dict[str, int] | None:
        got = usage_by_model(cluster, "team-a")
        return got if got.get("sql", 0) >= 23 else None

    # Each sql request counted by whether it found sql loaded: the burst's waited.
    metrics = httpx.get(cluster.admin_url + "/metrics", timeout=10).text
    found = {
        loaded: sample(metrics, "llmgw_router_adapter_requests_total", model="sql", loaded=loaded)
        for loaded in ("yes", "no")
    }
    assert found["yes"] + found["no"] == 23 and found["no"] >= 1 and found["yes"] >= 3, found
    assert sample(metrics, "llmgw_adapter_evictions_total", adapter="support") == 1

    by_model = wait_for("usage of sql counted", counted, 60)
    assert by_model["sql"] == 23 and by_model["support"] == 1 and by_model["poet"] == 1
    assert by_model["tiny"] == 3, by_model
