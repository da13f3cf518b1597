"""Fuzz targets for every parser of outside input: each must parse or raise ParseError.

(`http_request`, the router's HTTP/1.1 request parser, has its own property: see
`_http_request`; it never raises, it refuses with a status.)

Seeds are samples the parser must read (error outputs are tested elsewhere).
Each target is fed the real samples in tests/data whole, cut at every
length (the way h11's fuzz/afl-server.py feeds a connection byte by byte), and
mutated at random by hypothesis (characters inserted, deleted, replaced,
lines duplicated or dropped), plus arbitrary text. Anything other than a value
or `llmgw.errors.ParseError` is a bug.

Run longer than the test suite does:

    .venv/bin/python fuzz/targets.py [TARGET ...] [--seconds 60]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.agent import discovery as d
from llmgw.core import parse_xid_line, resume_plan
from llmgw.errors import ParseError
from llmgw.host.os_release import parse_os_release
from llmgw.router._continue import Join
from llmgw.router._http1 import END, Failure, Head, RequestParser
from llmgw.router._metering import UsageStrip
from llmgw.router._tokens import timings_usage

# The recorded samples live in the repository (tests/data/INDEX.md names their sources).
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "data"


@attrs.frozen
class Target:
    name: str
    parse: Callable[[str], object]
    seeds: tuple[str, ...]


def _fixtures(*patterns: str) -> tuple[str, ...]:
    texts: list[str] = []
    for pattern in patterns:
        texts.extend(p.read_text() for p in sorted(FIXTURES.glob(pattern)) if p.is_file())
    return tuple(texts)


def _sysfs_values(name: str) -> tuple[str, ...]:
    root = FIXTURES / "sysfs-infiniband-h100-ndr400-plus-bf3-roce-bond"
    return tuple(sorted({p.read_text() for p in root.glob(f"*/ports/*/{name}")}))


def _gpu_csv_noheader(text: str) -> object:
    return d.parse_gpu_csv(text, d.GPU_QUERY_FIELDS)


def _kernel_log(text: str) -> object:
    # The agent reads a kernel log line by line (llmgw/agent/_gpu_faults.py).
    return [parse_xid_line(line) for line in text.splitlines()]


def _smi_csv_fields(text: str) -> object:
    # The noheader sample's query: memory.total,memory.free,... (7 fields).
    return d.parse_smi_csv(text, [f"field{i}" for i in range(7)])


def _http_events(parser: RequestParser) -> list[object]:
    """The parser's events with each message's body joined (pieces follow the reads)."""
    out: list[object] = []
    body: list[bytes] = []
    for event in parser.events:
        if type(event) is bytes:
            body.append(event)
            continue
        if body:
            out.append(b"".join(body))
            body = []
        out.append(event.status if type(event) is Failure else event)
    if body:
        out.append(b"".join(body))
    return out


def _http_request(text: str) -> object:
    """The router's request parser (llmgw/router/_http1.py), fed whole and byte by byte.

    Invariants: the same requests and the same refusal either way; a refusal is a
    4xx (or 501, a transfer coding not applied, or 505) and the last event, so nothing after a framing error is ever
    served on that connection; a body is only ever inside a request.
    """
    data = text.encode("latin-1", "replace")
    whole = RequestParser()
    whole.feed(data)
    split = RequestParser()
    for i in range(len(data)):
        split.feed(data[i : i + 1])
    events = _http_events(whole)
    assert events == _http_events(split), (data, events, _http_events(split))
    in_message = False
    for i, event in enumerate(events):
        if type(event) is int:
            assert 400 <= event < 500 or event in (501, 505), event
            assert i == len(events) - 1, events
        elif type(event) is Head:
            assert not in_message, events
            in_message = True
        elif event is END:
            assert in_message, events
            in_message = False
        else:
            assert type(event) is bytes and in_message, events
    return events


def _stream_join(text: str) -> object:
    """The splice of a cut stream (llmgw/router/_continue.py) over an engine's SSE bytes,
    fed whole and in 7-byte pieces: the same output either way; the first stream passes
    unchanged; a continued one comes out as whole events only (or the held rest)."""
    data = text.encode("utf-8", "replace")

    def run(pieces: list[bytes]) -> tuple[bytes, bytes, str, int]:
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        j = Join(resume_plan("/v1/chat/completions", {**request, "temperature": 0}))
        first = b"".join(j.feed(p) for p in pieces) + j.rest()
        j.body("llama-server")
        j.begin()
        second = b"".join(j.feed(p) for p in pieces) + j.rest()
        return first, second, j.text, j.tokens

    whole = run([data])
    assert whole == run([data[i : i + 7] for i in range(0, len(data), 7)]), data
    assert whole[0] == data
    return whole


def _usage_strip(text: str) -> object:
    """What asking for usage added, taken out (llmgw/router/_metering.py) of an engine's
    SSE bytes fed whole and in 7-byte pieces: the same output either way, a stream
    without `"usage"` unchanged, and llama-server's `timings` read or not, never raising."""
    data = text.encode("utf-8", "replace")

    def run(pieces: list[bytes]) -> tuple[bytes, bytes]:
        strip = UsageStrip(nulls=True)
        fed = [strip.feed(p) for p in pieces]
        return b"".join(o for o, _ in fed) + strip.end(), b"".join(r for _, r in fed)

    whole = run([data])
    assert whole == run([data[i : i + 7] for i in range(0, len(data), 7)]), data
    if b'"usage"' not in data:
        assert whole == (data, b""), data
    return whole, timings_usage(data)


_SSE_SEEDS = tuple(
    "\n\n".join(t.split("\n\n", 3)[:3]) + "\n\n" for t in _fixtures("llama-server-*.sse")
)
_USAGE_SEEDS = _fixtures("llama-server-*-usage.sse", "vllm-*.sse")
_CHAT = b'{"model":"chat","messages":[{"role":"user","content":"hi"}]}'
_HTTP_SEEDS = tuple(
    s.decode("latin-1")
    for s in (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer k\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_CHAT) + _CHAT,
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\nGET /healthz HTTP/1.1\r\nHost: r\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\nTrailer: v\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /healthz HTTP/1.1\r\nHost: r\r\n\r\n",
        b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\nHEAD /healthz HTTP/1.1\r\nHost: r\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
        b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    )
)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "gpu_csv",
            _gpu_csv_noheader,
            (
                *_fixtures("csv-h100-*", "csv-l40s-*"),
                "0, GPU-a, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559, 10, 9.0, 0, 37\n"
                "1, GPU-b, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559, 0, 9.0, [N/A]\n",
            ),
        ),
        Target("smi_csv", d.parse_smi_csv, _fixtures("csv-[!n]*")),
        Target("smi_csv_fields", _smi_csv_fields, _fixtures("csv-noheader-*", "csv-gtx650-*")),
        Target(
            "compute_apps",
            d.parse_compute_apps,
            (*_fixtures("csv-compute-apps-*"), "GPU-a, 100, 2048\nGPU-b, 200, [N/A]\n"),
        ),
        Target("smi_versions", d.parse_smi_versions, _fixtures("smi-[!e]*", "q-*")),
        Target("topo", d.parse_topo, _fixtures("topo-*")),
        Target("ib_state", d.parse_ib_state, (*_sysfs_values("state"), "2: INIT\n")),
        Target("ib_phys_state", d.parse_ib_phys_state, _sysfs_values("phys_state")),
        Target("ib_rate", d.parse_ib_rate, (*_sysfs_values("rate"), "2.5 Gb/sec (1X SDR)\n")),
        Target("ibstatus", d.parse_ibstatus, _fixtures("ib-ibstatus-*")),
        Target("cpuinfo", d.parse_cpuinfo, _fixtures("cpu-proc-cpuinfo-*")),
        Target("lscpu", d.parse_lscpu, _fixtures("cpu-lscpu-*")),
        Target("os_release", parse_os_release, _fixtures("osrelease-*")),
        Target(
            "meminfo",
            d.parse_meminfo,
            ("MemTotal:       16318108 kB\nMemFree: 1 kB\nMemAvailable:   12000000 kB\n",),
        ),
        Target("loadavg", d.parse_loadavg, ("0.52 0.58 0.59 1/467 12345\n",)),
        Target("proc_stat", d.parse_proc_stat, ("cpu  10 0 5 800 3 0 1 0 0 0\ncpu0 1 2 3 4\n",)),
        Target("mountinfo", d.parse_mountinfo, _fixtures("mounts-nfs-*")),
        Target("mount_output", d.parse_mount_output, _fixtures("mounts-lustre-*")),
        Target("http_request", _http_request, _HTTP_SEEDS),
        Target("kernel_log_xids", _kernel_log, _fixtures("kernlog-*")),
        Target("smi_q_memory", d.parse_smi_q_memory, _fixtures("q-*", "smiq-*")),
        Target("smi_q_mig", d.parse_smi_q_mig, _fixtures("q-*")),
        Target("smi_list", d.parse_smi_list, _fixtures("smil-*")),
        Target(
            "mig_modes", d.parse_mig_modes, _fixtures("csv-mig-*", "csv-h100-mig-*", "csv-l40s-*")
        ),
        Target("stream_join", _stream_join, _SSE_SEEDS),
        Target("usage_strip", _usage_strip, _USAGE_SEEDS),
    )
}


def check(target: Target, text: str) -> None:
    """The property: a value, or ParseError. Anything else propagates and fails."""
    with contextlib.suppress(ParseError):
        target.parse(text)


def cuts(seed: str, every: int = 1) -> list[int]:
    """The lengths a seed is cut at: every `every`-th one, and always each line's end
    with a character either side of it (the parsers read lines: a cut there ends a
    line, or the text, where a parser looks next)."""
    at = set(range(0, len(seed) + 1, every)) | {len(seed)}
    for i, ch in enumerate(seed):
        if ch == "\n":
            at |= {i - 1, i, i + 1, i + 2}
    return sorted(n for n in at if 0 <= n <= len(seed))


def check_prefixes(target: Target, *, every: int = 1) -> int:
    """Each seed cut at the lengths of `cuts` (every length when `every` is 1); returns
    how many inputs were tried."""
    n = 0
    for seed in target.seeds:
        for i in cuts(seed, every):
            check(target, seed[:i])
            n += 1
    return n


_ALPHABET = st.sampled_from(list(" \t\n\r,:;=\"'[]()/-_.%0123456789XNVGPUxabcMiB#\\\x00é²"))


def _mutate(seed: str, edits: list[tuple[int, int, str]]) -> str:
    text = seed
    for pos, op, chunk in edits:
        i = pos % (len(text) + 1)
        if op == 0:  # insert
            text = text[:i] + chunk + text[i:]
        elif op == 1:  # delete
            text = text[:i] + text[i + len(chunk) + 1 :]
        elif op == 2:  # replace
            text = text[:i] + chunk + text[i + len(chunk) :]
        else:  # duplicate or drop a line
            lines = text.splitlines(keepends=True)
            if lines:
                j = pos % len(lines)
                lines[j : j + 1] = [lines[j]] * (op - 3) if op < 6 else []
                text = "".join(lines)
    return text


def inputs(target: Target) -> st.SearchStrategy[str]:
    seed = st.sampled_from(target.seeds)
    cut = st.tuples(seed, st.integers(0, 1 << 20)).map(lambda t: t[0][: t[1] % (len(t[0]) + 1)])
    edit = st.tuples(st.integers(0, 1 << 20), st.integers(0, 6), st.text(_ALPHABET, max_size=4))
    mutated = st.tuples(seed, st.lists(edit, min_size=1, max_size=6)).map(lambda t: _mutate(*t))
    noise = st.one_of(
        st.text(_ALPHABET, max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("utf-8", "replace")),
    )
    return st.one_of(seed, cut, mutated, mutated, noise)


def fuzz(target: Target, max_examples: int, *, seed: int | None = None) -> None:
    """Run hypothesis on one target for `max_examples` inputs."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=seed is not None,
        suppress_health_check=list(HealthCheck),
    )
    @given(inputs(target))
    def run(text: str) -> None:
        check(target, text)

    run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"default: all of {', '.join(TARGETS)}")
    parser.add_argument("--seconds", type=float, default=30.0, help="per target")
    args = parser.parse_args(argv)
    for name in args.targets or list(TARGETS):
        target = TARGETS[name]
        print(f"{name}: {check_prefixes(target)} prefixes", flush=True)
        start, runs = time.monotonic(), 0
        while time.monotonic() - start < args.seconds:
            fuzz(target, 500)
            runs += 500
        print(f"{name}: {runs} random inputs, no failure", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
