"""A standby control plane: it refuses agents naming the leader, serves the admin API
read-only, and a deposed one drops its sessions; all over real RPC on loopback."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import FakeAgent, loopback_pki, register
from helpers import asgi_call as asgi

from llmgw import core, model
from llmgw.agent._servant import AgentServant
from llmgw.agent._session import AgentSession, Backoff
from llmgw.core._reconcile import Stop
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._catalog import Catalog
from llmgw.cp._fleet._leader import Holder, LeaderView
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._fleet._wake import Wakeup
from llmgw.errors import RegistrationRefused
from llmgw.rpc import CapnpThread, PeerInfo

POLICY = core.LivenessPolicy(heartbeat_interval_s=0.2, missed_heartbeats=3, lost_after_s=30)
LEADER = Holder(rpc="127.0.0.1:7070", admin="127.0.0.1:8081")


def session(addresses: list[tuple[str, int]], tls: Any, servant: object = None) -> AgentSession:
    async def inventory() -> model.Inventory:
        return model.Inventory(host=model.Host("n1"))

    async def heartbeat(seq: int) -> model.Heartbeat:
        return model.Heartbeat(seq=seq)

    return AgentSession(
        node_id="n1",
        addresses=addresses,
        tls=tls,
        servant=servant if servant is not None else object(),
        hello_inventory=inventory,
        heartbeat=heartbeat,
        backoff=Backoff(initial_s=0.1, max_s=0.2),  # a redial is prompt
        rng=random.Random(0),
    )


class Lease:
    """The registry's lease in a test: `acting` is what may_act answers; each step_down
    is recorded with its reason."""

    def __init__(self, acting: bool = True) -> None:
        self.acting = acting
        self.stepped: list[str] = []

    def may_act(self) -> bool:
        return self.acting

    def step_down(self, why: str) -> None:
        self.stepped.append(why)


async def wait_for(cond: Any, timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.02)


async def test_a_standby_refuses_naming_the_leader_and_the_agent_goes_there(
    tmp_path: Path,
) -> None:
    server_tls, client_tls = loopback_pki(tmp_path, "n1")
    leader = NodeRegistry(POLICY, epoch=4)
    standby = NodeRegistry(POLICY, leading=False)
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        await nursery.start(leader.run)
        await nursery.start(standby.run)
        leader_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, leader)
        standby_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, standby)
        standby.set_leader(f"127.0.0.1:{leader_port}")
        # Only the standby is listed: the leader is known to the agent only from the refusal.
        s = session([("127.0.0.1", standby_port)], client_tls)
        nursery.start_soon(s.run, bridge)
        with trio.fail_after(15):
            await s.connected.wait()
        assert s.registered_with == f"127.0.0.1:{leader_port}"
        assert s.control_plane is not None and s.control_plane[2].epoch == 4
        assert [r.node_id for r in leader.records()] == ["n1"]
        assert standby.records() == [] and "n1" not in standby.known  # nothing of it read
        nursery.cancel_scope.cancel()


async def test_a_standby_without_a_leader_says_so_and_reads_nothing() -> None:
    standby = NodeRegistry(POLICY, leading=False)
    agent = FakeAgent("n1")
    peer = PeerInfo(1, "10.0.0.1:5000", "n1", trio.Event())
    hello = model.Hello("n1", "test", model.Inventory(model.Host("n1")), ())
    with pytest.raises(RegistrationRefused) as refused:
        await standby.register(peer, hello, agent)  # type: ignore[arg-type]
    assert str(refused.value) == "standby; no leader yet" and refused.value.leader is None
    assert agent.released == 1 and standby.records() == []
    standby.set_leader("cp1:7070")
    with pytest.raises(RegistrationRefused) as refused:
        await standby.register(peer, hello, FakeAgent("n1"))  # type: ignore[arg-type]
    assert str(refused.value) == "standby; leader is cp1:7070"
    assert refused.value.leader == "cp1:7070" and refused.value.epoch is None
    standby.set_leader("cp1:7070", 7)
    with pytest.raises(RegistrationRefused) as refused:
        await standby.register(peer, hello, FakeAgent("n1"))  # type: ignore[arg-type]
    assert (refused.value.leader, refused.value.epoch) == ("cp1:7070", 7)
    # A leader past its lease by its own clock refuses too, though not yet stepped down.
    leader = NodeRegistry(POLICY, lease=Lease(acting=False))
    with pytest.raises(RegistrationRefused, match="standby; no leader yet"):
        await leader.register(peer, hello, FakeAgent("n1"))  # type: ignore[arg-type]
    assert leader.agent("n1") is None


async def test_a_deposed_registry_drops_its_sessions_and_agents_go_to_the_new_leader(
    tmp_path: Path,
) -> None:
    server_tls, client_tls = loopback_pki(tmp_path, "n1")
    new = NodeRegistry(POLICY, epoch=2, leading=False)
    changes: list[str] = []
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        old = NodeRegistry(
            POLICY,
            epoch=1,
            close_connection=bridge.close_connection,
            listeners=(lambda: changes.append("changed"),),
        )
        await nursery.start(old.run)
        await nursery.start(new.run)
        old_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, old)
        new_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, new)
        new.set_leader(f"127.0.0.1:{old_port}")
        s = session([("127.0.0.1", old_port), ("127.0.0.1", new_port)], client_tls)
        nursery.start_soon(s.run, bridge)
        with trio.fail_after(15):
            await s.connected.wait()
        assert s.registered_with == f"127.0.0.1:{old_port}" and s.registrations == 1
        # The lease passes: the old one steps down, the new one leads.
        new.lead(2)
        old.set_leader(f"127.0.0.1:{new_port}")
        changes.clear()
        old.step_down("renewal refused: another control plane holds the lease")
        assert old.records() == [] and old.agent("n1") is None and changes == ["changed"]
        await wait_for(lambda: s.registrations == 2 and s.registered_with is not None)
        assert s.registered_with == f"127.0.0.1:{new_port}"
        assert [r.node_id for r in new.records()] == ["n1"]
        assert s.control_plane is not None and s.control_plane[2].epoch == 2
        assert old.records() == []  # it came back to the old one? refused: standby
        nursery.cancel_scope.cancel()


async def test_a_leader_deposed_and_elected_again_is_redialled_at_once(tmp_path: Path) -> None:
    """The store-outage case (issue 24): the leader steps down (its renewal failed), its
    agents leave it, and once the store is back it takes the lease again at a newer epoch.
    The standby's refusal names it with that epoch, so the agent dials it now instead of
    waiting out LOST_RECENTLY_S (20 s) since the session it lost there."""
    server_tls, client_tls = loopback_pki(tmp_path, "n1")
    standby = NodeRegistry(POLICY, leading=False)
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        leader = NodeRegistry(POLICY, epoch=1, close_connection=bridge.close_connection)
        await nursery.start(leader.run)
        await nursery.start(standby.run)
        leader_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, leader)
        standby_port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, standby)
        standby.set_leader(f"127.0.0.1:{leader_port}", 1)
        s = session([("127.0.0.1", leader_port), ("127.0.0.1", standby_port)], client_tls)
        nursery.start_soon(s.run, bridge)
        with trio.fail_after(15):
            await s.connected.wait()
        assert s.registered_with == f"127.0.0.1:{leader_port}"
        leader.step_down("renewal failed: the store is down")
        # While the standby still names it at epoch 1, the agent does not go back.
        await trio.sleep(1.0)
        assert s.registrations == 1 and s.registered_with is None
        refused = RegistrationRefused("x", leader=f"127.0.0.1:{leader_port}", epoch=1)
        assert s._dial_named(refused, "test") is None
        # Elected again at epoch 2; the standby reads the lease and names it so.
        t0 = trio.current_time()
        leader.lead(2)
        standby.set_leader(f"127.0.0.1:{leader_port}", 2)
        await wait_for(lambda: s.registrations == 2 and s.registered_with is not None, 10)
        assert s.registered_with == f"127.0.0.1:{leader_port}"
        assert s.control_plane is not None and s.control_plane[2].epoch == 2
        assert trio.current_time() - t0 < 5.0  # a backoff or two, not LOST_RECENTLY_S
        nursery.cancel_scope.cancel()


async def test_a_stale_epoch_from_a_real_agent_is_counted_and_steps_down(tmp_path: Path) -> None:
    """The agent has seen epoch 5; this leader is at 1: its stop is refused across the
    wire as StaleEpoch, decoded as such, counted, and the leader steps down."""
    server_tls, client_tls = loopback_pki(tmp_path, "n1")
    lease = Lease()
    registry = NodeRegistry(POLICY, epoch=1, lease=lease)
    servant = AgentServant(None, None)  # type: ignore[arg-type]
    servant.saw_epoch(5)
    reconciler = Reconciler(registry, lambda: Catalog())
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        port = await nursery.start(bridge.serve, "127.0.0.1", 0, server_tls, registry)
        s = session([("127.0.0.1", port)], client_tls, servant)
        nursery.start_soon(s.run, bridge)
        with trio.fail_after(15):
            await s.connected.wait()
        await reconciler._stop(Stop("n1", "x.0", "a test"))
        assert registry.commands_refused_stale == 1
        assert lease.stepped == ["node n1 refused epoch 1 as stale"]
        nursery.cancel_scope.cancel()


# --- the admin API and ctl on a standby ----------------------------------------------


class FakeLeadership:
    def __init__(self, role: str, leader: Holder | None) -> None:
        self.role, self.leader = role, leader

    def may_act(self) -> bool:
        return self.role != "standby"

    def view(self) -> LeaderView:
        me = Holder("127.0.0.1:7071", "127.0.0.1:8082")
        return LeaderView(self.role, 7, self.leader, me, 10.0, 1, 0)


async def test_the_admin_api_on_a_standby_is_read_only_and_names_the_leader() -> None:
    registry = NodeRegistry(POLICY, leading=False)
    app = AdminApp(registry, "key", leadership=FakeLeadership("standby", LEADER))
    status, body = await asgi(app, "POST", "/api/v1/nodes/n1/cordon", {"reason": "x"})
    assert status == 409
    assert body == {
        "error": {
            "message": "standby; leader is 127.0.0.1:7070 (admin 127.0.0.1:8081)",
            "code": 409,
        },
        "leader": {"rpc": "127.0.0.1:7070", "admin": "127.0.0.1:8081"},
    }
    assert registry.cordoned == {}
    status, _ = await asgi(app, "DELETE", "/api/v1/nodes/n1")
    assert status == 409
    status, body = await asgi(app, "GET", "/api/v1/nodes")
    assert status == 200 and body["nodes"] == []  # reads are served
    status, body = await asgi(app, "GET", "/api/v1/leader")
    assert status == 200
    assert body == {
        "role": "standby", "epoch": 7, "leader": LEADER.json(),
        "me": {"rpc": "127.0.0.1:7071", "admin": "127.0.0.1:8082"}, "lease_s": 10.0,
        "commands_refused_stale": 0,
    }  # fmt: skip
    app = AdminApp(registry, "key", leadership=FakeLeadership("standby", None))
    status, body = await asgi(app, "POST", "/api/v1/nodes/n1/cordon", {"reason": "x"})
    assert status == 409 and body["leader"] is None
    assert body["error"]["message"].startswith("standby; no leader yet")
    # The leader takes writes.
    app.leadership = FakeLeadership("leader", None)  # type: ignore[assignment]
    registry.lead(8)
    await register(registry, "n1")
    status, _ = await asgi(app, "POST", "/api/v1/nodes/n1/cordon", {"reason": "x"})
    assert status == 200 and "n1" in registry.cordoned


@pytest.mark.parametrize("old_shape", [False, True])
def test_ctl_prints_the_standbys_answer_and_exits_1(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    old_shape: bool,
) -> None:
    """The answer as the admin API gives it (test above), and as a control plane of the
    previous release did: the message as a bare string."""
    from llmgw.ctl import _main

    message = "standby; leader is 127.0.0.1:7070 (admin 127.0.0.1:8081)"
    error = message if old_shape else {"message": message, "code": 409}
    answer = {"error": error, "leader": LEADER.json()}

    def request(method: str, url: str, **_: Any) -> httpx.Response:
        assert (method, url) == ("POST", "http://cp2:8081/api/v1/nodes/n1/cordon")
        return httpx.Response(409, json=answer, request=httpx.Request(method, url))

    monkeypatch.setattr(httpx, "request", request)
    monkeypatch.setenv("LLMGW_CTL_CONFIG", str(tmp_path / "none.yaml"))
    monkeypatch.setenv("LLMGW_ADMIN_URL", "http://cp2:8081")
    monkeypatch.setenv("LLMGW_ADMIN_KEY", "k")
    assert _main.main(["cordon", "n1"]) == 1
    err = capsys.readouterr().err
    assert err == "llmgw ctl: standby; leader is 127.0.0.1:7070 (admin 127.0.0.1:8081)\n"


# --- the reconciler on a standby, and after an election ------------------------------


class RecordingAgent(FakeAgent):
    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.started: list[tuple[int, str]] = []

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.started.append((epoch, spec.shard_id))
        return model.ShardReport(shard_id=spec.shard_id, model=spec.model, engine=spec.engine,
                                 state="starting", port=spec.port, replica_id=spec.replica_id,
                                 model_name=spec.model_name, rank=spec.rank, ranks=spec.ranks,
                                 gpus=spec.gpus, profile_fingerprint=spec.profile_fingerprint)  # fmt: skip


def tiny() -> Catalog:
    from llmgw.cp._fleet._catalog import parse

    return parse(
        {"models": [{"name": "tiny", "source": "/models/tiny.gguf", "replicas": 1,
                     "profiles": [{"engine": "llama-server", "gpus_per_node": 0}]}]},
        "server.yaml",
    )  # fmt: skip


async def test_a_standby_reconciler_does_nothing_and_the_settle_counts_from_the_election(
    autojump_clock: trio.testing.MockClock,
) -> None:
    quiet = core.LivenessPolicy(heartbeat_interval_s=60, lost_after_s=600)  # no beats needed
    wake = Wakeup()
    registry = NodeRegistry(quiet, leading=False, listeners=(wake.poke,))
    registry.known.update({"a", "b"})  # as the store had them
    reconciler = Reconciler(registry, tiny, interval_s=0.5, settle_s=3.0, wake=wake)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await nursery.start(reconciler.run)
        # Long past the longest settle counted from the process start (6 x settle_s).
        await trio.sleep(30)
        assert reconciler.statistics()["passes"] >= 10
        assert reconciler.unplaced() == [] and reconciler.replicas() == []  # "no node fits": unsaid
        assert registry.events.events() == ()
        registry.lead(2)
        reconciler.elected()
        elected_at = trio.current_time()
        agent = RecordingAgent("a")
        await register(registry, "a", agent=agent)
        with trio.fail_after(30):
            while not agent.started:
                await trio.sleep(0.05)
        # b never comes: the new leader waits settle_s for it, from the election.
        assert trio.current_time() - elected_at >= 3.0
        assert agent.started[0][0] == 2  # the command carries the lease's epoch
        nursery.cancel_scope.cancel()


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)
