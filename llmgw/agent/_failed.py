"""Failed shards' directories, logs included, kept under `<state_dir>/failed/`.

When a failed shard is stopped (or its id started again) its directory moves
to `failed/<id>@<unix ms>/`, so that `logs` can still say what happened; the
newest `kept` stay and older ones are deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from llmgw import model
from llmgw.agent import _runfile
from llmgw.agent._shard import Shard
from llmgw.errors import LlmgwError

# Part of the supervisor, as operators know it.
log = logging.getLogger("llmgw.agent.supervisor")

FAILED_KEPT = 5  # failed shards whose directories are kept, newest first


class FailedShards:
    def __init__(self, failed_dir: Path, kept: int = FAILED_KEPT) -> None:
        self.dir = failed_dir
        self.kept_count = kept

    def __repr__(self) -> str:
        return f"<FailedShards {self.dir} keeps {self.kept_count}>"

    def keep(self, shard: Shard) -> None:
        failed_at = shard.failed_at if shard.failed_at is not None else time.time()
        dest = self.dir / f"{shard.spec.shard_id}@{int(failed_at * 1000)}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(shard.dir, dest)
        except OSError as exc:
            log.warning("shard %s: cannot keep its logs (%s)", shard.spec.shard_id, exc)
            shutil.rmtree(shard.dir, ignore_errors=True)
            return
        for old in self.kept()[self.kept_count :]:
            shutil.rmtree(old, ignore_errors=True)

    def kept(self) -> list[Path]:
        """Kept failed shards' directories, newest first."""
        try:
            entries = [p for p in self.dir.iterdir() if p.is_dir() and "@" in p.name]
        except OSError:
            return []

        def when(p: Path) -> int:
            stamp = p.name.rpartition("@")[2]
            return int(stamp) if stamp.isascii() and stamp.isdigit() else 0

        return sorted(entries, key=when, reverse=True)

    def kept_for(self, shard_id: str) -> Path | None:
        for path in self.kept():
            if path.name.rpartition("@")[0] == shard_id:
                return path
        return None


def read_kept(
    path: Path,
) -> tuple[tuple[model.ProcessSpec, ...], Path, tuple[float | None, str | None]]:
    """What a kept failed shard's directory says: its processes, where, and when and why."""
    run = _runfile.read_run(path)
    try:
        processes = _runfile.read_spec(path).processes
    except (OSError, ValueError, LlmgwError):
        names = sorted({p.name.rsplit(".", 2)[0] for p in path.glob("*.log")})
        processes = tuple(model.ProcessSpec(name=n, argv=(n,)) for n in names)
    stamp = run.get("failed_at")
    failed_at = float(stamp) if isinstance(stamp, (int, float)) else None
    if failed_at is None:
        tail = path.name.rpartition("@")[2]
        failed_at = int(tail) / 1000 if tail.isdigit() else None
    reason = run.get("reason")
    return processes, path, (failed_at, reason if isinstance(reason, str) else None)
