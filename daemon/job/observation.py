"""What the leader has seen of the current generation, rebuilt from agent reports.

Kept in memory only: heartbeats carry every process of the agent's generation (exited ones too),
so a newly elected leader rebuilds it within one heartbeat interval. Times are the coordinator's
monotonic clock; a new leader starts them at its takeover.

Progress comes through two channels: the trainer runtime's reports, and lines the agent reads from
a rank's output (`from_output`, e.g. MindSpore's LossMonitor, whose step counts within the epoch:
progress is ordered by (epoch, step)).
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field, replace

from daemon.job.state import SnapshotHolder, communication_error, error_key
from proto.progress_datagram import StartupTimes
from proto.vocabulary import FROZEN_OS_STATES, CauseKind, ProcessRole


@dataclass(frozen=True)
class RootCause:
    """Why a process failed, in one line, as the agent read it from the process's output."""

    message: str  # e.g. "FileNotFoundError: [Errno 2] No such file or directory: 'data'"
    location: str = ""  # innermost "file:line" of a Python traceback, when there is one
    kind: str = ""  # a CauseKind value: "python_exception", "fatal_error", "mindspore_error" or "last_line"

    @property
    def line(self) -> str:
        return f"{self.message} ({self.location})" if self.location else self.message


def _signal_name(number: int) -> str:
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:
        return ""


@dataclass(frozen=True)
class ProcessReport:
    node: str
    role: ProcessRole
    rank: int
    pid: int
    running: bool
    exit_code: int = 0
    signal: int = 0
    expected: bool = False  # exited because trainerd stopped it
    log_tail: str = ""
    cause: RootCause | None = None  # of a failed exit, when the agent found one
    os_state: str = ""  # the kernel's state of a running process (proto.vocabulary.FROZEN_OS_STATES)
    # When the coordinator first saw the process in this state (running, or this exit); stamped by
    # the inbox (daemon/job/inbox.py) on arrival, kept by `record_process` while the state is told again.
    observed_at: float = 0.0

    @property
    def failed(self) -> bool:
        return not self.running and not self.expected and (self.exit_code != 0 or self.signal != 0)

    @property
    def succeeded(self) -> bool:
        """Exited cleanly. A process never started has no pid: an agent's report of one is no success."""
        return not self.running and self.exit_code == 0 and self.signal == 0 and self.pid > 0

    def describe(self) -> str:
        """One line: who, how, and why (the root cause, else the last line of its log). A process killed
        by a signal says nothing about why in its last line (it was cut off mid-sentence): only an
        error it printed (an exception, a MindSpore error) is shown then."""
        who = "scheduler" if self.role is ProcessRole.SCHEDULER else f"rank {self.rank}"
        how = f"was killed by signal {self.signal}{_signal_name(self.signal)}" if self.signal else \
            f"exited with code {self.exit_code}"
        if self.cause is not None and self.cause.message and not (self.signal and self.cause.kind == "last_line"):
            return f"{who} on node {self.node} {how}: {self.cause.line}"
        tail = self.log_tail.strip().splitlines()[-1:] if self.log_tail.strip() and not self.signal else []
        return f"{who} on node {self.node} {how}" + (f": {tail[0]}" if tail else "")

    @property
    def same_cause_key(self) -> tuple[str, str] | None:
        """What makes two failures the same error (state.error_key of its root cause); None without one, and
        for a crash in native code in no Python line (its report alone says nothing of whose code crashed)."""
        if self.cause is None or not self.cause.message:
            return None
        if self.cause.kind == CauseKind.FATAL_ERROR and not self.cause.location:
            return None
        if self.cause.kind == CauseKind.FENCED:  # its agent stopped it: no error of its own
            return None
        return error_key(self.cause.message, self.cause.location, self.cause.kind)

    @property
    def communication(self) -> bool:
        """It failed in a collective or on a connection (state.communication_error): waiting for a peer
        that did not come, or went away. Not its own error, nor the job's."""
        return self.cause is not None and communication_error(self.cause.message, self.cause.location)


@dataclass(frozen=True)
class ProgressReport:
    rank: int
    step: int
    loss: float
    grad_norm: float
    samples_per_s: float
    consumed_samples: int
    epoch: int | None = None  # Model.train's (runtime), or from output such as LossMonitor's "epoch: E step: S"
    from_output: bool = False  # read from the rank's output, not sent by the trainer runtime
    checkpoint_stall_s: float = 0.0  # the rank's step loop blocked on checkpoint saves, in all this generation
    evaluating: bool = False  # no new step: the rank evaluates between steps (a sign of life, not of progress)
    training_finished: bool = False  # the rank's training loop has ended: no new step is awaited from it
    startup: StartupTimes | None = None  # on the rank's first step report: how its process's start went

    @property
    def position(self) -> tuple[int, int]:
        """Where the rank is, comparable across reports (a step read from output restarts each epoch)."""
        return (-1 if self.epoch is None else self.epoch, self.step)

    def describe_position(self) -> str:
        return f"step {self.step}" if self.epoch is None else f"epoch {self.epoch} step {self.step}"


@dataclass(frozen=True)
class SkippedBatch:
    """A step whose update a worker's guard skipped: its samples, why, and the values seen."""

    step: int
    sample_start: int
    sample_end: int
    reason: str
    loss: float
    grad_norm: float


DEVICE_SUSPECTED = "device_suspected"
GUARD_REBASELINED = "guard_rebaselined"
GUARD_NOTICES = (DEVICE_SUSPECTED, GUARD_REBASELINED)


@dataclass(frozen=True)
class WorkerNotice:
    """What a worker's replay of a refused step found other than bad data (`kind` one of GUARD_NOTICES)."""

    step: int
    kind: str
    detail: str


# A node whose devices are suspected restart.quarantine_after times within this window is quarantined: a
# device that computes wrong now and then is rare (large fleets see one every week or two), so a few in an
# hour on one node are a pattern, not chance.
DEVICE_SUSPICION_WINDOW_S = 3600.0

REMEMBERED_STEPS = 1024
"""Per generation, how many committed, failed and skipped steps the leader remembers, to tell a report told
again from a new one. Beyond this the oldest are forgotten, so an agent that reports step after step cannot
grow the leader's memory; a job commits, fails or skips far fewer steps than this in one generation."""


STEP_TIMES_KEPT = 100
"""Per generation, how many of the newest intervals between new steps the leader keeps to judge a hang by
(decide.py's _hang_allowance): the window is bounded, and recent enough to follow a job that slows down."""


@dataclass(frozen=True)
class StepInterval:
    """How long the generation took from one report of a new furthest step (`after_step`) to the next
    (`to_step`): the step time the hang allowance is scaled by (reports may skip steps)."""

    seconds: float
    after_step: int
    to_step: int


def _told_first(told: set[int] | dict[int, SkippedBatch], step: int, report: SkippedBatch | None = None) -> bool:
    """Remember that `step` was told (in a dict, with its `report`); False when it was told already.
    Beyond REMEMBERED_STEPS the oldest is forgotten."""
    if step in told:
        return False
    if isinstance(told, set):
        told.add(step)
    else:
        assert report is not None
        told[step] = report
    if len(told) > REMEMBERED_STEPS:
        oldest = min(told)
        if isinstance(told, set):
            told.discard(oldest)
        else:
            del told[oldest]
    return True


@dataclass(frozen=True)
class MemorySnapshot:
    """An in-memory snapshot an agent holds of the job (agent/snapshots/memory_snapshots.py): complete in its
    memory (a one-host generation's, `ranks` empty), or the files of `ranks` of one that `world_size`
    ranks of `generation` wrote across hosts (its own ranks' and its ring predecessor's)."""

    step: int
    consumed_samples: int
    ranks: frozenset[int] = frozenset()
    world_size: int = 0
    generation: int = 0
    # Chosen for a relaunch (daemon/job/decide.py): where each rank's files are fetched from.
    holders: tuple[SnapshotHolder, ...] = ()


@dataclass
class GenerationObservation:
    number: int
    started_at: float = 0.0  # launch (or takeover): the hang timeout counts from here at the latest
    processes: dict[tuple[str, ProcessRole, int], ProcessReport] = field(default_factory=dict)
    progress: dict[int, ProgressReport] = field(default_factory=dict)
    launched: set[str] = field(default_factory=set)
    # The spares told to stand by for this generation (their warm templates started), while they stay spares.
    standing_by: set[str] = field(default_factory=set)
    # Adopted by a new leader while the job was RUNNING: every node got its Launch and ran its processes, so
    # a node running nothing of it now lost them, and is not sent the Launch again.
    ran_before_takeover: bool = False
    stop_sent: dict[str, float] = field(default_factory=dict)  # node -> when its Stop was sent
    stopped: set[str] = field(default_factory=set)
    agent_generation: dict[str, int] = field(default_factory=dict)  # from each node's last heartbeat
    # Each node's heartbeats in a row that named another generation, since its last process report of this
    # one: one can be stale (an older agent builds a heartbeat before its turn to write, so one written after the
    # reports of a generation launched meanwhile can name the generation before).
    other_generation_heartbeats: dict[str, int] = field(default_factory=dict)
    heard_at: dict[str, float] = field(default_factory=dict)  # when each node's last heartbeat arrived
    checkpoints: set[int] = field(default_factory=set)  # steps this generation committed
    # The newest complete in-memory snapshot each node's agent reports holding (from its heartbeats while
    # it runs this generation, and from its Stop confirmation).
    memory_snapshots: dict[str, MemorySnapshot] = field(default_factory=dict)
    # A generation spanning hosts: the snapshot steps of which each node's agent holds some ranks' files.
    held_snapshots: dict[str, tuple[MemorySnapshot, ...]] = field(default_factory=dict)
    failed_checkpoints: set[int] = field(default_factory=set)  # steps whose save a rank reported failed
    launch_refused: set[str] = field(default_factory=set)  # nodes whose agent refused the generation's Launch
    bad_batches: dict[int, SkippedBatch] = field(default_factory=dict)  # by step
    guard_notices: set[tuple[int, int]] = field(default_factory=set)  # (rank, step) told
    # When each node's ranks reported a device_suspected replay, within DEVICE_SUSPICION_WINDOW_S.
    device_suspicions: dict[str, deque[float]] = field(default_factory=dict)
    last_progress_at: float | None = None  # the newest step of any rank; None: no progress yet
    runtime_progress: bool = False  # a rank reported progress through the trainer runtime
    newest_position: tuple[int, int] | None = None  # the furthest any rank got (ProgressReport.position)
    stop_decided_at: float | None = None
    all_stopped_at: float | None = None
    # Keys of the running processes per node (a node reported any process of this generation: its key is
    # here): node_idle and processes_gone are asked for every node on every pass.
    _running: dict[str, set] = field(default_factory=dict, repr=False)
    # Per rank: when and at which step its progress was first seen, and when it last advanced (a step rate).
    _first_progress: dict[int, tuple[float, int]] = field(default_factory=dict, repr=False)
    _progress_at: dict[int, float] = field(default_factory=dict, repr=False)
    # Ranks whose training loop has ended (the process may still evaluate or export before it exits).
    training_finished: set[int] = field(default_factory=set)
    startups: dict[int, StartupTimes] = field(default_factory=dict)  # per rank, as its first step report told
    new_steps: int = 0  # reports that moved the furthest position on (start-up and warm-up are the first)
    # The newest intervals between those reports, within STEP_TIMES_KEPT; an interval that held an
    # evaluation or began a new epoch is left out (it is not a step's time).
    step_intervals: deque[StepInterval] = field(default_factory=lambda: deque(maxlen=STEP_TIMES_KEPT))
    epoch_began: bool = False  # the newest furthest position is in another epoch than the one before
    _newest_at: float | None = field(default=None, repr=False)  # when the furthest position last moved on
    _interval_unmeasured: bool = field(default=False, repr=False)  # an evaluation since then

    def record_progress(self, report: ProgressReport, now: float) -> None:
        """A rank's progress. Once the trainer runtime reports for this generation, progress read
        from output is ignored: the runtime's steps are global, a LossMonitor's restart each epoch."""
        if report.from_output and self.runtime_progress:
            return
        if report.evaluating and self.last_progress_at is not None:
            self.last_progress_at = now  # evaluating between steps (Model.fit) is no hang
        if report.evaluating:
            self._interval_unmeasured = True
        if report.training_finished:
            self.training_finished.add(report.rank)
        if report.startup is not None:
            self.startups.setdefault(report.rank, report.startup)
        known = self.progress.get(report.rank)
        switched = known is not None and known.from_output != report.from_output
        advanced = known is None or switched or report.position > known.position
        if advanced:
            self.last_progress_at = now
        if not report.from_output and not self.runtime_progress:
            self.newest_position = None  # the runtime's global steps replace the steps read from output
            self._newest_at = None
        if self.newest_position is None or report.position > self.newest_position:
            self._record_new_step(report, now)
        if known is None or switched:
            self._first_progress[report.rank] = (now, report.step)
        self.runtime_progress = self.runtime_progress or not report.from_output
        self.progress[report.rank] = report
        if advanced:  # a report of a step already known (an agent sends its newest again on reconnecting) is no news
            self._progress_at[report.rank] = now

    def _record_new_step(self, report: ProgressReport, now: float) -> None:
        """The furthest position moved on: count it, and keep the time since the one before as a step
        time unless an evaluation or a new epoch passed in between."""
        before = self.newest_position
        self.epoch_began = before is not None and report.position[0] != before[0]
        if before is not None and self._newest_at is not None and not self.epoch_began \
                and not self._interval_unmeasured:
            self.step_intervals.append(StepInterval(now - self._newest_at, before[1], report.step))
        self.newest_position, self._newest_at, self._interval_unmeasured = report.position, now, False
        self.new_steps += 1

    @property
    def progress_seen(self) -> bool:
        """A rank of this generation showed progress (through any channel): hangs are judged from then."""
        return self.last_progress_at is not None

    @property
    def uses_runtime(self) -> bool:
        """The generation runs trainerd's runtime: it reported progress itself or committed a
        checkpoint, so it can save a checkpoint when asked."""
        return self.runtime_progress or bool(self.checkpoints)

    def silent_since(self) -> float | None:
        """Since when no rank reported a new step; None while no rank reported progress at all."""
        return None if self.last_progress_at is None else max(self.started_at, self.last_progress_at)

    def frozen_ranks(self) -> frozenset[int]:
        """Workers whose process the kernel shows stopped or stuck (not waiting in a collective)."""
        return frozenset(p.rank for p in self.processes.values()
                         if p.role is ProcessRole.WORKER and p.running and p.os_state in FROZEN_OS_STATES)

    def behind(self) -> ProgressReport | None:
        """The rank furthest behind, among those that reported: a frozen one first (its peers wait for
        it at the same step), then the lowest position, then the one that reached it first, then the
        lowest rank."""
        frozen = self.frozen_ranks()
        return min(self.progress.values(), default=None,
                   key=lambda p: (p.rank not in frozen, p.position, self._progress_at.get(p.rank, 0.0), p.rank))

    def steps_per_s(self) -> float | None:
        """The fastest rank's step rate over this generation, from when its reports arrived; None
        until a rank reported twice, steps apart (a step read from output with an epoch restarts: not used)."""
        rates = []
        for rank, report in self.progress.items():
            first_at, first_step = self._first_progress[rank]
            elapsed = self._progress_at[rank] - first_at
            counts_on = not report.from_output or report.epoch is None  # not a step that restarts each epoch
            if counts_on and elapsed > 0 and report.step > first_step:
                rates.append((report.step - first_step) / elapsed)
        return max(rates, default=None)

    def processes_gone(self, node: str) -> bool:
        """The node ran its processes of this generation, but its agent now runs another (a restarted agent
        runs none): they are gone without an exit report, killed with the agent that started them."""
        ran_here = self.ran_before_takeover or node in self._running
        return ran_here and self.other_generation_heartbeats.get(node, 0) >= 2

    def heard(self, node: str, generation: int) -> None:
        """A heartbeat of `node`'s agent, naming the generation it runs."""
        self.agent_generation[node] = generation
        other = generation != self.number
        self.other_generation_heartbeats[node] = self.other_generation_heartbeats.get(node, 0) + 1 if other else 0

    def node_idle(self, node: str) -> bool:
        """Nothing of this generation runs on `node`: it confirmed a Stop, or its reports show none running."""
        if node in self.stopped:
            return True
        seen = self.agent_generation.get(node)
        if seen is None:
            return False
        if seen != self.number:
            return True  # the agent runs another generation (a restarted agent runs none)
        return not self._running.get(node)

    def bad_run(self) -> list[SkippedBatch]:
        """The newest run of consecutive skipped steps (empty when the newest step was not skipped)."""
        if not self.bad_batches:
            return []
        newest = max(self.bad_batches)
        if (self.max_step() or 0) > newest:
            return []  # a later step went through
        run = []
        step = newest
        while step in self.bad_batches:
            run.append(self.bad_batches[step])
            step -= 1
        return run[::-1]

    def max_step(self) -> int | None:
        return max((p.step for p in self.progress.values()), default=None)

    def add_checkpoint(self, step: int) -> bool:
        """Rank 0 committed `step`; False when that was told already."""
        return _told_first(self.checkpoints, step)

    def add_failed_checkpoint(self, step: int) -> bool:
        """A rank's save of `step` failed; False when a failure of that step was told already."""
        return _told_first(self.failed_checkpoints, step)

    def add_guard_notice(self, rank: int, step: int) -> bool:
        """Whether a guard notice of `rank` at `step` is news (one told again after a reconnect is not)."""
        if (rank, step) in self.guard_notices:
            return False
        self.guard_notices.add((rank, step))
        if len(self.guard_notices) > REMEMBERED_STEPS:
            self.guard_notices.discard(min(self.guard_notices, key=lambda told: told[1]))
        return True

    def suspect_device(self, node: str, now: float) -> None:
        """A rank on `node` computed a step otherwise when it was replayed (forgotten after the window)."""
        times = self.device_suspicions.setdefault(node, deque())
        times.append(now)
        while times and times[0] < now - DEVICE_SUSPICION_WINDOW_S:
            times.popleft()

    def suspected_devices(self, now: float) -> dict[str, int]:
        """How many device suspicions each node had within the window up to `now`."""
        return {node: sum(1 for t in times if t >= now - DEVICE_SUSPICION_WINDOW_S)
                for node, times in self.device_suspicions.items()}

    def add_bad_batch(self, report: SkippedBatch) -> bool:
        """A rank's guard skipped `report.step`; False when that step was told already."""
        return _told_first(self.bad_batches, report.step, report)

    def record_process(self, report: ProcessReport) -> None:
        key = (report.node, report.role, report.rank)
        known = self.processes.get(key)
        if known is not None and known.running == report.running:
            # The same state told again (heartbeats repeat every process, exits included): it was
            # observed when first told, and the exit report's log tail and root cause, which the
            # heartbeat's summary lacks, are kept.
            report = replace(report, observed_at=known.observed_at, log_tail=report.log_tail or known.log_tail,
                             cause=report.cause or known.cause)
        self.processes[key] = report
        self.other_generation_heartbeats[report.node] = 0
        running = self._running.setdefault(report.node, set())
        if report.running:
            running.add(key)
        else:
            running.discard(key)

    def failures(self) -> list[ProcessReport]:
        """Every failed process, the earliest observed first. The first failure causes the others
        (a peer's collective breaks); at the same moment a worker's own crash explains more than the
        scheduler's reaction to it, then the lowest rank."""
        failed = [p for p in self.processes.values() if p.failed]
        failed.sort(key=lambda p: (p.observed_at, p.role is ProcessRole.SCHEDULER, p.rank))
        return failed

    def first_failure(self) -> ProcessReport | None:
        failed = self.failures()
        return failed[0] if failed else None

    def finished_ranks(self) -> set[int]:
        return {p.rank for p in self.processes.values() if p.role is ProcessRole.WORKER and p.succeeded}

    def workers_exited(self, world_size: int) -> bool:
        exited = {p.rank for p in self.processes.values() if p.role is ProcessRole.WORKER and not p.running}
        return exited >= set(range(world_size))

    def running_since(self, world_size: int) -> float | None:
        """Since when every process of the generation runs: every worker rank was seen running and
        none has exited (the latest start counts). None otherwise."""
        if any(not p.running for p in self.processes.values()):
            return None
        workers = {p.rank for p in self.processes.values() if p.role is ProcessRole.WORKER}
        if not workers >= set(range(world_size)):
            return None
        return max(p.observed_at for p in self.processes.values())

    def min_step(self, world_size: int) -> int | None:
        if len(self.progress) < world_size:
            return None
        return min(p.step for p in self.progress.values())
