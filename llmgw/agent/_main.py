"""`llmgw-agent`: the node agent process, and `llmgw-agent inventory`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
from pathlib import Path

import trio

from llmgw import config, model
from llmgw._process import run_service, setup_logging
from llmgw.agent import _install, _logs
from llmgw.agent._engines import Installer, PipTls, Placement
from llmgw.agent._fetch import Fetcher
from llmgw.agent._node import Node
from llmgw.agent._servant import AgentServant
from llmgw.agent._session import AgentSession, Backoff
from llmgw.agent._sources import ControlPlane, Sources
from llmgw.agent._supervisor import HealthPolicy, Supervisor
from llmgw.errors import ConfigError
from llmgw.host import packages
from llmgw.rpc import CapnpThread, check_certificates, client_tls_context

log = logging.getLogger("llmgw.agent")

DEFAULT_CONFIG = "/etc/llmgw/agent.yaml"
EPOCH_FILE = "epoch"  # in state_dir: the newest leader epoch seen (llmgw/agent/_servant.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw-agent", description="the llmgw node agent")
    parser.add_argument("--log-level", default=None)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the agent (the default)")
    inv = sub.add_parser("inventory", help="print what the control plane would see of this node")
    inv.add_argument("--json", action="store_true", help="machine-readable output")
    _install.register(sub)
    for p in (parser, run, inv):
        p.add_argument(
            "--config",
            type=Path,
            default=argparse.SUPPRESS,
            help=f"agent.yaml (default: $LLMGW_AGENT_CONFIG or {DEFAULT_CONFIG})",
        )
    args = parser.parse_args(argv)
    setup_logging(args.log_level or ("WARNING" if args.command == "inventory" else None))
    if args.command == "install":
        return _install.run(args)
    path = getattr(args, "config", None)
    if args.command == "inventory":
        return _inventory(path, args.json)
    try:
        cfg = load_config(path or Path(os.environ.get("LLMGW_AGENT_CONFIG", DEFAULT_CONFIG)))
    except ConfigError as exc:
        print(f"llmgw-agent: {exc}", file=sys.stderr)
        return 2
    return run_service("llmgw-agent", lambda: serve(cfg))


def load_config(path: Path) -> config.AgentConfig:
    cfg = config.load(path, config.AgentConfig)
    if not cfg.addresses:
        raise ConfigError(f"{path}: servers: name at least one control plane (host:port)")
    # Before anything starts: a missing file is named by its key, not only its path.
    config.check_tls_files(cfg.tls, path)
    return cfg


def _inventory(path: Path | None, as_json: bool) -> int:
    """Without a config file, discovery runs with defaults (no model dirs, no fabrics)."""
    env = os.environ.get("LLMGW_AGENT_CONFIG")
    try:
        if path is None and env:
            path = Path(env)
        cfg = config.load(path, config.AgentConfig) if path is not None else None
    except ConfigError as exc:
        print(f"llmgw-agent: {exc}", file=sys.stderr)
        return 2
    node = Node(cfg)
    inventory = node.collect_inventory()
    if as_json:
        print(json.dumps(node.inventory_json(inventory), indent=2))
    else:
        print(node.format_inventory(inventory))
    return 0


def make_weights_dir(cfg: config.AgentConfig) -> None:
    """Created at start, parents too: disk free is known from the first heartbeat."""
    try:
        cfg.weights_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"weights_dir {cfg.weights_dir}: cannot be created ({exc.strerror or exc}); "
            "name a directory this agent may write in agent.yaml"
        ) from None


async def serve(cfg: config.AgentConfig) -> None:
    check_certificates(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
    tls = client_tls_context(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
    make_weights_dir(cfg)
    # Its own last lines, as written to stderr, for `logs` on the source "agent".
    memory = _logs.install()
    # What the node reports of the installer and the supervisor, both built below and
    # read only once the session runs.
    node = Node(
        cfg,
        installed_engines=lambda: model.Engines(installer.found(), installer.pending()),
        llmgw_pids=lambda: supervisor.pids(),
        shard_pids=lambda: supervisor.shard_pids(),
    )
    session: AgentSession | None = None

    def on_shard_change(report: model.ShardReport) -> None:
        if session is not None:
            session.notify_shard(report)

    def on_progress(progress: model.Progress) -> None:
        if session is not None:
            session.notify_progress(progress)

    def control_plane() -> ControlPlane | None:
        known = session.control_plane if session is not None else None
        return ControlPlane(*known) if known is not None else None

    def on_fetch_progress(name: str, done: int, total: int | None) -> None:
        sources.progress(name, done, total)  # a shard's source
        installer.progress(name, done, total)  # an engine's archive

    fetcher = Fetcher(
        cfg.weights_dir,
        max_concurrent=cfg.max_concurrent_fetches,
        progress=on_fetch_progress,
    )
    sources = Sources(
        fetcher,
        node_id=cfg.node_id,
        control_plane=control_plane,
        client_tls=tls,
        on_fetched=node.rescan_weights,
        notify_progress=on_progress,
    )

    installer = Installer(
        cfg.state_dir,
        fetcher=fetcher,
        placement=lambda: placement(node.hardware),
        control_plane=control_plane,
        client_tls=tls,
        pip_tls=PipTls(cfg.tls.ca, cfg.tls.cert, cfg.tls.key),
    )

    engine_paths = _engine_paths(cfg)
    supervisor = Supervisor(
        cfg.state_dir,
        on_change=on_shard_change,
        engine_paths=engine_paths,
        grace_s=cfg.stop_grace_s,
        health=HealthPolicy(
            interval_s=cfg.health_interval_s,
            timeout_s=cfg.health_timeout_s,
            failures=cfg.health_failures,
            probe_interval_s=cfg.generation_probe_interval_s,
            probe_timeout_s=cfg.generation_probe_timeout_s,
        ),
        failed_kept=cfg.failed_shards_kept,
        node_id=cfg.node_id,
        sources=sources,
        path_of=installer.path_of,
    )
    servant = AgentServant(
        node,
        supervisor,
        engine_paths=engine_paths,
        in_flight=fetcher.in_flight,
        declare=installer.declare,
        path_of=installer.path_of,
        memory=memory,
        epoch_path=cfg.state_dir / EPOCH_FILE,
        sources=sources,
    )

    def on_registered(settings: model.Settings) -> None:
        servant.saw_epoch(settings.epoch)  # kept: a restart still refuses an older leader
        installer.declare(settings.engines)

    session = AgentSession(
        node_id=cfg.node_id,
        addresses=cfg.addresses,
        tls=tls,
        servant=servant,
        hello_inventory=node.hello_inventory,
        heartbeat=node.heartbeat,
        shards=supervisor.reports,
        backoff=Backoff(cfg.reconnect_initial_s, cfg.reconnect_max_s),
        cert_path=cfg.tls.cert,
        on_registered=on_registered,
    )
    log.info(
        "agent %s starting; control planes: %s",
        cfg.node_id,
        ", ".join(f"{h}:{p}" for h, p in cfg.addresses),
    )
    async with CapnpThread.open() as bridge, trio.open_nursery() as nursery:
        # Adopt surviving engines before registering: the hello reports them,
        # and discovery must know their pids to tell whose GPU memory is whose.
        await nursery.start(fetcher.run)
        await nursery.start(supervisor.run)
        await nursery.start(servant.run)
        # Once per process: every reconnect registers with what is known.
        await node.discover()
        # After discovery: the variant and the package family come from the hardware.
        await nursery.start(installer.run)
        nursery.start_soon(node.sample_forever)
        nursery.start_soon(node.watch_nvml_faults)
        await session.run(bridge)


def placement(hardware: model.Inventory | None) -> Placement:
    """What the installer chooses by: the architecture, an NVIDIA driver, the OS family."""
    host = hardware.host if hardware is not None else None
    arch = (host.arch if host is not None else None) or platform.machine() or None
    nvidia = bool(host is not None and host.driver_version) or bool(
        hardware is not None and hardware.gpus
    )
    family = packages.family(host.os_id, host.os_like) if host is not None else None
    return Placement(arch=arch, nvidia=nvidia, family=family)


def _engine_paths(cfg: config.AgentConfig) -> dict[str, str]:
    paths = dict(cfg.engine_paths)
    if cfg.sglang_python:
        paths.setdefault("python3", cfg.sglang_python)
    return paths
