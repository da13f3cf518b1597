"""A shard's output: each process's stdout and stderr in files in its directory.

Read by their tails (`tail`, `last_lines`): a failure's reason ends in its
process's last lines, and `logs` answers a shard's tail, a failed one's
first line saying when and why it failed. A file is cut back in place to its
last lines beyond `LOG_LIMIT_BYTES` (`cut_logs`, called by the health
watcher); the engine writes with O_APPEND, so it carries on at the new end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from llmgw import model
from llmgw.agent._shard import Shard

TAIL_LINES = 40
LOG_LIMIT_BYTES = 64 << 20  # an engine's log is cut back to its tail beyond this
LAST_LINES = 10  # output lines a failure's reason carries
STREAMS = ("stdout", "stderr")


def tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


def last_lines(shard: Shard, name: str, lines: int) -> list[str]:
    out: list[str] = []
    for source in ("stderr", "stdout"):
        path = shard.dir / f"{name}.{source}.log"
        out += [f"[{source}] {line}" for line in tail(path, lines)]
    return out[-lines:]


def with_last_lines(shard: Shard, reason: str, name: str | None = None) -> str:
    """The reason, and the last output of `name` (default: the last process started)."""
    if name is None:
        if not shard.procs:
            return reason
        name = shard.procs[-1].name
    last = last_lines(shard, name, LAST_LINES)
    return reason + ("; last output:\n" + "\n".join(last) if last else "")


def cut_logs(shard: Shard) -> None:
    for path in shard.dir.glob("*.log"):
        try:
            if path.stat().st_size > LOG_LIMIT_BYTES:
                keep = "\n".join(tail(path, 200)) + "\n"
                # O_APPEND writers carry on at the new end after a truncate.
                with open(path, "r+") as f:
                    f.truncate(0)
                    f.write(f"[llmgw: log cut back to its last lines]\n{keep}")
        except OSError:
            pass


def files(where: Path, processes: Sequence[model.ProcessSpec]) -> list[tuple[str, Path]]:
    """(LogLine.source, file) for every process's every stream, as `logs` names them."""
    return [
        (f"{spec.name}/{stream}", where / f"{spec.name}.{stream}.log")
        for spec in processes
        for stream in STREAMS
    ]


def tail_files(files: list[tuple[str, Path]], lines: int) -> list[model.LogLine]:
    return [model.LogLine(label, line) for label, path in files for line in tail(path, lines)]


def tail_shard(
    shard_id: str,
    processes: Sequence[model.ProcessSpec],
    where: Path,
    failed: tuple[float | None, str | None] | None,
    lines: int,
) -> list[model.LogLine]:
    """Each process's last lines; when `failed` (when, why), a first line says so."""
    out = []
    if failed is not None:
        failed_at, reason = failed
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(failed_at))
            if failed_at is not None
            else "an unknown time"
        )
        # The output lines follow below anyway.
        first = (reason or "no reason recorded").splitlines()[0].removesuffix("; last output:")
        out.append(model.LogLine("llmgw", f"shard {shard_id} failed at {when}: {first}"))
    for spec in processes:
        for source in STREAMS:
            for line in tail(where / f"{spec.name}.{source}.log", lines):
                out.append(model.LogLine(f"{spec.name}/{source}", line))
    return out
