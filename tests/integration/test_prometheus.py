"""The real Prometheus (Debian's `prometheus` package) scrapes a live trainerd (embedded etcd, one agent, the
trainer stand-in of scripted_trainer.py, no MindSpore) and loads configs/prometheus/alerts.yaml. A worker is
killed once, so the restart and recovery series exist too. Then every panel query of
configs/grafana-dashboard.json and every vector selector of every rule returns at least one series (a
misspelt metric or label value evaluates to nothing, silently), and every rule evaluates without an error."""

from __future__ import annotations

import json
import re
import shutil
import signal
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from tests.daemon.test_grafana_dashboard import dashboard
from tests.daemon.test_prometheus_rules import ALERTS, rules
from tests.harness import Processes, processes_mentioning
from tests.integration.cluster_files import cluster_file
from tests.integration.test_recovery import job_of
from tests.ports import free_port, scheduler_port
from tests.waiting import wait_until

SCRIPTED_TRAINER = Path(__file__).with_name("scripted_trainer.py")
JOB = "scripted"
# Grafana's variables, as a dashboard showing the job would fill them in.
VARIABLES = {"$job_name": JOB, "$__rate_interval": "1m"}
# A metric selector with its label matchers, if any: what a rule reads.
SELECTOR = re.compile(r"\b(trainerd_[a-z_]+|up)\b(\{[^}]*\})?")


def query(prometheus: str, expr: str) -> list[dict]:
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        answer = json.load(response)
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def loaded_rules(prometheus: str) -> list[dict]:
    with urllib.request.urlopen(f"http://{prometheus}/api/v1/rules", timeout=10) as response:
        return [rule for group in json.load(response)["data"]["groups"] for rule in group["rules"]]


def panel_queries() -> list[tuple[str, str]]:
    found = []
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"panel {panel['title']!r}: a variable the test does not fill in: {expr}"
            found.append((panel["title"], expr))
    return found


def rule_selectors() -> list[tuple[str, str]]:
    return [(rule["alert"], match.group(0)) for rule in rules() for match in SELECTOR.finditer(rule["expr"])]


def start_prometheus(tmp_path: Path, procs: Processes, metrics_address: str) -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed (apt-get install prometheus)", pytrace=False)
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "trainerd", "static_configs": [{"targets": [metrics_address]}]}],
    }))
    procs.start("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address={address}"])
    return address


def rank_0_worker() -> psutil.Process | None:
    for proc in processes_mentioning(SCRIPTED_TRAINER):
        try:
            if proc.environ().get("RANK_ID") == "0":
                return proc
        except psutil.Error:  # it exited (a zombie until reaped) between the listing and this look
            continue
    return None


def test_every_panel_and_rule_evaluates_against_the_series_a_live_trainerd_exports(
        tmp_path: Path, procs: Processes) -> None:
    control, checkpoints = tmp_path / "control", tmp_path / "checkpoints"
    control.mkdir()
    job = {"name": JOB, "entrypoint": ["{python}", str(SCRIPTED_TRAINER), str(control), str(checkpoints)],
           "min_nodes": 1, "max_nodes": 1, "global_batch": 8, "micro_batch": 8, "scheduler_port": scheduler_port(),
           "stop_grace_s": 3, "start_wait_s": 0, "hang_timeout_s": 600, "restart": {"backoff_s": 0},
           "checkpoint": {"dir": str(checkpoints)}}
    address, metrics_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs.trainerd("trainerd", cluster_file(tmp_path, "trainerd", listen=address, job=job,
                                            metrics_listen=metrics_address))
    procs.agent("node-a", address, flags=("--no-compile-cache",))
    prometheus = start_prometheus(tmp_path, procs, metrics_address)

    def at_step_5(generation: int):
        return lambda: ((j := job_of(address)) is not None and j["generation"] == generation
                        and j["state"] == "RUNNING" and j["step"] == 5 and j["last_checkpoint_step"] == 5 and j)

    wait_until(at_step_5(1), 60, "generation 1 at step 5 with checkpoint 5", interval=0.2, on_timeout=procs.logs)
    # A crash: a relaunch, the restart budget spent once, a recovery's phases.
    worker = wait_until(rank_0_worker, 10, "the rank 0 worker")
    worker.send_signal(signal.SIGKILL)
    wait_until(at_step_5(2), 60, "generation 2 at step 5", interval=0.2, on_timeout=procs.logs)

    def empty(queries: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(what, expr) for what, expr in queries if not query(prometheus, expr)]

    panels, selectors = panel_queries(), rule_selectors()
    assert len(panels) >= 10 and len(selectors) >= len(rules())
    missing = wait_until(lambda: not empty(panels + selectors) or None, 30, "every query to return a series",
                         interval=1, on_timeout=lambda: f"empty: {empty(panels + selectors)}\n{procs.logs()}")
    assert missing is True
    assert query(prometheus, 'trainerd_job_restart_budget_spent{job_name="scripted"}')[0]["value"][1] == "1"

    # Prometheus evaluates every rule it loaded, without an error (some are pending: the stand-in stops at step 5,
    # and its crash cost goodput).
    def evaluated() -> list[dict] | None:
        loaded = loaded_rules(prometheus)
        return loaded if loaded and all(rule.get("lastEvaluation", "").startswith("2") and rule["health"] != "unknown"
                                        for rule in loaded) else None

    loaded = wait_until(evaluated, 30, "every rule evaluated", interval=1, on_timeout=procs.logs)
    assert sorted(rule["name"] for rule in loaded) == sorted(rule["alert"] for rule in rules())
    for rule in loaded:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
    for rule in rules():
        query(prometheus, rule["expr"])  # the query API accepts it too
