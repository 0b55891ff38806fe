"""Children that end with the process that started them (common/child_lifetime.py), with real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from common.child_lifetime import ending_with_this_process
from tests.waiting import wait_until

# A parent that starts `sleep 600` as a child ending with it, prints the child's pid, and waits to be killed.
PARENT = """
import subprocess, sys, time
from common.child_lifetime import ending_with_this_process
child = subprocess.Popen(ending_with_this_process(["/bin/sleep", "600"]), start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_child_gets_sigterm_when_its_parent_is_killed_by_sigkill() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        wait_until(lambda: child.cmdline() == ["/bin/sleep", "600"], 10, "the child to exec its program")
        assert child.ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10,
                   "the child to end with its parent")
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_the_program_runs_with_its_own_arguments_and_exit_status() -> None:
    done = subprocess.run(ending_with_this_process(["/bin/sh", "-c", 'echo "$0 $1"; exit 3', "a b", "c"]),
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (3, "a b c\n")


def test_it_refuses_to_be_asked_outside_the_main_thread() -> None:
    raised: list[BaseException] = []

    def ask() -> None:
        try:
            ending_with_this_process(["/bin/true"])
        except RuntimeError as exc:
            raised.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join()
    assert len(raised) == 1 and "main thread" in str(raised[0])


def test_the_request_survives_exec_and_is_not_passed_to_the_program_s_own_children() -> None:
    """The agent's training processes, its children, must not end with trainerd: they end with the agent."""
    read_own = ("import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v)); "  # PR_GET_PDEATHSIG
                "print(v.value, flush=True)")
    script = f"import subprocess, sys; exec({read_own!r}); subprocess.run([sys.executable, '-c', {read_own!r}])"
    done = subprocess.run(ending_with_this_process([sys.executable, "-c", script]), capture_output=True, text=True,
                          timeout=30)
    assert done.stdout.split() == [str(int(signal.SIGTERM)), "0"], done.stderr
