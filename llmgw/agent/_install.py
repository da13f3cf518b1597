"""`llmgw-agent install`: make this node an agent of a fleet, run on the node itself.

After the bootstrap (llmgw/_bootstrap.py) has put llmgw in `<prefix>/venv`, this
writes what the agent needs and starts it:

- the PKI, copied to `<etc>/pki/` (`ca.crt`, `agent-NODE.crt`, `agent-NODE.key`,
  the key 0600);
- `<etc>/agent.yaml`, holding only the node id, the control planes, the TLS
  files and the overrides given (labels, fabrics, state and weights dirs);
- the systemd unit (shipped in the wheel as `llmgw/deploy/llmgw-agent.service`)
  in `/etc/systemd/system/`, with a drop-in naming this install's ExecStart when
  it differs from the unit's, then `systemctl daemon-reload` and `enable --now`
  (`restart` when a file changed). `--no-systemd` prints the ExecStart instead,
  and with `--start` runs it detached the way the unit would, its pid in
  `<state-dir>/agent.pid`.

`--from URL` runs the bootstrap first (the mirror's release into `--prefix`), then
that installation's `llmgw-agent install` with the other options: the steps
`llmgw ctl onboard` runs over ssh, for fleets provisioned by their own tooling.

Idempotent: each file is compared with what is there and reported `unchanged`
or `written`; when nothing changed nothing restarts. `--root DIR` (for tests,
or for preparing an image) puts every absolute path it writes under DIR.
The planning (`plan`) is pure; `apply` and `start` do the I/O.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import attrs

from llmgw import config
from llmgw.errors import ConfigError

UNIT_NAME = "llmgw-agent.service"
DROP_IN = "10-llmgw-install.conf"
PID_FILE = "agent.pid"
LOG_FILE = "agent.log"
KEY_MODE = 0o600
FILE_MODE = 0o644
SYSTEMCTL_TIMEOUT_S = 60.0
_NAME = re.compile(r"[A-Za-z0-9._-]{1,63}")
_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")


@attrs.frozen
class File:
    path: Path  # as written (under the root)
    data: bytes
    mode: int


@attrs.frozen
class Options:
    node: str
    servers: tuple[str, ...]
    ca: Path
    cert: Path
    key: Path
    labels: tuple[tuple[str, str], ...] = ()
    fabrics: tuple[tuple[str, tuple[str, ...]], ...] = ()
    etc: Path = Path("/etc/llmgw")
    state_dir: Path = Path("/var/lib/llmgw-agent")
    weights_dir: Path | None = None
    root: Path | None = None
    systemd_dir: Path = Path("/etc/systemd/system")


def rooted(options: Options, path: Path) -> Path:
    """Where an absolute path the node sees lies for this install (under `--root`)."""
    if options.root is None:
        return path
    return options.root / path.relative_to(path.anchor)


def parse_label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not _LABEL_KEY.fullmatch(key) or not value:
        raise ConfigError(f"--label: not key=value (got {text!r}); e.g. --label rack=r1")
    return key, value


def parse_fabric(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, devs = text.partition("=")
    adapters = tuple(d for d in devs.split(",") if d)
    if not sep or not _NAME.fullmatch(name) or not adapters:
        raise ConfigError(
            f"--fabric: not NAME=dev,dev (got {text!r}); e.g. --fabric ib-a=mlx5_0,mlx5_1"
        )
    return name, adapters


def agent_config(options: Options) -> dict[str, object]:
    """agent.yaml's body: the node, its control planes, its TLS files, the overrides."""
    pki = options.etc / "pki"
    body: dict[str, object] = {
        "node_id": options.node,
        "servers": list(options.servers),
        "tls": {
            "ca": str(rooted(options, pki / "ca.crt")),
            "cert": str(rooted(options, pki / f"agent-{options.node}.crt")),
            "key": str(rooted(options, pki / f"agent-{options.node}.key")),
        },
    }
    if options.root is not None or options.state_dir != Path("/var/lib/llmgw-agent"):
        body["state_dir"] = str(rooted(options, options.state_dir))
    weights = options.weights_dir
    if weights is None and options.root is not None:
        weights = Path("/var/lib/llmgw-weights")  # the default, but under the root
    if weights is not None:
        body["weights_dir"] = str(rooted(options, weights))
    if options.labels:
        body["labels"] = dict(options.labels)
    if options.fabrics:
        body["fabrics"] = {name: {"adapters": list(devs)} for name, devs in options.fabrics}
    return body


def config_text(options: Options) -> bytes:
    body = agent_config(options)
    # JSON is YAML; the check that it loads is the agent's own code path.
    config.structure(body, config.AgentConfig, "agent.yaml")
    head = "# Written by `llmgw-agent install`; running it again rewrites this file.\n"
    return (head + json.dumps(body, indent=2) + "\n").encode()


def exec_start(options: Options, program: Sequence[str]) -> list[str]:
    """The command the unit runs: this install's llmgw-agent and its agent.yaml."""
    return [*program, "run", "--config", str(rooted(options, options.etc / "agent.yaml"))]


def unit_exec_start(unit: str) -> list[str] | None:
    for line in unit.splitlines():
        if line.strip().startswith("ExecStart="):
            return shlex.split(line.strip().removeprefix("ExecStart="))
    return None


def plan(
    options: Options,
    *,
    pki: tuple[bytes, bytes, bytes],
    unit: str | None,
    program: Sequence[str],
    systemd: bool,
) -> list[File]:
    """Every file this install writes, with its bytes and mode; no I/O."""
    ca, cert, key = pki
    pki_dir = options.etc / "pki"
    files = [
        File(rooted(options, pki_dir / "ca.crt"), ca, FILE_MODE),
        File(rooted(options, pki_dir / f"agent-{options.node}.crt"), cert, FILE_MODE),
        File(rooted(options, pki_dir / f"agent-{options.node}.key"), key, KEY_MODE),
        File(rooted(options, options.etc / "agent.yaml"), config_text(options), FILE_MODE),
    ]
    if systemd:
        if unit is None:
            raise ConfigError(
                f"llmgw/deploy/{UNIT_NAME}: not in this installation of llmgw; "
                "reinstall llmgw from a release wheel, or pass --no-systemd"
            )
        unit_dir = rooted(options, options.systemd_dir)
        files.append(File(unit_dir / UNIT_NAME, unit.encode(), FILE_MODE))
        ours = exec_start(options, program)
        if unit_exec_start(unit) != ours:
            drop_in = "[Service]\nExecStart=\nExecStart=" + shlex.join(ours) + "\n"
            head = "# Written by `llmgw-agent install`: this install's paths.\n"
            files.append(
                File(unit_dir / f"{UNIT_NAME}.d" / DROP_IN, (head + drop_in).encode(), FILE_MODE)
            )
    return files


def _same(path: Path, f: File) -> bool:
    try:
        st = path.stat()
        return (st.st_mode & 0o777) == f.mode and path.read_bytes() == f.data
    except FileNotFoundError:
        return False


def apply(files: Sequence[File], *, dry_run: bool) -> list[tuple[Path, str]]:
    """Write what differs (atomically, the mode set before the rename); say what each was."""
    done = []
    for f in files:
        if _same(f.path, f):
            done.append((f.path, "unchanged"))
            continue
        if dry_run:
            done.append((f.path, "would write"))
            continue
        try:
            f.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.path.with_name(f".{f.path.name}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, f.mode)
            try:
                os.fchmod(fd, f.mode)
                os.write(fd, f.data)
                os.fsync(fd)
            finally:
                os.close(fd)
            tmp.replace(f.path)
        except OSError as exc:
            raise ConfigError(f"{f.path}: cannot write: {exc.strerror or exc}") from None
        done.append((f.path, "written"))
    return done


def read_pid(state_dir: Path) -> int | None:
    """The pid in the pid file when that process is alive, else None."""
    try:
        pid = int((state_dir / PID_FILE).read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def start(argv: Sequence[str], state_dir: Path) -> int:
    """Run the agent detached, as the unit would: its own session, no terminal, a log."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with (state_dir / LOG_FILE).open("ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if k != "LLMGW_AGENT_CONFIG"},
        )
    (state_dir / PID_FILE).write_text(f"{proc.pid}\n")
    return proc.pid


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)


def _program() -> list[str]:
    """This installation's llmgw-agent: beside the running interpreter, as in a venv."""
    beside = Path(sys.executable).with_name("llmgw-agent")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "llmgw.agent"]


def _unit_text() -> str | None:
    try:
        return (resources.files("llmgw") / "deploy" / UNIT_NAME).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read(what: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--{what} {path}: cannot read: {exc.strerror or exc}") from None


def _systemctl(*args: str, dry_run: bool) -> None:
    argv = ["systemctl", *args]
    print(f"step systemd: {shlex.join(argv)}" + (" (dry run)" if dry_run else ""))
    if dry_run:
        return
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{shlex.join(argv)}: {exc}") from None
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip()[-2000:]
        raise ConfigError(f"{shlex.join(argv)}: exit {done.returncode}: {tail}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("install", help="make this node an agent: PKI, agent.yaml, the unit")
    p.add_argument("--node", required=True, help="the node id (its certificate's CN)")
    p.add_argument("--servers", required=True, help="the control planes, H:P,H:P")
    p.add_argument("--ca", type=Path, required=True)
    p.add_argument("--cert", type=Path, required=True)
    p.add_argument("--key", type=Path, required=True)
    p.add_argument("--label", action="append", default=[], help="k=v, again for more")
    p.add_argument("--fabric", action="append", default=[], help="NAME=dev,dev")
    p.add_argument("--etc", type=Path, default=Path("/etc/llmgw"))
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/llmgw-agent"))
    p.add_argument("--weights-dir", type=Path, default=None)
    p.add_argument("--root", type=Path, default=None, help="write every path under DIR")
    p.add_argument("--no-systemd", action="store_true", help="print the ExecStart instead")
    p.add_argument(
        "--start", action="store_true", help="with --no-systemd: run it detached, as the unit"
    )
    p.add_argument("--dry-run", action="store_true", help="say what would change; change nothing")
    p.add_argument(
        "--from",
        dest="base",
        metavar="URL",
        default=None,
        help="first install llmgw from this mirror (https://CP:8082/) into --prefix with the "
        "bootstrap, then run that installation's `llmgw-agent install` with these options",
    )
    p.add_argument("--prefix", type=Path, default=Path("/opt/llmgw"), help="with --from")


def run(args: argparse.Namespace) -> int:
    try:
        if args.base is not None:
            return _from_mirror(args)
        return _run(args)
    except ConfigError as exc:
        print(f"llmgw-agent install: {exc}", file=sys.stderr)
        return 2


def _from_mirror(args: argparse.Namespace) -> int:
    """`--from URL`: the steps `llmgw ctl onboard` runs over ssh, run here (cloud-init,
    Ansible): the bootstrap installs the mirror's release, checked against its
    SHA256SUMS, into `<prefix>/venv`; then that installation, not this one, writes the
    configuration and the unit, so the node runs exactly the release it was given."""
    root = args.root.absolute() if args.root is not None else None
    prefix = root / args.prefix.relative_to("/") if root is not None else args.prefix
    bootstrap = Path(__file__).resolve().parents[1] / "_bootstrap.py"
    # The base interpreter, isolated: the venv is made from it, not from whatever runs this.
    python = getattr(sys, "_base_executable", sys.executable)
    boot = [python, "-I", str(bootstrap), "--from", args.base, "--prefix", str(prefix)]
    boot += ["--ca", str(args.ca), "--cert", str(args.cert), "--key", str(args.key)]
    if args.dry_run:
        boot.append("--dry-run")
    done = subprocess.run(boot, check=False)
    if done.returncode != 0:
        return done.returncode  # the bootstrap said which step failed, and why
    installed = prefix / "venv" / "bin" / "llmgw-agent"
    again = [str(installed), "install", *_passed_on(args)]
    if args.dry_run and not installed.exists():
        print(f"step install-agent: would run {shlex.join(again)}")
        return 0
    return subprocess.run(again, check=False).returncode


def _passed_on(args: argparse.Namespace) -> list[str]:
    """The options for the installed llmgw-agent install: all but --from and --prefix."""
    argv = ["--node", args.node, "--servers", args.servers]
    argv += ["--ca", str(args.ca), "--cert", str(args.cert), "--key", str(args.key)]
    for label in args.label:
        argv += ["--label", label]
    for fabric in args.fabric:
        argv += ["--fabric", fabric]
    argv += ["--etc", str(args.etc), "--state-dir", str(args.state_dir)]
    if args.weights_dir is not None:
        argv += ["--weights-dir", str(args.weights_dir)]
    if args.root is not None:
        argv += ["--root", str(args.root.absolute())]
    for flag in ("no_systemd", "start", "dry_run"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    return argv


def _run(args: argparse.Namespace) -> int:
    if not _NAME.fullmatch(args.node):
        raise ConfigError(f"--node: not a node id (got {args.node!r}); letters, digits, . _ -")
    servers = tuple(s for s in args.servers.split(",") if s)
    for s in servers:
        try:
            config.split_host_port(s)
        except ValueError as exc:
            raise ConfigError(f"--servers: {exc}; e.g. --servers cp1:7070,cp2:7070") from None
    if not servers:
        raise ConfigError("--servers: name at least one control plane (host:port)")
    if args.start and not args.no_systemd:
        raise ConfigError("--start: only with --no-systemd (systemd starts the unit)")
    options = Options(
        node=args.node,
        servers=servers,
        ca=args.ca,
        cert=args.cert,
        key=args.key,
        labels=tuple(parse_label(t) for t in args.label),
        fabrics=tuple(parse_fabric(t) for t in args.fabric),
        etc=args.etc,
        state_dir=args.state_dir,
        weights_dir=args.weights_dir,
        root=args.root.absolute() if args.root is not None else None,
    )
    pki = (_read("ca", args.ca), _read("cert", args.cert), _read("key", args.key))
    program = _program()
    files = plan(options, pki=pki, unit=_unit_text(), program=program, systemd=not args.no_systemd)
    done = apply(files, dry_run=args.dry_run)
    for path, what in done:
        print(f"step file: {path}: {what}")
    changed = any(what != "unchanged" for _, what in done)
    argv = exec_start(options, program)
    if not args.no_systemd:
        if changed:
            _systemctl("daemon-reload", dry_run=args.dry_run)
        _systemctl("enable", "--now", UNIT_NAME, dry_run=args.dry_run)
        if changed:  # enable --now leaves a running agent as it is
            _systemctl("try-restart", UNIT_NAME, dry_run=args.dry_run)
        return 0
    print(f"step exec: ExecStart={shlex.join(argv)}")
    if not args.start:
        return 0
    state_dir = rooted(options, options.state_dir)
    pid = read_pid(state_dir)
    if pid is not None and not changed:
        print(f"step start: agent running (pid {pid}): unchanged")
        return 0
    if args.dry_run:
        print("step start: would " + ("restart" if pid is not None else "start") + " the agent")
        return 0
    if pid is not None:
        stop(pid)  # a changed file: the new agent must read it
        print(f"step start: stopped pid {pid} to restart it")
    pid = start(argv, state_dir)
    print(f"step start: agent started (pid {pid}, log {state_dir / LOG_FILE})")
    return 0
