"""`llmgw ctl weights [--collect]`, the download line under a replica, what each fabric
holds: the pure formatting (llmgw/ctl/_weights.py), then a real llmgw-cp and a real
llmgw-agent whose weights directory holds a reclaimable cache entry, a wanted one, an
operator's file and a symlink into another directory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent._fetch import _write_marker
from llmgw.core import cache_name
from llmgw.ctl import _weights
from llmgw.testing.cluster import LocalCluster, wait_for

GIB = 2**30


def _p(source: str, done: int, total: int | None, rate: float | None) -> dict[str, Any]:
    eta = (total - done) / rate if total is not None and rate else None
    return {"source": source, "done_bytes": done, "total_bytes": total,
            "rate_bytes_per_s": rate, "eta_s": eta}  # fmt: skip


def test_the_download_line_reads_as_the_issue_shows_it() -> None:
    p = _p("mirror:/models/qwen-7b/", int(6.1 * GIB), int(15.2 * GIB), 310e6)
    assert _weights.format_progress(p) == (
        "downloading qwen-7b/ 6.1/15.2 GiB (40 %), 310 MB/s, about 30 s left"
    )
    assert _weights.format_progress(_p("https://h/x.gguf?sig=abc", int(1.2 * GIB), None, 310e6)) == (
        "downloading x.gguf 1.2 GiB so far, 310 MB/s"
    )  # fmt: skip
    # No rate yet (one message): no speed, no time left.
    assert _weights.format_progress(_p("mirror:/q/", 512 * 2**20, GIB, None)) == (
        "downloading q/ 0.5/1.0 GiB (50 %)"
    )
    assert _weights.format_progress(_p("mirror:/q.gguf", 10, 40, 1.0)) == (
        "downloading q.gguf 10/40 B (25 %), 1 B/s, about 30 s left"
    )
    assert _weights.format_progress(_p("mirror:/q.gguf", 40, 40, 5e3)) == (
        "downloading q.gguf 40/40 B (100 %), 5.0 kB/s, about 1 s left"
    )


def test_names_and_times() -> None:
    assert _weights.source_name("mirror:/tiny/") == "tiny/"
    assert _weights.source_name("mirror:/a/b.gguf") == "b.gguf"
    assert _weights.source_name("https://h/v1/files/?x=1") == "files/"
    assert [_weights.about(s) for s in (0.2, 7.4, 31.5, 600, 5400)] == [
        "about 1 s left", "about 7 s left", "about 30 s left", "about 10 min left",
        "about 1.5 h left",
    ]  # fmt: skip


@given(
    done=st.integers(0, 2**44),
    total=st.one_of(st.none(), st.integers(1, 2**44)),
    rate=st.one_of(st.none(), st.floats(0.5, 1e11)),
)
def test_the_line_invents_nothing(done: int, total: int | None, rate: float | None) -> None:
    if total is not None:
        done = min(done, total)
    line = _weights.format_progress(_p("mirror:/m/", done, total, rate))
    assert line.startswith("downloading m/ ")
    assert ("%" in line) == (total is not None)
    assert ("so far" in line) == (total is None)
    assert ("/s" in line) == (rate is not None)
    assert ("left" in line) == (rate is not None and total is not None)
    if total is not None and done < total:
        assert "(100 %)" not in line  # never complete before it is


def test_collect_summary_groups_refusals_by_reason_per_node() -> None:
    answer = {
        "dry_run": False,
        "nodes": [
            {"node": "node-a", "asked": ["/w/src-1", "/w/src-2"], "asked_bytes": 9_100_000_000,
             "removed": ["/w/src-1", "/w/src-2"], "freed_bytes": 9_100_000_000, "refused": [],
             "error": None},
            {"node": "node-b", "asked": ["/w/x"], "asked_bytes": 5_100_000_000, "removed": [],
             "freed_bytes": 0, "error": None,
             "refused": [{"path": "/w/x", "reason": "not a cache name",
                          "detail": "/w/x: not a cache name ('x' is not src-<32 hex digits>)"}]},
            {"node": "node-c", "asked": [], "asked_bytes": 0, "removed": [], "freed_bytes": 0,
             "refused": [], "error": None},
        ],
    }  # fmt: skip
    assert _weights.format_collect(answer) == [
        "asked to remove 3 files (14.2 GB); removed 2 (9.1 GB); node-b refused 1: not a cache name",
        "  node-b: /w/x: not a cache name ('x' is not src-<32 hex digits>)",
    ]
    answer["dry_run"] = True
    answer["nodes"][1]["refused"] *= 2
    answer["nodes"][1]["refused"].append({"path": "/w/l", "reason": "a symlink", "detail": "d"})
    answer["nodes"][0]["error"] = "did not answer reclaim in 30 s"
    answer["nodes"][1]["asked_bytes"] = None  # a path the control plane has no size for
    head, *rest = _weights.format_collect(answer)
    assert head == ("asked to remove 3 files (dry run); would remove 2 (9.1 GB); node-a failed; "
                    "node-b refused 3: 1 a symlink, 2 not a cache name")  # fmt: skip
    assert rest[0] == "  node-a: did not answer reclaim in 30 s"


def test_fabric_lines() -> None:
    fabrics = [{"fabric": "ib0", "nodes": ["a", "b"],
                "models": [{"model": "qwen", "bytes": 15_200_000_000, "nodes": ["a", "b"]}]},
               {"fabric": None, "nodes": ["c"], "models": []}]  # fmt: skip
    assert _weights.format_fabrics(fabrics) == [
        "FABRIC     NODES  HOLDS",
        "ib0        a,b    qwen (15.2 GB on 2 nodes)",
        "no fabric  c      -",
    ]


# --- a real control plane and agent ---------------------------------------------------

WANTED = "mirror:/wanted.gguf"


def _entry(weights: Path, source: str, name: str, data: bytes) -> Path:
    """A complete cache entry, as the agent's fetcher leaves one."""
    entry = weights / cache_name(source)
    entry.mkdir(parents=True)
    (entry / name).write_bytes(data)
    _write_marker(entry, [(name, len(data))])
    return entry


def _weights_view(cluster: LocalCluster) -> dict[str, Any]:
    return dict(json.loads(cluster.ctl("weights", "--json").stdout)["nodes"][0])


def test_ctl_weights_lists_and_collect_removes_only_what_is_unwanted(
    cluster: LocalCluster,
) -> None:
    # One catalog model that wants a fetched entry; no node can run it (no GPU here), so
    # nothing starts, and its entry must still be kept.
    cluster.models = [{"name": "wanted", "source": WANTED, "replicas": 1, "profiles": [
        {"engine": "vllm", "gpu_class": "h100-80g", "gpus_per_node": 1}]}]  # fmt: skip
    cluster.setup(["n1"])
    weights = Path(os.path.realpath(cluster.root / "n1-weights"))
    gone = _entry(weights, "mirror:/gone.gguf", "gone.gguf", b"GGUF" + b"\0" * 996)
    kept = _entry(weights, WANTED, "wanted.gguf", b"GGUF" + b"\1" * 96)
    # A download of a source no model names any more, never finished: no marker.
    half = weights / cache_name("mirror:/half.gguf")
    half.mkdir()
    (half / "half.gguf.partial").write_bytes(b"GGUF" + b"\2" * 296)
    (weights / "mine.gguf").write_bytes(b"GGUF mine")  # an operator's file
    elsewhere = cluster.root / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "target.gguf").write_bytes(b"GGUF target")
    (weights / "link.gguf").symlink_to(elsewhere / "target.gguf")
    cluster.start_cp()
    cluster.start_agent("n1")
    view = wait_for("n1's weights", lambda: (v := _weights_view(cluster))["reported"] and v, 30)
    assert view["weights_dir"] == str(weights)
    held = {h["path"]: (h["kind"], h["size_bytes"], h["wanted_by"]) for h in view["held"]}
    assert held == {
        str(gone): ("cache", 1000, []),
        str(kept): ("cache", 100, ["wanted"]),
        str(weights / "mine.gguf"): ("file", 9, []),
        str(weights / "link.gguf"): ("file", 11, []),
    }
    assert view["unfinished"] == [
        {"path": str(half), "kind": "cache", "size_bytes": 300, "files": 0, "wanted_by": []}
    ]
    assert sorted(view["reclaimable"], key=lambda r: r["size_bytes"]) == [
        {"path": str(half), "size_bytes": 300},
        {"path": str(gone), "size_bytes": 1000},
    ]
    text = cluster.ctl("weights").stdout
    assert f"n1: {weights}" in text
    assert f"{gone.name}/" in text and "not wanted" in text and "wanted" in text
    assert f"  unfinished: {half.name}/ (300 B so far), wanted by: not wanted" in text
    assert "would reclaim 2 entries (1.3 kB): " in text and half.name in text

    dry = cluster.ctl("weights", "--collect", "--dry-run")
    assert dry.stdout.splitlines()[0] == (
        "asked to remove 2 files (1.3 kB) (dry run); would remove 2 (1.3 kB)"
    )
    assert gone.is_dir() and half.is_dir()

    done = cluster.ctl("weights", "--collect")
    assert done.stdout.splitlines() == ["asked to remove 2 files (1.3 kB); removed 2 (1.3 kB)"]
    assert not gone.exists() and not half.exists()
    assert (kept / "wanted.gguf").is_file() and (weights / "mine.gguf").is_file()
    assert (weights / "link.gguf").is_symlink() and (elsewhere / "target.gguf").is_file()
    # The agent rescans: the next report no longer holds it.
    wait_for("the entry gone from the report",
             lambda: str(gone) not in {h["path"] for h in _weights_view(cluster)["held"]}, 30)  # fmt: skip

    # Paths a control plane asks for are checked again by the agent, which refuses them.
    asked = ["/etc/passwd", str(weights / "mine.gguf"), str(weights / "link.gguf"), str(kept)]
    refused = cluster.ctl("weights", "--collect", "--node", "n1",
                          *[a for p in asked for a in ("--path", p)], check=False)  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    head, *details = refused.stdout.splitlines()
    assert head.startswith("asked to remove 4 files; removed 0 (0 B); n1 refused 4: ")
    assert "2 not a cache name" in head and "1 outside the weights directory" in head
    assert "1 still wanted by the catalog" in head
    assert any(d.startswith("  n1: /etc/passwd: outside the weights directory") for d in details)
    assert Path("/etc/passwd").is_file() and (weights / "mine.gguf").is_file()
    assert (weights / "link.gguf").is_symlink() and (kept / "wanted.gguf").is_file()


def test_ctl_replicas_and_status_print_the_lines(monkeypatch: Any, capsys: Any) -> None:
    import httpx

    from llmgw.ctl import main

    now = time.time()
    answers = {
        "/api/v1/replicas": {"replicas": [
            {"model": "qwen", "replica": "qwen-1", "state": "starting", "nodes": ["a"],
             "since": now, "stale": False, "reason": None, "last_failure": None,
             "progress": {"node": "a", **_p("mirror:/qwen-7b/", GIB, 2 * GIB, 1e8)}},
            {"model": "tiny", "replica": "tiny-1", "state": "starting", "nodes": ["a"],
             "since": now, "stale": False, "reason": None, "last_failure": None,
             "progress": None},
        ]},
        "/api/v1/status": {"models": [], "reconciler": {}, "fabrics": [
            {"fabric": None, "nodes": ["a"],
             "models": [{"model": "qwen", "bytes": 10**9, "nodes": ["a"]}]}]},
        "/api/v1/leader": {"role": "leader", "epoch": 7, "leader": None, "me": None,
                           "lease_s": 10.0},
    }  # fmt: skip
    asked: list[str] = []

    def request(method: str, url: str, **_: Any) -> httpx.Response:
        route = url.removeprefix("http://cp:8081")
        asked.append(route)
        return httpx.Response(200, json=answers[route], request=httpx.Request(method, url))

    # The answers come through the admin API's client, as from a control plane.
    monkeypatch.setattr(httpx, "request", request)
    monkeypatch.setenv("LLMGW_CTL_CONFIG", "/nonexistent/ctl.yaml")
    monkeypatch.setenv("LLMGW_ADMIN_URL", "http://cp:8081")
    monkeypatch.setenv("LLMGW_ADMIN_KEY", "k")
    assert main(["replicas"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["qwen", "qwen-1", "starting"]
    assert lines[2] == "  downloading qwen-7b/ 1.0/2.0 GiB (50 %), 100 MB/s, about 10 s left"
    assert lines[3].split()[:3] == ["tiny", "tiny-1", "starting"] and len(lines) == 4
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("control plane: leader, epoch 7\n")
    assert out.endswith("\nFABRIC     NODES  HOLDS\nno fabric  a      qwen (1.0 GB on 1 node)\n")
    # --path belongs to --collect and --node: refused before anything is asked.
    assert main(["weights", "--collect", "--path", "/x"]) == 1
    assert "--path needs --node" in capsys.readouterr().err
    assert main(["weights", "--dry-run"]) == 1
    assert "go with --collect" in capsys.readouterr().err
    assert asked == ["/api/v1/replicas", "/api/v1/status", "/api/v1/leader"]
