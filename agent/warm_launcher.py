"""Starting training processes forked from pre-started interpreters (agent/warm_worker.py) where that is safe.

After a fault, most of a relaunched worker's start is the interpreter and `import mindspore` (about
2 CPU-seconds, 3 s of wall time on the CPU example). The agent outlives its workers, so it keeps warm
templates: interpreters that have done that once and fork a process for every start. `WarmLauncher` is a
`ProcessLauncher`: it forks a start from a template when

- the argv (after `{python}` is expanded) is this agent's interpreter followed by `-m MODULE ...` or
  `SCRIPT ...`, with no interpreter options: anything else (another interpreter, a shell script,
  msrun) starts cold, as before;
- the template was started in the same working directory with the same value of every variable read
  at import (agent/import_env.py): whatever was read then cannot change later. One device's processes
  share one template (DEVICE_ID is read at import), and the scheduler has its own.

A start with no fitting template starts one and waits for its imports (as long as a cold start takes),
so the first generation pays one import per device and every later one none; `prepare` starts the
templates of a generation's processes side by side before the first of them is started. Otherwise it
starts the process cold through the `SubprocessLauncher` and logs why. Either way the process is the
leader of its own session, its pid is the one the supervisor tracks and signals, and its exit status is
the command's (a forked child's comes from its template, which is its parent). At most `capacity`
templates are kept (one per local device and one for the scheduler); a retired one forks no more and
ends once its children have. Run as root, the agent starts templates at the lowest priority, so that
their imports do not slow the generation beside them, and gives each child the agent's priority back
before handing over the job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.import_env import import_env_mismatch
from agent.launcher import GroupLeader, ProcessHandle, SubprocessHandle, SubprocessLauncher
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


UNKNOWN_EXIT_CODE = 255  # a child whose template died before telling its exit status


class ForkedHandle(GroupLeader):
    """A process forked by a template: its exit status comes from the template (`WarmTemplate.exit_of`)."""

    def __init__(self, pid: int, exited: asyncio.Future[int]) -> None:
        self.pid = pid
        self._exited = exited

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


MAX_PID = 1 << 22  # the kernel's pid_max can be at most this


def template_message(data: bytes) -> tuple[str, int, int] | None:
    """`forked PID` or `exited PID CODE` (agent/warm_worker.py) as (kind, pid, code); None when malformed."""
    fields = data.decode("ascii", errors="replace").split()
    try:
        if len(fields) == 2 and fields[0] == "forked":
            kind, pid, code = "forked", int(fields[1]), 0
        elif len(fields) == 3 and fields[0] == "exited":
            kind, pid, code = "exited", int(fields[1]), int(fields[2])
        else:
            return None
    except ValueError:
        return None
    return (kind, pid, code) if 0 < pid <= MAX_PID and -255 <= code <= 255 else None


class WarmTemplate:
    """A template interpreter and the agent's end of its control socket (the protocol: agent/warm_worker.py)."""

    def __init__(self, process: asyncio.subprocess.Process, control: socket.socket, env: dict[str, str],
                 cwd: Path) -> None:
        self.process, self.control, self.env, self.cwd = process, control, env, cwd
        self.retired = False
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()  # one fork at a time: its answer is the next `forked`
        self._forked: asyncio.Future[int] | None = None
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._gone = False
        control.setblocking(False)
        self._loop.add_reader(control.fileno(), self._read)

    @property
    def usable(self) -> bool:
        return not self._gone and not self.retired and self.process.returncode is None

    async def fork(self) -> tuple[int, socket.socket]:
        """A new child of the template and the socket it waits on for its job; waits for the template's
        imports the first time.

        Raises:
            OSError: the template is gone.
        """
        async with self._lock:
            if self._gone:
                raise OSError(f"the warm template pid {self.process.pid} is gone")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._forked = self._loop.create_future()
            try:
                socket.send_fds(self.control, [b"fork"], [theirs.fileno()])
            except OSError:
                ours.close()
                raise
            finally:
                theirs.close()
            try:
                pid = await self._forked
            except BaseException:
                ours.close()
                raise
            return pid, ours

    def exit_of(self, pid: int) -> asyncio.Future[int]:
        """The exit status of `pid`, a child just forked: ask before the next await (an exit told is then
        dropped here, so that a template's life of generations keeps no record of each child)."""
        return self._exits[pid]

    @property
    def children(self) -> int:
        """How many of its children have not ended."""
        return sum(1 for f in self._exits.values() if not f.done())

    def _read(self) -> None:
        while True:
            try:
                data = self.control.recv(256)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            message = template_message(data)
            if message is None:
                # It runs as the workers' user: what it says is checked, and one that breaks the protocol
                # is not listened to again (its children's ends are then watched here).
                log.warning("the warm template pid %d sent %r: not listening to it any more", self.process.pid,
                            data[:80])
                self._lost()
                return
            kind, pid, code = message
            if kind == "forked" and self._forked is not None and not self._forked.done():
                self._exits[pid] = self._loop.create_future()
                self._forked.set_result(pid)
            elif kind == "exited":
                exited = self._exits.pop(pid, None)  # its handle holds it: kept no longer here
                if exited is not None and not exited.done():
                    exited.set_result(code)
                if self.retired and not self.children:
                    self.close()

    def _lost(self) -> None:
        """The template ended (or closed its end): no more forks, and its running children's exits are
        watched here, their status unknown."""
        self.close()
        if self._forked is not None and not self._forked.done():
            self._forked.set_exception(OSError(f"the warm template pid {self.process.pid} exited"))
        for pid, exited in self._exits.items():
            if not exited.done():
                log.warning("the warm template pid %d ended before its child pid %d: that child's exit status "
                            "will be unknown (%d)", self.process.pid, pid, UNKNOWN_EXIT_CODE)
                self._watch(pid, exited)

    def _watch(self, pid: int, exited: asyncio.Future[int]) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already
            exited.set_result(UNKNOWN_EXIT_CODE)
            return

        def ended() -> None:
            self._loop.remove_reader(pidfd)
            os.close(pidfd)
            if not exited.done():
                exited.set_result(UNKNOWN_EXIT_CODE)
        self._loop.add_reader(pidfd, ended)

    def retire(self) -> None:
        """Fork no more; the template ends once its children have."""
        self.retired = True
        if not self.children:
            self.close()

    def close(self) -> None:
        """Close the control socket: the template exits once its children have ended."""
        if not self._gone:
            self._gone = True
            self._loop.remove_reader(self.control.fileno())
            self.control.close()


class WarmLauncher:
    """A `ProcessLauncher` that starts `{python} -m MODULE` and `{python} SCRIPT` forked from warm templates
    (see the module docstring) and everything else through `cold`. `enabled=False` starts everything cold."""

    def __init__(self, cold: SubprocessLauncher, *, python: str, log_path: Path, capacity: int,
                 user: WorkerUser | None = None, enabled: bool = True, preload: Sequence[str] | None = None) -> None:
        self._cold = cold
        self._python = python
        self._log_path = log_path  # the templates' own output
        self._capacity = capacity
        self._user = user
        self.enabled = enabled
        self._preload = preload  # None: agent/warm_worker.py's PRELOAD (MindSpore and the trainer runtime)
        self._templates: list[WarmTemplate] = []  # the oldest first
        self._spawning = asyncio.Lock()
        # Only a privileged agent can give a niced process its priority back.
        self._nice = os.geteuid() == 0

    async def prepare(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        """Start the template a start of `argv` would be forked from, if there is none yet."""
        if self.enabled and warm_entrypoint(argv, self._python) is not None:
            await self._template_for(self._job_env(env), cwd)

    async def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> ProcessHandle:
        entry = warm_entrypoint(argv, self._python) if self.enabled else None
        if entry is None:
            why = "warm workers are off" if not self.enabled else "not {python} -m MODULE or {python} SCRIPT"
            return await self._start_cold(argv, env, cwd, log_path, why)
        env = self._job_env(env)
        template, why = await self._template_for(env, cwd)
        if template is not None:
            try:
                pid, channel = await template.fork()
            except OSError as exc:
                why = f"the warm template could not fork: {exc}"
                template.retire()
            else:
                try:
                    self._hand_over(pid, channel, entry, env, cwd, log_path)
                except OSError as exc:
                    why = f"the forked worker could not take the job: {exc}"
                    ForkedHandle(pid, template.exit_of(pid)).signal_group(signal.SIGKILL)
                else:
                    log.info("started pid %d warm (forked from the pre-started interpreter pid %d): %s", pid,
                             template.process.pid, " ".join(argv))
                    return ForkedHandle(pid, template.exit_of(pid))
        return await self._start_cold(argv, env, cwd, log_path, why)

    def _job_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {**env, **(self._user.environment() if self._user else {})}

    async def _start_cold(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
                          why: str) -> SubprocessHandle:
        handle = await self._cold.start(argv, env, cwd, log_path)
        log.info("started pid %d cold (%s): %s", handle.pid, why, " ".join(argv))
        return handle

    async def _template_for(self, env: dict[str, str], cwd: Path) -> tuple[WarmTemplate | None, str]:
        """The template fit for `env` and `cwd`, started when there is none; or None and why not."""
        async with self._spawning:
            reasons = []
            for template in self._templates:
                if not template.usable:
                    continue
                if template.cwd != cwd:
                    reasons.append(f"pid {template.process.pid} is in {template.cwd}")
                    continue
                mismatch = import_env_mismatch(template.env, env)
                if mismatch:
                    reasons.append(f"pid {template.process.pid} imported with other {', '.join(mismatch[:5])}"
                                   + (f" and {len(mismatch) - 5} more" if len(mismatch) > 5 else ""))
                    continue
                return template, ""
            try:
                template = await self._spawn(env, cwd)
            except OSError as exc:
                log.warning("cannot start a warm template in %s: %s", cwd, exc)
                why = f"cannot start a warm template: {exc}"
                return None, why + ("; none fits: " + "; ".join(reasons) if reasons else "")
            if reasons:
                log.info("started warm template pid %d in %s, as none fits: %s", template.process.pid, cwd,
                         "; ".join(reasons))
            self._templates = [t for t in self._templates if t.usable or t.children] + [template]
            for old in [t for t in self._templates if not t.retired][:-self._capacity]:
                old.retire()
            return template, ""

    def _hand_over(self, pid: int, channel: socket.socket, entry: list[str], env: dict[str, str], cwd: Path,
                   log_path: Path) -> None:
        message = json.dumps({"argv": entry, "env": env, "cwd": str(cwd)}).encode()
        try:
            with open(log_path, "ab") as log_file:
                if self._user is not None:
                    os.fchown(log_file.fileno(), self._user.uid, self._user.gid)
                sent = socket.send_fds(channel, [message], [log_file.fileno()])
                channel.sendall(message[sent:])
            if self._nice:
                set_priority(pid, os.getpriority(os.PRIO_PROCESS, 0))
        finally:
            channel.close()  # the end of the message: the job starts now

    async def _spawn(self, env: dict[str, str], cwd: Path) -> WarmTemplate:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
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
        log.debug("started warm template pid %d in %s", process.pid, cwd)
        return WarmTemplate(process, ours, dict(env), cwd)

    async def close(self) -> None:
        """End every template (the agent is stopping; its supervisor has stopped the processes)."""
        for template in self._templates:
            template.close()
            try:
                os.killpg(template.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            await template.process.wait()
        self._templates.clear()


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
