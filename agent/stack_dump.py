"""The Python stacks of a running process, taken from outside with py-spy (before a hang kill).

A hang is detected by the coordinator; by the time the processes are killed, only their stacks
say where they were stuck. `py-spy dump --nonblocking --pid PID` reads them from the process's memory
without its cooperation and without pausing it: a process that is itself stopped (SIGSTOP, a frozen
host) cannot be paused by ptrace, and py-spy's default mode then fails ("Failed to get stack traces").
The supervisor asks a `StackDumper` for each process and bounds the wait itself; cancelling a
dump kills its py-spy.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from typing import Protocol


class StackDumper(Protocol):
    async def dump(self, pid: int) -> str:
        """The Python stacks of process `pid` as text, or one line saying why they could not be taken.

        Raises nothing for a process that cannot be read; may be cancelled at any time.
        """


def find_py_spy() -> str | None:
    """py-spy next to the agent's interpreter (its virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file():
        return str(beside)
    return shutil.which("py-spy")


class PySpyDumper:
    def __init__(self, executable: str | None = None) -> None:
        self._executable = executable or find_py_spy()

    async def dump(self, pid: int) -> str:
        if self._executable is None:
            return f"py-spy is not installed (looked beside {sys.executable} and on PATH)\n"
        try:
            process = await asyncio.create_subprocess_exec(
                self._executable, "dump", "--nonblocking", "--pid", str(pid), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            return f"cannot run {self._executable}: {exc.strerror or exc}\n"
        try:
            stdout, stderr = await process.communicate()
        except asyncio.CancelledError:
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        if process.returncode == 0:
            return stdout.decode(errors="replace")
        return f"py-spy could not dump pid {pid}: {_first_error_line(stderr.decode(errors='replace'))}\n"


def _first_error_line(text: str) -> str:
    """py-spy prints `Error: …` and then a backtrace of its own: the error line is the reason."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("Error:")), lines[0] if lines else "no output")
    return reason.removeprefix("Error:").strip()
