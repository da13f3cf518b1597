"""`llmgw ctl`: the operator's CLI. Talks to the admin JSON API; `cert` works offline.

The admin API's client is `_client`, the tables are `_tables`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from llmgw.ctl import _cert, _onboard, _release, _tables, _weights
from llmgw.ctl._client import (
    DEFAULT_CTL_CONFIG,
    CtlError,
    api,
    api_get,
    follow,
    leader_line,
    settings,
)
from llmgw.ctl._tables import (
    FAILURE_LINES,
    format_audit,
    format_keys,
    format_nodes,
    format_tenants,
    format_usage,
    when,
)
from llmgw.errors import ConfigError, LlmgwError


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
    nodes_sub = nodes.add_subparsers(dest="nodes_command")
    forget = nodes_sub.add_parser(
        "forget",
        help="remove a node that is not connected from the fleet (a retired machine)",
        description="Remove a node that is not connected: it leaves `nodes`, no longer counts "
        "toward the control plane's mass-unreachable guard, and its replicas are replaced. "
        "If it comes back, it registers as a new node.",
    )
    forget.add_argument("node")
    forget.set_defaults(func=_nodes_forget)

    cordon = sub.add_parser("cordon", help="place nothing new on a node (running replicas stay)")
    cordon.add_argument("node")
    cordon.add_argument("--reason", default=None)
    cordon.set_defaults(func=_cordon)
    uncordon = sub.add_parser(
        "uncordon", help="let placement use a node again (lifts a cordon and a drain)"
    )
    uncordon.add_argument("node")
    uncordon.set_defaults(func=_uncordon)
    drain = sub.add_parser(
        "drain",
        help="move a node's replicas elsewhere, replacement first, then stop them there",
        description="Cordon the node and move what runs there: each replica is replaced "
        "elsewhere first, then the router sends it nothing new, its in-flight requests "
        "finish (up to drain_timeout_s), and it stops. `nodes` shows the node draining, "
        "then drained. `uncordon` returns it to service.",
    )
    drain.add_argument("node")
    drain.add_argument("--reason", default=None)
    drain.set_defaults(func=_drain)

    shard = sub.add_parser("shard", help="start, stop and read shards on a node by hand")
    shard_sub = shard.add_subparsers(dest="shard_command", required=True)
    start = shard_sub.add_parser(
        "start",
        help="start an engine on a node: shard start NODE --engine E --model PATH [-- ARGS]",
        epilog="Arguments after -- go to the engine as they are.",
    )
    start.add_argument("node")
    start.add_argument("--engine", required=True, choices=["vllm", "sglang", "llama-server"])
    start.add_argument("--model", required=True, help="a path on the node, or a hub id")
    start.add_argument("--port", type=int, default=None)
    start.add_argument("--gpus", type=int, default=None, help="cards to use (GPU engines: 1)")
    start.add_argument("--served-name", default=None)
    start.add_argument("--json", action="store_true")
    start.set_defaults(func=_shard_start)
    stop = shard_sub.add_parser("stop", help="stop a shard: SIGTERM, then SIGKILL after a grace")
    stop.add_argument("node")
    stop.add_argument("shard")
    stop.add_argument("--grace", type=float, default=0.0, help="seconds (default: the agent's)")
    stop.set_defaults(func=_shard_stop)
    logs = shard_sub.add_parser("logs", help="the last lines of a shard's processes")
    logs.add_argument("node")
    logs.add_argument("shard")
    logs.add_argument("--lines", type=int, default=40)
    logs.set_defaults(func=_shard_logs)

    node_logs = sub.add_parser(
        "logs",
        help="a node's logs: the agent's own (default) or a shard process's; -f follows",
        description="Sources: `agent` (the agent's last 2,000 lines, kept in memory), a "
        "shard id (all its processes), or SHARD/PROCESS/stdout|stderr; the node lists "
        "them (GET /api/v1/nodes/NODE/log-sources, and `--sources`).",
    )
    node_logs.add_argument("node")
    node_logs.add_argument("--source", default="agent")
    node_logs.add_argument("-n", "--lines", type=int, default=40)
    node_logs.add_argument("-f", "--follow", action="store_true", help="print new lines")
    node_logs.add_argument("--sources", action="store_true", help="list the node's log sources")
    node_logs.set_defaults(func=_node_logs)

    models = sub.add_parser("models", help="the catalog's models")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=_models)
    replicas = sub.add_parser(
        "replicas",
        help="every replica: state, nodes, age, stale, reason, and under it its last failure "
        "(or its predecessor's) with the engine's last output lines",
    )
    replicas.add_argument("--json", action="store_true")
    replicas.add_argument(
        "--lines", type=int, default=FAILURE_LINES, help="output lines shown per failure"
    )
    replicas.set_defaults(func=_replicas)
    events = sub.add_parser(
        "events", help="recent events (failed shards, stops and why, node state changes)"
    )
    events.add_argument("--replica", default=None)
    events.add_argument("--node", default=None)
    events.add_argument("--limit", type=int, default=50, help="newest N (at most 1000)")
    events.add_argument("--json", action="store_true")
    events.set_defaults(func=_events)
    weights = sub.add_parser(
        "weights",
        help="what each node holds of the weights, who wants it, and what would be reclaimed",
        description="List, per node, what its weights directory holds (fetched cache entries "
        "and an operator's files, with their size and the catalog models that want them) and "
        "the cache entries no model wants. --collect asks the nodes to delete those; each "
        "agent checks every path again and refuses what is not a cache entry it may delete "
        "(an operator's file, a symlink, anything outside its weights directory).",
    )
    weights.add_argument("--json", action="store_true", help="the API's JSON, as is")
    weights.add_argument("--collect", action="store_true", help="delete what would be reclaimed")
    weights.add_argument(
        "--dry-run", action="store_true", help="with --collect: ask, and delete nothing"
    )
    weights.add_argument("--node", default=None, help="with --collect: only this node")
    weights.add_argument(
        "--path",
        action="append",
        default=None,
        metavar="P",
        help="with --collect and --node: ask for exactly these paths (repeatable)",
    )
    weights.set_defaults(func=_weights_cmd)
    status = sub.add_parser(
        "status", help="desired and ready replicas per model, and what each fabric holds"
    )
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_status)
    place = sub.add_parser("place", help="where a replica of MODEL would go, or why it cannot")
    place.add_argument("model")
    place.add_argument(
        "--dry-run",
        action="store_true",
        required=True,
        help="only show the decision (the reconciler places for real)",
    )
    place.add_argument("--json", action="store_true")
    place.set_defaults(func=_place)
    route = sub.add_parser(
        "route",
        help="which endpoint the router would send a request for MODEL to now, and why",
        description="Ask the router how it would route a request now (nothing is sent): "
        "each endpoint's cached prompt blocks, its pending load, its scraped figures and "
        "their age, and the load bound. The prompt file holds either a whole request body "
        "as a client sends it (JSON with messages or prompt) or plain text, taken as one "
        "user message.",
    )
    route.add_argument("model")
    route.add_argument("--prompt-file", type=Path, required=True, metavar="F")
    route.add_argument(
        "--path",
        default=None,
        help="the API route the request is for (default: /v1/chat/completions, or "
        "/v1/completions for a body with prompt)",
    )
    route.add_argument("--json", action="store_true")
    route.set_defaults(func=_route)

    keys = sub.add_parser("keys", help="API keys for the router")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="a new key; its secret is shown once")
    create.add_argument("--tenant", required=True)
    create.add_argument(
        "--models", default=None, help="comma-separated served names (default: all)"
    )
    create.add_argument("--band", default="interactive", help="default priority band")
    create.add_argument("--max-band", default=None, help="highest band it may ask for")
    create.add_argument("--name", default="")
    create.add_argument(
        "--expires",
        default=None,
        metavar="WHEN",
        help="when it stops working: a time from now (90m, 24h, 30d) or a date "
        "(2026-12-31, at 00:00 UTC; or an ISO time with its offset)",
    )
    create.add_argument("--json", action="store_true")
    create.set_defaults(func=_keys_create)
    klist = keys_sub.add_parser("list", help="every key (never the secrets)")
    klist.add_argument("--json", action="store_true")
    klist.set_defaults(func=_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_keys_revoke)

    tenants = sub.add_parser(
        "tenants",
        help="tenants (accounts) and their limits: requests and tokens per minute, highest band",
    )
    tenants_sub = tenants.add_subparsers(dest="tenants_command", required=True)
    tlist = tenants_sub.add_parser("list", help="every tenant, its limits and its active keys")
    tlist.add_argument("--json", action="store_true")
    tlist.set_defaults(func=_tenants_list)
    tcreate = tenants_sub.add_parser("create", help="a new tenant (no limit unless given)")
    tcreate.add_argument("name")
    tset = tenants_sub.add_parser(
        "set", help="change a tenant's limits (`none` lifts one); the others stay as they are"
    )
    tset.add_argument("name")
    for p, none_ok in ((tcreate, False), (tset, True)):
        lift = "; none: no limit" if none_ok else ""
        p.add_argument("--rpm", default=None, metavar="N", help="requests per minute" + lift)
        p.add_argument("--tpm", default=None, metavar="N",
                       help="prompt + completion tokens per minute" + lift)  # fmt: skip
        p.add_argument("--max-band", default=None, metavar="B",
                       help="the highest priority band its keys may ask for" + lift)  # fmt: skip
        p.add_argument("--json", action="store_true")
    tcreate.set_defaults(func=_tenants_create)
    tset.set_defaults(func=_tenants_set)
    tdelete = tenants_sub.add_parser("delete", help="delete a tenant that has no unrevoked key")
    tdelete.add_argument("name")
    tdelete.set_defaults(func=_tenants_delete)

    usage = sub.add_parser(
        "usage", help="requests and tokens per hour, tenant, key and model, with totals"
    )
    usage.add_argument("--tenant", default=None)
    usage.add_argument("--since", default="7d", help="how far back: 90m, 24h, 7d (default 7d)")
    usage.add_argument("--json", action="store_true", help="the API's JSON, as is")
    usage.set_defaults(func=_usage)
    audit = sub.add_parser("audit", help="what operators did through the admin API, newest first")
    audit.add_argument("--limit", type=int, default=50, help="newest N (at most 1000)")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=_audit)

    check = sub.add_parser(
        "engine-check", help="check the flags llmgw would pass against each engine's --help"
    )
    check.add_argument("--node", default=None)
    check.add_argument("--engine", default=None, choices=["vllm", "sglang", "llama-server"])
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=_engine_check)
    _cert.register(sub)
    _onboard.register(sub)
    _release.register(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # engine arguments, untouched by our parser
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.extra = extra
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"llmgw ctl: {exc}", file=sys.stderr)
        return 2
    except LlmgwError as exc:
        print(f"llmgw ctl: {exc}", file=sys.stderr)
        return 1


def _nodes(args: argparse.Namespace) -> int:
    data = api_get(args, "/api/v1/nodes")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_nodes(data["nodes"], now=time.time()))
    return 0


def _nodes_forget(args: argparse.Namespace) -> int:
    data = api(args, "DELETE", f"/api/v1/nodes/{args.node}")
    print(f"{args.node} forgotten (it was {data['was']}): it no longer counts in the fleet")
    return 0


def _cordon(args: argparse.Namespace) -> int:
    body = {"reason": args.reason} if args.reason else {}
    api(args, "POST", f"/api/v1/nodes/{args.node}/cordon", body)
    print(f"{args.node} cordoned: nothing new is placed there")
    return 0


def _uncordon(args: argparse.Namespace) -> int:
    data = api(args, "DELETE", f"/api/v1/nodes/{args.node}/cordon")
    lifted = " and ".join(data.get("lifted") or ["cordon"])
    print(f"{args.node} uncordoned ({lifted} lifted): placement may use it again")
    return 0


def _drain(args: argparse.Namespace) -> int:
    body = {"reason": args.reason} if args.reason else {}
    api(args, "POST", f"/api/v1/nodes/{args.node}/drain", body)
    print(
        f"{args.node} draining: its replicas are replaced elsewhere, then stopped there; "
        f"`llmgw ctl nodes` shows it drained once nothing runs there"
    )
    return 0


def _shard_start(args: argparse.Namespace) -> int:
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


def _shard_stop(args: argparse.Namespace) -> int:
    grace = f"?grace={args.grace:g}" if args.grace else ""
    api(args, "DELETE", f"/api/v1/nodes/{args.node}/shards/{args.shard}{grace}")
    print(f"{args.shard} stopped on {args.node}")
    return 0


def _shard_logs(args: argparse.Namespace) -> int:
    data = api(
        args, "GET", f"/api/v1/nodes/{args.node}/shards/{args.shard}/logs?lines={args.lines}"
    )
    for line in data["lines"]:
        print(f"{line['source']}: {line['text']}")
    return 0


def _node_logs(args: argparse.Namespace) -> int:
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


def _engine_check(args: argparse.Namespace) -> int:
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


def _models(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/models")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(_tables.format_models(data["models"]))
    return 0


def _replicas(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/replicas")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(_tables.format_replicas(data["replicas"], now=time.time(), lines=args.lines))
    return 0


def _events(args: argparse.Namespace) -> int:
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
        print(f"no events{' for ' + what if what else ''} (they are kept in memory since the "
              "control plane started)")  # fmt: skip
        return 0
    print(_tables.format_events(data["events"], now=time.time()))
    return 0


def _status(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/status")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    line = leader_line(args)
    if line is not None:
        print(line)
    print(_tables.format_status(data["models"], now=time.time()))
    fabrics = _weights.format_fabrics(data.get("fabrics") or [])
    if fabrics:
        print()
        print("\n".join(fabrics))
    return 0


def _weights_cmd(args: argparse.Namespace) -> int:
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


def _place(args: argparse.Namespace) -> int:
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


def _route(args: argparse.Namespace) -> int:
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


_DURATION = re.compile(r"^(\d+)([mhd])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, what: str) -> float:
    """90m, 24h, 7d -> seconds."""
    found = _DURATION.match(text.strip())
    if found is None or int(found.group(1)) == 0:
        raise CtlError(f"{what}: {text!r} is not a time span; expected minutes, hours or days "
                       "such as 90m, 24h, 7d")  # fmt: skip
    return int(found.group(1)) * _UNIT_S[found.group(2)]


def parse_expires(text: str, *, now: float) -> float:
    """--expires: a span from now (30d) or a date or ISO time (UTC unless it says)."""
    if _DURATION.match(text.strip()):
        return now + parse_duration(text, "--expires")
    try:
        at_time = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise CtlError(f"--expires: {text!r} is neither a time span (90m, 24h, 30d) nor a date "
                       "(2026-12-31) or ISO time (2026-12-31T18:00+01:00)") from None  # fmt: skip
    if at_time.tzinfo is None:
        at_time = at_time.replace(tzinfo=datetime.UTC)
    at = at_time.timestamp()
    if at <= now:
        raise CtlError(f"--expires: {text} ({when(at)}) is not in the future")
    return at


# --- keys ------------------------------------------------------------------------------


def _keys_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"tenant": args.tenant, "default_band": args.band, "name": args.name}
    if args.models:
        body["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.max_band:
        body["max_band"] = args.max_band
    if args.expires is not None:
        body["expires_at"] = parse_expires(args.expires, now=time.time())
    data = api(args, "POST", "/api/v1/keys", body)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    key = data["key"]
    if data.get("tenant_created"):
        print(f"tenant {key['tenant']} did not exist: created with no limits "
              f"(set some with `llmgw ctl tenants set {key['tenant']}`)")  # fmt: skip
    expiry = "" if key.get("expires_at") is None else f", expires {when(key['expires_at'])}"
    print(f"key {key['key_id']} for tenant {key['tenant']} (max band {key['max_band']}{expiry});"
          " its secret (shown only now):")  # fmt: skip
    print(data["secret"])
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/keys")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_keys(data["keys"]))
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    api(args, "DELETE", f"/api/v1/keys/{args.key_id}")
    print(f"{args.key_id} revoked")
    return 0


# --- tenants ---------------------------------------------------------------------------


def _limit_arg(value: str | None, what: str, *, none_ok: bool) -> tuple[bool, int | None]:
    """(given, value) for --rpm/--tpm: a count, or `none` (set only) to lift it."""
    if value is None:
        return False, None
    if none_ok and value.strip().lower() == "none":
        return True, None
    if not value.strip().isdigit():
        lift = " or none" if none_ok else ""
        raise CtlError(f"--{what}: {value!r} is not a count >= 0{lift}")
    return True, int(value)


def _limits_body(args: argparse.Namespace, *, none_ok: bool) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for field in ("rpm", "tpm"):
        given, value = _limit_arg(getattr(args, field), field, none_ok=none_ok)
        if given:
            body[field] = value
    if args.max_band is not None:
        lift = none_ok and args.max_band.strip().lower() == "none"
        body["max_band"] = None if lift else args.max_band
    return body


def _tenants_list(args: argparse.Namespace) -> int:
    data = api_get(args, "/api/v1/tenants")
    if args.json:
        print(json.dumps(data, indent=2))
    elif not data["tenants"]:
        print("no tenants (llmgw ctl tenants create NAME)")
    else:
        print(format_tenants(data["tenants"]))
        print("(- : no limit; KEYS: keys neither revoked nor expired)")
    return 0


def _tenants_create(args: argparse.Namespace) -> int:
    body = {"name": args.name, **_limits_body(args, none_ok=False)}
    data = api(args, "POST", "/api/v1/tenants", body)
    print(json.dumps(data, indent=2) if args.json else format_tenants([data["tenant"]]))
    return 0


def _tenants_set(args: argparse.Namespace) -> int:
    body = _limits_body(args, none_ok=True)
    if not body:
        raise CtlError("tenants set: nothing to change; give --rpm, --tpm or --max-band")
    data = api(args, "PATCH", f"/api/v1/tenants/{quote(args.name, safe='')}", body)
    print(json.dumps(data, indent=2) if args.json else format_tenants([data["tenant"]]))
    return 0


def _tenants_delete(args: argparse.Namespace) -> int:
    api(args, "DELETE", f"/api/v1/tenants/{quote(args.name, safe='')}")
    print(f"tenant {args.name} deleted")
    return 0


# --- what was done ---------------------------------------------------------------------


def _usage(args: argparse.Namespace) -> int:
    query = [("since", str(int(parse_duration(args.since, "--since"))))]
    if args.tenant:
        query.append(("tenant", args.tenant))
    data = api_get(args, "/api/v1/usage?" + urlencode(query))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_usage(data["rows"], data["totals"]))
    return 0


def _audit(args: argparse.Namespace) -> int:
    data = api_get(args, f"/api/v1/audit?limit={args.limit}")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_audit(data["entries"]))
    return 0
