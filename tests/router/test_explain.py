"""`x-llmgw-explain: 1`: the router says where a request would go and why, and sends nothing.

Through the real router (in this trio loop on the lean server, and as a router-only
process) with fake engines as real processes behind it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio
from helpers import start_router

from llmgw.testing.cluster import free_port, wait_for
from router.conftest import SECRET_A, FakeEngine, RunningRouter, sample, serve_router

ADMIN = "llmgw-test-admin-key"
EXPLAIN = {"Authorization": f"Bearer {ADMIN}", "x-llmgw-explain": "1"}
AUTH_A = {"Authorization": f"Bearer {SECRET_A}"}
# The fake engine counts a prompt's words as its tokens: ~2,400 bytes, ~400 tokens,
# nine whole 256-byte blocks of the router's prefix index.
SYSTEM = " ".join(f"rule{i} applies" for i in range(200))
# The fake's prefix cache (tokens): room for the long system prompt several times over.
CACHE_ENV = {"LLMGW_FAKE_PREFIX_CACHE_TOKENS": "8192", "LLMGW_FAKE_TOKENS": "4"}


def chat(question: str, system: str | None = None, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return {"model": "chat", "messages": [*messages, {"role": "user", "content": question}],
            **extra}  # fmt: skip


async def until(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    with trio.fail_after(timeout):
        while not (result := check()):
            await trio.sleep(0.02)
    return result


async def scraped(r: RunningRouter) -> None:
    """Every endpoint's load has been read once: its figures are known, not missing."""
    await until(
        lambda: all(
            e["scraped_at"] is not None for e in r.router.statistics()["endpoints"].values()
        )
    )


def by_endpoint(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["endpoint"]: c for c in answer["candidates"]}


async def test_explain_names_the_choice_and_every_candidates_figures_and_sends_nothing(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fa, fb = start_engine("chat"), start_engine("chat")
    ids = sorted([fa.endpoint().endpoint_id, fb.endpoint().endpoint_id])
    async with (
        serve_router([fa.endpoint(), fb.endpoint()], admin_key=ADMIN, scrape_interval_s=0.5) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        await scraped(r)
        resp = await h.post(r.base_url + "/chat/completions", headers=EXPLAIN,
                            json=chat("hello there", max_tokens=7))  # fmt: skip
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "application/json"
        answer = resp.json()
        assert answer["object"] == "llmgw.route_explanation"
        assert answer["model"] == "chat"
        assert answer["policy"] == "prefix"
        assert answer["chosen"] in ids
        assert answer["reason"].startswith(
            "lowest expected cost (uncached prefill plus queued work)"
        )
        # Two idle endpoints: the next request makes a total of 1, and
        # ceil(2 x 1 / 2) = 1 request each is the (wide, epsilon 1) hot-spot bound.
        assert answer["bound"] == {
            "epsilon": 1.0,
            "max_requests_per_endpoint": 1,
            "average_load": 0.0,
        }
        req = answer["request"]
        prompt = b"\x1euser\x1fhello there"  # the canonical rendering (_surface.prompt_bytes)
        assert req["prompt_bytes"] == len(prompt)
        assert req["prompt_blocks"] == 0  # shorter than one 256-byte block
        assert req["block_bytes"] == 256
        assert req["estimated_prompt_tokens"] == len(prompt) / 4  # no report yet: 4 bytes/token
        assert req["expected_output_tokens"] == 7.0  # max_tokens, under the default 64
        assert sorted(by_endpoint(answer)) == ids
        for c in answer["candidates"]:
            assert c["healthy"] is True and c["breaker_allows"] is True
            assert c["within_bound"] is True
            assert c["in_flight"] == 0 and c["load"] == 0
            assert c["cached_tokens"] == 0
            assert c["uncached_tokens"] == req["estimated_prompt_tokens"]
            assert c["pending_prefill_tokens"] == 0 and c["pending_decode_tokens"] == 0
            assert c["queued_work_tokens"] == 0
            assert c["external_requests"] == 0
            sc = c["scraped"]
            assert (sc["running"], sc["waiting"], sc["kv_usage"]) == (0, 0, 0)
            assert 0 <= sc["age_s"] < 1.5  # fresh: within 3 scrape intervals
            assert c["cost"] == req["estimated_prompt_tokens"]
        # Nothing went to an engine, and nothing was recorded as sent.
        assert [fa.stats()["received"], fb.stats()["received"]] == [0, 0]
        stats = r.router.statistics()["endpoints"]
        assert all(e["prefix_blocks"] == 0 and e["in_flight"] == 0 for e in stats.values())


async def test_explain_shows_the_load_the_router_has_in_flight(
    start_engine: Callable[..., FakeEngine],
) -> None:
    env = {"LLMGW_FAKE_TOKENS": "40", "LLMGW_FAKE_TOKEN_DELAY": "0.25"}
    fa, fb = start_engine("chat", env=env), start_engine("chat", env=env)
    async with (
        serve_router([fa.endpoint(), fb.endpoint()], admin_key=ADMIN, scrape_interval_s=0.5) as r,
        httpx.AsyncClient(timeout=60) as h,
    ):
        await scraped(r)
        first_chunk = trio.Event()

        async def stream_one() -> None:
            async with h.stream("POST", r.base_url + "/chat/completions", headers=AUTH_A,
                                json=chat("a long answer", stream=True, max_tokens=40)) as s:  # fmt: skip
                assert s.status_code == 200
                async for _ in s.aiter_bytes():
                    first_chunk.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_one)
            await first_chunk.wait()
            busy = fa if fa.stats()["in_flight"] else fb
            idle = fb if busy is fa else fa
            # The scraper reads the engine's running request: once it has, the reading
            # counts it as the router's own (external 0), not as someone else's.
            eid = busy.endpoint().endpoint_id
            await until(lambda: r.router.statistics()["endpoints"][eid]["running"] == 1)
            resp = await h.post(r.base_url + "/chat/completions", headers=EXPLAIN,
                                json=chat("a short question", max_tokens=5))  # fmt: skip
            nursery.cancel_scope.cancel()
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        cands = by_endpoint(answer)
        b, i = cands[busy.endpoint().endpoint_id], cands[idle.endpoint().endpoint_id]
        # The streaming request answers already: its prompt is done, its 40 output
        # tokens (its max_tokens) are still expected.
        assert (b["in_flight"], b["pending_prefill_tokens"], b["pending_decode_tokens"]) == (
            1, 0, 40.0)  # fmt: skip
        assert b["scraped"]["running"] == 1 and b["external_requests"] == 0
        assert b["load"] == 1
        assert (i["in_flight"], i["pending_decode_tokens"], i["load"]) == (0, 0, 0)
        assert i["scraped"]["running"] == 0
        # The decode work waiting there costs 4 prompt tokens' worth per output token.
        assert b["cost"] - i["cost"] == 40 * answer["request"]["decode_cost"]
        assert b["queued_work_tokens"] == 40 * answer["request"]["decode_cost"]
        assert i["queued_work_tokens"] == 0
        assert answer["chosen"] == idle.endpoint().endpoint_id
        # One in flight, one more to place over two endpoints: ceil(2 x 2 / 2) = 2.
        assert answer["bound"]["max_requests_per_endpoint"] == 2
        assert answer["bound"]["average_load"] == 0.5
        assert idle.stats()["received"] == 0


async def test_explain_is_for_the_admin_key_only(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("chat")
    async with httpx.AsyncClient(timeout=30) as h:
        async with serve_router([fe.endpoint()], admin_key=ADMIN) as r:
            asked = {**AUTH_A, "x-llmgw-explain": "1"}
            resp = await h.post(r.base_url + "/chat/completions", headers=asked, json=chat("hi"))
            assert resp.status_code == 403
            err = resp.json()["error"]
            assert err["code"] == "explain_not_allowed"
            assert err["type"] == "permission_error"
            assert "only the admin key may ask why an endpoint is chosen" in err["message"]
            assert err["message"].startswith("x-llmgw-explain: ")
            # No key at all is refused the same way, not let through.
            resp = await h.post(r.base_url + "/chat/completions",
                                headers={"x-llmgw-explain": "1"}, json=chat("hi"))  # fmt: skip
            assert resp.status_code == 403
            assert resp.json()["error"]["code"] == "explain_not_allowed"
            # An unknown model is named.
            resp = await h.post(r.base_url + "/chat/completions", headers=EXPLAIN,
                                json={**chat("hi"), "model": "nonesuch"})  # fmt: skip
            assert resp.status_code == 404
            assert "'nonesuch' does not exist" in resp.json()["error"]["message"]
            # The header set to 0 is no request to explain: the ordinary key is proxied.
            resp = await h.post(r.base_url + "/chat/completions",
                                headers={**AUTH_A, "x-llmgw-explain": "0"}, json=chat("hi"))  # fmt: skip
            assert resp.status_code == 200
            assert resp.json()["object"] == "chat.completion"
        assert fe.stats()["received"] == 1

        async with serve_router([fe.endpoint()]) as r:  # no admin key configured
            resp = await h.post(r.base_url + "/chat/completions", headers=EXPLAIN, json=chat("hi"))
            assert resp.status_code == 403
            err = resp.json()["error"]
            assert err["code"] == "explain_not_allowed"
            assert "this router has no admin key configured" in err["message"]
        assert fe.stats()["received"] == 1


async def test_after_a_long_system_prompt_explain_credits_the_endpoint_that_served_it(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fa, fb = start_engine("chat", env=CACHE_ENV), start_engine("chat", env=CACHE_ENV)
    engines = {fa.endpoint().endpoint_id: fa, fb.endpoint().endpoint_id: fb}
    async with (
        serve_router([fa.endpoint(), fb.endpoint()], admin_key=ADMIN, scrape_interval_s=0.5) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        await scraped(r)
        resp = await h.post(r.base_url + "/chat/completions", headers=AUTH_A,
                            json=chat("what is rule 7?", SYSTEM))  # fmt: skip
        assert resp.status_code == 200, resp.text
        served = next(eid for eid, fe in engines.items() if fe.stats()["received"] == 1)
        other = next(eid for eid in engines if eid != served)
        # The first request's prompt was all computed: the engine said so (cached 0).
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        sibling = chat("and rule 9?", SYSTEM)
        # Scrapes on, the figures must be fresh when asked (a stale one costs a penalty).
        await scraped(r)
        resp = await h.post(r.base_url + "/chat/completions", headers=EXPLAIN, json=sibling)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        cands = by_endpoint(answer)
        prompt_blocks = answer["request"]["prompt_blocks"]
        assert prompt_blocks == len(SYSTEM) // 256  # the user's part adds no whole block
        assert cands[served]["cached_tokens"] > 0
        assert cands[other]["cached_tokens"] == 0
        assert cands[served]["cost"] < cands[other]["cost"]
        assert answer["chosen"] == served
        # Explaining sent nothing.
        assert [fe.stats()["received"] for fe in engines.values()].count(0) == 1

        # The sibling sent for real goes there, and the engine confirms the guess.
        resp = await h.post(r.base_url + "/chat/completions", headers=AUTH_A, json=sibling)
        assert resp.status_code == 200
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 400  # the ~400-token system prompt, in whole 16-token blocks
        assert engines[served].stats()["received"] == 2
        assert engines[other].stats()["received"] == 0
        text = r.metrics_text()
        assert sample(text, "llmgw_router_prompt_cached_tokens_total", model="chat") == cached
        assert sample(text, "llmgw_router_prefix_guesses_total", model="chat",
                      endpoint=served, outcome="hit") == 1.0  # fmt: skip
        assert sample(text, "llmgw_router_prefix_guesses_total", model="chat",
                      endpoint=served, outcome="none") == 1.0  # fmt: skip


def _router_file(tmp_path: Path, port: int, engine_port: int, admin_key_file: Path) -> Path:
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f"endpoints:\n  - {{model: chat, engine: vllm, url: 'http://127.0.0.1:{engine_port}'}}\n"
        f"keys:\n  - {{key: {SECRET_A}, tenant: t0}}\n"
        f"admin_key_file: {admin_key_file}\n"
    )
    return cfg


def _run_router(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw.router", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_router_only_admin_key_file_missing_or_empty_fails_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-admin.key"
    done = _run_router(_router_file(tmp_path, free_port(), free_port(), missing))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"llmgw-router: admin_key_file: {missing}: No such file or directory"]

    empty = tmp_path / "empty-admin.key"
    empty.write_text("\n")
    done = _run_router(_router_file(tmp_path, free_port(), free_port(), empty))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"llmgw-router: admin_key_file: {empty} is empty"]


def test_router_only_admin_key_file_lets_that_key_explain(
    tmp_path: Path, start_engine: Callable[..., FakeEngine]
) -> None:
    fe = start_engine("chat")
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN + "\n")  # the trailing newline an editor leaves is no part
    port = free_port()
    cfg = _router_file(tmp_path, port, fe.port, key_file)
    log = tmp_path / "router.log"
    proc = start_router(cfg, log)
    try:
        wait_for("router", lambda: "router listening" in log.read_text(), timeout=20, interval=0.1)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        resp = httpx.post(url, headers=EXPLAIN, json=chat("hi"), timeout=20)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert answer["chosen"] == f"chat@127.0.0.1:{fe.port}"
        assert [c["endpoint"] for c in answer["candidates"]] == [answer["chosen"]]
        refused = httpx.post(url, headers={**AUTH_A, "x-llmgw-explain": "1"}, json=chat("hi"),
                             timeout=20)  # fmt: skip
        assert refused.status_code == 403
        assert json.loads(refused.text)["error"]["code"] == "explain_not_allowed"
        assert fe.stats()["received"] == 0
    finally:
        proc.terminate()
        rc = proc.wait(10)
    assert rc == 0, log.read_text()
