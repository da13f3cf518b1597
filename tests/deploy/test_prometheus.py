"""deploy/prometheus/ (issue 14): promtool accepts the scrape config and the rules, the
rules' unit tests pass and cover every alert firing and not firing, and the dashboard
and the rules name only metric families docs/metrics.md lists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from helpers import REPO, documented_metrics, require
from ruamel.yaml import YAML

from llmgw.cp._fleet._fleet_metrics import DOCS

DEPLOY = REPO / "deploy" / "prometheus"
METRIC = re.compile(r"\bllmgw_[a-z0-9_]+")
SUFFIXES = ("_bucket", "_sum", "_count")


def promtool(*args: str) -> str:
    tool = shutil.which("promtool")
    require(tool is not None, "promtool (Debian's prometheus package) is not installed")
    assert tool is not None
    res = subprocess.run([tool, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"promtool {' '.join(args)}: {res.stdout}{res.stderr}"
    return res.stdout + res.stderr


def load(name: str) -> Any:
    return YAML(typ="safe").load((DEPLOY / name).read_text())


def families(expr: str) -> set[str]:
    out = set()
    for name in METRIC.findall(expr):
        for suffix in SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in documented_metrics():
                name = name.removesuffix(suffix)
        out.add(name)
    return out


def alerts() -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in load("alerts.yml")["groups"] for r in g["rules"]}


def test_promtool_accepts_the_scrape_config_and_the_rules() -> None:
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    out = promtool("check", "rules", "alerts.yml")
    assert f"SUCCESS: {len(alerts())} rules found" in out
    assert len(alerts()) == 6


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    cases: dict[str, set[bool]] = {}
    for test in load("alerts_test.yml")["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    assert {name: cases.get(name, set()) for name in alerts()} == {
        name: {True, False} for name in alerts()
    }


def test_rules_and_dashboard_name_only_documented_families() -> None:
    known = documented_metrics()
    assert set(DOCS) <= known, f"undocumented fleet families: {sorted(set(DOCS) - known)}"
    for name, expr in alerts().items():
        assert families(expr) <= known, f"alert {name}: {sorted(families(expr) - known)}"
        assert families(expr), f"alert {name} names no llmgw family: {expr}"
    dash = json.loads((DEPLOY / "grafana.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        assert families(expr) <= known, f"dashboard: {expr}: {sorted(families(expr) - known)}"
    shown = set().union(*(families(e) for e in exprs))
    assert set(DOCS) <= shown, f"fleet families the dashboard leaves out: {set(DOCS) - shown}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_the_scrape_config_has_one_target_for_the_fleet() -> None:
    cfg = load("prometheus.yml")
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert [t for s in job["static_configs"] for t in s["targets"]] == ["127.0.0.1:8081"]
    assert cfg["rule_files"] == ["alerts.yml"]
    assert Path(DEPLOY / "alerts.yml").is_file()
