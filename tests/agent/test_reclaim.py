"""Reclaim on the node: the real disk, the same `may_delete` the control plane plans with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio

from llmgw import config, model
from llmgw.agent._node import Node
from llmgw.agent._reclaim import TOO_MANY, reclaim
from llmgw.agent._servant import AgentServant
from llmgw.agent._supervisor import Supervisor
from llmgw.core import cache_name
from llmgw.core._weights import A_SYMLINK, LINKED, NOT_A_CACHE_NAME, OUTSIDE, TRAVERSES, WANTED
from llmgw.errors import StaleEpoch

PY = sys.executable


def entry(w: Path, source: str, sizes: dict[str, int]) -> Path:
    d = w / cache_name(source)
    d.mkdir(parents=True)
    for name, size in sizes.items():
        (d / name).write_bytes(b"x" * size)
    files = [{"name": n, "size": size} for n, size in sizes.items()]
    (d / ".llmgw-complete").write_text(json.dumps({"files": files}))
    return d


def size_of(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir())


def layout(tmp_path: Path) -> dict[str, Path]:
    w = tmp_path / "weights"
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.bin").write_bytes(b"k" * 5)
    paths = {
        "w": w,
        "old": entry(w, "mirror:/old/", {"a.gguf": 10, "b.gguf": 20}),
        "wanted": entry(w, "mirror:/wanted/", {"a.gguf": 7}),
        "flying": entry(w, "mirror:/flying/", {"a.gguf": 7}),
        "linked": entry(w, "mirror:/linked/", {"a.gguf": 7}),
        "other": other,
    }
    (w / "mine.gguf").write_bytes(b"m" * 3)  # an operator's file
    paths["mine"] = w / "mine.gguf"
    paths["outlink"] = w / cache_name("mirror:/outlink/")
    paths["outlink"].symlink_to(other)  # a symlink into another directory
    paths["inlink"] = w / cache_name("mirror:/inlink/")
    paths["inlink"].symlink_to(paths["linked"].name)  # a symlink to a cache entry
    return paths


def test_reclaim_removes_what_may_go_and_refuses_the_rest_untouched(tmp_path: Path) -> None:
    p = layout(tmp_path)
    w = p["w"]
    asked = [
        str(p["old"]),
        str(p["mine"]),
        str(p["outlink"]),
        str(p["other"] / "keep.bin"),
        str(p["linked"]),
        "/etc/passwd",
        f"{p['old']}/../mine.gguf",
        str(p["wanted"]),
        str(p["flying"]),
    ]
    old_bytes = size_of(p["old"])
    assert old_bytes > 30
    done = reclaim(
        w,
        asked,
        sources=["mirror:/wanted/", "Qwen/Qwen2.5-7B"],
        in_flight=frozenset({p["flying"].name}),
    )
    assert done.removed == (str(p["old"]),)
    assert done.freed_bytes == old_bytes
    assert not p["old"].exists()
    assert [(r.path, r.reason) for r in done.refused] == [
        (str(p["mine"]), NOT_A_CACHE_NAME),
        (str(p["outlink"]), A_SYMLINK),
        (str(p["other"] / "keep.bin"), OUTSIDE),
        (str(p["linked"]), LINKED),
        ("/etc/passwd", OUTSIDE),
        (f"{p['old']}/../mine.gguf", TRAVERSES),
        (str(p["wanted"]), WANTED),
        (str(p["flying"]), WANTED),
    ]
    assert done.refused[0].detail.startswith(f"{p['mine']}: not a cache name")
    # Untouched: every refused thing, and what the links lead to.
    assert p["mine"].read_bytes() == b"mmm"
    assert p["outlink"].is_symlink() and (p["other"] / "keep.bin").read_bytes() == b"k" * 5
    assert p["inlink"].is_symlink() and (p["linked"] / "a.gguf").exists()
    for name in ("wanted", "flying"):
        assert (p[name] / "a.gguf").exists()
    assert Path("/etc/passwd").exists()


def test_a_dry_run_deletes_nothing_and_says_what_would_go(tmp_path: Path) -> None:
    p = layout(tmp_path)
    done = reclaim(p["w"], [str(p["old"]), str(p["mine"])], sources=[], dry_run=True)
    assert done.removed == (str(p["old"]),)
    assert done.freed_bytes == size_of(p["old"])
    assert [r.reason for r in done.refused] == [NOT_A_CACHE_NAME]
    assert sorted(x.name for x in p["old"].iterdir()) == [".llmgw-complete", "a.gguf", "b.gguf"]


def test_a_file_inside_an_entry_and_a_path_asked_twice(tmp_path: Path) -> None:
    p = layout(tmp_path)
    one = str(p["old"] / "a.gguf")
    done = reclaim(p["w"], [one, one, f"{p['w']}//{p['old'].name}/./b.gguf"], sources=[])
    assert done.removed == (one, f"{p['w']}//{p['old'].name}/./b.gguf")
    assert done.freed_bytes == 30
    assert sorted(x.name for x in p["old"].iterdir()) == [".llmgw-complete"]


def test_past_the_bound_on_entries_every_path_is_refused(tmp_path: Path) -> None:
    p = layout(tmp_path)
    done = reclaim(p["w"], [str(p["old"])], sources=[], max_entries=3)
    assert done.removed == () and done.freed_bytes == 0
    (refusal,) = done.refused
    assert refusal.reason == TOO_MANY
    assert "holds more than 3 entries" in refusal.detail
    assert p["old"].exists()


async def test_through_the_servant_fenced_wanted_by_a_shard_and_rescanned(
    tmp_path: Path,
) -> None:
    p = layout(tmp_path)
    cfg = config.AgentConfig(
        node_id="node-a",
        servers=[config.HostPort("127.0.0.1:1")],
        tls=config.TlsFiles(ca=tmp_path / "a", cert=tmp_path / "b", key=tmp_path / "c"),
        state_dir=tmp_path / "state",
        weights_dir=p["w"],
    )
    node = Node(cfg, nvml=None)
    sup = Supervisor(tmp_path / "state", grace_s=1)
    servant = AgentServant(node, sup)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        argv = (PY, "-c", "import time; time.sleep(3600)", "mirror:/wanted/")
        await sup.start(
            model.ShardSpec(
                shard_id="s",
                model="m",
                engine="vllm",
                processes=(model.ProcessSpec(name="engine", argv=argv),),
                serves_http=False,
                source="mirror:/wanted/",
            )
        )
        await node.rescan_weights()
        before = (await node.heartbeat(1)).weights
        assert before is not None and before.dir == str(p["w"].resolve())
        assert str(p["old"] / "a.gguf") in {f.path for f in before.files}

        servant.newest_epoch = 5
        with pytest.raises(StaleEpoch, match="command from epoch 4 refused"):
            await servant.reclaim(4, [str(p["old"])], False)
        assert p["old"].exists()

        old_bytes = size_of(p["old"])
        done = await servant.reclaim(5, [str(p["old"]), str(p["wanted"])], False)
        assert done.removed == (str(p["old"]),) and done.freed_bytes == old_bytes
        assert [(r.path, r.reason) for r in done.refused] == [(str(p["wanted"]), WANTED)]
        after = (await node.heartbeat(2)).weights  # rescanned: the next heartbeat says so
        assert after is not None
        assert not any(f.path.startswith(str(p["old"])) for f in after.files)
        assert str(p["wanted"] / "a.gguf") in {f.path for f in after.files}
        await sup.stop("s")
        nursery.cancel_scope.cancel()
