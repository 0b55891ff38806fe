"""Runs one generation's training processes on this host and reports what they do.

Each process gets its own process group (so a stop reaches everything it spawned), a log file per
generation and rank, and a waiter that reports its exit at once with code, signal and log tail.
The agent owns every PID: there is no msrun in between. Every process group is recorded
(agent/orphans.py) so that an agent restarted after a crash kills what its predecessor left.
Processes start through a `ProcessLauncher` (agent/launcher.py), stacks are taken through a
`StackDumper` (agent/stack_dump.py) and time is read from a `Clock`, so the stop escalation, the
stack dump before a hang kill and the progress throttling are tested with fakes and no sleeps.

Processes run in the job's working directory, the same for every generation (agent/job_workdir.py).
Per generation directory: rank_table.json, skips.json (the skip ledger at launch), control.json
(rewritten when the coordinator asks for a checkpoint), one log per process and, after a hang, one
<name>.stacks.txt per process.

With a memory directory (agent/snapshots/memory_snapshots.py) the workers snapshot their state into shared
memory the agent owns; agent/snapshots/snapshot_keeper.py prepares it at a Launch (and the snapshot to resume
from, fetching what other hosts hold), copies the ring predecessor's, says in heartbeats and Stop
confirmations what is held, and drops it when the job completed.

Progress comes from two sources. A rank that runs the trainer runtime sends datagrams
(agent/progress_receiver.py); an unmodified script only prints, so `watch_output` reads what each
worker appends to its log (agent/output_follower.py). Once a datagram arrived for a rank, its output
is no longer read: one rank, one source. Both go through the same per-rank throttle. When a process
fails by itself, the root cause is read from the tail of its log (agent/root_cause.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.commands import CheckpointNow, Launch, ProcessSpec, ReadLog, RequestExit, Standby, Stop
from agent.epoch_shapes import EpochShapes, ShapeKey
from agent.generation_dirs import claim_generation_dir, generation_dir, prune_generation_dirs
from agent.job_workdir import UnsafeJobPath, graceful_exit_path, job_workdir
from agent.launch_policy import launch_refusal
from agent.launcher import ProcessHandle, ProcessLauncher
from agent.log_reader import describe_process, log_name, log_path, read_log_range
from agent.orphans import ProcessRegistry
from agent.output_follower import OutputFollower
from agent.output_progress import OutputProgress
from agent.process_state import descends_from, os_state
from agent.root_cause import extract_root_cause
from agent.snapshots import HeldReports, MemorySnapshotDir, PeerClient, SnapshotKeeper, SnapshotUnavailable
from agent.stack_dump import StackDumper
from agent.workdir_files import WorkdirFiles
from agent.worker_user import WorkerUser
from common.atomic_write import write_atomically
from common.clock import Clock
from proto import trainerd_pb2 as pb
from proto.exit_codes import EXIT_CANNOT_EXECUTE, EXIT_CHECKPOINT_UNREADABLE
from proto.launch_env import CONTROL_FILE_ENV, MEMORY_EVERY_ENV, PROGRESS_SOCKET_ENV, SKIPS_FILE_ENV
from proto.progress_datagram import (
    BadBatchReport,
    CheckpointFailedReport,
    CheckpointReport,
    EventReport,
    GuardNoticeReport,
    ProgressMessage,
    WarningReport,
    WorkerEvent,
)
from proto.progress_pattern import ProgressPatternError, compile_progress_pattern
from proto.vocabulary import PYTHON_WORD, CauseKind
from proto.worker_files import ControlFileRequest, SkipList, encode_control, encode_skips

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4000
# The root cause of a failure is looked for in this much of the end of the log.
CAUSE_TAIL_BYTES = 64 * 1024
PROGRESS_FORWARD_INTERVAL_S = 0.5
OUTPUT_POLL_INTERVAL_S = 0.5
STACK_DUMP_TIMEOUT_S = 10.0
# At most one warning this often about progress datagrams from processes that are not their rank's.
FOREIGN_PROGRESS_WARNING_INTERVAL_S = 60.0
# What MindSpore's OnRequestExit callback looks for in its config file.
GRACEFUL_EXIT_REQUEST = b'{"GracefulExit": 1}'
# Every training process runs with Python's fault handler on, unless the agent's or the job's environment
# sets the variable itself: a crash in native code (a MindSpore kernel, a C extension) then prints the
# Python line that ran into it, which becomes the failure's cause (agent/root_cause.py).
FAULT_HANDLER_ENV = {"PYTHONFAULTHANDLER": "1"}


class LaunchRefused(Exception):
    """A Launch whose processes cannot be started at all; the message says why in one line."""


@dataclass
class ManagedProcess:
    role: str
    rank: int
    log_path: Path
    handle: ProcessHandle | None = None
    pid: int = 0
    running: bool = False
    exit_code: int = 0
    signal: int = 0
    expected: bool = False
    fenced_because: str = ""  # its agent stopped it on its own (fence): why
    step: int = 0
    waiter: asyncio.Task | None = None
    cwd: Path | None = None
    output: OutputFollower | None = None  # a worker's progress read from its log
    epoch_shape_key: ShapeKey = ("", (), "")  # its output's epoch shape is kept under this (agent/epoch_shapes.py)
    runtime_reports: bool = False  # it sent a progress datagram: its output is not read for progress
    # Started, or failed to start. Until then it is not reported: a heartbeat taken while the launch
    # awaits an earlier process's start would tell a not-yet-started worker as exited with code 0,
    # which the coordinator takes for a rank that finished.
    launched: bool = False

    def status(self) -> pb.ProcessStatus:
        return pb.ProcessStatus(
            role=self.role, rank=self.rank, pid=self.pid,
            state=pb.PROCESS_RUNNING if self.running else pb.PROCESS_EXITED,
            step=self.step, exit_code=self.exit_code, signal=self.signal, expected=self.expected,
            os_state=os_state(self.pid) if self.running else "")


@dataclass
class _Forwarding:
    last_sent: float | None = None
    pending: pb.Progress | None = None
    sent: pb.Progress | None = None  # the newest progress sent for the rank: what a new session gets again


def log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def expand_argv(argv, python: str) -> list[str]:
    """`{python}` is the agent's own interpreter: never a bare `python` that PATH might resolve."""
    return [python if arg == PYTHON_WORD else arg for arg in argv]


class Supervisor:
    """Carries out Launch, Stop, CheckpointNow, RequestExit and ReadLog for one host; processes start
    through `launcher`, stacks are dumped through `stack_dumper`, and the stop grace, output polling,
    progress throttling and heartbeat timestamps read `clock`. A Launch whose argv starts with none
    of `allowed_entrypoints` (agent/launch_policy.py) starts nothing. With `worker_user` (who the
    launcher starts the processes as), the job's working directory is that user's and the agent
    changes things in it as that user (agent/workdir_files.py)."""

    def __init__(self, *, work_dir: Path, progress_socket: Path, report: Callable[[pb.AgentMessage], None],
                 launcher: ProcessLauncher, stack_dumper: StackDumper, clock: Clock,
                 allowed_entrypoints: Sequence[Sequence[str]], worker_user: WorkerUser | None = None,
                 python: str = sys.executable, memory: MemorySnapshotDir | None = None,
                 peers: PeerClient | None = None) -> None:
        self._work_dir = work_dir
        self.progress_socket = progress_socket
        self._report = report
        self._launcher = launcher
        self._stack_dumper = stack_dumper
        self._clock = clock
        self._python = python
        self._allowed_entrypoints = allowed_entrypoints
        self.worker_user = worker_user
        self._workdir_files = WorkdirFiles(worker_user)
        self.generation = 0
        self._job_name = ""
        self.processes: dict[tuple[str, int], ManagedProcess] = {}
        self._forwarding: dict[int, _Forwarding] = {}
        # The generation's newest checkpoint commit reported: a new session sends it again.
        self._newest_commit: pb.CheckpointSaved | None = None
        # Progress datagrams dropped because their sender was not their rank's process: in all, and
        # since the last warning (at FOREIGN_PROGRESS_WARNING_INTERVAL_S at most).
        self.foreign_progress = 0
        self._foreign_unwarned = 0
        self._foreign_warned_at: float | None = None
        self._workdir: Path | None = None
        self._graceful_exit_file = ""
        self._epoch_shapes = EpochShapes(work_dir)
        self._lock = asyncio.Lock()
        self._registry = ProcessRegistry(work_dir / "processes.json")
        self.memory = memory  # where the workers' in-memory snapshots go (agent/snapshots/memory_snapshots.py)
        self._snapshots = None if memory is None else SnapshotKeeper(
            memory, peers, on_saved=self._checkpoint_saved,
            on_failed=lambda failed: self._report(pb.AgentMessage(checkpoint_failed=failed)))

    def reap_orphans(self) -> int:
        """Kill processes a previous agent on this work dir left running (call before the first launch)."""
        return self._registry.reap_orphans()

    # ------------------------------------------------------------ commands

    async def launch(self, launch: Launch) -> None:
        async with self._lock:
            same_job = launch.job_name == self._job_name or not self._job_name
            if same_job and launch.generation <= self.generation:
                log.info("ignoring Launch of generation %d: already at generation %d", launch.generation,
                         self.generation)
                return
            if not same_job:  # a job under a new name counts its generations from 1 again
                log.info("job %s, generation %d, follows generation %d of job %s", launch.job_name,
                         launch.generation, self.generation, self._job_name)
            await self._stop_all(grace_s=5.0)
            if self._snapshots is not None:
                await self._snapshots.stop_generation()
            self.generation, self._job_name = launch.generation, launch.job_name
            self.processes = {}
            self._forwarding = {}
            self._newest_commit = None
            self._workdir, self._graceful_exit_file = None, ""
            gen_dir = await asyncio.to_thread(claim_generation_dir, self._work_dir, launch.generation,
                                              launch.job_name)
            await asyncio.to_thread(prune_generation_dirs, self._work_dir, launch.generation)
            rank_table = gen_dir / "rank_table.json"
            rank_table.write_text(launch.rank_table_json)
            skips = gen_dir / "skips.json"
            write_atomically(skips, encode_skips(SkipList(tuple((r.start, r.end) for r in launch.skips))))
            control = gen_dir / "control.json"
            control.unlink(missing_ok=True)
            workdir: Path | None = None
            refusal, pattern = launch_refusal(launch, self._allowed_entrypoints) or "", None
            if not refusal:
                try:
                    workdir = await self._prepare_workdir(launch)
                except LaunchRefused as exc:
                    refusal = str(exc)
            unavailable = ""  # why the snapshot the workers resume from cannot be had: they are not started
            if refusal:
                log.error("generation %d of job %s not launched: %s", launch.generation, launch.job_name, refusal)
            else:
                pattern = self._progress_pattern(launch)
                try:
                    memory_env = ({MEMORY_EVERY_ENV: "0"} if self._snapshots is None
                                  else await self._snapshots.launch_env(launch))
                except SnapshotUnavailable as exc:
                    memory_env, unavailable = {}, str(exc)
                log.info("launching generation %d of job %s in %s: %d process(es)", launch.generation,
                         launch.job_name, workdir, len(launch.processes))
            starts: list[tuple[ManagedProcess, list[str], dict[str, str]]] = []
            for spec in launch.processes:
                managed = ManagedProcess(spec.role, spec.rank, gen_dir / f"{log_name(spec.role, spec.rank)}.log")
                self.processes[(spec.role, spec.rank)] = managed
                if workdir is None:
                    self._fail_to_start(managed, refusal, kind=CauseKind.LAUNCH_REFUSED)
                    continue
                if unavailable and spec.role == "worker":
                    self._fail_to_start(managed, unavailable, EXIT_CHECKPOINT_UNREADABLE)
                    continue
                env = {**self._base_env(spec), "RANK_TABLE_FILE": str(rank_table),
                       PROGRESS_SOCKET_ENV: str(self.progress_socket),
                       CONTROL_FILE_ENV: str(control), SKIPS_FILE_ENV: str(skips), **memory_env}
                argv = expand_argv(spec.argv, self._python)
                managed.epoch_shape_key = (launch.job_name, tuple(argv), env.get("RANK_SIZE", ""))
                starts.append((managed, argv, env))
            if workdir is not None:
                for _, argv, env in starts:  # side by side: warm templates import at once (agent/warm_launcher.py)
                    await self._launcher.prepare(argv, env, workdir)
                for managed, argv, env in starts:
                    await self._start(managed, argv, env, workdir, pattern)

    async def _prepare_workdir(self, launch: Launch | Standby) -> Path:
        """The generation's working directory, created, with no graceful-exit request left in it (a
        leftover would stop the new generation at its first step).

        Raises:
            LaunchRefused: a path in the Launch is unsafe, or the directory cannot be prepared.
        """
        graceful_exit_file = launch.graceful_exit_file if isinstance(launch, Launch) else ""
        try:
            workdir = job_workdir(self._work_dir, launch.job_name, launch.workdir)
            graceful_exit = graceful_exit_path(workdir, graceful_exit_file) if graceful_exit_file else None
            if launch.workdir:
                await self._workdir_files.make_dirs(workdir)
            else:
                self._workdir_files.make_default(workdir)
            if graceful_exit is not None:
                await self._workdir_files.remove(graceful_exit)
        except UnsafeJobPath as exc:
            raise LaunchRefused(f"refused to launch: {exc}") from None
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            raise LaunchRefused(f"cannot prepare the working directory{where}: {exc.strerror or exc}") from None
        if isinstance(launch, Launch):
            self._workdir, self._graceful_exit_file = workdir, graceful_exit_file
        return workdir

    @staticmethod
    def _base_env(spec: ProcessSpec) -> dict[str, str]:
        """A process's environment before the generation's own files and sockets: all a warm template's depends
        on (agent/import_env.py), so a Standby prepares the template the Launch forks from."""
        return {**FAULT_HANDLER_ENV, **os.environ, **dict(spec.env)}

    async def stand_by(self, standby: Standby) -> None:
        """A spare of the job's running generation: start what its processes would be forked from (the warm
        templates), so that a relaunch that puts it in a lost node's place starts them warm. Nothing starts
        here; a node running processes of its own ignores it."""
        async with self._lock:
            if any(m.running for m in self.processes.values()):
                log.info("not standing by for generation %d of job %s: this node runs generation %d",
                         standby.generation, standby.job_name, self.generation)
                return
            refusal = launch_refusal(standby, self._allowed_entrypoints)
            if refusal:
                log.error("not standing by for generation %d of job %s: %s", standby.generation, standby.job_name,
                          refusal)
                return
            try:
                workdir = await self._prepare_workdir(standby)
            except LaunchRefused as exc:
                log.error("not standing by for generation %d of job %s: %s", standby.generation, standby.job_name,
                          exc)
                return
            for spec in standby.processes:
                await self._launcher.prepare(expand_argv(spec.argv, self._python), self._base_env(spec), workdir)
            log.info("standing by for generation %d of job %s: ready to start %d worker(s) in %s",
                     standby.generation, standby.job_name, len(standby.processes), workdir)

    def _progress_pattern(self, launch: Launch) -> re.Pattern[str] | None:
        if not launch.progress_pattern:
            return None
        try:
            return compile_progress_pattern(launch.progress_pattern)
        except ProgressPatternError as exc:
            log.error("generation %d of job %s: the progress_pattern cannot be used (%s); reading "
                      "MindSpore's LossMonitor lines instead", launch.generation, launch.job_name, exc)
            return None

    def _fail_to_start(self, managed: ManagedProcess, message: str, exit_code: int = EXIT_CANNOT_EXECUTE,
                       kind: str = CauseKind.LAST_LINE) -> None:
        """Report a process that was not started as exited `exit_code`, with `message` as its log and root
        cause (of `kind`: CauseKind.LAUNCH_REFUSED when this agent refused the Launch)."""
        with open(managed.log_path, "ab") as log_file:
            log_file.write(message.encode() + b"\n")
        log.error("%s: %s", describe_process(self.generation, managed.role, managed.rank), message)
        managed.exit_code, managed.launched = exit_code, True
        self._report(pb.AgentMessage(process_exited=pb.ProcessExited(
            generation=self.generation, role=managed.role, rank=managed.rank, exit_code=exit_code,
            log_tail=message, cause=pb.RootCause(message=message, kind=kind))))

    async def _start(self, managed: ManagedProcess, argv: list[str], env: dict[str, str], cwd: Path,
                     pattern: re.Pattern[str] | None) -> None:
        generation = self.generation
        managed.cwd = cwd
        if managed.role == "worker":
            managed.output = OutputFollower(managed.log_path, pattern, self._epoch_shapes.get(managed.epoch_shape_key))
        try:
            handle = await self._launcher.start(argv, env, cwd, managed.log_path)
        except OSError as exc:
            managed.output = None
            self._fail_to_start(managed, self._start_failure(argv[0], exc))
            return
        except ValueError as exc:  # what the system cannot pass, e.g. a variable named "A=B": once lost unreported
            managed.output = None
            self._fail_to_start(managed, f"refused to launch {argv[0]!r:.200}: {exc}", kind=CauseKind.LAUNCH_REFUSED)
            return
        managed.handle, managed.pid = handle, handle.pid
        managed.running = managed.launched = True
        self._registry.add(managed.pid)
        log.info("%s started (pid %d)", describe_process(generation, managed.role, managed.rank), managed.pid)
        self._report(pb.AgentMessage(process_started=pb.ProcessStarted(
            generation=generation, role=managed.role, rank=managed.rank, pid=managed.pid)))
        managed.waiter = asyncio.get_running_loop().create_task(self._wait(managed, handle, generation))

    def _start_failure(self, program: str, exc: OSError) -> str:
        """Why `program` did not start; with `run_as`, as whom, and what that user lacks when it was refused."""
        user = self.worker_user
        if user is None:
            return f"cannot start {program!r}: {exc.strerror or exc}"
        lacks = (f" (run_as: {user.name} needs read and execute on it, on the directories above it and on the "
                 f"training code)" if isinstance(exc, PermissionError) else "")
        return f"cannot start {program!r} as user {user.name}: {exc.strerror or exc}{lacks}"

    async def _wait(self, managed: ManagedProcess, handle: ProcessHandle, generation: int) -> None:
        code = await handle.wait()
        managed.running = False
        handle.signal_group(signal.SIGKILL)  # whatever it spawned and left behind
        self._registry.discard(managed.pid)
        if code < 0:
            managed.signal, managed.exit_code = -code, 0
        else:
            managed.exit_code = code
        if managed.output is not None:
            if not managed.runtime_reports:
                self._observe_output(managed, generation, managed.output.finish())
            managed.output = None
        tail = log_tail(managed.log_path)
        failed = code != 0 and not managed.expected
        cause: pb.RootCause | None = None
        if managed.fenced_because:
            cause = pb.RootCause(kind=CauseKind.FENCED, message=f"stopped by its agent: {managed.fenced_because}")
        elif failed:
            cause = self._root_cause(managed)
        # The last line a killed process printed (a LossMonitor line, say) is where it was cut off, not why.
        told = cause if cause is not None and not (managed.signal and cause.kind == CauseKind.LAST_LINE) else None
        level = logging.WARNING if failed else logging.INFO
        log.log(level, "%s (pid %d) exited: code %d signal %d%s",
                describe_process(generation, managed.role, managed.rank), managed.pid, managed.exit_code,
                managed.signal, f"; cause: {told.message} at {told.location or 'unknown location'}" if told else "")
        if managed.role == "worker":
            self._flush_progress(managed.rank)
        self._report(pb.AgentMessage(process_exited=pb.ProcessExited(
            generation=generation, role=managed.role, rank=managed.rank, pid=managed.pid,
            exit_code=managed.exit_code, signal=managed.signal, log_tail=tail, expected=managed.expected,
            cause=cause)))

    @staticmethod
    def _root_cause(managed: ManagedProcess) -> pb.RootCause | None:
        """Why the process failed, from the end of its log, with locations relative to its working directory."""
        cause = extract_root_cause(log_tail(managed.log_path, CAUSE_TAIL_BYTES),
                                      work_dir=None if managed.cwd is None else str(managed.cwd))
        if cause is None:
            return None
        return pb.RootCause(message=cause.message, location=cause.location or "", kind=str(cause.kind))

    async def stop(self, stop: Stop) -> None:
        async with self._lock:
            if stop.generation != self.generation:
                log.info("Stop for generation %d ignored: running generation %d", stop.generation, self.generation)
                return
            log.info("stopping generation %d: %s", stop.generation, stop.reason)
            if stop.dump_stacks:
                await self._dump_stacks()
            await self._stop_all(stop.grace_s)
            if self._snapshots is not None:
                if stop.job_completed:
                    await self._snapshots.drop(self._job_name)
                else:
                    await self._snapshots.stop_generation()
            stopped = pb.Stopped(generation=stop.generation)
            held = self._held()
            if held.newest is not None:
                stopped.memory_snapshot.CopyFrom(held.newest)
            stopped.held_snapshots.extend(held.held)
            self._report(pb.AgentMessage(stopped=stopped))

    async def _dump_stacks(self) -> None:
        """Append every running process's Python stacks to its log and to <name>.stacks.txt, all at
        once, waiting at most STACK_DUMP_TIMEOUT_S: the kill that follows is not held up longer."""
        live = [m for m in self.processes.values() if m.running]
        if not live:
            return
        dumps = {asyncio.ensure_future(self._stack_dumper.dump(m.pid)): m for m in live}
        pending = await self._wait_at_most(list(dumps), STACK_DUMP_TIMEOUT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task, managed in dumps.items():
            if task in pending:
                text = f"the stack dump did not finish within {STACK_DUMP_TIMEOUT_S:.0f}s\n"
            elif task.exception() is not None:
                text = f"the stack dump failed: {task.exception()}\n"
            else:
                text = task.result()
            self._write_stacks(managed, text)
        log.info("generation %d: Python stacks of %d process(es) written before the hang kill", self.generation,
                 len(dumps))

    def _write_stacks(self, managed: ManagedProcess, text: str) -> None:
        who = "the scheduler" if managed.role == "scheduler" else f"rank {managed.rank}"
        header = f"==== trainerd: Python stacks of {who} (pid {managed.pid}) before the hang kill ====\n"
        try:
            with open(managed.log_path, "a", encoding="utf-8", errors="replace") as log_file:
                log_file.write(f"\n{header}{text}")
            stacks = managed.log_path.with_name(f"{log_name(managed.role, managed.rank)}.stacks.txt")
            stacks.write_text(header + text, encoding="utf-8", errors="replace")
        except OSError as exc:
            log.warning("%s: cannot write its stacks: %s",
                        describe_process(self.generation, managed.role, managed.rank), exc)

    async def fence(self, grace_s: float, reason: str) -> bool:
        """Stop this generation's processes on the agent's own decision (agent/fence.py): SIGTERM, SIGKILL
        after `grace_s`. Their exits are reported as unexpected: no coordinator asked for them. True when
        there was something to stop."""
        async with self._lock:
            if not any(m.running for m in self.processes.values()):
                return False
            log.warning("fencing generation %d: %s; stopping its processes (SIGKILL after %.1fs)", self.generation,
                        reason, grace_s)
            for managed in self.processes.values():
                if managed.running:
                    managed.fenced_because = reason
            await self._stop_all(grace_s, expected=False)
            return True

    async def _stop_all(self, grace_s: float, *, expected: bool = True) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace, wait for every exit.
        `expected`: the exits follow a Stop (or the agent's own shutdown), they are no failure."""
        live = [(m, m.handle) for m in self.processes.values() if m.running and m.handle is not None]
        for managed, handle in live:
            managed.expected = expected
            handle.signal_group(signal.SIGTERM)
        waiters = [m.waiter for m, _ in live if m.waiter is not None]
        if not waiters:
            return
        pending = await self._wait_at_most(waiters, grace_s)
        if pending:
            for managed, handle in live:
                if managed.running:
                    log.warning("%s (pid %d) ignored SIGTERM for %.1fs; killing its process group",
                                describe_process(self.generation, managed.role, managed.rank), managed.pid, grace_s)
                    handle.signal_group(signal.SIGKILL)
            await asyncio.wait(pending)
        for _, handle in live:  # children a process left behind in its group
            handle.signal_group(signal.SIGKILL)

    async def _wait_at_most(self, tasks: list[asyncio.Task], timeout_s: float) -> set[asyncio.Task]:
        """Waits until every task is done or `timeout_s` has passed on the clock; returns those not done."""
        pending = set(tasks)
        timer = asyncio.ensure_future(self._clock.asleep(timeout_s))
        try:
            while pending and not timer.done():
                done, _ = await asyncio.wait({timer, *pending}, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
        finally:
            timer.cancel()
        return pending

    def checkpoint_now(self, request: CheckpointNow) -> None:
        """Tell this generation's workers to save once `request.step` completes (they poll the file)."""
        if request.generation != self.generation or not self.processes:
            log.info("CheckpointNow for generation %d ignored: running generation %d", request.generation,
                     self.generation)
            return
        write_atomically(generation_dir(self._work_dir, self.generation) / "control.json",
                         encode_control(ControlFileRequest(request.generation, request.step)))
        log.info("generation %d: checkpoint asked for at step %d", request.generation, request.step)

    async def request_exit(self, request: RequestExit) -> None:
        """Ask the script to stop at its next step boundary: write MindSpore OnRequestExit's file."""
        async with self._lock:
            await self._request_exit(request)

    async def _request_exit(self, request: RequestExit) -> None:
        if request.generation != self.generation or not self.processes:
            log.info("RequestExit for generation %d ignored: running generation %d", request.generation,
                     self.generation)
            return
        if self._workdir is None or not self._graceful_exit_file:
            log.info("RequestExit for generation %d ignored: the job names no graceful_exit_file", request.generation)
            return
        try:
            # Resolved again: a symlink planted since the launch must not lead the write out of the workdir.
            path = graceful_exit_path(self._workdir, self._graceful_exit_file)
            await self._workdir_files.make_dirs(path.parent)
            await self._workdir_files.replace(path, GRACEFUL_EXIT_REQUEST)
        except (UnsafeJobPath, OSError) as exc:
            log.error("generation %d: cannot request a graceful exit: %s", request.generation, exc)
            return
        log.info("generation %d: graceful exit requested through %s", request.generation, path)

    async def read_log(self, request: ReadLog) -> pb.LogData:
        """Part of one process's log, found by its generation, role and rank under this agent's work dir."""
        answer = pb.LogData(request_id=request.request_id)
        who = describe_process(request.generation, request.role, request.rank)
        path = log_path(self._work_dir, request.generation, request.role, request.rank)
        if path is None:
            answer.error = f"no log for {who}"
            return answer
        try:
            part = await asyncio.to_thread(read_log_range, path, request.offset, request.max_bytes)
        except FileNotFoundError:
            answer.error = f"no log for {who}"
            return answer
        except OSError as exc:
            answer.error = f"cannot read the log of {who}: {exc.strerror or exc}"
            return answer
        answer.data, answer.offset, answer.size = part.data, part.offset, part.size
        rank = -1 if request.role == "scheduler" else request.rank
        managed = self.processes.get((request.role, rank)) if request.generation == self.generation else None
        answer.running = managed is not None and managed.running
        return answer

    async def shutdown(self, grace_s: float = 10.0) -> None:
        async with self._lock:
            await self._stop_all(grace_s)
            if self._snapshots is not None:
                await self._snapshots.stop_generation()

    # ------------------------------------------------------------ reports

    def heartbeat(self) -> pb.Heartbeat:
        for rank in list(self._forwarding):
            self._flush_progress(rank)
        heartbeat = pb.Heartbeat(generation=self.generation, sent_at=self._clock.wall(),
                                 processes=[m.status() for m in self.processes.values() if m.launched])
        held = self._held()
        if held.newest is not None:
            heartbeat.memory_snapshot.CopyFrom(held.newest)
        heartbeat.held_snapshots.extend(held.held)
        return heartbeat

    def _held(self) -> HeldReports:
        """The in-memory snapshots of the job held here (agent/snapshots/snapshot_keeper.py)."""
        return HeldReports() if self._snapshots is None else self._snapshots.reports()

    async def watch_output(self) -> None:
        """Read what the running workers append to their logs every OUTPUT_POLL_INTERVAL_S, until cancelled."""
        while True:
            self.read_output()
            await self._clock.asleep(OUTPUT_POLL_INTERVAL_S)

    def read_output(self) -> None:
        """One poll: the progress in what each running worker wrote since the last one."""
        for managed in list(self.processes.values()):
            if managed.running and managed.output is not None and not managed.runtime_reports:
                self._observe_output(managed, self.generation, managed.output.read())

    def _observe_output(self, managed: ManagedProcess, generation: int, observations: list[OutputProgress]) -> None:
        shape = None if managed.output is None else managed.output.epoch_shape
        if shape is not None:
            self._epoch_shapes.remember(managed.epoch_shape_key, shape)
        for observation in observations:
            if observation.loss is None and observation.samples_per_s is None and observation.step <= managed.step:
                continue  # a step-time line after its step: nothing new to report
            managed.step = max(managed.step, observation.step)
            progress = pb.Progress(
                generation=generation, rank=managed.rank, step=observation.step,
                loss=math.nan if observation.loss is None else observation.loss,
                samples_per_s=observation.samples_per_s or 0.0, from_output=True)
            if observation.epoch is not None:
                progress.epoch = observation.epoch
            self._forward(progress)

    def on_progress(self, message: ProgressMessage, sender_pid: int) -> None:
        """Relay a worker's progress; steps are sent at most every 0.5 s per rank (the first at once).

        Only the process launched for the message's rank, or one it started (a worker may report from
        a child), may report for it: anything else on this host could write to the socket.
        """
        if message.generation != self.generation:
            return
        managed = self.processes.get(("worker", message.rank))
        if managed is None:
            return
        if not (sender_pid == managed.pid or (managed.running and descends_from(sender_pid, managed.pid))):
            self._drop_foreign_progress(message, managed, sender_pid)
            return
        if not managed.runtime_reports:
            # From now on this rank's progress is the runtime's: its step replaces the one read from the output.
            managed.runtime_reports = True
            managed.step = 0
            forwarding = self._forwarding.get(message.rank)
            if forwarding is not None:
                if forwarding.pending is not None and forwarding.pending.from_output:
                    forwarding.pending = None
                if forwarding.sent is not None and forwarding.sent.from_output:
                    forwarding.sent = None
        managed.step = max(managed.step, message.step)
        if isinstance(message, EventReport):
            if message.event is not WorkerEvent.STARTED:
                self._between_steps(message.rank, message.event)
            return
        if isinstance(message, CheckpointReport):
            self._checkpoint_saved(pb.CheckpointSaved(generation=message.generation, step=message.step,
                                                      consumed_samples=message.consumed_samples, path=message.path))
            return
        if isinstance(message, CheckpointFailedReport):
            self._report(pb.AgentMessage(checkpoint_failed=pb.CheckpointFailed(
                generation=message.generation, rank=message.rank, step=message.step, reason=message.reason)))
            return
        if isinstance(message, GuardNoticeReport):
            self._report(pb.AgentMessage(guard_notice=pb.GuardNotice(
                generation=message.generation, rank=message.rank, step=message.step, notice=str(message.notice),
                detail=message.detail)))
            return
        if isinstance(message, WarningReport):
            self._report(pb.AgentMessage(worker_warning=pb.WorkerWarning(
                generation=message.generation, rank=message.rank, step=message.step, text=message.text)))
            return
        if isinstance(message, BadBatchReport):
            self._report(pb.AgentMessage(bad_batch=pb.BadBatch(
                generation=message.generation, rank=message.rank, step=message.step,
                sample_start=message.sample_start, sample_end=message.sample_end, reason=str(message.reason),
                loss=message.loss, grad_norm=message.grad_norm)))
            return
        progress = pb.Progress(
            generation=message.generation, rank=message.rank, step=message.step, loss=message.loss,
            grad_norm=message.grad_norm, samples_per_s=message.samples_per_s,
            consumed_samples=message.consumed_samples, checkpoint_stall_s=message.checkpoint_stall_s,
            epoch=message.epoch)
        if message.startup is not None:
            progress.startup.CopyFrom(pb.RankStartup(**message.startup.to_wire()))
        self._forward(progress)

    def _between_steps(self, rank: int, event: WorkerEvent) -> None:
        """The rank evaluates between steps, or has ended its training loop: its newest step report goes
        again, marked so (the coordinator takes it as a sign of life, not a step; after the end, no step is
        awaited). Nothing before its first step report."""
        forwarding = self._forwarding.get(rank)
        newest = None if forwarding is None else (forwarding.pending or forwarding.sent)
        if newest is None or newest.from_output:
            return
        progress = pb.Progress()
        progress.CopyFrom(newest)
        progress.evaluating = event is WorkerEvent.EVALUATING
        progress.training_finished = event is WorkerEvent.FINISHED
        self._forward(progress)
        if progress.training_finished:
            self._flush_progress(rank)  # at once: the process may exit next

    def _checkpoint_saved(self, saved: pb.CheckpointSaved) -> None:
        """A commit of this generation, by its rank 0 or by this agent for it: reported, and kept to report
        again on a new session."""
        if saved.generation != self.generation:
            return
        if self._newest_commit is None or saved.step >= self._newest_commit.step:
            self._newest_commit = saved
        for rank in list(self._forwarding):  # the step goes first: the coordinator believes no commit beyond it
            self._flush_progress(rank)
        self._report(pb.AgentMessage(checkpoint_saved=saved))

    def _drop_foreign_progress(self, message: ProgressMessage, managed: ManagedProcess, sender_pid: int) -> None:
        self.foreign_progress += 1
        self._foreign_unwarned += 1
        now = self._clock.now()
        if self._foreign_warned_at is not None and now - self._foreign_warned_at < FOREIGN_PROGRESS_WARNING_INTERVAL_S:
            return
        log.warning("generation %d of job %s: dropped %d progress datagram(s) not sent by the process of their "
                    "rank nor one it started (%d in all); the last, for rank %d (pid %d), came from pid %d",
                    self.generation, self._job_name, self._foreign_unwarned, self.foreign_progress, message.rank,
                    managed.pid, sender_pid)
        self._foreign_warned_at, self._foreign_unwarned = now, 0

    def _forward(self, progress: pb.Progress) -> None:
        """Send `progress` now if its rank sent nothing for PROGRESS_FORWARD_INTERVAL_S, else hold it
        back (replacing what was held) until then or the next heartbeat."""
        forwarding = self._forwarding.setdefault(progress.rank, _Forwarding())
        held = forwarding.pending
        if held is not None and held.HasField("startup") and not progress.HasField("startup"):
            progress.startup.CopyFrom(held.startup)  # the rank's start-up times are told once: never dropped
        forwarding.pending = progress
        now = self._clock.now()
        if forwarding.last_sent is None or now - forwarding.last_sent >= PROGRESS_FORWARD_INTERVAL_S:
            forwarding.last_sent = now
            self._flush_progress(progress.rank)

    def _flush_progress(self, rank: int) -> None:
        forwarding = self._forwarding.get(rank)
        if forwarding is None or forwarding.pending is None:
            return
        progress, forwarding.pending = forwarding.pending, None
        forwarding.sent = progress
        self._report(pb.AgentMessage(progress=progress))

    def resend_reports(self) -> None:
        """A new session began (a reconnect, maybe to a new leader): send each rank's newest progress and the
        current generation's newest checkpoint commit again, in that order (the coordinator believes no commit
        beyond the steps reported). Those sent before may have been lost
        with the old session, or reached a leader that lost office before it recorded them: without
        them a new leader's status shows no step until the next report, and its checkpoint catalog
        misses a commit it would resume from. The coordinator takes a report it already has as a no-op.
        What is held is one message per rank and one commit, replaced as newer ones come."""
        for rank, forwarding in list(self._forwarding.items()):
            if forwarding.pending is not None:
                self._flush_progress(rank)  # newer than what was sent
            elif forwarding.sent is not None:
                self._report(pb.AgentMessage(progress=forwarding.sent))
        if self._newest_commit is not None:  # after the steps: the coordinator believes no commit beyond them
            self._report(pb.AgentMessage(checkpoint_saved=self._newest_commit))
