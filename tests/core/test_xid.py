"""GPU faults, the pure part: Xid lines, the class table, health, the card drain and the
placement refusal (llmgw/core/_xid.py, _facts.py gpu_drains, _drain.py, _placement.py)."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core, model
from llmgw.core import (
    XID_CLASSES,
    DrainInput,
    GpuFacts,
    NodeFacts,
    Placement,
    PlacementProfile,
    Refusal,
    classify_xid,
    gpu_drains,
    keep_faults,
    parse_xid_line,
    pci_key,
    place,
    unhealthy_words,
    xid_fault,
)
from llmgw.core._reconcile import DesiredModel, ObservedShard, Start, Stop, reconcile
from tests.helpers import FIXTURES

XID79 = (FIXTURES / "kernlog-xid79-fallen-off-bus-dmesg-T-drv535.txt").read_text()
XID48 = (FIXTURES / "kernlog-xid48-dbe-framebuffer.txt").read_text()
XID13 = (FIXTURES / "kernlog-xid13-graphics-exception-dmesg-ctime.txt").read_text()


def xids(text: str) -> list[tuple[str, int]]:
    return [(x.bus, x.xid) for line in text.splitlines() if (x := parse_xid_line(line))]


# --- the kernel log's lines ----------------------------------------------------------------


def test_recorded_lines_give_their_xid_and_card() -> None:
    # One Xid line among the crash-dump lines and the "fallen off" line that has no Xid.
    assert xids(XID79) == [("0000:a1:00", 79)]
    assert xids(XID48) == [("0000:07:00", 48)]
    assert xids(XID13) == [("0000:cb:00", 13)] * 3 + [("0000:cb:00", 109)]
    line = parse_xid_line(XID79.splitlines()[1])
    assert line is not None and line.text.endswith("GPU has fallen off the bus.")


def test_any_prefix_and_the_old_form_without_pci() -> None:
    body = "NVRM: Xid (PCI:0000:a1:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off"
    for prefix in ("", "6,1234,5678901,-;", "Dec  2 10:43:35 worker4 kernel: [1.5] ", "[ 1.2] "):
        x = parse_xid_line(prefix + body)
        assert x is not None and (x.bus, x.xid) == ("0000:a1:00", 79)
    x = parse_xid_line("NVRM: Xid (0000:03:00): 14, Channel 00000001")
    assert x is not None and (x.bus, x.xid) == ("0000:03:00", 14)


def test_pci_addresses_compare_as_numbers() -> None:
    assert pci_key("00000000:A1:00.0") == pci_key("0000:a1:00") == "0000:a1:00"
    assert pci_key("0004:01:00") == "0004:01:00"
    assert pci_key("not a bus") is None


@given(st.text())
def test_any_text_parses_or_is_none(text: str) -> None:
    x = parse_xid_line(text)
    assert x is None or (x.xid >= 0 and pci_key(x.bus) == x.bus)


# --- the table ---------------------------------------------------------------------------------


def test_the_table_takes_hardware_faults_out_and_reports_the_applications() -> None:
    for xid in (79, 48, 62, 64, 74, 95, 119, 120, 140):
        assert classify_xid(xid).unusable, xid
    for xid in (13, 31, 43, 45):
        assert classify_xid(xid) == attrs.evolve(classify_xid(xid), whose="application")
        assert not classify_xid(xid).unusable, xid
    assert classify_xid(79).meaning == "GPU has fallen off the bus"
    assert classify_xid(48).meaning == "Double Bit ECC Error"


@given(st.integers(min_value=0, max_value=100_000))
def test_an_unknown_xid_is_reported_never_acted_on(xid: int) -> None:
    c = classify_xid(xid)
    if xid not in XID_CLASSES:
        assert not c.unusable and c.meaning == f"unknown Xid {xid}"


FAULTS = st.builds(
    xid_fault, st.sampled_from([13, 31, 43, 48, 79, 94, 999]), st.floats(0, 1e9, allow_nan=False)
)


@given(st.lists(FAULTS, max_size=40))
def test_kept_faults_are_bounded_and_the_first_unusable_one_stays(
    faults: list[model.GpuFault],
) -> None:
    kept: tuple[model.GpuFault, ...] = ()
    for f in faults:
        kept = keep_faults(kept, f)
    assert len(kept) <= core._xid.FAULTS_KEPT
    first = next((f for f in faults if f.unusable), None)
    assert core.gpu_health(kept) == (
        model.GpuHealth.UNHEALTHY if first is not None else model.GpuHealth.OK
    )
    if first is not None:
        assert first in kept
        assert unhealthy_words(1, kept) == f"gpu 1 unhealthy: {core.fault_words(first)}"
    if faults:
        assert kept[-1] == faults[-1]


# --- from the node's report to the drain -------------------------------------------------------


@attrs.frozen
class Rec:
    node_id: str
    inventory: model.Inventory
    shards: tuple[model.ShardReport, ...]
    host: str = "127.0.0.1"
    liveness: object = None


def gpu(i: int) -> model.Gpu:
    return model.Gpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", "h100-80g")


def node(health: list[str | None], faults: dict[int, tuple[model.GpuFault, ...]]) -> Rec:
    usage = model.Usage(
        gpus=tuple(
            model.GpuUsage(i, health=h, faults=faults.get(i, ()) if h else None)
            for i, h in enumerate(health)
        )
    )
    shards = tuple(
        model.ShardReport(
            f"s{i}", "m", "vllm", "ready", replica_id=f"r{i}", model_name="m", gpus=(f"GPU-{i}",)
        )
        for i in range(len(health))
    )
    inv = model.Inventory(
        host=model.Host("n1"), usage=usage, gpus=tuple(map(gpu, range(len(health))))
    )
    return Rec("n1", inv, shards)


def test_only_the_replica_on_the_unusable_card_drains() -> None:
    f79 = xid_fault(79, 1.0, line="...")
    f13 = xid_fault(13, 1.0)
    rec = node(["ok", "unhealthy"], {0: (f13,), 1: (f13, f79)})
    assert gpu_drains([rec]) == {"r1": "gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus) on n1"}
    # Xid 13 alone, or an agent older than the field (health unknown): nothing drains.
    assert gpu_drains([node(["ok", "ok"], {0: (f13,)})]) == {}
    assert gpu_drains([node([None, None], {})]) == {}


def test_the_plan_replaces_the_cards_replica_first_then_stops_it() -> None:
    desired = [DesiredModel("m", 2, ("fp",), {"fp": 600.0})]

    def shard(r: str, node_id: str) -> ObservedShard:
        return ObservedShard(node_id, "ready", f"s-{r}", "ready", r, "m", 0, 1, "fp")

    why = "gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus) on n1"
    states = {"n1": "ready", "n2": "ready"}
    before = [shard("r0", "n1"), shard("r1", "n1")]
    drain = DrainInput(replicas={"r1": why})
    p = reconcile(desired, before, states, {"r0": 0.0, "r1": 0.0}, 10.0, drain=drain)
    assert p.actions == (Start("m"),)  # the replacement first; nothing stopped yet
    view = {v.replica_id: v for v in p.replicas}
    assert view["r0"].state == "ready"
    assert view["r1"].state == "draining" and (view["r1"].reason or "").startswith(why)
    # Replaced: out of the router first, then stopped at zero in flight.
    after = [*before, shard("r2", "n2")]
    seen = {"r0": 0.0, "r1": 0.0, "r2": 5.0}
    p = reconcile(desired, after, states, seen, 10.0, drain=DrainInput(replicas={"r1": why},
                  in_flight={"r1": 0}))  # fmt: skip
    assert p.actions == () and {v.replica_id: v.state for v in p.replicas}["r1"] == "retiring"
    idle = DrainInput(replicas={"r1": why}, in_flight={"r1": 0}, retiring_since={"r1": 10.0})
    p = reconcile(desired, after, states, seen, 11.0, drain=idle)
    assert p.actions == (Stop("n1", "s-r1", f"replica r1 retired: {why}; replaced, and no "
                              "request is in flight"),)  # fmt: skip


def test_placement_leaves_the_card_out_and_says_why() -> None:
    cards = (
        GpuFacts(0, "GPU-0", "h100-80g", True),
        GpuFacts(1, "GPU-1", "h100-80g", False,
                 why="gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus)"),
    )  # fmt: skip
    facts = NodeFacts("n1", "127.0.0.1", True, gpus=cards)
    profile = PlacementProfile("m", "vllm", "h100-80g", 1)
    got = place([facts], profile)
    assert isinstance(got, Placement) and got.ranks[0].gpu_indexes == (0,)
    full = place([facts], profile, core.Allocations(gpus={"n1": frozenset({0})}))
    assert isinstance(full, Refusal)
    assert full.reasons == (
        "n1: 0 free healthy h100-80g cards, needs 1 (1 in use, 1 unhealthy); "
        "gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus)",
    )


@given(st.lists(st.sampled_from(["ok", "unhealthy", None]), min_size=1, max_size=8))
def test_exactly_the_replicas_on_cards_taken_out_drain(health: list[str | None]) -> None:
    f79 = xid_fault(79, 1.0)
    faults = {i: (f79,) for i, h in enumerate(health) if h == "unhealthy"}
    drains = gpu_drains([node(health, faults)])
    assert set(drains) == {f"r{i}" for i, h in enumerate(health) if h == "unhealthy"}
    for replica, why in drains.items():
        assert why == f"gpu {replica[1:]} unhealthy: Xid 79 (GPU has fallen off the bus) on n1"
