"""An event as the store keeps it: `Recorded` <-> (at, body JSON), and back.

The body is this module's: the event's fields by name, with the failure it was and
the repeat it suppresses (llmgw/cp/_observe/_events.py `Recorded`). `decode` reads
what an older or newer llmgw wrote as far as it can and raises `UsageError` naming
the row for anything it cannot read; the keeper skips such a row and says so.

Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.cp._observe._events import Event, Recorded
from llmgw.errors import UsageError

VERSION = 1  # the body's shape; a reader takes what it knows of any version


def encode(rec: Recorded) -> tuple[float, str]:
    e = rec.event
    body: dict[str, Any] = {
        "v": VERSION,
        "kind": e.kind,
        "message": e.message,
        "node": e.node_id,
        "replica": e.replica_id,
        "model": e.model_name,
        "shard": e.shard_id,
        "lines": list(e.lines),
    }
    if rec.failure is not None:
        body["failure"] = rec.failure
        body["strong"] = rec.strong
    if rec.seen is not None:
        body["seen"] = list(rec.seen)
    return e.at, json.dumps(body, separators=(",", ":"))


def _text(body: dict[str, Any], name: str, seq: int, *, optional: bool = True) -> str | None:
    value = body.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise UsageError(f"stored event {seq}: {name}: expected text, got {value!r:.60}")
    return value


def _seen_shape(seen: Any) -> bool:
    """Whether `seen` is one of the two shapes `Recorded.seen` takes."""
    if not isinstance(seen, list) or not seen:
        return False

    def text(x: Any) -> bool:
        return isinstance(x, str)

    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if seen[0] == "shard" and len(seen) == 5:
        _, node, shard, state, reason = seen
        return text(node) and text(shard) and text(state) and (reason is None or text(reason))
    if seen[0] == "gpu" and len(seen) == 6:
        _, node, index, kind, xid, line = seen
        return (
            text(node)
            and whole(index)
            and text(kind)
            and (xid is None or whole(xid))
            and (text(line))
        )
    return False


def decode(seq: int, at: float, body_json: str) -> Recorded:
    """The store's row `seq` as a `Recorded` (its `seq` is the store's; the log
    renumbers it on `replace`)."""
    try:
        body = json.loads(body_json)
    except ValueError as exc:
        raise UsageError(f"stored event {seq}: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise UsageError(f"stored event {seq}: expected a JSON object, got {body_json[:60]!r}")
    lines = body.get("lines") or []
    if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
        raise UsageError(f"stored event {seq}: lines: expected a list of text, got {lines!r:.60}")
    seen = body.get("seen")
    if seen is not None and not _seen_shape(seen):
        raise UsageError(
            f'stored event {seq}: seen: expected ["shard", node, shard, state, reason] or '
            f'["gpu", node, index, kind, xid, line], got {seen!r:.80}'
        )
    event = Event(
        seq=seq,
        at=float(at),
        kind=_text(body, "kind", seq, optional=False) or "",
        message=_text(body, "message", seq, optional=False) or "",
        node_id=_text(body, "node", seq),
        replica_id=_text(body, "replica", seq),
        model_name=_text(body, "model", seq),
        shard_id=_text(body, "shard", seq),
        lines=tuple(lines),
    )
    return Recorded(
        event,
        failure=_text(body, "failure", seq),
        strong=body.get("strong") is True,
        seen=tuple(seen) if seen is not None else None,
    )
