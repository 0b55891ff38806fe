"""Starting training processes in pre-started interpreters (agent/warm_worker.py) where that is safe.

After a fault, most of a relaunched worker's start is the interpreter and `import mindspore` (about
3 s on the CPU example). The agent outlives its workers, so it keeps warm workers: interpreters that
have done that already and wait for a job. `WarmLauncher` is a `ProcessLauncher`: it hands a start to
a warm worker when

- the argv (after `{python}` is expanded) is this agent's interpreter followed by `-m MODULE ...` or
  `SCRIPT ...`, with no interpreter options: anything else (another interpreter, a shell script,
  msrun) starts cold, as before;
- an idle warm worker was started in the same working directory with the same value of every
  variable read at import (agent/import_env.py): whatever was read then cannot change later.

Otherwise it starts the process cold through the `SubprocessLauncher` and logs why. Either way the
process is the leader of its own session, its pid is the one the supervisor tracks and signals, and
its exit status is the command's. After each qualifying start, a fresh warm worker with that start's
environment and directory is prepared in the background, so the next generation (the same ranks on
the same devices, new ports) finds one. At most `capacity` idle ones are kept (one per local device
and one for the scheduler); the oldest goes first. Run as root, the agent prepares them at the lowest
priority, so that they do not slow the generation starting beside them, and restores the priority
before handing over the job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.import_env import import_env_mismatch
from agent.launcher import SubprocessHandle, SubprocessLauncher
from agent.worker_user import WorkerUser

log = logging.getLogger(__name__)

PREPARE_NICENESS = 19
# Room for the job's command line, which the warm worker writes over its own so that `ps` shows the
# job (agent/warm_worker.py).
TITLE_ROOM = 4096


def warm_entrypoint(argv: Sequence[str], python: str) -> list[str] | None:
    """The part of `argv` a warm worker runs (`["-m", MODULE, ...]` or `[SCRIPT, ...]`), or None when
    `argv` is not `python` running a module or a script without interpreter options."""
    if len(argv) < 2 or argv[0] != python:
        return None
    if argv[1] == "-m":
        return list(argv[1:]) if len(argv) >= 3 and argv[2] and not argv[2].startswith("-") else None
    if argv[1].startswith("-"):
        return None
    return list(argv[1:])


@dataclass
class WarmWorker:
    process: asyncio.subprocess.Process
    channel: socket.socket
    env: dict[str, str]
    cwd: Path

    def discard(self) -> None:
        """Close its socket (an idle warm worker then exits by itself) and make sure it is gone."""
        self.channel.close()
        if self.process.returncode is None:
            try:
                os.killpg(self.process.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass


class WarmLauncher:
    """A `ProcessLauncher` that starts `{python} -m MODULE` and `{python} SCRIPT` in warm workers (see
    the module docstring) and everything else through `cold`. `enabled=False` starts everything cold."""

    def __init__(self, cold: SubprocessLauncher, *, python: str, log_path: Path, capacity: int,
                 user: WorkerUser | None = None, enabled: bool = True, preload: Sequence[str] | None = None) -> None:
        self._cold = cold
        self._python = python
        self._log_path = log_path  # the warm workers' own output before they get a job
        self._capacity = capacity
        self._user = user
        self.enabled = enabled
        self._preload = preload  # None: agent/warm_worker.py's PRELOAD (MindSpore and the trainer runtime)
        self._idle: list[WarmWorker] = []
        self._preparing: set[asyncio.Task] = set()
        # Only a privileged agent can give a niced process its priority back.
        self._nice = os.geteuid() == 0

    async def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> SubprocessHandle:
        entry = warm_entrypoint(argv, self._python) if self.enabled else None
        if entry is None:
            why = "warm workers are off" if not self.enabled else "not {python} -m MODULE or {python} SCRIPT"
            return await self._start_cold(argv, env, cwd, log_path, why)
        env = {**env, **(self._user.environment() if self._user else {})}
        warm, why = self._take(env, cwd)
        try:
            if warm is not None:
                try:
                    handle = self._hand_over(warm, entry, env, cwd, log_path)
                except OSError as exc:
                    warm.discard()
                    why = f"the warm worker could not take the job: {exc}"
                else:
                    log.info("started pid %d warm (a pre-started interpreter): %s", handle.pid, " ".join(argv))
                    return handle
            return await self._start_cold(argv, env, cwd, log_path, why)
        finally:
            self._prepare_in_background(env, cwd)

    async def _start_cold(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
                          why: str) -> SubprocessHandle:
        handle = await self._cold.start(argv, env, cwd, log_path)
        log.info("started pid %d cold (%s): %s", handle.pid, why, " ".join(argv))
        return handle

    def _take(self, env: Mapping[str, str], cwd: Path) -> tuple[WarmWorker | None, str]:
        """An idle warm worker fit for `env` and `cwd`, removed from the pool, or None and why not."""
        reasons = []
        for warm in self._idle:
            if warm.process.returncode is not None:
                continue
            if warm.cwd != cwd:
                reasons.append(f"pid {warm.process.pid} is in {warm.cwd}")
                continue
            mismatch = import_env_mismatch(warm.env, env)
            if mismatch:
                reasons.append(f"pid {warm.process.pid} imported with other {', '.join(mismatch[:5])}"
                               + (f" and {len(mismatch) - 5} more" if len(mismatch) > 5 else ""))
                continue
            self._idle.remove(warm)
            return warm, ""
        self._drop_dead()
        if not reasons:
            return None, "no warm worker ready" if not self._preparing else "the warm workers are still being started"
        return None, "no warm worker fits: " + "; ".join(reasons)

    def _hand_over(self, warm: WarmWorker, entry: list[str], env: dict[str, str], cwd: Path,
                   log_path: Path) -> SubprocessHandle:
        message = json.dumps({"argv": entry, "env": env, "cwd": str(cwd)}).encode()
        with open(log_path, "ab") as log_file:
            if self._user is not None:
                os.fchown(log_file.fileno(), self._user.uid, self._user.gid)
            sent = socket.send_fds(warm.channel, [message], [log_file.fileno()])
            warm.channel.sendall(message[sent:])
        if self._nice:
            set_priority(warm.process.pid, os.getpriority(os.PRIO_PROCESS, 0))
        warm.channel.close()  # the end of the message: the job starts now
        return SubprocessHandle(warm.process)

    def _prepare_in_background(self, env: dict[str, str], cwd: Path) -> None:
        task = asyncio.get_running_loop().create_task(self._prepare(env, cwd))
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)

    async def _prepare(self, env: dict[str, str], cwd: Path) -> None:
        try:
            warm = await self._spawn(env, cwd)
        except OSError as exc:
            log.warning("cannot prepare a warm worker in %s: %s", cwd, exc)
            return
        self._idle.append(warm)
        while len(self._idle) > self._capacity:
            self._idle.pop(0).discard()
        log.debug("prepared warm worker pid %d in %s", warm.process.pid, cwd)

    async def _spawn(self, env: dict[str, str], cwd: Path) -> WarmWorker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [self._python, "-m", "agent.warm_worker", str(theirs.fileno())]
        if self._preload is not None:
            argv += ["--preload", ",".join(self._preload)]
        argv += ["--room", " " * TITLE_ROOM]
        options: dict[str, Any] = {} if self._user is None else self._user.process_options()
        try:
            with open(self._log_path, "ab") as log_file:  # noqa: ASYNC230 (local, append: no real wait)
                process = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=(theirs.fileno(),),
                    **options)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if self._nice:
            # Still one thread (the interpreter is starting): the threads its imports start inherit this.
            set_priority(process.pid, PREPARE_NICENESS)
        return WarmWorker(process, ours, dict(env), cwd)

    def _drop_dead(self) -> None:
        for warm in [w for w in self._idle if w.process.returncode is not None]:
            self._idle.remove(warm)
            warm.discard()

    async def close(self) -> None:
        """Stop preparing and end every idle warm worker (the agent is stopping)."""
        for task in list(self._preparing):
            task.cancel()
        await asyncio.gather(*self._preparing, return_exceptions=True)
        for warm in self._idle:
            warm.discard()
            await warm.process.wait()
        self._idle.clear()


def set_priority(pid: int, niceness: int) -> None:
    """Set every thread of `pid` to `niceness` (on Linux each thread has its own)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:
            pass
