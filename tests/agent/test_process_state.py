"""The kernel state of a real process: running or sleeping, then stopped by SIGSTOP, then gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from agent.process_state import descends_from, os_state, parent_pid
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


def test_a_process_descends_from_its_parents_and_not_from_a_sibling() -> None:
    script = "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'input()'], stdin=subprocess.PIPE); " \
             "print(c.pid, flush=True); input(); c.communicate(b'\\n')"
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sibling = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert parent_pid(grandchild) == child.pid and parent_pid(child.pid) == os.getpid()
        assert descends_from(grandchild, child.pid) and descends_from(child.pid, child.pid)
        assert descends_from(grandchild, os.getpid())
        assert not descends_from(sibling.pid, child.pid) and not descends_from(child.pid, grandchild)
        assert not descends_from(os.getpid(), 1) and not descends_from(0, child.pid)
    finally:
        for process in (child, sibling):
            process.communicate(b"\n", timeout=10)
    assert parent_pid(child.pid) == 0  # gone
