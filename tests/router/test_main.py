"""Router-only mode as a real process: router.yaml, serving, metrics, keys CLI, SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from helpers import start_router

from llmgw.errors import ConfigError
from llmgw.router._main import main, parse
from llmgw.testing.cluster import free_port, wait_for
from router.conftest import FakeEngine, sample


def test_config_errors_name_their_paths() -> None:
    with pytest.raises(ConfigError) as err:
        parse(
            {
                "listen": "nowhere",
                "endpoints": [{"model": "m", "engine": "tgi", "url": "ftp://x"}],
                "keys": [{"key": "k", "tenant": "t", "default_band": "urgent"}],
                "retries": "many",
                "bogus": 1,
            },
            "router.yaml",
        )
    lines = str(err.value).splitlines()
    assert "router.yaml: listen: not a host:port (got 'nowhere')" in lines
    assert "router.yaml: bogus: unknown key" in lines
    assert "router.yaml: retries: expected an integer, got 'many'" in lines
    # Once the shape is right, the values are checked too, all at once.
    with pytest.raises(ConfigError) as err:
        parse(
            {
                "endpoints": [{"model": "m", "engine": "tgi", "url": "ftp://x"}],
                "keys": [{"key": "k", "tenant": "t", "default_band": "urgent"}],
            },
            "router.yaml",
        )
    lines = str(err.value).splitlines()
    assert any(line.startswith("router.yaml: endpoints[0].engine: 'tgi'") for line in lines)
    assert any(line.startswith("router.yaml: endpoints[0].url: expected http://") for line in lines)
    assert any("keys[0].default_band: no band 'urgent'" in line for line in lines)

    with pytest.raises(ConfigError, match="keys or keys_db"):
        parse({"endpoints": []}, "router.yaml")
    _file_cfg, router_cfg, endpoints = parse(
        {
            "endpoints": [{"model": "m", "engine": "vllm", "url": "http://10.0.0.5:8000"}],
            "keys_db": "/tmp/k.db",
            "bands": [{"name": "only", "rank": 0, "queue_timeout_s": 5}],
            "idle_timeout_s": 2,
        },
        "router.yaml",
    )
    assert endpoints[0].endpoint_id == "m@10.0.0.5:8000"
    assert (endpoints[0].host, endpoints[0].port) == ("10.0.0.5", 8000)
    assert router_cfg.idle_timeout_s == 2.0
    assert [b.name for b in router_cfg.bands] == ["only"]


def test_router_only_process_serves_and_stops_on_sigterm(
    tmp_path: Path, start_engine: Callable[..., FakeEngine]
) -> None:
    fe = start_engine("chat", env={"LLMGW_FAKE_TOKENS": "2"})
    db = tmp_path / "keys.db"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw.router",
            "keys",
            "--db",
            str(db),
            "create",
            "--tenant",
            "t1",
            "--model",
            "chat",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    key_id, secret = out.stdout.split()
    assert secret.startswith("llmgw-")
    port, metrics_port = free_port(), free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f"metrics_listen: 127.0.0.1:{metrics_port}\n"
        f"endpoints:\n  - {{model: chat, engine: vllm, url: 'http://127.0.0.1:{fe.port}'}}\n"
        f"keys:\n  - {{key: llmgw-static-one, tenant: t0}}\n"
        f"keys_db: {db}\n"
        "scrape_interval_s: 0.2\n"
    )
    log = tmp_path / "router.log"
    proc = start_router(cfg, log)
    try:
        wait_for("router", lambda: "router listening" in log.read_text(), timeout=60, interval=0.1)
        base = f"http://127.0.0.1:{port}/v1"
        for key in (secret, "llmgw-static-one"):
            with openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=20) as c:
                answer = c.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}]
                )
                assert answer.choices[0].message.content == "tok0 tok1"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

        def scraped() -> str | None:
            text = httpx.get(metrics_url, timeout=5).text
            running = sample(text, "llmgw_router_endpoint_running_requests", model="chat")
            return text if running is not None else None

        text = wait_for("engine load in metrics", scraped, timeout=10)
        assert sample(text, "llmgw_router_requests_total", model="chat", status="200") == 2.0
        assert sample(text, "llmgw_router_endpoint_kv_cache_usage_ratio", model="chat") == 0.0
        # As from llmgw-cp: no `_created` series beside the counters (docs/metrics.md).
        assert "_created" not in text

        revoked = subprocess.run(
            [sys.executable, "-m", "llmgw.router", "keys", "--db", str(db), "revoke", key_id],
            capture_output=True,
            text=True,
        )
        assert revoked.returncode == 0
        listing = subprocess.run(
            [sys.executable, "-m", "llmgw.router", "keys", "--db", str(db), "list"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"{key_id}\tt1\tchat\tinteractive\tinteractive\trevoked" in listing
        assert secret not in listing
    finally:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
    assert rc == 0, log.read_text()
    assert time.monotonic() - start < 5


def test_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("endpoints: {}\n")
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "endpoints: expected a list" in err
