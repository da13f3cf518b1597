"""LoRA adapters in the router (llmgw/router/_adapters.py), through the real router on
loopback in front of fake engines: an adapter's name routed to the replicas that hold it,
the body in each engine's form (llama-server's `lora` list, base requests included),
`/v1/models` with `parent`, a tenant the adapter does not allow refused with 403, a
request for an adapter none holds held until one does, and the prefix index kept per
adapter. The wire forms (`encode_adapters`/`decode_adapters`) refuse hostile input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw.core import chain
from llmgw.router import AdapterRoute, Endpoint, Hold, decode_adapters, encode_adapters
from router.conftest import SECRET_A, SECRET_B, FakeEngine, serve_router

AUTH_A = {"Authorization": f"Bearer {SECRET_A}"}
AUTH_B = {"Authorization": f"Bearer {SECRET_B}"}
ADMIN = "llmgw-test-admin-key"


def body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def held(fe: FakeEngine, endpoint_id: str, model: str, adapters: tuple[str, ...]) -> Endpoint:
    """An endpoint of `fe` listed under `model`, holding `adapters`."""
    return Endpoint(endpoint_id, model, fe.engine, "127.0.0.1", fe.port, None, adapters)


def test_the_wire_form_round_trips_and_refuses_what_is_not_a_route() -> None:
    routes = {
        "sql": AdapterRoute("llama", 0.5, ("acme",), ("r1",)),
        "bot": AdapterRoute("llama"),
    }
    assert decode_adapters(encode_adapters(routes)) == routes
    assert decode_adapters(None) == {}
    for bad, words in [
        ([], "expected"),
        ({"sql": {"base": "llama"}}, "expected an object with"),
        ({"sql": {"base": 1, "scale": 1, "tenants": None, "loading": []}}, "base must be"),
        ({"sql": {"base": "l", "scale": "x", "tenants": None, "loading": []}}, "scale"),
        ({"sql": {"base": "l", "scale": float("nan"), "tenants": None, "loading": []}}, "finite"),
        ({"sql": {"base": "l", "scale": 1, "tenants": [1], "loading": []}}, "tenants"),
        ({"sql": {"base": "l", "scale": 1, "tenants": None, "loading": "r1"}}, "loading"),
    ]:
        with pytest.raises(ValueError, match=words):
            decode_adapters(bad)


def test_a_prompt_under_an_adapter_shares_no_block_with_the_base_or_another() -> None:
    text = b"the same long prompt " * 40
    base, sql, bot = chain(text, 64), chain(text, 64, "sql"), chain(text, 64, "bot")
    assert len(base) == len(sql) == len(bot) > 3
    assert not set(base) & set(sql) and not set(sql) & set(bot)
    assert chain(text, 64, "sql") == sql  # the same in every process


async def test_an_adapter_goes_to_its_holder_in_the_engines_form(
    start_engine: Callable[..., FakeEngine], tmp_path: Path
) -> None:
    """Two llama-server replicas of `tiny`: r1 holds sql and bot (launched with both, id
    order), r2 none. A request for sql reaches r1 with sql at its scale and bot at 0 (the
    fake's answer names the adapters it applied); the base through r1 gets every adapter
    at 0, through r2 the client's body."""
    sql, bot = tmp_path / "sql.gguf", tmp_path / "bot.gguf"
    for f in (sql, bot):
        f.write_bytes(b"GGUF")
    flags = ["--lora-scaled", f"{sql}:0", "--lora-scaled", f"{bot}:0", "--cache-ram", "0"]
    r1 = start_engine("tiny", engine="llama-server", extra=flags)
    r2 = start_engine("tiny", engine="llama-server")
    async with serve_router([]) as r, httpx.AsyncClient(timeout=30) as h:
        on_r1 = ("sql", "bot")
        r.source.replace(
            [
                held(r1, "r1", "tiny", on_r1),
                held(r1, "r1", "sql", on_r1),
                held(r1, "r1", "bot", on_r1),
                held(r2, "r2", "tiny", ()),
            ],
            ["tiny", "sql", "bot"],
            adapters={
                "sql": AdapterRoute("tiny", 0.5),
                "bot": AdapterRoute("tiny", 1.0, ("tenant-a",)),
            },
        )
        r.router.refresh()

        async def text(model: str, auth: dict[str, str] = AUTH_A) -> str:
            resp = await h.post(r.base_url + "/chat/completions", headers=auth, json=body(model))
            assert resp.status_code == 200, resp.text
            return str(resp.json()["choices"][0]["message"]["content"])

        for _ in range(4):
            assert (await text("sql")).startswith(f"[{sql}*0.5] ")
        assert (await text("bot")).startswith(f"[{bot}] ")
        before = r2.stats()["received"]
        assert before == 0, "no adapter request went to the replica without it"
        # The base: through r1 with every adapter at 0 (no bracket), and through r2.
        for _ in range(6):
            assert not (await text("tiny")).startswith("[")
        assert r2.stats()["received"] > 0 and r1.stats()["received"] > 5

        # Listed with parent; bot only to tenant-a; tenant-b gets 403 for bot.
        listed = (await h.get(r.base_url + "/models", headers=AUTH_A)).json()["data"]
        assert {m["id"]: m.get("parent") for m in listed} == {
            "tiny": None,
            "sql": "tiny",
            "bot": "tiny",
        }
        one = (await h.get(r.base_url + "/models/sql", headers=AUTH_A)).json()
        assert one["parent"] == "tiny"
        theirs = (await h.get(r.base_url + "/models", headers=AUTH_B)).json()["data"]
        assert "bot" not in {m["id"] for m in theirs}
        refused = await h.post(r.base_url + "/chat/completions", headers=AUTH_B, json=body("bot"))
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and "bot" in error["message"]


async def test_a_request_for_an_adapter_none_holds_waits_for_a_holder(
    start_engine: Callable[..., FakeEngine], tmp_path: Path
) -> None:
    """Held while none holds it (its demand is what the router reports as queued, and
    explain says a request would trigger a load), answered once the view lists a holder."""
    runtime = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    fe = start_engine("tiny", engine="vllm", env=runtime, extra=["--enable-lora"])
    (tmp_path / "sql").mkdir()
    async with (
        serve_router([], admin_key=ADMIN) as r,
        httpx.AsyncClient(timeout=30) as h,
    ):
        routes = {"sql": AdapterRoute("tiny")}
        r.source.replace(
            [held(fe, "r1", "tiny", ())],
            ["tiny", "sql"],
            holds={"sql": Hold(10, 30.0)},
            adapters=routes,
        )
        r.router.refresh()
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(
                await h.post(r.base_url + "/chat/completions", headers=AUTH_A, json=body("sql"))
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            with trio.fail_after(10):
                while r.router.loads().get("sql") is None or not r.router.loads()["sql"].queued:
                    await trio.sleep(0.01)
            # The control plane's demand: one request waiting for sql.
            assert r.router.loads()["sql"].queued == 1
            explained = await h.post(
                r.base_url + "/chat/completions",
                headers={"Authorization": f"Bearer {ADMIN}", "x-llmgw-explain": "1"},
                json=body("sql"),
            )
            adapter = explained.json()["adapter"]
            assert adapter["held_by"] == [] and adapter["triggers_load"] is True, adapter
            # Loaded on r1 (vLLM: registered under its name): the view says r1 holds it.
            await trio.to_thread.run_sync(
                lambda: httpx.post(
                    f"http://127.0.0.1:{fe.port}/v1/load_lora_adapter",
                    json={"lora_name": "sql", "lora_path": str(tmp_path / "sql")},
                    timeout=10,
                ).raise_for_status()
            )
            r.source.replace(
                [held(fe, "r1", "tiny", ("sql",)), held(fe, "r1", "sql", ("sql",))],
                ["tiny", "sql"],
                holds={"sql": Hold(10, 30.0)},
                adapters=routes,
            )
            r.router.refresh()
        (resp,) = answers
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "sql"


async def test_an_adapter_not_loaded_within_its_hold_gets_a_503_naming_it(
    start_engine: Callable[..., FakeEngine],
) -> None:
    fe = start_engine("tiny", engine="vllm")
    async with serve_router([]) as r, httpx.AsyncClient(timeout=30) as h:
        r.source.replace(
            [held(fe, "r1", "tiny", ())],
            ["tiny", "sql"],
            holds={"sql": Hold(10, 0.3)},
            adapters={"sql": AdapterRoute("tiny")},
        )
        r.router.refresh()
        resp = await h.post(r.base_url + "/chat/completions", headers=AUTH_A, json=body("sql"))
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        error = resp.json()["error"]
        assert error["type"] == "service_unavailable"
        assert error["message"].startswith(
            "the adapter 'sql' is not loaded yet: a replica of 'tiny' is to load it and it "
            "was waited for 0.3 s (ctl adapters says why)"
        ), error
        metrics = r.router.metrics_registry
        from prometheus_client import generate_latest

        text = generate_latest(metrics).decode()
        assert 'llmgw_router_adapter_requests_total{loaded="no",model="sql"} 1.0' in text
