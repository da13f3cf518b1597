"""`llmgw ctl adapters [NAME]`: each LoRA adapter of the catalog, the replicas that hold
it, a load in flight, its demand, when it was last used, and the leader's loads,
evictions and failures (the admin API's /api/v1/adapters)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from llmgw.ctl._client import api
from llmgw.ctl._tables import age, num, table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "adapters",
        help="LoRA adapters: where each is loaded, last use, loads and evictions",
        description="A LoRA adapter (server.yaml `adapters:`) is served on its base model's "
        "replicas. The leader loads it on one when requests wait for it, evicting that "
        "replica's least recently used adapter when it is full. Shows, for each adapter "
        "(or NAME), the replicas holding it, a load in flight, requests waiting and in "
        "flight, its last use and the leader's counts since it was elected.",
    )
    p.add_argument("name", nargs="?", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=show)


def show(args: argparse.Namespace) -> int:
    if args.name is None:
        rows = api(args, "GET", "/api/v1/adapters")["adapters"]
    else:
        rows = [api(args, "GET", f"/api/v1/adapters/{args.name}")]
    if args.json:
        print(json.dumps(rows if args.name is None else rows[0], indent=2))
        return 0
    print(format_adapters(rows, now=time.time()) if rows else "no adapters in the catalog")
    return 0


def format_adapters(rows: list[dict[str, Any]], *, now: float) -> str:
    header = ("ADAPTER", "BASE", "LOADED ON", "LOADING", "QUEUED", "IN FLIGHT", "DRAW",
              "LAST USED", "LOADS", "EVICTIONS", "FAILURES")  # fmt: skip
    lines = []
    errors = []
    for r in rows:
        held = ", ".join(f"{h['replica']}@{h['node']}" for h in r["held_by"]) or "-"
        last = r["last_used"]
        lines.append(
            (
                r["name"],
                r["base"],
                held,
                ", ".join(r["loading_on"]) or "-",
                num(r["queued"]),
                num(r["in_flight"]),
                "-" if r.get("draw") is None else f"{r['draw']:.1f}",
                "-" if last is None else f"{age(now - last)} ago",
                str(r["loads"]),
                str(r["evictions"]),
                str(r["failures"]),
            )
        )
        if r["last_error"]:
            errors.append(f"{r['name']}: last failure {r['last_error']}")
    return "\n".join([table(header, lines), *errors])
