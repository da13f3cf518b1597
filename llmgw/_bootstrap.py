"""Install llmgw on a node from its control plane's mirror: stdlib only.

    python3 bootstrap.py --from https://CP:8082/ --ca ca.crt --cert agent.crt --key agent.key \
        [--prefix /opt/llmgw] [--dry-run]

The node has no llmgw yet, so this file imports nothing outside the standard
library (nor anything of llmgw); the mirror serves it as `llmgw/bootstrap.py`
and `python -m llmgw._bootstrap` runs the same code. Steps, each printed as
`step NAME: ...`:

- fetch: `llmgw/SHA256SUMS` from the mirror (mutual TLS: the mirror asks for the
  node's certificate), then every file it lists, into a staging directory
  beside `<prefix>/release/`. A file already in `<prefix>/release/` with the
  listed sum is reused, not fetched again.
- verify: each file's sha256 against SHA256SUMS. One mismatch refuses the whole
  release (exit 3, naming the file): the staging directory is removed and
  nothing of the node changes. Only then does the staged release replace
  `<prefix>/release/`.
- venv: `<prefix>/venv`, made with the interpreter running this, when missing.
- install: `pip install --no-index` from `<prefix>/release/` alone, with its
  constraints.txt: nothing comes from anywhere but the verified files.

Run again with the same release, it finds that version installed from the same
sums and does nothing ("llmgw VERSION already installed"). A failing step prints
`step NAME failed: ...` with the command's last output lines and exits 1.
Every read from the mirror has a deadline (`--timeout`, per file).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

RELEASE = "llmgw"  # the release's directory in the mirror
SUMS = "SHA256SUMS"
MAX_SUMS_BYTES = 1 << 20
MAX_FILE_BYTES = 4 << 30
READ_SIZE = 1 << 20
TAIL_LINES = 20
STEP_TIMEOUT_S = 1800.0  # a local venv or pip install: minutes on a slow disk, never hours
_WHEEL = re.compile(r"llmgw-([0-9][A-Za-z0-9.+!_]*)-py3-none-any\.whl")
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3


class StepFailed(Exception):
    """A step that could not be done: its name and what went wrong (exit 1)."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"step {step} failed: {detail}")


class Refused(Exception):
    """The release does not verify: nothing is installed (exit 3)."""


def say(step: str, text: str) -> None:
    print(f"step {step}: {text}", flush=True)


# --- pure: SHA256SUMS ------------------------------------------------------------------


def parse_sums(text: str, where: str = f"{RELEASE}/{SUMS}") -> dict[str, str]:
    """SHA256SUMS (sha256sum's format) -> {relative path: hex digest}.

    The paths come from the mirror: each must be a plain relative path (no `..`,
    no absolute path, no dot-name, no backslash or control character), or the
    whole file is refused.
    """
    sums: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise Refused(f"{where} line {n}: {line[:80]!r} is not `<sha256>  <path>`")
        digest, path = m.groups()
        parts = path.split("/")  # not PurePosixPath: it would drop the empty segment of `a/`
        if any(p in ("", ".", "..") or p.startswith(".") for p in parts) or re.search(
            r"[\x00-\x1f\x7f\\]", path
        ):
            raise Refused(f"{where} line {n}: {path!r} is not a plain relative path")
        if path in sums:
            raise Refused(f"{where} line {n}: {path!r} is listed twice")
        sums[path] = digest
    return sums


def release_version(sums: dict[str, str], where: str = f"{RELEASE}/{SUMS}") -> str:
    """The version of the one `llmgw-VERSION-py3-none-any.whl` at the release's top."""
    found = [m.group(1) for p in sums if (m := _WHEEL.fullmatch(p))]
    if len(found) != 1:
        raise Refused(
            f"{where} lists {len(found)} llmgw-VERSION-py3-none-any.whl at its top, "
            "needs exactly one"
        )
    if "constraints.txt" not in sums:
        raise Refused(f"{where} does not list constraints.txt")
    return found[0]


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --- the mirror ------------------------------------------------------------------------


def tls_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    for what, path in (("--ca", ca), ("--cert", cert), ("--key", key)):
        if not path.is_file():
            raise StepFailed("fetch", f"{what} {path}: no such file")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise StepFailed("fetch", f"cannot use --cert {cert} with --key {key}: {exc}") from exc
    return ctx


class Mirror:
    def __init__(self, base: str, ctx: ssl.SSLContext | None, timeout: float) -> None:
        self.base = base if base.endswith("/") else base + "/"
        self.ctx = ctx
        self.timeout = timeout

    def url(self, path: str) -> str:
        return urllib.parse.urljoin(self.base, urllib.parse.quote(f"{RELEASE}/{path}"))

    def fetch(self, path: str, sink: Callable[[bytes], object], limit: int) -> int:
        """Pass the file's bytes to `sink`, chunk by chunk; its size. Deadline: self.timeout."""
        url = self.url(path)
        deadline = time.monotonic() + self.timeout
        try:
            with urllib.request.urlopen(url, timeout=self.timeout, context=self.ctx) as answer:
                size = 0
                while chunk := answer.read(READ_SIZE):
                    size += len(chunk)
                    if size > limit:
                        raise StepFailed("fetch", f"{url}: more than {limit} bytes")
                    if time.monotonic() > deadline:
                        raise StepFailed("fetch", f"{url}: not complete in {self.timeout:g} s")
                    sink(chunk)
                return size
        except urllib.error.HTTPError as exc:
            reason = re.sub(
                r"[\x00-\x1f\x7f]", "?", exc.read(300).decode("utf-8", "replace").strip()
            )
            raise StepFailed("fetch", f"{url}: HTTP {exc.code} {reason}") from exc
        except (urllib.error.URLError, OSError) as exc:
            why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise StepFailed("fetch", f"{url}: {why}") from exc


# --- the steps -------------------------------------------------------------------------


def run(step: str, cmd: list[str]) -> str:
    """Run a command; its output, or StepFailed with its last lines."""
    # Nothing of the node's pip configuration (pip.conf, PIP_FIND_LINKS, PIP_CONSTRAINT)
    # may add a source or a pin: the verified release is the only one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    try:
        done = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=STEP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise StepFailed(step, f"`{' '.join(cmd)}` still running after {exc.timeout:g} s") from exc
    except OSError as exc:
        raise StepFailed(step, f"{cmd[0]}: {exc.strerror or exc}") from exc
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        tail = "\n".join(output.splitlines()[-TAIL_LINES:])
        raise StepFailed(step, f"`{' '.join(cmd)}` exited {done.returncode}:\n{tail}")
    return output


def installed_version(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    try:  # -I: neither the working directory nor PYTHONPATH may answer for the venv
        done = subprocess.run(
            [str(python), "-I", "-c", "import importlib.metadata as m; print(m.version('llmgw'))"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def stage(mirror: Mirror, sums: dict[str, str], sums_text: bytes, release: Path) -> Path:
    """Fetch and verify every listed file into a new directory beside `release`."""
    staging = Path(tempfile.mkdtemp(prefix=".release.", dir=release.parent))
    try:
        fetched = reused = 0
        for path, want in sums.items():
            dest = staging / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            old = release / path
            if old.is_file() and not old.is_symlink() and file_sha256(old) == want:
                shutil.copy2(old, dest)
                reused += 1
                continue
            with open(dest, "wb") as sink:
                mirror.fetch(path, sink.write, MAX_FILE_BYTES)
            fetched += 1
        (staging / SUMS).write_bytes(sums_text)
        say("fetch", f"{fetched} fetched, {reused} reused from {release}")
        for path, want in sums.items():
            got = file_sha256(staging / path)
            if got != want:
                raise Refused(
                    f"{RELEASE}/{path}: sha256 mismatch (expected {want}, got {got}): "
                    "refusing to install"
                )
        say("verify", f"{len(sums)} files match {RELEASE}/{SUMS}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def replace_release(staging: Path, release: Path) -> None:
    old = None
    if release.exists():
        old = release.with_name(f".release.old.{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(release, old)
    os.rename(staging, release)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def bootstrap(args: argparse.Namespace) -> int:
    prefix: Path = args.prefix
    release, venv = prefix / "release", prefix / "venv"
    ctx = tls_context(args.ca, args.cert, args.key) if args.base.startswith("https:") else None
    mirror = Mirror(args.base, ctx, args.timeout)

    chunks: list[bytes] = []
    mirror.fetch(SUMS, chunks.append, MAX_SUMS_BYTES)
    sums_text = b"".join(chunks)
    try:
        sums = parse_sums(sums_text.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise Refused(f"{RELEASE}/{SUMS} is not UTF-8 text") from exc
    version = release_version(sums)
    say("fetch", f"{mirror.url(SUMS)}: llmgw {version}, {len(sums)} files")

    same_sums = (release / SUMS).is_file() and (release / SUMS).read_bytes() == sums_text
    have = installed_version(venv)
    if same_sums and have == version:
        print(f"llmgw {version} already installed in {venv} (from the same {SUMS})")
        return 0

    wheel = next(p for p in sums if _WHEEL.fullmatch(p))
    install = [
        str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index",
        "--find-links", str(release / "wheelhouse"), "--find-links", str(release),
        "-c", str(release / "constraints.txt"),
    ]  # fmt: skip
    if have == version:
        install.append("--force-reinstall")  # the same version rebuilt: its sums differ
    install.append(f"llmgw=={version}")

    if args.dry_run:
        say("fetch", f"would fetch {len(sums)} files into {release} and verify each")
        if not (venv / "bin" / "python").exists():
            say("venv", f"would run {sys.executable} -m venv {venv}")
        say("install", f"would run {' '.join(install)} (installed now: {have or 'nothing'})")
        return 0

    made = not prefix.exists()
    prefix.mkdir(parents=True, exist_ok=True)
    try:
        staging = stage(mirror, sums, sums_text, release)
    except BaseException:
        if made:
            shutil.rmtree(prefix, ignore_errors=True)  # refused: leave no trace of it
        raise
    replace_release(staging, release)
    say("verify", f"{release} now holds llmgw {version} ({wheel})")

    if (venv / "bin" / "python").exists():
        say("venv", f"{venv} exists")
    else:
        say("venv", f"creating {venv} with {sys.executable}")
        run("venv", [sys.executable, "-m", "venv", str(venv)])
    say("install", " ".join(install))
    run("install", install)
    got = installed_version(venv)
    if got != version:
        raise StepFailed("install", f"{venv} reports llmgw {got or 'absent'}, not {version}")
    say("install", f"llmgw {version} installed in {venv}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bootstrap.py",
        description="install llmgw from a control plane's mirror, checked against its SHA256SUMS",
    )
    parser.add_argument("--from", dest="base", required=True, metavar="URL",
                        help="the mirror's base URL, e.g. https://cp:8082/")  # fmt: skip
    parser.add_argument("--ca", type=Path, help="the cluster's CA certificate")
    parser.add_argument("--cert", type=Path, help="this node's certificate")
    parser.add_argument("--key", type=Path, help="this node's key")
    parser.add_argument("--prefix", type=Path, default=Path("/opt/llmgw"))
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds each file may take to arrive (default 600)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="say what would be done")
    args = parser.parse_args(argv)
    scheme = urllib.parse.urlsplit(args.base).scheme
    if scheme not in ("http", "https"):
        parser.error(f"--from {args.base!r}: needs an http:// or https:// URL")
    if scheme == "https" and not (args.ca and args.cert and args.key):
        parser.error("--from https://...: --ca, --cert and --key are needed (mutual TLS)")
    args.prefix = args.prefix.absolute()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return bootstrap(args)
    except Refused as exc:
        print(exc, file=sys.stderr, flush=True)
        return EXIT_REFUSED
    except StepFailed as exc:
        print(exc, file=sys.stderr, flush=True)
        return EXIT_FAILED
    except OSError as exc:  # the prefix cannot be written, a disk full: say what and where
        print(f"step install failed: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
