"""The router inside llmgw-cp, fed by the fleet: the real openai client, through the
router, to a real llama-server the reconciler placed from the catalog."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from helpers import llama_server_binary

from llmgw.testing.cluster import LocalCluster, wait_for


@pytest.mark.slow
def test_openai_client_through_the_router_to_a_placed_llama_server(
    cluster: LocalCluster, tiny_model: Path
) -> None:
    binary = llama_server_binary()
    cluster.models = [
        {
            "name": "tiny",
            "source": str(tiny_model),
            "served_names": ["tiny", "tiny-chat"],
            "replicas": 1,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "engine_args": ["--ctx-size", "512", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.setup(["cpu-1"])
    cluster.write_agent_config("cpu-1", engine_paths={"llama-server": binary})
    cluster.start_cp()
    cluster.start_agent("cpu-1")
    key = cluster.api_key("team-a")
    client = openai.OpenAI(base_url=cluster.router_url, api_key=key, max_retries=0, timeout=60)

    def listed() -> list[str] | None:
        ids = sorted(m.id for m in client.models.list().data)
        return ids or None

    assert wait_for("the model listed by the router", listed, 90) == ["tiny", "tiny-chat"]
    chat = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=cluster.router_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Keys: listed without their secrets; a revoked key is refused at once.
    import json

    keys = json.loads(cluster.ctl("keys", "list", "--json").stdout)["keys"]
    assert [(k["tenant"], k["revoked"]) for k in keys] == [("team-a", False)]
    assert key not in cluster.ctl("keys", "list").stdout
    cluster.ctl("keys", "revoke", keys[0]["key_id"])
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # The router's metrics are on the admin listener.
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(cluster.admin_url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(page)}

    def value(name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        family = families[name.removesuffix("_total").removesuffix("_count")]
        found = [
            s.value
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert found, f"no {name}{labels} on the page"
        return float(sum(found))

    requests = "llmgw_router_requests_total"
    assert families[requests.removesuffix("_total")].type == "counter"
    # One answered chat per served name, each counted under the name it was asked by.
    assert value(requests, model="tiny-chat", status="200", band="interactive") == 1
    assert value(requests, model="tiny", status="200", band="interactive") == 1
    assert value(requests, status="404") == 1  # the made-up name ...
    assert "nope" not in page  # ... never becomes a label
    assert value(requests, status="401") == 2  # the wrong key, the revoked one
    # Usage as the engine reported it: 8 and 6 generated tokens.
    assert value("llmgw_router_completion_tokens_total", model="tiny-chat") == 8
    assert value("llmgw_router_completion_tokens_total", model="tiny") == 6
    assert value("llmgw_router_request_duration_seconds_count", model="tiny-chat") == 1
    assert value("llmgw_router_time_to_first_token_seconds_count", model="tiny") == 1
    # Nothing is in flight or queued now.
    assert value("llmgw_router_queue_depth") == 0
