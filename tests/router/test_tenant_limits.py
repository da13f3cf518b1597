"""Tenant limits through a real router on loopback, to a fake engine: requests and tokens
per minute (429 with Retry-After), the band ceiling (403), and their metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from llmgw.keys import ApiKey, TenantLimits
from llmgw.router._keys import StaticKeys
from router.conftest import FakeEngine, sample, serve_router


def key(key_id: str, tenant: str, limits: TenantLimits | None, band: str = "interactive") -> ApiKey:
    return ApiKey(key_id, tenant, None, band, "interactive", 0.0, limits=limits)


KEYS = StaticKeys(
    [
        ("secret-acme", key("key-acme", "acme", TenantLimits(rpm=2))),
        ("secret-free", key("key-free", "free", None)),
        ("secret-tokens", key("key-tokens", "tokens", TenantLimits(tpm=10))),
        ("secret-low", key("key-low", "low", TenantLimits(max_band="batch"), band="batch")),
        ("secret-odd", key("key-odd", "odd", TenantLimits(max_band="platinum"))),
    ]
)


def auth(secret: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}", **headers}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": "hello"}], **extra}


async def test_tenant_limits_refuse_with_their_reasons_and_spare_other_tenants(
    start_engine: Callable[..., FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "8"})
    async with serve_router([fe.endpoint()], keys=KEYS) as r, httpx.AsyncClient(timeout=30) as h:
        url = r.base_url + "/chat/completions"

        # Requests per minute: 2 pass, the third is refused before the model's queue.
        for _ in range(2):
            assert (await h.post(url, headers=auth("secret-acme"), json=chat())).status_code == 200
        over = await h.post(url, headers=auth("secret-acme"), json=chat())
        assert over.status_code == 429
        retry = int(over.headers["retry-after"])
        assert retry in (29, 30)  # 1 request at 2 per minute: 30 s, less what refilled
        assert over.json() == {
            "error": {
                "message": f"tenant acme: over its 2 requests per minute; retry in {retry} s",
                "type": "rate_limit_error",
                "code": "rate_limit_exceeded",
                "param": None,
            }
        }
        # A tenant with no limits is not affected, nor one with its own.
        for _ in range(5):
            assert (await h.post(url, headers=auth("secret-free"), json=chat())).status_code == 200

        # Tokens per minute: the first answer (4 prompt + 8 completion) takes the bucket
        # of 10 below zero; the next request is refused until it has refilled.
        first = await h.post(url, headers=auth("secret-tokens"), json=chat())
        assert first.status_code == 200
        usage = first.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 12
        with trio.fail_after(10):  # the tokens are charged once the answer has ended
            while r.router.tenants.statistics().get("tokens", {}).get("tokens", 0) > 0:
                await trio.sleep(0.01)
        broke = await h.post(url, headers=auth("secret-tokens"), json=chat())
        assert broke.status_code == 429
        wait = int(broke.headers["retry-after"])
        assert wait == 12 or wait == 11  # 2 tokens at 10 per minute
        assert broke.json()["error"]["message"] == (
            f"tenant tokens: over its 10 tokens per minute; retry in {wait} s"
        )

        # The band ceiling: asking above the tenant's highest band is refused, not capped.
        high = await h.post(
            url, headers=auth("secret-low", **{"X-LLMGW-Priority": "interactive"}), json=chat()
        )
        assert high.status_code == 403
        assert high.json()["error"]["code"] == "band_not_allowed"
        assert high.json()["error"]["message"] == (
            "tenant low: the priority band 'interactive' is above its highest allowed band 'batch'"
        )
        low = await h.post(url, headers=auth("secret-low"), json=chat())  # its default: batch
        assert low.status_code == 200
        # A tenant whose highest band is not configured has no ceiling (and a log line).
        with caplog.at_level(logging.WARNING, "llmgw.router"):
            for _ in range(2):
                odd = await h.post(url, headers=auth("secret-odd"), json=chat())
                assert odd.status_code == 200
        assert [m.split(" [request")[0] for m in caplog.messages if "platinum" in m] == [
            "tenant odd: its highest band 'platinum' is not a configured band (the bands "
            "are interactive, batch); no band ceiling for it"
        ]

        # Anthropic's route answers in its own shape, with the same status and header.
        messages = await h.post(
            r.base_url + "/messages",
            headers=auth("secret-acme"),
            json={"model": "chat", "max_tokens": 4, "messages": chat()["messages"]},
        )
        assert messages.status_code == 429 and "retry-after" in messages.headers
        assert messages.json()["error"]["type"] == "rate_limit_error"

        with trio.fail_after(10):
            while sample(r.metrics_text(), "llmgw_tenant_requests_total", tenant="odd") != 2:
                await trio.sleep(0.01)
        text = r.metrics_text()
        assert sample(text, "llmgw_tenant_refused_total", tenant="acme", reason="rpm") == 2
        assert sample(text, "llmgw_tenant_refused_total", tenant="tokens", reason="tpm") == 1
        assert sample(text, "llmgw_tenant_refused_total", tenant="low", reason="band") == 1
        assert sample(text, "llmgw_tenant_refused_total", tenant="free", reason="rpm") is None
        # Refused requests count as refused, not as the tenant's requests or usage.
        assert sample(text, "llmgw_tenant_requests_total", tenant="acme") == 2
        assert sample(text, "llmgw_tenant_requests_total", tenant="free") == 5
        assert sample(text, "llmgw_tenant_tokens_total", tenant="tokens", kind="prompt") == 4
        assert sample(text, "llmgw_tenant_tokens_total", tenant="tokens", kind="completion") == 8
        # Nothing reached the model's admission: its refusals stay at none.
        assert sample(text, "llmgw_router_admission_refused_total") is None
        stats = await trio.to_thread.run_sync(fe.stats)
        assert stats["completed"] == 2 + 5 + 1 + 1 + 2


async def test_each_worker_admits_its_share_of_a_tenant_limit(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat")
    keys = StaticKeys([("secret-acme", key("key-acme", "acme", TenantLimits(rpm=5)))])
    async with (
        serve_router([fe.endpoint()], keys=keys, workers=2) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        url = r.base_url + "/chat/completions"
        codes = [
            (await h.post(url, headers=auth("secret-acme"), json=chat())).status_code
            for _ in range(4)
        ]
        assert codes == [200, 200, 200, 429]  # worker 0 of 2: 3 of 5 per minute
