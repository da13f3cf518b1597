"""The agent's one-token generation probe (llmgw/agent/_health.py), with the real fake
engine as a process: `/health` 200 is not enough for a shard that generates."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import trio
from agent.test_supervisor import wait_state

from llmgw import model
from llmgw.agent._supervisor import HealthPolicy, Supervisor
from llmgw.testing.cluster import free_port

PROBING = HealthPolicy(
    interval_s=0.2, poll_s=0.1, timeout_s=0.5, failures=3, probe_interval_s=1.0,
    probe_timeout_s=0.5,
)  # fmt: skip
REASON = "a one-token generation (POST /v1/completions) did not answer within 0.5 s"


def engine(shard_id: str, port: int, kind: str, *flags: str, **env: str) -> model.ShardSpec:
    if kind == "vllm":
        args = ("serve", "m", "--served-model-name", "chat")
    else:
        args = ("-m", "m", "-a", "chat")
    argv = (sys.executable, "-m", "llmgw.testing.fake_engine", *args, "--port", str(port))
    variables = (
        model.EnvVar("LLMGW_FAKE_ENGINE", kind),
        *(model.EnvVar(k, v) for k, v in env.items()),
    )
    return model.ShardSpec(
        shard_id=shard_id,
        model="m",
        engine=kind,
        served_names=("chat",),
        processes=(model.ProcessSpec(name="engine", argv=(*argv, *flags), env=variables),),
        port=port,
    )


def stats(port: int) -> dict[str, int]:
    return dict(httpx.get(f"http://127.0.0.1:{port}/fake/stats", timeout=5).json())


async def tokens(client: httpx.AsyncClient, port: int, hang: bool) -> None:
    answer = await client.post(f"http://127.0.0.1:{port}/fake/tokens", json={"hang": hang})
    assert answer.json() == {"hang": hang}


async def test_a_wedged_engine_with_health_200_becomes_unhealthy_and_recovers(
    tmp_path: Path,
) -> None:
    port = free_port()
    seen: list[model.ShardReport] = []
    sup = Supervisor(tmp_path, on_change=seen.append, grace_s=2, health=PROBING)
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(sup.run)
        await sup.start(engine("g1", port, "vllm"))
        ready = await wait_state(sup, "g1", "ready")
        # Probed before ready, then at most once a second: counted apart from requests.
        await trio.sleep(2.0)
        got = stats(port)
        assert 1 <= got["probes"] <= 4, got
        assert got["received"] == 0, got
        await tokens(client, port, True)
        assert (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        unhealthy = await wait_state(sup, "g1", "unhealthy")
        assert unhealthy.reason == f"/health failed 3 times in a row: {REASON}; {REASON}; {REASON}"
        assert unhealthy.pids == ready.pids
        await tokens(client, port, False)
        back = await wait_state(sup, "g1", "ready")
        assert back.reason is None
        assert [r.state for r in seen] == ["starting", "loading", "ready", "unhealthy", "ready"]
        await sup.stop("g1")
        nursery.cancel_scope.cancel()


async def test_an_engine_that_cannot_generate_is_never_reported_ready(tmp_path: Path) -> None:
    port = free_port()
    sup = Supervisor(tmp_path, grace_s=2, health=PROBING)
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(sup.run)
        await sup.start(engine("g2", port, "vllm", LLMGW_FAKE_LOAD_DELAY="1"))
        await wait_state(sup, "g2", "loading")
        with trio.fail_after(20):
            while True:
                try:
                    await tokens(client, port, True)
                    break
                except httpx.HTTPError:
                    await trio.sleep(0.05)
        with trio.fail_after(20):  # loaded: /health 200, the generation hangs
            while (await client.get(f"http://127.0.0.1:{port}/health")).status_code != 200:
                await trio.sleep(0.1)
        await trio.sleep(2.0)
        assert [r.state for r in sup.reports()] == ["loading"]
        await tokens(client, port, False)
        await wait_state(sup, "g2", "ready")
        await sup.stop("g2")
        nursery.cancel_scope.cancel()


async def test_an_embedding_only_llama_server_is_not_asked_to_generate(tmp_path: Path) -> None:
    port = free_port()
    sup = Supervisor(tmp_path, grace_s=2, health=PROBING)
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(sup.run)
        await sup.start(engine("e1", port, "llama-server", "--embeddings"))
        await wait_state(sup, "e1", "ready")
        await tokens(client, port, True)  # would fail a generation probe within 0.5 s
        await trio.sleep(2.0)
        assert [r.state for r in sup.reports()] == ["ready"]
        assert stats(port)["probes"] == 0
        await sup.stop("e1")
        nursery.cancel_scope.cancel()
