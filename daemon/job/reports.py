"""What an agent reports about the job, as plain values: one frozen dataclass a kind, and their union.

The servicer (daemon/grpc_services.py) checks a message and builds one of these at its edge; the
coordinator hands it, with the node it came from, to the job's inbox (daemon/job/inbox.py), which
dispatches on its type. Every report names the generation it is about: one about another generation
than the current one is ignored (docs/concepts/generations.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.job.observation import MemorySnapshot, ProcessReport, ProgressReport, SkippedBatch, WorkerNotice


@dataclass(frozen=True)
class HeartbeatReport:
    """The agent runs `generation`; `memory`: the newest in-memory snapshot it holds whole, `held`: those of
    which it holds some ranks' files."""

    generation: int
    memory: MemorySnapshot | None = None
    held: tuple[MemorySnapshot, ...] = ()


@dataclass(frozen=True)
class ProcessChanged:
    """A process started or exited, or its state as a heartbeat lists it."""

    generation: int
    process: ProcessReport


@dataclass(frozen=True)
class RankProgressed:
    """A rank's progress, from the trainer runtime or read from its output."""

    generation: int
    progress: ProgressReport


@dataclass(frozen=True)
class GenerationStopped:
    """The node stopped the generation; `memory` and `held`: the in-memory snapshots its agent holds then
    (fresher than its last heartbeat's, and what the relaunch may resume from)."""

    generation: int
    memory: MemorySnapshot | None = None
    held: tuple[MemorySnapshot, ...] = ()


@dataclass(frozen=True)
class CheckpointCommitted:
    """Rank 0 committed the checkpoint of `step` at `path`."""

    generation: int
    step: int
    consumed_samples: int
    path: str


@dataclass(frozen=True)
class CheckpointFailed:
    """A rank's save of `step` failed."""

    generation: int
    rank: int
    step: int
    reason: str


@dataclass(frozen=True)
class GuardNoticed:
    """A rank's replay of a step its guard refused found other than bad data (a device fault, a re-baseline)."""

    generation: int
    rank: int
    notice: WorkerNotice


@dataclass(frozen=True)
class WorkerWarned:
    """A worker found something risky about the job (it may work)."""

    generation: int
    rank: int
    text: str


@dataclass(frozen=True)
class BatchSkipped:
    """A rank's guard skipped a step's update: its samples are bad data."""

    generation: int
    rank: int
    batch: SkippedBatch


AgentReport = (HeartbeatReport | ProcessChanged | RankProgressed | GenerationStopped | CheckpointCommitted
               | CheckpointFailed | GuardNoticed | WorkerWarned | BatchSkipped)
