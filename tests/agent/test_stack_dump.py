"""py-spy against real processes: the stacks of a sleeping Python child, and one line when it cannot."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from agent.stack_dump import PySpyDumper, find_py_spy

SLEEPER = """
import time

def waiting_in_a_collective_that_never_returns():
    time.sleep(60)

print("ready", flush=True)
waiting_in_a_collective_that_never_returns()
"""


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_the_stacks_of_a_sleeping_python_process_name_its_function() -> None:
    assert find_py_spy() is not None, "py-spy is a dependency of trainerd"
    child = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        dump = run(PySpyDumper().dump(child.pid))
    finally:
        child.kill()
        child.wait()
    assert f"Process {child.pid}" in dump
    assert "waiting_in_a_collective_that_never_returns (<string>:5)" in dump


def test_a_process_that_is_not_python_gives_one_line_saying_why() -> None:
    child = subprocess.Popen(["sleep", "60"])  # Popen returns once the exec has succeeded
    try:
        dump = run(PySpyDumper().dump(child.pid))
    finally:
        child.kill()
        child.wait()
    assert dump.startswith(f"py-spy could not dump pid {child.pid}: ")
    assert dump.count("\n") == 1


def test_a_missing_py_spy_gives_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "py-spy"
    assert run(PySpyDumper(str(missing)).dump(1)) == f"cannot run {missing}: No such file or directory\n"
