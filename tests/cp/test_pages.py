"""The admin pages (llmgw/cp/_pages) at the ASGI level, through the real AdminApp.

A real NodeRegistry, Reconciler, CatalogFile and SQLite key store stand behind the
admin API; the pages read it in-process, as they do under hypercorn. Chromium
drives the same pages in tests/integration (helper P5's).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import httpx
import pytest
from helpers import FakeAgent, register
from hypothesis import given
from hypothesis import strategies as st

from llmgw import core, model
from llmgw.cp._admin import AdminApp
from llmgw.cp._fleet._catalog import Catalog, CatalogModel, Profile, fingerprint
from llmgw.cp._fleet._catalog_file import CatalogFile
from llmgw.cp._fleet._reconciler import Reconciler
from llmgw.cp._fleet._registry import NodeRegistry
from llmgw.cp._observe._history import History
from llmgw.cp._pages import COOKIE, Sessions, api_client, make_pages
from llmgw.cp._pages._sessions import MAX_SESSIONS, SESSION_TTL_S
from llmgw.cp._pages._view import DASH, chart
from llmgw.router._keys import StoreKeys
from llmgw.router._main import open_keys_db
from llmgw.testing.cluster import LocalCluster

KEY = "llmgw-admin-test-key"
HOSTILE = '<script>alert("x")</script>'
GIB = 1 << 30


def _catalog() -> Catalog:
    cpu = Profile(engine="llama-server")
    return Catalog(
        (
            CatalogModel(name="tiny", source="mirror:/tiny/", profiles=[cpu]),
            CatalogModel(name="big", source="mirror:/big/", replicas=2,
                         profiles=[Profile(engine="vllm", gpu_class="h100-80g")]),
        )
    )  # fmt: skip


def _inventory(node: str, *, cpu: float | None, warnings: tuple[str, ...] = ()) -> model.Inventory:
    return model.Inventory(
        model.Host(node, cpu_count=8),
        usage=model.Usage(
            memory_total_bytes=16 * GIB,
            memory_available_bytes=4 * GIB,
            cpu_util_pct=cpu,
            load1=1.5,
            filesystems=(model.Filesystem("/", "ext4", ("/w",), 100 * GIB, 25 * GIB, False),),
        ),
        gpus=(),
        engines=model.Engines(
            found=(model.Engine("llama-server", "/bin/llama-server", "b1", "installed"),)
        ),
        warnings=warnings,
    )


class Fleet:
    def __init__(self, tmp_path: Path, keys: StoreKeys, history: History | None = None) -> None:
        self.registry = NodeRegistry(core.LivenessPolicy(), history=history)
        self.catalog = CatalogFile(tmp_path / "server.yaml", _catalog())
        self.reconciler = Reconciler(self.registry, lambda: self.catalog.catalog)
        self.keys = keys
        self.admin = AdminApp(self.registry, KEY, reconciler=self.reconciler,
                              catalog=self.catalog, keys=self.keys)  # fmt: skip
        self.mirror = tmp_path / "mirror"
        (self.mirror / "tiny").mkdir(parents=True)
        (self.mirror / "tiny" / "model.gguf").write_bytes(b"x" * 3000)
        (self.mirror / "big").mkdir()
        (self.mirror / "big" / "w.safetensors").write_bytes(b"y" * 10)
        self.admin.pages = make_pages(api_client(self.admin, KEY), KEY, mirror_dir=self.mirror)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.admin),
                                 base_url="http://admin.test")  # fmt: skip


async def _login(client: httpx.AsyncClient) -> str:
    r = await client.post("/admin/login", data={"key": KEY})
    assert r.status_code == 303, r.text
    return _csrf((await client.get("/admin/")).text)


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, html
    return found.group(1)


def _cell(html: str, row: str, field: str) -> str:
    """The text of `<td data-field=field>` in the `<tr row>` (`data-node="n1"`)."""
    tr = re.search(rf"<tr {re.escape(row)}>(.*?)</tr>", html, re.S)
    assert tr is not None, f"no row {row} in {html}"
    td = re.search(rf'<td data-field="{field}"[^>]*>(.*?)</td>', tr.group(1), re.S)
    assert td is not None, f"no field {field} in row {row}: {tr.group(1)}"
    return td.group(1)


@pytest.fixture
async def keys(tmp_path: Path) -> AsyncIterator[StoreKeys]:
    """Router-only mode's keys: the store on one SQLite file."""
    async with open_keys_db(tmp_path / "keys.db") as keys:
        yield keys


@pytest.fixture
async def fleet(tmp_path: Path, keys: StoreKeys) -> Fleet:
    return Fleet(tmp_path, keys)


# --- login, cookie, CSRF --------------------------------------------------------------


async def test_login_sets_an_httponly_strict_session_cookie_that_is_not_the_key(
    fleet: Fleet,
) -> None:
    async with fleet.client() as client:
        form = await client.get("/admin/login")
        assert form.status_code == 200 and 'name="key"' in form.text
        r = await client.post("/admin/login", data={"key": KEY})
        assert r.status_code == 303
        assert r.headers["location"] == "/admin/"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=")
        value = cookie.split(";")[0].split("=", 1)[1]
        assert value and KEY not in value
        attrs = {a.strip().split("=")[0].lower(): a.strip() for a in cookie.split(";")[1:]}
        assert "httponly" in attrs
        assert attrs["samesite"].lower() == "samesite=strict"
        assert attrs["path"] == "Path=/admin"
        page = await client.get("/admin/")
        assert page.status_code == 200 and 'table id="nodes"' in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]


async def test_a_wrong_key_shows_the_form_again_with_an_error_and_no_cookie(
    fleet: Fleet,
) -> None:
    async with fleet.client() as client:
        r = await client.post("/admin/login", data={"key": "guess"})
        assert r.status_code == 403
        assert "set-cookie" not in r.headers
        assert 'id="error"' in r.text and 'name="key"' in r.text


@pytest.mark.parametrize(
    "path", ["/admin/", "/admin/nodes/n1", "/admin/replicas", "/admin/logs?node=n1",
             "/admin/mirror", "/admin/keys", "/admin/place?model=tiny", "/admin"],
)  # fmt: skip
async def test_every_page_without_a_session_redirects_to_the_login(fleet: Fleet, path: str) -> None:
    async with fleet.client() as client:
        r = await client.get(path)
        assert r.status_code == 303
        assert r.headers["location"] == "/admin/login"
        client.cookies.set(COOKIE, "forged", path="/admin")
        r = await client.get(path)
        assert (r.status_code, r.headers["location"]) == (303, "/admin/login")


@pytest.mark.parametrize(
    "path", ["/admin/data/cluster", "/admin/data/nodes/n1", "/admin/data/replicas",
             "/admin/data/logs?node=n1&source=agent", "/admin/data/mirror", "/admin/data/place"],
)  # fmt: skip
async def test_data_without_a_session_is_401(fleet: Fleet, path: str) -> None:
    async with fleet.client() as client:
        r = await client.get(path)
        assert r.status_code == 401
        assert "/admin/login" in r.text


async def test_a_post_without_or_with_a_wrong_csrf_token_is_refused(fleet: Fleet) -> None:
    async with fleet.client() as client:
        csrf = await _login(client)
        r = await client.post("/admin/keys", data={"tenant": "acme"})
        assert r.status_code == 400 and "csrf" in r.text
        r = await client.post("/admin/keys", data={"tenant": "acme", "csrf": csrf + "x"})
        assert r.status_code == 403
        r = await client.post("/admin/logout", data={"csrf": "nope"})
        assert r.status_code == 403
        assert await fleet.keys.list() == []  # neither made a key
        # Another session's token is not this one's.
        async with fleet.client() as other:
            other_csrf = await _login(other)
        r = await client.post("/admin/keys", data={"tenant": "acme", "csrf": other_csrf})
        assert r.status_code == 403


async def test_logout_ends_the_session(fleet: Fleet) -> None:
    async with fleet.client() as client:
        csrf = await _login(client)
        cookie = client.cookies[COOKIE]
        r = await client.post("/admin/logout", data={"csrf": csrf})
        assert (r.status_code, r.headers["location"]) == (303, "/admin/login")
        client.cookies.set(COOKIE, cookie, path="/admin")  # the old id, replayed
        r = await client.get("/admin/")
        assert (r.status_code, r.headers["location"]) == (303, "/admin/login")


async def test_the_api_still_wants_its_bearer_key_and_the_cookie_is_not_one(fleet: Fleet) -> None:
    async with fleet.client() as client:
        await _login(client)
        r = await client.get("/api/v1/nodes")
        assert r.status_code == 401


async def test_sessions_expire_and_are_bounded() -> None:
    now = [0.0]
    store = Sessions(clock=lambda: now[0])
    sid, session = store.create()
    assert await store.get(sid) is session
    assert await store.get("other") is None and await store.get(None) is None
    now[0] = SESSION_TTL_S - 1
    assert await store.get(sid) is session
    now[0] = SESSION_TTL_S
    assert await store.get(sid) is None and len(store) == 0
    first, _ = store.create()
    for _ in range(MAX_SESSIONS):
        store.create()
    assert len(store) == MAX_SESSIONS and await store.get(first) is None  # the oldest went


# --- pages ----------------------------------------------------------------------------


async def test_the_cluster_page_shows_nodes_models_and_events(fleet: Fleet) -> None:
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=37.0))
    await register(fleet.registry, "n2", inventory=_inventory("n2", cpu=None,
                                                              warnings=("fan failing",)))  # fmt: skip
    fleet.registry.cordon("n2", "maintenance")
    h100 = [model.Gpu(i, f"GPU-{i}", "NVIDIA H100", "h100-80g") for i in range(2)]
    await register(
        fleet.registry, "n3", inventory=model.Inventory(model.Host("n3"), gpus=tuple(h100))
    )
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/")).text
        fragment = (await client.get("/admin/data/cluster")).text
    for page in (html, fragment):
        assert _cell(page, 'data-node="n1"', "state") == "ready"
        cpu = _cell(page, 'data-node="n1"', "cpu")
        assert 'data-bar data-value="37.0"' in cpu and "37 % of 8 CPUs" in cpu
        ram = _cell(page, 'data-node="n1"', "ram")
        assert 'data-value="75.0"' in ram and "12.0 GiB of 16.0 GiB" in ram
        # n2 reported no CPU figure: no value on its bar, a dash, never 0.
        cpu2 = _cell(page, 'data-node="n2"', "cpu")
        assert "data-value" not in cpu2 and f"{DASH} of 8 CPUs" in cpu2
        assert "cordoned" in _cell(page, 'data-node="n2"', "state")
        assert "fan failing" in _cell(page, 'data-node="n2"', "warnings")
        assert "25.0 GiB free of 100.0 GiB" in _cell(page, 'data-node="n1"', "disk")
        assert "llama-server b1 (installed)" in _cell(page, 'data-node="n1"', "engines")
        assert _cell(page, 'data-node="n1"', "gpus") == "none"
        assert _cell(page, 'data-node="n3"', "gpus") == "2\u00d7 h100-80g"
        assert _cell(page, 'data-node="n3"', "cpu").count(DASH) == 2  # no figure, no count
        assert _cell(page, 'data-model="big"', "desired") == "2"
        assert _cell(page, 'data-model="big"', "ready") == "0"
        assert _cell(page, 'data-model="tiny"', "stale") == "0"
        assert '<ul id="events">' in page
    assert 'data-refresh="/admin/data/cluster"' in html
    assert "<html" not in fragment


async def test_a_hostile_node_name_and_reason_are_escaped(fleet: Fleet) -> None:
    await register(fleet.registry, HOSTILE, inventory=_inventory(HOSTILE, cpu=1.0,
                                                                 warnings=(HOSTILE,)))  # fmt: skip
    fleet.registry.drain(HOSTILE, HOSTILE)
    async with fleet.client() as client:
        await _login(client)
        pages = [(await client.get("/admin/")).text,
                 (await client.get("/admin/data/cluster")).text,
                 (await client.get("/admin/logs", params={"node": HOSTILE})).text]  # fmt: skip
    for html in pages:
        assert "<script>alert" not in html
        assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html


async def test_the_node_page_shows_figures_and_one_chart_per_series(fleet: Fleet) -> None:
    inv = _inventory("n1", cpu=50.0)
    shard = model.ShardReport("s1", "tiny", "llama-server", "ready", model_name="tiny")
    inv = model.Inventory(
        inv.host, gpus=(), engines=inv.engines,
        usage=model.Usage(memory_total_bytes=16 * GIB, memory_available_bytes=8 * GIB,
                          cpu_util_pct=50.0, load1=0.5, load5=None, load15=2.0,
                          shards=(model.ShardUsage("s1", cpu_cores=1.25, rss_bytes=GIB),)),
    )  # fmt: skip
    await register(fleet.registry, "n1", inventory=inv, shards=(shard,))
    async with fleet.client() as client:
        await _login(client)
        r = await client.get("/admin/nodes/n1")
        missing = await client.get("/admin/nodes/nope")
    assert r.status_code == 200
    html = r.text
    assert re.search(r'data-field="cpu">50 %<', html)
    assert re.search(r'data-field="ram">8.0 GiB of 16.0 GiB<', html)
    assert re.search(rf'data-field="load">0.50 / {DASH} / 2.00<', html)  # absent load5: a dash
    assert re.search(r'data-field="cores">1.25<', html)
    assert re.search(r'data-field="memory">1.0 GiB<', html)
    for name in ("cpu", "memory", "load", "disk", "gpu-util", "gpu-memory"):
        assert f'data-chart="{name}"' in html
    assert missing.status_code == 404 and "no node &#39;nope&#39;" in missing.text


async def test_the_node_page_says_which_card_is_out_and_why(fleet: Fleet) -> None:
    inv = _inventory("n1", cpu=None)
    fault = core.xid_fault(79, 1.0, line="NVRM: Xid (PCI:0000:a1:00): 79, ...")
    inv = model.Inventory(
        inv.host, engines=inv.engines,
        gpus=tuple(model.Gpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", "h100-80g") for i in range(3)),
        usage=model.Usage(gpus=(model.GpuUsage(0, health="ok", faults=()),
                                model.GpuUsage(1, health="unhealthy", faults=(fault,)),
                                model.GpuUsage(2))),
    )  # fmt: skip
    await register(fleet.registry, "n1", inventory=inv)
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/nodes/n1")).text
    health = re.findall(r'data-field="gpu-health">([^<]*)<', html)
    # Card 2's agent says nothing of its health: unknown, never "ok".
    assert health == ["ok", "unhealthy: Xid 79 (GPU has fallen off the bus)", DASH]


async def test_the_node_page_draws_its_charts_from_the_history_with_gaps(
    tmp_path: Path, keys: StoreKeys
) -> None:
    now = [1000.0]
    history = History(clock=lambda: now[0], wall=lambda: now[0])
    fleet = Fleet(tmp_path, keys, history=history)
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=10.0))
    gpu = model.GpuUsage(0, memory_used_mib=1024, utilization_pct=90.0)
    for cpu, gpus in ((20.0, (gpu,)), (None, (gpu,)), (None, ()), (40.0, (gpu,))):
        now[0] += history.resolution_s
        history.record("n1", model.Usage(cpu_util_pct=cpu, memory_total_bytes=8 * GIB,
                                         memory_available_bytes=2 * GIB, gpus=gpus))  # fmt: skip
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/nodes/n1")).text
        fragment = (await client.get("/admin/data/nodes/n1")).text
    for page in (html, fragment):
        charts = dict(re.findall(r'<svg data-chart="([a-z-]+)" data-points="(\d+)"', page))
        # cpu: 10 (registration), 20, gap, gap, 40; gpu: 90, 90, gap, 90.
        assert charts == {"cpu": "3", "memory": "5", "load": "1", "disk": "1",
                          "gpu-util": "3", "gpu-memory": "3"}  # fmt: skip
        cpu = re.search(r'<svg data-chart="cpu".*?</svg>', page, re.S)
        assert cpu is not None
        (d,) = re.findall(r'<path class="line" d="([^"]+)"', cpu.group(0))
        assert d.count("M") == 2 and d.count("L") == 1  # 10-20, then 40 alone: a gap, no 0
        gpu_util = re.search(r'<svg data-chart="gpu-util".*?</svg>', page, re.S)
        assert gpu_util is not None
        (d,) = re.findall(r'<path class="line" d="([^"]+)"', gpu_util.group(0))
        assert d.count("M") == 2 and d.count("L") == 1
    assert 'data-refresh="/admin/data/nodes/n1"' in html


async def test_after_a_failover_the_node_page_says_since_when_it_holds_history(
    tmp_path: Path, keys: StoreKeys
) -> None:
    """The history is in memory: a control plane that took over holds a node's figures
    only from then on. The page says so, rather than an empty hour that reads as idle;
    once it holds the whole hour the note goes."""
    t0 = 1_796_000_000.0  # 2026-11-29 ... UTC; a multiple of 60 s, so HH:MM is exact
    now = [t0]
    history = History(clock=lambda: now[0], wall=lambda: now[0])
    fleet = Fleet(tmp_path, keys, history=history)
    now[0] += 2 * 3600  # a standby for two hours, then elected
    history.took_over()
    took_over = now[0]
    now[0] += 5  # the agents re-register with it a few seconds later
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=10.0))
    for _ in range(6):
        now[0] += history.resolution_s
        history.record("n1", model.Usage(cpu_util_pct=30.0))
    shown = time.strftime("%H:%M", time.gmtime(took_over + 5))
    note = (f"history since {shown} UTC (this control plane took over as leader then); "
            "before it, nothing was kept here")  # fmt: skip
    async with fleet.client() as client:
        await _login(client)
        r = await client.get("/api/v1/nodes/n1/history", headers={"Authorization": f"Bearer {KEY}"})
        view = r.json()
        assert view["since"] == took_over + 5
        assert view["kept_since"] == {"at": took_over, "why": "took over as leader"}
        for path in ("/admin/nodes/n1", "/admin/data/nodes/n1"):
            page = (await client.get(path)).text
            found = re.search(r'<p class="note" data-field="history-since">([^<]*)</p>', page)
            assert found is not None and found.group(1) == note, page
        # A node that first reports long after the takeover: its own start is the reason.
        now[0] += 600
        await register(fleet.registry, "n2", inventory=_inventory("n2", cpu=10.0))
        page = (await client.get("/admin/nodes/n2")).text
        assert "(the node first reported to this control plane then)" in page
        # An hour later the whole window is this control plane's: no note.
        now[0] += 3600
        history.record("n1", model.Usage(cpu_util_pct=30.0))
        page = (await client.get("/admin/nodes/n1")).text
        assert 'data-field="history-since"' not in page


def test_an_election_at_start_is_not_a_takeover() -> None:
    now = [1000.0]
    history = History(clock=lambda: now[0], wall=lambda: now[0])
    now[0] += 2  # alone on its store, it leads at once
    history.took_over()
    assert history.kept_since == (1000.0, "started")


async def test_the_replicas_page_shows_unplaced_models_with_their_reasons(fleet: Fleet) -> None:
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=1.0))
    await fleet.reconciler.tick()
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/replicas")).text
    row = re.search(r'<tr data-unplaced="big">(.*?)</tr>', html, re.S)
    assert row is not None, html
    assert "unplaced" in row.group(1)


async def test_the_replicas_page_shows_a_model_in_its_restart_backoff(fleet: Fleet) -> None:
    m = fleet.catalog.catalog.models[0]
    shard = model.ShardReport("s1", "tiny", "llama-server", "failed", replica_id="r1",
                              model_name="tiny", profile_fingerprint=fingerprint(m, m.profiles[0]),
                              reason="engine exited with code 1")  # fmt: skip
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=1.0), shards=(shard,))
    await fleet.reconciler.tick()
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/data/replicas")).text
    state = _cell(html, 'data-backoff="tiny"', "state")
    assert state == (
        "backoff: trying again after 1 failure: rank 0 on n1 failed: engine exited with code 1"
    )


async def test_a_starting_replica_shows_its_download_as_a_progress_bar(fleet: Fleet) -> None:
    m = fleet.catalog.catalog.models[0]
    shard = model.ShardReport("s1", "tiny", "llama-server", "starting", replica_id="r1",
                              model_name="tiny", profile_fingerprint=fingerprint(m, m.profiles[0]),
                              source=m.source)  # fmt: skip
    _agent, _peer, session = await register(fleet.registry, "n1",
                                            inventory=_inventory("n1", cpu=1.0), shards=(shard,))  # fmt: skip
    await session.progress(model.Progress(m.source, 40 * 1024, 100 * 1024))
    await fleet.reconciler.tick()
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/data/replicas")).text
    assert _cell(html, 'data-replica="r1"', "state").strip() == "starting"
    assert _cell(html, 'data-replica="r1"', "node") == "n1"
    progress = _cell(html, 'data-replica="r1"', "progress")
    assert '<progress data-progress value="40960" max="102400">' in progress
    assert "40.0 KiB of 100.0 KiB" in progress


async def test_keys_are_created_once_shown_and_revoked(fleet: Fleet) -> None:
    async with fleet.client() as client:
        csrf = await _login(client)
        r = await client.post("/admin/keys", data={"tenant": "acme", "csrf": csrf})
        assert r.status_code == 200
        secret = re.search(r'<code id="secret">([^<]+)</code>', r.text)
        assert secret is not None
        (key,) = await fleet.keys.list()
        assert key.tenant == "acme" and not key.revoked
        assert f'<tr data-key="{key.key_id}">' in r.text
        listing = (await client.get("/admin/keys")).text
        assert secret.group(1) not in listing  # shown once
        assert f'data-revoke="{key.key_id}"' in listing
        r = await client.post(f"/admin/keys/{key.key_id}/revoke", data={"csrf": csrf})
        assert (r.status_code, r.headers["location"]) == (303, "/admin/keys")
        (key,) = await fleet.keys.list()
        assert key.revoked
        listing = (await client.get("/admin/keys")).text
        assert _cell(listing, f'data-key="{key.key_id}"', "state") == "revoked"


async def test_the_placement_page_explains_a_placement_and_a_refusal(fleet: Fleet) -> None:
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=1.0))
    async with fleet.client() as client:
        await _login(client)
        chooser = (await client.get("/admin/place")).text
        placed = (await client.get("/admin/place", params={"model": "tiny"})).text
        refused = (await client.get("/admin/data/place", params={"model": "big"})).text
        unknown = (await client.get("/admin/data/place", params={"model": "nope"})).text
    assert '<option value="tiny">' in chooser and '<option value="big">' in chooser
    assert 'id="placement"' in placed and 'data-placed="yes"' in placed
    assert '<tr data-rank="0"><td>0</td><td>n1</td>' in placed
    assert 'data-placed="no"' in refused and "n1" in refused
    assert "no model &#39;nope&#39; in the catalog" in unknown


async def test_the_mirror_page_lists_paths_sizes_models_and_unservable_ones(fleet: Fleet) -> None:
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=1.0))
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/mirror")).text
    assert _cell(html, 'data-path="/tiny/"', "size") == "2.9 KiB"
    assert _cell(html, 'data-path="/tiny/"', "models") == "tiny"
    assert _cell(html, 'data-path="/big/"', "models") == "big"
    tiny = re.search(r'<tr data-path="/tiny/">(.*?)</tr>', html, re.S)
    big = re.search(r'<tr data-path="/big/">(.*?)</tr>', html, re.S)
    assert tiny is not None and big is not None
    assert 'class="warning"' not in tiny.group(1)  # n1 runs llama-server
    assert "no node reports an engine that could serve big (it needs vllm)" in big.group(1)


class LoggingAgent(FakeAgent):
    """An agent's capability with a log that grows as the test writes to it."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.lines: list[model.LogLine] = []

    async def log_sources(self) -> list[str]:
        return ["agent", "s1/engine"]

    async def logs(self, source: str, lines: int) -> list[model.LogLine]:
        return [x for x in self.lines if x.source == source][-lines:]


async def test_the_logs_page_offers_the_sources_and_its_data_grows(fleet: Fleet) -> None:
    agent = LoggingAgent("n1")
    agent.lines.append(model.LogLine("agent", "registered with the control plane"))
    agent.lines.append(model.LogLine("agent", HOSTILE))
    await register(fleet.registry, "n1", inventory=_inventory("n1", cpu=1.0), agent=agent)
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/logs", params={"node": "n1"})).text
        first = await client.get("/admin/data/logs", params={"node": "n1", "source": "agent"})
        agent.lines.append(model.LogLine("agent", "line three"))
        agent.lines.append(model.LogLine("s1/engine", "an engine line"))
        second = await client.get("/admin/data/logs", params={"node": "n1", "source": "agent"})
        other = await client.get("/admin/data/logs", params={"node": "n1", "source": "s1/engine"})
        gone = await client.get("/admin/data/logs", params={"node": "n9", "source": "agent"})
    assert '<option value="n1" selected>' in html
    assert '<option value="agent" selected>' in html and '<option value="s1/engine">' in html
    assert 'input type="checkbox" id="follow" checked' in html
    assert 'pre id="log" data-follow="/admin/data/logs?node=n1&amp;source=agent"' in html
    assert "registered with the control plane" in html
    assert "<script>alert" not in html and "&lt;script&gt;" in html
    assert first.json() == {"lines": ["registered with the control plane", HOSTILE], "error": None}
    assert second.json()["lines"][-1] == "line three"
    assert other.json()["lines"] == ["an engine line"]
    assert gone.json()["lines"] == [] and "n9" in gone.json()["error"]


# --- the charts' pure part ------------------------------------------------------------


def test_an_absent_sample_is_a_gap_never_a_line_to_zero() -> None:
    c = chart("cpu", [[10.0, 20.0, None, None, 40.0, 50.0]], top=100.0, width=50, height=100)
    assert c.points == 4
    (d,) = c.lines
    assert d == "M0.0,90.0 L10.0,80.0 M40.0,60.0 L50.0,50.0"
    # 40 alone between gaps: a move only, which draws nothing, so a dot as well.
    lone = chart("cpu", [[10.0, None, 40.0, None]], top=100.0, width=30, height=100)
    assert lone.lines == ("M0.0,90.0 M20.0,60.0",)
    assert lone.dots == ((0.0, 90.0), (20.0, 60.0))
    assert chart("cpu", [[None, None]]).points == 0
    assert chart("cpu", [[None, None]]).lines == ()


@given(st.lists(st.lists(st.one_of(st.none(), st.floats(0, 1e6)), max_size=40), max_size=4))
def test_every_present_sample_is_drawn_once_and_every_run_starts_with_a_move(
    series: list[list[float | None]],
) -> None:
    c = chart("x", series)
    present = sum(v is not None for s in series for v in s)
    assert c.points == present
    drawn = sum(len(re.findall(r"[ML]", d)) for d in c.lines)
    assert drawn == present
    runs = sum(
        1 for s in series for i, v in enumerate(s) if v is not None and (i == 0 or s[i - 1] is None)
    )
    assert sum(d.count("M") for d in c.lines) == runs


# --- mounted in the real control plane ------------------------------------------------


def test_the_control_plane_serves_the_pages_on_its_admin_listener(cluster: LocalCluster) -> None:
    cluster.setup(["n1"])
    cluster.start_cp()
    cluster.start_agent("n1")
    cluster.wait_states({"n1": "ready"}, timeout=30)
    with httpx.Client(base_url=cluster.admin_url, timeout=10) as client:
        assert client.get("/admin/").status_code == 303
        r = client.post("/admin/login", data={"key": cluster.admin_key})
        assert r.status_code == 303 and COOKIE in client.cookies
        page = client.get("/admin/")
        assert page.status_code == 200
        assert _cell(page.text, 'data-node="n1"', "state") == "ready"
        assert client.get("/admin/static/pages.js").status_code == 200
        logs = client.get("/admin/data/logs", params={"node": "n1", "source": "agent"}).json()
        assert logs["error"] is None and logs["lines"], logs
        # The JSON API beside it is unchanged: its Bearer key, not the cookie.
        assert client.get("/api/v1/nodes").status_code == 401
        assert client.get("/healthz").status_code == 200


async def test_the_cluster_page_shows_each_traffic_split_as_ctl_status_does(fleet: Fleet) -> None:
    split = core.TrafficSplit(
        "chat",
        (core.TrafficVersion("tiny", "tiny", 90), core.TrafficVersion("big", "big", 10)),
        (("key-qa", "big"),),
    )
    fleet.catalog.catalog = attrs.evolve(fleet.catalog.catalog, traffic=(split,))
    async with fleet.client() as client:
        await _login(client)
        html = (await client.get("/admin/")).text
    # No replica of either is ready: neither can be drawn, so the weights decide as if
    # all were (the router then answers 503 naming the version drawn).
    assert _cell(html, 'data-version="chat/tiny"', "weight") == "90"
    assert _cell(html, 'data-version="chat/tiny"', "share") == "90 %"
    assert _cell(html, 'data-version="chat/big"', "share") == "10 %"
    assert _cell(html, 'data-version="chat/big"', "ready") == "0"
    assert _cell(html, 'data-version="chat/big"', "keys") == "key-qa"
    assert _cell(html, 'data-version="chat/tiny"', "keys") == "-"
