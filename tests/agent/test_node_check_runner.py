"""The node check with real processes (the production launcher): a pass, a failure with its reason in
one line, a timeout, and an argv outside allowed_entrypoints, which never runs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agent.commands import NodeCheck
from agent.launcher import SubprocessLauncher
from agent.node_check import run_node_check
from proto import trainerd_pb2 as pb


def check(tmp_path: Path, *argv: str, timeout_s: float = 30.0) -> pb.NodeCheckResult:
    request = NodeCheck(check_id=7, argv=tuple(argv), timeout_s=timeout_s)
    return asyncio.run(run_node_check(request, launcher=SubprocessLauncher(), work_dir=tmp_path,
                                      allowed_entrypoints=[["{python}"]], python=sys.executable))


def test_exit_0_passes(tmp_path: Path) -> None:
    result = check(tmp_path, "{python}", "-c", "print('all devices healthy')")
    assert (result.check_id, result.passed, result.detail) == (7, True, "")
    assert "all devices healthy" in (tmp_path / "node_check.log").read_text()


def test_a_failure_says_why_in_one_line(tmp_path: Path) -> None:
    result = check(tmp_path, "{python}", "-c", "import sys; print('checking'); print('device 3: ECC errors'); "
                                               "sys.exit(4)")
    assert not result.passed
    assert result.detail == "exit code 4: device 3: ECC errors"


def test_a_check_past_its_timeout_is_killed_and_fails(tmp_path: Path) -> None:
    result = check(tmp_path, "{python}", "-c", "import time; time.sleep(60)", timeout_s=0.5)
    assert not result.passed and result.detail.startswith("did not finish within")


def test_an_argv_outside_allowed_entrypoints_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = check(tmp_path, "/bin/touch", str(marker))
    assert not result.passed and result.detail.startswith("refused to run ['/bin/touch'")
    assert not marker.exists()
