"""OS packages (an engine's, PostgreSQL's), from the machine's own package manager.

- `family(os_id, os_like)` is pure: os-release's ID and ID_LIKE (as
  discovery reads them, `model.Host.os_id` / `os_like`) to "debian", "rhel",
  "suse" or None (unknown: nothing is installed). ID decides when it is
  known; otherwise the first ID_LIKE entry that is.
- `MANAGERS`: the command per family (the package names follow it):
  debian `apt-get install -y --no-install-recommends` (with
  DEBIAN_FRONTEND=noninteractive), rhel `dnf install -y` (`yum install -y`
  where there is no dnf), suse `zypper --non-interactive install`.
- `PackageInstaller(family).install(packages, on_wait=)` runs it once per
  attempt, each bounded by `timeout_s` (its process group is killed past it).
  A failure whose output says only that another process holds the package
  lock (apt/dpkg's lock-frontend, lock or lists lock; dnf/yum's "Waiting for
  process with pid", "another copy is running", "Another app is currently
  holding the yum lock"; zypper's "System management is locked") calls
  `on_wait("waiting for another apt-get to finish")` once, when the waiting
  starts, and is retried every `retry_s`, until `lock_wait_s`
  has passed by `clock`: then `PackageError` "apt-get: the package lock was
  held for 10 min". Any other failure is `PackageError` with the manager's
  last meaningful line (apt's last `E:` line, dnf's last `Error:` line, else
  the last line). Not root: `PackageError` "installing libgomp1 needs root;
  run: apt-get install libgomp1", before anything is run. No manager on PATH:
  `PackageError` naming it.
- `env` is the environment the manager runs with and is looked up in (None:
  the agent's); the family's variables (DEBIAN_FRONTEND) are added to it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence

import trio

from llmgw.errors import LlmgwError
from llmgw.host.run import run_bounded

__all__ = [
    "FAMILIES",
    "MANAGERS",
    "MANAGER_ENV",
    "PackageError",
    "PackageInstaller",
    "family",
    "last_meaningful_line",
    "only_lock",
]

# The agent's logger name still: moving the module here changed no log line.
log = logging.getLogger("llmgw.agent.packages")

FAMILIES = ("debian", "rhel", "suse")

# The command before the package names; for rhel, the first one on PATH.
MANAGERS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "debian": (("apt-get", "install", "-y", "--no-install-recommends"),),
    "rhel": (("dnf", "install", "-y"), ("yum", "install", "-y")),
    "suse": (("zypper", "--non-interactive", "install"),),
}
MANAGER_ENV: Mapping[str, Mapping[str, str]] = {
    "debian": {"DEBIAN_FRONTEND": "noninteractive"},
    "rhel": {},
    "suse": {},
}

_DEBIAN_IDS = frozenset({"debian", "ubuntu", "raspbian", "linuxmint", "pop", "kali", "devuan"})
_RHEL_IDS = frozenset(
    {"rhel", "fedora", "centos", "rocky", "almalinux", "amzn", "ol", "scientific", "cloudlinux"}
)
_SUSE_IDS = frozenset({"sles", "sled", "suse", "sle-micro", "sle_hpc"})

_LOCK_LINES = {
    "debian": re.compile(
        r"Could not get lock /var/lib/(?:dpkg/lock(?:-frontend)?|apt/lists/lock)"
        r"|Unable to acquire the dpkg frontend lock"
        r"|Unable to lock the administration directory \(/var/lib/dpkg/\)"
        r"|Unable to lock directory /var/lib/apt/lists/"
    ),
    "rhel": re.compile(
        r"Waiting for process with pid|another copy is running"
        r"|Another app is currently holding the yum lock"
    ),
    "suse": re.compile(r"System management is locked by the application with pid"),
}
_ERROR_LINE = re.compile(r"^(?:E:|Error:|ERROR:)")


class PackageError(LlmgwError):
    """An OS package could not be installed; one line naming the manager and why."""


def _one(name: str) -> str | None:
    name = name.strip().lower()
    if name in _DEBIAN_IDS:
        return "debian"
    if name in _RHEL_IDS:
        return "rhel"
    if name in _SUSE_IDS or name.startswith(("opensuse", "sles", "sle-")):
        return "suse"
    return None


def family(os_id: str | None, os_like: Sequence[str]) -> str | None:
    """The package family of a node from os-release's ID and ID_LIKE; None when unknown."""
    for name in (os_id or "", *os_like):
        if (found := _one(name)) is not None:
            return found
    return None


def only_lock(family: str, output: str) -> bool:
    """Whether a failed run's output says nothing but that the package lock is held."""
    pattern = _LOCK_LINES.get(family)
    if pattern is None:
        return False
    if family == "debian":
        errors = [line for line in output.splitlines() if line.startswith("E:")]
        return bool(errors) and all(pattern.search(line) for line in errors)
    return pattern.search(output) is not None


def last_meaningful_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "no output"


def _stale_lists(family: str, output: str) -> bool:
    """Whether apt-get failed for want of package lists (never updated on this image)."""
    return family == "debian" and (
        "Unable to locate package" in output or "has no installation candidate" in output
    )


def _duration(seconds: float) -> str:
    if seconds >= 60 and math.isclose(seconds % 60, 0, abs_tol=1e-6):
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


class PackageInstaller:
    """Installs packages with one family's manager; see the module."""

    def __init__(
        self,
        family: str,
        *,
        lock_wait_s: float = 600,
        retry_s: float = 5,
        timeout_s: float = 900,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = trio.current_time,
        euid: Callable[[], int] = os.geteuid,
    ) -> None:
        if family not in MANAGERS:
            raise ValueError(f"unknown package family {family!r}; known: {', '.join(FAMILIES)}")
        self.family = family
        self.lock_wait_s = lock_wait_s
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self._env = dict(os.environ if env is None else env)
        self._env.update(MANAGER_ENV[family])
        self._clock = clock
        self._euid = euid
        self.attempts = 0

    def __repr__(self) -> str:
        return f"<PackageInstaller {self.family} attempts={self.attempts}>"

    def _command(self) -> tuple[str, ...] | None:
        for command in MANAGERS[self.family]:
            found = shutil.which(command[0], path=self._env.get("PATH", os.defpath))
            if found is not None:
                return (found, *command[1:])
        return None

    async def install(
        self, packages: Sequence[str], *, on_wait: Callable[[str], None] = lambda s: None
    ) -> None:
        """Install `packages` (a no-op when empty); PackageError with one line otherwise."""
        if not packages:
            return
        names = " ".join(packages)
        command = self._command()
        tool = os.path.basename(command[0]) if command else MANAGERS[self.family][0][0]
        if self._euid() != 0:
            raise PackageError(f"installing {names} needs root; run: {tool} install {names}")
        if command is None:
            wanted = " or ".join(c[0] for c in MANAGERS[self.family])
            raise PackageError(f"installing {names} needs {wanted}, which is not on PATH")
        argv = [*command, *packages]
        waiting_since: float | None = None
        updated = False
        while True:
            self.attempts += 1
            status, output = await self._run(argv)
            if status == 0:
                return
            shown = f"{tool} install {names}"
            if status is None:
                raise PackageError(f"{shown} did not finish within {_duration(self.timeout_s)}")
            if not only_lock(self.family, output):
                if not updated and _stale_lists(self.family, output):
                    # A fresh image ships no package lists: apt-get cannot find anything
                    # until `apt-get update` has run. Once, then the install again.
                    updated = True
                    on_wait(f"{tool} knows no such package: running {tool} update")
                    up_status, up_output = await self._run([command[0], "update"])
                    if up_status == 0:
                        continue
                    raise PackageError(
                        f"{shown} exited {status}: {last_meaningful_line(output)}; "
                        f"{tool} update did not help: {last_meaningful_line(up_output)}"
                    )
                raise PackageError(f"{shown} exited {status}: {last_meaningful_line(output)}")
            now = self._clock()
            if waiting_since is None:
                waiting_since = now
                on_wait(f"waiting for another {tool} to finish")
                log.info("%s: the package lock is held; retrying every %s s", shown, self.retry_s)
            if now - waiting_since >= self.lock_wait_s:
                raise PackageError(
                    f"{tool}: the package lock was held for {_duration(self.lock_wait_s)}"
                )
            await trio.sleep(self.retry_s)

    async def _run(self, argv: list[str]) -> tuple[int | None, str]:
        try:
            # The tail: a package manager's last lines say why it failed.
            return await run_bounded(argv, self.timeout_s, env=self._env, keep="tail")
        except OSError as exc:
            raise PackageError(f"{argv[0]} could not be run: {exc.strerror or exc}") from None
