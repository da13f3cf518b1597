"""What /proc says about a process: enough to trust a pid, or not.

A pid alone proves nothing after a restart: the kernel reuses them. A process
is ours only when its start time (field 22 of /proc/PID/stat, clock ticks
since boot) is the one recorded when it was started, and its command line
still ends with the arguments it was given. A zombie is dead.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

PROC = Path("/proc")

# Environment markers set on every process llmgw starts; how a restarted agent
# finds what it started even when its state files are gone.
SHARD_ENV = "LLMGW_SHARD_ID"
OWNER_ENV = "LLMGW_AGENT_STATE"


class Liveness(enum.Enum):
    ALIVE = "alive"
    GONE = "gone"  # no such process, or a zombie
    REUSED = "reused"  # the pid now belongs to another process


def stat(pid: int, proc: Path = PROC) -> tuple[str, int] | None:
    """(state letter, start time) of `pid`, or None when it does not exist."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    if len(rest) < 20:
        return None
    return rest[0], int(rest[19])


def start_time(pid: int, proc: Path = PROC) -> int | None:
    found = stat(pid, proc)
    return None if found is None else found[1]


def cmdline(pid: int, proc: Path = PROC) -> list[str] | None:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def environ(pid: int, proc: Path = PROC) -> dict[str, str]:
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def check(pid: int, started: int, argv: Sequence[str], proc: Path = PROC) -> Liveness:
    """Is `pid` still the process started at `started` with `argv`?

    The command line must end with argv[1:]: a wrapper script that execs a
    Python module, or an interpreter running a script, changes what precedes
    the arguments but not the arguments.
    """
    found = stat(pid, proc)
    if found is None:
        return Liveness.GONE
    state, ticks = found
    if ticks != started:
        return Liveness.REUSED
    if state in ("Z", "X"):
        return Liveness.GONE
    current = cmdline(pid, proc)
    if current is None:
        return Liveness.GONE
    tail = list(argv[1:])
    if tail and current[-len(tail) :] != tail:
        return Liveness.REUSED
    if not tail and (not current or Path(current[0]).name != Path(argv[0]).name):
        return Liveness.REUSED
    return Liveness.ALIVE


def marked(owner: str, proc: Path = PROC) -> Iterator[tuple[int, str]]:
    """(pid, shard id) of every live process llmgw started for the agent `owner`."""
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        env = environ(int(entry.name), proc)
        if env.get(OWNER_ENV) == owner and SHARD_ENV in env:
            found = stat(int(entry.name), proc)
            if found is not None and found[0] not in ("Z", "X"):
                yield int(entry.name), env[SHARD_ENV]
