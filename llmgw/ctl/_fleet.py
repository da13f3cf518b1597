"""`llmgw ctl` on the fleet's machines: nodes, cordon, drain, shards by hand, logs, engine-check.

Each command takes the parsed arguments (their flags are in `_args`), asks the
admin API, prints, and returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from urllib.parse import quote, urlencode

from llmgw.ctl._client import CtlError, api, api_get, follow, settings
from llmgw.ctl._tables import format_nodes


def nodes(args: argparse.Namespace) -> int:
    data = api_get(args, "/api/v1/nodes")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_nodes(data["nodes"], now=time.time()))
    return 0


def nodes_forget(args: argparse.Namespace) -> int:
    data = api(args, "DELETE", f"/api/v1/nodes/{args.node}")
    print(f"{args.node} forgotten (it was {data['was']}): it no longer counts in the fleet")
    return 0


def cordon(args: argparse.Namespace) -> int:
    body = {"reason": args.reason} if args.reason else {}
    api(args, "POST", f"/api/v1/nodes/{args.node}/cordon", body)
    print(f"{args.node} cordoned: nothing new is placed there")
    return 0


def uncordon(args: argparse.Namespace) -> int:
    data = api(args, "DELETE", f"/api/v1/nodes/{args.node}/cordon")
    lifted = " and ".join(data.get("lifted") or ["cordon"])
    print(f"{args.node} uncordoned ({lifted} lifted): placement may use it again")
    return 0


def drain(args: argparse.Namespace) -> int:
    body = {"reason": args.reason} if args.reason else {}
    api(args, "POST", f"/api/v1/nodes/{args.node}/drain", body)
    print(
        f"{args.node} draining: its replicas are replaced elsewhere, then stopped there; "
        f"`llmgw ctl nodes` shows it drained once nothing runs there"
    )
    return 0


def shard_start(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"engine": args.engine, "model": args.model, "args": args.extra}
    for key in ("port", "gpus", "served_name"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    data = api(args, "POST", f"/api/v1/nodes/{args.node}/shards", body)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        shard = data["shard"]
        print(f"{shard['shard_id']}  {shard['state']}  port {shard['port']}  on {args.node}")
    return 0


def shard_stop(args: argparse.Namespace) -> int:
    grace = f"?grace={args.grace:g}" if args.grace else ""
    api(args, "DELETE", f"/api/v1/nodes/{args.node}/shards/{args.shard}{grace}")
    print(f"{args.shard} stopped on {args.node}")
    return 0


def shard_logs(args: argparse.Namespace) -> int:
    data = api(
        args, "GET", f"/api/v1/nodes/{args.node}/shards/{args.shard}/logs?lines={args.lines}"
    )
    for line in data["lines"]:
        print(f"{line['source']}: {line['text']}")
    return 0


def node_logs(args: argparse.Namespace) -> int:
    node = quote(args.node, safe="")
    if args.sources:
        for source in api_get(args, f"/api/v1/nodes/{node}/log-sources")["sources"]:
            print(source)
        return 0
    query = urlencode({"source": args.source, "lines": args.lines})
    route = f"/api/v1/nodes/{node}/logs?{query}"
    # One stream (the agent, or one process's output) prints as it is; a whole shard's
    # lines say which process wrote them.
    one = args.source == "agent" or args.source.count("/") == 2

    def show(line: dict[str, Any]) -> None:
        print(line["text"] if one else f"{line['source']}: {line['text']}", flush=True)

    if not args.follow:
        for line in api_get(args, route)["lines"]:
            show(line)
        return 0
    items = follow(args, route)
    try:
        for item in items:
            if "error" in item:
                raise CtlError(str(item["error"]))
            if "end" in item:
                print(f"llmgw ctl: {item['end']}", file=sys.stderr)
                return 0
            if "text" in item:
                show(item)
    except KeyboardInterrupt:  # Ctrl-C: the way a follow ends
        return 130
    finally:
        items.close()
    url, _ = settings(args)
    raise CtlError(f"the control plane at {url} ended the stream of {args.source} unexplained")


def engine_check(args: argparse.Namespace) -> int:
    body = {k: v for k, v in (("node", args.node), ("engine", args.engine)) if v}
    data = api(args, "POST", "/api/v1/engine-check", body)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    problems = 0
    for check in data["checks"]:
        where = f"{check['node']} {check['engine']}"
        if check.get("error"):
            print(f"{where}: error: {check['error']}")
            problems += 1
            continue
        if check.get("path") is None:
            print(f"{where}: not installed")
            continue
        missing = check.get("missing") or []
        status = "ok" if not missing else "missing " + " ".join(missing)
        problems += bool(missing)
        print(f"{where} ({check['path']}): {status}")
        for warning in check.get("warnings") or []:
            print(f"{where}: warning: {warning}")
    return 1 if problems else 0
