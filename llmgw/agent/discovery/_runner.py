"""How probes run outside commands.

Probes take a `Runner` so tests can drive them with recorded output or a fake
binary on PATH. A missing binary is not an error: a node without nvidia-smi is
a node without NVIDIA cards, so the runner reports it distinctly instead of
raising.

The runner is blocking; the agent calls probes from a worker thread
(`trio.to_thread.run_sync`), so nothing here imports trio.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Sequence
from typing import Protocol

import attrs

logger = logging.getLogger("llmgw.agent.discovery")

#: Shell conventions, so a log line reads the same as a terminal would.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_TIMED_OUT = 124


@attrs.frozen
class RunResult:
    """What a command did. `missing`: the binary was not found (nothing ran)."""

    returncode: int
    stdout: str
    stderr: str
    missing: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.missing and not self.timed_out

    def describe(self) -> str:
        """One line for a log or a warning: the exit status and the telling line.

        That is the last line of stderr (a Python traceback ends with the
        error) or else the first line of stdout (nvidia-smi prints its one
        error line there).
        """
        if self.missing:
            return "not found"
        if self.timed_out:
            return "timed out"
        err = [ln for ln in self.stderr.splitlines() if ln.strip()]
        out = [ln for ln in self.stdout.splitlines() if ln.strip()]
        line = err[-1].strip() if err else out[0].strip() if out else "no output"
        return f"exit status {self.returncode}: {line}"


class Runner(Protocol):
    """Run `argv` with a timeout in seconds; never raise for a missing binary."""

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult: ...


@attrs.frozen
class SubprocessRunner:
    """The real runner.

    LC_ALL=C because every caller parses the output, and a localised lscpu or
    nvidia-smi would print words the parsers do not know. stdin is closed so a
    command that asks a question fails instead of hanging the probe.
    """

    env: dict[str, str] | None = None

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        env = dict(os.environ if self.env is None else self.env)
        env["LC_ALL"] = "C"
        try:
            done = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
                env=env,
                check=False,
            )
        except FileNotFoundError as e:
            logger.debug("%s: not found (%s)", argv[0], e)
            return RunResult(EXIT_NOT_FOUND, "", f"{argv[0]}: not found", missing=True)
        except PermissionError as e:
            return RunResult(EXIT_NOT_EXECUTABLE, "", f"{argv[0]}: {e.strerror}")
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else ""
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else ""
            logger.warning("%s: timed out after %.0f s", " ".join(argv), timeout)
            return RunResult(EXIT_TIMED_OUT, out, err, timed_out=True)
        except OSError as e:
            # ENOEXEC (a script without #!) and friends: it exists but cannot run.
            return RunResult(EXIT_NOT_EXECUTABLE, "", f"{argv[0]}: {e.strerror or e}")
        return RunResult(done.returncode, done.stdout, done.stderr)
