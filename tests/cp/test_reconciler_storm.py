"""A register storm is reconciled in a few passes, not one per registration.

Every registration pokes the reconciler, and each pass reads the whole fleet:
one pass per registration made a storm of N agents cost O(N²) (a fifth of a
10,000-agent storm's CPU). Here a real llmgw-cp takes STORM registrations at
once over mutual TLS and `GET /api/v1/status` reports how many pokes it got
and how many passes it made of them.
"""

from __future__ import annotations

import pytest
import trio

from llmgw import model
from llmgw.rpc import CapnpThread, _tls
from llmgw.testing.cluster import LocalCluster, wait_for

STORM = 120


class Agent:
    def __init__(self, node: str) -> None:
        self.node = node

    async def inventory(self) -> model.Inventory:
        return model.Inventory(host=model.Host(hostname=self.node))


async def storm(cluster: LocalCluster, nodes: list[str]) -> None:
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        registered = trio.Semaphore(0)
        done = trio.Event()

        async def one(node: str) -> None:
            pki = cluster.pki
            tls = _tls.client_context(
                pki / "ca.crt", pki / f"agent-{node}.crt", pki / f"agent-{node}.key"
            )
            hello = model.Hello(
                node_id=node, agent_version="t", inventory=await Agent(node).inventory()
            )
            async with bridge.connect("127.0.0.1", cluster.rpc_port, tls, agent=Agent(node)) as c:
                session, _ = await c.register(hello)
                registered.release()
                await done.wait()  # stay connected until every one has registered
                session.release()

        for node in nodes:
            nursery.start_soon(one, node)
        with trio.fail_after(120):
            for _ in nodes:
                await registered.acquire()
        done.set()


@pytest.mark.slow
def test_a_register_storm_takes_far_fewer_passes_than_registrations(
    cluster: LocalCluster,
) -> None:
    nodes = [f"s{i:03d}" for i in range(STORM)]
    cluster.setup(nodes)
    cp = cluster.start_cp()
    cp_ = cluster.first

    def reconciler() -> dict[str, int]:
        stats: dict[str, int] = cp_.api_get("/api/v1/status")["reconciler"]
        return stats

    before = reconciler()
    trio.run(storm, cluster, nodes)
    after = wait_for(
        "the storm's pokes reconciled",
        lambda: (r := reconciler())["passes"] > before["passes"] and r,
        30,
    )
    pokes = after["pokes"] - before["pokes"]
    passes = after["passes"] - before["passes"]
    # Every registration poked (a node that went ready pokes again)...
    assert pokes >= STORM, (before, after)
    # ...and the passes (with the 2 s timer's among them) are a small fraction of that.
    assert passes <= STORM // 6, f"{passes} passes for {pokes} pokes ({before} -> {after})"
    assert cp.alive()
