from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import config
from llmgw.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_example_configs_load() -> None:
    server = config.load(REPO / "deploy/examples/server.yaml", config.ServerConfig)
    assert server.rpc_listen == "0.0.0.0:7070"
    assert server.tls.ca == Path("/etc/llmgw/pki/ca.crt")
    assert server.lost_after_s == 60.0
    agent = config.load(REPO / "deploy/examples/agent.yaml", config.AgentConfig)
    assert agent.addresses == [("cp1.example.net", 7070), ("cp2.example.net", 7070)]
    rails = ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    assert agent.fabrics["ib-a"].adapters == rails  # a recorded H100 node's (tests/deploy)
    assert agent.fabrics["ib-a"].interface == "ib0"
    assert agent.model_dirs == [Path("/models")]
    assert agent.weights_dir == Path("/var/lib/llmgw-weights")
    assert agent.max_concurrent_fetches == 2


def test_server_key_is_tried_first_and_not_twice() -> None:
    agent = config.structure(
        {"server": "b:2", "servers": ["a:1", "b:2"], "tls": {"ca": "c", "cert": "d", "key": "e"}},
        config.AgentConfig,
        "agent.yaml",
    )
    assert agent.addresses == [("b", 2), ("a", 1)]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"servers": ["a:1", "cp1"]}, "agent.yaml: servers[1]: not a host:port (got 'cp1')"),
        ({"servers": ["a:1"], "heartbeat": 5}, "agent.yaml: heartbeat: unknown key"),
        (
            {"servers": ["a:1"], "fetch_dir": "/var/lib/w"},
            "agent.yaml: fetch_dir: renamed weights_dir: where fetched weights live",
        ),
        (
            {"servers": ["a:1"], "max_concurrent_fetches": 0},
            "agent.yaml: max_concurrent_fetches: must be ≥ 1 and ≤ 64 (got 0)",
        ),
        (
            {"servers": ["a:1"], "reconnect_max_s": "soon"},
            "agent.yaml: reconnect_max_s: expected a number, got 'soon'",
        ),
        ({"servers": "a:1"}, "agent.yaml: servers: expected a list, got 'a:1'"),
        (
            {"servers": ["a:1"], "fabrics": {"ib-a": {"adapters": [1]}}},
            "agent.yaml: fabrics['ib-a'].adapters[0]: expected a string, got 1",
        ),
        (
            {"servers": ["[::1]:70000"]},
            "agent.yaml: servers[0]: not a host:port (got '[::1]:70000')",
        ),
    ],
)
def test_each_error_names_its_path(body: dict, expected: str) -> None:
    body = {"tls": {"ca": "c", "cert": "d", "key": "e"}, **body}
    with pytest.raises(ConfigError) as info:
        config.structure(body, config.AgentConfig, "agent.yaml")
    assert str(info.value) == expected


def test_every_problem_is_reported_not_only_the_first() -> None:
    with pytest.raises(ConfigError) as info:
        config.structure({"tls": 3, "bogus": 1, "servers": ["x"]}, config.AgentConfig, "a.yaml")
    assert sorted(str(info.value).splitlines()) == [
        "a.yaml: bogus: unknown key",
        "a.yaml: servers[0]: not a host:port (got 'x')",
        "a.yaml: tls: expected a mapping, got 3",
    ]


@pytest.mark.parametrize(
    ("command", "text", "expected"),
    [
        (
            "llmgw.agent",
            "servers: [a:1]\ntls: {ca: a, cert: b, key: c}\nnode: x\n",
            "node: unknown key",
        ),
        (
            "llmgw.agent",
            "servers: [a:1]\ntls: {ca: a, cert: b, key: c}\nreconnect_max_s: [1]\n",
            "reconnect_max_s: expected a number, got a list",
        ),
        (
            "llmgw.cp",
            "tls: {ca: a, cert: b, key: c}\nmissed_heartbeats: three\n",
            "missed_heartbeats: expected an integer, got 'three'",
        ),
        (
            "llmgw.cp",
            "tls: {ca: a, cert: b, key: c}\nrpc_listen: {}\n",
            "rpc_listen: expected host:port, got a mapping",
        ),
        ("llmgw.cp", "tls: [\n", "not valid YAML"),
    ],
)
def test_processes_refuse_bad_config_in_one_line_exit_2(
    tmp_path: Path, command: str, text: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", command, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(path) in lines[0] and expected in lines[0]


# Bounds -------------------------------------------------------------------------

TLS = {"ca": "c", "cert": "d", "key": "e"}


def _error(body: dict, cls: type, source: str = "x.yaml") -> list[str]:
    with pytest.raises(ConfigError) as info:
        config.structure({"tls": TLS, **body}, cls, source)
    return str(info.value).splitlines()


def test_between_says_the_bounds_and_the_value() -> None:
    b = config.between(0, 300, exclusive_low=True)
    assert b.problem(-1) == "must be > 0 and ≤ 300 (got -1)"
    assert b.problem(0.0) == "must be > 0 and ≤ 300 (got 0)"
    assert b.problem(300.5) == "must be > 0 and ≤ 300 (got 300.5)"
    assert b.problem(float("inf")) == "must be > 0 and ≤ 300 (got inf)"
    assert b.problem(float("nan")) == "must be > 0 and ≤ 300 (got nan)"
    assert [b.problem(v) for v in (0.001, 1, 300)] == [None, None, None]
    assert b.problem(None) is None  # unknown or "never": not this validator's business
    assert config.between(0.1).problem(0.05) == "must be ≥ 0.1 (got 0.05)"
    assert config.between(high=10).problem(11) == "must be ≤ 10 (got 11)"
    assert config.between(1).problem(1) is None  # the low bound is inclusive unless told
    assert config.positive().problem(0) == "must be > 0 (got 0)"
    with pytest.raises(ValueError, match="low or a high"):
        config.between()


def test_between_as_an_attrs_validator_names_the_key() -> None:
    import attrs

    @attrs.define(kw_only=True)
    class Thing:
        every_s: float = attrs.field(default=1.0, validator=config.positive(60))

    with pytest.raises(config.BoundError) as info:
        Thing(every_s=-1)
    assert (info.value.key, info.value.message) == ("every_s", "must be > 0 and ≤ 60 (got -1)")
    assert str(info.value) == "every_s: must be > 0 and ≤ 60 (got -1)"
    # Through the loader the key path and the file come first.
    with pytest.raises(ConfigError, match=r"^t\.yaml: every_s: must be > 0 and ≤ 60 \(got 61\)$"):
        config.structure({"every_s": 61}, Thing, "t.yaml")


@pytest.mark.parametrize(
    ("cls", "key", "value", "message"),
    [
        (config.ServerConfig, "heartbeat_interval_s", -1, "must be > 0 and ≤ 300 (got -1)"),
        (config.ServerConfig, "heartbeat_interval_s", 301, "must be > 0 and ≤ 300 (got 301)"),
        (config.ServerConfig, "missed_heartbeats", 0, "must be ≥ 1 and ≤ 1000 (got 0)"),
        (config.ServerConfig, "lost_after_s", -5, "must be > 0 and ≤ 604800 (got -5)"),
        (config.ServerConfig, "reconcile_interval_s", 0, "must be ≥ 0.1 and ≤ 300 (got 0)"),
        (config.ServerConfig, "reconcile_settle_s", -1, "must be ≥ 0 and ≤ 3600 (got -1)"),
        (config.ServerConfig, "stop_grace_s", -1, "must be > 0 and ≤ 3600 (got -1)"),
        (config.AgentConfig, "reconnect_initial_s", 0, "must be > 0 and ≤ 60 (got 0)"),
        (config.AgentConfig, "reconnect_max_s", -1, "must be > 0 and ≤ 3600 (got -1)"),
        (config.AgentConfig, "stop_grace_s", -0.5, "must be > 0 and ≤ 3600 (got -0.5)"),
        (config.AgentConfig, "sample_interval_s", 0, "must be ≥ 0.1 and ≤ 3600 (got 0)"),
        (config.AgentConfig, "sample_interval_s", 0.01, "must be ≥ 0.1 and ≤ 3600 (got 0.01)"),
    ],
)
def test_each_bound_is_one_line_with_its_key(
    cls: type, key: str, value: float, message: str
) -> None:
    body = {key: value, "servers": ["a:1"]} if cls is config.AgentConfig else {key: value}
    assert _error(body, cls) == [f"x.yaml: {key}: {message}"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([9000, 8000], "must be [first, last] ports, 0 < first ≤ last < 65536 (got [9000, 8000])"),
        ([0, 10], "must be [first, last] ports, 0 < first ≤ last < 65536 (got [0, 10])"),
        (
            [8100, 65536],
            "must be [first, last] ports, 0 < first ≤ last < 65536 (got [8100, 65536])",
        ),
    ],
)
def test_engine_ports_is_a_range_of_ports(value: list[int], message: str) -> None:
    assert _error({"engine_ports": value}, config.ServerConfig) == [
        f"x.yaml: engine_ports: {message}"
    ]
    assert _error({"engine_ports": [8100]}, config.ServerConfig)[0].startswith(
        "x.yaml: engine_ports"
    )


def test_read_yaml_names_the_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "server.yaml"
    bad.write_text("store: null\nmodels: [a\n  b: c\n")
    with pytest.raises(ConfigError) as info:
        config.read_yaml(bad)
    assert re.fullmatch(
        rf"{re.escape(str(bad))}: line \d+ column \d+: not valid YAML: .+", str(info.value)
    )


def test_reconnect_max_below_initial_is_refused() -> None:
    lines = _error({"reconnect_initial_s": 2, "reconnect_max_s": 1}, config.AgentConfig)
    assert lines == ["x.yaml: reconnect_max_s: must be ≥ reconnect_initial_s (2) (got 1)"]


def test_every_bound_problem_is_reported_at_once_with_type_errors() -> None:
    lines = _error(
        {
            "heartbeat_interval_s": -1,
            "reconcile_interval_s": 0,
            "missed_heartbeats": "three",
            "bogus": 1,
        },
        config.ServerConfig,
    )
    assert sorted(lines) == [
        "x.yaml: bogus: unknown key",
        "x.yaml: heartbeat_interval_s: must be > 0 and ≤ 300 (got -1)",
        "x.yaml: missed_heartbeats: expected an integer, got 'three'",
        "x.yaml: reconcile_interval_s: must be ≥ 0.1 and ≤ 300 (got 0)",
    ]


def test_a_nested_section_names_its_whole_path() -> None:
    from llmgw.router import RouterConfig

    with pytest.raises(ConfigError) as info:
        config.structure(
            {"connect_timeout_s": 0, "idle_timeout_s": 7200, "retries": -1},
            RouterConfig,
            "server.yaml",
            at="router",
        )
    assert sorted(str(info.value).splitlines()) == [
        "server.yaml: router.connect_timeout_s: must be > 0 and ≤ 300 (got 0)",
        "server.yaml: router.idle_timeout_s: must be > 0 and ≤ 3600 (got 7200)",
        "server.yaml: router.retries: must be ≥ 0 (got -1)",
    ]
    with pytest.raises(ConfigError, match=r"^server\.yaml: router: expected a mapping, got 3$"):
        config.structure(3, RouterConfig, "server.yaml", at="router")


def test_defaults_and_examples_are_within_bounds() -> None:
    from llmgw.router import RouterConfig

    # attrs validates defaults too: constructing with none given proves them.
    config.structure({"tls": TLS}, config.ServerConfig, "s.yaml")
    config.structure({"tls": TLS}, config.AgentConfig, "a.yaml")
    RouterConfig()
    assert (
        config.structure(
            {"tls": TLS, "forget_after_s": None}, config.ServerConfig, "s"
        ).forget_after_s
        is None
    )


def test_every_interval_and_timeout_has_bounds() -> None:
    """A key in seconds (`*_s`) or a count of tries without a Between validator is a defect:
    this is the test that makes a new key come with its bounds."""
    import attrs

    from llmgw.router import RouterConfig

    numbers = ("int", "float", "int | None", "float | None")
    fields = [
        (f"{cls.__name__}.{a.name}", a)
        for cls in (config.AgentConfig, config.ServerConfig, RouterConfig)
        for a in attrs.fields(cls)
    ]
    seconds = [name for name, a in fields if name.endswith("_s")]
    assert len(seconds) > 15  # the check sees the keys
    assert [
        name for name, a in fields if name.endswith("_s") and not config._bounds(a.validator)
    ] == []
    assert [name for name, a in fields if a.type in numbers and a.validator is None] == []


# Through the real processes -------------------------------------------------------

TLS_YAML = "tls: {ca: /nonexistent/ca.crt, cert: /nonexistent/c.crt, key: /nonexistent/c.key}\n"
BROKEN = [
    (
        "llmgw-cp",
        "heartbeat_interval_s: -1",
        "heartbeat_interval_s: must be > 0 and ≤ 300 (got -1)",
    ),
    (
        "llmgw-cp",
        "reconcile_interval_s: 0",
        "reconcile_interval_s: must be ≥ 0.1 and ≤ 300 (got 0)",
    ),
    ("llmgw-cp", "stop_grace_s: -3", "stop_grace_s: must be > 0 and ≤ 3600 (got -3)"),
    ("llmgw-cp", "lost_after_s: -1", "lost_after_s: must be > 0 and ≤ 604800 (got -1)"),
    ("llmgw-cp", "missed_heartbeats: 0", "missed_heartbeats: must be ≥ 1 and ≤ 1000 (got 0)"),
    ("llmgw-cp", "reconcile_settle_s: -1", "reconcile_settle_s: must be ≥ 0 and ≤ 3600 (got -1)"),
    (
        "llmgw-cp",
        "router: {connect_timeout_s: -1}",
        "router.connect_timeout_s: must be > 0 and ≤ 300 (got -1)",
    ),
    ("llmgw-agent", "reconnect_max_s: -1", "reconnect_max_s: must be > 0 and ≤ 3600 (got -1)"),
    ("llmgw-agent", "reconnect_initial_s: 0", "reconnect_initial_s: must be > 0 and ≤ 60 (got 0)"),
    ("llmgw-agent", "sample_interval_s: 0", "sample_interval_s: must be ≥ 0.1 and ≤ 3600 (got 0)"),
    ("llmgw-agent", "stop_grace_s: -1", "stop_grace_s: must be > 0 and ≤ 3600 (got -1)"),
]


def _entry_point(name: str) -> list[str]:
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", {"llmgw-cp": "llmgw.cp", "llmgw-agent": "llmgw.agent"}[name]]


def _run(name: str, path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    import time

    start = time.monotonic()
    done = subprocess.run(
        [*_entry_point(name), "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, time.monotonic() - start


def _main(name: str, path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """`name --config path` by its entry point's main() in this process, as `_run` would
    see it: the exit code main() returns (what the script exits with), its stdout and
    stderr. Each entry point still runs as a real process in the tests above and in
    test_missing_tls_file_is_named_by_its_key; a Python per refused value (0.7 s of CPU
    each on the suite's two cores) adds nothing to what these check: the value's message."""
    import contextlib
    import io
    import logging
    import time

    from llmgw.agent import main as agent_main
    from llmgw.cp import main as cp_main

    main = {"llmgw-cp": cp_main, "llmgw-agent": agent_main}[name]

    def started(*_: object) -> int:
        raise AssertionError(f"{name} accepted {path} and started its service")

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # main() sets up logging
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    try:
        with (
            pytest.MonkeyPatch.context() as patch,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            # A config main() accepted would serve for ever: fail instead.
            patch.setitem(main.__globals__, "run_service", started)
            rc = main(["--config", str(path)])
    finally:
        root.handlers[:], root.level = handlers, level
    took = time.monotonic() - start
    argv = [name, "--config", str(path)]
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue()), took


# A refusal comes at once, before any retry or backoff; the bound is generous because a
# loaded 2-core machine takes seconds just to start Python and import llmgw.
REFUSED_WITHIN_S = 30.0


@pytest.mark.parametrize(("command", "line", "expected"), BROKEN, ids=[b[1] for b in BROKEN])
def test_broken_values_stop_the_process_in_one_line(
    tmp_path: Path, command: str, line: str, expected: str
) -> None:
    name = "server.yaml" if command == "llmgw-cp" else "agent.yaml"
    path = tmp_path / name
    servers = "servers: [127.0.0.1:1]\n" if command == "llmgw-agent" else ""
    path.write_text(f"{servers}{TLS_YAML}{line}\n")
    done, took = _main(command, path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"{command}: {path}: {expected}"]
    assert "Traceback" not in done.stderr + done.stdout
    assert took < REFUSED_WITHIN_S, f"{command} took {took:.1f} s to refuse its config"


@pytest.mark.parametrize("command", ["llmgw-cp", "llmgw-agent"])
def test_missing_tls_file_is_named_by_its_key(tmp_path: Path, command: str) -> None:
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "node.key").write_text("x")
    path = tmp_path / ("server.yaml" if command == "llmgw-cp" else "agent.yaml")
    servers = "servers: [127.0.0.1:1]\n" if command == "llmgw-agent" else ""
    path.write_text(
        f"{servers}state_dir: {tmp_path / 'state'}\n"
        f"tls: {{ca: {tmp_path}/ca.crt, cert: {tmp_path}/nope.crt, key: {tmp_path}/node.key}}\n"
    )
    done, took = _run(command, path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"{command}: {path}: tls.cert: no such file: {tmp_path}/nope.crt"
    ]
    assert took < REFUSED_WITHIN_S, took
    assert not (tmp_path / "state").exists()  # refused before anything was started or written


def test_check_tls_files_names_each_missing_key(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    tls = config.TlsFiles(ca=tmp_path / "ca", cert=tmp_path / "dir", key=tmp_path / "k")
    with pytest.raises(ConfigError) as info:
        config.check_tls_files(tls, "agent.yaml")
    assert str(info.value).splitlines() == [
        f"agent.yaml: tls.ca: no such file: {tmp_path}/ca",
        f"agent.yaml: tls.cert: a directory, not a file: {tmp_path}/dir",
        f"agent.yaml: tls.key: no such file: {tmp_path}/k",
    ]


# The weights mirror (`mirror:` in server.yaml) ----------------------------------------


def test_mirror_defaults_to_none_and_its_keys_are_checked() -> None:
    server = config.structure({"tls": TLS}, config.ServerConfig, "s.yaml")
    assert server.mirror == config.MirrorConfig(
        dir=None, listen=config.HostPort("0.0.0.0:8082"), tls=True
    )
    on = config.structure(
        {"tls": TLS, "mirror": {"dir": "/srv/w", "listen": "[::1]:9000", "tls": False}},
        config.ServerConfig,
        "s.yaml",
    )
    assert on.mirror == config.MirrorConfig(
        dir=Path("/srv/w"), listen=config.HostPort("[::1]:9000"), tls=False
    )
    body = {"mirror": {"dir": 3, "listen": "8082", "tls": "yes", "port": 8082}}
    assert sorted(_error(body, config.ServerConfig, "server.yaml")) == [
        "server.yaml: mirror.dir: expected a path, got 3",
        "server.yaml: mirror.listen: not a host:port (got '8082')",
        "server.yaml: mirror.port: unknown key",
        "server.yaml: mirror.tls: expected true or false, got 'yes'",
    ]
    assert _error({"mirror": "/srv/w"}, config.ServerConfig, "server.yaml") == [
        "server.yaml: mirror: expected a mapping, got '/srv/w'"
    ]


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_mirror_dir_that_is_not_a_directory_stops_llmgw_cp(tmp_path: Path, kind: str) -> None:
    for name in ("ca.crt", "server.crt", "server.key"):
        (tmp_path / name).write_text("x")
    target = tmp_path / "weights"
    if kind == "file":
        target.write_text("not a directory")
    path = tmp_path / "server.yaml"
    path.write_text(
        f"state_dir: {tmp_path / 'state'}\n"
        f"tls: {{ca: {tmp_path}/ca.crt, cert: {tmp_path}/server.crt, key: {tmp_path}/server.key}}\n"
        f"mirror: {{dir: {target}}}\n"
    )
    done, took = _main("llmgw-cp", path)
    assert done.returncode == 2, done.stderr
    problem = "no such directory" if kind == "missing" else "not a directory"
    assert done.stderr.strip().splitlines() == [
        f"llmgw-cp: {path}: mirror.dir: {problem}: {target}"
    ]
    assert "Traceback" not in done.stderr + done.stdout
    assert took < REFUSED_WITHIN_S, took
    assert not (tmp_path / "state").exists()  # refused before anything was started or written


def test_check_mirror_dir(tmp_path: Path) -> None:
    config.check_mirror_dir(config.MirrorConfig(), "s.yaml")  # no mirror: nothing to check
    config.check_mirror_dir(config.MirrorConfig(dir=tmp_path), "s.yaml")
    with pytest.raises(
        ConfigError, match=rf"^s.yaml: mirror.dir: no such directory: {tmp_path}/nope$"
    ):
        config.check_mirror_dir(config.MirrorConfig(dir=tmp_path / "nope"), "s.yaml")
