"""configs/grafana-dashboard.json: a Grafana 10 dashboard whose every query names metrics the coordinator
registers (daemon/metrics.py), filtered only by labels those metrics have. The integration run in
tests/integration/test_recovery.py checks the same names against a real coordinator's /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from daemon import metrics

DASHBOARD = Path(__file__).parents[2] / "configs" / "grafana-dashboard.json"
# A metric name, and the label matchers right after it, if any.
SELECTOR = re.compile(r"\b(trainerd_[a-z_]+)(\{([^}]*)\})?")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_metric_names(data: dict) -> set[str]:
    """Every trainerd metric name the dashboard's queries use (with the suffix of the series they read)."""
    return {match.group(1) for panel in data["panels"] for target in panel["targets"]
            for match in SELECTOR.finditer(target["expr"])}


def exported_series_names() -> dict[str, frozenset[str]]:
    """Series name -> label names, for every metric daemon/metrics.py registers."""
    names: dict[str, frozenset[str]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for suffix in SUFFIXES[metric._type]:
                names[metric._name + suffix] = frozenset(metric._labelnames)
    return names


def test_it_is_a_grafana_10_dashboard_on_a_prometheus_data_source_variable() -> None:
    data = dashboard()
    assert 37 <= data["schemaVersion"] <= 39 and data["uid"] and data["title"]
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job_name"]["datasource"]["uid"] == "${datasource}"
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"], panel["title"]


def test_every_query_names_metrics_the_coordinator_exports_with_labels_they_have() -> None:
    data = dashboard()
    exported = exported_series_names()
    assert "trainerd_job_phase_seconds_total" in exported and "trainerd_recovery_phase_seconds_bucket" in exported
    for panel in data["panels"]:
        for target in panel["targets"]:
            for match in SELECTOR.finditer(target["expr"]):
                name, matchers = match.group(1), match.group(3) or ""
                assert name in exported, f"panel {panel['title']!r} reads {name}, which nothing exports"
                labels = {m.split("=")[0].strip(" !~") for m in matchers.split(",") if m.strip()}
                assert labels <= exported[name], f"panel {panel['title']!r} filters {name} by {labels}"
            read = [exported[match.group(1)] for match in SELECTOR.finditer(target["expr"])]
            for grouping in re.findall(r"by \(([^)]*)\)", target["expr"]):
                labels = {label.strip() for label in grouping.split(",")}
                assert any(labels <= have for have in read), f"panel {panel['title']!r} groups by {labels}"


def test_it_shows_goodput_the_phases_recoveries_step_time_and_loss() -> None:
    used = dashboard_metric_names(dashboard())
    assert {"trainerd_job_goodput_ratio", "trainerd_job_phase_seconds_total", "trainerd_job_restarts_total",
            "trainerd_job_step_seconds", "trainerd_job_loss"} <= used
