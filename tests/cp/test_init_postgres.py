"""`llmgw-cp init --postgres` against a real PostgreSQL started here, real llmgw-cp
processes, and fake package managers, systemctl and runuser that record what they were
asked (runuser runs the real psql against the test's server as its superuser)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from helpers import FIXTURES, postgres_admin, require
from hypothesis import given
from hypothesis import strategies as st

from llmgw.cp._init_pg import (
    DB_SELECT,
    InitError,
    configure_steps,
    dsn_password,
    edit_store_line,
    make_dsn,
    psql_script,
)
from llmgw.errors import UsageError
from llmgw.keys import UsageRow, digest
from llmgw.store import SQLITE_FILE, Account, open_store
from llmgw.testing.cluster import LocalCluster, wait_for

# --- pure parts ---------------------------------------------------------------------------

CONFIG = """\
# the control plane of a test
state_dir: /var/lib/llmgw   # where it keeps things
rpc_listen: 0.0.0.0:7070

# what it keeps: null is SQLite in state_dir
{store_line}
tls:  # the PKI
  ca: /etc/llmgw/pki/ca.crt
  cert: /etc/llmgw/pki/server.crt
  key: /etc/llmgw/pki/server.key
"""


@pytest.mark.parametrize(
    "store_line",
    ["store: null", "store:", "store: ~  # SQLite", "store:   null   # SQLite", "store: null\r"],
)
def test_the_store_line_is_the_only_line_changed(store_line: str) -> None:
    text = CONFIG.format(store_line=store_line)
    new = edit_store_line(text, "/var/lib/llmgw/secrets/store-dsn")
    old_lines, new_lines = text.splitlines(), new.splitlines()
    changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
    assert len(changed) == 1
    assert changed[0][1].startswith("store: /var/lib/llmgw/secrets/store-dsn")
    if "#" in store_line:
        assert changed[0][1].endswith("# SQLite")  # the line's own comment stays


def test_a_missing_store_line_is_appended_and_a_flow_file_goes_round_trip() -> None:
    text = CONFIG.format(store_line="# (no store line)")
    new = edit_store_line(text, "/s/store-dsn")
    assert new == text + "store: /s/store-dsn\n"
    flow = '{"state_dir": "/x", "tls": {"ca": "a"}}\n'
    from ruamel.yaml import YAML

    assert YAML(typ="safe").load(edit_store_line(flow, "/s/store-dsn")) == {
        "state_dir": "/x",
        "tls": {"ca": "a"},
        "store": "/s/store-dsn",
    }
    with pytest.raises(InitError, match="not valid YAML"):
        edit_store_line("a: [", "/s")


@given(
    st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=16),
    st.sampled_from(["127.0.0.1", "::1", "db.example"]),
    st.integers(1, 65535),
)
def test_a_dsn_gives_back_its_password(password: str, host: str, port: int) -> None:
    dsn = make_dsn(password, host, port)
    assert dsn_password(dsn) == password
    assert urlsplit(dsn).port == port
    assert dsn_password(dsn.replace("llmgw:", "other:", 1)) is None


def test_the_sql_never_takes_a_password_it_cannot_quote() -> None:
    with pytest.raises(InitError, match="password"):
        psql_script("it's'; DROP ROLE x; --")
    script = psql_script("a" * 24)
    assert script.index("password_encryption = 'scram-sha-256'") < script.index("ROLE llmgw")
    assert DB_SELECT in script
    assert script.rstrip().endswith("SHOW port;")
    # RHEL's initdb gets password auth for TCP; the others start what the package made.
    rhel = configure_steps("rhel")
    assert [s.argv for s in rhel] == [
        ("postgresql-setup", "--initdb"),
        ("systemctl", "enable", "--now", "postgresql"),
    ]
    assert "--auth-host=scram-sha-256" in rhel[0].env["PGSETUP_INITDB_OPTIONS"]
    assert [s.argv for s in configure_steps("debian")] == [
        ("systemctl", "enable", "--now", "postgresql")
    ]


# --- a real PostgreSQL --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg_admin_server() -> Iterator[str]:
    with postgres_admin() as (admin, _):
        yield admin


@pytest.fixture
def pg_admin(pg_admin_server: str) -> Iterator[str]:
    """The superuser DSN; the llmgw role and database are gone again after each test."""
    yield pg_admin_server
    import psycopg

    with psycopg.connect(pg_admin_server, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS llmgw WITH (FORCE)")
        conn.execute("DROP ROLE IF EXISTS llmgw")


FAKE = """\
#!{python}
# A fake {name}: records its argv (and a few variables), then acts as the test set it.
import json, os, signal, socket, sys, time
root = {root!r}
with open(os.path.join(root, "calls.jsonl"), "a") as f:
    env = {{k: os.environ[k] for k in ("DEBIAN_FRONTEND", "PGSETUP_INITDB_OPTIONS")
           if k in os.environ}}
    f.write(json.dumps({{"tool": {name!r}, "argv": sys.argv[1:], "env": env}}) + "\\n")
mode = json.load(open(os.path.join(root, "mode.json")))
name = {name!r}
if name == "runuser":  # runuser -u postgres -- psql ...: psql as the test's superuser
    os.environ.update(mode["pg_env"])
    argv = sys.argv[sys.argv.index("--") + 1:]
    os.execv(argv[0], argv)
if name == "systemctl" and sys.argv[1] == "is-active":
    sys.exit(0 if mode.get("active") else 3)
if name == "systemctl" and sys.argv[1] == "stop":
    os.kill(mode["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", mode["admin_port"]), 1).close()
        except OSError:
            break
        time.sleep(0.1)
print("done")
"""


class Fakes:
    def __init__(self, root: Path, pg_admin: str | None) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        self.mode: dict[str, Any] = {}
        if pg_admin is not None:
            u = urlsplit(pg_admin)
            self.mode["pg_env"] = {
                "PGHOST": u.hostname,
                "PGPORT": str(u.port),
                "PGUSER": u.username,
                "PGPASSWORD": u.password,
            }
        self.save()
        for name in ("apt-get", "dnf", "systemctl", "runuser", "postgresql-setup"):
            path = self.bin / name
            path.write_text(FAKE.format(python=sys.executable, name=name, root=str(root)))
            path.chmod(0o755)

    def save(self) -> None:
        (self.root / "mode.json").write_text(json.dumps(self.mode))

    def calls(self) -> list[tuple[str, list[str], dict[str, str]]]:
        path = self.root / "calls.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(ln) for ln in path.read_text().splitlines()]
        return [(r["tool"], r["argv"], r["env"]) for r in rows]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', os.defpath)}"}


def init(fakes: Fakes, config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cp", "init", "--postgres", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        env=fakes.env(),
        timeout=120,
    )


def write_config(cluster: LocalCluster) -> Path:
    """server.yaml as an operator writes it, comments and all, for this cluster's ports."""
    pki = cluster.pki
    path = cluster.root / "server.yaml"
    path.write_text(
        "# llmgw control plane for a test; comments must survive init --postgres\n"
        f"state_dir: {cluster.root / 'cp'}  # its state\n"
        f"rpc_listen: 127.0.0.1:{cluster.rpc_port}\n"
        f"admin_listen: 127.0.0.1:{cluster.admin_port}\n"
        f"router_listen: 127.0.0.1:{cluster.router_port}\n"
        "reconcile_settle_s: 1.0\n"
        "\n"
        "# null: SQLite in state_dir\n"
        "store: null  # the line init --postgres edits\n"
        "tls:\n"
        f"  ca: {pki / 'ca.crt'}\n"
        f"  cert: {pki / 'server.crt'}\n"
        f"  key: {pki / 'server.key'}  # the server's key\n"
        "models: []\n"
    )
    return path


def routes(cluster: LocalCluster, secret: str) -> int:
    got = httpx.get(
        cluster.router_url + "/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10
    )
    return got.status_code


def lift_cordon(cluster: LocalCluster, node: str) -> tuple[int, Any]:
    got = httpx.delete(
        f"{cluster.admin_url}/api/v1/nodes/{node}/cordon",
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        timeout=10,
    )
    return got.status_code, got.json()


def sqlite_rows(state: Path) -> list[tuple[Any, ...]]:
    import sqlite3

    with sqlite3.connect(state / SQLITE_FILE) as db:
        return db.execute("SELECT key_id, tenant, revoked FROM api_keys ORDER BY key_id").fetchall()


def sqlite_epoch(state: Path) -> int:
    import sqlite3

    with sqlite3.connect(state / SQLITE_FILE) as db:
        return int(db.execute("SELECT epoch FROM lease").fetchone()[0])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "c")
    c.setup(["gpu-7"])
    yield c
    c.stop_all()


async def test_a_sqlite_control_plane_moves_with_its_keys_and_cordons(
    cluster: LocalCluster, pg_admin: str, tmp_path: Path
) -> None:
    config = write_config(cluster)
    original = config.read_bytes()
    state = cluster.root / "cp"
    cluster.start_cp()
    secret = cluster.api_key("acme")
    old = json.loads(cluster.ctl("keys", "create", "--tenant", "old", "--json").stdout)
    revoked_id = old["key"]["key_id"]
    cluster.ctl("keys", "revoke", revoked_id)
    cluster.start_agent("gpu-7")
    wait_for("gpu-7 registered", lambda: "gpu-7" in cluster.nodes(), 30)
    cluster.ctl("cordon", "gpu-7", "--reason", "a bad fan")
    assert cluster.nodes()["gpu-7"]["cordoned"] == "a bad fan"
    old_epoch = sqlite_epoch(state)
    assert routes(cluster, secret) == 200
    fakes = Fakes(tmp_path / "fakes", pg_admin)

    # Running, and not under systemd: the operator must stop it; nothing is touched.
    refused = init(fakes, config, "--admin-dsn", pg_admin, "--yes")
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.count("\n") == 1
    assert f"its admin listener 127.0.0.1:{cluster.admin_port} answers" in refused.stderr
    assert config.read_bytes() == original
    assert not (state / "secrets" / "store-dsn").exists()
    assert routes(cluster, secret) == 200

    # Under systemd (a fake systemctl that stops this very process): stopped, moved, started.
    assert cluster.cp is not None
    fakes.mode.update(active=True, pid=cluster.cp.pid, admin_port=cluster.admin_port)
    fakes.save()
    (fakes.root / "calls.jsonl").unlink()  # the refused run asked systemctl too
    t0 = time.monotonic()
    done = init(fakes, config, "--admin-dsn", pg_admin, "--yes")
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    cluster.cp.popen.wait(10)  # stopped by the fake systemctl
    cluster.cp.terminate()  # (closes its log)
    systemctl = [argv for tool, argv, _ in fakes.calls() if tool == "systemctl"]
    assert systemctl == [
        ["is-active", "--quiet", "llmgw-cp"],
        ["stop", "llmgw-cp"],
        ["start", "llmgw-cp"],
    ]
    print(done.stdout)
    assert f"{len(sqlite_rows(state))} API keys, 1 node overrides" in done.stdout, done.stdout

    # server.yaml: only the store line changed, comments kept, the old file beside it.
    dsn_file = state / "secrets" / "store-dsn"
    new_lines, old_lines = config.read_text().splitlines(), original.decode().splitlines()
    diff = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
    assert diff == [
        ("store: null  # the line init --postgres edits",
         f"store: {dsn_file}  # the line init --postgres edits"),
    ]  # fmt: skip
    backups = list(config.parent.glob("server.yaml.bak-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == original
    assert stat.S_IMODE(dsn_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(dsn_file.parent.stat().st_mode) == 0o700
    dsn = dsn_file.read_text().strip()
    assert dsn.startswith("postgresql://llmgw:") and dsn.endswith("/llmgw")

    # The rows are in PostgreSQL, digests and all; the lease is free, its epoch kept.
    pg = await open_store(dsn)
    try:
        keys = {k.key.key_id: k.key for k in await pg.list_keys()}
        assert keys.keys() == {r[0] for r in sqlite_rows(state)}
        assert keys[revoked_id].revoked
        assert await pg.lookup_key(digest(secret)) is not None
        assert (await pg.current()) is None
        assert [(o.node_id, o.kind, o.reason) for o in await pg.overrides()] == [
            ("gpu-7", "cordon", "a bad fan")
        ]
        assert [n.node_id for n in await pg.known_nodes()] == ["gpu-7"]
        actions = [e.action for e in await pg.recent_audit()]
        assert actions[0] == "store.move"
    finally:
        await pg.aclose()

    # Started again: on PostgreSQL, the key routes, the cordon is there to lift.
    cluster.start_cp()
    assert "store: postgresql://" in cluster.root.joinpath("cp.log").read_text()
    assert routes(cluster, secret) == 200
    assert routes(cluster, "sk-not-a-key-" + "x" * 30) == 401
    # The agent, still running, registers with it (the epoch went on from SQLite's).
    node = wait_for("gpu-7 back", lambda: cluster.nodes().get("gpu-7"), 30)
    assert node["cordoned"] == "a bad fan"
    pg = await open_store(dsn)
    try:
        lease = await pg.current()
        assert lease is not None and lease.epoch == old_epoch + 1  # above what agents saw
    finally:
        await pg.aclose()
    status, body = lift_cordon(cluster, "gpu-7")
    assert (status, body.get("lifted")) == (200, ["cordon"]), body
    print(f"init --postgres moved a running control plane in {took:.1f} s")

    # A second run: the store already names PostgreSQL, which is refused, nothing touched.
    moved = config.read_bytes()
    again = init(fakes, config, "--admin-dsn", pg_admin, "--yes")
    assert again.returncode == 1
    assert "moving one PostgreSQL store into another is refused" in again.stderr
    assert config.read_bytes() == moved


async def test_a_failed_move_leaves_sqlite_in_place_and_working(
    cluster: LocalCluster, pg_admin: str, tmp_path: Path
) -> None:
    config = write_config(cluster)
    original = config.read_bytes()
    state = cluster.root / "cp"
    cluster.start_cp()
    secret = cluster.api_key("acme")
    rows = sqlite_rows(state)
    assert cluster.cp is not None
    fakes = Fakes(tmp_path / "fakes", None)  # llmgw-cp under (a fake) systemd
    fakes.mode.update(active=True, pid=cluster.cp.pid, admin_port=cluster.admin_port)
    fakes.save()

    def systemctl() -> list[list[str]]:
        return [argv for tool, argv, _ in fakes.calls() if tool == "systemctl"]

    # PostgreSQL unreachable: a closed port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    down = f"postgresql://admin:pw@127.0.0.1:{closed}/postgres"
    failed = init(fakes, config, "--admin-dsn", down, "--yes")
    assert failed.returncode == 1
    assert failed.stderr.count("\n") == 1, failed.stderr
    assert f"PostgreSQL at 127.0.0.1:{closed} failed" in failed.stderr
    assert "pw@" not in failed.stderr  # the password is never shown
    # PostgreSQL is made ready before the control plane is stopped: it never was.
    assert systemctl() == [["is-active", "--quiet", "llmgw-cp"]]
    assert routes(cluster, secret) == 200
    (fakes.root / "calls.jsonl").unlink()

    # A PostgreSQL that already holds a store: refused inside the copy's transaction.
    import psycopg

    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute("CREATE ROLE llmgw LOGIN PASSWORD 'not-the-one-init-sets'")
        conn.execute("CREATE DATABASE llmgw OWNER llmgw")
    port = urlsplit(pg_admin).port
    other = await open_store(f"postgresql://llmgw:not-the-one-init-sets@127.0.0.1:{port}/llmgw")
    try:
        await other.create_key(tenant="someone-else")
    finally:
        await other.aclose()
    refused = init(fakes, config, "--admin-dsn", pg_admin, "--yes")
    assert refused.returncode == 1
    assert "already holds 0 accounts and 1 API keys" in refused.stderr, refused.stderr
    assert "moving one store into another is refused" in refused.stderr
    # Stopped for the copy, started again on SQLite when the copy was refused.
    assert systemctl() == [
        ["is-active", "--quiet", "llmgw-cp"],
        ["stop", "llmgw-cp"],
        ["start", "llmgw-cp"],
    ]
    assert "starting llmgw-cp again, on SQLite" in refused.stdout
    cluster.cp.popen.wait(10)  # stopped by the fake systemctl
    cluster.cp.terminate()  # (closes its log)

    assert config.read_bytes() == original
    assert list(config.parent.glob("server.yaml.bak-*")) == []
    assert list(config.parent.glob(".server.yaml.tmp-*")) == []
    assert sqlite_rows(state) == rows
    cluster.start_cp()  # what the real `systemctl start llmgw-cp` would have done
    assert "store: postgresql://" not in cluster.root.joinpath("cp.log").read_text()
    assert routes(cluster, secret) == 200


async def test_a_store_copies_whole_into_an_empty_one(pg_admin: str, tmp_path: Path) -> None:
    import psycopg

    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute("CREATE ROLE llmgw LOGIN PASSWORD 'move-test-password'")
        conn.execute("CREATE DATABASE llmgw OWNER llmgw")
    port = urlsplit(pg_admin).port
    lite = await open_store(tmp_path / "state")
    pg = await open_store(f"postgresql://llmgw:move-test-password@127.0.0.1:{port}/llmgw")
    try:
        await lite.create_account(Account("acme", rpm=60, tpm=None, max_band="batch"))
        key, secret = await lite.create_key(tenant="acme", models=["m"], expires_at=4e9)
        await lite.set_override("n1", "drain", "disk")
        await lite.remember_node("n1", "10.0.0.1:7071")
        await lite.audit("ops", "keys.create", key.key_id)
        await lite.add_usage([UsageRow(7200, "acme", key.key_id, "m", 3, 30, 9)])
        await lite.put_rollout("m", '{"record": null}')
        await lite.add_events([(1.5, '{"kind": "node-state"}'), (2.5, "{}")], keep=100)
        for _ in range(5):
            await lite.try_acquire("cp-a", 10)  # epoch 5
        dump = await lite.export_rows()
        assert dump.epoch == 5 and [r[:2] for r in dump.rollouts] == [("m", '{"record": null}')]
        assert dump.events == ((1.5, '{"kind": "node-state"}'), (2.5, "{}"))
        await pg.import_rows(dump)

        assert await pg.export_rows() == dump  # every row, digests and times as they were
        found = await pg.lookup_key(digest(secret))
        assert found is not None and found.limits is not None and found.limits.rpm == 60
        lease = await pg.try_acquire("cp-b", 10)
        assert lease is not None and lease.epoch == 6
        with pytest.raises(UsageError, match="already holds 1 accounts and 1 API keys"):
            await pg.import_rows(dump)
        assert len(await pg.list_keys()) == 1  # the refused copy left nothing behind
    finally:
        await lite.aclose()
        await pg.aclose()


# --- package managers ---------------------------------------------------------------------


def as_root() -> None:
    # The package manager and `runuser -u postgres` paths are root's (the fakes stand in
    # for what root would run); tests here run as root, as make test does.
    require(os.geteuid() == 0, "init --postgres installs and runs as the postgres user as root")


def fresh_config(tmp_path: Path) -> Path:
    """A control plane that has kept nothing yet: init points it at PostgreSQL, no move."""
    path = tmp_path / "server.yaml"
    path.write_text(
        f"state_dir: {tmp_path / 'state'}\n"
        "store: null  # SQLite for now\n"
        "tls: {ca: /x/ca.crt, cert: /x/server.crt, key: /x/server.key}\n"
    )
    return path


def _dsn_of(config: Path) -> str:
    return (config.parent / "state" / "secrets" / "store-dsn").read_text().strip()


@pytest.mark.parametrize(
    ("osrelease", "install", "setup"),
    [
        (
            "osrelease-debian-12-bookworm-armv7-m5stack.txt",
            ("apt-get", ["install", "-y", "--no-install-recommends", "postgresql"]),
            [],
        ),
        (
            "osrelease-rhel-9.6.txt",
            ("dnf", ["install", "-y", "postgresql-server"]),
            [("postgresql-setup", ["--initdb"])],
        ),
    ],
)
async def test_no_postgresql_installs_it_and_makes_the_role(
    tmp_path: Path,
    pg_admin: str,
    osrelease: str,
    install: tuple[str, list[str]],
    setup: list[tuple[str, list[str]]],
) -> None:
    as_root()
    fakes = Fakes(tmp_path / "fakes", pg_admin)
    config = fresh_config(tmp_path)
    nothing = tmp_path / "no-postgres"
    nothing.mkdir()
    args = ("--yes", "--pg-bin", str(nothing), "--os-release", str(FIXTURES / osrelease))
    done = init(fakes, config, *args)
    assert done.returncode == 0, done.stderr
    calls = fakes.calls()
    assert [(tool, argv) for tool, argv, _ in calls[:-1]] == [
        install,
        *setup,
        ("systemctl", ["enable", "--now", "postgresql"]),
    ]
    runuser = calls[-1]
    assert runuser[0] == "runuser" and runuser[1][:3] == ["-u", "postgres", "--"]
    assert not any("PASSWORD" in a or "scram" in a for a in runuser[1])  # SQL on stdin
    envs = {tool: env for tool, _, env in calls}
    if install[0] == "apt-get":
        assert envs["apt-get"]["DEBIAN_FRONTEND"] == "noninteractive"
    else:
        assert "--auth-host=scram-sha-256" in envs["postgresql-setup"]["PGSETUP_INITDB_OPTIONS"]
    marker = tmp_path / "state" / "secrets" / "postgresql-installed-by-llmgw"
    assert json.loads(marker.read_text())["configured"] is True
    dsn = _dsn_of(config)
    assert f":{urlsplit(pg_admin).port}/llmgw" in dsn  # the port psql reported
    store = await open_store(dsn)
    await store.aclose()
    assert f"store: {tmp_path / 'state' / 'secrets' / 'store-dsn'}  # SQLite for now" in (
        config.read_text()
    )

    # Again (server.yaml put back): the same password, and llmgw's own PostgreSQL, found
    # now, is neither installed nor set up again.
    backup = next(tmp_path.glob("server.yaml.bak-*"))
    config.write_bytes(backup.read_bytes())
    backup.unlink()
    found = tmp_path / "found-bin"
    found.mkdir()
    (found / "pg_ctl").write_text("")
    (fakes.root / "calls.jsonl").unlink()
    again = init(fakes, config, "--yes", "--pg-bin", str(found), "--os-release", "/nonexistent")
    assert again.returncode == 0, again.stderr
    assert [tool for tool, _, _ in fakes.calls()] == ["runuser"]
    assert _dsn_of(config) == dsn


async def test_a_postgresql_llmgw_did_not_install_is_not_reconfigured(
    tmp_path: Path, pg_admin: str
) -> None:
    as_root()
    fakes = Fakes(tmp_path / "fakes", pg_admin)
    config = fresh_config(tmp_path)
    theirs = tmp_path / "their-bin"
    theirs.mkdir()
    (theirs / "pg_ctl").write_text("")
    rhel = FIXTURES / "osrelease-rhel-9.6.txt"
    done = init(fakes, config, "--yes", "--pg-bin", str(theirs), "--os-release", str(rhel))
    assert done.returncode == 0, done.stderr
    assert "llmgw did not install it: its configuration is kept" in done.stdout
    # Only the role and database, through the local superuser: no install, no initdb,
    # no service change.
    assert [tool for tool, _, _ in fakes.calls()] == ["runuser"]
    assert not (tmp_path / "state" / "secrets" / "postgresql-installed-by-llmgw").exists()
    store = await open_store(_dsn_of(config))
    await store.aclose()

    # Without --yes nothing is installed either: it says what it would do.
    fakes2 = Fakes(tmp_path / "fakes2", pg_admin)
    config2 = tmp_path / "other" / "server.yaml"
    config2.parent.mkdir()
    config2.write_text(
        f"state_dir: {tmp_path / 'other' / 'state'}\ntls: {{ca: a, cert: b, key: c}}\n"
    )
    before = config2.read_bytes()
    nothing = tmp_path / "no-postgres"
    nothing.mkdir()
    asked = init(fakes2, config2, "--pg-bin", str(nothing), "--os-release", str(rhel))
    assert asked.returncode == 1
    assert "would install postgresql-server on this machine: run again with --yes" in asked.stderr
    assert fakes2.calls() == [] and config2.read_bytes() == before
