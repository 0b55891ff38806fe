"""Training processes left behind by an agent that died without stopping them (SIGKILL, OOM).

They would hold their device and wait in collectives forever, and nobody could report or stop
them. The supervisor records the process group of every process it starts in
`<work_dir>/processes.json`; an agent starting on that work dir kills the groups still alive. A
PID is matched with its start time (/proc/<pid>/stat), so a recycled PID is never killed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

from common.atomic_write import write_atomically

log = logging.getLogger(__name__)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    return int(stat.rsplit(")", 1)[1].split()[19])


class ProcessRegistry:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._groups: dict[int, int] = {}

    def add(self, pid: int) -> None:
        started = start_time(pid)
        if started is not None:
            self._groups[pid] = started
            self._save()

    def discard(self, pid: int) -> None:
        if self._groups.pop(pid, None) is not None:
            self._save()

    def _save(self) -> None:
        write_atomically(self._path, json.dumps({str(pid): started for pid, started in self._groups.items()}).encode())

    def reap_orphans(self) -> int:
        """Kill the groups a previous agent left running; returns how many."""
        try:
            recorded = json.loads(self._path.read_text())
        except (OSError, ValueError):
            recorded = {}
        killed = 0
        for pid_text, started in recorded.items() if isinstance(recorded, dict) else ():
            try:
                pid = int(pid_text)
            except ValueError:
                continue
            if pid > 1 and start_time(pid) == started:
                log.warning("killing process group %d left running by a previous agent", pid)
                try:
                    os.killpg(pid, signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, PermissionError):
                    pass
        self._groups = {}
        self._save()
        return killed
