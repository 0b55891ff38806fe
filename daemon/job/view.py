"""The job as operators see it: the JobView `trainerctl status` shows, built from what the controller keeps,
and the job's Prometheus series, set from that view on every reconcile pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from daemon import metrics
from daemon.config import JobSettings
from daemon.job.catalog import CheckpointEntry
from daemon.job.goodput import GoodputSnapshot, Phase
from daemon.job.observation import GenerationObservation
from daemon.job.state import Failure, GenerationRecord, JobRecord
from daemon.job.timeline import RecoveryTimeline
from proto.vocabulary import JobState


@dataclass(frozen=True)
class RankView:
    rank: int
    node: str
    step: int
    loss: float
    samples_per_s: float
    epoch: int | None = None
    from_output: bool = False  # read from the rank's output, not sent by the trainer runtime
    grad_norm: float = 0.0


@dataclass(frozen=True)
class JobView:
    name: str
    state: JobState
    generation: int
    world_size: int
    restarts: int
    crash_restarts: int
    restart_budget: int
    step: int | None
    last_checkpoint_step: int | None
    loss: float | None
    samples_per_s: float | None
    ranks: tuple[RankView, ...]
    last_failure: Failure | None
    last_recovery: RecoveryTimeline | None
    quarantined: frozenset[str]
    skipped_batches: int
    node_crashes: Mapping[str, int]  # the crashes counted against each node (JobRecord.node_failures)
    epoch: int | None = None  # the lowest epoch a rank reported from its output
    hang_detection: bool = False  # a rank of the live generation showed progress: hangs are judged
    goodput: GoodputSnapshot | None = None
    grad_norm: float | None = None  # the global norm: every rank of the runtime reports the same one
    waiting_for: str = ""  # what a job not launched yet, or WAITING, waits for (decide.waiting_for)
    pausing: bool = False  # RUNNING, asked to pause: it saves a checkpoint (or leaves gracefully) first
    warnings: tuple[str, ...] = ()  # what the workers found risky about the job (job_warning), oldest first
    spares: tuple[str, ...] = ()  # usable nodes standing by beside the live generation (decide.spares)


def job_view(*, spec: JobSettings, record: JobRecord, generation: GenerationRecord | None,
             observation: GenerationObservation | None, checkpoints: tuple[CheckpointEntry, ...], skipped_batches: int,
             goodput: GoodputSnapshot, recovery: RecoveryTimeline | None, waiting_for: str,
             warnings: tuple[str, ...], spares: tuple[str, ...] = ()) -> JobView:
    """`waiting_for`: as of the last reconcile pass (shown while the job is PENDING or WAITING)."""
    ranks: tuple[RankView, ...] = ()
    step = loss = samples_per_s = epoch = grad_norm = None
    hang_detection = False
    if observation is not None and generation is not None:
        node_of = {slot.rank: slot.node for slot in generation.placement.ranks}
        ranks = tuple(RankView(p.rank, node_of.get(p.rank, ""), p.step, p.loss, p.samples_per_s, p.epoch,
                               p.from_output, p.grad_norm)
                      for p in sorted(observation.progress.values(), key=lambda p: p.rank))
        step = observation.min_step(generation.placement.world_size)
        if ranks:
            loss = sum(r.loss for r in ranks) / len(ranks)
            # The runtime reports the global rate on every rank; a rate read from output is the rank's.
            runtime = [r.samples_per_s for r in ranks if not r.from_output]
            samples_per_s = max(runtime) if runtime else sum(r.samples_per_s for r in ranks)
            grad_norm = max((r.grad_norm for r in ranks if not r.from_output), default=None)
        epoch = min((r.epoch for r in ranks if r.epoch is not None), default=None)
        hang_detection = observation.progress_seen and not record.between_generations
    if step is None and record.state is JobState.COMPLETED and goodput.high_water is not None:
        # Progress is not kept in etcd, but the furthest position reached is: a COMPLETED job taken over
        # by a new leader (a coordinator restarted) still shows where it ended.
        epoch = goodput.high_water[0] if goodput.high_water[0] >= 0 else None
        step = goodput.high_water[1]
    good = [c.step for c in checkpoints if c.good]
    return JobView(spec.name, record.state, record.generation, record.world_size,
                   record.restarts, record.crash_restarts, spec.restart.max, step,
                   good[-1] if good else None, loss, samples_per_s, ranks, record.last_failure,
                   recovery, record.quarantined(spec.restart.quarantine_after),
                   skipped_batches, dict(record.node_failures), epoch, hang_detection, goodput, grad_norm,
                   waiting_for if record.state in (JobState.PENDING, JobState.WAITING) else "",
                   record.pausing, warnings, spares)


def export_metrics(view: JobView, spec: JobSettings, checkpoints: tuple[CheckpointEntry, ...],
                   steps_per_s: float | None) -> None:
    """Set the job's series from `view`; `steps_per_s`: the current generation's (GenerationObservation)."""
    name = view.name
    assert view.goodput is not None
    metrics.JOB_GOODPUT_RATIO.labels(name).set(view.goodput.ratio)
    for phase in Phase:
        metrics.JOB_PHASE_SECONDS.labels(name, phase.value).set(view.goodput.seconds.get(phase, 0.0))
    metrics.set_job_gauge(metrics.JOB_STEP, name, view.step)
    metrics.set_job_gauge(metrics.JOB_LOSS, name, view.loss)
    metrics.set_job_gauge(metrics.JOB_SAMPLES_PER_SECOND, name, view.samples_per_s)
    metrics.set_job_gauge(metrics.JOB_STEP_SECONDS, name, _step_seconds(view, spec, steps_per_s))
    metrics.set_job_state(name, view.state.value, [state.value for state in JobState])
    metrics.JOB_RESTART_BUDGET.labels(name).set(view.restart_budget)
    metrics.JOB_RESTART_BUDGET_SPENT.labels(name).set(view.crash_restarts)
    newest = next((entry for entry in reversed(checkpoints) if entry.good), None)
    metrics.set_job_gauge(metrics.JOB_CHECKPOINT_STEP, name, None if newest is None else newest.step)
    metrics.set_job_gauge(metrics.JOB_CHECKPOINT_TIME, name, None if newest is None else newest.committed_at)


def _step_seconds(view: JobView, spec: JobSettings, steps_per_s: float | None) -> float | None:
    if spec.global_batch is not None and view.samples_per_s:
        return spec.global_batch / view.samples_per_s
    return 1 / steps_per_s if steps_per_s else None


def forget_metrics(job_name: str) -> None:
    """This coordinator stands down: the new leader exports the job's series."""
    metrics.forget_job(job_name, [phase.value for phase in Phase], [state.value for state in JobState])
