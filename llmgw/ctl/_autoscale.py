"""`llmgw ctl autoscale [status] [MODEL]`, `pause MODEL [--replicas N]`, `resume MODEL`: an
autoscaled model's count, what set it, and the operator's hold on it (the admin API's
/api/v1/autoscale; the decision is llmgw/core/_autoscale.py)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from llmgw.ctl._client import api
from llmgw.ctl._tables import age, num


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    auto = sub.add_parser(
        "autoscale",
        help="autoscaled models: their count and why, pause (hold a count), resume",
        description="A model with `autoscale:` in server.yaml has its count set by the "
        "leader from the routers' load (queued and in-flight requests, TTFT p90, "
        "refusals), between its min and max. `status` shows the count, the rule and the "
        "signal that set it; `pause` holds a count (the current one, or --replicas N) on "
        "every control plane until `resume`; decisions go on being shown while paused.",
    )
    verbs = auto.add_subparsers(dest="verb", required=True)
    status = verbs.add_parser("status", help="each autoscaled model (or MODEL): count and why")
    status.add_argument("model", nargs="?", default=None)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=show)
    pause = verbs.add_parser("pause", help="hold MODEL's count where it is (or at --replicas)")
    pause.add_argument("model")
    pause.add_argument("--replicas", type=int, default=None, help="the count to hold")
    pause.add_argument("--json", action="store_true")
    pause.set_defaults(func=command, verb="pause")
    resume = verbs.add_parser("resume", help="let the load set MODEL's count again")
    resume.add_argument("model")
    resume.add_argument("--json", action="store_true")
    resume.set_defaults(func=command, verb="resume")


def show(args: argparse.Namespace) -> int:
    if args.model is None:
        rows = api(args, "GET", "/api/v1/autoscale")["models"]
    else:
        rows = [api(args, "GET", f"/api/v1/autoscale/{args.model}")]
    if args.json:
        print(json.dumps(rows if args.model is None else rows[0], indent=2))
        return 0
    now = time.time()
    print("\n\n".join(format_scale(r, now=now) for r in rows) or "no autoscaled models")
    return 0


def command(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if getattr(args, "replicas", None) is not None:
        body["replicas"] = args.replicas
    row = api(args, "POST", f"/api/v1/autoscale/{args.model}/{args.verb}", body)
    print(json.dumps(row, indent=2) if args.json else format_scale(row, now=time.time()))
    return 0


def format_scale(row: dict[str, Any], *, now: float) -> str:
    """One autoscaled model, for an operator."""
    ready = "-" if row["ready"] is None else str(row["ready"])
    lines = [f"{row['model']}: {row['desired']} wanted ({row['min']}-{row['max']}), {ready} ready"]
    if row["paused"] is not None:
        p = row["paused"]
        lines.append(
            f"  paused at {p['replicas']} by {p['by']} {age(now - p['at'])} ago; the load "
            f"would set {'-' if row['decided'] is None else row['decided']}"
        )
    set_by = row.get("set_by")
    if set_by is not None:
        lines.append(f"  set by {set_by['rule']} {age(now - set_by['at'])} ago: {set_by['reason']}")
    lines.append(f"  now {row['rule'] or '-'}: {row['reason'] or 'no decision yet'}")
    load = row["load"]
    if load is None:
        lines.append("  load: no signal from the routers yet")
    else:
        p90 = load["ttft_p90_s"]
        lines.append(
            f"  load: {num(load['queued'])} queued, {num(load['in_flight'])} in flight, "
            f"{num(load['uncached_tokens'])} uncached prompt tokens, TTFT p90 "
            f"{'-' if p90 is None else f'{p90:g} s'}, {num(load['rejected'])} refused"
        )
    t = row["targets"]
    targets = [
        f"{t['requests_per_replica']:g} requests per replica"
        if t["requests_per_replica"] is not None
        else None,
        f"TTFT p90 {t['ttft_p90_s']:g} s" if t["ttft_p90_s"] is not None else None,
    ]
    lines.append("  targets: " + ", ".join(x for x in targets if x))
    return "\n".join(lines)
