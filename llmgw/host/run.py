"""One short command on the node, bounded: its own process group, killed whole at the deadline.

For the agent's installer helpers (`ldd`, `<engine> --version`), the package manager
(llmgw.host.packages) and `llmgw-cp init-postgres`:
stdin is /dev/null, stdout and stderr are read together, at most `keep` bytes
are kept (the head or the tail: a version is in the first line, a package
manager says why it failed in its last), and past `timeout_s` the whole group
is killed (a script's children too) and the status is None.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from typing import Literal

import trio

__all__ = ["KEEP_BYTES", "run_bounded"]

KEEP_BYTES = 64 << 10


async def run_bounded(
    argv: list[str],
    timeout_s: float,
    *,
    env: Mapping[str, str] | None = None,
    keep: Literal["head", "tail"] = "head",
    keep_bytes: int = KEEP_BYTES,
) -> tuple[int | None, str]:
    """(exit status, or None past the deadline; the output kept); OSError if it cannot start."""
    proc = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )
    kept = bytearray()
    assert proc.stdout is not None
    try:
        with trio.move_on_after(timeout_s) as deadline:
            while chunk := await proc.stdout.receive_some(1 << 16):
                if keep == "head":
                    kept += chunk[: max(0, keep_bytes - len(kept))]
                else:
                    kept += chunk
                    del kept[: max(0, len(kept) - keep_bytes)]
            await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await proc.wait()
        await proc.stdout.aclose()
    status = None if deadline.cancelled_caught else proc.returncode
    return status, kept.decode(errors="replace")
