"""Runs one generation's training processes on this host and reports what they do.

Each process gets its own process group (so a stop reaches everything it spawned), a log file per
generation and rank, and a waiter that reports its exit at once with code, signal and log tail.
The agent owns every PID: there is no msrun in between. Every process group is recorded
(agent/orphans.py) so that an agent restarted after a crash kills what its predecessor left.
Processes start through a `ProcessLauncher` (agent/launcher.py) and time is read from a `Clock`,
so the stop escalation and the progress throttling are tested with fakes and no sleeps.

Per generation directory: rank_table.json, skips.json (the skip ledger at launch), control.json
(rewritten when the coordinator asks for a checkpoint) and one log per process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent.launcher import ProcessHandle, ProcessLauncher
from agent.orphans import ProcessRegistry
from common.clock import Clock
from proto import trainerd_pb2 as pb
from proto.exit_codes import EXIT_CANNOT_EXECUTE
from proto.progress_datagram import BadBatchReport, CheckpointReport, EventReport, ProgressMessage, StepReport
from proto.worker_files import CheckpointRequest, SkipList, encode_control, encode_skips, write_atomically

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4000
PROGRESS_FORWARD_INTERVAL_S = 0.5


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
    step: int = 0
    waiter: asyncio.Task | None = None

    def status(self) -> pb.ProcessStatus:
        return pb.ProcessStatus(
            role=self.role, rank=self.rank, pid=self.pid,
            state=pb.PROCESS_RUNNING if self.running else pb.PROCESS_EXITED,
            step=self.step, exit_code=self.exit_code, signal=self.signal, expected=self.expected)


@dataclass
class _Forwarding:
    last_sent: float | None = None
    pending: StepReport | None = None


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
    return [python if arg == "{python}" else arg for arg in argv]


class Supervisor:
    """Carries out Launch, Stop and CheckpointNow for one host; processes start through `launcher`,
    and the stop grace, progress throttling and heartbeat timestamps read `clock`."""

    def __init__(self, *, work_dir: Path, progress_socket: Path, report: Callable[[pb.AgentMessage], None],
                 launcher: ProcessLauncher, clock: Clock, python: str = sys.executable) -> None:
        self._work_dir = work_dir
        self.progress_socket = progress_socket
        self._report = report
        self._launcher = launcher
        self._clock = clock
        self._python = python
        self.generation = 0
        self.processes: dict[tuple[str, int], ManagedProcess] = {}
        self._forwarding: dict[int, _Forwarding] = {}
        self._lock = asyncio.Lock()
        self._registry = ProcessRegistry(work_dir / "processes.json")

    def reap_orphans(self) -> int:
        """Kill processes a previous agent on this work dir left running (call before the first launch)."""
        return self._registry.reap_orphans()

    # ------------------------------------------------------------ commands

    async def launch(self, launch: pb.Launch) -> None:
        async with self._lock:
            if launch.generation <= self.generation:
                log.info("ignoring Launch of generation %d: already at generation %d", launch.generation,
                         self.generation)
                return
            await self._stop_all(grace_s=5.0)
            self.generation = launch.generation
            self.processes = {}
            self._forwarding = {}
            gen_dir = self._generation_dir(launch.generation)
            gen_dir.mkdir(parents=True, exist_ok=True)
            rank_table = gen_dir / "rank_table.json"
            rank_table.write_text(launch.rank_table_json)
            skips = gen_dir / "skips.json"
            write_atomically(skips, encode_skips(SkipList(tuple((r.start, r.end) for r in launch.skips))))
            control = gen_dir / "control.json"
            control.unlink(missing_ok=True)
            log.info("launching generation %d of job %s: %d process(es)", launch.generation, launch.job_name,
                     len(launch.processes))
            for spec in launch.processes:
                name = "scheduler" if spec.role == "scheduler" else f"rank{spec.rank}"
                managed = ManagedProcess(spec.role, spec.rank, gen_dir / f"{name}.log")
                self.processes[(spec.role, spec.rank)] = managed
                env = {**os.environ, **dict(spec.env), "RANK_TABLE_FILE": str(rank_table),
                       "TRAINERD_PROGRESS_SOCKET": str(self.progress_socket),
                       "TRAINERD_CONTROL_FILE": str(control), "TRAINERD_SKIPS_FILE": str(skips)}
                await self._start(managed, expand_argv(spec.argv, self._python), env, gen_dir)

    async def _start(self, managed: ManagedProcess, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        generation = self.generation
        try:
            handle = await self._launcher.start(argv, env, cwd, managed.log_path)
        except OSError as exc:
            message = f"cannot start {argv[0]!r}: {exc.strerror or exc}"
            with open(managed.log_path, "ab") as log_file:
                log_file.write(message.encode() + b"\n")
            log.error("generation %d %s %d: %s", generation, managed.role, managed.rank, message)
            managed.exit_code = EXIT_CANNOT_EXECUTE
            self._report(pb.AgentMessage(process_exited=pb.ProcessExited(
                generation=generation, role=managed.role, rank=managed.rank, exit_code=EXIT_CANNOT_EXECUTE,
                log_tail=message)))
            return
        managed.handle, managed.pid = handle, handle.pid
        managed.running = True
        self._registry.add(managed.pid)
        self._report(pb.AgentMessage(process_started=pb.ProcessStarted(
            generation=generation, role=managed.role, rank=managed.rank, pid=managed.pid)))
        managed.waiter = asyncio.get_running_loop().create_task(self._wait(managed, handle, generation))

    async def _wait(self, managed: ManagedProcess, handle: ProcessHandle, generation: int) -> None:
        code = await handle.wait()
        managed.running = False
        handle.signal_group(signal.SIGKILL)  # whatever it spawned and left behind
        self._registry.discard(managed.pid)
        if code < 0:
            managed.signal, managed.exit_code = -code, 0
        else:
            managed.exit_code = code
        tail = log_tail(managed.log_path)
        level = logging.INFO if managed.expected or code == 0 else logging.WARNING
        log.log(level, "generation %d %s %d (pid %d) exited: code %d signal %d", generation, managed.role,
                managed.rank, managed.pid, managed.exit_code, managed.signal)
        self._flush_progress(managed.rank)
        self._report(pb.AgentMessage(process_exited=pb.ProcessExited(
            generation=generation, role=managed.role, rank=managed.rank, pid=managed.pid,
            exit_code=managed.exit_code, signal=managed.signal, log_tail=tail, expected=managed.expected)))

    async def stop(self, stop: pb.Stop) -> None:
        async with self._lock:
            if stop.generation != self.generation:
                log.info("Stop for generation %d ignored: running generation %d", stop.generation, self.generation)
                return
            log.info("stopping generation %d: %s", stop.generation, stop.reason)
            await self._stop_all(stop.grace_s)
            self._report(pb.AgentMessage(stopped=pb.Stopped(generation=stop.generation)))

    async def _stop_all(self, grace_s: float) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace, wait for every exit."""
        live = [(m, m.handle) for m in self.processes.values() if m.running and m.handle is not None]
        for managed, handle in live:
            managed.expected = True
            handle.signal_group(signal.SIGTERM)
        waiters = [m.waiter for m, _ in live if m.waiter is not None]
        if not waiters:
            return
        pending = await self._wait_at_most(waiters, grace_s)
        if pending:
            for managed, handle in live:
                if managed.running:
                    log.warning("generation %d %s %d (pid %d) ignored SIGTERM for %.1fs; killing its process group",
                                self.generation, managed.role, managed.rank, managed.pid, grace_s)
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

    def checkpoint_now(self, request: pb.CheckpointNow) -> None:
        """Tell this generation's workers to save once `request.step` completes (they poll the file)."""
        if request.generation != self.generation or not self.processes:
            log.info("CheckpointNow for generation %d ignored: running generation %d", request.generation,
                     self.generation)
            return
        write_atomically(self._generation_dir(self.generation) / "control.json",
                         encode_control(CheckpointRequest(request.generation, request.step)))
        log.info("generation %d: checkpoint asked for at step %d", request.generation, request.step)

    def _generation_dir(self, generation: int) -> Path:
        return self._work_dir / "generations" / f"{generation:06d}"

    async def shutdown(self, grace_s: float = 10.0) -> None:
        async with self._lock:
            await self._stop_all(grace_s)

    # ------------------------------------------------------------ reports

    def heartbeat(self) -> pb.Heartbeat:
        for rank in list(self._forwarding):
            self._flush_progress(rank)
        return pb.Heartbeat(generation=self.generation, sent_at=self._clock.wall(),
                            processes=[m.status() for m in self.processes.values()])

    def on_progress(self, message: ProgressMessage) -> None:
        """Relay a worker's progress; steps are sent at most every 0.5 s per rank (the first at once)."""
        if message.generation != self.generation:
            return
        managed = self.processes.get(("worker", message.rank))
        if managed is None:
            return
        managed.step = max(managed.step, message.step)
        if isinstance(message, EventReport):
            return
        if isinstance(message, CheckpointReport):
            self._report(pb.AgentMessage(checkpoint_saved=pb.CheckpointSaved(
                generation=message.generation, step=message.step, consumed_samples=message.consumed_samples,
                path=message.path)))
            return
        if isinstance(message, BadBatchReport):
            self._report(pb.AgentMessage(bad_batch=pb.BadBatch(
                generation=message.generation, rank=message.rank, step=message.step,
                sample_start=message.sample_start, sample_end=message.sample_end, reason=str(message.reason),
                loss=message.loss, grad_norm=message.grad_norm)))
            return
        forwarding = self._forwarding.setdefault(message.rank, _Forwarding())
        forwarding.pending = message
        now = self._clock.now()
        if forwarding.last_sent is None or now - forwarding.last_sent >= PROGRESS_FORWARD_INTERVAL_S:
            forwarding.last_sent = now
            self._flush_progress(message.rank)

    def _flush_progress(self, rank: int) -> None:
        forwarding = self._forwarding.get(rank)
        if forwarding is None or forwarding.pending is None:
            return
        step, forwarding.pending = forwarding.pending, None
        self._report(pb.AgentMessage(progress=pb.Progress(
            generation=step.generation, rank=step.rank, step=step.step, loss=step.loss, grad_norm=step.grad_norm,
            samples_per_s=step.samples_per_s, consumed_samples=step.consumed_samples)))
