"""The tables `llmgw ctl` prints, from the admin API's JSON: pure, no I/O.

Every unknown prints as `-` (or `?` for a figure), never as 0. Each `format_*`
takes the API's rows (and `now` where an age is shown) and returns the text.
The weights tables are in `_weights`.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from typing import Any

from llmgw.ctl import _weights

FAILURE_LINES = 5  # output lines shown under a failure, by default


# --- the pieces ------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns as wide as their widest cell, two spaces apart, no trailing blanks."""
    all_rows = [tuple(header), *[tuple(r) for r in rows]]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in all_rows
    )


def with_notes(text: str, notes: dict[int, list[str]]) -> str:
    """`text` (a table) with `notes[i]` printed under its row i (line 0 is the header)."""
    out = []
    for i, line in enumerate(text.splitlines()):
        out.append(line)
        out += notes.get(i - 1, [])
    return "\n".join(out)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def num(value: float | None) -> str:
    """A figure for a table: unknown stays unknown."""
    if value is None:
        return "?"
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.2f}"


# --- nodes -----------------------------------------------------------------------------


def _gib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f}" if n < 100 * 2**30 else f"{n / 2**30:.0f}"


def _pair(used: int | None, total: int | None) -> str:
    if used is None and total is None:
        return "-"
    return f"{_gib(used)}/{_gib(total)}"


def _gpus(
    gpus: list[dict[str, Any]] | None,
    usage: list[dict[str, Any]] | None = None,
    shards: list[dict[str, Any]] | None = None,
) -> str:
    """`8xh100-80g`, then each card in MIG mode with its instances
    (`gpu 0 MIG 3g.40gb,2x1g.10gb`), each shared card with its replicas' claims
    (`gpu 0 shared 72/80 GiB: small-1a2b 24, ...`), then each card its agent marked
    unhealthy, and why."""
    if gpus is None:
        return "-"  # unknown: the agent could not tell
    if not gpus:
        return "0"
    counts: dict[str, int] = {}
    for gpu in gpus:
        counts[gpu["gpu_class"]] = counts.get(gpu["gpu_class"], 0) + 1
    cell = ",".join(f"{n}x{cls}" for cls, n in sorted(counts.items()))
    cell += "".join(f"; gpu {g['index']} {_mig(g)}" for g in gpus if g.get("mig_mode") == "enabled")
    cell += "".join(f"; {c}" for c in _claims(gpus, shards or []))
    sick = [_unhealthy(u) for u in usage or () if u.get("health") == "unhealthy"]
    return cell + "".join(f"; {s}" for s in sick)


def _claims(gpus: list[dict[str, Any]], shards: list[dict[str, Any]]) -> list[str]:
    """Each card shared by replicas (their `gpu_memory_mib` on it), with what each claims:
    `gpu 0 shared 72/80 GiB: small-1a2b 24, small-3c4d 24, small-5e6f 24`."""
    out = []
    for g in gpus:
        mine = sorted(
            (s for s in shards if g["uuid"] in (s.get("gpus") or ()) and s.get("gpu_memory_mib")),
            key=lambda s: s.get("replica_id") or s["shard_id"],
        )
        if not mine:
            continue
        claimed = sum(s["gpu_memory_mib"] for s in mine)
        total = g.get("memory_total_mib")
        of = "?" if total is None else f"{total / 1024:.0f}"
        each = ", ".join(f"{s.get('replica_id') or s['shard_id']} {_gib_of(s)}" for s in mine)
        out.append(f"gpu {g['index']} shared {claimed / 1024:.0f}/{of} GiB: {each}")
    return out


def _gib_of(shard: dict[str, Any]) -> str:
    return f"{shard['gpu_memory_mib'] / 1024:g}"


def _mig(gpu: dict[str, Any]) -> str:
    """`MIG 3g.40gb,2g.20gb,2x1g.10gb`: the instances by profile, in the card's order."""
    counts: dict[str, int] = {}
    for d in gpu.get("mig_devices") or ():
        counts[d["profile"]] = counts.get(d["profile"], 0) + 1
    profiles = ",".join(p if n == 1 else f"{n}x{p}" for p, n in counts.items())
    return f"MIG {profiles or 'no instances'}"


def _unhealthy(usage: dict[str, Any]) -> str:
    """`gpu 1 unhealthy: Xid 79 (GPU has fallen off the bus)`, as placement says it."""
    first = next((f for f in usage.get("faults") or () if f.get("unusable")), None)
    if first is None:
        return f"gpu {usage['index']} unhealthy"
    words = (
        f"Xid {first['xid']} ({first['meaning']})"
        if first.get("xid") is not None
        else first["meaning"]
    )
    return f"gpu {usage['index']} unhealthy: {words}"


def _disk(filesystems: list[dict[str, Any]]) -> str:
    # The node's own space only: a shared filer is not this node's disk.
    own = [f for f in filesystems if not f.get("shared")]
    if not own or any(f.get("free_bytes") is None or f.get("total_bytes") is None for f in own):
        return "-"
    return f"{_gib(sum(f['free_bytes'] for f in own))}/{_gib(sum(f['total_bytes'] for f in own))}"


_PERCENT = re.compile(r"(\d+(?:\.\d+)?) ?%")


def format_engines(engines: dict[str, Any] | None) -> str:
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
    """`ctl nodes`; every unknown is `-`, never 0."""
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
                age(now - n["since"]),
                age(None if n.get("last_seen") is None else now - n["last_seen"]),
                _gpus(inv.get("gpus"), usage.get("gpus"), shards),
                _pair(used, total),
                _disk(usage.get("filesystems") or []),
                format_engines(inv.get("engines")),
                f"{ready}/{len(shards)}" if shards else "-",
                _warn(inv.get("warnings") or []) if n["state"] == "ready" else n["state_reason"],
            )
        )
    return table(header, rows)


# --- the catalog and its replicas ------------------------------------------------------


def format_models(models: list[dict[str, Any]]) -> str:
    """`ctl models`: each model, the names it is served as, and its profiles."""
    rows = []
    for m in models:
        profiles = "; ".join(
            f"{p['engine']} {p.get('gpu_class') or 'cpu'}"
            + (f" x{p['gpus_per_node']}" if p.get("gpus_per_node") else "")
            + (f" {p['nodes']} nodes" if p.get("nodes", 1) > 1 else "")
            for p in m["profiles"]
        )
        names = ",".join(m.get("served_names") or [m["name"]])
        rows.append((m["name"], names, str(m["replicas"]), m["source"], profiles))
    return table(("MODEL", "SERVED AS", "REPLICAS", "SOURCE", "PROFILES"), rows)


def format_replicas(replicas: list[dict[str, Any]], *, now: float, lines: int) -> str:
    """`ctl replicas`: a row each, its reason's further lines under it, then its download's
    progress and its last failure with `lines` of the engine's output."""
    rows = []
    notes: dict[int, list[str]] = {}
    for r in replicas:
        reason = (r.get("reason") or "-").splitlines()
        rows.append(
            (
                r["model"],
                r["replica"] or "-",
                r["state"],
                ",".join(r["nodes"]) or "-",
                age(None if r["since"] is None else now - r["since"]),
                "stale" if r["stale"] else "-",
                reason[0],
            )
        )
        rows += [("", "", "", "", "", "", line) for line in reason[1:]]
        below = []
        if r.get("progress"):
            below.append("  " + _weights.format_progress(r["progress"]))
        if r.get("last_failure"):
            below += format_failure(r["last_failure"], r["replica"], now=now, lines=lines)
        if below:
            notes[len(rows) - 1] = below
    header = ("MODEL", "REPLICA", "STATE", "NODES", "AGE", "STALE", "REASON")
    return with_notes(table(header, rows), notes)


def format_failure(
    failure: dict[str, Any], replica: str | None, *, now: float, lines: int = FAILURE_LINES
) -> list[str]:
    """The lines under a replica: why it (or the one it replaces) failed, and the output."""
    where = f" on {failure['node_id']}" if failure.get("node_id") else ""
    if failure.get("shard_id"):
        where += f" (shard {failure['shard_id']})"
    ago = age(now - failure["at"])
    if failure["replica_id"] == replica:
        head = f"  last failure {ago} ago{where}: {failure['reason']}"
    else:
        head = f"  replaces {failure['replica_id']}, failed {ago} ago{where}: {failure['reason']}"
    shown = failure.get("lines") or []
    return [head, *(f"      {line}" for line in shown[-lines:] if lines > 0)]


def format_events(events: list[dict[str, Any]], *, now: float) -> str:
    """`ctl events`: newest as the API orders them, each with its last output lines."""
    rows = []
    notes: dict[int, list[str]] = {}
    for e in events:
        rows.append((age(now - e["at"]), e["kind"], e["node_id"] or "-",
                     e["replica_id"] or "-", e["message"]))  # fmt: skip
        if e["lines"]:
            notes[len(rows) - 1] = [f"      {line}" for line in e["lines"][-FAILURE_LINES:]]
    return with_notes(table(("AGO", "KIND", "NODE", "REPLICA", "WHAT"), rows), notes)


def format_status(models: list[dict[str, Any]], *, now: float) -> str:
    """`ctl status`: desired and ready replicas per model, an autoscaled model's range
    (MIN-MAX; `-` for a fixed count) and why it wants what it wants, and why one is short."""
    rows = []
    for m in models:
        note = []
        scale = m.get("autoscale")
        if scale is not None:
            if scale["paused"] is not None:
                p = scale["paused"]
                note.append(f"paused at {p['replicas']} by {p['by']} {age(now - p['at'])} ago")
            set_by = scale.get("set_by")
            if set_by is not None:
                note.append(f"{set_by['reason']} ({age(now - set_by['at'])} ago)")
            else:
                note.append(scale["reason"] or "no decision yet (no signal from the routers)")
        if m["unplaced"]:
            note.append(m.get("no_room") or "unplaced")
        failure = m.get("last_failure")
        if failure:
            note.append(f"{failure['replica_id']} failed {age(now - failure['at'])} ago: "
                        f"{failure['reason']}")  # fmt: skip
        span = f"{scale['min']}-{scale['max']}" if scale is not None else "-"
        rows.append((m["model"], str(m["desired"]), str(m["ready"]), span, "; ".join(note) or "-"))
    return table(("MODEL", "DESIRED", "READY", "AUTOSCALE", "NOTE"), rows)


def format_traffic(splits: list[dict[str, Any]]) -> str:
    """`ctl status`'s splits: each version's weight, its share of the drawn requests now
    (a version with no ready replica takes none), its ready replicas and pinned keys."""
    rows = []
    for split in splits:
        for i, v in enumerate(split["versions"]):
            rows.append((
                split["name"] if i == 0 else "", v["model"], str(v["weight"]),
                f"{v['share'] * 100:.0f} %", str(v["ready"]), ", ".join(v["keys"]) or "-",
            ))  # fmt: skip
    return table(("SPLIT", "VERSION", "WEIGHT", "SHARE", "READY", "PINNED KEYS"), rows)


def format_route(data: dict[str, Any]) -> str:
    """`ctl route`: the router's choice and why, the request's size, the bound, and each
    candidate endpoint (the chosen one starred)."""
    r, bound = data["request"], data["bound"]
    out = [f"{data['model']}: {data['chosen'] or 'no endpoint'} ({data['policy']}): "
           f"{data['reason']}"]  # fmt: skip
    out.append(f"  prompt: {num(r['prompt_bytes'])} bytes, {num(r['prompt_blocks'])} blocks of "
               f"{r['block_bytes']}, ~{num(r['estimated_prompt_tokens'])} tokens; "
               f"~{num(r['expected_output_tokens'])} output tokens")  # fmt: skip
    most = bound["max_requests_per_endpoint"]
    out.append(f"  bound: at most {most} request{'s' if most != 1 else ''} per endpoint "
               f"(epsilon {bound['epsilon']:g}, average {num(bound['average_load'])})")  # fmt: skip
    rows = []
    for c in data["candidates"]:
        sc = c["scraped"]
        state = "ok" if c["healthy"] and c["breaker_allows"] else (
            "unhealthy" if not c["healthy"] else "circuit open")  # fmt: skip
        if state == "ok" and not c["within_bound"]:
            state = "over bound"
        scraped = (f"run {num(sc['running'])} wait {num(sc['waiting'])} "
                   f"kv {num(sc['kv_usage'])} age {num(sc['age_s'])}s")  # fmt: skip
        rows.append((
            ("* " if c["endpoint"] == data["chosen"] else "  ") + c["endpoint"], state,
            num(c["cost"]), num(c["cached_tokens"]), str(c["in_flight"]),
            num(c["pending_prefill_tokens"]), num(c["pending_decode_tokens"]),
            num(c["external_requests"]), scraped,
        ))  # fmt: skip
    out.append(table(("ENDPOINT", "STATE", "COST", "CACHED", "IN-FLIGHT", "PREFILL", "DECODE",
                      "EXTERNAL", "SCRAPED"), rows))  # fmt: skip
    return "\n".join(out)


# --- accounts --------------------------------------------------------------------------


def format_keys(keys: list[dict[str, Any]]) -> str:
    """`ctl keys list`: never a secret (the API has none to give)."""
    rows = [
        (
            k["key_id"],
            k["tenant"],
            ",".join(k["models"]) if k["models"] is not None else "all",
            k["default_band"],
            k["max_band"],
            "never" if k.get("expires_at") is None else when(k["expires_at"]),
            k.get("state") or ("revoked" if k["revoked"] else "active"),
            k["name"] or "-",
        )
        for k in keys
    ]
    header = ("KEY", "TENANT", "MODELS", "BAND", "MAX BAND", "EXPIRES", "STATE", "NAME")
    return table(header, rows)


def format_tenants(tenants: list[dict[str, Any]]) -> str:
    """`ctl tenants`: a limit that is not set is `-`."""
    rows = [
        (t["name"], "-" if t["rpm"] is None else str(t["rpm"]),
         "-" if t["tpm"] is None else str(t["tpm"]), t["max_band"] or "-", str(t["keys"]))
        for t in tenants
    ]  # fmt: skip
    return table(("TENANT", "RPM", "TPM", "MAX BAND", "KEYS"), rows)


def format_usage(rows_in: list[dict[str, Any]], totals: dict[str, Any]) -> str:
    """`ctl usage`: a row per hour, tenant, key and model, then the totals."""
    rows = [
        (when(r["hour"]), r["tenant"], r["key_id"], r["model"], str(r["requests"]),
         str(r["prompt_tokens"]), str(r["completion_tokens"]))
        for r in rows_in
    ]  # fmt: skip
    t = totals
    rows.append(("total", "", "", "", str(t["requests"]), str(t["prompt_tokens"]),
                 str(t["completion_tokens"])))  # fmt: skip
    header = ("HOUR", "TENANT", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION")
    return table(header, rows)


def format_audit(entries: list[dict[str, Any]]) -> str:
    """`ctl audit`: who did what, newest first as the API orders it."""
    rows = [(when(e["at"]), e["actor"], e["action"], e["detail"]) for e in entries]
    return table(("AT", "WHO", "ACTION", "DETAIL"), rows) if rows else "no operator actions yet"
