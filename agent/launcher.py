"""Starting a training process and signalling its process group, behind a small protocol.

The supervisor decides what to start, when to signal and what to report; a `ProcessLauncher`
does the starting, in the manner of torch elastic's `PContext`. Production uses
`SubprocessLauncher`; the supervisor's tests use a fake that exits on command.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from agent.worker_user import WorkerUser


class ProcessHandle(Protocol):
    """One started process, the leader of its own process group (its group id is its pid)."""

    pid: int

    async def wait(self) -> int:
        """Waits for the process to exit; returns its return code (-N when signal N ended it)."""

    def signal_group(self, signum: int) -> None:
        """Sends `signum` to the process's group; a group that is gone already is not an error."""


class ProcessLauncher(Protocol):
    async def prepare(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        """A hint, before a generation's processes are started one after another: `argv` will be started in
        `cwd` with `env`. A launcher that can make that start quicker begins now."""

    async def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> ProcessHandle:
        """Starts `argv` in a new process group with stdin from /dev/null and stdout and stderr
        appended to `log_path`.

        Raises:
            OSError: `argv[0]` cannot be executed (missing, not executable, bad interpreter).
        """


class GroupLeader:
    """A started process that leads its own process group: signals go to the group, whose id is its pid."""

    pid: int

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class SubprocessHandle(GroupLeader):
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.pid = process.pid

    async def wait(self) -> int:
        return await self._process.wait()


class SubprocessLauncher:
    """asyncio subprocesses, each in a new session, so a signal to its group reaches all it spawned.
    With `user`, every process runs as that user, with its HOME, USER and LOGNAME, and owns its log."""

    def __init__(self, user: WorkerUser | None = None) -> None:
        self._user = user

    async def prepare(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        """Nothing to prepare: every start execs anew."""

    async def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> SubprocessHandle:
        env, options = dict(env), dict[str, Any]()
        with open(log_path, "ab") as log_file:  # noqa: ASYNC230 (local, append: no real wait)
            if self._user is not None:
                os.fchown(log_file.fileno(), self._user.uid, self._user.gid)
                env.update(self._user.environment())
                options = self._user.process_options()
            process = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=log_file,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, **options)
        return SubprocessHandle(process)
