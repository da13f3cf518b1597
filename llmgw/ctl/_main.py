"""`llmgw ctl`: the operator's CLI. Talks to the admin JSON API; `cert` works offline."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx

from llmgw import config
from llmgw.ctl import _cert, _onboard, _release, _weights
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
    return api(args, "GET", route)


def api(args: argparse.Namespace, method: str, route: str, body: Any = None) -> Any:
    url, key = _settings(args)
    try:
        response = httpx.request(
            method, url + route, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=120
        )
    except httpx.ConnectError:
        raise CtlError(f"cannot reach the control plane at {url} (connection refused)") from None
    except httpx.TimeoutException:
        raise CtlError(f"the control plane at {url} did not answer within 120 s") from None
    except httpx.HTTPError as exc:
        raise CtlError(f"cannot talk to the control plane at {url}: {exc}") from None
    if response.status_code == 401:
        raise CtlError(f"the control plane at {url} refused the admin key (401)")
    if response.status_code >= 400:
        standby = _standby_message(response)
        if standby is not None:  # a write sent to a standby: name the leader, nothing else
            raise CtlError(standby)
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:200]
        raise CtlError(f"{route}: {response.status_code}: {message}")
    return response.json()


def _standby_message(response: httpx.Response) -> str | None:
    """A standby's 409 ("standby; leader is H:P (admin H:P)"), or None for any other error."""
    if response.status_code != 409:
        return None
    try:
        error = response.json().get("error")
    except Exception:
        return None
    if isinstance(error, dict):
        error = error.get("message")
    # A string: a control plane from before the error body was the same for every refusal.
    return error if isinstance(error, str) and error.startswith("standby;") else None


def _leader_line(args: argparse.Namespace) -> str | None:
    """`control plane: leader, epoch 7` / `control plane: standby; leader is H:P (admin H:P)`;
    None from a control plane that predates the leader route."""
    try:
        data = api(args, "GET", "/api/v1/leader")
    except CtlError:
        return None
    role, epoch, leader = data.get("role"), data.get("epoch"), data.get("leader")
    if role == "standby":
        if isinstance(leader, dict):
            rpc, admin = leader.get("rpc"), leader.get("admin")
            return f"control plane: standby; leader is {rpc} (admin {admin})"
        return "control plane: standby; no leader yet"
    return f"control plane: {role}, epoch {epoch}"


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
    url, key = _settings(args)
    # The control plane sends a keepalive line at least every few seconds while the
    # agent answers, and ends the stream itself when the agent stops answering.
    timeout = httpx.Timeout(30.0, connect=10.0)
    try:
        with httpx.stream(
            "GET", url + route + "&follow=1", headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
        ) as response:  # fmt: skip
            if response.status_code >= 400:
                response.read()
                try:
                    message = response.json()["error"]["message"]
                except Exception:
                    message = response.text[:200]
                raise CtlError(f"{route}: {response.status_code}: {message}")
            for raw in response.iter_lines():
                if not raw.strip():
                    continue
                item = json.loads(raw)
                if "error" in item:
                    raise CtlError(str(item["error"]))
                if "end" in item:
                    print(f"llmgw ctl: {item['end']}", file=sys.stderr)
                    return 0
                if "text" in item:
                    show(item)
    except KeyboardInterrupt:  # Ctrl-C: the way a follow ends
        return 130
    except httpx.TimeoutException:
        raise CtlError(f"the control plane at {url} sent nothing for 30 s") from None
    except httpx.HTTPError as exc:
        raise CtlError(f"following logs from the control plane at {url}: {exc}") from None
    raise CtlError(f"the control plane at {url} ended the stream of {args.source} unexplained")


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


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    all_rows = [tuple(header), *[tuple(r) for r in rows]]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in all_rows
    )


def _models(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/models")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = []
    for m in data["models"]:
        profiles = "; ".join(
            f"{p['engine']} {p.get('gpu_class') or 'cpu'}"
            + (f" x{p['gpus_per_node']}" if p.get("gpus_per_node") else "")
            + (f" {p['nodes']} nodes" if p.get("nodes", 1) > 1 else "")
            for p in m["profiles"]
        )
        names = ",".join(m.get("served_names") or [m["name"]])
        rows.append((m["name"], names, str(m["replicas"]), m["source"], profiles))
    print(_table(("MODEL", "SERVED AS", "REPLICAS", "SOURCE", "PROFILES"), rows))
    return 0


FAILURE_LINES = 5


def _replicas(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/replicas")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    now = time.time()
    rows = []
    notes: dict[int, list[str]] = {}
    for r in data["replicas"]:
        reason = (r.get("reason") or "-").splitlines()
        rows.append(
            (
                r["model"],
                r["replica"] or "-",
                r["state"],
                ",".join(r["nodes"]) or "-",
                _age(None if r["since"] is None else now - r["since"]),
                "stale" if r["stale"] else "-",
                reason[0],
            )
        )
        rows += [("", "", "", "", "", "", line) for line in reason[1:]]
        below = []
        if r.get("progress"):
            below.append("  " + _weights.format_progress(r["progress"]))
        if r.get("last_failure"):
            below += format_failure(r["last_failure"], r["replica"], now=now, lines=args.lines)
        if below:
            notes[len(rows) - 1] = below
    header = ("MODEL", "REPLICA", "STATE", "NODES", "AGE", "STALE", "REASON")
    print(_with_notes(_table(header, rows), notes))
    return 0


def format_failure(
    failure: dict[str, Any], replica: str | None, *, now: float, lines: int = FAILURE_LINES
) -> list[str]:
    """The lines under a replica: why it (or the one it replaces) failed, and the output."""
    where = f" on {failure['node_id']}" if failure.get("node_id") else ""
    if failure.get("shard_id"):
        where += f" (shard {failure['shard_id']})"
    ago = _age(now - failure["at"])
    if failure["replica_id"] == replica:
        head = f"  last failure {ago} ago{where}: {failure['reason']}"
    else:
        head = f"  replaces {failure['replica_id']}, failed {ago} ago{where}: {failure['reason']}"
    shown = failure.get("lines") or []
    return [head, *(f"      {line}" for line in shown[-lines:] if lines > 0)]


def _with_notes(table: str, notes: dict[int, list[str]]) -> str:
    """`table` with `notes[i]` printed under its row i (line 0 is the header)."""
    out = []
    for i, line in enumerate(table.splitlines()):
        out.append(line)
        out += notes.get(i - 1, [])
    return "\n".join(out)


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
    now = time.time()
    rows = []
    notes: dict[int, list[str]] = {}
    for e in data["events"]:
        rows.append((_age(now - e["at"]), e["kind"], e["node_id"] or "-",
                     e["replica_id"] or "-", e["message"]))  # fmt: skip
        if e["lines"]:
            notes[len(rows) - 1] = [f"      {line}" for line in e["lines"][-FAILURE_LINES:]]
    print(_with_notes(_table(("AGO", "KIND", "NODE", "REPLICA", "WHAT"), rows), notes))
    return 0


def _status(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/status")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    line = _leader_line(args)
    if line is not None:
        print(line)
    now = time.time()
    rows = []
    for m in data["models"]:
        note = ["unplaced"] if m["unplaced"] else []
        failure = m.get("last_failure")
        if failure:
            note.append(f"{failure['replica_id']} failed {_age(now - failure['at'])} ago: "
                        f"{failure['reason']}")  # fmt: skip
        rows.append((m["model"], str(m["desired"]), str(m["ready"]), "; ".join(note) or "-"))
    print(_table(("MODEL", "DESIRED", "READY", "NOTE"), rows))
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
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    r, bound = data["request"], data["bound"]
    print(f"{data['model']}: {data['chosen'] or 'no endpoint'} ({data['policy']}): "
          f"{data['reason']}")  # fmt: skip
    print(f"  prompt: {_num(r['prompt_bytes'])} bytes, {_num(r['prompt_blocks'])} blocks of "
          f"{r['block_bytes']}, ~{_num(r['estimated_prompt_tokens'])} tokens; "
          f"~{_num(r['expected_output_tokens'])} output tokens")  # fmt: skip
    most = bound["max_requests_per_endpoint"]
    print(f"  bound: at most {most} request{'s' if most != 1 else ''} per endpoint "
          f"(epsilon {bound['epsilon']:g}, average {_num(bound['average_load'])})")  # fmt: skip
    rows = []
    for c in data["candidates"]:
        sc = c["scraped"]
        state = "ok" if c["healthy"] and c["breaker_allows"] else (
            "unhealthy" if not c["healthy"] else "circuit open")  # fmt: skip
        if state == "ok" and not c["within_bound"]:
            state = "over bound"
        scraped = (f"run {_num(sc['running'])} wait {_num(sc['waiting'])} "
                   f"kv {_num(sc['kv_usage'])} age {_num(sc['age_s'])}s")  # fmt: skip
        rows.append((
            ("* " if c["endpoint"] == data["chosen"] else "  ") + c["endpoint"], state,
            _num(c["cost"]), _num(c["cached_tokens"]), str(c["in_flight"]),
            _num(c["pending_prefill_tokens"]), _num(c["pending_decode_tokens"]),
            _num(c["external_requests"]), scraped,
        ))  # fmt: skip
    print(_table(("ENDPOINT", "STATE", "COST", "CACHED", "IN-FLIGHT", "PREFILL", "DECODE",
                  "EXTERNAL", "SCRAPED"), rows))  # fmt: skip
    return 0


def _num(value: float | None) -> str:
    """A figure for a table: unknown stays unknown."""
    if value is None:
        return "?"
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.2f}"


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


def _nodes_forget(args: argparse.Namespace) -> int:
    data = api(args, "DELETE", f"/api/v1/nodes/{args.node}")
    print(f"{args.node} forgotten (it was {data['was']}): it no longer counts in the fleet")
    return 0


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
    expiry = "" if key.get("expires_at") is None else f", expires {_when(key['expires_at'])}"
    print(f"key {key['key_id']} for tenant {key['tenant']} (max band {key['max_band']}{expiry});"
          " its secret (shown only now):")  # fmt: skip
    print(data["secret"])
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    data = api(args, "GET", "/api/v1/keys")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [
        (
            k["key_id"],
            k["tenant"],
            ",".join(k["models"]) if k["models"] is not None else "all",
            k["default_band"],
            k["max_band"],
            "never" if k.get("expires_at") is None else _when(k["expires_at"]),
            k.get("state") or ("revoked" if k["revoked"] else "active"),
            k["name"] or "-",
        )
        for k in data["keys"]
    ]
    header = ("KEY", "TENANT", "MODELS", "BAND", "MAX BAND", "EXPIRES", "STATE", "NAME")
    print(_table(header, rows))
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
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise CtlError(f"--expires: {text!r} is neither a time span (90m, 24h, 30d) nor a date "
                       "(2026-12-31) or ISO time (2026-12-31T18:00+01:00)") from None  # fmt: skip
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    at = when.timestamp()
    if at <= now:
        raise CtlError(f"--expires: {text} ({_when(at)}) is not in the future")
    return at


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


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


def _tenant_rows(tenants: list[dict[str, Any]]) -> str:
    rows = [
        (t["name"], "-" if t["rpm"] is None else str(t["rpm"]),
         "-" if t["tpm"] is None else str(t["tpm"]), t["max_band"] or "-", str(t["keys"]))
        for t in tenants
    ]  # fmt: skip
    return _table(("TENANT", "RPM", "TPM", "MAX BAND", "KEYS"), rows)


def _tenants_list(args: argparse.Namespace) -> int:
    data = api_get(args, "/api/v1/tenants")
    if args.json:
        print(json.dumps(data, indent=2))
    elif not data["tenants"]:
        print("no tenants (llmgw ctl tenants create NAME)")
    else:
        print(_tenant_rows(data["tenants"]))
        print("(- : no limit; KEYS: keys neither revoked nor expired)")
    return 0


def _tenants_create(args: argparse.Namespace) -> int:
    body = {"name": args.name, **_limits_body(args, none_ok=False)}
    data = api(args, "POST", "/api/v1/tenants", body)
    print(json.dumps(data, indent=2) if args.json else _tenant_rows([data["tenant"]]))
    return 0


def _tenants_set(args: argparse.Namespace) -> int:
    body = _limits_body(args, none_ok=True)
    if not body:
        raise CtlError("tenants set: nothing to change; give --rpm, --tpm or --max-band")
    data = api(args, "PATCH", f"/api/v1/tenants/{quote(args.name, safe='')}", body)
    print(json.dumps(data, indent=2) if args.json else _tenant_rows([data["tenant"]]))
    return 0


def _tenants_delete(args: argparse.Namespace) -> int:
    api(args, "DELETE", f"/api/v1/tenants/{quote(args.name, safe='')}")
    print(f"tenant {args.name} deleted")
    return 0


def _usage(args: argparse.Namespace) -> int:
    query = [("since", str(int(parse_duration(args.since, "--since"))))]
    if args.tenant:
        query.append(("tenant", args.tenant))
    data = api_get(args, "/api/v1/usage?" + urlencode(query))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [
        (_when(r["hour"]), r["tenant"], r["key_id"], r["model"], str(r["requests"]),
         str(r["prompt_tokens"]), str(r["completion_tokens"]))
        for r in data["rows"]
    ]  # fmt: skip
    t = data["totals"]
    rows.append(("total", "", "", "", str(t["requests"]), str(t["prompt_tokens"]),
                 str(t["completion_tokens"])))  # fmt: skip
    header = ("HOUR", "TENANT", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION")
    print(_table(header, rows))
    return 0


def _audit(args: argparse.Namespace) -> int:
    data = api_get(args, f"/api/v1/audit?limit={args.limit}")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [(_when(e["at"]), e["actor"], e["action"], e["detail"]) for e in data["entries"]]
    print(_table(("AT", "WHO", "ACTION", "DETAIL"), rows) if rows else "no operator actions yet")
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    api(args, "DELETE", f"/api/v1/keys/{args.key_id}")
    print(f"{args.key_id} revoked")
    return 0


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
    if n is None:
        return "-"
    return f"{n / 2**30:.1f}" if n < 100 * 2**30 else f"{n / 2**30:.0f}"


def _pair(used: int | None, total: int | None) -> str:
    if used is None and total is None:
        return "-"
    return f"{_gib(used)}/{_gib(total)}"


def _gpus(gpus: list[dict[str, Any]] | None) -> str:
    if gpus is None:
        return "-"  # unknown: the agent could not tell
    if not gpus:
        return "0"
    counts: dict[str, int] = {}
    for gpu in gpus:
        counts[gpu["gpu_class"]] = counts.get(gpu["gpu_class"], 0) + 1
    return ",".join(f"{n}x{cls}" for cls, n in sorted(counts.items()))


def _disk(filesystems: list[dict[str, Any]]) -> str:
    # The node's own space only: a shared filer is not this node's disk.
    own = [f for f in filesystems if not f.get("shared")]
    if not own or any(f.get("free_bytes") is None or f.get("total_bytes") is None for f in own):
        return "-"
    return f"{_gib(sum(f['free_bytes'] for f in own))}/{_gib(sum(f['total_bytes'] for f in own))}"


_PERCENT = re.compile(r"(\d+(?:\.\d+)?) ?%")


def _engines(engines: dict[str, Any] | None) -> str:
    """The ENGINES cell: `llama-server b6123, vllm 0.9.2 installing (40 %)`.

    A pending engine is named with the version it works on (the declared one);
    `-`: the agent has not probed yet; `none`: it has none."""
    if engines is None:
        return "-"
    cells = []
    for e in sorted(engines.get("found") or [], key=lambda e: str(e.get("name"))):
        if e.get("state") == "configured":
            cells.append(f"{e['name']} (configured)")
        else:
            cells.append(f"{e['name']} {e['version']}" if e.get("version") else str(e["name"]))
    for p in sorted(engines.get("pending") or [], key=lambda p: str(p.get("name"))):
        pct = (
            _PERCENT.search(str(p.get("detail") or "")) if p.get("state") == "installing" else None
        )
        name = f"{p['name']} {p['version']}" if p.get("version") else str(p["name"])
        cells.append(f"{name} {p['state']}" + (f" ({pct.group(1)} %)" if pct else ""))
    return ", ".join(cells) or "none"


def _warn(warnings: list[str]) -> str:
    if not warnings:
        return "-"
    first = warnings[0] if len(warnings[0]) <= 60 else warnings[0][:57] + "..."
    return first + (f" (+{len(warnings) - 1})" if len(warnings) > 1 else "")


def _node_state(node: dict[str, Any], shards: list[dict[str, Any]]) -> str:
    """Liveness, then the operator's override: `ready,draining` until nothing runs there."""
    state = str(node["state"])
    if node.get("draining"):
        return state + (",draining" if shards else ",drained")
    return state + (",cordoned" if node.get("cordoned") else "")


def format_nodes(nodes: list[dict[str, Any]], *, now: float) -> str:
    """A table; every unknown is `-`, never 0."""
    header = (
        "NODE", "STATE", "SINCE", "SEEN", "GPUS", "MEM GiB used/total",
        "DISK GiB free/total", "ENGINES", "SHARDS", "WARN",
    )  # fmt: skip
    rows = []
    for n in nodes:
        inv = n.get("inventory") or {}
        usage = inv.get("usage") or {}
        total, avail = usage.get("memory_total_bytes"), usage.get("memory_available_bytes")
        used = total - avail if total is not None and avail is not None else None
        shards = n.get("shards") or []
        ready = sum(1 for s in shards if s["state"] == "ready")
        rows.append(
            (
                n["node_id"],
                _node_state(n, shards),
                _age(now - n["since"]),
                _age(None if n.get("last_seen") is None else now - n["last_seen"]),
                _gpus(inv.get("gpus")),
                _pair(used, total),
                _disk(usage.get("filesystems") or []),
                _engines(inv.get("engines")),
                f"{ready}/{len(shards)}" if shards else "-",
                _warn(inv.get("warnings") or []) if n["state"] == "ready" else n["state_reason"],
            )
        )
    return _table(header, rows)
