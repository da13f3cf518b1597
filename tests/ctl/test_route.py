"""`llmgw ctl route` and `POST /api/v1/route` through a real llmgw-cp with its router.

A control plane, two agents, one replica of the tiny model on each (the fake
llama-server with a prefix cache). After one real request, the router's decision for
a sibling prompt credits the replica that served it; nothing is sent by asking.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from helpers import ready_shards, start_tiny_fleet, tiny_catalog

from llmgw.testing.cluster import LocalCluster, wait_for

# Words are the fake engine's tokens: ~2,600 bytes, ~450 tokens, ten 256-byte blocks.
LONG = " ".join(f"clause{i} holds" for i in range(200))
ENV = {"LLMGW_FAKE_PREFIX_CACHE_TOKENS": "8192", "LLMGW_FAKE_TOKENS": "4"}


def route_json(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    return dict(json.loads(cluster.ctl("route", *args, "--json").stdout))


def fake_stats(port: int) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{port}/fake/stats", timeout=5).json())


def test_ctl_route_explains_a_decision_and_sends_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    start_tiny_fleet(cluster, tmp_path, ["n1", "n2"], engine_env=ENV)
    cluster.write_server_config(tiny_catalog(2))  # one replica on each node
    shards = wait_for("two replicas ready", lambda: (s := ready_shards(cluster)) and
                      len(s) == 2 and s, 60)  # fmt: skip
    ports = {node: s["port"] for node, s in shards}
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(LONG + " first question?\n")  # plain text: one user message
    # The router learns of both replicas a moment after the control plane holds them.
    answer = wait_for(
        "both replicas among the router's candidates",
        lambda: (a := route_json(cluster, "tiny", "--prompt-file", str(prompt)))
        and len(a["candidates"]) == 2 and a,
        30,
    )  # fmt: skip
    endpoints = sorted(c["endpoint"] for c in answer["candidates"])
    assert sorted(e.rsplit("@", 1)[1] for e in endpoints) == ["n1", "n2"]
    assert answer["object"] == "llmgw.route_explanation"
    assert answer["model"] == "tiny" and answer["policy"] == "prefix"
    assert answer["chosen"] in endpoints
    assert answer["request"]["prompt_blocks"] == len(b"\x1euser\x1f" + LONG.encode()) // 256
    for c in answer["candidates"]:
        assert c["cached_tokens"] == 0 and c["in_flight"] == 0
        assert set(c["scraped"]) == {"running", "waiting", "kv_usage", "age_s"}
    assert set(answer["bound"]) == {"epsilon", "max_requests_per_endpoint", "average_load"}
    assert [fake_stats(p)["received"] for p in ports.values()] == [0, 0]

    # One real request with the same opening; a sibling's decision credits where it went.
    key = cluster.api_key()
    r = httpx.post(
        cluster.router_url + "/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": LONG + " other?"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    served_node = next(n for n, p in ports.items() if fake_stats(p)["received"] == 1)
    served = next(e for e in endpoints if e.endswith("@" + served_node))
    other = next(e for e in endpoints if e != served)

    asked = time.monotonic()
    answer = route_json(cluster, "tiny", "--prompt-file", str(prompt))
    cands = {c["endpoint"]: c for c in answer["candidates"]}
    assert cands[served]["cached_tokens"] > 0
    assert cands[other]["cached_tokens"] == 0
    assert answer["chosen"] == served

    table = cluster.ctl("route", "tiny", "--prompt-file", str(prompt)).stdout
    apart = time.monotonic() - asked
    lines = table.splitlines()
    assert lines[0].startswith(f"tiny: {served} (prefix): lowest expected cost")
    assert lines[1].startswith(f"  prompt: {answer['request']['prompt_bytes']} bytes, ")
    assert lines[2].startswith("  bound: at most ")
    assert lines[3].split() == ["ENDPOINT", "STATE", "COST", "CACHED", "IN-FLIGHT", "PREFILL",
                                "DECODE", "EXTERNAL", "SCRAPED"]  # fmt: skip
    star = next(line for line in lines[4:] if line.startswith("* "))
    assert star.split()[1] == served
    assert star.split()[2] == "ok"
    # Two asks `apart` seconds apart (more on a loaded machine): the credit has decayed by
    # at most what a half-life of 300 s takes in that time, and the table rounds it.
    credit = cands[served]["cached_tokens"]
    decayed = credit * (1 - 0.5 ** (apart / 300))
    assert credit - decayed - 1 <= float(star.split()[4]) <= credit + 1, (credit, apart)
    plain = next(line for line in lines[4:] if line.split()[0] == other)
    assert plain.split()[1] == "ok" and plain.split()[3] == "0"  # nothing cached there
    assert len(lines) == 6  # both candidates, the chosen one starred

    # A whole request body as a client sends it works too, with its path.
    body = tmp_path / "completion.json"
    body.write_text(json.dumps({"prompt": LONG + " x", "max_tokens": 3}))
    completion = route_json(cluster, "tiny", "--prompt-file", str(body))
    # Taken as /v1/completions: the prompt itself is the rendering.
    assert completion["request"]["prompt_bytes"] == len((LONG + " x").encode())
    assert completion["request"]["expected_output_tokens"] == 3.0

    # Asking sent nothing: still the one real request.
    assert sorted(fake_stats(p)["received"] for p in ports.values()) == [0, 1]

    # The admin API itself, as ctl calls it.
    admin = {"Authorization": f"Bearer {cluster.admin_key}"}
    direct = httpx.post(cluster.admin_url + "/api/v1/route", headers=admin, timeout=10,
                        json={"model": "tiny", "request": {"messages": [
                            {"role": "user", "content": LONG + " first question?\n"}]}})  # fmt: skip
    assert direct.status_code == 200, direct.text
    assert direct.json()["chosen"] == served
    bad = httpx.post(cluster.admin_url + "/api/v1/route", headers=admin, timeout=10,
                     json={"model": "tiny"})  # fmt: skip
    assert bad.status_code == 400

    # An unknown model: a clear error, naming it.
    unknown = cluster.ctl("route", "nonesuch", "--prompt-file", str(prompt), check=False)
    assert unknown.returncode == 1
    assert "'nonesuch' does not exist" in unknown.stderr
    assert unknown.stdout == ""
    missing = cluster.ctl("route", "tiny", "--prompt-file", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 1
    assert f"--prompt-file {tmp_path / 'nope'}: No such file or directory" in missing.stderr
