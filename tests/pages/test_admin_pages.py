"""The admin pages in a real headless Chromium, against a real control plane and agents.

Every test saves a screenshot under its tmp_path and asserts the page logged no
console error and threw no uncaught exception. The pages' contract is the one
in llmgw/cp/_pages (selectors `tr[data-node]`, `svg[data-chart]`, `#log`, ...).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import ThrottlingProxy, require, slow_file_server

from llmgw.testing import fake_engine, fake_nvidia_smi
from llmgw.testing.browser import BrowserError, Page, open_browser
from llmgw.testing.cluster import LocalCluster, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _chromium() -> None:
    require(shutil.which("chromium") is not None, "Debian's chromium package (/usr/bin/chromium)")


def _api(cluster: LocalCluster, path: str) -> Any:
    reply = httpx.get(
        cluster.admin_url + path,
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        timeout=10,
    )
    assert reply.status_code == 200, f"GET {path}: {reply.status_code} {reply.text[:300]}"
    return reply.json()


def _api_nodes(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in _api(cluster, "/api/v1/nodes")["nodes"]}


async def _login(page: Page, cluster: LocalCluster) -> None:
    await page.goto(cluster.admin_url + "/admin/login")
    await page.fill("input[name=key]", cluster.admin_key)
    await page.submit("form")
    await page.wait_for("location.pathname === '/admin/' && document.readyState === 'complete'")


async def _finish(page: Page, tmp_path: Path, name: str) -> None:
    shot = await page.screenshot(tmp_path / f"{name}.png")
    assert shot.stat().st_size > 1000, shot
    page.assert_no_console_errors()


def _bytes(n: float) -> str:
    """A size as the pages write it, worked out here: "23.5 GiB" (one decimal, binary units)."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    power = 0
    while power < 4 and n >= 1024 ** (power + 1):
        power += 1
    return f"{n:.0f} B" if power == 0 else f"{n / 1024**power:.1f} {units[power]}"


# --- a fleet of two real agents, one with eight fake H100s and a vLLM shard -------------


class Fleet:
    def __init__(self, cluster: LocalCluster, shard_id: str) -> None:
        self.cluster = cluster
        self.shard_id = shard_id


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require(shutil.which("chromium") is not None, "Debian's chromium package (/usr/bin/chromium)")
    root = tmp_path_factory.mktemp("fleet")
    bin_dir = root / "bin"
    fake_nvidia_smi.install(bin_dir)
    fake_engine.install(bin_dir, "vllm")
    fake_engine.install(bin_dir, "llama-server")
    cluster = LocalCluster(root / "cluster")
    try:
        cluster.setup(["gpu-1", "cpu-1"])
        cluster.write_agent_config(
            "gpu-1",
            engine_paths={n: str(bin_dir / n) for n in ("vllm", "llama-server")},
        )
        cluster.write_agent_config(
            "cpu-1", engine_paths={"llama-server": str(bin_dir / "llama-server")}
        )
        cluster.start_cp()
        cluster.start_agent(
            "gpu-1",
            env={
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "LLMGW_FAKE_GPUS": "8xh100-80g",
                # The engine prints a timestamped statistics line every second.
                "LLMGW_FAKE_LOG_EVERY": "1",
                "LLMGW_FAKE_LOAD_DELAY": "0.2",
            },
        )
        cluster.start_agent("cpu-1")
        cluster.wait_states({"gpu-1": "ready", "cpu-1": "ready"}, timeout=30)
        out = cluster.ctl(
            "shard", "start", "gpu-1", "--engine", "vllm", "--model", "/models/tiny", "--gpus", "1"
        ).stdout
        shard_id = out.split()[0]

        def shard_ready() -> bool:
            shards = _api_nodes(cluster)["gpu-1"]["shards"]
            return any(s["shard_id"] == shard_id and s["state"] == "ready" for s in shards)

        wait_for(f"shard {shard_id} ready on gpu-1", shard_ready, 30)
        yield Fleet(cluster, shard_id)
    finally:
        cluster.stop_all()


# --- login, the cookie, and refusal without it --------------------------------------------


async def test_login_sets_a_strict_httponly_session_cookie(fleet: Fleet, tmp_path: Path) -> None:
    cluster = fleet.cluster
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await page.goto(cluster.admin_url + "/admin/login")
        # A wrong key: the form again, with an error, and no session.
        await page.fill("input[name=key]", "llmgw-admin-wrong")
        await page.submit("form")
        await page.wait_for(
            "document.readyState === 'complete' && location.pathname === '/admin/login'"
            " && document.querySelector('input[name=key]') !== null"
            " && document.querySelector('.error') !== null"
            " && document.querySelector('.error').textContent.trim() !== ''"
        )
        assert not [c for c in await page.cookies() if c["name"] == "llmgw_admin"]
        await page.screenshot(tmp_path / "login-refused.png")
        # The refused login's own status, which Chromium logs: the only error expected.
        assert all(
            re.fullmatch(r"Failed to load resource: .* status of 4\d\d .*", e.text)
            and e.url.endswith("/admin/login")
            for e in page.console_errors
        ), page.console_errors
        page.console_errors.clear()

        await _login(page, cluster)
        (cookie,) = [c for c in await page.cookies() if c["name"] == "llmgw_admin"]
        assert cookie["httpOnly"] is True
        assert cookie["sameSite"] == "Strict"
        assert cookie["path"] == "/admin"
        assert cookie["value"] and cluster.admin_key not in cookie["value"]
        # HttpOnly: the page's own scripts cannot read it.
        assert "llmgw_admin" not in await page.evaluate("document.cookie")
        await _finish(page, tmp_path, "logged-in")

        # Logged out: the same session cookie, replayed, opens nothing.
        await page.submit("form#logout")
        await page.wait_for("location.pathname === '/admin/login'")
        await page.call(
            "Network.setCookie",
            name="llmgw_admin",
            value=cookie["value"],
            url=cluster.admin_url + "/admin/",
            path="/admin",
            httpOnly=True,
            sameSite="Strict",
        )
        await page.goto(cluster.admin_url + "/admin/")
        assert await page.evaluate("location.pathname") == "/admin/login"
        await _finish(page, tmp_path, "logged-out")


async def test_without_the_cookie_pages_redirect_to_login_and_data_is_401(
    fleet: Fleet, tmp_path: Path
) -> None:
    cluster = fleet.cluster
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        for path in ("/admin/", "/admin/nodes/gpu-1", "/admin/keys", "/admin/replicas"):
            await page.goto(cluster.admin_url + path)
            await page.wait_for("location.pathname === '/admin/login'")
            assert await page.count("input[name=key]") == 1
        # The admin key itself as the cookie's value is not a session.
        await page.call(
            "Network.setCookie",
            name="llmgw_admin",
            value=cluster.admin_key,
            url=cluster.admin_url + "/admin/",
            path="/admin",
        )
        await page.goto(cluster.admin_url + "/admin/")
        await page.wait_for("location.pathname === '/admin/login'")
        status = await page.evaluate(
            "fetch('/admin/data/cluster', {redirect: 'manual'}).then(r => r.status)"
        )
        assert status == 401
        # The 401 fetched just now is logged by Chromium as a failed resource: expected.
        page.console_errors[:] = [
            e
            for e in page.console_errors
            if not (e.url.endswith("/admin/data/cluster") and "status of 401" in e.text)
        ]
        await _finish(page, tmp_path, "refused")


# --- the cluster page ---------------------------------------------------------------------


async def test_cluster_page_lists_the_nodes_with_the_api_figures(
    fleet: Fleet, tmp_path: Path
) -> None:
    cluster = fleet.cluster
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await _login(page, cluster)
        await page.wait_for("document.querySelectorAll('table#nodes tr[data-node]').length === 2")
        shown = await page.evaluate(
            "Array.from(document.querySelectorAll('table#nodes tr[data-node]'),"
            " r => r.dataset.node).sort()"
        )
        assert shown == ["cpu-1", "gpu-1"]
        api = await trio.to_thread.run_sync(_api_nodes, cluster)
        for node_id, node in api.items():
            row = f'table#nodes tr[data-node="{node_id}"]'
            inv = node["inventory"]
            usage = inv["usage"]
            assert await page.text(f"{row} td[data-field=state]") == node["state"] == "ready"
            # CPUs: the count the node reported.
            cpu = await page.text(f"{row} td[data-field=cpu]")
            assert re.search(rf"\b{inv['host']['cpu_count']} (logical )?CPUs?\b", cpu), cpu
            # RAM: the total as the API says, and a bar with its percent.
            ram = await page.text(f"{row} td[data-field=ram]")
            assert f"of {_bytes(usage['memory_total_bytes'])}" in ram, ram
            value = await page.attr(f"{row} td[data-field=ram] [data-bar]", "data-value")
            used = usage["memory_total_bytes"] - usage["memory_available_bytes"]
            assert value is not None
            assert abs(float(value) - 100 * used / usage["memory_total_bytes"]) < 10, value
            # GPUs: how many, of which class.
            gpus = await page.text(f"{row} td[data-field=gpus]")
            counts = [int(n) for n in re.findall(r"(\d+)\s*\u00d7", gpus)]
            assert sum(counts) == len(inv["gpus"]), gpus
            if inv["gpus"]:
                assert inv["gpus"][0]["gpu_class"] in gpus
            # Disk: every filesystem, its total as the API says.
            disk = await page.text(f"{row} td[data-field=disk]")
            for fs in usage["filesystems"]:
                assert fs["mount"] in disk and f"of {_bytes(fs['total_bytes'])}" in disk, disk
        assert len(api["gpu-1"]["inventory"]["gpus"]) == 8
        assert api["cpu-1"]["inventory"]["gpus"] == []
        shards = await page.text('table#nodes tr[data-node="gpu-1"] td[data-field=shards]')
        assert fleet.shard_id in shards
        await _finish(page, tmp_path, "cluster")


# --- the node page's charts -----------------------------------------------------------------


CHART_POINTS = """(name => {
  const svg = document.querySelector(`svg[data-chart="${name}"]`);
  if (svg === null) return null;
  const ds = Array.from(svg.querySelectorAll('path'), p => p.getAttribute('d') || '');
  const coords = ds.join(' ').match(/[ML]/g) || [];
  return {points: Number(svg.dataset.points), coords: coords.length, paths: ds.filter(d => d).length};
})"""


async def test_node_page_draws_its_charts_from_the_history(fleet: Fleet, tmp_path: Path) -> None:
    cluster = fleet.cluster

    def cpu_samples() -> tuple[int, int] | None:
        series = _api(cluster, "/api/v1/nodes/gpu-1/history")["series"]
        cpu = next(v for k, v in series.items() if "cpu" in k and isinstance(v, list))
        n = sum(1 for x in cpu if x is not None)
        return (n, len(cpu)) if n >= 2 else None

    # History buckets are 10 s wide: two samples after one bucket's turn.
    before, slots = await trio.to_thread.run_sync(
        lambda: wait_for("two CPU samples in gpu-1's history", cpu_samples, 40)
    )
    # The hour is mostly absent (the node is new): those slots must not be drawn.
    assert before < slots
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await _login(page, cluster)
        await page.goto(cluster.admin_url + "/admin/nodes/gpu-1")
        for name in ("cpu", "memory", "load", "disk", "gpu-util", "gpu-memory"):
            assert await page.count(f'svg[data-chart="{name}"]') == 1, name
        cpu = await page.wait_for(f"(c => c && c.points >= {before} && c)({CHART_POINTS}('cpu'))")
        # Every sample drawn is one M or L: an absent one is not drawn (no line to 0).
        assert cpu["coords"] == cpu["points"] < slots and cpu["paths"] >= 1, cpu
        memory = await page.evaluate(f"{CHART_POINTS}('memory')")
        assert memory["points"] > 0 and memory["coords"] == memory["points"], memory
        await _finish(page, tmp_path, "node-gpu-1")

        # A node with no GPU: no GPU series, so its GPU charts draw no line at all.
        await page.goto(cluster.admin_url + "/admin/nodes/cpu-1")
        for name in ("gpu-util", "gpu-memory"):
            chart = await page.evaluate(f"{CHART_POINTS}('{name}')")
            assert chart == {"points": 0, "coords": 0, "paths": 0}, (name, chart)
        cpu = await page.evaluate(f"{CHART_POINTS}('cpu')")
        assert cpu["points"] > 0 and cpu["coords"] == cpu["points"], cpu
        await _finish(page, tmp_path, "node-cpu-1")


# --- the logs page follows a growing engine log ------------------------------------------


async def test_logs_page_follows_a_growing_engine_log(fleet: Fleet, tmp_path: Path) -> None:
    cluster = fleet.cluster
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await _login(page, cluster)
        await page.goto(cluster.admin_url + "/admin/logs?node=gpu-1")
        sources = await page.wait_for(
            "(() => { const v = [];"
            " document.querySelectorAll('select[name=source] option').forEach(o => v.push(o.value));"
            " document.querySelectorAll('a[href*=\"source=\"]').forEach(a =>"
            "   v.push(new URL(a.href).searchParams.get('source')));"
            " return v.length ? v : null; })()"
        )
        assert "agent" in sources, sources
        engine = next(s for s in sources if fleet.shard_id in s)
        await page.goto(
            cluster.admin_url + f"/admin/logs?node=gpu-1&source={engine.replace('/', '%2F')}"
        )
        assert await page.evaluate("document.querySelector('input#follow').checked") is True
        try:
            await page.wait_for("document.querySelector('#log').textContent.includes('loggers.py')")
        except BrowserError as exc:
            shown = await page.text("#log")
            error = await page.text("#log-error")
            raise AssertionError(f"#log: {shown[-1500:]!r}; #log-error: {error!r}") from exc
        # Marked: a reload would lose it, so what arrives next arrived in place.
        await page.evaluate("window.__llmgwTestMark = 1")
        opened = time.strftime("%m-%d %H:%M:%S", time.localtime())
        latest = await page.wait_for(
            "(() => { const m = document.querySelector('#log').textContent"
            "   .match(/INFO (\\d\\d-\\d\\d \\d\\d:\\d\\d:\\d\\d) \\[loggers\\.py/g) || [];"
            f"  const after = m.map(s => s.slice(5, 19)).filter(t => t > {json.dumps(opened)});"
            "  return after.length ? after[after.length - 1] : null; })()",
            timeout=15,
        )
        assert latest > opened
        assert await page.evaluate("window.__llmgwTestMark") == 1
        await _finish(page, tmp_path, "logs")


# --- keys: create (secret shown once) and revoke ---------------------------------------------


def _router_status(cluster: LocalCluster, secret: str) -> int:
    return httpx.get(
        cluster.router_url + "/models",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=10,
    ).status_code


async def test_keys_can_be_created_shown_once_and_revoked(fleet: Fleet, tmp_path: Path) -> None:
    cluster = fleet.cluster
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await _login(page, cluster)
        await page.goto(cluster.admin_url + "/admin/keys")
        await page.fill("form#create-key input[name=tenant]", "browser-test")
        await page.submit("form#create-key")
        secret = await page.wait_for(
            "document.readyState === 'complete' && document.querySelector('#secret')"
            " && document.querySelector('#secret').textContent.trim()"
        )
        keys = await trio.to_thread.run_sync(lambda: _api(cluster, "/api/v1/keys")["keys"])
        (key,) = [k for k in keys if k.get("tenant") == "browser-test"]
        key_id = key["key_id"]
        assert await page.count(f'table#keys tr[data-key="{key_id}"]') == 1
        assert await trio.to_thread.run_sync(_router_status, cluster, secret) == 200
        await _finish(page, tmp_path, "key-created")

        # Shown once: the keys page again does not hold it.
        await page.goto(cluster.admin_url + "/admin/keys")
        assert secret not in await page.evaluate("document.documentElement.outerHTML")
        assert await page.count(f'table#keys tr[data-key="{key_id}"]') == 1

        await page.click(f'button[data-revoke="{key_id}"]')
        # Revoked: no longer active (the row stays, marked, with no revoke button).
        row = f'table#keys tr[data-key="{key_id}"]'
        await page.wait_for(
            "document.readyState === 'complete'"
            f" && document.querySelector({json.dumps(row + ' td[data-field=state]')}) !== null"
            f" && document.querySelector({json.dumps(row + ' td[data-field=state]')})"
            ".textContent.trim() === 'revoked'"
        )
        assert await page.count(f'button[data-revoke="{key_id}"]') == 0
        status = await trio.to_thread.run_sync(
            lambda: wait_for(
                "the revoked key refused by the router",
                lambda: (s := _router_status(cluster, secret)) == 401 and s,
                10,
            )
        )
        assert status == 401
        await _finish(page, tmp_path, "key-revoked")


# --- the replicas page during a throttled download ---------------------------------------


@pytest.fixture
def throttled_files(tmp_path: Path) -> Iterator[tuple[Path, ThrottlingProxy]]:
    """A plain HTTP file server on loopback behind a throttling proxy (256 KiB/s)."""
    root = tmp_path / "files"
    root.mkdir()
    with slow_file_server(root, 256 * 1024) as proxy:
        yield root, proxy


async def test_replicas_page_shows_a_progress_bar_during_a_throttled_download(
    cluster: LocalCluster, tmp_path: Path, throttled_files: tuple[Path, ThrottlingProxy]
) -> None:
    root, proxy = throttled_files
    size = 16 << 20  # 64 s at 256 KiB/s: downloading for the whole test
    (root / "big.bin").write_bytes(os.urandom(size))
    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.models = [
        {
            "name": "big",
            "source": f"http://127.0.0.1:{proxy.port}/big.bin",
            "replicas": 1,
            "profiles": [{"engine": "llama-server", "gpus_per_node": 0, "startup_timeout_s": 300}],
        }
    ]
    cluster.setup(["n1"])
    cluster.write_agent_config("n1", engine_paths={"llama-server": str(llama)})
    cluster.start_cp()
    cluster.start_agent("n1")

    def downloading() -> dict[str, Any] | None:
        for row in _api(cluster, "/api/v1/replicas")["replicas"]:
            if row.get("model") == "big" and row.get("progress"):
                return dict(row)
        return None

    row = await trio.to_thread.run_sync(
        lambda: wait_for("big's replica downloading", downloading, 30)
    )
    replica = row["replica"]
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await _login(page, cluster)
        await page.goto(cluster.admin_url + "/admin/replicas")
        bar = f'tr[data-replica="{replica}"] progress[data-progress]'
        first = await page.wait_for(
            f"(p => p && Number(p.value) > 0 && {{value: Number(p.value), max: Number(p.max)}})"
            f"(document.querySelector({json.dumps(bar)}))"
        )
        assert first["max"] == size and 0 < first["value"] < size, first
        assert "n1" in await page.text(f'tr[data-replica="{replica}"]')
        # It moves in place as the download goes on.
        await page.evaluate("window.__llmgwTestMark = 1")
        later = await page.wait_for(
            f"(p => p && Number(p.value) > {first['value']} && Number(p.value))"
            f"(document.querySelector({json.dumps(bar)}))",
            timeout=15,
        )
        assert first["value"] < later < size
        assert await page.evaluate("window.__llmgwTestMark") == 1
        await _finish(page, tmp_path, "replicas")
