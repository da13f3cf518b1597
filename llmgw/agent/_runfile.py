"""A shard's spec.json and run.json: written before anything happens, read back on adoption.

spec.json is the full `ShardSpec`, written before the shard's first process
exists, so that a crash right after spawning still leaves a describable
engine. run.json holds the state, the reason, when it failed, and each
process's name, role, argv, pid and start time; it is written whole (a
temporary file, synced, renamed) at every change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmgw import config, model
from llmgw.agent._shard import ProcRecord, Shard


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_spec(shard_dir: Path, spec: model.ShardSpec) -> None:
    write_json(shard_dir / "spec.json", config.unstructure(spec))


def read_spec(shard_dir: Path) -> model.ShardSpec:
    """The spec.json in `shard_dir`; OSError, ValueError or LlmgwError when unreadable."""
    path = shard_dir / "spec.json"
    return config.structure(json.loads(path.read_text()), model.ShardSpec, str(path))


def save_run(shard: Shard) -> None:
    if not shard.dir.exists():
        return
    write_json(
        shard.dir / "run.json",
        {
            "state": shard.state.value,
            "reason": shard.reason,
            "failed_at": shard.failed_at,
            "procs": [
                {
                    "name": p.name,
                    "role": p.role,
                    "argv": p.argv,
                    "pid": p.pid,
                    "start_time": p.start_time,
                }
                for p in shard.procs
            ],
        },
    )


def read_run(shard_dir: Path) -> Any:
    """run.json as written; {} when it cannot be read."""
    try:
        return json.loads((shard_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def records(run: Any) -> list[ProcRecord]:
    """The processes run.json names (none were ours: they are adopted, if anything)."""
    return [
        ProcRecord(p["name"], p["role"], list(p["argv"]), int(p["pid"]), int(p["start_time"]))
        for p in run.get("procs", [])
    ]
