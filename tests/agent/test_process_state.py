"""The kernel state of a real process: running or sleeping, then stopped by SIGSTOP, then gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from agent.process_state import os_state
from proto.vocabulary import FROZEN_OS_STATES


def wait_for_state(pid: int, wanted: set[str]) -> str:
    deadline = time.monotonic() + 10
    while (state := os_state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


def test_a_stopped_process_reads_as_frozen_and_a_gone_one_as_unknown() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_for_state(child.pid, {"S", "R"}) in {"S", "R"}
        child.send_signal(signal.SIGSTOP)
        assert wait_for_state(child.pid, {"T"}) in FROZEN_OS_STATES
        child.send_signal(signal.SIGCONT)
        assert wait_for_state(child.pid, {"S", "R"}) not in FROZEN_OS_STATES
    finally:
        child.kill()
        child.wait()
    assert os_state(child.pid) == "" and os_state(0) == ""
