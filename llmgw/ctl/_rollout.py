"""`llmgw ctl rollout status|pause|resume|undo MODEL`: a changed model's rolling replacement
(the admin API's /api/v1/rollouts; the rule is llmgw/core/_rollout.py)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from llmgw.ctl._client import api


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rollout = sub.add_parser(
        "rollout",
        help="a changed model's rolling replacement: status, pause, resume, undo",
        description="When a model's profile, source, engine or served names change in "
        "server.yaml, its replicas are replaced a few at a time (the model's rollout: "
        "max_surge, max_unavailable, max_failures). `status` shows how far each is; `pause` "
        "holds it where it is; `resume` goes on (and retries one that stopped itself); "
        "`undo` goes back to the previous version while server.yaml still says the new one.",
    )
    verbs = rollout.add_subparsers(dest="verb", required=True)
    status = verbs.add_parser("status", help="how far MODEL's rollout is (every model without)")
    status.add_argument("model", nargs="?", default=None)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=show)
    for verb, text in (
        ("pause", "start and retire nothing more (what is retiring finishes)"),
        ("resume", "go on with a paused rollout, or retry one that stopped itself"),
        ("undo", "roll back to the version before (again: forward to server.yaml's)"),
    ):
        p = verbs.add_parser(verb, help=text)
        p.add_argument("model")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=command, verb=verb)


def show(args: argparse.Namespace) -> int:
    if args.model is None:
        rows = api(args, "GET", "/api/v1/rollouts")["rollouts"]
    else:
        rows = [api(args, "GET", f"/api/v1/rollouts/{args.model}")]
    if args.json:
        print(json.dumps(rows if args.model is None else rows[0], indent=2))
        return 0
    print("\n\n".join(format_rollout(r, now=time.time()) for r in rows) or "no models")
    return 0


def command(args: argparse.Namespace) -> int:
    row = api(args, "POST", f"/api/v1/rollouts/{args.model}/{args.verb}", {})
    print(json.dumps(row, indent=2) if args.json else format_rollout(row, now=time.time()))
    return 0


def format_rollout(row: dict[str, Any], *, now: float) -> str:
    """One model's rollout, for an operator."""
    name = row["model"]
    reps = row["replicas"]
    head = f"{name}: {reps['new_ready']} of {reps['wanted']} ready on {_fps(row['fingerprints'])}"
    if reps["old"]:
        head += f", {reps['old']} old"
    lines = [head]
    if row["phase"] is None:
        lines.append("  never rolled out by this control plane")
        return "\n".join(lines)
    ago = f"{now - row['started_at']:.0f} s ago" if row["started_at"] is not None else "-"
    lines.append(
        f"  rollout {row['phase']}: {_fps(row['previous'])} -> {_fps(row['to'])}, began {ago}"
    )
    if row["status"]:
        lines.append(f"  {row['status']}")
    if row["undone"]:
        lines.append(
            f"  undone: running {_fps(row['fingerprints'])} while server.yaml says "
            f"{_fps(row['file_fingerprints'])} (`llmgw ctl rollout undo {name}` again goes forward)"
        )
    policy = row["policy"]
    lines.append(
        f"  max_surge {policy['max_surge']}, max_unavailable {policy['max_unavailable']}, "
        f"failures {row['failures']} of {policy['max_failures']}"
    )
    return "\n".join(lines)


def _fps(fps: list[str] | None) -> str:
    if not fps:
        return "(unknown)"
    return ",".join(f[:8] for f in fps)
