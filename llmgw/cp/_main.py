"""`llmgw-cp`: the control plane process: its command line, server.yaml read once
(`load_server`), its stores opened; llmgw/cp/_assembly.py builds and starts the rest."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial
from pathlib import Path

import trio

from llmgw import config
from llmgw._process import run_service, setup_logging
from llmgw.cp._assembly import run
from llmgw.cp._fleet import _catalog, _catalog_file, _engines
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._weights._mirror import ManifestCache
from llmgw.cp._workers import SOCKET_NAME
from llmgw.errors import ConfigError
from llmgw.router import RouterConfig
from llmgw.store import SqlStore, open_store, store_location

log = logging.getLogger("llmgw.cp")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["init"]:  # `llmgw-cp init --postgres`: llmgw/cp/_init_pg.py
        from llmgw.cp._init_pg import main as init_main

        return init_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="llmgw-cp",
        description="the llmgw control plane (and `llmgw-cp init --postgres`: see its --help)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=Path(os.environ.get("LLMGW_SERVER_CONFIG", "/etc/llmgw/server.yaml")),
        help="server.yaml (default: $LLMGW_SERVER_CONFIG or /etc/llmgw/server.yaml)",
    )
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        loaded = load_server(args.config)
    except ConfigError as exc:
        print(f"llmgw-cp: {exc}", file=sys.stderr)
        return 2
    cfg, catalog, router_cfg, hashes = loaded
    return run_service(
        "llmgw-cp",
        lambda: serve(cfg, catalog, router_cfg, log_level=args.log_level, hashes=hashes),
    )


async def open_configured_store(cfg: config.ServerConfig, source: str = "server.yaml") -> SqlStore:
    """The store server.yaml names (SQLite in state_dir when it names none), migrated."""
    return await open_store(store_location(cfg.store, cfg.state_dir, source))


def load_server(
    path: Path, *, check_tls: bool = True
) -> tuple[config.ServerConfig, CatalogFile, RouterConfig, ManifestCache]:
    """server.yaml as llmgw-cp reads it at start, catalog and engines included: the
    config, the catalog, the router's settings and the mirror's hash cache (whose sha256
    of the engine archives the mirror then serves without reading them again).
    ConfigError names what is wrong. `check_tls`: whether the TLS files must exist
    (False only to check an example written for another machine)."""
    data = _catalog_file.read_data(path)  # read once: the settings, the catalog, the engines
    cfg = config.structure(data, config.ServerConfig, str(path))
    models = _catalog.parse(data, str(path))
    router_cfg = config.structure(cfg.router, RouterConfig, str(path), at="router")
    if router_cfg.workers > 1 and cfg.router_listen is None:
        raise ConfigError(
            f"{path}: router.workers: {router_cfg.workers}, but router_listen is "
            "null: workers serve router_listen (set it, or set router.workers to 1)"
        )
    sock = cfg.state_dir / SOCKET_NAME
    if router_cfg.workers > 1 and len(os.fsencode(sock)) > 107:
        raise ConfigError(
            f"{path}: router.workers: {router_cfg.workers}: the workers' socket "
            f"{sock} is longer than a Unix socket path may be (107 bytes): shorten state_dir"
        )
    # Before anything starts: a missing file is named by its key, not only its path.
    if check_tls:
        config.check_tls_files(cfg.tls, path)
    config.check_mirror_dir(cfg.mirror, path)
    hashes = ManifestCache()
    load_engines = engine_loader(cfg, path, hashes)
    catalog = CatalogFile(path, models, trio.run(load_engines, data), load_engines)
    return cfg, catalog, router_cfg, hashes


def engine_loader(
    cfg: config.ServerConfig, path: Path, hashes: ManifestCache
) -> _catalog_file.EngineLoader:
    """server.yaml's data -> its engine declaration, with this file's mirror and hashes."""
    return partial(_engines.load, source=str(path), mirror_dir=cfg.mirror.dir, hasher=hashes.sha256)


async def serve(
    cfg: config.ServerConfig,
    catalog: CatalogFile,
    router_cfg: RouterConfig | None = None,
    *,
    log_level: str | None = None,
    hashes: ManifestCache | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    store = await open_configured_store(cfg)
    lease_store: SqlStore | None = None
    try:
        # The lease on a connection of its own: a renewal never waits behind key lookups.
        lease_store = await open_configured_store(cfg)
        await run(
            cfg,
            catalog,
            store,
            router_cfg,
            log_level=log_level,
            hashes=hashes,
            lease_store=lease_store,
            task_status=task_status,
        )
    finally:
        with trio.CancelScope(shield=True):
            if lease_store is not None:
                await lease_store.aclose()
            await store.aclose()
