"""`llmgw ctl` on weights: a download's progress line, `ctl weights`, what each fabric holds.

Pure formatting of the admin API's JSON; unknown stays unknown: no percentage, rate
or time left is shown that the answer does not hold.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def _scaled(n: float, size: int) -> str:
    value = n / size
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def binary_unit(n: int) -> tuple[str, int]:
    for unit, size in _BINARY:
        if n >= size:
            return unit, size
    return "B", 1


def gib(n: int) -> str:
    """`n` bytes in binary units: "6.1 GiB", "310 MiB", "12 B"."""
    unit, size = binary_unit(n)
    return f"{n} B" if size == 1 else f"{_scaled(n, size)} {unit}"


def gb(n: int) -> str:
    """`n` bytes in decimal units, as disks are sold: "14.2 GB", "3 B"."""
    for unit, size in _DECIMAL:
        if n >= size:
            return f"{_scaled(n, size)} {unit}"
    return f"{n} B"


def rate(bytes_per_s: float) -> str:
    for unit, size in _DECIMAL[1:]:
        if bytes_per_s >= size:
            value = bytes_per_s / size
            return f"{value:.0f} {unit}/s" if value >= 10 else f"{value:.1f} {unit}/s"
    return f"{bytes_per_s:.0f} B/s"


def about(seconds: float) -> str:
    """A time left, rounded as a person would say it: "about 30 s left"."""
    if seconds < 10:
        return f"about {max(1, round(seconds))} s left"
    if seconds < 60:
        return f"about {round(seconds / 5) * 5} s left"
    if seconds < 3600:
        return f"about {round(seconds / 60)} min left"
    return f"about {seconds / 3600:.1f} h left"


def source_name(source: str) -> str:
    """The source's last path segment, with its trailing / for a version:
    `mirror:/models/qwen-7b/` -> `qwen-7b/`, `https://h/x.gguf?sig=…` -> `x.gguf`."""
    path = re.split(r"[?#]", source, maxsplit=1)[0] if "://" in source else source
    version = path.endswith("/")
    last = path.rstrip("/").rsplit("/", 1)[-1].removeprefix("mirror:")
    return (last or path) + ("/" if version and last else "")


def format_progress(p: dict[str, Any]) -> str:
    """The line under a downloading replica, from the API's `progress` object."""
    done, total = int(p["done_bytes"]), p.get("total_bytes")
    bps, eta = p.get("rate_bytes_per_s"), p.get("eta_s")
    if total is not None and total > 0:
        unit, size = binary_unit(int(total))
        if size == 1:
            amount = f"{done}/{total} B"
        else:
            amount = f"{_scaled(done, size)}/{_scaled(total, size)} {unit}"
        pct = min(99, done * 100 // total) if done < total else 100
        parts = [f"downloading {source_name(p['source'])} {amount} ({pct} %)"]
    else:
        parts = [f"downloading {source_name(p['source'])} {gib(done)} so far"]
    if bps is not None and bps > 0:
        parts.append(rate(bps))
        if eta is not None and total is not None:
            parts.append(about(eta))
    return ", ".join(parts)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    all_rows = [tuple(header), *[tuple(r) for r in rows]]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(header))]
    return [
        indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in all_rows
    ]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _shown(path: str, base: str | None) -> str:
    if base and path.startswith(base.rstrip("/") + "/"):
        return path[len(base.rstrip("/")) + 1 :]
    return path


def format_weights(nodes: list[dict[str, Any]]) -> str:
    """`ctl weights`: per node what it holds (size, wanted by which model) and what would
    be reclaimed."""
    out: list[str] = []
    for n in nodes:
        where = n.get("weights_dir") or "no weights directory reported"
        state = "" if n.get("connected") else f" ({n['state']}, not connected)"
        out.append(f"{n['node']}{state}: {where}")
        if not n.get("reported"):
            out.append("  has not reported its weights")
            continue
        if not n["held"]:
            out.append("  holds nothing")
        else:
            rows = []
            for h in n["held"]:
                name = _shown(h["path"], n.get("weights_dir"))
                name += "/" if h["kind"] in ("cache", "dir") else ""
                what = "fetched" if h["kind"] == "cache" else "operator's"
                files = f" ({_plural(h['files'], 'file')})" if h["kind"] != "file" else ""
                wanted = ", ".join(h["wanted_by"]) or "not wanted"
                rows.append((name, what + files, gb(h["size_bytes"]), wanted))
            out += _table(("HELD", "KIND", "SIZE", "WANTED BY"), rows, "  ")
        for u in n.get("unfinished") or ():
            name = _shown(u["path"], n.get("weights_dir"))
            wanted = ", ".join(u["wanted_by"]) or "not wanted"
            out.append(f"  unfinished: {name}/ ({gb(u['size_bytes'])} so far), wanted by: {wanted}")
        reclaim = n["reclaimable"]
        if reclaim:
            names = ", ".join(_shown(r["path"], n.get("weights_dir")) for r in reclaim)
            entries = "1 entry" if len(reclaim) == 1 else f"{len(reclaim)} entries"
            out.append(f"  would reclaim {entries} ({gb(n['reclaimable_bytes'])}): {names}")
        else:
            out.append("  nothing to reclaim")
    return "\n".join(out) if out else "no nodes have registered"


def format_collect(answer: dict[str, Any]) -> list[str]:
    """The summary of a reclaim: one line, then each refusal's detail and each error."""
    nodes = answer["nodes"]
    dry = bool(answer.get("dry_run"))
    asked = sum(len(n["asked"]) for n in nodes)
    sizes = [n.get("asked_bytes") for n in nodes if n["asked"]]
    asked_size = f" ({gb(sum(sizes))})" if sizes and None not in sizes else ""
    removed = sum(len(n["removed"]) for n in nodes)
    freed = sum(n["freed_bytes"] for n in nodes)
    dry_run = " (dry run)" if dry else ""
    clauses = [f"asked to remove {_plural(asked, 'file')}{asked_size}{dry_run}"]
    if asked:
        verb = "would remove" if dry else "removed"
        clauses.append(f"{verb} {removed} ({gb(freed)})")
    details: list[str] = []
    for n in nodes:
        by_reason: dict[str, int] = {}
        for r in n["refused"]:
            by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
            details.append(f"  {n['node']}: {r['detail']}")
        if len(by_reason) == 1:
            ((reason, count),) = by_reason.items()
            clauses.append(f"{n['node']} refused {count}: {reason}")
        elif by_reason:
            parts = ", ".join(f"{c} {r}" for r, c in sorted(by_reason.items()))
            clauses.append(f"{n['node']} refused {len(n['refused'])}: {parts}")
        if n.get("error"):
            clauses.append(f"{n['node']} failed")
            details.append(f"  {n['node']}: {n['error']}")
    return ["; ".join(clauses), *details]


def format_fabrics(fabrics: list[dict[str, Any]]) -> list[str]:
    """`ctl status`: per fabric, the catalog models whose weights some node on it holds."""
    rows = []
    for f in fabrics:
        held = ", ".join(
            f"{m['model']} ({gb(m['bytes'])} on {_plural(len(m['nodes']), 'node')})"
            for m in f["models"]
        )
        rows.append((f["fabric"] or "no fabric", ",".join(f["nodes"]) or "-", held or "-"))
    return _table(("FABRIC", "NODES", "HOLDS"), rows) if rows else []
