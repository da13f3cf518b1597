"""Calls per second of a small RPC (a heartbeat) over loopback with mutual TLS.

Both ends run in this process, each call crossing trio -> capnp thread ->
TLS socket -> capnp thread -> trio servant and back. Prints the figures with
the Python and pycapnp versions. Run: `.venv/bin/python bench/rpc.py [--calls N]`.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import trio

from llmgw import model
from llmgw.ctl import _cert
from llmgw.rpc import AgentHandle, CapnpThread, PeerInfo, _tls


class _Session:
    async def heartbeat(self, beat: model.Heartbeat) -> None:
        pass

    async def shard_status(self, shard: model.ShardReport) -> None:
        pass

    async def progress(self, progress: model.Progress) -> None:
        pass


class _Registry:
    async def register(self, peer: PeerInfo, hello: model.Hello, agent: AgentHandle):
        return _Session(), model.Settings(heartbeat_interval_s=5.0, epoch=1)


class _Agent:
    async def inventory(self) -> model.Inventory:
        return model.Inventory(host=model.Host("bench"))


async def bench(calls: int, concurrency: int, pki: Path) -> dict[str, float]:
    server_tls = _tls.server_context(pki / "ca.crt", pki / "server.crt", pki / "server.key")
    client_tls = _tls.client_context(pki / "ca.crt", pki / "agent-b.crt", pki / "agent-b.key")
    beat = model.Heartbeat(seq=1, usage=model.Usage(memory_available_bytes=1 << 30, load1=0.5))
    results: dict[str, float] = {}
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, _Registry())
        async with bridge.connect("127.0.0.1", port, client_tls, agent=_Agent()) as conn:
            session, _ = await conn.register(
                model.Hello(
                    node_id="b",
                    agent_version="bench",
                    inventory=model.Inventory(host=model.Host("b")),
                )
            )
            for _ in range(200):  # warm up
                await session.heartbeat(beat)
            start = time.perf_counter()
            for _ in range(calls):
                await session.heartbeat(beat)
            took = time.perf_counter() - start
            results["sequential calls/s"] = calls / took
            results["sequential us/call"] = took / calls * 1e6

            async def worker(n: int) -> None:
                for _ in range(n):
                    await session.heartbeat(beat)

            start = time.perf_counter()
            async with trio.open_nursery() as workers:
                for _ in range(concurrency):
                    workers.start_soon(worker, calls // concurrency)
            took = time.perf_counter() - start
            results[f"{concurrency} in flight calls/s"] = (
                (calls // concurrency) * concurrency / took
            )
        nursery.cancel_scope.cancel()
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pki = Path(tmp)
        _cert.init_ca(pki)
        _cert.issue_server(pki, ["127.0.0.1"])
        _cert.issue_agent(pki, "b")
        results = trio.run(bench, args.calls, args.concurrency, pki)
    print(
        f"python {platform.python_version()} ({sys.implementation.name}), "
        f"pycapnp {version('pycapnp')}, trio {version('trio')}, {platform.machine()}"
    )
    print(f"heartbeat RPC over loopback TLS 1.3, {args.calls} calls:")
    for name, value in results.items():
        print(f"  {name:>24}: {value:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
