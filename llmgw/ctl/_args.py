"""The argparse tree of `llmgw ctl`: every command, its flags and its help, in help order.

`build_parser()` makes the whole tree; `llmgw.ctl.main` parses with it and runs the
command's `func`. Tests read the command list from it (the docs name only commands
that exist).

Adding a command, for a newcomer:

1. Write the function, `def NAME(args: argparse.Namespace) -> int` (the exit code),
   in the module of its resource: `_fleet` (nodes, cordon, drain, shards, logs,
   engine-check), `_models` (models, replicas, events, weights, status, place,
   route) or `_accounts` (keys, tenants, usage, audit). It asks the admin API
   through `_client` (`api`, `api_get`: a refusal is a `CtlError`, exit 1) and
   prints a table from `_tables` (pure: the API's JSON in, text out; an unknown
   prints `-`, never 0). A command that needs no admin API and has a module of
   its own (`_cert`, `_onboard`, `_release`) keeps its flags there, in its
   `register(sub)`, which `build_parser` calls.
2. Add its parser below, where it belongs in `llmgw ctl --help`, with a `help=`
   that says what it does, and `set_defaults(func=...)`.
3. Show it in docs/operations.md and in the README's list of ctl commands: the
   tests in tests/ctl/test_ctl_docs.py hold the docs and this tree equal. Its
   test goes in tests/ctl/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmgw.ctl import (
    _accounts,
    _adapters,
    _autoscale,
    _cert,
    _fleet,
    _models,
    _onboard,
    _release,
    _rollout,
)
from llmgw.ctl._client import DEFAULT_CTL_CONFIG
from llmgw.ctl._tables import FAILURE_LINES


def build_parser() -> argparse.ArgumentParser:
    """The whole `llmgw ctl` tree; each leaf sets `func`, the command to run."""
    parser = argparse.ArgumentParser(prog="llmgw ctl", description="operate an llmgw fleet")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="ctl.yaml with admin_url and admin_key (default: $LLMGW_CTL_CONFIG or "
        f"{DEFAULT_CTL_CONFIG}); $LLMGW_ADMIN_URL and $LLMGW_ADMIN_KEY win over it",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_fleet(sub)
    _add_models(sub)
    _rollout.register(sub)
    _autoscale.register(sub)
    _adapters.register(sub)
    _add_accounts(sub)
    _add_engine_check(sub)
    _cert.register(sub)
    _onboard.register(sub)
    _release.register(sub)
    return parser


def _add_fleet(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """nodes, cordon, uncordon, drain, shard, logs (`_fleet`)."""
    nodes = sub.add_parser("nodes", help="list the nodes and their state")
    nodes.add_argument("--json", action="store_true", help="the API's JSON, as is")
    nodes.set_defaults(func=_fleet.nodes)
    nodes_sub = nodes.add_subparsers(dest="nodes_command")
    forget = nodes_sub.add_parser(
        "forget",
        help="remove a node that is not connected from the fleet (a retired machine)",
        description="Remove a node that is not connected: it leaves `nodes`, no longer counts "
        "toward the control plane's mass-unreachable guard, and its replicas are replaced. "
        "If it comes back, it registers as a new node.",
    )
    forget.add_argument("node")
    forget.set_defaults(func=_fleet.nodes_forget)

    cordon = sub.add_parser("cordon", help="place nothing new on a node (running replicas stay)")
    cordon.add_argument("node")
    cordon.add_argument("--reason", default=None)
    cordon.set_defaults(func=_fleet.cordon)
    uncordon = sub.add_parser(
        "uncordon", help="let placement use a node again (lifts a cordon and a drain)"
    )
    uncordon.add_argument("node")
    uncordon.set_defaults(func=_fleet.uncordon)
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
    drain.set_defaults(func=_fleet.drain)

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
    start.set_defaults(func=_fleet.shard_start)
    stop = shard_sub.add_parser("stop", help="stop a shard: SIGTERM, then SIGKILL after a grace")
    stop.add_argument("node")
    stop.add_argument("shard")
    stop.add_argument("--grace", type=float, default=0.0, help="seconds (default: the agent's)")
    stop.set_defaults(func=_fleet.shard_stop)
    logs = shard_sub.add_parser("logs", help="the last lines of a shard's processes")
    logs.add_argument("node")
    logs.add_argument("shard")
    logs.add_argument("--lines", type=int, default=40)
    logs.set_defaults(func=_fleet.shard_logs)

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
    node_logs.set_defaults(func=_fleet.node_logs)


def _add_models(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """models, replicas, events, weights, status, place, route (`_models`)."""
    models = sub.add_parser("models", help="the catalog's models")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=_models.models)
    replicas = sub.add_parser(
        "replicas",
        help="every replica: state, nodes, age, stale, reason, and under it its last failure "
        "(or its predecessor's) with the engine's last output lines",
    )
    replicas.add_argument("--json", action="store_true")
    replicas.add_argument(
        "--lines", type=int, default=FAILURE_LINES, help="output lines shown per failure"
    )
    replicas.set_defaults(func=_models.replicas)
    events = sub.add_parser(
        "events", help="recent events (failed shards, stops and why, node state changes)"
    )
    events.add_argument("--replica", default=None)
    events.add_argument("--node", default=None)
    events.add_argument("--limit", type=int, default=50, help="newest N (at most 1000)")
    events.add_argument("--json", action="store_true")
    events.set_defaults(func=_models.events)
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
    weights.set_defaults(func=_models.weights)
    status = sub.add_parser(
        "status", help="desired and ready replicas per model, and what each fabric holds"
    )
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_models.status)
    place = sub.add_parser("place", help="where a replica of MODEL would go, or why it cannot")
    place.add_argument("model")
    place.add_argument(
        "--dry-run",
        action="store_true",
        required=True,
        help="only show the decision (the reconciler places for real)",
    )
    place.add_argument("--json", action="store_true")
    place.set_defaults(func=_models.place)
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
    route.set_defaults(func=_models.route)


def _add_accounts(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """keys, tenants, usage, audit (`_accounts`)."""
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
    create.set_defaults(func=_accounts.keys_create)
    klist = keys_sub.add_parser("list", help="every key (never the secrets)")
    klist.add_argument("--json", action="store_true")
    klist.set_defaults(func=_accounts.keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_accounts.keys_revoke)

    tenants = sub.add_parser(
        "tenants",
        help="tenants (accounts) and their limits: requests and tokens per minute, highest band",
    )
    tenants_sub = tenants.add_subparsers(dest="tenants_command", required=True)
    tlist = tenants_sub.add_parser("list", help="every tenant, its limits and its active keys")
    tlist.add_argument("--json", action="store_true")
    tlist.set_defaults(func=_accounts.tenants_list)
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
    tcreate.set_defaults(func=_accounts.tenants_create)
    tset.set_defaults(func=_accounts.tenants_set)
    tdelete = tenants_sub.add_parser("delete", help="delete a tenant that has no unrevoked key")
    tdelete.add_argument("name")
    tdelete.set_defaults(func=_accounts.tenants_delete)

    usage = sub.add_parser(
        "usage", help="requests and tokens per hour, tenant, key and model, with totals"
    )
    usage.add_argument("--tenant", default=None)
    usage.add_argument("--since", default="7d", help="how far back: 90m, 24h, 7d (default 7d)")
    usage.add_argument("--json", action="store_true", help="the API's JSON, as is")
    usage.set_defaults(func=_accounts.usage)
    audit = sub.add_parser("audit", help="what operators did through the admin API, newest first")
    audit.add_argument("--limit", type=int, default=50, help="newest N (at most 1000)")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=_accounts.audit)


def _add_engine_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """engine-check (`_fleet`)."""
    check = sub.add_parser(
        "engine-check", help="check the flags llmgw would pass against each engine's --help"
    )
    check.add_argument("--node", default=None)
    check.add_argument("--engine", default=None, choices=["vllm", "sglang", "llama-server"])
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=_fleet.engine_check)
