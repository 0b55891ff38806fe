"""A supervisor with a fake launcher, a fake stack dumper and a fake clock: no processes, no sleeps.

The fake processes exit when a test says so, or on the signals a real one would obey; every signal
is recorded with the clock's time and whether the process was still running when it came. They write
their "output" into the log file the supervisor gave them, as a real process's stdout would go.
"""

from __future__ import annotations

import asyncio
import errno
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.commands import Launch, ProcessSpec
from agent.snapshots.memory_snapshots import MemorySnapshotDir
from agent.snapshots.peer_client import PeerClient
from agent.supervisor import Supervisor
from agent.worker_user import WorkerUser
from common.clock import FakeClock
from proto import trainerd_pb2 as pb
from proto.progress_datagram import ProgressMessage

PYTHON = "/opt/agent/bin/python"
START = 100.0
# Above any Linux pid_max, so the process registry never mistakes a fake pid for a real process.
FIRST_FAKE_PID = 10_000_000


@dataclass(frozen=True)
class SignalSent:
    signum: int
    at: float
    while_running: bool


class FakeProcess:
    def __init__(self, pid: int, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
                 clock: FakeClock):
        self.pid = pid
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.cwd_at_start = sorted(p.name for p in cwd.iterdir())  # what it found in its working directory
        self.log_path = log_path
        self.obeys_sigterm = True
        self.signals: list[SignalSent] = []
        self._clock = clock
        self._returncode: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._returncode)

    def signal_group(self, signum: int) -> None:
        self.signals.append(SignalSent(signum, self._clock.now(), not self._returncode.done()))
        if signum == signal.SIGKILL or (signum == signal.SIGTERM and self.obeys_sigterm):
            self.exit(-signum)

    def write(self, output: str) -> None:
        """What the process prints (stdout and stderr go to its log)."""
        with open(self.log_path, "a") as log_file:
            log_file.write(output)

    def exit(self, returncode: int, output: str = "") -> None:
        if output:
            self.write(output)
        if not self._returncode.done():
            self._returncode.set_result(returncode)

    @property
    def running(self) -> bool:
        return not self._returncode.done()

    def signums(self, while_running: bool | None = None) -> list[int]:
        return [s.signum for s in self.signals if while_running is None or s.while_running == while_running]


class FakeLauncher:
    """Starts FakeProcesses, named by their log file ("rank0", "scheduler"); `cannot_execute` (no such file) and
    `not_permitted` (permission denied) fail."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.started: dict[str, FakeProcess] = {}
        self.prepared: list[tuple[tuple[str, ...], dict[str, str], Path]] = []  # (argv, env, cwd) of each prepare
        self.cannot_execute: set[str] = set()
        self.not_permitted: set[str] = set()

    async def prepare(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        self.prepared.append((tuple(argv), dict(env), cwd))

    async def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> FakeProcess:
        if argv[0] in self.cannot_execute:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", argv[0])
        if argv[0] in self.not_permitted:
            raise PermissionError(errno.EACCES, "Permission denied", argv[0])
        log_path.touch()
        process = FakeProcess(FIRST_FAKE_PID + len(self.started), argv, env, cwd, log_path, self._clock)
        self.started[log_path.stem] = process
        return process


@dataclass(frozen=True)
class DumpAsked:
    pid: int
    at: float
    signalled_before: bool  # the process had already been sent a signal when its stacks were asked for


class FakeStackDumper:
    """Answers with a made-up stack naming the pid; the pids in `hangs` never answer (until cancelled)."""

    def __init__(self, clock: FakeClock, launcher: FakeLauncher) -> None:
        self._clock = clock
        self._launcher = launcher
        self.asked: list[DumpAsked] = []
        self.hangs: set[int] = set()
        self.cancelled: list[int] = []

    async def dump(self, pid: int) -> str:
        process = next(p for p in self._launcher.started.values() if p.pid == pid)
        self.asked.append(DumpAsked(pid, self._clock.now(), bool(process.signals)))
        if pid in self.hangs:
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                self.cancelled.append(pid)
                raise
        return f"Thread {pid} (idle)\n    stuck_in_allreduce (train.py:42)\n"


class Host:
    """One supervisor with its fakes and every report it sent."""

    def __init__(self, work_dir: Path, allowed_entrypoints: Sequence[Sequence[str]] = (("{python}",),),
                 worker_user: WorkerUser | None = None, memory: MemorySnapshotDir | None = None,
                 peers: PeerClient | None = None) -> None:
        self.work_dir = work_dir
        self.clock = FakeClock(start=START)
        self.launcher = FakeLauncher(self.clock)
        self.dumper = FakeStackDumper(self.clock, self.launcher)
        self.reports: list[pb.AgentMessage] = []
        self.supervisor = Supervisor(work_dir=work_dir, progress_socket=work_dir / "progress.sock",
                                     report=self.reports.append, launcher=self.launcher,
                                     stack_dumper=self.dumper, clock=self.clock,
                                     allowed_entrypoints=allowed_entrypoints, worker_user=worker_user, python=PYTHON,
                                     memory=memory, peers=peers)

    def progress(self, message: ProgressMessage) -> None:
        """A progress datagram from the process of its rank."""
        self.supervisor.on_progress(message, self.launcher.started[f"rank{message.rank}"].pid)

    def sent(self, kind: str) -> list:
        return [getattr(m, kind) for m in self.reports if m.WhichOneof("body") == kind]

    async def exited(self, name: str) -> None:
        """Waits until the supervisor has handled the exit of process `name`."""
        role, rank = ("scheduler", -1) if name == "scheduler" else ("worker", int(name.removeprefix("rank")))
        waiter = self.supervisor.processes[(role, rank)].waiter
        assert waiter is not None
        await waiter


def launch(generation: int, workers: int = 2, entrypoint: str = "{python}", script: str = "train.py",
           env: Mapping[str, str] | None = None, **fields) -> Launch:
    """A Launch of job "job": the scheduler and `workers` workers, each running `entrypoint script` and given `env`
    too; `fields` are more Launch fields."""
    env = dict(env or {})
    processes = [ProcessSpec(role="scheduler", rank=-1, argv=(entrypoint, script), env=env)]
    processes += [ProcessSpec(role="worker", rank=r, argv=(entrypoint, script), env={"RANK_ID": str(r), **env})
                  for r in range(workers)]
    return Launch(generation=generation, job_name="job", processes=tuple(processes), rank_table_json="{}", **fields)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))
