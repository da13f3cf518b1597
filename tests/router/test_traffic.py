"""A served name split between versions, through the router to fake vLLM engines (which,
as vLLM does, refuse a model name they do not serve): the split's share, pins by key and
by header, and the counts per version."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import trio

from llmgw.core import TrafficSplit, TrafficVersion
from llmgw.keys import ApiKey
from llmgw.router._keys import StaticKeys
from router.conftest import FakeEngine, sample, serve_router

KEYS = StaticKeys(
    [
        ("secret-any", ApiKey("key-any", "tenant-a", None, "interactive", "interactive", 0.0)),
        ("secret-pin", ApiKey("key-pin", "tenant-b", None, "interactive", "interactive", 0.0)),
        ("secret-qwen", ApiKey("key-qwen", "tenant-c", frozenset({"qwen"}), "interactive",
                                "interactive", 0.0)),
        ("secret-v1", ApiKey("key-v1", "tenant-d", frozenset({"qwen-v1"}), "interactive",
                              "interactive", 0.0)),
    ]
)  # fmt: skip


def split(v1: int = 90, v2: int = 10) -> TrafficSplit:
    return TrafficSplit(
        "qwen",
        (TrafficVersion("qwen-v1", "qwen-v1", v1), TrafficVersion("qwen-v2", "qwen-v2", v2)),
        (("key-pin", "qwen-v2"),),
    )


def auth(secret: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}", **headers}


def ask(model: str = "qwen") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def send_many(
    url: str, n: int, headers: dict[str, str], *, parallel: int = 16
) -> list[tuple[int, str | None, str | None]]:
    """n chat requests for `qwen`: (status, the body's model, the x-llmgw-version header)."""
    out: list[tuple[int, str | None, str | None]] = []
    per = -(-n // parallel)

    async def one_lane(h: httpx.AsyncClient, count: int) -> None:
        for _ in range(count):
            r = await h.post(url + "/v1/chat/completions", headers=headers, json=ask())
            model = r.json().get("model") if r.status_code == 200 else None
            out.append((r.status_code, model, r.headers.get("x-llmgw-version")))

    async with httpx.AsyncClient(timeout=30) as h, trio.open_nursery() as nursery:
        for lane in range(parallel):
            nursery.start_soon(one_lane, h, min(per, n - lane * per))
    return out


async def test_a_ninety_ten_split_over_a_thousand_requests_lands_near_ten_percent(
    start_engine: Callable[..., FakeEngine],
) -> None:
    v1, v2 = start_engine("qwen-v1"), start_engine("qwen-v2")
    async with serve_router([v1.endpoint(), v2.endpoint()], keys=KEYS) as r:
        r.source.replace([v1.endpoint(), v2.endpoint()], traffic=[split()])
        got = await send_many(r.url, 1000, auth("secret-any"))
        metrics = r.metrics_text()
        # Summed over the hours: a run that crosses an hour has two rows per version.
        usage: Counter[str] = Counter()
        for row in r.router.meter.pending():
            usage[row.model] += row.requests
    assert len(got) == 1000
    assert {status for status, _, _ in got} == {200}
    # The engine answered under its own name (the body was renamed for it), and the
    # header names the same version.
    assert all(model == header for _, model, header in got)
    answered = Counter(model for _, model, _ in got)
    assert set(answered) == {"qwen-v1", "qwen-v2"}
    assert 70 <= answered["qwen-v2"] <= 130, answered  # 10 % ± 3 % of 1,000
    assert (v1.stats()["completed"], v2.stats()["completed"]) == (
        answered["qwen-v1"],
        answered["qwen-v2"],
    )
    # Counted per version: the split's own counter, the request counters and the usage.
    for version in ("qwen-v1", "qwen-v2"):
        n = answered[version]
        assert sample(metrics, "llmgw_router_traffic_requests_total", split="qwen",
                      version=version, how="split") == n  # fmt: skip
        assert sample(metrics, "llmgw_router_requests_total", model=version, status="200",
                      band="interactive") == n  # fmt: skip
        assert usage[version] == n


async def test_a_pinned_key_always_gets_its_version_and_a_header_pins_any(
    start_engine: Callable[..., FakeEngine],
) -> None:
    v1, v2 = start_engine("qwen-v1"), start_engine("qwen-v2")
    async with serve_router([v1.endpoint(), v2.endpoint()], keys=KEYS) as r:
        r.source.replace([v1.endpoint(), v2.endpoint()], traffic=[split(99, 1)])
        pinned = await send_many(r.url, 200, auth("secret-pin"))
        by_header = await send_many(r.url, 50, auth("secret-pin", **{"X-LLMGW-Version": "qwen-v1"}))
        metrics = r.metrics_text()
        async with httpx.AsyncClient(timeout=30) as h:
            unknown = await h.post(
                r.url + "/v1/chat/completions",
                headers=auth("secret-any", **{"X-LLMGW-Version": "qwen-v3"}),
                json=ask(),
            )
    assert Counter(m for _, m, _ in pinned) == {"qwen-v2": 200}  # 1 % weight, every time
    assert Counter(m for _, m, _ in by_header) == {"qwen-v1": 50}  # the header wins
    assert sample(metrics, "llmgw_router_traffic_requests_total", split="qwen",
                  version="qwen-v2", how="key") == 200  # fmt: skip
    assert sample(metrics, "llmgw_router_traffic_requests_total", split="qwen",
                  version="qwen-v1", how="header") == 50  # fmt: skip
    assert unknown.status_code == 400
    assert unknown.json()["error"]["code"] == "unknown_version"
    assert unknown.json()["error"]["message"] == (
        "x-llmgw-version: 'qwen-v3' is not a version of 'qwen' (its versions: qwen-v1, qwen-v2)"
    )


async def test_weights_change_with_the_view_and_a_version_without_replicas_takes_no_share(
    start_engine: Callable[..., FakeEngine],
) -> None:
    v1, v2 = start_engine("qwen-v1"), start_engine("qwen-v2")
    async with serve_router([v1.endpoint(), v2.endpoint()], keys=KEYS) as r:
        r.source.replace([v1.endpoint(), v2.endpoint()], traffic=[split(0, 100)])
        all_v2 = await send_many(r.url, 40, auth("secret-any"))
        # `ctl route qwen` (POST /api/v1/route) explains the version a request would draw.
        explained = r.router.explain("qwen", "/v1/chat/completions", ask())
        # The canary's replicas gone: its share goes to v1, no request fails.
        r.source.replace([v1.endpoint()], ["qwen-v2"], traffic=[split(10, 90)])
        only_v1 = await send_many(r.url, 40, auth("secret-any"))
    assert Counter(m for _, m, _ in all_v2) == {"qwen-v2": 40}
    assert (explained["model"], explained["chosen"]) == ("qwen-v2", v2.endpoint().endpoint_id)
    assert Counter((s, m) for s, m, _ in only_v1) == {(200, "qwen-v1"): 40}


async def test_keys_may_use_the_split_by_its_name_and_models_lists_it(
    start_engine: Callable[..., FakeEngine],
) -> None:
    v1, v2 = start_engine("qwen-v1"), start_engine("qwen-v2")
    async with serve_router([v1.endpoint(), v2.endpoint()], keys=KEYS) as r:
        r.source.replace([v1.endpoint(), v2.endpoint()], traffic=[split()])
        async with httpx.AsyncClient(timeout=30) as h:
            listed = await h.get(r.url + "/v1/models", headers=auth("secret-qwen"))
            allowed = await h.post(
                r.url + "/v1/chat/completions",
                headers=auth("secret-qwen", **{"X-LLMGW-Version": "qwen-v2"}),
                json=ask(),
            )
            refused = await h.post(
                r.url + "/v1/chat/completions", headers=auth("secret-v1"), json=ask()
            )
            one = await h.get(r.url + "/v1/models/qwen", headers=auth("secret-any"))
            # Streamed: the body the router rewrites to ask for the usage chunk names the
            # version too (vLLM would answer 404 for `qwen`).
            streamed = await h.post(
                r.url + "/v1/chat/completions",
                headers=auth("secret-pin"),
                json={**ask(), "stream": True},
            )
    assert [m["id"] for m in listed.json()["data"]] == ["qwen"]  # the split, not its versions
    assert (allowed.status_code, allowed.json()["model"]) == (200, "qwen-v2")
    assert refused.status_code == 403  # a key for qwen-v1 alone may not ask for the split
    assert one.json()["id"] == "qwen"
    assert streamed.status_code == 200
    assert streamed.headers["x-llmgw-version"] == "qwen-v2"
    assert '"model":"qwen-v2"' in streamed.text.replace(" ", "")
    assert streamed.text.rstrip().endswith("data: [DONE]")
