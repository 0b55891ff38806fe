"""configs/prometheus/alerts.yaml: rules promtool accepts, unit-tested by alerts_test.yaml (each alert fires on a
failing cluster and not on a healthy one), on metrics the coordinator registers, filtered and grouped only by
labels those metrics have. tests/integration/test_prometheus.py evaluates them against a live trainerd."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from daemon import metrics
from tests.daemon.test_grafana_dashboard import SELECTOR, exported_series_names

RULES_DIR = Path(__file__).parents[2] / "configs" / "prometheus"
ALERTS = RULES_DIR / "alerts.yaml"
ALERTS_TEST = RULES_DIR / "alerts_test.yaml"
# What issue 48 asked alerts for, by the alert that answers it.
REQUIRED = {"TrainerdJobNotRunning", "TrainerdLowGoodput", "TrainerdNodeLost", "TrainerdNoLeader",
            "TrainerdRestartBudgetNearlySpent", "TrainerdCheckpointStale"}


def promtool() -> str:
    """Debian's `prometheus` package ships it (.ci/run installs it); the rules are never left unchecked."""
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed (apt-get install prometheus)", pytrace=False)
    return found


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run([promtool(), "test", "rules", ALERTS_TEST.name], capture_output=True, text=True,
                            timeout=60, cwd=RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerts_asked_for_are_there_and_each_is_tested_firing_and_quiet() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)) and REQUIRED <= set(names)
    checks = [check for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"] for check in test["alert_rule_test"]]
    for name in names:
        mine = [check for check in checks if check["alertname"] == name]
        assert any(check["exp_alerts"] for check in mine), f"no test makes {name} fire"
        assert any(not check["exp_alerts"] for check in mine), f"no test shows {name} quiet"


def test_every_rule_reads_metrics_the_coordinator_exports_with_labels_they_have() -> None:
    exported = exported_series_names()
    for rule in rules():
        expr, name = rule["expr"], rule["alert"]
        read = []
        for match in SELECTOR.finditer(expr):
            metric, matchers = match.group(1), match.group(3) or ""
            assert metric in exported, f"{name} reads {metric}, which nothing exports"
            labels = {m.split("=")[0].strip(" !~") for m in matchers.split(",") if m.strip()}
            assert labels <= exported[metric], f"{name} filters {metric} by {labels}"
            read.append(exported[metric] | ({"le"} if metric.endswith("_bucket") else set()))
        assert read or "up{" in expr, f"{name} reads no trainerd metric"
        for grouping in re.findall(r"(?:by|on) \(([^)]*)\)", expr):
            labels = {label.strip() for label in grouping.split(",")}
            assert any(labels <= have for have in read), f"{name} groups or matches by {labels}"


def test_every_reason_a_message_is_dropped_for_is_exported_from_the_start() -> None:
    """TrainerdAgentMessagesDropped reads increase(): a reason's series born at its first drop hides that drop."""
    used = {reason for path in (RULES_DIR.parents[1] / "daemon").rglob("*.py")
            for reason in re.findall(r'AGENT_MESSAGES_DROPPED\.labels\("([a-z_]+)"\)', path.read_text())}
    assert used and used <= set(metrics.DROP_REASONS), used - set(metrics.DROP_REASONS)
