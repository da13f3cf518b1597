"""`llmgw-cp init --postgres`: move this control plane's store to a local PostgreSQL.

1. A PostgreSQL server on this machine (its programs under /usr/lib/postgresql/*/bin,
   /usr/pgsql-*/bin or on PATH)? None: install it with the machine's package manager
   (llmgw/host/packages.py: apt-get, dnf/yum, zypper by os-release), then on the RHEL
   family `postgresql-setup --initdb` with password (scram-sha-256) auth on 127.0.0.1/::1
   (its default is ident), and enable and start the service. A marker in
   `<state_dir>/secrets/` remembers that llmgw installed it: a PostgreSQL llmgw did not
   install is never reconfigured.
2. The `llmgw` role (LOGIN, a generated password; a second run keeps the password the DSN
   file holds) and the `llmgw` database owned by it: through `--admin-dsn` (a superuser
   address), else as root through `runuser -u postgres -- psql` (the SQL, password and
   all, on its stdin, never in argv), else the SQL to run is printed.
3. `postgresql://llmgw:PASS@127.0.0.1:PORT/llmgw` into `<state_dir>/secrets/store-dsn`
   (dir 0700, file 0600, written whole and renamed), then opened (`open_store`, which
   migrates): the address is checked before anything depends on it.
4. On a control plane on SQLite (`store:` null and `<state_dir>/store.sqlite3` there): it
   is stopped (`systemctl stop llmgw-cp` when that unit is active; otherwise the operator
   must stop it: refused while its admin listener answers), every row is copied into
   PostgreSQL in one transaction (refused if it already holds accounts or keys), the
   lease's epoch with it; then server.yaml's `store:` names the DSN file (one line edited,
   comments kept; the old file kept as `server.yaml.bak-<time>`), and the unit started
   again. Any failure before that last rename leaves server.yaml and the SQLite file as
   they were, and says what failed in one line.

`store:` already naming a PostgreSQL is refused: one PostgreSQL store is never moved
into another. Tests point the discovery elsewhere: `--pg-bin DIR` (search only there),
`--os-release FILE`, and PATH for the package manager, systemctl, runuser, psql and
postgresql-setup.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import attrs
import trio
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from llmgw import config
from llmgw.errors import LlmgwError
from llmgw.host.os_release import parse_os_release
from llmgw.host.packages import PackageError, PackageInstaller, family
from llmgw.host.run import run_bounded
from llmgw.store import SQLITE_FILE, SqlStore, open_store

log = logging.getLogger("llmgw.cp.init")

ROLE = DATABASE = "llmgw"
UNIT = "llmgw-cp"
DSN_FILE = "store-dsn"
MARKER = "postgresql-installed-by-llmgw"
PACKAGES: Mapping[str, tuple[str, ...]] = {
    "debian": ("postgresql",),  # its postinst creates the cluster and starts it
    "rhel": ("postgresql-server",),
    "suse": ("postgresql-server",),
}
# RHEL's initdb defaults to ident on TCP; llmgw connects with a password. initdb given
# scram-sha-256 for host lines also sets password_encryption to it in postgresql.conf.
RHEL_INITDB = "--auth-local=peer --auth-host=scram-sha-256"
_PASSWORD = re.compile(r"[A-Za-z0-9_-]{16,}")
STEP_TIMEOUT_S = 300.0


class InitError(LlmgwError):
    """`init --postgres` cannot go on; one line saying what and what to do."""


@attrs.frozen
class Step:
    """One command of the setup, as it is run."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = attrs.field(factory=dict)


def configure_steps(fam: str) -> list[Step]:
    """What follows the package install, per family: password auth, enabled and started."""
    start = Step(("systemctl", "enable", "--now", "postgresql"))
    if fam == "rhel":
        setup = Step(("postgresql-setup", "--initdb"), {"PGSETUP_INITDB_OPTIONS": RHEL_INITDB})
        return [setup, start]
    return [start]


def _check_password(password: str) -> None:
    if not _PASSWORD.fullmatch(password):
        raise InitError("the llmgw role's password must be 16+ characters of [A-Za-z0-9_-]")


def role_select(password: str) -> str:
    """A SELECT whose one value is the statement that makes the role or sets its password."""
    _check_password(password)
    return (
        f"SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}')"
        f" THEN 'ALTER' ELSE 'CREATE' END || ' ROLE {ROLE} LOGIN PASSWORD '"
        f" || quote_literal('{password}')"
    )


# CREATE DATABASE cannot run in a DO block: a SELECT yields it only when it is missing.
DB_SELECT = (
    f"SELECT 'CREATE DATABASE {DATABASE} OWNER {ROLE}'"
    f" WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = '{DATABASE}')"
)
# md5 (PostgreSQL 13's default) would store a hash that scram-sha-256 auth cannot check.
SCRAM = "SET password_encryption = 'scram-sha-256'"


def psql_script(password: str) -> str:
    """For psql on stdin: the role, the database (each through \\gexec), then the port."""
    return f"{SCRAM};\n{role_select(password)} \\gexec\n{DB_SELECT} \\gexec\nSHOW port;\n"


def make_dsn(password: str, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"postgresql://{ROLE}:{quote(password, safe='')}@{shown}:{port}/{DATABASE}"


def dsn_password(dsn: str) -> str | None:
    """The llmgw role's password in an earlier run's DSN, or None."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return None
    if parts.username != ROLE or not parts.password:
        return None
    return parts.password if _PASSWORD.fullmatch(parts.password) else None


# --- server.yaml, as text -----------------------------------------------------------------


def _yaml_scalar(value: str) -> str:
    return value if re.fullmatch(r"/[A-Za-z0-9_./-]+", value) else json.dumps(value)


def edit_store_line(text: str, value: str) -> str:
    """server.yaml with its top-level `store:` set to `value`, every other byte kept.

    A top-level `store:` line with a one-line value (or none) is replaced, its comment
    kept; without one, the line is appended. Anything else (a flow-style file, a value
    over several lines) goes through ruamel's round-trip, which keeps comments too.
    The result is checked to parse to the same mapping with only `store` changed.
    """
    safe = YAML(typ="safe", pure=True)
    try:
        before = safe.load(text)
    except YAMLError as exc:
        raise InitError(f"server.yaml is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(before, dict):
        raise InitError("server.yaml does not hold a mapping")
    new = _line_edit(text, value)
    if new is None:
        new = _round_trip(text, value)
    after = safe.load(new)
    if after != {**before, "store": value}:
        raise InitError(
            f"could not edit server.yaml's store: line; set it yourself: store: {value}"
        )
    return new


def _line_edit(text: str, value: str) -> str | None:
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if re.match(r"store[ \t]*:", ln)]
    if not hits:
        if text.lstrip().startswith("{"):
            return None  # a flow mapping: a line after it would not belong to it
        sep = "" if not text or text.endswith("\n") else "\n"
        return f"{text}{sep}store: {_yaml_scalar(value)}\n"
    if len(hits) > 1:
        return None
    i = hits[0]
    m = re.match(
        r"store[ \t]*:[ \t]*(?:null|~|\"[^\"]*\"|'[^']*'|[^\s#'\"][^#\n]*?)?"
        r"(?P<tail>[ \t]+#[^\n]*)?[ \t]*(?P<nl>\r?\n)?$",
        lines[i],
    )
    if m is None:
        return None
    nxt = next((ln for ln in lines[i + 1 :] if ln.strip() and not ln.lstrip().startswith("#")), "")
    if nxt[:1] in (" ", "\t"):
        return None  # the value goes on over the next lines
    lines[i] = f"store: {_yaml_scalar(value)}{m['tail'] or ''}{m['nl'] or ''}"
    return "".join(lines)


def _round_trip(text: str, value: str) -> str:
    yaml = YAML()  # round-trip: comments survive
    yaml.preserve_quotes = True
    yaml.width = 4096
    data = yaml.load(text)
    data["store"] = value
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


# --- files --------------------------------------------------------------------------------


def write_secret(path: Path, text: str) -> None:
    """`text` into `path`, 0600 in a 0700 directory, written whole then renamed; both
    owned by the state directory's owner (the user llmgw-cp runs as reads them)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    owner = path.parent.parent.stat()
    _chown_as(path.parent, owner)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    _chown_as(tmp, owner)
    os.replace(tmp, path)


def _chown_as(path: Path, like: os.stat_result) -> None:
    if os.geteuid() == 0 and (like.st_uid, like.st_gid) != (0, 0):
        os.chown(path, like.st_uid, like.st_gid)


def _write_replacing(path: Path, text: str) -> Path:
    """`text` in a temporary file beside `path` (to be renamed over it), `path`'s mode."""
    st = path.stat()
    mode = st.st_mode & 0o777
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    _chown_as(tmp, st)
    return tmp


# --- the machine --------------------------------------------------------------------------


@attrs.define
class Machine:
    """Where to look for programs, and how to run them; tests point it at fakes."""

    env: dict[str, str]
    pg_bin: Path | None = None  # search only here for the server's programs
    os_release: Path = Path("/etc/os-release")
    euid: int = attrs.field(factory=os.geteuid)

    def which(self, name: str) -> str | None:
        return shutil.which(name, path=self.env.get("PATH", os.defpath))

    def server_bin(self) -> Path | None:
        """The directory of an installed PostgreSQL server's programs, or None."""
        if self.pg_bin is not None:
            dirs = [self.pg_bin]
        else:

            def version(p: Path) -> int:
                digits = re.sub(r"\D", "", p.parent.name)
                return int(digits) if digits else 0

            dirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
            dirs += sorted(Path("/usr").glob("pgsql-*/bin"), key=version, reverse=True)
            found = self.which("pg_ctl") or self.which("postgres")
            if found:
                dirs.append(Path(found).parent)
        for d in dirs:
            if (d / "pg_ctl").is_file() or (d / "postgres").is_file():
                return d
        return None

    def psql(self, server_bin: Path | None) -> str | None:
        if server_bin is not None and (server_bin / "psql").is_file():
            return str(server_bin / "psql")
        return self.which("psql")

    def family(self) -> str:
        try:
            rel = parse_os_release(self.os_release.read_text(), source=str(self.os_release))
        except OSError as exc:
            raise InitError(f"{self.os_release}: cannot read: {exc.strerror}") from None
        except LlmgwError as exc:
            raise InitError(str(exc)) from None
        fam = family(rel.id, rel.id_like)
        if fam is None:
            raise InitError(
                f"{self.os_release}: ID={rel.id} is not a known package family "
                "(Debian, RHEL or SUSE): install PostgreSQL yourself and pass --admin-dsn"
            )
        return fam

    async def run(self, step: Step, *, what: str) -> str:
        argv = list(step.argv)
        found = self.which(argv[0])
        if found is None:
            raise InitError(f"{what} needs {argv[0]}, which is not on PATH")
        argv[0] = found
        try:
            status, out = await run_bounded(
                argv, STEP_TIMEOUT_S, env={**self.env, **step.env}, keep="tail"
            )
        except OSError as exc:
            raise InitError(f"{what}: {argv[0]} could not be run: {exc.strerror}") from None
        shown = " ".join(step.argv)
        if status is None:
            raise InitError(f"{what}: {shown} did not finish within {STEP_TIMEOUT_S:g} s")
        if status != 0:
            lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
            raise InitError(
                f"{what}: {shown} exited {status}: {lines[-1] if lines else 'no output'}"
            )
        return out


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


async def ensure_server(
    machine: Machine, secrets_dir: Path, *, may_change: bool = True, say: Any = print
) -> str:
    """A PostgreSQL server on this machine: "installed" (now, by llmgw), "ours" (by llmgw
    before) or "theirs" (left exactly as it is)."""
    marker_path = secrets_dir / MARKER
    marker = _read_marker(marker_path)
    found = machine.server_bin()
    if found is not None and marker is None:
        say(f"PostgreSQL found in {found}; llmgw did not install it: its configuration is kept")
        return "theirs"
    if found is not None and marker is not None and marker.get("configured"):
        return "ours"
    fam = str(marker["family"]) if marker is not None else machine.family()
    if not may_change:
        what = f"install {' '.join(PACKAGES[fam])}" if found is None else "set up PostgreSQL"
        raise InitError(f"this would {what} on this machine: run again with --yes")
    if found is None:
        names = " ".join(PACKAGES[fam])
        say(f"no PostgreSQL on this machine: installing {names}")
        installer = PackageInstaller(fam, env=machine.env, euid=lambda: machine.euid)
        try:
            await installer.install(PACKAGES[fam], on_wait=say)
        except PackageError as exc:
            raise InitError(str(exc)) from None
        write_secret(marker_path, json.dumps({"family": fam, "at": time.time()}) + "\n")
    for step in configure_steps(fam):
        say(f"running {' '.join(step.argv)}")
        await machine.run(step, what="setting up PostgreSQL")
    write_secret(
        marker_path, json.dumps({"family": fam, "at": time.time(), "configured": True}) + "\n"
    )
    return "installed"


# --- the role and the database ------------------------------------------------------------


def _create_with_dsn(admin_dsn: str, password: str) -> tuple[str, int]:
    import psycopg

    try:
        info = psycopg.conninfo.conninfo_to_dict(admin_dsn)
    except psycopg.ProgrammingError:
        raise InitError(
            "--admin-dsn is not a PostgreSQL address; expected postgresql://USER:PASS@HOST:PORT/DB"
        ) from None
    host = str(info.get("host") or "127.0.0.1")
    if host.startswith("/"):
        host = "127.0.0.1"
    port = int(info.get("port") or 5432)
    try:
        with psycopg.connect(
            admin_dsn,
            autocommit=True,
            connect_timeout=10,
            options="-c statement_timeout=60000 -c lock_timeout=60000",
        ) as conn:
            conn.execute(SCRAM)
            for select in (role_select(password), DB_SELECT):
                row = conn.execute(select).fetchone()
                if row is not None:
                    conn.execute(row[0])
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InitError(
            f"creating the {ROLE} role on PostgreSQL at {host}:{port} failed: {first}"
        ) from None
    return host, port


async def _create_as_postgres(machine: Machine, psql: str, password: str) -> int:
    runuser = machine.which("runuser")
    if runuser is None:
        raise InitError("creating the llmgw role as the postgres user needs runuser")
    argv = [runuser, "-u", "postgres", "--", psql, "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1"]
    argv += ["-d", "postgres"]
    try:
        with trio.fail_after(60):
            done = await trio.run_process(
                argv,
                stdin=psql_script(password).encode(),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=machine.env,
            )
    except trio.TooSlowError:
        raise InitError("runuser -u postgres -- psql did not finish within 60 s") from None
    out = done.stdout.decode(errors="replace").strip().splitlines()
    if done.returncode != 0 or not out or not out[-1].strip().isdigit():
        err = [ln.strip() for ln in done.stderr.decode(errors="replace").splitlines()]
        errors = [ln for ln in err if re.search(r"error|ERROR|FATAL", ln)] or [e for e in err if e]
        # psql exits 2 when it could not connect at all
        hint = (
            " (is PostgreSQL running? systemctl start postgresql)" if done.returncode == 2 else ""
        )
        raise InitError(
            f"creating the {ROLE} role as the postgres user failed"
            f" (psql exited {done.returncode}): {errors[0] if errors else 'no output'}{hint}"
        )
    return int(out[-1].strip())


# --- the move -----------------------------------------------------------------------------


async def _answers(host_port: str) -> bool:
    host, port = config.split_host_port(host_port)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    with trio.move_on_after(2):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


async def _unit_active(machine: Machine) -> bool:
    if machine.which("systemctl") is None:
        return False
    try:
        status, _ = await run_bounded(
            [str(machine.which("systemctl")), "is-active", "--quiet", UNIT], 30, env=machine.env
        )
    except OSError:
        return False
    return status == 0


@attrs.define(kw_only=True)
class Options:
    config: Path
    yes: bool = False
    admin_dsn: str | None = None


async def init_postgres(opts: Options, machine: Machine, *, say: Any = print) -> None:
    cfg = config.load(opts.config, config.ServerConfig)
    state_dir = cfg.state_dir.absolute()
    secrets_dir = state_dir / "secrets"
    dsn_path = secrets_dir / DSN_FILE
    if cfg.store is not None:
        named = "a postgresql:// DSN" if "://" in cfg.store else cfg.store[:200]
        raise InitError(
            f"{opts.config}: store: already names PostgreSQL ({named}):"
            " moving one PostgreSQL store into another is refused"
        )
    sqlite = state_dir / SQLITE_FILE
    moving = sqlite.exists()
    stop_unit = False
    if moving:
        stop_unit = await _unit_active(machine)
        if not stop_unit and await _answers(cfg.admin_listen):
            raise InitError(
                f"llmgw-cp is running (its admin listener {cfg.admin_listen} answers):"
                " stop it first, then run this again"
            )
        if stop_unit and not opts.yes:
            raise InitError(f"this stops {UNIT} for the move: run again with --yes")

    # PostgreSQL, the role, the DSN: all before the control plane stops.
    if opts.admin_dsn is not None:
        how = "dsn"
    else:
        await ensure_server(machine, secrets_dir, may_change=opts.yes, say=say)
        how = "postgres"
    old = dsn_path.read_text().strip() if dsn_path.exists() else ""
    password = dsn_password(old) or secrets.token_urlsafe(24)
    if how == "dsn":
        assert opts.admin_dsn is not None
        host, port = await trio.to_thread.run_sync(_create_with_dsn, opts.admin_dsn, password)
    else:
        psql = machine.psql(machine.server_bin())
        try:
            pwd.getpwnam("postgres")
            has_postgres = True
        except KeyError:
            has_postgres = False
        if machine.euid != 0 or psql is None or not has_postgres:
            raise InitError(
                "no superuser access to PostgreSQL here (run as root, or pass --admin-dsn);"
                f' or create the role yourself: psql -c "CREATE ROLE {ROLE} LOGIN PASSWORD'
                f" '...'\" -c 'CREATE DATABASE {DATABASE} OWNER {ROLE}', write"
                f" postgresql://{ROLE}:...@127.0.0.1:5432/{DATABASE} to {dsn_path} (0600) and"
                f" set store: {dsn_path} in {opts.config}"
            )
        host, port = "127.0.0.1", await _create_as_postgres(machine, psql, password)
    dsn = make_dsn(password, host, port)
    write_secret(dsn_path, dsn + "\n")
    say(f"the {ROLE} role and database are ready; the address is in {dsn_path}")
    try:
        pg = await open_store(dsn)
    except LlmgwError as exc:
        raise InitError(f"PostgreSQL at {host}:{port} as {ROLE} does not connect: {exc}") from None
    try:
        text = opts.config.read_text()
        new_text = edit_store_line(text, str(dsn_path))
        if not moving:
            # A control plane that never kept anything: nothing to copy, nothing to stop.
            await pg.audit("llmgw-cp init", "store.init", f"store: {dsn_path}")
            _replace_config(opts.config, new_text)
            say(f"{opts.config}: store: {dsn_path}")
            return
        if stop_unit:
            say(f"stopping {UNIT}")
            await machine.run(Step(("systemctl", "stop", UNIT)), what=f"stopping {UNIT}")
        if await _answers(cfg.admin_listen):  # started again meanwhile, or not stopped
            raise InitError(
                f"llmgw-cp is running (its admin listener {cfg.admin_listen} answers):"
                " stop it first, then run this again"
            )
        start = Step(("systemctl", "start", UNIT))
        try:
            await _move(state_dir, pg, opts.config, new_text, say=say)
        except BaseException:
            if stop_unit:  # back on SQLite, as it was; the move's error is the one shown
                say(f"starting {UNIT} again, on SQLite")
                with trio.CancelScope(shield=True):
                    try:
                        await machine.run(start, what=f"starting {UNIT}")
                    except InitError as exc:
                        say(str(exc))
            raise
        if stop_unit:
            say(f"starting {UNIT}")
            await machine.run(start, what=f"starting {UNIT}")
    finally:
        with trio.CancelScope(shield=True):
            await pg.aclose()


async def _move(state_dir: Path, pg: SqlStore, path: Path, new_text: str, *, say: Any) -> None:
    sqlite = state_dir / SQLITE_FILE
    lite = await open_store(state_dir)
    try:
        dump = await lite.export_rows()
    finally:
        await lite.aclose()
    backup = path.with_name(f"{path.name}.bak-{time.strftime('%Y%m%dT%H%M%S')}")
    tmp = _write_replacing(path, new_text)
    try:
        shutil.copy2(path, backup)
        # The move's own audit entry goes in with the rows, in the one transaction.
        entry = (time.time(), "llmgw-cp init", "store.move", f"from {sqlite}: {dump.describe()}")
        await pg.import_rows(attrs.evolve(dump, audit=(*dump.audit, entry)))
    except BaseException:
        tmp.unlink(missing_ok=True)
        backup.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)  # the one step after which the control plane is on PostgreSQL
    say(f"copied {dump.describe()} from {sqlite}")
    say(f"{path}: store: {state_dir / 'secrets' / DSN_FILE} (the old file: {backup.name})")


def _replace_config(path: Path, new_text: str) -> None:
    backup = path.with_name(f"{path.name}.bak-{time.strftime('%Y%m%dT%H%M%S')}")
    tmp = _write_replacing(path, new_text)
    shutil.copy2(path, backup)
    os.replace(tmp, path)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="llmgw-cp init", description="set up what the control plane keeps"
    )
    parser.add_argument("--postgres", action="store_true", required=True,
                        help="move the store to a PostgreSQL on this machine")  # fmt: skip
    parser.add_argument(
        "--config",
        type=Path,
        default=Path(os.environ.get("LLMGW_SERVER_CONFIG", "/etc/llmgw/server.yaml")),
    )
    parser.add_argument("--yes", action="store_true", help="install PostgreSQL, stop llmgw-cp")
    parser.add_argument(
        "--admin-dsn", help="a superuser address of an existing PostgreSQL to use instead"
    )
    parser.add_argument("--pg-bin", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--os-release", type=Path, default=Path("/etc/os-release"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    machine = Machine(env=dict(os.environ), pg_bin=args.pg_bin, os_release=args.os_release)
    opts = Options(config=args.config, yes=args.yes, admin_dsn=args.admin_dsn)
    try:
        trio.run(init_postgres, opts, machine)
    except LlmgwError as exc:
        print(f"llmgw-cp init: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"llmgw-cp init: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
