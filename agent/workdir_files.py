"""What the agent does in a job's working directory: create it, and remove and write the
graceful-exit file that MindSpore's OnRequestExit watches.

Without a worker user (`run_as`) the agent does it itself. With one, the working directory is the
workers': they write in it, so they could plant a symlink where the agent, which runs as root, is
about to write or delete. So every change there is made by a short process running as the worker
user (coreutils, which any user can run): the agent does nothing in it that the job's own processes
could not do. The one exception is the job's default working directory, under the agent's own work
dir where the worker user may create nothing: the agent creates it and gives it to that user.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from agent.worker_user import WorkerUser
from common.atomic_write import write_atomically

# sh -c REPLACE sh PATH: stdin into PATH.partial, renamed over PATH.
_REPLACE = 'cat > "$1.partial" && exec mv -f -- "$1.partial" "$1"'


class WorkdirFiles:
    """Changes in a job's working directory, made as `user` (None: as the agent itself)."""

    def __init__(self, user: WorkerUser | None) -> None:
        self._user = user

    async def make_dirs(self, path: Path) -> None:
        """Create the directory `path` and its missing parents.

        Raises:
            OSError: it cannot be created (as the worker user).
        """
        if self._user is None:
            path.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (a local directory: no real wait)
        else:
            await _run_as(self._user, ["/bin/mkdir", "-p", "--", str(path)])

    def make_default(self, path: Path) -> None:
        """Create the job's default working directory `path`, under the agent's own work dir, and
        give it to the worker user (not following a symlink: only the agent writes in its work dir).

        Raises:
            OSError: it cannot be created or given.
        """
        path.mkdir(parents=True, exist_ok=True)
        if self._user is not None:
            os.chown(path, self._user.uid, self._user.gid, follow_symlinks=False)

    async def remove(self, path: Path) -> None:
        """Remove the file `path`; one that is not there is not an error.

        Raises:
            OSError: it cannot be removed (as the worker user).
        """
        if self._user is None:
            path.unlink(missing_ok=True)  # noqa: ASYNC240 (a local file: no real wait)
        else:
            await _run_as(self._user, ["/bin/rm", "-f", "--", str(path)])

    async def replace(self, path: Path, data: bytes) -> None:
        """Write `data` beside `path` and rename it over `path`: a reader sees the old file or the whole new one.

        Raises:
            OSError: it cannot be written (as the worker user).
        """
        if self._user is None:
            write_atomically(path, data)
        else:
            await _run_as(self._user, ["/bin/sh", "-c", _REPLACE, "sh", str(path)], data)



async def _run_as(user: WorkerUser, argv: list[str], data: bytes = b"") -> None:
    """Run `argv` as `user` with `data` on its stdin; its last line of errors becomes the OSError.

    Raises:
        OSError: it failed.
    """
    process = await asyncio.create_subprocess_exec(
        *argv, cwd="/", env={"PATH": "/usr/bin:/bin", **user.environment()}, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, **user.process_options())
    _, errors = await process.communicate(data)
    if process.returncode != 0:
        lines = errors.decode(errors="replace").strip().splitlines()
        raise OSError(lines[-1] if lines else f"{argv[0]} exited with code {process.returncode} as {user.name}")
