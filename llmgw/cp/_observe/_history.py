"""An hour of each node's figures, kept in the control plane (no Prometheus needed).

Every heartbeat (and every registration) writes one sample per series into a
ring of fixed-size float32 arrays, one slot per bucket: RESOLUTION_S = 10 s
buckets, SPAN_S = 3600 s, so 360 slots per series. A bucket that got several
heartbeats keeps the last one's values. A bucket no heartbeat reached, and a
figure a heartbeat did not carry, is NaN in the ring and null on the API:
absent is not zero. The ring is cleared slot by slot as time moves on, so the
arrays never grow; a GPU, filesystem or shard series nobody wrote for an hour
is dropped, and a node the registry forgets takes its history with it.

Series, per node: cpu_util_percent, memory_used_bytes (total - available, only
when both are known), memory_available_bytes, memory_total_bytes, load1,
load5, load15; per GPU (by index): utilization_percent, memory_used_bytes; per
filesystem (by mount): free_bytes; per shard (by shard id, with its model):
cpu_cores, memory_bytes, and the engine's running_requests and
waiting_requests as the router last scraped them (the `queue` callable; left
null when the router has no fresh figure, or the shard is not a serving rank).

Values are float32: about 7 significant digits (a 1 TB figure to within
64 KiB), which a chart cannot tell from exact; the API shows whole numbers
exactly and others to seven digits. Buckets are placed by a
monotonic clock; `start` on the API is the wall-clock time of the first
bucket, so a step of the wall clock moves no sample.

Memory: one series is an array of 360 float32 (1,440 bytes of data, 1,504
with the array's header). A node with 8 GPUs, 2 filesystems and 2 shards holds
7 + 16 + 2 + 8 = 33 series: 49.6 KB of arrays, 54,689 bytes with the
dictionaries (`nbytes`, measured); 5,000 such nodes 273 MB (tracemalloc:
272.5 MB). Each further GPU adds 3 KB, filesystem 1.5 KB, shard 6 KB.
NODE_BYTES_BOUND (64,000) is the documented ceiling for that shape:
bench/history.py measures it, tests/cp/test_history.py asserts it and that a
node's size does not change after its first hour. A hostile or
broken agent cannot grow it past MAX_GPUS, MAX_FILESYSTEMS and MAX_SHARDS
series groups (keys longer than MAX_KEY characters are not kept).

The history is this control plane's own: it is kept in memory and starts
empty after a restart or a failover. So that an empty stretch is not read as
an idle node, the API says since when it holds each node (`since`, the wall
time of its first sample here) and since when it has kept any history, and why
(`kept_since`: this control plane started, or took over as leader:
`took_over`); the node page says "history since HH:MM (this control plane took
over then)" where that is later than the window's start.

Pure: no trio, no I/O; the clocks are injected.
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from llmgw import model

RESOLUTION_S = 10.0
SPAN_S = 3600.0
MAX_GPUS = 64
MAX_FILESYSTEMS = 32
MAX_SHARDS = 64
MAX_KEY = 512
# bytes per node with 8 GPUs, 2 filesystems, 2 shards (measured 54,689; see the docstring)
NODE_BYTES_BOUND = 64_000
# An election this soon after the start is the start's own (alone on its store, a
# control plane leads at its first try, within a second or two of being built): its
# history was kept "since it started", not "since it took over".
START_ELECTION_S = 10.0

NODE_SERIES = (
    "cpu_util_percent",
    "memory_used_bytes",
    "memory_available_bytes",
    "memory_total_bytes",
    "load1",
    "load5",
    "load15",
)
GPU_SERIES = ("utilization_percent", "memory_used_bytes")
FS_SERIES = ("free_bytes",)
SHARD_SERIES = ("cpu_cores", "memory_bytes", "running_requests", "waiting_requests")

_NAN = math.nan
_F32_MAX = 3.4e38

# (node, replica) -> (running, waiting) as the router last scraped them; None: unknown
QueueDepth = Callable[[str, str], tuple[float | None, float | None] | None]


def _value(v: float | None) -> float:
    if v is None:
        return _NAN
    f = float(v)
    return f if math.isfinite(f) and abs(f) < _F32_MAX else _NAN


def _mib(v: int | None) -> float | None:
    return None if v is None else v * 1048576.0


def _shown(v: float) -> float:
    """A float32 as JSON shows it: whole numbers (every float32 above 2**24 is one)
    exactly, others to float32's seven significant digits (33.3, not 33.29999923706055)."""
    return int(v) if v.is_integer() else float(f"{v:.7g}")


class _Group:
    """The series of one GPU, filesystem, shard or of the node itself."""

    __slots__ = ("arrays", "label", "seen")

    def __init__(self, names: Sequence[str], size: int, label: str | None = None) -> None:
        blank = array("f", [_NAN]) * size
        self.arrays = {name: array("f", blank) for name in names}
        self.label = label  # a shard's model
        self.seen = -1  # the last bucket written

    def nbytes(self) -> int:
        return (
            sys.getsizeof(self)
            + sys.getsizeof(self.arrays)
            + sum(sys.getsizeof(a) for a in self.arrays.values())
        )


class _Node:
    __slots__ = ("filesystems", "first", "gpus", "last", "own", "shards")

    def __init__(self, size: int, first: float) -> None:
        self.first = first  # wall clock of its first sample here
        self.last = -1  # the last bucket written
        self.own = _Group(NODE_SERIES, size)
        self.gpus: dict[str, _Group] = {}
        self.filesystems: dict[str, _Group] = {}
        self.shards: dict[str, _Group] = {}

    def tables(self) -> tuple[dict[str, _Group], ...]:
        return self.gpus, self.filesystems, self.shards

    def groups(self) -> Iterable[_Group]:
        yield self.own
        for table in self.tables():
            yield from table.values()


class History:
    def __init__(
        self,
        *,
        resolution_s: float = RESOLUTION_S,
        span_s: float = SPAN_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        queue: QueueDepth | None = None,
    ) -> None:
        if resolution_s <= 0 or span_s < resolution_s:
            raise ValueError(
                f"history: resolution_s {resolution_s:g} and span_s {span_s:g}: need "
                "0 < resolution_s <= span_s"
            )
        self.resolution_s = resolution_s
        self.buckets = round(span_s / resolution_s)
        self._clock = clock
        self._wall = wall
        self._nodes: dict[str, _Node] = {}
        self._queue_of = queue
        self.samples = 0  # samples written, for statistics
        # Since when this control plane keeps history, and why (module docstring).
        self.kept_since: tuple[float, str] = (wall(), "started")

    def __repr__(self) -> str:
        return f"<History {self.statistics()}>"

    def statistics(self) -> dict[str, Any]:
        return {
            "nodes": len(self._nodes),
            "series": sum(len(g.arrays) for n in self._nodes.values() for g in n.groups()),
            "resolution_s": self.resolution_s,
            "buckets": self.buckets,
            "samples": self.samples,
        }

    def took_over(self) -> None:
        """This control plane was elected leader: the nodes' history before now is
        the other control plane's (an election within START_ELECTION_S of the start
        is the start's own)."""
        now = self._wall()
        if now - self.kept_since[0] > START_ELECTION_S:
            self.kept_since = (now, "took over as leader")

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def forget(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    def nbytes(self, node_id: str) -> int:
        """What the node's history holds, in bytes (sys.getsizeof, deep)."""
        node = self._nodes.get(node_id)
        if node is None:
            return 0
        total = sys.getsizeof(node) + sum(g.nbytes() for g in node.groups())
        for table in node.tables():
            total += sys.getsizeof(table) + sum(sys.getsizeof(k) for k in table)
        return total

    # writing ---------------------------------------------------------------------------

    def _bucket(self, t: float) -> int:
        return math.floor(t / self.resolution_s)

    def record(
        self,
        node_id: str,
        usage: model.Usage,
        shards: Sequence[model.ShardReport] = (),
    ) -> None:
        """One heartbeat's figures, into the bucket of now."""
        b = self._bucket(self._clock())
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node(self.buckets, self._wall())
        if b < node.last:
            return  # the monotonic clock does not go back; a sample from the past has no slot
        if b > node.last:
            self._advance(node, b)
        slot = b % self.buckets
        self.samples += 1

        used = (
            usage.memory_total_bytes - usage.memory_available_bytes
            if usage.memory_total_bytes is not None and usage.memory_available_bytes is not None
            else None
        )
        own = node.own.arrays
        for name, v in (
            ("cpu_util_percent", usage.cpu_util_pct),
            ("memory_used_bytes", used),
            ("memory_available_bytes", usage.memory_available_bytes),
            ("memory_total_bytes", usage.memory_total_bytes),
            ("load1", usage.load1),
            ("load5", usage.load5),
            ("load15", usage.load15),
        ):
            own[name][slot] = _value(v)
        node.own.seen = b

        for gpu in usage.gpus:
            group = self._group(node.gpus, str(gpu.index), GPU_SERIES, MAX_GPUS, b)
            if group is not None:
                group.arrays["utilization_percent"][slot] = _value(gpu.utilization_pct)
                group.arrays["memory_used_bytes"][slot] = _value(_mib(gpu.memory_used_mib))
        for fs in usage.filesystems:
            group = self._group(node.filesystems, fs.mount, FS_SERIES, MAX_FILESYSTEMS, b)
            if group is not None:
                group.arrays["free_bytes"][slot] = _value(fs.free_bytes)

        reports = {s.shard_id: s for s in shards}
        used_by = {s.shard_id: s for s in usage.shards}
        for shard_id in [*used_by, *(s for s in reports if s not in used_by)]:
            report = reports.get(shard_id)
            label = (report.model_name or report.model) if report is not None else None
            group = self._group(node.shards, shard_id, SHARD_SERIES, MAX_SHARDS, b, label)
            if group is None:
                continue
            su = used_by.get(shard_id)
            if su is not None:
                group.arrays["cpu_cores"][slot] = _value(su.cpu_cores)
                group.arrays["memory_bytes"][slot] = _value(su.rss_bytes)
            depth = self._queue(node_id, report)
            if depth is not None:
                group.arrays["running_requests"][slot] = _value(depth[0])
                group.arrays["waiting_requests"][slot] = _value(depth[1])

    def _queue(
        self, node_id: str, report: model.ShardReport | None
    ) -> tuple[float | None, float | None] | None:
        if self._queue_of is None or report is None or report.replica_id is None or report.rank:
            return None
        return self._queue_of(node_id, report.replica_id)

    def _group(
        self,
        table: dict[str, _Group],
        key: str,
        names: Sequence[str],
        cap: int,
        b: int,
        label: str | None = None,
    ) -> _Group | None:
        group = table.get(key)
        if group is None:
            if len(table) >= cap or not isinstance(key, str) or len(key) > MAX_KEY:
                return None
            group = table[key] = _Group(names, self.buckets, label)
        if label is not None:
            group.label = label
        group.seen = b
        return group

    def _advance(self, node: _Node, b: int) -> None:
        """Clear the slots of the buckets between the last write and `b` (inclusive)."""
        n = self.buckets
        first = max(node.last + 1, b - n + 1)
        slots = [k % n for k in range(first, b + 1)]
        for group in node.groups():
            for arr in group.arrays.values():
                for slot in slots:
                    arr[slot] = _NAN
        node.last = b
        for table in node.tables():
            for key in [k for k, g in table.items() if g.seen <= b - n]:
                del table[key]  # nothing of it left in the window

    # reading ---------------------------------------------------------------------------

    def view(self, node_id: str) -> dict[str, Any] | None:
        """The node's last hour as JSON-ready data (null for absent); None: no history."""
        node = self._nodes.get(node_id)
        if node is None:
            return None
        now, wall = self._clock(), self._wall()
        n = self.buckets
        cur = self._bucket(now)
        first = cur - n + 1
        # The window is the buckets first..cur; the ring holds last-n+1..last. Rotated so
        # that the ring's oldest slot comes first, the ring's data is the window's head,
        # and the buckets after `last` (no heartbeat since) are its tail of nulls.
        lead = (node.last + 1) % n
        blank = min(n, max(0, cur - node.last))

        def values(arr: array[float]) -> list[float | None]:
            ring = (arr[lead:] + arr[:lead]).tolist()[blank:]
            out: list[float | None] = [None if v != v else _shown(v) for v in ring]
            return out + [None] * blank

        def table(groups: dict[str, _Group], with_model: bool) -> dict[str, Any]:
            rendered: dict[str, Any] = {}
            for key in sorted(groups):
                g = groups[key]
                entry: dict[str, Any] = {"model": g.label} if with_model else {}
                entry.update({name: values(arr) for name, arr in g.arrays.items()})
                rendered[key] = entry
            return rendered

        series: dict[str, Any] = {name: values(arr) for name, arr in node.own.arrays.items()}
        series["gpus"] = table(node.gpus, False)
        series["filesystems"] = table(node.filesystems, False)
        series["shards"] = table(node.shards, True)
        return {
            "node": node_id,
            "resolution_s": self.resolution_s,
            "buckets": n,
            "start": wall - (now - first * self.resolution_s),
            "since": node.first,
            "kept_since": {"at": self.kept_since[0], "why": self.kept_since[1]},
            "series": series,
        }
