"""An agent restarted after a crash kills the process groups its predecessor left running."""

import os
import subprocess
import sys

from agent.orphans import ProcessRegistry, start_time


def test_a_restarted_agent_kills_what_its_predecessor_left_and_nothing_else(tmp_path) -> None:
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    finished = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        previous = ProcessRegistry(tmp_path / "processes.json")
        previous.add(orphan.pid)
        previous.add(finished.pid)
        finished.wait(timeout=10)  # gone by itself: its PID must not be signalled
        assert ProcessRegistry(tmp_path / "processes.json").reap_orphans() == 1
        assert orphan.wait(timeout=10) == -9
        assert ProcessRegistry(tmp_path / "processes.json").reap_orphans() == 0
    finally:
        orphan.kill()


def test_a_recycled_pid_is_not_killed(tmp_path) -> None:
    (tmp_path / "processes.json").write_text('{"1": 0, "%d": 1}' % os.getpid())
    assert start_time(os.getpid()) != 1
    assert ProcessRegistry(tmp_path / "processes.json").reap_orphans() == 0
    (tmp_path / "processes.json").write_text("not json")
    assert ProcessRegistry(tmp_path / "processes.json").reap_orphans() == 0
