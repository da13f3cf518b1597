from __future__ import annotations

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
    assert agent.fabrics["ib-a"].adapters == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert agent.fabrics["ib-a"].interface == "ib0"
    assert agent.model_dirs == [Path("/models")]


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
    assert str(info.value).splitlines() == [
        "a.yaml: servers[0]: not a host:port (got 'x')",
        "a.yaml: tls: expected a mapping, got 3",
        "a.yaml: bogus: unknown key",
    ] or sorted(str(info.value).splitlines()) == sorted(
        [
            "a.yaml: servers[0]: not a host:port (got 'x')",
            "a.yaml: tls: expected a mapping, got 3",
            "a.yaml: bogus: unknown key",
        ]
    )


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


def test_missing_tls_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        f"servers: [127.0.0.1:1]\ntls: {{ca: {tmp_path}/nope.crt, cert: {tmp_path}/a, key: {tmp_path}/b}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "llmgw.agent", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "nope.crt" in done.stderr and "Traceback" not in done.stderr
