"""vLLM and SGLang on the node: one virtualenv per version, filled by pip, proven by import.

The virtualenv is created in place, `<state>/engines/<name>/<version>/` (a
venv's scripts name their directory, so it cannot be renamed), and filled by
pip from the declared index or the control plane's mirror `/simple/`; pip
reads no configuration of the node's. It is proven by importing the package,
never by running the server, and its marker is written last (`_engine_dir`).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw import model
from llmgw.agent._engine_dir import InstallError, read_marker, rmtree, write_marker
from llmgw.agent._sources import MIRROR_PREFIX, ControlPlane, SourceError, mirror_url

# Part of the engine installer, as operators know it.
log = logging.getLogger("llmgw.agent.engines")

VENV_TIMEOUT_S = 300.0
PIP_TIMEOUT_S = 3600.0  # vLLM pulls torch: gigabytes
IMPORT_TIMEOUT_S = 300.0  # importing vllm imports torch
PIP_ENGINES = {"vllm": "vllm", "sglang": "sglang"}  # engine -> the module proven by import


@attrs.frozen
class PipTls:
    """The mirror's TLS for pip: the cluster CA, and this agent's key and certificate."""

    ca: Path
    cert: Path
    key: Path


def pip_failure(output: str, requirement: str) -> str:
    """pip's failure in one line: its "No matching distribution found for X" line when
    there is one, else its last error line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        # The index could not be read (TLS, refused): that, not "no matching", is why.
        if line.startswith("Could not fetch URL "):
            why = line.removeprefix("Could not fetch URL ").split(" (Caused by", 1)[0]
            return f"pip install {requirement}: could not read the index {why}"[:300]
    for line in lines:
        if "No matching distribution found for" in line:
            what = line.split("No matching distribution found for", 1)[1].strip()
            return f"no matching distribution for {what or requirement}"
    errors = [line for line in lines if line.startswith("ERROR:")]
    last = (errors or lines or ["(no output)"])[-1]
    return f"pip install {requirement}: {last.removeprefix('ERROR:').strip()}"[:300]


# (engine, state, detail, version): a step of a pass, in the node's words.
Status = Callable[[str, str, str, "str | None"], None]
# (engine, detail, version): a proof's step; an installed engine stays installed meanwhile.
Checking = Callable[[str, str, "str | None"], None]


class VenvInstaller:
    """One pass for a pip engine: `install(decl)` is the engine proven, or InstallError."""

    def __init__(
        self,
        root: Path,
        state_dir: Path,
        *,
        python: str,
        env: Mapping[str, str] | None,
        control_plane: Callable[[], ControlPlane | None],
        pip_tls: PipTls | None,
        status: Status,
        checking: Checking,
    ) -> None:
        self._root = root
        self._state_dir = state_dir
        self._python = python
        self._env = env  # the proofs' environment; None: this process's
        self._control_plane = control_plane
        self._pip_tls = pip_tls
        self._status = status  # said as it is
        self._checking = checking  # a proof's step: an installed engine stays installed

    def __repr__(self) -> str:
        return f"<VenvInstaller {self._root} python={self._python}>"

    async def install(self, decl: model.EngineDecl) -> model.Engine:
        module = PIP_ENGINES[decl.name]
        requirement = decl.requirement or f"{module}=={decl.version}"
        venv = self._root / decl.name / decl.version
        python = venv / "bin" / "python"
        exe = python if decl.name == "sglang" else venv / "bin" / decl.name
        marker = await trio.to_thread.run_sync(read_marker, venv)
        if not (
            marker is not None
            and marker.get("version") == decl.version
            and marker.get("requirement") == requirement
        ):
            await self._fill_venv(decl, venv, requirement)
        self._checking(decl.name, f"import {module}", decl.version)
        done = await self._run([str(python), "-c", f"import {module}"], IMPORT_TIMEOUT_S)
        if done is None:
            raise InstallError(
                f"{python} -c 'import {module}': no answer within {IMPORT_TIMEOUT_S:g} s"
            )
        if done.returncode != 0:
            raise InstallError(f"{python} -c 'import {module}' failed: {_last_line(done.stdout)}")
        if not os.access(exe, os.X_OK):
            raise InstallError(f"{exe}: not installed by {requirement} (no such executable)")
        if marker is None or marker.get("requirement") != requirement:
            data = {
                "version": decl.version,
                "requirement": requirement,
                "binary": str(exe.relative_to(venv)),
            }
            await trio.to_thread.run_sync(write_marker, venv, data)
        return model.Engine(decl.name, str(exe), decl.version, "installed")

    async def _fill_venv(self, decl: model.EngineDecl, venv: Path, requirement: str) -> None:
        await trio.to_thread.run_sync(rmtree, venv)  # unmarked: an earlier pass's leftover
        await trio.to_thread.run_sync(lambda: venv.parent.mkdir(parents=True, exist_ok=True))
        self._status(decl.name, "installing", "creating a virtualenv", decl.version)
        done = await self._run([self._python, "-m", "venv", str(venv)], VENV_TIMEOUT_S)
        if done is None or done.returncode != 0:
            why = "no answer" if done is None else _last_line(done.stdout)
            raise InstallError(f"{self._python} -m venv {venv} failed: {why}")
        args = [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--index-url",
            await self._index(decl),
        ]
        tls_args = await self._pip_tls_args(decl)
        args += tls_args
        args.append(requirement)
        self._status(decl.name, "installing", f"pip install {requirement}", decl.version)
        done = await self._run(args, PIP_TIMEOUT_S, pip=True, own_ca=bool(tls_args))
        if done is None:
            raise InstallError(f"pip install {requirement}: no answer within {PIP_TIMEOUT_S:g} s")
        if done.returncode != 0:
            output = done.stdout.decode(errors="replace")
            log.warning(
                "pip install %s failed; its last lines:\n%s",
                requirement,
                "\n".join(output.splitlines()[-15:]),
            )
            raise InstallError(pip_failure(output, requirement))

    async def _index(self, decl: model.EngineDecl) -> str:
        if decl.index_url:
            return decl.index_url
        try:
            url, _ = mirror_url(self._control_plane(), MIRROR_PREFIX + "/simple/", None)
        except SourceError as exc:
            raise InstallError(
                f"{decl.name} {decl.version}: no index_url declared, and {exc}"
            ) from None
        return url

    async def _pip_tls_args(self, decl: model.EngineDecl) -> list[str]:
        cp = self._control_plane()
        if decl.index_url or cp is None or not cp.settings.mirror_tls or self._pip_tls is None:
            return []
        tls = self._pip_tls
        pem = self._state_dir / "pip-client.pem"

        def write() -> None:
            body = tls.key.read_bytes().rstrip(b"\n") + b"\n" + tls.cert.read_bytes()
            fd = os.open(pem.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.chmod(pem.with_suffix(".tmp"), 0o600)
            os.replace(pem.with_suffix(".tmp"), pem)

        await trio.to_thread.run_sync(write)
        return ["--cert", str(tls.ca), "--client-cert", str(pem)]

    async def _run(
        self, argv: list[str], timeout_s: float, *, pip: bool = False, own_ca: bool = False
    ) -> Any:
        """The finished process (stdout and stderr together), or None past `timeout_s`.

        pip (`pip=True`) reads no configuration file and no PIP_* variable: the
        declaration alone says where it installs from (a node's pip.conf may add
        indexes, find-links or constraints). With the mirror's CA (`own_ca`),
        REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE go too: requests lets them win over
        pip's --cert."""
        env = {**(self._env if self._env is not None else os.environ), "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONHOME", None)
        env.pop("VIRTUAL_ENV", None)
        if pip:
            env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
            env["PIP_CONFIG_FILE"] = os.devnull
        if own_ca:
            env.pop("REQUESTS_CA_BUNDLE", None)
            env.pop("CURL_CA_BUNDLE", None)
        with trio.move_on_after(timeout_s):
            try:
                return await trio.run_process(
                    argv, capture_stdout=True, stderr=subprocess.STDOUT, check=False, env=env
                )
            except OSError as exc:
                raise InstallError(f"{argv[0]}: cannot run ({exc.strerror or exc})") from None
        return None


def _last_line(output: bytes | str | None) -> str:
    text = output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"
