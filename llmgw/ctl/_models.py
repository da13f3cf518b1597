"""`llmgw ctl` on what the fleet serves: models, replicas, events, weights, status, place, route.

Each command takes the parsed arguments (their flags are in `_args`), asks the
admin API, prints, and returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any
from urllib.parse import urlencode

from llmgw.ctl import _tables, _weights
from llmgw.ctl._client import CtlError, api, api_get, leader_line


def models(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/models")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(_tables.format_models(data["models"]))
    return 0


def replicas(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/replicas")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(_tables.format_replicas(data["replicas"], now=time.time(), lines=args.lines))
    return 0


def events(args: argparse.Namespace) -> int:
    query = [("limit", str(args.limit))]
    query += [(k, v) for k, v in (("replica", args.replica), ("node", args.node)) if v]
    data = api(args, "GET", "/api/v1/events?" + urlencode(query))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    if not data["events"]:
        what = " and ".join(
            f"{k} {v}" for k, v in (("replica", args.replica), ("node", args.node)) if v
        )
        print(f"no events{' for ' + what if what else ''} (the store keeps the newest "
              "events_kept of them)")  # fmt: skip
        return 0
    print(_tables.format_events(data["events"], now=time.time()))
    return 0


def status(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/status")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    line = leader_line(args)
    if line is not None:
        print(line)
    print(_tables.format_status(data["models"], now=time.time()))
    if data.get("traffic"):
        print()
        print(_tables.format_traffic(data["traffic"]))
    fabrics = _weights.format_fabrics(data.get("fabrics") or [])
    if fabrics:
        print()
        print("\n".join(fabrics))
    return 0


def weights(args: argparse.Namespace) -> int:
    if not args.collect:
        if args.dry_run or args.node or args.path:
            raise CtlError("--dry-run, --node and --path go with --collect")
        data = api_get(args, "/api/v1/weights")
        print(json.dumps(data, indent=2) if args.json else _weights.format_weights(data["nodes"]))
        return 0
    if args.path and not args.node:
        raise CtlError("--path needs --node: each node's paths are its own")
    body: dict[str, Any] = {"dry_run": bool(args.dry_run)}
    if args.node:
        body["node"] = args.node
    if args.path:
        body["paths"] = list(args.path)
    data = api(args, "POST", "/api/v1/weights/collect", body)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print("\n".join(_weights.format_collect(data)))
    failed = any(n["refused"] or n["error"] for n in data["nodes"])
    return 1 if failed else 0


def place(args: argparse.Namespace) -> int:
    data = api(args, "POST", "/api/v1/place", {"model": args.model})
    if args.json:
        print(json.dumps(data, indent=2))
    elif data["placed"]:
        print(f"{data['model']}: would place with {data['engine']}"
              + (f" over fabric {data['fabric']}" if data.get("fabric") else ""))  # fmt: skip
        for r in data["ranks"]:
            gpus = ",".join(map(str, r["gpus"])) or "cpu"
            nics = " " + ",".join(r["fabric_adapters"]) if r["fabric_adapters"] else ""
            print(f"  rank {r['rank']}: {r['node']} gpus {gpus}{nics}")
    else:
        print(f"{data['model']}: cannot be placed:")
        for reason in data["reasons"]:
            print(f"  {reason}")
    return 0 if data["placed"] else 1


def route(args: argparse.Namespace) -> int:
    try:
        text = args.prompt_file.read_text()
    except OSError as exc:
        raise CtlError(f"--prompt-file {args.prompt_file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CtlError(f"--prompt-file {args.prompt_file}: not UTF-8 text") from None
    try:
        request = json.loads(text)
    except ValueError:
        request = None
    if not isinstance(request, dict) or not ({"messages", "prompt", "input"} & set(request)):
        request = {"messages": [{"role": "user", "content": text}]}
    request["model"] = args.model
    if args.path is not None:
        path = args.path
    elif "messages" in request:
        path = "/v1/chat/completions"
    elif "prompt" in request:
        path = "/v1/completions"
    else:
        path = "/v1/responses"
    data = api(args, "POST", "/api/v1/route", {"model": args.model, "path": path,
                                               "request": request})  # fmt: skip
    print(json.dumps(data, indent=2) if args.json else _tables.format_route(data))
    return 0
