"""What the leader has seen of the current generation, rebuilt from agent reports.

Kept in memory only: heartbeats carry every process of the agent's generation (exited ones too),
so a newly elected leader rebuilds it within one heartbeat interval. Times are the coordinator's
monotonic clock; a new leader starts them at its takeover.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.vocabulary import ProcessRole


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

    @property
    def failed(self) -> bool:
        return not self.running and not self.expected and (self.exit_code != 0 or self.signal != 0)

    @property
    def succeeded(self) -> bool:
        return not self.running and self.exit_code == 0 and self.signal == 0

    def describe(self) -> str:
        who = "scheduler" if self.role is ProcessRole.SCHEDULER else f"rank {self.rank}"
        how = f"was killed by signal {self.signal}" if self.signal else f"exited with code {self.exit_code}"
        tail = self.log_tail.strip().splitlines()[-1:] if self.log_tail.strip() else []
        return f"{who} on node {self.node} {how}" + (f": {tail[0]}" if tail else "")


@dataclass(frozen=True)
class ProgressReport:
    rank: int
    step: int
    loss: float
    grad_norm: float
    samples_per_s: float
    consumed_samples: int


@dataclass(frozen=True)
class BadBatchReport:
    """A step whose update a worker's guard skipped: its samples, why, and the values seen."""

    step: int
    sample_start: int
    sample_end: int
    reason: str
    loss: float
    grad_norm: float


@dataclass
class GenerationObservation:
    number: int
    started_at: float = 0.0  # launch (or takeover): the hang timeout counts from here at the latest
    processes: dict[tuple[str, ProcessRole, int], ProcessReport] = field(default_factory=dict)
    progress: dict[int, ProgressReport] = field(default_factory=dict)
    launched: set[str] = field(default_factory=set)
    stop_sent: dict[str, float] = field(default_factory=dict)  # node -> when its Stop was sent
    stopped: set[str] = field(default_factory=set)
    agent_generation: dict[str, int] = field(default_factory=dict)  # from each node's last heartbeat
    checkpoints: set[int] = field(default_factory=set)  # steps this generation committed
    bad_batches: dict[int, BadBatchReport] = field(default_factory=dict)  # by step
    last_progress_at: float | None = None
    stop_decided_at: float | None = None
    all_stopped_at: float | None = None
    # Keys of the running processes per node: node_idle is asked for every node on every report.
    _running: dict[str, set] = field(default_factory=dict, repr=False)

    def record_progress(self, report: ProgressReport, now: float) -> None:
        known = self.progress.get(report.rank)
        if known is None or report.step > known.step:
            self.last_progress_at = now
        self.progress[report.rank] = report

    def silent_since(self) -> float:
        return self.started_at if self.last_progress_at is None else max(self.started_at, self.last_progress_at)

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

    def bad_run(self) -> list[BadBatchReport]:
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

    def record_process(self, report: ProcessReport) -> None:
        key = (report.node, report.role, report.rank)
        known = self.processes.get(key)
        # An exit report with a log tail is worth more than the heartbeat's summary of the same exit.
        if known is not None and not known.running and not report.running and known.log_tail and not report.log_tail:
            return
        self.processes[key] = report
        running = self._running.setdefault(report.node, set())
        if report.running:
            running.add(key)
        else:
            running.discard(key)

    def first_failure(self) -> ProcessReport | None:
        failed = [p for p in self.processes.values() if p.failed]
        # A worker's own crash explains more than the scheduler's reaction to it.
        failed.sort(key=lambda p: (p.role is ProcessRole.SCHEDULER, p.rank))
        return failed[0] if failed else None

    def finished_ranks(self) -> set[int]:
        return {p.rank for p in self.processes.values() if p.role is ProcessRole.WORKER and p.succeeded}

    def min_step(self, world_size: int) -> int | None:
        if len(self.progress) < world_size:
            return None
        return min(p.step for p in self.progress.values())
