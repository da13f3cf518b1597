"""Benchmark: what the router adds to a request (a benchmark, not a test).

Starts a canned upstream (an asyncio server that answers every completion at
once, never the bottleneck), then measures a keep-alive load generator going
direct and through the router (router-only mode, hypercorn, real processes)
at concurrency 1, 16 and 64, streamed (16 chunks, each its own write) and
not. The router is pinned to one core; the load generator and the upstream
share the other. Prints p50 and p99 latency, requests/s, the router's added
p50 latency and its CPU time per request (from /proc).

    .venv/bin/python bench/router.py [--seconds 4] [--router-core 0] [--client-core 1]
                                     [--chunk-gap-ms 0] [--only direct|router]
                                     [--workers 1,2] [--prompt-kb 1,32,256]
                                     [--policy prefix,least-load,round-robin]
                                     [--endpoints N]

`--workers 1,2` runs the router once per count (`workers: N`, router-only mode's
SO_REUSEPORT processes); with N > 1 the router may use cores router-core ..
router-core+N-1 (on a 2-core machine that includes the load generator's core),
and its CPU per request sums the supervisor and every worker.

`--prompt-kb 1,32,256` measures what the prompt's size costs the router (prefix
hashing): every request then carries a chat prompt of about that many
kilobytes, a system prompt shared by all requests (3/4 of it) and a tail unique
to the request (the rest, starting with the request's own number, so that
every block of it is new to the router's prefix index); one row per size.
Without it, every request is the same tiny "hello". `--policy` (several:
comma-separated) sets the router's `policy:` for one router run each, so that
prefix routing on and off can be compared; without it the router's default
applies. `--endpoints N` puts N endpoints in front of the canned upstream (one
port each, one process), so that the router has a choice to make; default 1,
or 2 with `--prompt-kb`.

For scale, LiteLLM's proxy on this machine in the same setup: +11.5 ms p50 at
concurrency 1; 88-125 requests/s non-streaming and 32-44 streamed; at
concurrency 64, +485 ms p50. Goals for llmgw on one core: added p50 under 1 ms
at concurrency 1; at concurrency 64 at least 1,000 requests/s non-streaming
and 500 streamed, with p99 no more than twice p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

MODEL = "bench"
KEY = "llmgw-bench-key"
CHUNKS = 16
POLICIES = ("prefix", "least-load", "round-robin")
_CL = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)


# --- the canned upstream ------------------------------------------------------------------


def _canned() -> tuple[bytes, list[bytes], bytes]:
    body = json.dumps(
        {
            "id": "cmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": " ".join(f"tok{i}" for i in range(CHUNKS)),
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": CHUNKS, "total_tokens": 8 + CHUNKS},
        }
    ).encode()
    whole = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % len(body)
        + body
    )
    parts = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    ]
    for i in range(CHUNKS):
        event = (
            b"data: "
            + json.dumps(
                {
                    "id": "chatcmpl-bench",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": MODEL,
                    "choices": [
                        {"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}
                    ],
                }
            ).encode()
            + b"\n\n"
        )
        parts.append(b"%x\r\n%s\r\n" % (len(event), event))
    done = b"data: [DONE]\n\n"
    parts[-1] += b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
    metrics = (
        b'vllm:num_requests_running{model_name="bench"} 0.0\n'
        b'vllm:num_requests_waiting{model_name="bench"} 0.0\n'
        b'vllm:kv_cache_usage_perc{model_name="bench"} 0.0\n'
    )
    metrics_reply = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(metrics)
        + metrics
    )
    return whole, parts, metrics_reply


class _Upstream(asyncio.Protocol):
    """Answers each request once its body is in, keeping none of the body: a large
    prompt is read and dropped as it arrives, looked at only for `"stream": true`."""

    whole, parts, metrics = _canned()
    gap_s = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""  # the head being read
        self.head = b""
        self.need = -1  # body bytes still to come; -1 while reading a head
        self.streamed = False
        self.tail = b""  # the body's last bytes, for a flag split across reads

    def data_received(self, data: bytes) -> None:
        while True:
            if self.need < 0:
                self.buf += data
                data = b""
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self.head, data = self.buf[:end], self.buf[end + 4 :]
                self.buf = b""
                m = _CL.search(self.head)
                self.need = int(m.group(1)) if m else 0
                self.streamed, self.tail = False, b""
            if self.need:
                if not data:
                    return
                take, data = data[: self.need], data[self.need :]
                self.need -= len(take)
                if not self.streamed:
                    window = self.tail + take
                    self.streamed = b'"stream": true' in window or b'"stream":true' in window
                    self.tail = window[-16:]
                if self.need:
                    return
            self.need = -1
            self._answer()

    def _answer(self) -> None:
        head = self.head
        if head.startswith(b"GET /metrics"):
            self.t.write(self.metrics)
        elif head.startswith(b"GET"):
            self.t.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
        elif self.streamed:
            self._stream(0)
        else:
            self.t.write(self.whole)

    def _stream(self, i: int) -> None:
        # One write per chunk: the router sees them arrive as an engine sends tokens.
        if self.gap_s:
            self.t.write(self.parts[i])
            if i + 1 < len(self.parts):
                asyncio.get_running_loop().call_later(self.gap_s, self._stream, i + 1)
        else:
            for part in self.parts:
                self.t.write(part)


def run_upstream(ports: list[int], gap_s: float) -> None:
    _Upstream.gap_s = gap_s

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [
            await loop.create_server(_Upstream, "127.0.0.1", port, backlog=1024) for port in ports
        ]
        print("upstream ready", flush=True)
        await asyncio.gather(*(server.serve_forever() for server in servers))

    asyncio.run(main())


# --- the load generator -------------------------------------------------------------------


def _request(port: int, stream: bool) -> bytes:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
    ).encode()
    return _post(port, body)


def _post(port: int, body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (port, KEY.encode(), len(body), body)
    )


def _filler(n: int, tag: str) -> bytes:
    """About `n` bytes of words, no character JSON would escape."""
    words = b" ".join(b"%s%d" % (tag.encode(), i) for i in range(n // 4 + 1))
    return words[:n]


def prompt_requests(port: int, stream: bool, kb: float) -> Callable[[], bytes]:
    """A maker of requests whose chat prompts are about `kb` KB: a system prompt shared
    by all (3/4), then a user message unique to each (its number, then filler)."""
    size = max(64, int(kb * 1024))
    system = _filler(size * 3 // 4, "sys")
    tail = _filler(size - len(system), "tail")
    nonce = f"{os.getpid()}-".encode()  # several load processes run one after another
    open_ = (
        b'{"model":"%s","messages":[{"role":"system","content":"%s"},'
        b'{"role":"user","content":"' % (MODEL.encode(), system)
    )
    close = b'"}],"stream":%s}' % (b"true" if stream else b"false")
    count = 0

    def make() -> bytes:
        nonlocal count
        count += 1
        unique = b"request %s%d " % (nonce, count)
        return _post(port, open_ + unique + tail[len(unique) :] + close)

    return make


class _Client(asyncio.Protocol):
    """One keep-alive connection sending `req` back to back until `until` (a cheap parser:
    the load generator shares its core with the upstream and must not be the bottleneck)."""

    def __init__(
        self,
        req: bytes | Callable[[], bytes],
        until: float,
        latencies: list[float],
        errors: list[str],
        done: asyncio.Future[None],
    ) -> None:
        self.req, self.until, self.latencies, self.errors, self.done = (
            req,
            until,
            latencies,
            errors,
            done,
        )
        self.buf = b""
        self.t0 = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        self.buf = b""
        req = self.req if isinstance(self.req, bytes) else self.req()
        self.t0 = time.perf_counter()
        self.t.write(req)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end]
        m = _CL.search(head)
        if m:
            if len(self.buf) < end + 4 + int(m.group(1)):
                return
        elif not self.buf.endswith(b"\r\n0\r\n\r\n"):
            return
        now = time.perf_counter()
        self.latencies.append(now - self.t0)
        if not head.startswith(b"HTTP/1.1 200"):
            self.errors.append(head.split(b"\r\n", 1)[0].decode())
        if now >= self.until or b"connection: close" in head.lower():
            self.t.close()
        else:
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _worker(
    port: int,
    req: bytes | Callable[[], bytes],
    until: float,
    latencies: list[float],
    errors: list[str],
) -> None:
    loop = asyncio.get_running_loop()
    while time.perf_counter() < until:
        done: asyncio.Future[None] = loop.create_future()
        client = _Client(req, until, latencies, errors, done)
        await loop.create_connection(lambda c=client: c, "127.0.0.1", port)  # type: ignore[misc]
        await done


async def _load(
    port: int, stream: bool, concurrency: int, seconds: float, prompt_kb: float | None
) -> tuple[list[float], list[str], float]:
    req = _request(port, stream) if prompt_kb is None else prompt_requests(port, stream, prompt_kb)
    warm: list[float] = []
    errors: list[str] = []
    await asyncio.gather(
        *(_worker(port, req, time.perf_counter() + 0.3, warm, errors) for _ in range(concurrency))
    )
    latencies: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(
        *(_worker(port, req, start + seconds, latencies, errors) for _ in range(concurrency))
    )
    return latencies, errors, time.perf_counter() - start


def run_load(
    port: int, stream: bool, concurrency: int, seconds: float, prompt_kb: float | None
) -> None:
    latencies, errors, elapsed = asyncio.run(_load(port, stream, concurrency, seconds, prompt_kb))
    print(
        json.dumps(
            {
                "latencies": latencies,
                "errors": errors[:5],
                "n_errors": len(errors),
                "elapsed": elapsed,
            }
        )
    )


# --- orchestration ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and of its live children (a supervisor and its workers)."""
    total = _cpu_seconds(pid)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                total += _cpu_seconds(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return total


def _wait_log(path: Path, text: str, count: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.read_text(errors="replace").count(text) >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{count} x {text!r} not in {path} after {timeout:g} s")


def _wait_port(
    port: int,
    timeout: float = 20,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            said = log.read_text(errors="replace")[-2000:] if log else ""
            raise RuntimeError(f"the router exited with status {proc.returncode}:\n{said}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _sizes(text: str | None) -> list[float | None]:
    if text is None:
        return [None]
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"--prompt-kb is {text!r}; it must be sizes in KB, e.g. 1,32,256"
        ) from None
    if not sizes or min(sizes) <= 0:
        raise SystemExit(f"--prompt-kb is {text!r}; each size must be above 0 KB")
    return list(sizes)


def _policies(text: str | None) -> list[str | None]:
    if text is None:
        return [None]
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in chosen if x not in POLICIES]
    if bad or not chosen:
        raise SystemExit(f"--policy is {text!r}; each must be one of {', '.join(POLICIES)}")
    return list(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--router-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--chunk-gap-ms", type=float, default=0.0)
    parser.add_argument("--only", choices=["direct", "router"], default=None)
    parser.add_argument("--server", choices=["lean", "hypercorn"], default="lean")
    parser.add_argument("--stream", choices=["both", "no", "yes"], default="both")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument(
        "--workers",
        default="1",
        help="router worker counts to run, comma-separated (e.g. 1,2); default 1",
    )
    parser.add_argument(
        "--prompt-kb",
        default=None,
        help="chat prompt sizes in KB, comma-separated (e.g. 1,32,256); default: a tiny prompt",
    )
    parser.add_argument(
        "--policy",
        default=None,
        help=f"router policies to run, comma-separated ({', '.join(POLICIES)}); "
        "default: the router's own",
    )
    parser.add_argument(
        "--endpoints",
        type=int,
        default=None,
        help="endpoints (canned upstream ports) behind the router; default 1, 2 with --prompt-kb",
    )
    parser.add_argument("--_upstream", nargs="+", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_load", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._upstream:
        run_upstream(args._upstream, args.chunk_gap_ms / 1000)
        return 0
    if args._load:
        port, stream, conc, secs, kb = args._load
        run_load(int(port), stream == "1", int(conc), float(secs), None if kb == "-" else float(kb))
        return 0
    sizes = _sizes(args.prompt_kb)
    policies = _policies(args.policy)
    n_endpoints = args.endpoints or (1 if args.prompt_kb is None else 2)
    if n_endpoints < 1:
        raise SystemExit(f"--endpoints is {n_endpoints}; it must be at least 1")

    cores = os.cpu_count() or 1
    pin_client = ["taskset", "-c", str(args.client_core)] if cores > 1 else []
    up_ports = [_free_port() for _ in range(n_endpoints)]
    up_port = up_ports[0]
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    try:
        procs.append(
            subprocess.Popen(
                [
                    *pin_client,
                    sys.executable,
                    __file__,
                    "--_upstream",
                    *map(str, up_ports),
                    "--chunk-gap-ms",
                    str(args.chunk_gap_ms),
                ],
                stdout=subprocess.DEVNULL,
            )
        )
        for port in up_ports:
            _wait_port(port)
        worker_counts = [int(w) for w in args.workers.split(",") if w.strip()]
        print(
            f"llmgw router benchmark: Python {platform.python_version()}, "
            f"hypercorn {version('hypercorn')}, h11 {version('h11')}, trio {version('trio')}; "
            f"router server: {args.server}; {cores} cores; router on core {args.router_core}"
            f"{' (and the next, for each worker more)' if max(worker_counts) > 1 else ''}, "
            "load generator and upstream on "
            f"core {args.client_core}; {args.seconds:g} s per run; streamed = {CHUNKS} chunks"
            f"{f' {args.chunk_gap_ms:g} ms apart' if args.chunk_gap_ms else ', back to back'}"
            + (f"; {n_endpoints} endpoints" if n_endpoints > 1 else "")
            + (
                "; prompts: 3/4 a system prompt shared by all, 1/4 unique"
                if args.prompt_kb is not None
                else ""
            )
        )
        # Columns that only these options bring, so that the default table stays as it was.
        show_kb, show_policy = args.prompt_kb is not None, args.policy is not None
        header = (
            f"{'mode':<8}{'workers':>8}"
            + (f"{'policy':>12}" if show_policy else "")
            + (f"{'KB':>6}" if show_kb else "")
            + f"{'stream':>7}{'conc':>5}{'p50 ms':>10}{'p99 ms':>10}"
            f"{'req/s':>10}{'+p50 ms':>10}{'cpu/req ms':>12}{'errors':>8}"
        )
        print(header)
        print("-" * len(header))
        direct_p50: dict[tuple[bool, int, float | None], float] = {}
        streams = {"both": (False, True), "no": (False,), "yes": (True,)}[args.stream]
        endpoints = "".join(
            f"  - {{model: {MODEL}, engine: vllm, url: 'http://127.0.0.1:{port}'}}\n"
            for port in up_ports
        )
        for n_workers in worker_counts:
            for policy in policies:
                router_port = _free_port()
                name = f"router-{n_workers}-{policy or 'default'}"
                cfg = tmp / f"{name}.yaml"
                cfg.write_text(
                    f"listen: 127.0.0.1:{router_port}\n"
                    f"endpoints:\n{endpoints}"
                    f"keys:\n  - {{key: {KEY}, tenant: bench}}\n"
                    f"concurrency: 4096\nlog_level: INFO\nserver: {args.server}\n"
                    f"workers: {n_workers}\n" + (f"policy: {policy}\n" if policy else "")
                )
                router_cores = ",".join(
                    str((args.router_core + i) % cores) for i in range(min(n_workers, cores))
                )
                pin_router = ["taskset", "-c", router_cores] if cores > 1 else []
                log_path = tmp / f"{name}.log"
                router_log = open(log_path, "wb")  # noqa: SIM115 - as long as the router runs
                router = subprocess.Popen(
                    [
                        *pin_router,
                        sys.executable,
                        *os.environ.get("BENCH_ROUTER_PY", "-m llmgw.router").split(),
                        "--config",
                        str(cfg),
                    ],
                    stdout=router_log,
                    stderr=subprocess.STDOUT,
                )
                procs.append(router)
                _wait_port(router_port, proc=router, log=log_path)
                _wait_log(log_path, "router listening", n_workers)
                for kb in sizes:
                    for stream in streams:
                        for conc in args.concurrency:
                            for mode in ("direct", "router"):
                                if args.only and mode != args.only:
                                    continue
                                key = (stream, conc, kb)
                                if mode == "direct" and key in direct_p50:
                                    continue  # measured once, for the first router run
                                port = up_port if mode == "direct" else router_port
                                cpu0 = _tree_cpu_seconds(router.pid)
                                out = subprocess.run(
                                    [
                                        *pin_client,
                                        sys.executable,
                                        __file__,
                                        "--_load",
                                        str(port),
                                        "1" if stream else "0",
                                        str(conc),
                                        str(args.seconds),
                                        "-" if kb is None else str(kb),
                                    ],
                                    capture_output=True,
                                    check=True,
                                ).stdout
                                cpu = _tree_cpu_seconds(router.pid) - cpu0
                                res = json.loads(out)
                                lat = res["latencies"]
                                p50, p99 = _pct(lat, 0.5) * 1000, _pct(lat, 0.99) * 1000
                                rps = len(lat) / res["elapsed"]
                                # The warm-up's requests burn CPU too: count them at the
                                # measured rate.
                                n_all = len(lat) * (1 + 0.3 / res["elapsed"])
                                added = ""
                                cpu_req = ""
                                shown = "-" if mode == "direct" else str(n_workers)
                                shown_policy = "-" if mode == "direct" else (policy or "default")
                                if mode == "direct":
                                    direct_p50[key] = p50
                                else:
                                    if key in direct_p50:
                                        added = f"{p50 - direct_p50[key]:+.2f}"
                                    cpu_req = f"{cpu / n_all * 1000:.3f}"
                                print(
                                    f"{mode:<8}{shown:>8}"
                                    + (f"{shown_policy:>12}" if show_policy else "")
                                    + (f"{kb:>6g}" if show_kb and kb is not None else "")
                                    + f"{'yes' if stream else 'no':>7}{conc:>5}"
                                    f"{p50:>10.2f}{p99:>10.2f}{rps:>10.0f}{added:>10}{cpu_req:>12}"
                                    f"{res['n_errors']:>8}",
                                    flush=True,
                                )
                                if res["errors"]:
                                    print(f"   errors: {res['errors']}")
                router.send_signal(signal.SIGTERM)
                router.wait(10)
                procs.remove(router)
                router_log.close()
        _ = statistics  # (kept for quick ad-hoc analysis)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
