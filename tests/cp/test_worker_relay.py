"""The control plane relays what each router worker's prefix index learns to the others
(llmgw/cp/_workers.py WorkerHub, llmgw/router/_share.py Relay), over the real Unix
socket, with two stand-in workers speaking the channel's lines and the control plane's
own router (worker 0) taking part."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import trio

from llmgw.core import Learned, chain
from llmgw.cp._workers import WorkerHub
from llmgw.router import (
    Endpoint,
    Lines,
    Relay,
    Router,
    RouterConfig,
    StaticEndpoints,
    StaticKeys,
    learned_line,
    send_line,
)

EP = [Endpoint(f"r{i}@n{i}", "m", "vllm", "127.0.0.1", 9, None) for i in (1, 2)]


def test_the_relay_tells_every_member_but_the_source_and_forgets_who_left() -> None:
    relay = Relay(max_blocks=100)
    one, two, three = relay.join(1), relay.join(2), relay.join(3)
    facts = [Learned("e", (1, 2), True, 1)]
    relay.publish(2, facts)
    assert one.take() == facts and three.take() == facts and two.take() == []
    relay.leave(3, three)
    relay.publish(1, facts)
    assert two.take() == facts and len(three) == 0
    again = relay.join(2)  # a restarted worker: its old outbox is no longer served
    relay.leave(2, two)  # the old connection's cleanup comes late: the new one stays
    relay.publish(0, facts)
    assert again.take() == facts and one.take() == facts
    assert relay.statistics() == {"members": [1, 2], "relayed": 3, "dropped": 0}


class StandIn:
    """A worker's end of the channel: hello, then lines."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.lines = Lines(stream)

    @classmethod
    async def connect(cls, path: Path, index: int) -> StandIn:
        worker = cls(await trio.open_unix_socket(str(path)))
        await send_line(worker.stream, {"hello": index, "pid": os.getpid()})
        assert "router" in await worker.lines.next()  # the setup
        assert "endpoints" in await worker.lines.next()  # the first view
        return worker

    async def learned(self) -> list[Any]:
        with trio.fail_after(10):
            while True:
                msg = await self.lines.next()
                if "learned" in msg:
                    return list(msg["learned"])


async def test_facts_reach_the_other_workers_and_the_control_planes_router(
    tmp_path: Path,
) -> None:
    source = StaticEndpoints(EP)
    local = Router(RouterConfig(workers=3), source, StaticKeys([]), worker=0)
    hub = WorkerHub(source, 3, {}, "/nonexistent", tmp_path / "admin.key", local=local)
    sock = tmp_path / "router.sock"
    theirs = tuple(chain(b"w" * 1024, 256))
    mine = tuple(chain(b"m" * 512, 256))
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.serve, sock)
        one = await StandIn.connect(sock, 1)
        two = await StandIn.connect(sock, 2)
        # Worker 1 sent `theirs` to r2@n2: worker 2 and the control plane learn it.
        await send_line(one.stream, learned_line([Learned("r2@n2", theirs, True, 1)]))
        assert await two.learned() == [["r2@n2", 1, 1, list(theirs)]]
        state = local.fleet.endpoint_states()["r2@n2"]
        match = state.index.match(theirs, trio.current_time())
        assert match.blocks == 4 and match.pending  # in flight there, on worker 1
        # ... and counted in the load the control plane's router scores r2@n2 with.
        model = local.fleet.models()["m"]
        loads, _ = local.fleet.loads(list(model.endpoints), model, None, trio.current_time())
        assert {x.endpoint_id: x.in_flight for x in loads} == {"r1@n1": 0, "r2@n2": 1}
        like = model.estimate(None)  # its cost: one request like the one being placed
        assert [(x.pending_prefill, x.pending_decode) for x in loads] == [
            (0.0, 0.0),
            (like.prompt_tokens, like.output_tokens),
        ]
        # The control plane's own router sends `mine` to r1@n1: both workers hear it,
        # and worker 1 does not hear its own fact back.
        local.fleet.endpoint_states()["r1@n1"].index.record(mine, trio.current_time())
        assert local.fleet.outbox is not None
        local.fleet.outbox.sent("r1@n1", mine)
        assert await one.learned() == [["r1@n1", 1, 1, list(mine)]]
        assert await two.learned() == [["r1@n1", 1, 1, list(mine)]]
        # Worker 1's request ended: the pending mark it set on the control plane goes.
        await send_line(one.stream, learned_line([Learned("r2@n2", theirs, False, -1)]))
        assert await two.learned() == [["r2@n2", 0, -1, list(theirs)]]
        assert not state.index.match(theirs, trio.current_time()).pending
        assert state.remote_in_flight == 0
        assert hub.relay.statistics()["members"] == [1, 2]
        # A worker that goes away leaves the relay.
        await one.stream.aclose()
        with trio.fail_after(5):
            while hub.relay.statistics()["members"] != [2]:
                await trio.sleep(0.01)
        await two.stream.aclose()
        nursery.cancel_scope.cancel()
