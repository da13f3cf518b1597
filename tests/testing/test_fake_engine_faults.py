"""The fake engine's fault switches, in process: what flips them and what they answer.

The faults as a client meets them (a hung /health, a crash, failed requests)
are checked against a running engine in test_fake_engine.py.
"""

from __future__ import annotations

import json

import trio
import trio.testing

from llmgw.testing import fake_engine
from llmgw.testing._fake_engine_cli import Behaviour
from llmgw.testing._fake_engine_faults import Faults, crash_lines, injected_failure


def test_crash_lines_is_reexported_where_callers_import_it() -> None:
    assert fake_engine.crash_lines is crash_lines


def test_health_switch_takes_a_bool_and_refuses_anything_else() -> None:
    faults = Faults("vllm", Behaviour())
    assert faults.health_hangs is False
    on = faults.switch_health(b'{"hang": true}')
    assert (on.status, json.loads(on.body), faults.health_hangs) == (200, {"hang": True}, True)
    for bad in (b"", b"[1]", b"{", b'{"hang": "yes"}'):
        reply = faults.switch_health(bad)
        assert reply.status == 400
        assert faults.health_hangs is True  # a refused body leaves the switch as it was
    off = faults.switch_health(b'{"hang": false}')
    assert (off.status, faults.health_hangs) == (200, False)


def test_health_hang_after_zero_hangs_from_the_start() -> None:
    assert Faults("sglang", Behaviour(health_hang_after=0)).health_hangs is True
    assert Faults("sglang", Behaviour(health_hang_after=None)).health_hangs is False


async def test_health_hangs_once_its_timer_runs_out(autojump_clock: trio.testing.MockClock) -> None:
    faults = Faults("llama-server", Behaviour(health_hang_after=2.5))
    seen: list[bool] = []
    async with trio.open_nursery() as nursery:
        faults.start(nursery)
        for _ in range(3):
            await trio.sleep(1.0)
            seen.append(faults.health_hangs)  # at 1, 2 and 3 simulated seconds
        nursery.cancel_scope.cancel()
    assert seen == [False, False, True]


def test_injected_failure_speaks_each_engines_words() -> None:
    vllm = injected_failure("vllm")
    llama = injected_failure("llama-server")
    assert (vllm.status, llama.status) == (500, 500)
    assert b"EngineCore encountered an issue" in vllm.body
    assert b"LLMGW_FAKE_FAIL_RATE" in llama.body
