"""The agent's log sources: its own last lines in memory, and shard files followed.

`MemoryLog` is a logging handler holding the agent's last `MEMORY_LINES`
lines, formatted as they are written to its log (stderr); `logs` on the
source "agent" reads it. `FileFollower` reads what a shard process's output
file gained since the last read, and starts again from the top of a file that
shrank or was replaced (the supervisor cuts a long log back in place).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from pathlib import Path

AGENT_SOURCE = "agent"
MEMORY_LINES = 2000
POLL_S = 0.5  # how often a followed source is read again
KEEPALIVE_S = 2.0  # a follower with nothing new says it is there this often
PUSH_DEADLINE_S = 10.0  # a sink that does not take a line in this long ends the follow
READ_LIMIT = 1 << 20  # bytes read from a file per poll; the rest comes next poll
LINE_LIMIT = 64 << 10  # a "line" with no newline this long is passed on as it is


class MemoryLog(logging.Handler):
    """The last `capacity` lines the agent logged. Thread-safe: the capnp thread logs too."""

    def __init__(self, capacity: int = MEMORY_LINES) -> None:
        super().__init__()
        self._lines: collections.deque[str] = collections.deque(maxlen=capacity)
        self._written = 0  # lines ever written; a follower's position
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)
            return
        with self._guard:
            for line in text.splitlines() or [""]:
                self._lines.append(line)
                self._written += 1

    def tail(self, lines: int) -> tuple[int, list[str]]:
        """(position, the last `lines` lines); the position is for `since`."""
        with self._guard:
            held = list(self._lines)
            return self._written, held[-lines:] if lines > 0 else []

    def since(self, position: int) -> tuple[int, list[str]]:
        """(new position, the lines written after `position` that are still held)."""
        with self._guard:
            new = self._written - position
            held = list(self._lines)[-new:] if new > 0 else []
            return self._written, held


_installed: MemoryLog | None = None


def install() -> MemoryLog:
    """Attach one `MemoryLog` to the root logger, formatted like its first handler."""
    global _installed
    if _installed is None:
        root = logging.getLogger()
        _installed = MemoryLog()
        formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
        _installed.setFormatter(
            formatter or logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        root.addHandler(_installed)
    return _installed


class FileFollower:
    """The complete lines a file gained since the last `read`.

    It starts at the file's end as it is now (the tail is read separately). A
    file that shrank (truncated, cut back) or was replaced (another inode) is
    read again from its start; a file that is not there yet reads as nothing.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._partial = b""
        try:
            st = os.stat(path)
            self._inode: int | None = st.st_ino
            self._offset = st.st_size
        except OSError:
            self._inode, self._offset = None, 0

    def read(self) -> list[str]:
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._inode, self._offset, self._partial = st.st_ino, 0, b""
        if st.st_size == self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(min(st.st_size - self._offset, READ_LIMIT))
        except OSError:
            return []
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) >= LINE_LIMIT:
            complete.append(self._partial)
            self._partial = b""
        return [line.decode(errors="replace").removesuffix("\r") for line in complete]
