"""A training process's checkpoints: resume from the one the coordinator chose, save after the steps the
schedule names, and tell the agent once a save is committed.

    checkpoints = TrainingCheckpoints(ctx, ctx.checkpoints, reporter, (network, optimizer),
                                      data_seed=seed, grad_accumulation=batch.grad_accum)
    start = checkpoints.resume()           # ResumePosition(step=0, consumed_samples=0) when starting fresh
    with checkpoints:
        for step in range(start.step + 1, steps + 1):
            ...                            # train on the samples from start.consumed_samples on
            checkpoints.after_step(step, consumed_samples)
    # leaving the block waits for the last save and reports it

Worker side only: MindSpore comes in through `trainer.checkpoint.mindspore_io`, imported where it is
needed, so importing this module does not load it.

In-memory snapshots (`trainer.runtime.memory_snapshots`, TRAINERD_MEMORY_DIR and TRAINERD_MEMORY_EVERY, a
number of steps or "auto") are taken beside the disk saves, in the same format, into the agent's shared
memory; a resume from one reads it like a disk checkpoint (TRAINERD_RESUME_FROM names it, inside TRAINERD_MEMORY_DIR).

With TRAINERD_CHECKPOINT_OUTBOX (`checkpoint.saved_by: agent`) the agent writes the disk checkpoints: each
rank hands its share of a save to its agent (`trainer.runtime.agent_saves`), which commits and reports it;
the schedule, the stall accounting and the failure reports are as below, the commit report is the agent's.
With in-memory snapshots on as well, every disk save step is also a snapshot step, and the agent saves the
snapshot's share (linked into the outbox): the step blocks for the one copy into shared memory.

A save blocks the step only while the parameters are copied to host memory (`CheckpointWriter.save_async`);
a helper thread waits for the writer, and the step after the save has committed (rank 0) reports it, so the
report follows the manifest's rename and training never waits on the disk. A save that fails (a full disk,
an unwritable directory) is logged, reported to the coordinator with its reason (which records it as an
event) and training goes on: the job resumes, if it must, from the last checkpoint that committed. The time
each save blocks the step loop (waiting for the previous save, the copy to host memory) is added to the
reporter's checkpoint stall, which every step report carries to the coordinator's goodput accounting.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from common.clock import Clock, SystemClock
from proto.exit_codes import EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from proto.launch_env import CHECKPOINT_DIR_ENV
from proto.progress_datagram import CheckpointReport, MalformedProgress, encode, failure_reason
from trainer.checkpoint import CheckpointError, CheckpointMeta, CheckpointWriter, load_checkpoint
from trainer.checkpoint.directory_owner import DirectoryOfAnotherJob, claim_for_job
from trainer.checkpoint.manifest import EpochPosition, read_manifest, step_dir_name
from trainer.checkpoint.sharding import ShardedTensor
from trainer.checkpoint.step_dirs import check_inside_root
from trainer.data.skip_ranges import SkipRanges
from trainer.runtime import startup_times
from trainer.runtime.agent_saves import AgentSaves, ShareNotSaved
from trainer.runtime.checkpoint_schedule import CheckpointSchedule, ControlFile
from trainer.runtime.memory_snapshots import MemorySnapshots
from trainer.runtime.progress import ProgressReporter
from trainer.runtime.rank_context import RankCheckpointSettings, RankContext
from trainer.runtime.snapshot_interval import interval_cap

if TYPE_CHECKING:
    import numpy as np
    from mindspore import nn

log = logging.getLogger(__name__)

# The largest step a report is checked for up front: its directory name is the longest one written.
_PROBE_STEP = 10**12


class ResumeError(Exception):
    """The run cannot resume as launched; the message is one line, `exit_code` the status to exit with."""

    exit_code: int


class CheckpointUnreadable(ResumeError):
    """TRAINERD_RESUME_FROM cannot be loaded or does not verify, or does not fit the model."""

    exit_code = EXIT_CHECKPOINT_UNREADABLE


class SeedMismatch(ResumeError):
    """The checkpoint was trained on another data seed: resuming would silently change the sample order."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class ResumePosition:
    step: int              # optimizer steps completed: training continues with step + 1
    consumed_samples: int  # the stream position of the next sample to read
    epoch_position: EpochPosition | None = None  # where Model.train stood in its epochs, when it kept that


def resume_position(settings: RankCheckpointSettings, data_seed: int) -> ResumePosition | None:
    """Where the checkpoint named by `resume_from` stands, from its manifest alone (no tensor is read or
    verified), or None when starting fresh: what a dataset must know before training begins. Raises
    CheckpointUnreadable when it lies outside the checkpoint directory or its manifest is missing or
    invalid, SeedMismatch when it was trained on another data seed.
    """
    path, root = settings.resume_from, settings.resume_root()
    if settings.memory_step is not None and (path is None or root != settings.memory_directory):
        # The agent names the snapshot it holds; without one here, starting fresh would lose the job's work.
        raise CheckpointUnreadable(f"cannot resume from the in-memory snapshot of step {settings.memory_step}: "
                                   "the agent named none on this host")
    if path is None:
        return None
    if root is None:
        raise CheckpointUnreadable(f"cannot resume from checkpoint {path}: no checkpoint directory "
                                   f"({CHECKPOINT_DIR_ENV}) is set for it to lie in")
    try:
        check_inside_root(root, path)
        meta = read_manifest(path).meta
    except (CheckpointError, OSError) as exc:
        raise CheckpointUnreadable(f"cannot resume from checkpoint {path}: {exc}") from exc
    if meta.data_seed != data_seed:
        raise SeedMismatch(f"checkpoint {path} was trained with data seed {meta.data_seed}, "
                           f"but this run's seed is {data_seed}")
    return ResumePosition(meta.step, meta.consumed_samples, meta.epoch_position)


class TrainingCheckpoints:
    """Resume, periodic and requested saves, and commit reports for one worker of a job.

    `cells` (the network and its optimizer) hold everything saved and restored: parameters every rank holds
    whole, and the parameters named in `sharded` (tensor or optimizer parallel, see
    `trainer.runtime.parameter_layouts`), of which every rank holds, saves and restores its region.
    `data_seed` and `grad_accumulation` go into every checkpoint's meta, as do the skip ledger ranges in
    force. Raises ValueError when the checkpoint directory could not be reported.
    """

    def __init__(
        self,
        ctx: RankContext,
        settings: RankCheckpointSettings,
        reporter: ProgressReporter,
        cells: Sequence[nn.Cell],
        *,
        data_seed: int,
        grad_accumulation: int,
        skip_ledger: Sequence[tuple[int, int]] = (),
        sharded: Mapping[str, ShardedTensor] | None = None,
        clock: Clock = SystemClock(),  # stateless, so one shared default is safe
    ) -> None:
        if ctx.rank is None:
            raise ValueError("the scheduler process has no rank and keeps no checkpoints")
        self._ctx = ctx
        self._rank = ctx.rank
        self._settings = settings
        self._reporter = reporter
        self._cells = tuple(cells)
        self._data_seed = data_seed
        self._grad_accumulation = grad_accumulation
        self._skip_ledger = tuple(skip_ledger)
        self._epoch_position: EpochPosition | None = None  # as of the last step (after_step)
        self._sharded = dict(sharded or {})
        self._clock = clock
        self._where = f"job {ctx.job} generation {ctx.generation} rank {ctx.rank}/{ctx.world_size}"
        self._completed = 0
        self._in_flight: tuple[CheckpointMeta, Future[Path | None]] | None = None
        self._writer: CheckpointWriter | None = None
        self._agent_saves: AgentSaves | None = None
        self._schedule: CheckpointSchedule | None = None
        self._memory: MemorySnapshots | None = None
        if settings.memory_directory is not None and settings.memory_every != 0:
            self._memory = MemorySnapshots(settings.memory_directory, settings.memory_every, self._rank,
                                           ctx.world_size, ctx.generation, self._where, clock,
                                           interval_cap(settings.every), scope_host=settings.memory_scope_host)
        if settings.directory is None:
            if settings.control_file is not None:
                log.warning("%s: there is no checkpoint directory, so checkpoint requests will be ignored.",
                            self._where)
            return
        self._check_reportable(settings.directory)
        try:
            claim_for_job(settings.directory, ctx.job)
        except DirectoryOfAnotherJob as exc:
            raise ValueError(str(exc)) from None
        except OSError as exc:  # a full or read-only disk: each save then fails and says so, as without the claim
            log.warning("%s: cannot claim checkpoint directory %s for the job: %s", self._where, settings.directory,
                        exc.strerror or exc)
        control = None if settings.control_file is None else ControlFile(settings.control_file)
        self._schedule = CheckpointSchedule(settings.every or 0, ctx.generation, control, self._where)
        if settings.outbox is not None:
            self._agent_saves = AgentSaves(settings.outbox, self._rank, ctx.world_size, ctx.generation,
                                           self._where, clock)
            return
        self._writer = CheckpointWriter(settings.directory, self._rank, ctx.world_size,
                                        generation=ctx.generation, keep=settings.keep)
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix=f"checkpoint-commit-rank{self._rank}")

    def record_skip(self, start: int, end: int) -> None:
        """A batch the guard skipped: later checkpoints record its range in their skip ledger."""
        self._skip_ledger = SkipRanges.of((*self._skip_ledger, (start, end))).ranges

    def resume(self) -> ResumePosition:
        """Load the checkpoint named by `resume_from` into the cells (any world size may have written it),
        or start fresh when there is none. The checkpoint must lie inside the checkpoint directory. Raises
        CheckpointUnreadable or SeedMismatch.
        """
        path = self._settings.resume_from
        # Where it lies, a readable manifest, the seed; a snapshot chosen but not named here is refused.
        if resume_position(self._settings, self._data_seed) is None or path is None:
            return ResumePosition(0, 0)
        started = self._clock.now()
        try:
            regions = {name: layout.regions[self._rank] for name, layout in self._sharded.items()}
            tensors, manifest = load_checkpoint(path, self._rank, self._ctx.world_size, regions=regions)
        except (CheckpointError, OSError) as exc:
            raise CheckpointUnreadable(f"cannot resume from checkpoint {path}: {exc}") from exc
        from trainer.checkpoint.mindspore_io import load_numpy_into
        from trainer.runtime.guard import check_guard_state

        meta = manifest.meta
        try:
            load_numpy_into(check_guard_state(tensors, *self._cells), *self._cells)
        except CheckpointError as exc:
            raise CheckpointUnreadable(f"cannot resume from checkpoint {path}: {exc}") from exc
        self._completed = meta.step
        startup_times.loaded(self._clock.now() - started)
        log.info("%s: resumed from %s at step %d, sample %d (saved by %d ranks with %d accumulation steps)",
                 self._where, path, meta.step, meta.consumed_samples, manifest.world_size, meta.grad_accumulation)
        return ResumePosition(meta.step, meta.consumed_samples, meta.epoch_position)

    def after_step(self, step: int, consumed_samples: int, epoch_position: EpochPosition | None = None) -> None:
        """Call after every optimizer step, with the stream position after it (and, under Model.train, the
        place in its epochs): reports a save that has committed since, and starts a save when this step is
        due one."""
        self._completed = step
        self._epoch_position = epoch_position
        self._collect(block=False)
        save_due = self._schedule is not None and self._schedule.due(step)
        snapshot_due = self._memory is not None and self._memory.due(step)
        if save_due and self._agent_saves is not None and self._memory is not None:
            self._snapshot(step, consumed_samples, for_agent=self._agent_saves)  # the disk save from memory
            return
        if save_due:
            self._save(step, consumed_samples)
        if snapshot_due:
            self._snapshot(step, consumed_samples)

    def close(self) -> None:
        """Wait for the save in flight and report it; a requested step never reached is logged."""
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        if self._agent_saves is not None:
            agent_saves, self._agent_saves = self._agent_saves, None
            try:
                agent_saves.close()
            except ShareNotSaved as exc:
                self._agent_save_failed(exc.step, exc)
            self._warn_unreached_request()
        if self._writer is None:
            return
        try:
            self._collect(block=True)
            self._warn_unreached_request()
        finally:
            self._writer.close()
            self._waiter.shutdown()
            self._writer = None

    def _warn_unreached_request(self) -> None:
        if self._schedule is not None and self._schedule.requested is not None:
            log.warning("%s: training ended at step %d, before the checkpoint requested at step %d.",
                        self._where, self._completed, self._schedule.requested)

    def __enter__(self) -> TrainingCheckpoints:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _save(self, step: int, consumed_samples: int) -> None:
        """Start the save of `step`; the time it blocks the step loop is reported as checkpoint stall."""
        started = self._clock.now()
        try:
            self._start_save(step, consumed_samples)
        finally:
            self._reporter.add_checkpoint_stall(self._clock.now() - started)

    def _snapshot(self, step: int, consumed_samples: int, for_agent: AgentSaves | None = None) -> None:
        """Snapshot `step` into the agent's memory; the time it blocks the step loop is checkpoint stall.
        `for_agent`: this step is a disk save too, which the agent takes from the snapshot (the share is
        written once and linked into the outbox); when the snapshot cannot start, the share is handed over
        as without snapshots."""
        from trainer.checkpoint.mindspore_io import parameters_to_numpy

        assert self._memory is not None
        started = self._clock.now()
        try:
            meta, tensors = self._meta(step, consumed_samples), parameters_to_numpy(*self._cells)
            if for_agent is None:
                self._memory.save(meta, tensors, self._sharded)
                return
            self._settle_agent_saves(for_agent)
            written = self._memory.save(meta, tensors, self._sharded, share_into=for_agent.outbox)
            if written is not None:
                for_agent.hand_over_snapshot(step, written)
                log.info("%s: step %d: the agent saves the checkpoint from this rank's in-memory snapshot",
                         self._where, step)
            else:
                self._hand_to_agent(for_agent, meta, tensors)
        finally:
            stall = self._clock.now() - started
            self._reporter.add_checkpoint_stall(stall)
            self._memory.snapshotted(step, stall)

    def _meta(self, step: int, consumed_samples: int) -> CheckpointMeta:
        return CheckpointMeta(step=step, consumed_samples=consumed_samples, data_seed=self._data_seed,
                              grad_accumulation=self._grad_accumulation, skip_ledger=self._skip_ledger,
                              epoch_position=self._epoch_position)

    def _start_save(self, step: int, consumed_samples: int) -> None:
        from trainer.checkpoint.mindspore_io import parameters_to_numpy

        meta = self._meta(step, consumed_samples)
        if self._agent_saves is not None:
            self._settle_agent_saves(self._agent_saves)
            self._hand_to_agent(self._agent_saves, meta, parameters_to_numpy(*self._cells))
            return
        assert self._writer is not None  # a schedule exists only with a writer or the agent's saves
        self._collect(block=True)  # one save at a time: the writer reuses its host buffers
        try:
            self._writer.save_async(meta, parameters_to_numpy(*self._cells), self._sharded)
        except (CheckpointError, OSError) as exc:
            log.error("%s: could not start the checkpoint of step %d: %s", self._where, step, exc)
            self._reporter.checkpoint_failed(step, failure_reason(exc))
            return
        # Only this thread waits on the writer, and the main thread touches the writer again only
        # after this wait is over (`_collect`), so the two never use it at once.
        self._in_flight = (meta, self._waiter.submit(self._writer.wait))

    def _settle_agent_saves(self, agent_saves: AgentSaves) -> None:
        """Wait for the agent to take the previous share; one it will not save is reported failed."""
        try:
            agent_saves.settle()
        except ShareNotSaved as exc:
            self._agent_save_failed(exc.step, exc)

    def _hand_to_agent(self, agent_saves: AgentSaves, meta: CheckpointMeta, tensors: Mapping[str, np.ndarray]) -> None:
        try:
            agent_saves.save(meta, tensors, self._sharded)
        except (CheckpointError, OSError) as exc:
            self._agent_save_failed(meta.step, exc)

    def _agent_save_failed(self, step: int, exc: CheckpointError | OSError) -> None:
        """The agent will not save this rank's share of `step`: logged and reported, training goes on."""
        log.error("%s: the checkpoint of step %d was not handed to the agent: %s", self._where, step, exc)
        self._reporter.checkpoint_failed(step, failure_reason(exc))

    def _collect(self, block: bool) -> None:
        """Report the save in flight once it is over (at once when `block`, else only if it is)."""
        if self._in_flight is None:
            return
        meta, done = self._in_flight
        if not block and not done.done():
            return
        self._in_flight = None
        try:
            step_dir = done.result()
        except (CheckpointError, OSError) as exc:
            log.error("%s: the checkpoint of step %d failed: %s", self._where, meta.step, exc)
            self._reporter.checkpoint_failed(meta.step, failure_reason(exc))
            return
        if self._rank != 0:
            return
        log.info("%s: checkpoint of step %d committed in %s", self._where, meta.step, step_dir)
        self._reporter.checkpoint(meta.step, meta.consumed_samples, str(step_dir))

    def _check_reportable(self, directory: Path) -> None:
        """Refuse at start a directory whose commits the agent would refuse to hear about later."""
        probe = CheckpointReport(self._ctx.job, self._ctx.generation, self._rank, _PROBE_STEP, 0,
                                 str(directory / step_dir_name(_PROBE_STEP)))
        try:
            encode(probe)
        except MalformedProgress as exc:
            raise ValueError(f"checkpoint directory {str(directory)!r:.200} cannot be reported: {exc}") from None
