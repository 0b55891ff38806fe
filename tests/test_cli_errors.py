"""A user's mistake gets one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.harness import BIN
from tests.ports import free_port


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:") or ": " in line]
    assert error_lines, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize(("text", "fragment"), [
    ("cluster:\n  heartbeat: {interval_s: fast}\n", "cluster.heartbeat.interval_s"),
    ("cluster:\n  nope: 1\n", "cluster.nope: unknown key"),
    ("cluster: [\n", "malformed YAML"),
    ("cluster:\n  coordinator: {listen: 'x'}\n", "cluster.coordinator.listen"),
    ("job:\n  entrypoint: [a]\n  global_batch: 10\n  micro_batch: 4\n", "job: global_batch 10 cannot be kept"),
])
def test_trainerd_rejects_a_bad_cluster_file(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    assert_one_line_error(run("trainerd", "start", "--cluster", str(path)), 2, str(path), fragment)


def test_trainerd_missing_cluster_file(tmp_path: Path) -> None:
    assert_one_line_error(run("trainerd", "start", "--cluster", str(tmp_path / "none.yaml")), 2, "cannot read")


def test_trainerctl_usage_and_unreachable() -> None:
    assert_one_line_error(run("trainerctl", "--coordinator", "nohost", "status"), 2, "not HOST:PORT")
    assert_one_line_error(run("trainerctl", "status", "-o", "yaml"), 2, "'yaml' is not one of")
    result = run("trainerctl", "--coordinator", f"127.0.0.1:{free_port()}", "status")
    assert_one_line_error(result, 3, "cannot reach the coordinator")


def test_agent_rejects_bad_flags(tmp_path: Path) -> None:
    assert_one_line_error(run("trainerd-agent", "--coordinator", "h:0", "--cpu-devices", "1",
                              "--work-dir", str(tmp_path)), 2, "coordinator.0")
    assert_one_line_error(run("trainerd-agent", "--coordinator", "h:1", "--work-dir", str(tmp_path),
                              "--config", str(tmp_path / "missing.yaml")), 2, "cannot read")


@pytest.mark.parametrize(("argv", "fragment"), [
    (("skips", "add", "5", "--reason", "x"), "'5' is not START:END"),
    (("skips", "add", "1:2"), "Missing option '--reason'"),
    (("resume", "--from-step", "0"), "0 is not in the range x>=1"),
    (("nodes", "drain"), "Missing argument 'NAME'"),
])
def test_trainerctl_refuses_malformed_operator_commands(argv: tuple[str, ...], fragment: str) -> None:
    assert_one_line_error(run("trainerctl", "--coordinator", "127.0.0.1:1", *argv), 2, fragment)


@pytest.mark.parametrize("argv", [("pause",), ("resume",), ("nodes", "undrain", "n1"), ("skips",)])
def test_trainerctl_operator_commands_without_a_coordinator(argv: tuple[str, ...]) -> None:
    assert_one_line_error(run("trainerctl", "--coordinator", f"127.0.0.1:{free_port()}", *argv), 3,
                          "cannot reach the coordinator")
