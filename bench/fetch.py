"""Benchmark: the agent's Fetcher against curl, from the weights mirror on loopback (not a test).

Writes a test file of real bytes into a temporary directory (a 16 MiB block
of os.urandom repeated: not sparse, so the mirror reads every page; the file
was just written, so those reads mostly come from the page cache, as they
would on a control plane whose weights are warm), starts the mirror
(llmgw.cp._weights._mirror.serve_mirror) in its own process on 127.0.0.1, plain HTTP by
default or TLS with a trustme CA that both clients trust (`--tls`), then:

1. `curl -sf -o <file>` of it (skipped, and said so, when curl is not
   installed), then an fsync of what curl wrote: the Fetcher fsyncs before it
   renames, so both times include getting the bytes to disk (curl's time
   without the fsync is printed too);
2. `Fetcher.fetch(url, "file")` of the same file into a fresh weights
   directory;

   each `--runs` times, alternating, with time and MB/s per run, best and mean,
   and the Fetcher's throughput as a share of curl's (best against best);
3. eight `fetch()` calls of one fresh source started together: the GETs the
   mirror answered for the file (counted by a wrapper around the mirror's file
   handler in the mirror's process) and the wall time.

The mirror is pinned to core 0, curl and the Fetcher to core 1 (when there are
two); each run starts after an os.sync(), so that the last run's writeback is
not charged to it. Each row shows the client's CPU seconds (curl's from
RUSAGE_CHILDREN; the Fetcher's from RUSAGE_SELF, its writer threads included)
and the mirror's (from /proc). Temporary files are removed at the end.

    .venv/bin/python bench/fetch.py [--size-gib 2] [--runs 2] [--tls]

Goal: the Fetcher reaches at least 90 % of curl's throughput; the eight
concurrent fetches of one source cause exactly one download.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

BLOCK = 16 << 20
FILE_NAME = "bench.bin"
SHARDS = 8
MB = 1e6
GOAL_SHARE = 0.90


# --- the mirror, in its own process ------------------------------------------------------


def run_mirror(root: Path, port_file: Path, count_file: Path, tls_dir: Path | None) -> None:
    from llmgw.cp._weights import _mirror

    original = _mirror._Mirror._file

    async def counted(
        self: Any, stream: Any, conn: Any, request: Any, real: str, shown: str
    ) -> None:
        if request.method == b"GET":
            async with await trio.open_file(count_file, "a") as f:
                await f.write(shown + "\n")
        await original(self, stream, conn, request, real, shown)

    _mirror._Mirror._file = counted  # type: ignore[method-assign]
    ctx = None
    if tls_dir is not None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(tls_dir / "server.pem")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            serve = functools.partial(_mirror.serve_mirror, ssl_context=ctx)
            port = await nursery.start(serve, root, "127.0.0.1", 0)
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(str(port))
            tmp.replace(port_file)

    trio.run(main)


# --- the clients ----------------------------------------------------------------------------


def write_file(path: Path, size: int) -> float:
    """Write `size` real bytes (a random block repeated) and fsync; the seconds it took."""
    block = os.urandom(BLOCK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, BLOCK)
            f.write(block[:n] if n < BLOCK else block)
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def run_curl(url: str, out: Path, cafile: Path | None) -> tuple[float, float]:
    """(seconds to download, seconds to download and fsync) of one curl run."""
    cmd = ["curl", "-sf", "-o", str(out)]
    if cafile is not None:
        cmd += ["--cacert", str(cafile)]
    start = time.perf_counter()
    subprocess.run([*cmd, url], check=True)
    done = time.perf_counter()
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return done - start, time.perf_counter() - start


async def _fetch_all(
    weights: Path, url: str, n: int, ctx: ssl.SSLContext | None, source: str | None
) -> tuple[float, list[Path]]:
    from llmgw.agent._fetch import Fetcher

    fetcher = Fetcher(weights, ssl_context=ctx)
    paths: list[Path] = []
    async with trio.open_nursery() as outer:
        await outer.start(fetcher.run)
        start = time.perf_counter()

        async def one() -> None:
            paths.append(await fetcher.fetch(url, "file", source=source))

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
        elapsed = time.perf_counter() - start
        outer.cancel_scope.cancel()
    return elapsed, paths


def run_fetcher(
    weights: Path, url: str, n: int, ctx: ssl.SSLContext | None, source: str | None = None
) -> tuple[float, list[Path]]:
    from llmgw.agent._fetch import FetchError

    weights.mkdir()  # the agent creates its weights directory at start
    try:
        return trio.run(_fetch_all, weights, url, n, ctx, source)
    except BaseExceptionGroup as group:
        matched, _ = group.split(FetchError)
        if matched is None:
            raise
        failed: BaseException = matched
        while isinstance(failed, BaseExceptionGroup):
            failed = failed.exceptions[0]
        raise SystemExit(f"the Fetcher failed: {failed}") from None


# --- orchestration ------------------------------------------------------------------------


def _pin(core: int) -> list[str]:
    if (os.cpu_count() or 1) > 1 and shutil.which("taskset"):
        return ["taskset", "-c", str(core)]
    return []


def _gets(count_file: Path) -> int:
    if not count_file.exists():
        return 0
    return sum(1 for line in count_file.read_text().splitlines() if line == "/" + FILE_NAME)


def _wait_port(port_file: Path, proc: subprocess.Popen[bytes], log: Path) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if proc.poll() is not None:
            said = log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"the mirror exited with status {proc.returncode}:\n{said}")
        time.sleep(0.05)
    raise SystemExit(f"the mirror wrote no port to {port_file} within 20 s")


def _cpu(who: int) -> float:
    """CPU seconds (user + system) of this process (RUSAGE_SELF, threads included) or of
    its waited-for children (RUSAGE_CHILDREN)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _row(
    what: str, run: int, size: int, seconds: float, cpu: float, mirror_cpu: float, extra: str = ""
) -> None:
    print(
        f"{what:<10}{run:>4}{seconds:>10.2f}{size / MB / seconds:>10.0f}"
        f"{cpu:>14.2f}{mirror_cpu:>14.2f}  {extra}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="the test file's size")
    parser.add_argument("--runs", type=int, default=2, help="runs of curl and of the Fetcher")
    parser.add_argument("--tls", action="store_true", help="TLS with a trustme CA (default: HTTP)")
    parser.add_argument("--_mirror", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._mirror:
        root, port_file, count_file, tls_dir = args._mirror
        run_mirror(
            Path(root), Path(port_file), Path(count_file), None if tls_dir == "-" else Path(tls_dir)
        )
        return 0
    if args.size_gib <= 0:
        raise SystemExit(f"--size-gib is {args.size_gib:g}; it must be above 0")
    if args.runs < 1:
        raise SystemExit(f"--runs is {args.runs}; it must be at least 1")
    size = int(args.size_gib * (1 << 30))
    curl = shutil.which("curl")

    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-fetch-"))
    mirror: subprocess.Popen[bytes] | None = None
    try:
        root = tmp / "mirror"
        root.mkdir()
        wrote = write_file(root / FILE_NAME, size)
        cafile: Path | None = None
        ctx: ssl.SSLContext | None = None
        tls_dir = "-"
        if args.tls:
            import trustme

            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1")
            cert.private_key_and_cert_chain_pem.write_to_path(str(tmp / "server.pem"))
            cafile = tmp / "ca.pem"
            ca.cert_pem.write_to_path(str(cafile))
            ctx = ssl.create_default_context(cafile=str(cafile))
            tls_dir = str(tmp)
        port_file, count_file, log = tmp / "port", tmp / "gets", tmp / "mirror.log"
        with open(log, "wb") as log_f:
            mirror = subprocess.Popen(
                [
                    *_pin(0),
                    sys.executable,
                    __file__,
                    "--_mirror",
                    str(root),
                    str(port_file),
                    str(count_file),
                    tls_dir,
                ],
                stdout=log_f,
                stderr=subprocess.STDOUT,
            )
        port = _wait_port(port_file, mirror, log)
        if (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {1})  # curl inherits it
        scheme = "https" if args.tls else "http"
        url = f"{scheme}://127.0.0.1:{port}/{FILE_NAME}"
        print(
            f"llmgw fetch benchmark: {size / (1 << 30):g} GiB ({size / MB:.0f} MB) written in "
            f"{wrote:.1f} s; mirror over {scheme.upper()} on 127.0.0.1, "
            f"{os.cpu_count()} cores (mirror on core 0, clients on core 1); {args.runs} runs each"
        )
        header = (
            f"{'client':<10}{'run':>4}{'seconds':>10}{'MB/s':>10}"
            f"{'client cpu s':>14}{'mirror cpu s':>14}"
        )
        print(header)
        print("-" * len(header))
        curl_s: list[float] = []
        curl_raw: list[float] = []
        fetch_s: list[float] = []
        for run in range(1, args.runs + 1):
            if curl is not None:
                out = tmp / "curl.out"
                os.sync()  # the last run's writeback (and its unlink) is not this one's
                cpu0, m0 = _cpu(resource.RUSAGE_CHILDREN), _proc_cpu(mirror.pid)
                got, synced = run_curl(url, out, cafile)
                cpu, m = _cpu(resource.RUSAGE_CHILDREN) - cpu0, _proc_cpu(mirror.pid) - m0
                if out.stat().st_size != size:
                    raise SystemExit(f"curl wrote {out.stat().st_size} bytes, expected {size}")
                out.unlink()
                curl_s.append(synced)
                curl_raw.append(got)
                _row("curl", run, size, synced, cpu, m, f"({got:.2f} s before its fsync)")
            weights = tmp / f"weights-{run}"
            os.sync()
            cpu0, m0 = _cpu(resource.RUSAGE_SELF), _proc_cpu(mirror.pid)
            elapsed, paths = run_fetcher(weights, url, 1, ctx)
            cpu, m = _cpu(resource.RUSAGE_SELF) - cpu0, _proc_cpu(mirror.pid) - m0
            if paths[0].stat().st_size != size:
                raise SystemExit(f"the Fetcher wrote {paths[0].stat().st_size} bytes, not {size}")
            shutil.rmtree(weights)
            fetch_s.append(elapsed)
            _row("fetcher", run, size, elapsed, cpu, m)
        print()
        share: float | None = None
        fetch_best = size / MB / min(fetch_s)
        fetch_mean = size / MB / statistics.mean(fetch_s)
        print(f"fetcher: best {fetch_best:.0f} MB/s, mean {fetch_mean:.0f} MB/s")
        if curl_s:
            curl_best = size / MB / min(curl_s)
            curl_mean = size / MB / statistics.mean(curl_s)
            share = fetch_best / curl_best
            print(f"curl:    best {curl_best:.0f} MB/s, mean {curl_mean:.0f} MB/s")
            print(
                f"fetcher / curl: {share:.0%} best to best, "
                f"{fetch_mean / curl_mean:.0%} mean to mean; against curl before its fsync "
                f"(best {size / MB / min(curl_raw):.0f} MB/s): "
                f"{min(curl_raw) / min(fetch_s):.0%}"
            )
        else:
            print("curl: skipped (not installed); no throughput ratio")

        os.sync()
        before = _gets(count_file)
        weights = tmp / "weights-shards"
        elapsed, paths = run_fetcher(weights, url, SHARDS, ctx, source=f"bench:{time.time_ns()}")
        gets = _gets(count_file) - before
        same = len(set(paths)) == 1 and len(paths) == SHARDS
        print(
            f"\n{SHARDS} concurrent fetch() of one source: {gets} GET(s) of /{FILE_NAME} at the "
            f"mirror, {elapsed:.2f} s wall, "
            f"{'one path for all' if same else f'{len(set(paths))} different paths'}"
        )
        shutil.rmtree(weights)

        print("\ngoals:")
        if share is None:
            print(f"  >= {GOAL_SHARE:.0%} of curl's throughput: not measured (no curl)")
        else:
            met = "met" if share >= GOAL_SHARE else "unmet"
            print(f"  >= {GOAL_SHARE:.0%} of curl's throughput: {met} ({share:.0%})")
        one = gets == 1 and same
        print(f"  one download for {SHARDS} shards: {'met' if one else 'unmet'} ({gets} GETs)")
    finally:
        if mirror is not None:
            mirror.send_signal(signal.SIGTERM)
            try:
                mirror.wait(10)
            except subprocess.TimeoutExpired:
                mirror.kill()
                mirror.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
