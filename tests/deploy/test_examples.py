"""deploy/examples/ (issue 16): the examples are real.

server.yaml is loaded the way `llmgw-cp` loads its file at start (llmgw/cp/_main.py main():
config.load, then the catalog from the same parsed data, the router settings and the
engines declaration through the control plane's own engine loader), and every model
of its catalog is placed by `llmgw ctl place --dry-run` against a fleet of nodes whose
inventories the agent's own discovery collected from recordings: two H100 nodes built
from the example agent.yaml (its fabric and labels) with the recorded sysfs of an H100
node's InfiniBand adapters (tests/data/sysfs-infiniband-h100-ndr400-plus-bf3-roce-bond)
and eight H100s answered by the fake nvidia-smi, and one CPU node.

The one change to server.yaml is `mirror.dir`, moved under tmp_path where the test puts
the llama-server archive the engines declaration finds at its conventional mirror path
(what an operator puts in /srv/llmgw-mirror); the test asserts that is the only line
that differs. Of main()'s checks only the TLS files' is left out (the example's PKI in
/etc/llmgw/pki is not on this machine); router.workers is 1, so its checks have nothing
to refuse."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import trio
from helpers import FIXTURES, REPO, register

from llmgw import config, model
from llmgw.agent.discovery import SubprocessRunner, collect_inventory
from llmgw.cp._admin import AdminApp
from llmgw.cp._assembly import policy
from llmgw.cp._fleet import _catalog, _catalog_file, _engines
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._reconciler import Reconciler, Unplaced
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._main import load_server
from llmgw.errors import ConfigError
from llmgw.router import RouterConfig
from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.cluster import free_port

EXAMPLES = REPO / "deploy" / "examples"
MIRROR = "/srv/llmgw-mirror"
LLAMA_ARCHIVE = "engines/llama-server/b11434/llama-b11434-bin-cpu-x86_64.tar.gz"
MODELS = ["qwen2.5-32b", "llama3.1-8b", "qwen2.5-1.5b-cpu", "llama3.1-405b-fp8"]
H100_RAILS = ("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9")


@attrs.frozen
class Loaded:
    path: Path
    cfg: config.ServerConfig
    catalog: CatalogFile
    router: RouterConfig


def server_yaml(tmp: Path) -> Path:
    """The example, its mirror.dir under tmp holding the llama-server archive."""
    text = (EXAMPLES / "server.yaml").read_text()
    mirror = tmp / "mirror"
    (mirror / LLAMA_ARCHIVE).parent.mkdir(parents=True)
    (mirror / LLAMA_ARCHIVE).write_bytes(b"a llama.cpp release archive")
    moved = text.replace(f"dir: {MIRROR}\n", f"dir: {mirror}\n")
    changed = [(a, b) for a, b in zip(text.splitlines(), moved.splitlines(), strict=True) if a != b]
    assert changed == [(f"  dir: {MIRROR}", f"  dir: {mirror}")]
    path = tmp / "server.yaml"
    path.write_text(moved)
    return path


def load_like_llmgw_cp(path: Path) -> Loaded:
    """llmgw-cp's own loading (llmgw/cp/_main.py load_server, which main() calls), up to
    starting the service; the TLS files are the example machine's, not this one's."""
    cfg, catalog, router, _hashes = load_server(path, check_tls=False)
    return Loaded(path, cfg, catalog, router)


def test_server_example_loads_as_llmgw_cp_loads_it(tmp_path: Path) -> None:
    loaded = load_like_llmgw_cp(server_yaml(tmp_path))
    cfg = loaded.cfg
    assert cfg.tls.ca == Path("/etc/llmgw/pki/ca.crt")
    assert (cfg.state_dir, cfg.store) == (Path("/var/lib/llmgw"), None)
    assert cfg.mirror.dir == tmp_path / "mirror" and cfg.mirror.tls is True
    assert [(b.name, b.rank) for b in loaded.router.bands] == [("interactive", 0), ("batch", 1)]
    assert (loaded.router.policy, loaded.router.affinity_header) == ("prefix", "x-session-id")
    engines = loaded.catalog.engines
    assert engines is not None
    assert {e.name: e.version for e in engines.engines} == {
        "llama-server": "b11434",
        "sglang": "0.4.9.post2",
        "vllm": "0.9.2",
    }
    assert _engines.describe(engines).startswith(
        "llama-server b11434 (cpu-x86_64), sglang 0.4.9.post2, vllm 0.9.2 ["
    )
    models = {m.name: m for m in loaded.catalog.catalog.models}
    assert list(models) == MODELS
    shapes = {
        name: [(p.engine, p.gpu_class, p.cards, p.nodes, p.tensor_parallel, p.pp)
               for p in m.profiles]
        for name, m in models.items()
    }  # fmt: skip
    assert shapes == {
        "qwen2.5-32b": [("vllm", "h100-80g", 2, 1, 2, 1)],
        "llama3.1-8b": [("sglang", "h100-80g", 1, 1, 1, 1)],
        "qwen2.5-1.5b-cpu": [("llama-server", None, 0, 1, 1, 1)],
        "llama3.1-405b-fp8": [("vllm", "h100-80g", 8, 2, 8, 2)],
    }
    ray = models["llama3.1-405b-fp8"].profiles[0]
    assert (ray.multinode, ray.fabric, ray.quantization) == ("ray", "ib-a", "fp8")


def test_every_example_profile_passes_validation() -> None:
    """Each profile alone, through the catalog's validation and the engines' own."""
    data = _catalog_file.read_data(EXAMPLES / "server.yaml")
    count = 0
    for m in data["models"]:
        for p in m["profiles"]:
            one = {"models": [{**m, "profiles": [p]}]}
            parsed = _catalog.parse(one, "server.yaml")
            assert [x.name for x in parsed.models] == [m["name"]]
            count += 1
    assert count == 4


def test_validation_would_refuse_a_broken_example() -> None:
    """The check above is not vacuous: the same path refuses a wrong profile."""
    data = _catalog_file.read_data(EXAMPLES / "server.yaml")
    data["models"][3]["profiles"][0]["multinode"] = "mpi"
    try:
        _catalog.parse(data, "server.yaml")
    except ConfigError as exc:
        assert "models[3].profiles[0].multinode: 'mpi': use ray or native" in str(exc)
    else:
        raise AssertionError("a multinode of 'mpi' was accepted")


def test_agent_example_loads() -> None:
    cfg = config.load(EXAMPLES / "agent.yaml", config.AgentConfig)
    assert cfg.addresses == [("cp1.example.net", 7070), ("cp2.example.net", 7070)]
    assert cfg.labels == {"pool": "gpu", "zone": "eu-west-1a"}
    assert {n: (tuple(f.adapters), f.interface) for n, f in cfg.fabrics.items()} == {
        "ib-a": (H100_RAILS, "ib0")
    }
    assert cfg.weights_dir == Path("/var/lib/llmgw-weights")
    assert cfg.engine_paths == {} and cfg.sglang_python is None  # commented out


# --- the example catalog placed on a recorded fleet ------------------------------------


def fake_engines(tmp: Path) -> tuple[dict[str, str], str]:
    """vLLM and llama-server stand-ins, and a Python that imports a stand-in sglang."""
    bin_dir = tmp / "bin"
    paths = {name: str(fake_engine.install(bin_dir, name)) for name in ("vllm", "llama-server")}
    site = tmp / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    python = bin_dir / "sglang-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return paths, str(python)


def node_root(tmp: Path, name: str, *, rdma: bool) -> Path:
    """/proc, /etc and /sys as discovery reads them; the adapters from the recording."""
    root = tmp / name
    (root / "proc").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "proc" / "meminfo").write_text("MemTotal: 2113389772 kB\nMemAvailable: 2010000000 kB\n")
    (root / "proc" / "loadavg").write_text("0.50 0.40 0.30 1/900 4242\n")
    shutil.copy(FIXTURES / "osrelease-rhel-9.6.txt", root / "etc" / "os-release")
    if rdma:
        shutil.copytree(
            FIXTURES / "sysfs-infiniband-h100-ndr400-plus-bf3-roce-bond",
            root / "sys" / "class" / "infiniband",
        )
    return root


def inventory(tmp: Path, node: str, agent: config.AgentConfig, gpus: str) -> model.Inventory:
    engine_paths, sglang_python = fake_engines(tmp)
    smi = tmp / "smi"
    fake_nvidia_smi.install(smi)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_FAKE_")}
    # No NICs in the fake `topo -m`: its mlx5_0..N would not be the recorded adapters'
    # names, so each rank gets every rail of the fabric (distance unknown).
    env.update(PATH=f"{smi}{os.pathsep}{env['PATH']}", LLMGW_FAKE_GPUS=gpus)
    weights = tmp / f"{node}-weights"
    weights.mkdir()
    inv = collect_inventory(
        root=node_root(tmp, node, rdma=bool(agent.fabrics)),
        runner=SubprocessRunner(env=env),
        weights_dir=weights,
        fabrics={name: f.adapters for name, f in agent.fabrics.items()},
        fabric_interfaces={n: f.interface for n, f in agent.fabrics.items() if f.interface},
        sglang_python=sglang_python,
        engine_paths=engine_paths,
        nvml=None,
        hostname=node,
    )
    labels = tuple(model.Label(k, v) for k, v in sorted(agent.labels.items()))
    return attrs.evolve(inv, labels=labels)  # as the agent adds them (llmgw/agent/_node.py)


async def ctl(url: str, key: str, *args: str) -> tuple[int, str]:
    env = {**os.environ, "LLMGW_ADMIN_URL": url, "LLMGW_ADMIN_KEY": key}
    done = await trio.run_process(
        [sys.executable, "-m", "llmgw", "ctl", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )
    return done.returncode, done.stdout.decode() + done.stderr.decode()


async def test_ctl_place_dry_run_places_every_example_model_on_a_recorded_fleet(
    tmp_path: Path,
) -> None:
    loaded = await trio.to_thread.run_sync(load_like_llmgw_cp, server_yaml(tmp_path))
    gpu_agent = config.load(EXAMPLES / "agent.yaml", config.AgentConfig)
    cpu_agent = attrs.evolve(gpu_agent, labels={"pool": "cpu"}, fabrics={})
    fleet = {
        "gpu-1": inventory(tmp_path / "gpu-1", "gpu-1", gpu_agent, "8xh100-80g"),
        "gpu-2": inventory(tmp_path / "gpu-2", "gpu-2", gpu_agent, "8xh100-80g"),
        "cpu-1": inventory(tmp_path / "cpu-1", "cpu-1", cpu_agent, "0"),
    }
    # What discovery found, before placement is asked anything of it.
    for node in ("gpu-1", "gpu-2"):
        inv = fleet[node]
        assert inv.gpus is not None and [g.gpu_class for g in inv.gpus] == ["h100-80g"] * 8
        assert inv.fabrics == (model.Fabric("ib-a", H100_RAILS, 400.0, "ib0"),)
    assert fleet["cpu-1"].gpus == () and fleet["cpu-1"].fabrics == ()
    for inv in fleet.values():
        assert inv.engines is not None
        assert {e.name for e in inv.engines.found} == {"vllm", "llama-server", "sglang"}

    cfg = loaded.cfg
    registry = NodeRegistry(
        policy(cfg), forget_after_s=cfg.forget_after_s, engines=loaded.catalog.engines
    )
    for node, inv in fleet.items():
        await register(registry, node, inventory=inv)
    reconciler = Reconciler(registry, lambda: loaded.catalog.catalog)
    app = AdminApp(registry, "admin-key", reconciler=reconciler, catalog=loaded.catalog)
    hc = hypercorn.config.Config()
    port = free_port()
    hc.bind = [f"127.0.0.1:{port}"]
    hc.accesslog = None
    hc.graceful_timeout = 0.5
    url = f"http://127.0.0.1:{port}"
    answers: dict[str, tuple[int, str]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(hypercorn.trio.serve, app, hc)
        with trio.fail_after(120):
            for name in MODELS:
                answers[name] = await ctl(url, "admin-key", "place", name, "--dry-run")
            answers["wrong key"] = await ctl(url, "not-the-key", "place", MODELS[0], "--dry-run")
        nursery.cancel_scope.cancel()

    for name in MODELS:
        assert answers[name][0] == 0, f"{name}: {answers[name][1]}"
    lines = {name: answers[name][1].splitlines() for name in MODELS}
    assert lines["qwen2.5-32b"][0] == "qwen2.5-32b: would place with vllm"
    assert len(lines["qwen2.5-32b"]) == 2 and " gpus 0,1" in lines["qwen2.5-32b"][1]
    assert lines["llama3.1-8b"][0] == "llama3.1-8b: would place with sglang"
    assert lines["qwen2.5-1.5b-cpu"] == [
        "qwen2.5-1.5b-cpu: would place with llama-server",
        "  rank 0: cpu-1 gpus cpu",
    ]
    ray = lines["llama3.1-405b-fp8"]
    assert ray[0] == "llama3.1-405b-fp8: would place with vllm over fabric ib-a"
    assert sorted(line.split()[2] for line in ray[1:]) == ["gpu-1", "gpu-2"]
    for rank in ray[1:]:
        assert rank.endswith(" gpus 0,1,2,3,4,5,6,7 " + ",".join(H100_RAILS)), rank
    assert answers["wrong key"][0] != 0 and "refused the admin key (401)" in answers["wrong key"][1]


class StartingAgent:
    """A node's capability that records the shards it is asked to start (each starting)."""

    def __init__(self) -> None:
        self.started: list[model.ShardSpec] = []

    async def start_shard(self, epoch: int, spec: model.ShardSpec) -> model.ShardReport:
        self.started.append(spec)
        return model.ShardReport(spec.shard_id, spec.model, spec.engine, "starting")

    def release(self) -> None:
        pass


async def test_the_fabrics_interface_reaches_the_two_node_engines_environment(
    tmp_path: Path,
) -> None:
    """agent.yaml's `fabrics.ib-a.interface: ib0` travels with the fabric in the node's
    inventory, and the reconciler's start of the two-node Ray model tells NCCL and Gloo
    to bootstrap over it on both ranks, beside the fabric's adapters."""
    loaded = await trio.to_thread.run_sync(load_like_llmgw_cp, server_yaml(tmp_path))
    gpu_agent = config.load(EXAMPLES / "agent.yaml", config.AgentConfig)
    assert gpu_agent.fabrics["ib-a"].interface == "ib0"
    registry = NodeRegistry(
        policy(loaded.cfg),
        forget_after_s=loaded.cfg.forget_after_s,
        engines=loaded.catalog.engines,
    )
    # Both probed before either registers: a probe takes seconds, and a node registered
    # first would miss heartbeats meanwhile.
    fleet = {n: inventory(tmp_path / n, n, gpu_agent, "8xh100-80g") for n in ("gpu-1", "gpu-2")}
    agents = {node: StartingAgent() for node in fleet}
    for node, inv in fleet.items():
        await register(registry, node, inventory=inv, agent=agents[node])  # type: ignore[arg-type]
    ray = loaded.catalog.catalog.model("llama3.1-405b-fp8")
    assert ray is not None
    only_ray = _catalog.Catalog((ray,))
    reconciler = Reconciler(registry, lambda: only_ray, interval_s=0.05, settle_s=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await nursery.start(reconciler.run)
        with trio.fail_after(60):
            while not all(a.started for a in agents.values()):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    for node, agent in agents.items():
        spec = agent.started[0]  # the registry hears of no shard here: later passes start again
        assert (spec.rank, spec.ranks) == ((0, 2) if spec.rank == 0 else (1, 2)), spec
        env = {e.name: e.value for p in spec.processes for e in p.env}
        assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("=ib0", "ib0"), node
        assert env["NCCL_IB_HCA"] == "=" + ",".join(H100_RAILS), node


async def test_the_recorded_fleet_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    """Placement on this fleet is not vacuous: without the fabric the Ray model is refused
    with the nodes' reasons, and the CPU model has nowhere to go without its CPU node."""
    loaded = await trio.to_thread.run_sync(load_like_llmgw_cp, server_yaml(tmp_path))
    gpu_agent = attrs.evolve(config.load(EXAMPLES / "agent.yaml", config.AgentConfig), fabrics={})
    registry = NodeRegistry(policy(loaded.cfg), engines=loaded.catalog.engines)
    for node in ("gpu-1", "gpu-2"):
        inv = inventory(tmp_path / node, node, gpu_agent, "8xh100-80g")
        await register(registry, node, inventory=inv)
    reconciler = Reconciler(registry, lambda: loaded.catalog.catalog)
    models = {m.name: m for m in loaded.catalog.catalog.models}
    found: dict[str, Any] = {name: reconciler.try_place(models[name]) for name in MODELS}
    ray = found["llama3.1-405b-fp8"]
    assert isinstance(ray, Unplaced), ray
    assert ray.reasons == (
        "ib-a: no node with an ACTIVE port, needs 2",
        "gpu-1, gpu-2: no ACTIVE port on ib-a",
    )
    cpu = found["qwen2.5-1.5b-cpu"]
    assert isinstance(cpu, Unplaced), cpu
    assert cpu.reasons == ("gpu-1, gpu-2: labels do not match pool=cpu",)
    assert not isinstance(found["qwen2.5-32b"], Unplaced)  # the rest still fit
    assert not isinstance(found["llama3.1-8b"], Unplaced)
