"""`llmgw ctl`: the operator's CLI. Talks to the admin JSON API; `cert` works offline."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from llmgw import config
from llmgw.ctl import _cert
from llmgw.errors import ConfigError, LlmgwError

DEFAULT_CTL_CONFIG = Path("~/.config/llmgw/ctl.yaml")


class CtlError(LlmgwError):
    """One clear line for the operator; exit code 1."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw ctl", description="operate an llmgw fleet")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="ctl.yaml with admin_url and admin_key (default: $LLMGW_CTL_CONFIG or "
        f"{DEFAULT_CTL_CONFIG}); $LLMGW_ADMIN_URL and $LLMGW_ADMIN_KEY win over it",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    nodes = sub.add_parser("nodes", help="list the nodes and their state")
    nodes.add_argument("--json", action="store_true", help="the API's JSON, as is")
    nodes.set_defaults(func=_nodes)
    _cert.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"llmgw ctl: {exc}", file=sys.stderr)
        return 2
    except LlmgwError as exc:
        print(f"llmgw ctl: {exc}", file=sys.stderr)
        return 1


def _settings(args: argparse.Namespace) -> tuple[str, str]:
    path = args.config or Path(os.environ.get("LLMGW_CTL_CONFIG", str(DEFAULT_CTL_CONFIG)))
    path = path.expanduser()
    cfg = config.CtlConfig()
    if path.exists() or args.config is not None:
        cfg = config.load(path, config.CtlConfig)
    url = os.environ.get("LLMGW_ADMIN_URL") or cfg.admin_url
    key = os.environ.get("LLMGW_ADMIN_KEY") or cfg.admin_key
    if not key and cfg.admin_key_file is not None:
        try:
            key = cfg.admin_key_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{path}: admin_key_file: {exc.strerror or exc}") from None
    if not key:
        raise ConfigError(
            "no admin key: set LLMGW_ADMIN_KEY (the control plane wrote the first one to "
            "admin.key in its state directory) or admin_key in " + str(path)
        )
    return url.rstrip("/"), key


def api_get(args: argparse.Namespace, route: str) -> Any:
    url, key = _settings(args)
    try:
        response = httpx.get(url + route, headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
    except httpx.ConnectError:
        raise CtlError(f"cannot reach the control plane at {url} (connection refused)") from None
    except httpx.TimeoutException:
        raise CtlError(f"the control plane at {url} did not answer within 10 s") from None
    except httpx.HTTPError as exc:
        raise CtlError(f"cannot talk to the control plane at {url}: {exc}") from None
    if response.status_code == 401:
        raise CtlError(f"the control plane at {url} refused the admin key (401)")
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:200]
        raise CtlError(f"{route}: {response.status_code}: {message}")
    return response.json()


def _nodes(args: argparse.Namespace) -> int:
    data = api_get(args, "/api/v1/nodes")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_nodes(data["nodes"], now=time.time()))
    return 0


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.0f}"


def format_nodes(nodes: list[dict[str, Any]], *, now: float) -> str:
    """A table; every unknown is `-`, never 0."""
    header = ("NODE", "STATE", "SINCE", "LAST SEEN", "CPUS", "MEM GiB used/total", "REASON")
    rows = [header]
    for n in nodes:
        inv = n.get("inventory") or {}
        usage = inv.get("usage") or {}
        host = inv.get("host") or {}
        total, avail = usage.get("memory_total_bytes"), usage.get("memory_available_bytes")
        used = total - avail if total is not None and avail is not None else None
        mem = f"{_gib(used)}/{_gib(total)}"
        cpus = host.get("cpu_count")
        rows.append(
            (
                n["node_id"],
                n["state"],
                _age(now - n["since"]),
                _age(None if n.get("last_seen") is None else now - n["last_seen"]),
                "-" if cpus is None else str(cpus),
                mem,
                n.get("state_reason") or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
