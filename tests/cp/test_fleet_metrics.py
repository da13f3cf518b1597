"""Fleet metrics (issue 14): the collector on a registry with an injected clock, and the
admin listener's /metrics of a fleet of real agents with recorded nvidia-smi output."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import attrs
import httpx
import hypothesis.strategies as st
import pytest
import trio
from helpers import documented_metrics, register, require
from hypothesis import given
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw import core, model
from llmgw.cp._fleet._catalog import Catalog, CatalogModel, Profile
from llmgw.cp._fleet._fleet_metrics import (
    DOCS,
    LABEL_MAX,
    FleetCollector,
    FleetInput,
    fleet_families,
)
from llmgw.cp._fleet._placing import Unplaced
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for

POLICY = core.LivenessPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, lost_after_s=600.0)
MIB = 1 << 20

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def pick(got: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return {k: v for (n, k), v in got.items() if n == name and want <= k}


def one(got: Samples, name: str, **labels: str) -> float:
    found = pick(got, name, **labels)
    assert len(found) == 1, f"{name}{labels}: {len(found)} series, want 1: {sorted(found)}"
    return next(iter(found.values()))


INVENTORY = model.Inventory(
    model.Host("gpu-a", cpu_count=64),
    gpus=(
        model.Gpu(0, "GPU-0", "NVIDIA H100 80GB HBM3", "h100-80g", memory_total_mib=81559),
        model.Gpu(1, "GPU-1", "NVIDIA H100 80GB HBM3", "h100-80g", memory_total_mib=81559),
    ),
    topology=model.Topology(nvlinks=(model.NvLink(0, 1, 18),)),
    fabrics=(model.Fabric("ib0", ("mlx5_0", "mlx5_1"), 400.0),),
    engines=model.Engines(
        found=(model.Engine("llama-server", "/usr/bin/llama-server", "b6000", "installed"),),
        pending=(model.EngineStatus("vllm", "failed", "pip said no"),),
    ),
)
USAGE = model.Usage(
    memory_total_bytes=64 << 30,
    memory_available_bytes=40 << 30,
    load1=1.5,
    load5=None,  # nobody measured it: no series
    load15=0.25,
    cpu_util_pct=12.5,
    gpus=(
        model.GpuUsage(
            0, memory_used_mib=1024, utilization_pct=37.0, ecc_uncorrected=0, health="ok"
        ),
        model.GpuUsage(
            1,
            memory_used_mib=2048,
            utilization_pct=None,
            foreign_memory_mib=512,
            health="unhealthy",
            faults=(core.xid_fault(79, 1.0),),
        ),
    ),
    filesystems=(
        model.Filesystem("/", "ext4", ("/var/lib/llmgw",), 100 << 30, 5 << 30, False),
        model.Filesystem("/shared", "nfs", ("/models",), 10 << 40, None, True),
    ),
    shards=(
        model.ShardUsage("s1", cpu_cores=2.5, rss_bytes=3 << 30, gpu_memory_mib=20480),
        model.ShardUsage("s2"),  # nothing measured
    ),
)


async def test_collector_exports_what_was_reported_and_drops_a_stale_sample() -> None:
    now = [1000.0]
    registry = NodeRegistry(POLICY, clock=lambda: now[0], wall=lambda: 1.7e9 + now[0])
    catalog = Catalog(
        (
            CatalogModel(
                name="tiny",
                source="hub/tiny",
                replicas=2,
                profiles=[Profile(engine="llama-server")],
            ),
        )
    )
    prom = CollectorRegistry()
    prom.register(FleetCollector(registry, catalog=lambda: catalog, clock=lambda: now[0]))
    shard = model.ShardReport("s1", "/m/tiny.gguf", "llama-server", "ready", model_name="tiny")
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        _agent, _peer, session = await register(
            registry, "gpu-a", inventory=INVENTORY, shards=(shard,)
        )
        await session.heartbeat(model.Heartbeat(seq=1, usage=USAGE))
        now[0] += 59.0  # the heartbeat is 59 s old: still fresh
        got = samples(generate_latest(prom).decode())
        nursery.cancel_scope.cancel()

    assert one(got, "llmgw_node_state", node="gpu-a", state="ready") == 1
    assert one(got, "llmgw_node_state", node="gpu-a", state="lost") == 0
    assert one(got, "llmgw_node_cpus", node="gpu-a") == 64
    assert one(got, "llmgw_node_cpu_utilization_percent", node="gpu-a") == 12.5
    assert {dict(k)["window"]: v for k, v in pick(got, "llmgw_node_load").items()} == {
        "1m": 1.5,
        "15m": 0.25,
    }
    assert one(got, "llmgw_node_memory_total_bytes") == 64 << 30
    assert one(got, "llmgw_node_memory_available_bytes") == 40 << 30
    assert one(got, "llmgw_node_memory_used_bytes") == 24 << 30
    assert one(got, "llmgw_node_disk_free_bytes", mount="/", shared="false") == 5 << 30
    assert one(got, "llmgw_node_disk_total_bytes", mount="/shared", shared="true") == 10 << 40
    assert pick(got, "llmgw_node_disk_free_bytes", mount="/shared") == {}  # not reported
    gpu0 = {"node": "gpu-a", "gpu": "0", "uuid": "GPU-0", "class": "h100-80g"}
    assert one(got, "llmgw_gpu_memory_total_bytes", **gpu0) == 81559 * MIB
    assert one(got, "llmgw_gpu_memory_used_bytes", **gpu0) == 1024 * MIB
    assert one(got, "llmgw_gpu_utilization_percent", **gpu0) == 37.0
    assert one(got, "llmgw_gpu_ecc_uncorrected_errors", **gpu0) == 0  # a measured zero
    assert pick(got, "llmgw_gpu_foreign_memory_bytes", gpu="0") == {}
    assert pick(got, "llmgw_gpu_utilization_percent", gpu="1") == {}  # nobody said
    assert one(got, "llmgw_gpu_foreign_memory_bytes", gpu="1") == 512 * MIB
    assert one(got, "llmgw_gpu_nvlink_peers", gpu="1") == 1
    assert one(got, "llmgw_gpu_healthy", **gpu0) == 1
    assert one(got, "llmgw_gpu_healthy", gpu="1") == 0  # Xid 79: the card is out
    assert one(got, "llmgw_shard_cpu_cores", node="gpu-a", shard="s1", model="tiny") == 2.5
    assert one(got, "llmgw_shard_memory_bytes", shard="s1") == 3 << 30
    assert one(got, "llmgw_shard_gpu_memory_bytes", shard="s1") == 20480 * MIB
    assert pick(got, "llmgw_shard_gpu_memory_bytes", shard="s2") == {}  # unknown: absent
    assert one(got, "llmgw_engine_state", engine="llama-server", state="installed") == 1
    assert one(got, "llmgw_engine_state", engine="vllm", state="failed") == 1
    assert one(got, "llmgw_fabric_adapters", fabric="ib0") == 2
    assert one(got, "llmgw_fabric_rate_bits_per_second", fabric="ib0") == 400e9
    assert one(got, "llmgw_model_desired_replicas", model="tiny") == 2
    assert not [name for name, _ in got if name.endswith("_created")]

    # Two seconds later the same sample is 61 s old: every usage figure goes, the
    # inventory's facts and the state stay.
    now[0] += 2.0
    stale = samples(generate_latest(prom).decode())
    names = {name for name, _ in stale}
    assert names == {
        "llmgw_node_state",
        "llmgw_node_cpus",
        "llmgw_gpu_memory_total_bytes",
        "llmgw_gpu_nvlink_peers",
        "llmgw_engine_state",
        "llmgw_fabric_adapters",
        "llmgw_fabric_rate_bits_per_second",
        "llmgw_model_desired_replicas",
    }, names
    assert one(stale, "llmgw_node_cpus", node="gpu-a") == 64


def test_replicas_models_and_hostile_labels() -> None:
    huge = "h" * 10_000_000
    twice = model.Filesystem("/", "ext4", (), 100, 1, False)
    rec_inv = model.Inventory(
        model.Host(huge, cpu_count=None),
        gpus=None,
        # Two filesystems an agent named alike: one series, else Prometheus refuses it all.
        usage=model.Usage(filesystems=(twice, attrs.evolve(twice, free_bytes=2))),
    )
    from llmgw.cp._fleet._registry import NodeRecord

    rec = NodeRecord(
        node_id=huge,
        liveness=core.Liveness(core.NodeState.LOST, 0.0, "silent", 0.0, False),
        generation=1,
        address="x:1",
        agent_version="t",
        inventory=rec_inv,
        shards=(),
        agent=None,
        last_seen_wall=0.0,
    )
    replicas = (
        core.ReplicaView("r1", "tiny", "ready", ("a",), 0.0, False, None),
        core.ReplicaView("r2", "tiny", "timed-out", ("b",), 0.0, False, "slow"),
    )
    catalog = Catalog(
        (
            CatalogModel(
                name="tiny",
                source="hub/tiny",
                replicas=3,
                profiles=[Profile(engine="llama-server")],
            ),
        )
    )
    fams = fleet_families(
        FleetInput(
            [rec],
            now=10.0,
            replicas=replicas,
            unplaced=[Unplaced("big", ("no GPU",))],
            catalog=catalog,
        )
    )
    prom = CollectorRegistry()

    class Fixed:
        def collect(self) -> list[object]:
            return list(fams)

    prom.register(Fixed())  # type: ignore[arg-type]
    text = generate_latest(prom).decode()
    assert len(text) < 10_000
    got = samples(text)
    states = pick(got, "llmgw_node_state")
    assert {dict(k)["node"] for k in states} == {"h" * LABEL_MAX}
    assert one(got, "llmgw_node_state", state="lost") == 1
    assert pick(got, "llmgw_node_cpus") == {}  # nobody said how many
    assert one(got, "llmgw_replica_state", replica="r2", node="b") == 1
    assert dict(next(iter(pick(got, "llmgw_replica_state", replica="r2"))))["state"] == "timed-out"
    assert one(got, "llmgw_model_desired_replicas", model="tiny") == 3
    assert one(got, "llmgw_model_ready_replicas", model="tiny") == 1
    assert one(got, "llmgw_model_unplaced", model="big") == 1
    assert not [n for n, _ in got if n.startswith("llmgw_gpu_")]
    assert list(pick(got, "llmgw_node_disk_free_bytes").values()) == [1]
    assert text.count("llmgw_node_disk_free_bytes{") == 1


USAGE_FAMILIES = {
    "llmgw_node_cpu_utilization_percent": "cpu_util_pct",
    "llmgw_node_memory_total_bytes": "memory_total_bytes",
    "llmgw_node_memory_available_bytes": "memory_available_bytes",
}
maybe_float = st.none() | st.floats(allow_nan=True, allow_infinity=True)


@given(
    cpu=maybe_float,
    total=st.none() | st.integers(0, 1 << 50),
    avail=st.none() | st.integers(0, 1 << 50),
    load1=maybe_float,
    age=st.floats(0, 200),
)
def test_only_what_was_reported_and_fresh_is_exported(
    cpu: float | None, total: int | None, avail: int | None, load1: float | None, age: float
) -> None:
    from llmgw.cp._fleet._registry import NodeRecord

    usage = model.Usage(
        memory_total_bytes=total, memory_available_bytes=avail, load1=load1, cpu_util_pct=cpu
    )
    rec = NodeRecord(
        node_id="n",
        liveness=core.Liveness(core.NodeState.READY, 0.0, "registered", 1000.0 - age, True),
        generation=1,
        address="x:1",
        agent_version="t",
        inventory=model.Inventory(model.Host("n"), usage=usage),
        shards=(),
        agent=None,
        last_seen_wall=0.0,
    )
    got = {
        (fam.name, s.labels.get("window")): s.value
        for fam in fleet_families(FleetInput([rec], now=1000.0))
        for s in fam.samples
    }
    fresh = age <= 60.0

    def expect(value: float | int | None) -> float | None:
        ok = value is not None and fresh and math.isfinite(value)
        return float(value) if ok else None  # type: ignore[arg-type]

    for name, field in USAGE_FAMILIES.items():
        assert got.get((name, None)) == expect(getattr(usage, field))
    assert got.get(("llmgw_node_load", "1m")) == expect(load1)
    used = None if total is None or avail is None else total - avail
    assert got.get(("llmgw_node_memory_used_bytes", None)) == expect(used)
    assert got[("llmgw_node_state", None)] in (0, 1)  # three states, always there


# --- a fleet of real processes --------------------------------------------------------------


def promtool_check_metrics(text: str) -> None:
    promtool = shutil.which("promtool")
    require(promtool is not None, "promtool (Debian's prometheus package) is not installed")
    assert promtool is not None
    res = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_fleet_metrics_of_real_agents(cluster: LocalCluster, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_nvidia_smi.install(bin_dir)
    fake_engine.install(bin_dir, "llama-server")
    cluster.setup(["gpu-1", "old-1"])
    cluster.write_agent_config(
        "gpu-1", engine_paths={"llama-server": str(bin_dir / "llama-server")}
    )
    cluster.start_cp()
    path = f"{bin_dir}:{cluster.env['PATH']}"
    # gpu-1: two H100s, 1 GiB used and 37 % busy on each; old-1: an old driver's L40S,
    # whose rows carry no utilization.gpu: that node reported no GPU utilisation.
    cluster.start_agent(
        "gpu-1",
        env={
            "PATH": path,
            "LLMGW_FAKE_GPUS": "2xh100-80g",
            "LLMGW_FAKE_SMI_MEM_USED_MIB": "1024",
            "LLMGW_FAKE_SMI_UTIL": "37",
        },
    )
    cluster.start_agent(
        "old-1",
        env={"PATH": path, "LLMGW_FAKE_GPUS": "1xl40s-45g", "LLMGW_FAKE_SMI_OLD_DRIVER": "1"},
    )
    cluster.wait_states({"gpu-1": "ready", "old-1": "ready"}, timeout=30)
    out = cluster.ctl(
        "shard", "start", "gpu-1", "--engine", "llama-server", "--model", "/models/tiny.gguf"
    ).stdout
    shard_id = out.split()[0]

    def scrape() -> str:
        r = httpx.get(cluster.admin_url + "/metrics", timeout=5)
        assert r.status_code == 200
        return r.text

    why: list[str] = []

    def settled() -> tuple[str, dict[str, Any]] | None:
        # A scrape between two reads of gpu-1's inventory that agree: one heartbeat's
        # figures (old-1's heartbeats in between change nothing asserted of gpu-1).
        before = cluster.nodes()["gpu-1"]["inventory"]
        text = scrape()
        nodes = cluster.nodes()
        if before != nodes["gpu-1"]["inventory"]:
            why.append("a heartbeat of gpu-1 came between the reads")
            return None
        usage = nodes["gpu-1"]["inventory"]["usage"]
        shard = [s for s in usage["shards"] if s["shard_id"] == shard_id]
        if not shard or shard[0]["rss_bytes"] is None or not usage["gpus"]:
            why.append(f"no shard usage yet: shards {usage['shards']}, gpus {usage['gpus']}")
            return None
        return text, nodes

    try:
        text, nodes = wait_for("a shard's usage in a heartbeat", settled, 60)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the last reasons: {why[-3:]}") from None
    got = samples(text)
    inv = nodes["gpu-1"]["inventory"]
    usage = inv["usage"]
    assert one(got, "llmgw_node_state", node="gpu-1", state="ready") == 1
    assert one(got, "llmgw_node_cpus", node="gpu-1") == inv["host"]["cpu_count"]
    assert one(got, "llmgw_node_memory_total_bytes", node="gpu-1") == usage["memory_total_bytes"]
    assert (
        one(got, "llmgw_node_memory_used_bytes", node="gpu-1")
        == usage["memory_total_bytes"] - usage["memory_available_bytes"]
    )
    assert one(got, "llmgw_node_load", node="gpu-1", window="1m") == usage["load1"]
    fs = usage["filesystems"][0]
    shared = "true" if fs["shared"] else "false"
    assert (
        one(got, "llmgw_node_disk_free_bytes", node="gpu-1", mount=fs["mount"], shared=shared)
        == fs["free_bytes"]
    )
    # The recording's memory.total of an H100 80GB HBM3 is 81559 MiB.
    card = inv["gpus"][1]
    gpu1 = {"node": "gpu-1", "gpu": "1", "uuid": card["uuid"], "class": "h100-80g"}
    assert one(got, "llmgw_gpu_memory_total_bytes", **gpu1) == 81559 * MIB
    assert one(got, "llmgw_gpu_memory_used_bytes", **gpu1) == 1024 * MIB
    assert one(got, "llmgw_gpu_utilization_percent", **gpu1) == 37.0
    assert one(got, "llmgw_gpu_nvlink_peers", **gpu1) == 1
    shard = next(s for s in usage["shards"] if s["shard_id"] == shard_id)
    assert one(got, "llmgw_shard_memory_bytes", node="gpu-1", shard=shard_id) == shard["rss_bytes"]
    if shard["cpu_cores"] is not None:
        assert one(got, "llmgw_shard_cpu_cores", shard=shard_id) == shard["cpu_cores"]
    assert one(got, "llmgw_engine_state", node="gpu-1", engine="llama-server") == 1
    # old-1 has its card, but no utilisation series: nobody measured it.
    assert one(got, "llmgw_gpu_memory_total_bytes", node="old-1") == 46068 * MIB
    assert pick(got, "llmgw_gpu_utilization_percent", node="old-1") == {}
    assert len(pick(got, "llmgw_gpu_utilization_percent")) == 2
    # The router's families are still there, and nothing has a _created series.
    assert "# TYPE llmgw_router_requests_total counter" in text
    assert "_created" not in text
    # docs/metrics.md lists every family the control plane exposes, and every family
    # it lists but the fleet's (which exist only where something was reported) is here.
    exposed = set(re.findall(r"^# TYPE (llmgw_[a-z0-9_]+) ", text, flags=re.M))
    known = documented_metrics()
    assert exposed - known == set(), "undocumented families"
    assert known - set(DOCS) - exposed == set(), "documented but not exposed"
    promtool_check_metrics(text)
