"""`llmgw ctl onboard NODE --ssh user@host`: join a machine to the fleet, from the CA's machine.

Steps, each printed as `step NAME: ...`:

1. `cert`: the node's client certificate (CN = NODE) from the CA in the PKI
   directory; an existing one that is still valid for a day and signed by this
   CA is reused (`unchanged`).
2. `copy`: the CA certificate, the node's certificate and key, and this
   installation's bootstrap (llmgw/_bootstrap.py) go to `<prefix>/onboard/` on
   the node over ssh's stdin (no scp); each file replaced only when it differs.
3. `install-llmgw`: the bootstrap installs llmgw from the control plane's mirror
   into `<prefix>/venv`, checked against the release's SHA256SUMS.
4. `install-agent`: `<prefix>/venv/bin/llmgw-agent install ...` writes the PKI,
   agent.yaml and the unit, and starts it.
5. `wait`: until the admin API lists the node ready; its `ctl nodes` row.

The system `ssh` client runs every remote command (BatchMode, a connect
timeout, the operator's `--ssh-option`s), each bounded by `--step-timeout-s`;
a failing one names its step, the node and the output's tail. `--dry-run`
prints every step and its command and runs none.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw import config
from llmgw.ctl import _cert
from llmgw.ctl._client import api_get, settings
from llmgw.ctl._tables import format_nodes
from llmgw.errors import ConfigError, LlmgwError

DEFAULT_PREFIX = "/opt/llmgw"
MIRROR_PORT = 8082
RENEW_BEFORE = dt.timedelta(days=1)
TAIL = 2000


class OnboardError(LlmgwError):
    """A step that failed on the node; the message names it and the output's tail."""


def ssh_argv(
    target: str, options: Sequence[str], command: str, connect_timeout_s: int
) -> list[str]:
    return [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={connect_timeout_s}",
        *options,
        target,
        "--",
        command,
    ]


def remote_path(root: str | None, path: str) -> str:
    return path if root is None else root.rstrip("/") + path


def put_command(path: str, mode: int) -> str:
    """A shell command that writes its stdin to `path` only when it differs, and says which.

    Its directory (the key's) is 0700; the directories above it keep the node's umask."""
    p = shlex.quote(path)
    tmp = shlex.quote(path + ".tmp")
    d = shlex.quote(str(Path(path).parent))
    return (
        f"mkdir -p {d} && chmod 700 {d} && (umask 077 && cat > {tmp}) && chmod {mode:o} {tmp} && "
        f"if cmp -s {tmp} {p}; then rm -f {tmp}; echo unchanged; "
        f"else mv -f {tmp} {p}; echo written; fi"
    )


def mirror_from_cp(cp: Sequence[str]) -> str:
    host, _ = config.split_host_port(cp[0])
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{MIRROR_PORT}/"


def cert_is_reusable(cert_path: Path, ca_path: Path, node: str, *, now: dt.datetime) -> bool:
    """The node's certificate exists, names the node, is signed by this CA and stays valid."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    except (OSError, ValueError):
        return False
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names or names[0].value != node or cert.issuer != ca.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:
        return False
    return cert.not_valid_before_utc <= now and cert.not_valid_after_utc > now + RENEW_BEFORE


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("onboard", help="install llmgw on a machine over ssh and join it")
    p.add_argument("node", metavar="NODE", help="the node id (its certificate's CN)")
    p.add_argument("--ssh", required=True, metavar="USER@HOST", help="where to ssh to")
    p.add_argument(
        "--cp",
        default=None,
        help="the control planes' RPC addresses, H:P,H:P (default: the admin URL's host, 7070)",
    )
    p.add_argument("--mirror", default=None, help="the mirror's URL (default: https://CP:8082/)")
    p.add_argument("--label", action="append", default=[], help="k=v, again for more")
    p.add_argument("--fabric", action="append", default=[], help="NAME=dev,dev")
    p.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        help='passed to ssh, split like a shell: --ssh-option "-p 2222" --ssh-option=-iKEY',
    )
    p.add_argument("--pki-dir", type=Path, default=None, help="the CA's directory")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="where llmgw goes on the node")
    p.add_argument("--python", default="python3", help="the node's Python for the venv")
    p.add_argument("--node-root", default=None, help="(tests) the node's files under DIR")
    p.add_argument("--no-systemd", action="store_true", help="start the agent without systemd")
    p.add_argument("--connect-timeout-s", type=int, default=10)
    p.add_argument("--step-timeout-s", type=float, default=600.0)
    p.add_argument("--wait-s", type=float, default=120.0, help="for the node to be ready")
    p.add_argument("--dry-run", action="store_true", help="print every step; run none")
    p.set_defaults(func=run)


class Onboarding:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.node: str = args.node
        self.ssh_options = [w for o in args.ssh_option for w in shlex.split(o)]

    def ssh(self, step: str, command: str, data: bytes | None = None) -> str:
        argv = ssh_argv(self.args.ssh, self.ssh_options, command, self.args.connect_timeout_s)
        if self.args.dry_run:
            print(f"step {step}: would run: {shlex.join(argv)}")
            return ""
        try:
            done = subprocess.run(
                argv,
                input=data if data is not None else b"",
                capture_output=True,
                timeout=self.args.step_timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            out = ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")
            raise OnboardError(
                f"step {step} failed on {self.node}: no answer within "
                f"{self.args.step_timeout_s:g} s (--step-timeout-s): {out.strip()[-TAIL:]}"
            ) from None
        except OSError as exc:
            raise OnboardError(f"step {step}: cannot run ssh: {exc.strerror or exc}") from None
        out = (done.stdout + done.stderr).decode(errors="replace").strip()
        if done.returncode != 0:
            raise OnboardError(
                f"step {step} failed on {self.node} (exit {done.returncode}): {out[-TAIL:]}"
            )
        return done.stdout.decode(errors="replace").strip()


def run(args: argparse.Namespace) -> int:
    ob = Onboarding(args)
    node = args.node
    if args.cp is None:
        admin_host = urlsplit(settings(args)[0]).hostname or "127.0.0.1"
        args.cp = f"{admin_host}:7070"
    cps = [c for c in args.cp.split(",") if c]
    for c in cps:
        try:
            config.split_host_port(c)
        except ValueError as exc:
            raise ConfigError(f"--cp: {exc}; e.g. --cp cp1:7070,cp2:7070") from None
    mirror = args.mirror or mirror_from_cp(cps)

    # 1. the certificate
    pki_dir = args.pki_dir or _cert.default_pki_dir()
    cert_path, key_path = pki_dir / f"agent-{node}.crt", pki_dir / f"agent-{node}.key"
    ca_path = pki_dir / _cert.CA_CERT
    reuse = key_path.exists() and cert_is_reusable(
        cert_path, ca_path, node, now=dt.datetime.now(dt.UTC)
    )
    if reuse:
        print(f"step cert: {cert_path}: unchanged")
    elif args.dry_run:
        print(f"step cert: would issue {cert_path} from {ca_path}")
    else:
        try:
            _cert.issue_agent(pki_dir, node, force=True)
        except OSError as exc:
            raise ConfigError(f"{pki_dir}: cannot issue: {exc.strerror or exc}") from None
        print(f"step cert: {cert_path}: issued")

    # 2. the files the node needs
    root = args.node_root
    stage = remote_path(root, args.prefix.rstrip("/") + "/onboard")
    bootstrap = Path(__file__).resolve().parent.parent / "_bootstrap.py"
    sources = [
        (ca_path, "ca.crt", 0o644),
        (cert_path, f"agent-{node}.crt", 0o644),
        (key_path, f"agent-{node}.key", 0o600),
        (bootstrap, "bootstrap.py", 0o644),
    ]
    for src, name, mode in sources:
        dest = f"{stage}/{name}"
        if args.dry_run:
            print(f"step copy: {src} -> {args.ssh}:{dest}")
            ob.ssh("copy", put_command(dest, mode))
            continue
        try:
            data = src.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{src}: cannot read: {exc.strerror or exc}") from None
        said = ob.ssh("copy", put_command(dest, mode), data)
        print(f"step copy: {dest}: {said}")

    # 3. llmgw from the mirror
    prefix = remote_path(root, args.prefix)
    tls = ["--ca", f"{stage}/ca.crt", "--cert", f"{stage}/agent-{node}.crt"]
    tls += ["--key", f"{stage}/agent-{node}.key"]
    boot = [args.python, f"{stage}/bootstrap.py", "--from", mirror, *tls, "--prefix", prefix]
    said = ob.ssh("install-llmgw", shlex.join(boot))
    _show("install-llmgw", said)

    # 4. the agent
    install = [f"{prefix}/venv/bin/llmgw-agent", "install", "--node", node, "--servers"]
    install += [",".join(cps), *tls]
    for label in args.label:
        install += ["--label", label]
    for fabric in args.fabric:
        install += ["--fabric", fabric]
    if root is not None:
        install += ["--root", root]
    if args.no_systemd:
        install += ["--no-systemd", "--start"]
    said = ob.ssh("install-agent", shlex.join(install))
    _show("install-agent", said)

    # 5. ready in the control plane
    if args.dry_run:
        print(f"step wait: until {node} is ready in `llmgw ctl nodes` (at most {args.wait_s:g} s)")
        return 0
    row = _wait_ready(args, node, api_get)
    print(format_nodes([row], now=time.time()))
    labels = (row.get("inventory") or {}).get("labels") or []
    print("labels: " + (", ".join(f"{lb['key']}={lb['value']}" for lb in labels) or "-"))
    return 0


def _show(step: str, output: str) -> None:
    for line in output.splitlines():
        print(f"step {step}: {line}" if not line.startswith("step ") else line)


def _wait_ready(
    args: argparse.Namespace, node: str, api_get: Callable[[argparse.Namespace, str], Any]
) -> dict[str, Any]:
    deadline = time.monotonic() + args.wait_s
    last = "not listed"
    while True:
        try:
            nodes = {n["node_id"]: n for n in api_get(args, "/api/v1/nodes")["nodes"]}
        except LlmgwError as exc:
            nodes, last = {}, str(exc)
        row = nodes.get(node)
        if row is not None:
            if row["state"] == "ready":
                print(f"step wait: {node} is ready")
                return dict(row)
            last = f"{row['state']} ({row.get('state_reason') or '-'})"
        if time.monotonic() > deadline:
            raise OnboardError(
                f"step wait failed on {node}: not ready in the control plane within "
                f"{args.wait_s:g} s (--wait-s); last: {last}"
            )
        time.sleep(0.5)
