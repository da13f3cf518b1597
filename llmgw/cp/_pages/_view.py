"""What the admin pages show, decided from the admin API's JSON: no I/O here.

Absent is not zero: every figure nobody reported reads as "—" (`DASH`), a bar
without a figure has no `data-value`, and a chart's absent sample starts a new
segment (an `M` move) instead of a line down to 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from llmgw.core import bytes_text

DASH = "—"
MIB = 1 << 20


def fmt_bytes(n: float | None) -> str:
    return DASH if n is None else bytes_text(n)


def fmt_num(x: float | None, digits: int = 1) -> str:
    return DASH if x is None else f"{x:.{digits}f}"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172800:
        return f"{s // 3600} h"
    return f"{s // 86400} d"


def fmt_time(unix: float | None) -> str:
    if unix is None:
        return DASH
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix)) + " UTC"


def percent(part: float | None, whole: float | None) -> float | None:
    if part is None or whole is None or whole <= 0:
        return None
    return max(0.0, min(100.0, 100.0 * part / whole))


def engine_lines(engines: Mapping[str, Any] | None) -> list[str]:
    """One line per engine the node runs, then one per declared engine it cannot run yet."""
    if engines is None:
        return []
    found = [f"{e.get('name')} {e.get('version') or '?'} ({e.get('state')})"
             for e in engines.get("found") or ()]  # fmt: skip
    pending = [f"{p.get('name')}: {p.get('state')} — {p.get('detail')}"
               for p in engines.get("pending") or ()]  # fmt: skip
    return found + pending


@attrs.frozen
class Bar:
    value: float | None  # percent, None: not reported
    label: str


def node_row(node: Mapping[str, Any], now: float) -> dict[str, Any]:
    """One row of the cluster page's node table, from one /api/v1/nodes entry."""
    inv = node.get("inventory") or {}
    usage = inv.get("usage") or {}
    cpu = usage.get("cpu_util_pct")
    total = usage.get("memory_total_bytes")
    avail = usage.get("memory_available_bytes")
    used = None if total is None or avail is None else total - avail
    gpus = inv.get("gpus")
    if gpus is None:
        gpu_text = DASH
    elif not gpus:
        gpu_text = "none"
    else:
        classes: dict[str, int] = {}
        for g in gpus:
            classes[g.get("gpu_class") or "?"] = classes.get(g.get("gpu_class") or "?", 0) + 1
        gpu_text = ", ".join(f"{n}\u00d7 {c}" for c, n in sorted(classes.items()))
    disks = []
    for fs in usage.get("filesystems") or ():
        shared = " (shared)" if fs.get("shared") else ""
        disks.append(
            f"{fs.get('mount')}{shared}: {fmt_bytes(fs.get('free_bytes'))} free of "
            f"{fmt_bytes(fs.get('total_bytes'))}"
        )
    engine_items = [DASH] if inv.get("engines") is None else engine_lines(inv["engines"])
    engine_items = engine_items or ["none"]
    shards = [f"{s.get('shard_id')} {s.get('model')} ({s.get('state')})"
              for s in node.get("shards") or ()]  # fmt: skip
    warnings = list(inv.get("warnings") or ())
    state = str(node.get("state"))
    if node.get("draining"):
        state += " (draining)"
    elif node.get("cordoned"):
        state += " (cordoned)"
    since = node.get("since")
    count = (inv.get("host") or {}).get("cpu_count")
    cpus = f"{DASH} CPUs" if count is None else f"{count} CPU{'' if count == 1 else 's'}"
    return {
        "id": str(node.get("node_id")),
        "state": state,
        "state_reason": node.get("state_reason") or "",
        "since": fmt_age(None if since is None else now - since) + " ago"
        if since is not None
        else DASH,
        "cpu": Bar(cpu, f"{DASH if cpu is None else f'{cpu:.0f} %'} of {cpus}"),
        "ram": Bar(
            percent(used, total),
            DASH if used is None else f"{fmt_bytes(used)} of {fmt_bytes(total)}",
        ),
        "gpus": gpu_text,
        "disk": disks or [DASH],
        "engines": engine_items,
        "shards": shards or ["none"],
        "warnings": warnings,
    }


def _mig_text(gpu: Mapping[str, Any]) -> str | None:
    """`MIG 3g.40gb, 2g.20gb, 2x1g.10gb`, and a mode change waiting for a reset; None: no MIG."""
    mode, pending = gpu.get("mig_mode"), gpu.get("mig_pending")
    if mode != "enabled" and pending is None:
        return None
    counts: dict[str, int] = {}
    for d in gpu.get("mig_devices") or ():
        counts[d["profile"]] = counts.get(d["profile"], 0) + 1
    text = "MIG " + (", ".join(p if n == 1 else f"{n}x{p}" for p, n in counts.items()) or
                     ("no instances" if mode == "enabled" else str(mode or DASH)))  # fmt: skip
    return text + (f" ({pending} after a GPU reset)" if pending is not None else "")


def _claims_text(gpu: Mapping[str, Any], shards: Any) -> str | None:
    """`shared: 72 GiB claimed (small-1a2b 24, ...)`: the replicas sharing the card and
    what each claims of it; None: no replica shares it."""
    mine = sorted(
        (s for s in shards if gpu.get("uuid") in (s.get("gpus") or ()) and s.get("gpu_memory_mib")),
        key=lambda s: s.get("replica_id") or s.get("shard_id") or "",
    )
    if not mine:
        return None
    each = ", ".join(
        f"{s.get('replica_id') or s.get('shard_id')} {s['gpu_memory_mib'] / 1024:g}" for s in mine
    )
    return f"shared: {sum(s['gpu_memory_mib'] for s in mine) / 1024:g} GiB claimed ({each})"


def node_figures(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node page's current figures and its GPUs and shards, from one /api/v1/nodes entry."""
    inv = node.get("inventory") or {}
    usage = inv.get("usage") or {}
    total = usage.get("memory_total_bytes")
    avail = usage.get("memory_available_bytes")
    used = None if total is None or avail is None else total - avail
    cpu = usage.get("cpu_util_pct")
    loads = [usage.get("load1"), usage.get("load5"), usage.get("load15")]
    gpu_usage = {g.get("index"): g for g in usage.get("gpus") or ()}
    gpus = []
    for g in inv.get("gpus") or ():
        u = gpu_usage.get(g.get("index"), {})
        mem_used = u.get("memory_used_mib", g.get("memory_used_mib"))
        util = u.get("utilization_pct", g.get("utilization_pct"))
        total_mib = g.get("memory_total_mib")
        gpus.append({
            "index": g.get("index"),
            "name": g.get("name"),
            "mig": _mig_text(g),
            "claims": _claims_text(g, node.get("shards") or ()),
            "util": fmt_num(util, 0) + (" %" if util is not None else ""),
            "memory": f"{fmt_bytes(None if mem_used is None else mem_used * MIB)} of "
                      f"{fmt_bytes(None if total_mib is None else total_mib * MIB)}",
            "ecc": DASH if u.get("ecc_uncorrected", g.get("ecc_uncorrected")) is None
                   else str(u.get("ecc_uncorrected", g.get("ecc_uncorrected"))),
            "health": _gpu_health(u),
        })  # fmt: skip
    shard_usage = {s.get("shard_id"): s for s in usage.get("shards") or ()}
    shards = []
    for s in node.get("shards") or ():
        u = shard_usage.get(s.get("shard_id"), {})
        cores = u.get("cpu_cores")
        shards.append({
            "id": s.get("shard_id"), "model": s.get("model_name") or s.get("model"),
            "engine": s.get("engine"), "state": s.get("state"),
            "cores": fmt_num(cores, 2), "memory": fmt_bytes(u.get("rss_bytes")),
        })  # fmt: skip
    return {
        "state": str(node.get("state")),
        "cpu": DASH if cpu is None else f"{cpu:.0f} %",
        "ram": DASH if used is None else f"{fmt_bytes(used)} of {fmt_bytes(total)}",
        "load": " / ".join(fmt_num(x, 2) for x in loads),
        "disk": [
            f"{fs.get('mount')}: {fmt_bytes(fs.get('free_bytes'))} free of "
            f"{fmt_bytes(fs.get('total_bytes'))}"
            for fs in usage.get("filesystems") or ()
        ]
        or [DASH],
        "gpus": gpus,
        "shards": shards,
        "engines": engine_lines(inv.get("engines"))
        or ([DASH] if inv.get("engines") is None else ["none"]),
    }


# --- charts ---------------------------------------------------------------------------


@attrs.frozen
class Chart:
    name: str
    lines: tuple[str, ...]  # one SVG path `d` per series
    points: int  # samples drawn (not absent)
    top: float | None  # the y axis' top; None: nothing to draw
    width: int
    height: int
    # A sample alone between gaps is a path of one move, which draws nothing: a dot.
    dots: tuple[tuple[float, float], ...] = ()
    unit: str = ""  # "%", "bytes" or "": how the top is written

    @property
    def top_label(self) -> str:
        if self.top is None:
            return DASH
        if self.unit == "bytes":
            return fmt_bytes(self.top)
        return f"{self.top:.3g}{' %' if self.unit == '%' else ''}"


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    f = float(x)
    return f if math.isfinite(f) else None


def chart(
    name: str, series: Sequence[Sequence[Any]], *, top: float | None = None,
    width: int = 360, height: int = 80, unit: str = "",
) -> Chart:  # fmt: skip
    """Paths for `series` (each a list of samples, None absent): an absent sample ends a
    segment and the next present one starts another with `M`."""
    values = [[_number(x) for x in s] for s in series]
    present = [v for s in values for v in s if v is not None]
    if not present:
        return Chart(name, (), 0, None, width, height, unit=unit)
    high = top if top is not None else max(present)
    high = high if high > 0 else 1.0
    lines = []
    dots = []
    for s in values:
        n = len(s)
        step = width / max(1, n - 1)
        parts: list[str] = []
        pen_down = False
        for i, v in enumerate(s):
            if v is None:
                pen_down = False
                continue
            x = i * step
            y = height - min(max(v, 0.0), high) / high * height
            parts.append(f"{'L' if pen_down else 'M'}{x:.1f},{y:.1f}")
            if not pen_down and (i + 1 >= n or s[i + 1] is None):
                dots.append((round(x, 1), round(y, 1)))
            pen_down = True
        if parts:
            lines.append(" ".join(parts))
    return Chart(name, tuple(lines), len(present), high, width, height, tuple(dots), unit)


def _lists(tree: Any, want: Iterable[str]) -> list[list[Any]]:
    """The sample lists under `tree` whose key contains every word of `want`."""
    words = tuple(want)
    found: list[list[Any]] = []
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if isinstance(value, list) and all(w in str(key) for w in words):
                found.append(value)
    return found


def history_since(history: Mapping[str, Any] | None) -> str | None:
    """ "history since 06:12 UTC (this control plane took over then)" when this control
    plane holds less than the window of the node's history; None when it holds it all.
    The chart's empty stretch before that is not an idle node: nothing was kept here."""
    if not history:
        return None
    since, start = history.get("since"), history.get("start")
    if not isinstance(since, (int, float)) or not isinstance(start, (int, float)):
        return None
    if since <= start + float(history.get("resolution_s") or 0):
        return None
    kept = history.get("kept_since") or {}
    at, why = kept.get("at"), kept.get("why")
    if isinstance(at, (int, float)) and why and since - at <= SINCE_SLACK_S:
        reason = f"this control plane {why} then"
    else:
        reason = "the node first reported to this control plane then"
    shown = time.strftime("%H:%M", time.gmtime(since))
    return f"history since {shown} UTC ({reason}); before it, nothing was kept here"


# A node that reports to a control plane this soon after it started or took over had
# its earlier history there, not nowhere.
SINCE_SLACK_S = 120.0


def history_charts(history: Mapping[str, Any] | None) -> list[Chart]:
    """The node page's six charts from GET /api/v1/nodes/{node}/history."""
    series = (history or {}).get("series") or {}
    gpus = series.get("gpus") or {}
    fss = series.get("filesystems") or {}
    gpu_util = [s for g in gpus.values() for s in _lists(g, ("util",))]
    gpu_mem = [s for g in gpus.values() for s in _lists(g, ("memory", "used"))]
    disk = [s for f in fss.values() for s in _lists(f, ("free",))]
    memory = _lists(series, ("memory", "used"))
    load = _lists(series, ("load1",))[:1] or _lists(series, ("load",))[:1]
    return [
        chart("cpu", _lists(series, ("cpu",)), top=100.0, unit="%"),
        chart("memory", memory, unit="bytes"),
        chart("load", load),
        chart("disk", disk, unit="bytes"),
        chart("gpu-util", gpu_util, top=100.0, unit="%"),
        chart("gpu-memory", gpu_mem, unit="bytes"),
    ]


# --- mirror ---------------------------------------------------------------------------


def mirror_rows(
    entries: Sequence[tuple[str, int]],
    models: Sequence[Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """The mirror page: each held path, its size, the models whose source is under it, and
    a warning when no node reports an engine that could serve one of those models."""
    engines_seen: set[Any] = set()
    for n in nodes:
        found = ((n.get("inventory") or {}).get("engines") or {}).get("found") or ()
        engines_seen.update(e.get("name") for e in found)
    rows = []
    for path, size in entries:
        using = []
        unserved = []
        for m in models:
            source = str(m.get("source") or "")
            if not source.startswith("mirror:"):
                continue
            wanted = "/" + source.removeprefix("mirror:").strip("/")
            if (
                wanted == path
                or wanted.startswith(path.rstrip("/") + "/")
                or (path.startswith(wanted.rstrip("/") + "/"))
            ):
                using.append(str(m.get("name")))
                needs = {p.get("engine") for p in m.get("profiles") or ()}
                if not needs & engines_seen:
                    unserved.append(
                        f"no node reports an engine that could serve {m.get('name')} "
                        f"(it needs {' or '.join(sorted(str(x) for x in needs)) or 'an engine'})"
                    )
        rows.append({"path": path, "size": fmt_bytes(size), "models": using,
                     "warnings": unserved})  # fmt: skip
    return rows


def _gpu_health(usage: dict[str, Any]) -> str:
    """`ok`, or `unhealthy: Xid 79 (GPU has fallen off the bus)` as `ctl nodes` says it;
    a dash from an agent that does not say (older than the field)."""
    health = usage.get("health")
    if health is None:
        return DASH
    first = next((f for f in usage.get("faults") or () if f.get("unusable")), None)
    if health != "unhealthy" or first is None:
        return str(health)
    xid = first.get("xid")
    words = f"Xid {xid} ({first.get('meaning')})" if xid is not None else first.get("meaning")
    return f"unhealthy: {words}"
