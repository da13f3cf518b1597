"""The leader's autoscaler shell (llmgw/cp/_fleet/_autoscaler.py) on a real store: the
load of every router of every control plane (a standby's through the store) summed
into one sample per model, counters taken as growth per router, a hostile row
refused, and the decision applied, paused and shown."""

from __future__ import annotations

from pathlib import Path

import attrs
import trio

from llmgw import core
from llmgw.cp._fleet._autoscaler import AUTOSCALED, Autoscaler, decode_loads, encode_loads
from llmgw.cp._fleet._catalog import parse
from llmgw.store import open_store

CATALOG = parse(
    {
        "models": [
            {
                "name": "tiny", "source": "x/tiny", "served_names": ["tiny", "tiny-b"],
                "autoscale": {"min": 0, "max": 4, "target": {"requests_per_replica": 2}},
                "profiles": [{"engine": "llama-server"}],
            },
            {"name": "fixed", "source": "x/f", "replicas": 3,
             "profiles": [{"engine": "llama-server"}]},
        ]
    },
    "server.yaml",
)  # fmt: skip


def load(queued: int, in_flight: int, ttft: dict[int, int] | None = None, rejected: int = 0):
    buckets = [0] * (len(core.TTFT_BOUNDS) + 1)
    for i, n in (ttft or {}).items():
        buckets[i] = n
    return core.RouterLoad(queued, in_flight, 100 * in_flight, tuple(buckets), rejected)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []

    def record(self, kind: str, message: str, *, model_name: str | None = None) -> None:
        self.seen.append((kind, message, model_name))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_every_router_of_every_control_plane_counts_once(tmp_path: Path) -> None:
    store = await open_store(tmp_path, timeout_s=10)
    wall = Clock()
    events = Events()
    pokes: list[int] = []
    try:
        leader = Autoscaler(lambda: CATALOG, dict, store, "cp-a:1", lambda: True, events,
                            poke=lambda: pokes.append(1), wall=wall)  # fmt: skip
        standby = Autoscaler(lambda: CATALOG, dict, store, "cp-b:1", lambda: False, Events(),
                             wall=wall)  # fmt: skip
        # The standby's router: 3 in flight for the second served name, 2 first bytes.
        await standby._publish({"w0": {"tiny-b": load(0, 3, {3: 2}, rejected=1)}})
        # A hostile control plane's row is refused, the rest still count.
        await store.put_router_load("cp-evil:1", '{"w0": {"tiny": [1, 2]}}', wall.now)
        await leader._read_others()
        own = {
            "w0": {"tiny": load(4, 2, {1: 5})},  # the leader's own router
            "w1-4242": {"tiny": load(1, 1, {8: 3}), "fixed": load(9, 9)},  # its worker
        }
        leader.step(own, 0.0)
        (scale,) = leader.scales()
        s = scale.sample
        assert s is not None
        assert (s.queued, s.in_flight, s.uncached_tokens) == (5, 6, 600)
        # 10 first bytes: 5 in bucket 1, 2 in bucket 3, 3 in bucket 8: p90 is bucket 8's bound
        assert (s.first_bytes, s.ttft_p90_s) == (10, core.TTFT_BOUNDS[8])
        assert s.rejected == 1
        assert leader.scales()[0].routers == 3  # w0, w1-4242, and the standby's w0
        # Demand 11 for a target of 2 per replica, at zero: raised, and said.
        m = CATALOG.model("tiny")
        assert m is not None
        assert leader.count(m) >= 1 and pokes
        assert events.seen and events.seen[0][0] == AUTOSCALED and events.seen[0][2] == "tiny"
        fixed = CATALOG.model("fixed")
        assert fixed is not None and leader.count(fixed) == 3

        # The next reading: counters count their growth only; a restarted worker (its
        # counter went down) counts all of its new reading.
        own["w0"]["tiny"] = load(0, 0, {1: 6})  # one more first byte
        own["w1-4242"]["tiny"] = load(0, 0, {8: 1})  # restarted: 1 since
        leader.step(own, 1.0)
        s = leader.scales()[0].sample
        # w0: 1 more; the restarted worker: its 1; the standby's row, read again: none.
        assert s is not None and s.first_bytes == 2
    finally:
        await store.aclose()


def test_rows_round_trip_and_bad_ones_are_refused_naming_what() -> None:
    loads = {"w0": {"tiny": load(1, 2, {0: 1})}}
    assert decode_loads(encode_loads(loads)) == loads
    for bad, words in (
        ("[]", "expected {router id"),
        ('{"w0": []}', "expected {model: load}"),
        ('{"w0": {"m": [1, 2, 3, [0], 1]}}', "ttft must be"),
        ('{"w0": {"m": [1, -2, 3, [0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0], 0]}}', "non-negative"),
    ):
        try:
            decode_loads(bad)
        except ValueError as exc:
            assert words in str(exc), (bad, exc)
        else:
            raise AssertionError(f"{bad} was accepted")


async def test_a_pause_holds_the_count_and_the_decision_goes_on(tmp_path: Path) -> None:
    store = await open_store(tmp_path, timeout_s=10)
    try:
        scaler = Autoscaler(lambda: CATALOG, dict, store, "cp-a:1", lambda: True, Events())
        await store.pause_autoscale("tiny", 2, "admin", 1.0)
        scaler.paused_changed(await store.autoscale_paused())
        scaler.step({"w0": {"tiny": load(0, 0)}}, 0.0)
        m = CATALOG.model("tiny")
        assert m is not None and scaler.count(m) == 2
        (scale,) = scaler.scales()
        assert scale.paused == (2, "admin", 1.0) and scale.decision is not None
        assert scale.decision.desired == 0  # what the load would set
        await store.resume_autoscale("tiny")
        scaler.paused_changed(await store.autoscale_paused())
        assert scaler.count(m) == 0
    finally:
        await store.aclose()


async def test_run_writes_its_row_and_a_standby_decides_nothing(tmp_path: Path) -> None:
    store = await open_store(tmp_path, timeout_s=10)
    try:
        standby = Autoscaler(
            lambda: CATALOG, lambda: {"w0": {"tiny": load(7, 0)}}, store, "cp-b:1",
            lambda: False, Events(), sample_s=0.05, live=lambda name: 1,
        )  # fmt: skip
        async with trio.open_nursery() as nursery:
            await nursery.start(standby.run)
            with trio.fail_after(10):
                while not await store.router_loads(0):
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        ((cp, body, _),) = await store.router_loads(0)
        assert cp == "cp-b:1" and decode_loads(body)["w0"]["tiny"].queued == 7
        m = CATALOG.model("tiny")
        assert m is not None and standby.count(m) == 1  # what runs: it decided nothing
        assert standby.scales()[0].decision is None
    finally:
        await store.aclose()


async def test_an_adapters_demand_is_this_cps_routers_now_plus_the_others_last_rows(
    tmp_path: Path,
) -> None:
    """What the adapter manager reads (`demand`): the own routers' figures as they are
    now (a request answered since the last step no longer counts), plus the other control
    planes' routers' as their rows said at the last step, with the latest last use."""
    store = await open_store(tmp_path, timeout_s=10)
    wall = Clock()
    mine: dict[str, dict[str, core.RouterLoad]] = {"w0": {"sql": load(2, 1)}}
    try:
        leader = Autoscaler(lambda: CATALOG, lambda: mine, store, "cp-a:1", lambda: True,
                            Events(), wall=wall)  # fmt: skip
        standby = Autoscaler(lambda: CATALOG, dict, store, "cp-b:1", lambda: False, Events(),
                             wall=wall)  # fmt: skip
        theirs = attrs.evolve(load(1, 3), last_used=500.0)
        await standby._publish({"w0": {"sql": theirs}})
        await leader._read_others()
        leader.step(mine, 0.0)
        got = leader.demand(["sql"]).get("sql")
        assert got is not None and (got.queued, got.in_flight, got.last_used) == (3, 4, 500.0)
        # The own request was answered since: only the standby's figures remain.
        mine["w0"]["sql"] = attrs.evolve(load(0, 0), last_used=900.0)
        got = leader.demand(["sql"]).get("sql")
        assert got is not None and (got.queued, got.in_flight, got.last_used) == (1, 3, 900.0)
        assert leader.demand(["nobody"]).get("nobody") is None
    finally:
        await store.aclose()
